"""``kvxfer audit capacity``: the band of prompt lengths that pass the context check but cannot fit the KV pool.

Sample logs live in ``tests/data/logs/``: ``incident/`` (prefill pool 681,280 under a 1,048,576 context),
``fixed/`` (prefill pool 2,040,000), ``restarted-prefill.log`` (two startups, the latest safe) and
``mixed.log`` (role prefixes, thousands separators, noise, two unparseable lines, invalid UTF-8, binary
garbage). Edge cases that need odd sizes are written to ``tmp_path``.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvxfer.tools.audit.capacity import (
    MAX_LINE_BYTES,
    Band,
    CapacityLine,
    Unparseable,
    add_arguments,
    analyse,
    main,
    parse_line,
    parse_number,
)

LOGS = Path(__file__).parent / "data" / "logs"
INCIDENT = [LOGS / "incident" / "prefill0.log", LOGS / "incident" / "decode0.log"]
FIXED = [LOGS / "fixed" / "prefill0.log", LOGS / "fixed" / "decode0.log"]
MIXED = LOGS / "mixed.log"
LINE = ("[2026-10-26 12:00:00 DP0 TP0] max_total_num_tokens={pool}, chunked_prefill_size=8192, "
        "max_prefill_tokens=16384, max_running_requests=4096, context_len={context}, available_gpu_mem=12.34 GB")


@pytest.fixture(autouse=True)
def plain_console(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain text as on a pipe, even where the environment forces colour or a terminal."""
    for name in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        monkeypatch.delenv(name, raising=False)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str]:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    code = main(parser.parse_args([str(a) for a in argv]))
    return code, capsys.readouterr().out


def groups_by_node(paths: list[Path]) -> dict[str, tuple[str, int, int]]:
    return {g.node: (g.role, g.pool, g.context) for g in analyse(map(str, paths)).groups}


# ---------------------------------------------------------------------------------------- the incident


def test_incident_band_is_exact() -> None:
    report = analyse(map(str, INCIDENT))
    assert report.band == Band(681_281, 1_048_576)
    assert (report.band.tokens, report.band.text, report.band.describe()) == (
        367_296, "681,281-1,048,576", "681,281-1,048,576, 367,296 tokens, 35%")
    assert report.exit_status == 1 and report.verdict_word == "unsafe"
    assert [(s.name, s.smallest.pool) for s in report.roles] == [("prefill", 681_280), ("decode", 3_407_872)]


def test_incident_groups_per_scheduler() -> None:
    assert groups_by_node(INCIDENT) == {
        "prefill0.log DP0 TP0": ("prefill", 681_280, 1_048_576),
        "prefill0.log DP1 TP0": ("prefill", 681_280, 1_048_576),
        "decode0.log DP0 TP0": ("decode", 3_407_872, 1_048_576),
    }
    bands = {g.node: g.band for g in analyse(map(str, INCIDENT)).groups}
    assert bands["decode0.log DP0 TP0"] is None
    assert bands["prefill0.log DP1 TP0"] == Band(681_281, 1_048_576)


def test_incident_table_and_exit_status(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run_cli(capsys, *INCIDENT)
    assert code == 1
    assert "681,281-1,048,576" in out and "367,296" in out and "35%" in out
    verdict = out.rstrip("\n").splitlines()[-1]
    assert verdict.startswith("UNSAFE: prompts of 681,281-1,048,576 tokens (367,296 tokens, 35% of the "
                              "1,048,576-token context)")
    assert "681,280 tokens" in verdict


def test_incident_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run_cli(capsys, "--json", *INCIDENT)
    doc = json.loads(out)
    assert code == 1 == doc["exit_status"] and doc["verdict"] == "unsafe"
    assert {k: doc["band"][k] for k in ("first", "last", "tokens", "percent")} == {
        "first": 681_281, "last": 1_048_576, "tokens": 367_296, "percent": "35%"}
    assert doc["band"]["share"] == pytest.approx(367_296 / 1_048_576)
    assert doc["deployment"]["smallest_pool_tokens"] == 681_280
    assert {g["node"]: bool(g["band"]) for g in doc["groups"]} == {
        "prefill0.log DP0 TP0": True, "prefill0.log DP1 TP0": True, "decode0.log DP0 TP0": False}
    assert doc["unparseable"] == [] and doc["missing_files"] == []


def test_module_entry_point_reads_stdin() -> None:
    text = "prefill: " + LINE.format(pool="681,280", context="1,048,576") + "\n"
    done = subprocess.run([sys.executable, "-m", "kvxfer.tools.audit.capacity", "-"], input=text.encode(),
                          capture_output=True, timeout=60, cwd=Path(__file__).parent.parent)
    out = done.stdout.decode()
    assert done.returncode == 1, done.stderr.decode()
    assert "681,281-1,048,576" in out and "367,296" in out and "35%" in out and "<stdin>" in out


# ---------------------------------------------------------------------------------------- safe and mixed


def test_fixed_deployment_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run_cli(capsys, *FIXED)
    assert code == 0
    assert out.rstrip("\n").splitlines()[-1].startswith("SAFE: every KV pool holds the full context: smallest "
                                                        "pool 2,040,000 tokens")
    assert analyse(map(str, FIXED)).band is None


def test_latest_line_wins_and_disagreement_is_reported(capsys: pytest.CaptureFixture[str]) -> None:
    report = analyse([str(LOGS / "restarted-prefill.log")])
    (group,) = report.groups
    assert (group.pool, len(group.lines), [c.pool for c in group.disagreeing]) == (2_040_000, 2, [681_280])
    code, out = run_cli(capsys, LOGS / "restarted-prefill.log")
    assert code == 0 and "DISAGREE" in out and "681,280/1,048,576 at line 5" in out
    assert "lines disagree in 1 group (latest used)" in out


def test_role_prefixes_and_separators_in_mixed_file() -> None:
    assert groups_by_node([MIXED]) == {
        "prefill": ("prefill", 681_280, 1_048_576),
        "Prefill-B DP1 TP0 PP0": ("prefill", 681_280, 1_048_576),
        "decode-node-3 TP0": ("decode", 3_407_872, 1_048_576),
        "mixed.log TP0": ("unknown", 900_000, 1_048_576),
    }


def test_unparseable_lines_have_numbers_and_reasons(capsys: pytest.CaptureFixture[str]) -> None:
    report = analyse([str(MIXED)])
    assert [(u.line, u.reason.split(" (")[0]) for u in report.unparseable] == [
        (8, "max_total_num_tokens=12abc is not a whole number"), (9, "no context_len= field")]
    assert all(u.file == str(MIXED) for u in report.unparseable)
    code, out = run_cli(capsys, MIXED)
    assert code == 1  # the band is the finding; the unparseable lines are listed as well
    assert f"{MIXED}:8" in out and f"{MIXED}:9" in out and "no context_len= field" in out
    assert "2 capacity lines unparseable" in out


def test_unparseable_without_band_exits_two(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "decode1.log"
    log.write_text(LINE.format(pool=2_000_000, context=1_048_576) + "\n" + "max_total_num_tokens=-5, context_len=9\n")
    code, out = run_cli(capsys, log)
    assert code == 2 and "INCOMPLETE" in out and f"{log}:2" in out and "is negative" in out


# ---------------------------------------------------------------------------------------- parse_line


@pytest.mark.parametrize(("line", "file", "role", "node"), [
    (LINE, "logs/prefill0.log", "prefill", "prefill0.log DP0 TP0"),
    (LINE, "/var/log/sglang-DECODE-2.log", "decode", "sglang-DECODE-2.log DP0 TP0"),
    (LINE, "node7.log", "unknown", "node7.log DP0 TP0"),
    (LINE, "prefill-decode.log", "unknown", "prefill-decode.log DP0 TP0"),
    ("prefill-7: " + LINE, "decode3.log", "prefill", "prefill-7 DP0 TP0"),
    ("decode-node-3: " + LINE.replace("12:00:00 DP0 TP0", "12:00:00.123 TP0"), "x.log", "decode",
     "decode-node-3 TP0"),
    ("router.eu-1: " + LINE.replace(" DP0 TP0", ""), "x.log", "router.eu-1", "router.eu-1"),
    ("INFO:sglang.srt.managers.scheduler:" + LINE.replace("[2026-10-26 12:00:00 DP0 TP0] ", ""), "decode0.log",
     "decode", "decode0.log"),
    ("12:00:00 " + LINE, "prefill.log", "prefill", "prefill.log DP0 TP0"),
    ("2026-10-26T12:00:00: " + LINE, "prefill.log", "prefill", "prefill.log DP0 TP0"),
    ("some text: " + LINE, "a.log", "unknown", "a.log DP0 TP0"),
    (LINE.replace("DP0 TP0", "DP1 PP2 TP3 EP4"), "p.log", "unknown", "p.log DP1 PP2 TP3 EP4"),
])
def test_role_and_node(line: str, file: str, role: str, node: str) -> None:
    parsed = parse_line(line.format(pool=681_280, context=1_048_576), file=file, line_no=3)
    assert isinstance(parsed, CapacityLine)
    assert (parsed.role, parsed.node, parsed.pool, parsed.context, parsed.line) == (role, node, 681_280, 1_048_576, 3)


@pytest.mark.parametrize(("raw", "value"), [
    ("681280", 681_280), ("681,280", 681_280), ("681_280", 681_280), ("1,048,576", 1_048_576),
    ("1_048_576", 1_048_576), ("0", 0), ("2040000", 2_040_000),
])
def test_thousands_separators(raw: str, value: int) -> None:
    assert parse_number(raw) == value
    parsed = parse_line(LINE.format(pool=raw, context="1,048,576"), file="prefill.log")
    assert isinstance(parsed, CapacityLine) and (parsed.pool, parsed.context) == (value, 1_048_576)


@pytest.mark.parametrize(("line", "reason"), [
    ("max_total_num_tokens=681280, chunked_prefill_size=8192", "no context_len= field"),
    ("max_total_num_tokens=68,1280, context_len=1048576", "is not a whole number"),
    ("max_total_num_tokens=681280.5, context_len=1048576", "is not a whole number"),
    ("max_total_num_tokens=None, context_len=1048576", "is not a whole number"),
    ("max_total_num_tokens=, context_len=1048576", "has no value"),
    ("max_total_num_tokens=-1, context_len=1048576", "is negative"),
    ("max_total_num_tokens=681280, context_len=0", "zero-token context"),
    ("max_total_num_tokens=681280, context_len=" + "9" * 5000, "digits"),
    ("max_total_num_tokens=1, context_len=2, GB[TP1] max_total_num_tokens=1, context_len=2", "appears 2 times"),
    ("my_max_total_num_tokens=5, context_len=9", "no max_total_num_tokens= field"),
    ("max_total_num_tokens=x, context_len=y", "context_len=y is not a whole number"),
])
def test_unparseable_reasons(line: str, reason: str) -> None:
    parsed = parse_line(line, file="p.log", line_no=7)
    assert isinstance(parsed, Unparseable) and parsed.line == 7 and reason in parsed.reason


def test_noise_is_ignored() -> None:
    assert parse_line("[2026-10-26 11:59:55 TP0] KV Cache is allocated. #tokens: 681280") is None
    assert parse_line("") is None


@given(st.integers(min_value=0, max_value=10**15))
def test_separator_round_trip(n: int) -> None:
    assert parse_number(f"{n:,}") == parse_number(f"{n:_}") == parse_number(str(n)) == n


@given(st.text())
def test_parse_line_never_raises(text: str) -> None:
    parsed = parse_line("x: max_total_num_tokens=" + text)
    assert isinstance(parsed, CapacityLine | Unparseable)


@given(st.integers(min_value=0, max_value=10**9), st.integers(min_value=1, max_value=10**9))
def test_band_arithmetic(pool: int, context: int) -> None:
    band = Band.between(pool, context)
    if pool >= context:
        assert band is None
    else:
        assert band is not None and (band.first, band.last, band.tokens) == (pool + 1, context, context - pool)


# ---------------------------------------------------------------------------------------- odd input


def test_missing_file_with_band_still_exits_one(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    missing = tmp_path / "gone.log"
    code, out = run_cli(capsys, missing, *INCIDENT)
    assert code == 1 and f"not read: {missing}: No such file or directory" in out and "367,296" in out


def test_missing_file_without_band_exits_two(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out = run_cli(capsys, "--json", *FIXED, tmp_path / "gone.log", tmp_path)
    doc = json.loads(out)
    assert code == 2 == doc["exit_status"] and doc["verdict"] == "incomplete"
    assert [m["path"] for m in doc["missing_files"]] == [str(tmp_path / "gone.log"), str(tmp_path)]
    assert len(doc["groups"]) == 3


def test_nothing_parsed_exits_two(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    empty = tmp_path / "prefill-empty.log"
    empty.write_bytes(b"")
    code, out = run_cli(capsys, empty, tmp_path / "gone.log")
    assert code == 2
    assert "NO DATA: no parseable max_total_num_tokens= line in 1 file read (1 file not read)" in out


def test_binary_garbage_does_not_crash(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    junk = tmp_path / "core.bin"
    junk.write_bytes(random.Random(0).randbytes(1 << 20))
    code, out = run_cli(capsys, junk)
    assert code == 2 and "NO DATA" in out
    code, out = run_cli(capsys, junk, *INCIDENT, MIXED)
    assert code == 1 and "\x1b[31m" not in out


def test_control_characters_are_escaped_in_reports(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    log = tmp_path / "p.log"
    log.write_bytes(b"\x1b[2Jevil: max_total_num_tokens=\x1b]0;x\x07, context_len=1\xff\n")
    code, out = run_cli(capsys, log)
    assert code == 2 and "\\x1b" in out
    assert "\x1b[2J" not in out and "\x1b]0;" not in out and "\x07" not in out


def test_huge_lines(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    log = tmp_path / "prefill9.log"
    filler = b"x" * (3 * MAX_LINE_BYTES)
    log.write_bytes(b"".join([
        filler + b"\n",  # 1: long noise
        filler + b" [TP0] max_total_num_tokens=1, context_len=2\n",  # 2: key beyond what is kept
        filler[: MAX_LINE_BYTES - 10] + b"max_total_num_tokens=1, context_len=2\n",  # 3: key across the cut
        LINE.format(pool=681_280, context=1_048_576).encode() + b"\n",  # 4: the real one
        filler,  # 5: unterminated
    ]))
    report = analyse([str(log)])
    assert [(u.line, "longer than" in u.reason) for u in report.unparseable] == [(2, True), (3, True)]
    assert [(g.node, g.latest.line, g.pool) for g in report.groups] == [("prefill9.log DP0 TP0", 4, 681_280)]
    assert report.files[0].lines == 5 and report.exit_status == 1


def test_invalid_utf8_and_crlf_lines_parse() -> None:
    data = b"\xef\xbb\xbfdecode: " + LINE.format(pool=4_000_000, context=1_048_576).encode() + b" \xff\xc3\x28\r\n"
    report = analyse(["-"], stdin=io.BytesIO(data))
    assert [(g.role, g.node, g.pool) for g in report.groups] == [("decode", "decode DP0 TP0", 4_000_000)]
    assert report.exit_status == 0 and report.files[0].path == "<stdin>"


def test_mismatched_contexts_count_as_a_band(tmp_path: Path) -> None:
    prefill, decode = tmp_path / "prefill.log", tmp_path / "decode.log"
    prefill.write_text(LINE.format(pool=600_000, context=524_288) + "\n")
    decode.write_text(LINE.format(pool=2_000_000, context=1_048_576) + "\n")
    report = analyse([str(prefill), str(decode)])
    assert all(g.band is None for g in report.groups)
    assert report.band == Band(600_001, 1_048_576) and report.exit_status == 1
    assert "contexts differ between groups" in report.verdict
