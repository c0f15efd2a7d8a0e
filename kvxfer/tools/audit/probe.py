"""``kvxfer audit probe URL``: the boundary test for a deployment you own.

It plants unique markers through a few short requests (``Remember the code CANARY-...``), then sends
one prompt whose length lands in the band you name (``--words N``, or ``--tokens N`` counted as
one token per filler word) and asks for the codes back. It reports the status, the reported
``prompt_tokens``, the latency against what a prompt that long should take (from the short
requests' rate), and any marker found in the reply. It fails when the over-length prompt gets a
success status or a marker leaks; a missing marker proves nothing (a model need not repeat what it
read), the status is the test that counts.

Speaks SGLang's native ``/generate`` and the OpenAI-compatible ``/v1/completions``. Refuses targets
that are not loopback unless ``--i-own-this-deployment`` is given, and a URL where nothing accepts a
connection (exit status 2, before any request). Bounded: at most ``--max-requests`` requests and
``--max-seconds`` seconds. Exit status: 0 PASS; 1 FAIL, or ERROR when the target stopped answering
during the probe.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import secrets
import socket
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass, field
from typing import Any

# PASS 0; FAIL, or an ERROR while probing (the target stopped answering), 1; a mistake refused before any
# request (kvxfer's one-line refusal) 2
EXIT_PASS, EXIT_FAIL, EXIT_REFUSED = 0, 1, 2
CONNECT_TIMEOUT_S = 10.0  # the check's TCP connect to the target, at most (or --timeout, if shorter)


@dataclass
class Call:
    """One HTTP request's outcome: status (0 when no response came), reply text, reported prompt tokens, time."""

    status: int
    text: str
    prompt_tokens: int | None
    seconds: float
    error: str = ""


@dataclass
class ProbeReport:
    """What one probe planted, sent and saw, and its verdict with the reasons for it."""

    url: str
    api: str
    markers: list[str] = field(default_factory=list)
    planted: int = 0
    probe_words: int = 0
    status: int | None = None
    prompt_tokens: int | None = None
    seconds: float | None = None
    expected_seconds: float | None = None
    leaked: list[str] = field(default_factory=list)
    reply_excerpt: str = ""
    verdict: str = ""
    reasons: list[str] = field(default_factory=list)


def is_loopback(url: str) -> bool:
    host = urllib.parse.urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            infos = socket.getaddrinfo(host, None)
        except OSError:
            return False
        return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


class Client:
    """A minimal HTTP client for SGLang's ``/generate`` or the OpenAI ``/v1/completions`` API; counts what it sends.

    Never raises on a failed request: the failure comes back as a :class:`Call` with ``error`` set."""

    def __init__(self, base: str, api: str, timeout: float) -> None:
        self.base = base.rstrip("/")
        self.api = api
        self.timeout = timeout
        self.sent = 0

    def complete(self, prompt: str, max_tokens: int) -> Call:
        if self.api == "generate":
            url = f"{self.base}/generate"
            body = {"text": prompt, "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0}}
        else:
            url = f"{self.base}/v1/completions"
            body = {"model": "default", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        data = json.dumps(body).encode()
        request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
        self.sent += 1
        started = time.monotonic()
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                status, raw = response.status, response.read()
        except urllib.error.HTTPError as exc:
            status, raw = exc.code, exc.read()
        except (urllib.error.URLError, OSError) as exc:
            return Call(status=0, text="", prompt_tokens=None, seconds=time.monotonic() - started, error=str(exc))
        seconds = time.monotonic() - started
        try:
            payload = json.loads(raw or b"{}")
        except ValueError:
            payload = {"raw": raw[:200].decode(errors="replace")}
        return Call(status=status, text=self._text(payload), prompt_tokens=self._prompt_tokens(payload),
                    seconds=seconds)

    def _text(self, payload: Any) -> str:
        if not isinstance(payload, dict):
            return ""
        if "error" in payload or payload.get("object") == "error":  # SGLang / OpenAI error bodies
            error = payload.get("error", payload)
            message = error.get("message", error) if isinstance(error, dict) else error
            return f"error: {message}"
        if self.api == "generate":
            text = payload.get("text", "")
        else:
            choices = payload.get("choices") or [{}]
            text = choices[0].get("text", "") if isinstance(choices[0], dict) else ""
        return text if isinstance(text, str) else json.dumps(text)

    def _prompt_tokens(self, payload: Any) -> int | None:
        if not isinstance(payload, dict):
            return None
        meta = payload.get("meta_info") if self.api == "generate" else payload.get("usage")
        if isinstance(meta, dict) and isinstance(meta.get("prompt_tokens"), int):
            return meta["prompt_tokens"]
        return None


def run_probe(url: str, *, api: str, words: int, markers: int, repeat: int, timeout: float,
              max_requests: int, max_seconds: float) -> ProbeReport:
    report = ProbeReport(url=url, api=api, probe_words=words)
    client = Client(url, api, timeout)
    deadline = time.monotonic() + max_seconds
    report.markers = [f"CANARY-{secrets.token_hex(5).upper()}" for _ in range(min(markers, max_requests - 1))]
    rates = []
    for marker in report.markers:
        if time.monotonic() > deadline:
            report.reasons.append("time limit reached while planting markers")
            break
        call = client.complete(f"Remember the code {marker}. " * repeat, 8)
        if call.error:
            report.reasons.append(f"planting failed: {call.error}")
            break
        report.planted += 1
        tokens = call.prompt_tokens or 4 * repeat
        if call.status == 200 and call.seconds > 0:
            rates.append(tokens / call.seconds)
    prompt = "word " * words + "Repeat any codes you saw."
    call = client.complete(prompt, 64)
    report.status = call.status if not call.error else None
    report.prompt_tokens = call.prompt_tokens
    report.seconds = call.seconds
    report.reply_excerpt = call.text[:300]
    if rates:
        rates.sort()
        report.expected_seconds = (words + 5) / rates[len(rates) // 2]
    report.leaked = [m for m in report.markers if m in call.text]
    if call.error:
        report.verdict = "ERROR"
        report.reasons.append(f"the long prompt got no answer: {call.error}")
    elif 200 <= call.status < 300:
        report.verdict = "FAIL"
        report.reasons.append(f"an over-length prompt of {words:,} words got a success status ({call.status}); "
                              "if that length fits the deployment's pool, pick one inside the band "
                              "`kvxfer audit capacity` reports")
    else:
        report.verdict = "PASS"
    if report.leaked:
        report.verdict = "FAIL"
        report.reasons.append(f"{len(report.leaked)} marker(s) from other requests appear in the reply")
    if (report.verdict == "FAIL" and report.expected_seconds and report.seconds is not None
            and report.seconds < 0.5 * report.expected_seconds):
        report.reasons.append(f"it answered in {report.seconds:.3f} s; a prompt that long should take about "
                              f"{report.expected_seconds:.3f} s (the placeholder path is fast)")
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..checks import integer, number

    parser.add_argument("url", help="base URL of the deployment (e.g. http://127.0.0.1:30000)")
    parser.add_argument("--api", choices=["generate", "openai"], default="generate",
                        help="SGLang's native /generate or OpenAI-compatible /v1/completions")
    size = parser.add_mutually_exclusive_group(required=True)
    size.add_argument("--words", type=integer(1), help="filler words in the long prompt")
    size.add_argument("--tokens", type=integer(1), help="target prompt length in tokens (one token per filler word)")
    parser.add_argument("--markers", type=integer(1), default=16, help="markers to plant (default 16)")
    parser.add_argument("--marker-repeat", type=integer(1), default=50, help="repetitions per marker prompt")
    parser.add_argument("--timeout", type=number(above=0), default=600.0, help="seconds per request")
    parser.add_argument("--max-requests", type=integer(2), default=64, help="upper bound on requests sent")
    parser.add_argument("--max-seconds", type=number(above=0), default=1800.0,
                        help="upper bound on the probe's duration")
    parser.add_argument("--i-own-this-deployment", action="store_true",
                        help="allow a target that is not on loopback (only ever probe deployments you own)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def _url(text: str) -> str:
    return text if "://" in text else f"http://{text}"


def _port(parts: urllib.parse.SplitResult) -> int:
    """The URL's port, or its scheme's (80, 443)."""
    return parts.port if parts.port is not None else 443 if parts.scheme == "https" else 80


def unreachable(url: str, timeout: float) -> str:
    """"" when something accepts a TCP connection at ``url``'s host and port now (closed at once, no
    request sent), else why not ("Connection refused", "timed out")."""
    parts = urllib.parse.urlsplit(url)
    try:
        with socket.create_connection((parts.hostname, _port(parts)), timeout=timeout):
            return ""
    except TimeoutError:
        return f"no answer within {timeout:g} s"
    except OSError as exc:
        return exc.strerror or str(exc) or type(exc).__name__


def check(args: argparse.Namespace) -> None:
    """Before any request (``kvxfer audit probe``): a URL this probe can speak to, on loopback unless
    ``--i-own-this-deployment``, where something listens; a long prompt and room for a marker."""
    from ...errors import ConfigError

    url = _url(args.url)
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"URL {args.url}: not an http:// or https:// address with a host")
    try:
        parts.port  # noqa: B018 - raises for a port outside 0..65535
    except ValueError as exc:
        raise ConfigError(f"URL {args.url}: {exc}") from None
    if not is_loopback(url) and not args.i_own_this_deployment:
        raise ConfigError(f"--i-own-this-deployment: refusing to probe {url}: not a loopback address. Probe only "
                          "deployments you own, and say so with --i-own-this-deployment.")
    words = args.words if args.words is not None else args.tokens
    if words is None or words <= 0:
        raise ConfigError("--words/--tokens: need a positive prompt length")
    if args.max_requests < 2:
        raise ConfigError(f"--max-requests {args.max_requests}: need at least 2 (a marker and the long prompt)")
    why = unreachable(url, min(args.timeout, CONNECT_TIMEOUT_S))
    if why:
        raise ConfigError(f"URL {args.url}: nothing answers at {parts.hostname}:{_port(parts)} ({why}); start the "
                          "deployment, or give the URL it serves on")


def main(args: argparse.Namespace) -> int:
    url = _url(args.url)
    words = args.words if args.words is not None else args.tokens
    report = run_probe(url, api=args.api, words=words, markers=args.markers, repeat=args.marker_repeat,
                       timeout=args.timeout, max_requests=args.max_requests, max_seconds=args.max_seconds)
    if args.json:
        print(json.dumps(asdict(report), indent=2))
    else:
        _print(report)
    return EXIT_PASS if report.verdict == "PASS" else EXIT_FAIL  # FAIL, or ERROR: the work failed


def _print(report: ProbeReport) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kvxfer audit probe {report.url} ({report.api})")
    table.add_column("measure")
    table.add_column("value", overflow="fold")
    expected = f"{report.expected_seconds:.3f} s" if report.expected_seconds else "unknown"
    rows = [
        ("markers planted", f"{report.planted} of {len(report.markers)}"),
        ("long prompt", f"{report.probe_words:,} filler words"),
        ("status", str(report.status)),
        ("reported prompt_tokens", str(report.prompt_tokens)),
        ("latency", f"{report.seconds:.3f} s (a prompt that long: about {expected})" if report.seconds else "-"),
        ("markers in the reply", ", ".join(report.leaked) or "none"),
        ("reply (start)" if report.status == 200 else "answer (start)", report.reply_excerpt or "-"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console = Console()
    console.print(table)
    colour = {"PASS": "green", "FAIL": "red"}.get(report.verdict, "yellow")
    console.print(f"[{colour}]{report.verdict}[/]" + (": " + "; ".join(report.reasons) if report.reasons else
                                                      ": the over-length prompt was refused and nothing leaked"))


if __name__ == "__main__":
    from ...errors import ConfigError

    parser = argparse.ArgumentParser(prog="python -m kvxfer.tools.audit.probe")
    add_arguments(parser)
    parsed = parser.parse_args()
    try:
        check(parsed)
    except ConfigError as exc:
        print(f"{parser.prog}: {exc}", file=sys.stderr)
        sys.exit(EXIT_REFUSED)
    sys.exit(main(parsed))
