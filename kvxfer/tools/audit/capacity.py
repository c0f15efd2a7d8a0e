"""``kvxfer audit capacity LOG...``: the prompt lengths a deployment accepts but cannot hold.

SGLang's scheduler prints one startup line per scheduler with its KV-cache pool and its context::

    [2026-10-26 12:00:00 DP0 TP0] max_total_num_tokens=681280, ..., context_len=1048576, ...

A prompt longer than the pool but no longer than the context passes the context check and then cannot
fit the pool. This module owns finding that band in logs: reading them (files or ``-`` for stdin),
parsing every line that contains ``max_total_num_tokens=``, grouping by (role, node), computing the
bands, and rendering them as a rich table or JSON. It never changes the logs or the deployment.

Invariants:

* a band is the closed range ``pool + 1 .. context``; it exists exactly when ``pool < context``, its
  width is ``context - pool`` tokens and its share is ``width / context``;
* every line containing ``max_total_num_tokens=`` ends up either parsed into a :class:`CapacityLine` or
  reported in :class:`Unparseable` with its file, line number and reason; nothing else is reported,
  and no line is ever half-parsed (a line over :data:`MAX_LINE_BYTES` is reported, not parsed);
* a group's figures are those of its latest line (the last one read: files in the order given, lines in
  file order); earlier lines that disagree are kept and named in the report;
* the deployment-wide band (smallest pool of all groups against the largest context) contains every
  group's band, so it decides the verdict;
* reading never raises on content: bytes are decoded as UTF-8 with ``errors="replace"``, lines are split
  on ``\\n`` only (so numbers match ``grep -n``), files that cannot be opened are reported and skipped.

Role: an explicit ``ROLE:`` prefix at the start of the line (a name of letters, digits, ``-``, ``_``,
``.``, with at least one letter, not a date and not a log level such as ``INFO``), normalised to
``prefill`` or ``decode`` when it contains exactly one of those words, otherwise kept as written; else
``prefill`` or ``decode`` when the file name contains exactly one of them; else ``unknown``.
Node: the prefix name, or else the file name without directories, followed by the rank tags from the
bracketed log prefix (``DP1 TP0``...), e.g. ``prefill0.log DP1 TP0`` or ``decode-node-3 TP0``.

Numbers may be written ``681280``, ``681,280`` or ``681_280`` (groups of three); anything else is
unparseable, as are negative values, a zero context, missing fields, and a field written twice on one
line (two schedulers' lines interleaved).

Exit status: 1 when a band exists (whatever else went wrong: the band is the finding); 2 when no band was
found but the audit is incomplete: a file could not be read, a capacity line could not be parsed, or no
capacity line was parsed at all; 0 when at least one group was parsed, no band exists and nothing was
missed. ``--json`` prints the same report as one JSON document on stdout instead of the table.
"""

from __future__ import annotations

import argparse
import errno
import io
import json
import math
import os
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import IO, Any

KEY = "max_total_num_tokens="
KEY_BYTES = KEY.encode()
MAX_LINE_BYTES = 64 * 1024
"""Longer lines are consumed but not parsed: a scheduler line is about 200 bytes."""
MAX_DIGITS = 18
STDIN_LABEL = "<stdin>"
HELP = "find prompt lengths that pass the context check but do not fit a scheduler's KV-cache pool"
DESCRIPTION = (
    "Read SGLang scheduler logs, compare each scheduler's KV-cache pool (max_total_num_tokens) with its "
    "context (context_len) and report the band of prompt lengths that pass the context check but cannot fit. "
    "Exit status: 1 band found, 0 every pool holds the context, 2 nothing parsed or the audit is incomplete "
    "(missing file, unparseable capacity line)."
)
LOG_LEVELS = frozenset({"debug", "info", "warn", "warning", "error", "critical", "fatal", "trace"})
ROLE_ORDER = {"prefill": 0, "decode": 1, "unknown": 3}

_ROLE_PREFIX = re.compile(r"\s*([A-Za-z0-9._-]+):")
_DATE = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")
_BRACKET = re.compile(r"\[([^\[\]]*)\]")
_RANK = re.compile(r"[A-Z][A-Z_]*[0-9]+")
_NUMBER = re.compile(r"[0-9]+|[0-9]{1,3}(?:,[0-9]{3})+|[0-9]{1,3}(?:_[0-9]{3})+")
_VALUE = r"((?:[^\s,;)\]}]|,(?=[0-9]))*)"  # a comma followed by a digit is a thousands separator
_FIELDS = {
    name: re.compile(rf"(?<![A-Za-z0-9_]){name}[ \t]*=[ \t]*{_VALUE}") for name in ("max_total_num_tokens", "context_len")
}


class _Unparseable(ValueError):
    """Raised inside the parser with the reason a capacity line cannot be read."""


# ---------------------------------------------------------------------------------------------- model


@dataclass(frozen=True)
class Band:
    """Prompt lengths ``first..last`` (inclusive) that pass a ``last``-token context check but exceed the pool."""

    first: int
    last: int

    @classmethod
    def between(cls, pool: int, context: int) -> Band | None:
        return cls(pool + 1, context) if pool < context else None

    @property
    def tokens(self) -> int:
        return self.last - self.first + 1

    @property
    def share(self) -> float:
        return self.tokens / self.last

    @property
    def text(self) -> str:
        return f"{self.first:,}-{self.last:,}"

    def describe(self) -> str:
        return f"{self.text}, {self.tokens:,} tokens, {percent(self.share)}"

    def to_dict(self) -> dict[str, Any]:
        return {"first": self.first, "last": self.last, "tokens": self.tokens, "share": self.share,
                "percent": percent(self.share), "text": self.describe()}


@dataclass(frozen=True)
class CapacityLine:
    """One parsed scheduler line: where it was read, the (role, node) it belongs to, its pool and context in tokens."""

    file: str
    line: int
    role: str
    node: str
    pool: int
    context: int

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.file, "line": self.line, "pool_tokens": self.pool, "context_tokens": self.context}


@dataclass(frozen=True)
class Unparseable:
    """A line containing ``max_total_num_tokens=`` that could not be parsed, with the reason and an excerpt."""

    file: str
    line: int
    reason: str
    text: str

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.file, "line": self.line, "reason": self.reason, "text": self.text}


@dataclass(frozen=True)
class MissingFile:
    """A path that could not be opened or read to the end, with the OS's reason; the audit is then incomplete."""

    path: str
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "reason": self.reason}


@dataclass
class FileRead:
    """How much of one input was read: lines in total and lines containing ``max_total_num_tokens=``."""

    path: str
    lines: int = 0
    capacity_lines: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "lines": self.lines, "capacity_lines": self.capacity_lines}


@dataclass
class Group:
    """Every capacity line of one (role, node); the latest decides."""

    role: str
    node: str
    lines: list[CapacityLine] = field(default_factory=list)

    @property
    def latest(self) -> CapacityLine:
        return self.lines[-1]

    @property
    def pool(self) -> int:
        return self.latest.pool

    @property
    def context(self) -> int:
        return self.latest.context

    @property
    def band(self) -> Band | None:
        return Band.between(self.pool, self.context)

    @property
    def disagreeing(self) -> list[CapacityLine]:
        """Earlier lines whose pool or context differ from the latest."""
        return [c for c in self.lines[:-1] if (c.pool, c.context) != (self.pool, self.context)]

    @property
    def label(self) -> str:
        return f"{self.role} {self.node}"

    def note(self) -> str:
        if not self.disagreeing:
            return "" if len(self.lines) == 1 else f"{len(self.lines)} lines agree"
        earlier = "; ".join(f"{c.pool:,}/{c.context:,} at line {c.line}" for c in self.disagreeing)
        return f"{len(self.lines)} lines DISAGREE, latest used; earlier pool/context: {earlier}"

    def to_dict(self) -> dict[str, Any]:
        return {"role": self.role, "node": self.node, "pool_tokens": self.pool, "context_tokens": self.context,
                "band": self.band.to_dict() if self.band else None, "source": self.latest.to_dict(),
                "disagree": bool(self.disagreeing), "lines": [c.to_dict() for c in self.lines]}


@dataclass(frozen=True)
class Summary:
    """Smallest pool against largest context over some groups (one role, or the whole deployment)."""

    name: str
    groups: tuple[Group, ...]

    @property
    def smallest(self) -> Group:
        return min(self.groups, key=lambda g: g.pool)

    @property
    def widest(self) -> Group:
        return max(self.groups, key=lambda g: g.context)

    @property
    def band(self) -> Band | None:
        return Band.between(self.smallest.pool, self.widest.context)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "groups": len(self.groups),
                "smallest_pool_tokens": self.smallest.pool, "smallest_pool_group": self.smallest.label,
                "largest_context_tokens": self.widest.context, "largest_context_group": self.widest.label,
                "band": self.band.to_dict() if self.band else None}


@dataclass
class Report:
    """Everything one audit found: the inputs read, the (role, node) groups, and what was unparseable or missing."""

    files: list[FileRead] = field(default_factory=list)
    groups: list[Group] = field(default_factory=list)
    unparseable: list[Unparseable] = field(default_factory=list)
    missing: list[MissingFile] = field(default_factory=list)

    @property
    def roles(self) -> list[Summary]:
        names = sorted({g.role for g in self.groups}, key=role_sort_key)
        return [Summary(n, tuple(g for g in self.groups if g.role == n)) for n in names]

    @property
    def deployment(self) -> Summary | None:
        return Summary("deployment", tuple(self.groups)) if self.groups else None

    @property
    def band(self) -> Band | None:
        return self.deployment.band if self.deployment else None

    @property
    def incomplete(self) -> bool:
        return bool(self.missing or self.unparseable or not self.groups)

    @property
    def exit_status(self) -> int:
        if self.band:
            return 1
        return 2 if self.incomplete else 0

    @property
    def verdict_word(self) -> str:
        if self.band:
            return "unsafe"
        if not self.groups:
            return "no-data"
        return "incomplete" if self.incomplete else "safe"

    @property
    def verdict(self) -> str:
        text = {"unsafe": _verdict_unsafe, "safe": _verdict_safe, "incomplete": _verdict_incomplete,
                "no-data": _verdict_no_data}[self.verdict_word](self)
        disagree = sum(1 for g in self.groups if g.disagreeing)
        return text + (f"; lines disagree in {_count(disagree, 'group')} (latest used)" if disagree else "")

    def to_dict(self) -> dict[str, Any]:
        deployment = self.deployment
        return {
            "tool": "kvxfer audit capacity", "verdict": self.verdict_word, "message": self.verdict,
            "exit_status": self.exit_status,
            "band": self.band.to_dict() if self.band else None,
            "deployment": deployment.to_dict() if deployment else None,
            "roles": [s.to_dict() for s in self.roles],
            "groups": [g.to_dict() for g in self.groups],
            "unparseable": [u.to_dict() for u in self.unparseable],
            "missing_files": [m.to_dict() for m in self.missing],
            "files": [f.to_dict() for f in self.files],
        }


# -------------------------------------------------------------------------------------------- parsing


def parse_line(text: str, *, file: str = "<input>", line_no: int = 0) -> CapacityLine | Unparseable | None:
    """One log line: ``None`` when it has no ``max_total_num_tokens=``, else the parsed line or why not."""
    if KEY not in text:
        return None
    text = text.rstrip("\r\n")
    prefix, body = split_role_prefix(text)
    role = role_from_prefix(prefix) if prefix else role_from_file(file)
    node = " ".join(part for part in (prefix or _basename(file), rank_tag(body)) if part)
    try:
        pool, context = _capacity(body)
    except _Unparseable as exc:
        return Unparseable(file, line_no, str(exc), excerpt(text))
    return CapacityLine(file, line_no, role, node, pool, context)


def split_role_prefix(text: str) -> tuple[str | None, str]:
    """``("decode-node-3", "[... TP0] max_total...")`` for ``decode-node-3: [... TP0] max_total...``."""
    match = _ROLE_PREFIX.match(text)
    if not match or not _is_role_name(match.group(1)):
        return None, text
    return match.group(1), text[match.end():]


def _is_role_name(name: str) -> bool:
    return any(c.isalpha() for c in name) and not _DATE.match(name) and name.lower() not in LOG_LEVELS


def role_from_prefix(name: str) -> str:
    return _known_role(name) or name


def role_from_file(path: str) -> str:
    return _known_role(_basename(path)) or "unknown"


def _known_role(name: str) -> str | None:
    lowered = name.lower()
    found = [role for role in ("prefill", "decode") if role in lowered]
    return found[0] if len(found) == 1 else None


def rank_tag(body: str) -> str:
    """The rank tags (``DP1 TP0 PP0``) of the first bracket before the key, or ``""``."""
    match = _BRACKET.search(body, 0, max(0, body.find(KEY)))
    if not match:
        return ""
    return " ".join(t for t in match.group(1).split() if _RANK.fullmatch(t))


def _capacity(body: str) -> tuple[int, int]:
    reasons: list[str] = []
    values: list[int] = []
    for name in ("max_total_num_tokens", "context_len"):
        try:
            values.append(_field(body, name))
        except _Unparseable as exc:
            reasons.append(str(exc))
    if not reasons and values[1] == 0:
        reasons.append("context_len=0: no model has a zero-token context")
    if reasons:
        raise _Unparseable("; ".join(reasons))
    return values[0], values[1]


def _field(body: str, name: str) -> int:
    found = _FIELDS[name].findall(body)
    if not found:
        raise _Unparseable(f"no {name}= field")
    if len(found) > 1:
        raise _Unparseable(f"{name}= appears {len(found)} times (interleaved log lines?)")
    return parse_number(found[0], name)


def parse_number(raw: str, name: str = "value") -> int:
    """``681280``, ``681,280`` or ``681_280`` as an int; raises ``ValueError`` with the reason otherwise."""
    shown = excerpt(raw, 40)
    if not raw:
        raise _Unparseable(f"{name}= has no value")
    if raw[0] == "-" and _NUMBER.fullmatch(raw[1:]):
        raise _Unparseable(f"{name}={shown} is negative")
    if not _NUMBER.fullmatch(raw):
        raise _Unparseable(f"{name}={shown} is not a whole number (digits, optionally grouped as 1,234 or 1_234)")
    digits = raw.replace(",", "").replace("_", "")
    if len(digits) > MAX_DIGITS:
        raise _Unparseable(f"{name}= has {len(digits)} digits, more than any real pool or context")
    return int(digits)


def excerpt(text: str, limit: int = 160) -> str:
    """Printable, bounded text for reports: control and other unprintable characters become escapes."""
    cut = text[:limit]
    safe = "".join(c if c.isprintable() else c.encode("unicode_escape", "backslashreplace").decode("ascii")
                   for c in cut)
    return safe + ("..." if len(text) > limit else "")


def _basename(path: str) -> str:
    return os.path.basename(path) or path


# -------------------------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class RawLine:
    """One input line as read: its 1-based number, decoded text (at most ``MAX_LINE_BYTES``), whether the rest
    was cut off, and whether ``max_total_num_tokens=`` appears anywhere in the full line."""

    number: int
    text: str
    truncated: bool
    has_key: bool


def iter_lines(stream: IO[bytes]) -> Iterator[RawLine]:
    """Lines split on ``\\n`` only, decoded leniently; at most :data:`MAX_LINE_BYTES` kept per line."""
    number = 0
    while head := stream.readline(MAX_LINE_BYTES):
        number += 1
        rest, key_in_rest = (0, False) if head.endswith(b"\n") else _skip_rest(stream, head[-len(KEY_BYTES):])
        text = head.decode("utf-8", errors="replace").rstrip("\r\n")
        if number == 1:
            text = text.lstrip("\ufeff")
        yield RawLine(number, text, rest > 0, key_in_rest or KEY_BYTES in head)


def _skip_rest(stream: IO[bytes], carry: bytes) -> tuple[int, bool]:
    """Consume the rest of an over-long line: (bytes skipped, whether the key occurs in them)."""
    skipped, found = 0, False
    while chunk := stream.readline(MAX_LINE_BYTES):
        skipped += len(chunk)
        found = found or KEY_BYTES in carry + chunk
        if chunk.endswith(b"\n"):
            break
        carry = chunk[-len(KEY_BYTES):]
    return skipped, found


def scan(label: str, stream: IO[bytes], report: Report, groups: dict[tuple[str, str], Group]) -> None:
    read = FileRead(label)
    report.files.append(read)
    for raw in iter_lines(stream):
        read.lines = raw.number
        if not raw.has_key:
            continue
        read.capacity_lines += 1
        parsed = _parse_raw(raw, label)
        if isinstance(parsed, CapacityLine):
            groups.setdefault((parsed.role, parsed.node), Group(parsed.role, parsed.node)).lines.append(parsed)
        elif parsed is not None:
            report.unparseable.append(parsed)


def _parse_raw(raw: RawLine, label: str) -> CapacityLine | Unparseable | None:
    if raw.truncated:
        reason = f"line is longer than {MAX_LINE_BYTES:,} bytes; a scheduler line is far shorter, so it is not parsed"
        return Unparseable(label, raw.number, reason, excerpt(raw.text))
    if KEY not in raw.text:  # defensive: the decoder never alters ASCII, so the key survives decoding
        return Unparseable(label, raw.number, f"{KEY} is not readable as text on this line", excerpt(raw.text))
    return parse_line(raw.text, file=label, line_no=raw.number)


def analyse(paths: Iterable[str], *, stdin: IO[bytes] | None = None) -> Report:
    """Read every path (``-``: ``stdin``, default the process's) and build the report; never raises on input."""
    report = Report()
    groups: dict[tuple[str, str], Group] = {}
    for path in paths:
        label = STDIN_LABEL if path == "-" else path
        opened = len(report.files)
        try:
            _read_path(path, label, stdin, report, groups)
        except OSError as exc:
            reason = exc.strerror or str(exc) or type(exc).__name__
            if len(report.files) > opened:
                reason = f"read failed after line {report.files[opened].lines}: {reason}"
            report.missing.append(MissingFile(label, reason))
    report.groups = sorted(groups.values(), key=lambda g: (role_sort_key(g.role), natural_key(g.node)))
    return report


def _read_path(path: str, label: str, stdin: IO[bytes] | None, report: Report,
               groups: dict[tuple[str, str], Group]) -> None:
    if path == "-":
        scan(label, stdin if stdin is not None else _stdin_bytes(), report, groups)
        return
    with open(path, "rb") as stream:
        scan(label, stream, report, groups)


def _stdin_bytes() -> IO[bytes]:
    if sys.stdin is None:
        raise OSError(errno.EBADF, "stdin is closed")
    buffer = getattr(sys.stdin, "buffer", None)
    return buffer if buffer is not None else io.BytesIO(sys.stdin.read().encode("utf-8", "replace"))


def role_sort_key(role: str) -> tuple[int, str]:
    return ROLE_ORDER.get(role, 2), role


def natural_key(text: str) -> list[Any]:
    parts = re.split(r"([0-9]+)", text.casefold())
    return [(0, int(part), "") if part.isascii() and part.isdigit() else (1, 0, part) for part in parts if part]


# -------------------------------------------------------------------------------------------- verdict


def percent(share: float) -> str:
    value = math.floor(share * 100 + 0.5)
    if value == 0 and share > 0:
        return "<1%"
    if value == 100 and share < 1:
        return ">99%"
    return f"{value}%"


def _problems(report: Report) -> str:
    parts = []
    if report.missing:
        parts.append(_count(len(report.missing), "file") + " not read")
    if report.unparseable:
        parts.append(_count(len(report.unparseable), "capacity line") + " unparseable")
    return " and ".join(parts)


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def _verdict_unsafe(report: Report) -> str:
    deployment = report.deployment
    assert deployment is not None and report.band is not None
    band, smallest, widest = report.band, deployment.smallest, deployment.widest
    bad = sum(1 for g in report.groups if g.band)
    text = (f"UNSAFE: prompts of {band.text} tokens ({band.tokens:,} tokens, {percent(band.share)} of the "
            f"{widest.context:,}-token context) pass the context check but do not fit the smallest KV pool "
            f"({smallest.pool:,} tokens, {smallest.label}); {_count(bad, 'group')} of {len(report.groups)} "
            f"with pool < context")
    if not bad:
        text += " (contexts differ between groups)"
    problems = _problems(report)
    return text + (f"; also {problems}" if problems else "")


def _verdict_safe(report: Report) -> str:
    deployment = report.deployment
    assert deployment is not None
    return (f"SAFE: every KV pool holds the full context: smallest pool {deployment.smallest.pool:,} tokens "
            f"({deployment.smallest.label}) >= largest context {deployment.widest.context:,} tokens, "
            f"{_count(len(report.groups), 'group')}")


def _verdict_incomplete(report: Report) -> str:
    return (f"INCOMPLETE: no unsafe band in {_count(len(report.groups), 'group')} read, but {_problems(report)}; "
            "the audit does not cover them")


def _verdict_no_data(report: Report) -> str:
    problems = _problems(report)
    return (f"NO DATA: no parseable {KEY} line in {_count(len(report.files), 'file')} read"
            + (f" ({problems})" if problems else "") + "; nothing was audited")


# ------------------------------------------------------------------------------------------ rendering


def render(report: Report, console: Any) -> None:
    """The tables and the one-line verdict on a rich console."""
    from rich.text import Text

    console.print(f"kvxfer audit capacity: {_count(len(report.files), 'file')} read, "
                  f"{_count(sum(len(g.lines) for g in report.groups), 'scheduler line')} parsed", highlight=False)
    if report.groups:
        console.print(groups_table(report))
        console.print(summary_table(report))
    if report.unparseable:
        console.print(unparseable_table(report))
    for missing in report.missing:
        console.print(Text(f"not read: {excerpt(missing.path)}: {missing.reason}", style="red"))
    style = {"unsafe": "bold red", "safe": "bold green"}.get(report.verdict_word, "bold yellow")
    console.print(Text(report.verdict, style=style), soft_wrap=True)


def groups_table(report: Report) -> Any:
    from rich.table import Table
    from rich.text import Text

    table = Table(title="KV pool against context, per scheduler (latest line of each)", title_justify="left")
    for name, justify in (("role", "left"), ("node", "left"), ("pool tokens", "right"), ("context", "right"),
                          ("unsafe prompt band", "right"), ("band tokens", "right"), ("share", "right")):
        table.add_column(name, justify=justify, no_wrap=name not in ("node",), overflow="fold")
    table.add_column("source", overflow="fold")
    notes = any(g.note() for g in report.groups)
    if notes:
        table.add_column("note", overflow="fold")
    for g in report.groups:
        table.add_row(Text(g.role), Text(excerpt(g.node)), f"{g.pool:,}", f"{g.context:,}", *_band_cells(g.band),
                      Text(f"{excerpt(g.latest.file)}:{g.latest.line}"),
                      *([Text(g.note(), style="yellow")] if notes else []))
    return table


def summary_table(report: Report) -> Any:
    from rich.table import Table
    from rich.text import Text

    table = Table(title="Smallest pool against largest context, per role and deployment-wide", title_justify="left")
    for name, justify in (("scope", "left"), ("groups", "right"), ("smallest pool", "right"), ("at", "left"),
                          ("largest context", "right"), ("unsafe prompt band", "right"), ("band tokens", "right"),
                          ("share", "right")):
        table.add_column(name, justify=justify, no_wrap=name != "at", overflow="fold")
    rows = [*report.roles, *([report.deployment] if report.deployment else [])]
    for i, s in enumerate(rows):
        last = i == len(rows) - 1
        table.add_row(Text(s.name, style="bold" if last else ""), str(len(s.groups)), f"{s.smallest.pool:,}",
                      Text(excerpt(s.smallest.label)), f"{s.widest.context:,}", *_band_cells(s.band),
                      end_section=i == len(rows) - 2)
    return table


def unparseable_table(report: Report) -> Any:
    from rich.table import Table
    from rich.text import Text

    table = Table(title="Unparseable capacity lines (not audited)", title_justify="left")
    table.add_column("file:line", overflow="fold")
    table.add_column("reason", overflow="fold")
    table.add_column("text", overflow="fold")
    for u in report.unparseable:
        table.add_row(Text(f"{excerpt(u.file)}:{u.line}"), Text(u.reason, style="red"), Text(excerpt(u.text, 100)))
    return table


def _band_cells(band: Band | None) -> tuple[Any, ...]:
    from rich.text import Text

    if band is None:
        return Text("none", style="green"), "0", "0%"
    return Text(band.text, style="bold red"), f"{band.tokens:,}", percent(band.share)


def _console() -> Any:
    from rich.console import Console

    console = Console(highlight=False)
    if not console.is_terminal:  # a pipe or file has no width: do not fold numbers at 80 columns
        console.width = max(console.width, 200)
    return console


# ------------------------------------------------------------------------------------------------ CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("logs", nargs="+", metavar="LOG",
                        help="scheduler log files (or pasted startup lines, optionally 'ROLE: ...'); - reads stdin")
    parser.add_argument("--json", action="store_true",
                        help="print the report as one JSON document on stdout instead of the tables")


def check(args: argparse.Namespace) -> None:
    """Before reading (``kvxfer audit capacity``): at least one LOG can be opened. A report with some
    files missing is still a report (it names them); one with every file missing is a mistake."""
    from ...errors import ConfigError

    if "-" in args.logs:
        return
    problems = []
    for path in args.logs:
        if os.path.isdir(path):
            problems.append(f"{path}: is a directory")
        elif not os.access(path, os.R_OK):
            problems.append(f"{path}: {'cannot be read' if os.path.exists(path) else 'No such file or directory'}")
        else:
            return
    raise ConfigError(f"LOG: no log file could be read ({'; '.join(problems)})")


def main(args: argparse.Namespace) -> int:
    report = analyse(args.logs)
    if args.json:
        sys.stdout.write(json.dumps(report.to_dict(), indent=2) + "\n")
    else:
        render(report, _console())
    return report.exit_status


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvxfer.tools.audit.capacity", description=DESCRIPTION)
    add_arguments(parser)
    return parser


if __name__ == "__main__":
    sys.exit(main(build_parser().parse_args()))
