"""``kvxfer audit probe`` against a real ``kvxfer serve-toy`` process, safe and ``--unsafe-legacy``.

The toy server is started as its own process on a free loopback port and spoken to over real HTTP;
the probe runs as the CLI would (``python -m kvxfer audit probe``) and is judged by its exit status
and its JSON report.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

# The toy's prefill pool is 256 pages x 16 tokens = 4,096 tokens against an advertised 32,768:
# 8,000 words lands in the unsafe band.
BAND_WORDS = 8000


def _start_toy(*extra: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvxfer", "serve-toy", "--port", "0", "--max-seconds", "120", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "http://" not in line:
        proc.kill()
        pytest.fail(f"serve-toy did not start: {line!r}")
    url = line.split("http://", 1)[1].split()[0]
    return proc, f"http://{url}"


@pytest.fixture(scope="module")
def safe_toy() -> Iterator[str]:
    proc, url = _start_toy()
    yield url
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def legacy_toy() -> Iterator[str]:
    proc, url = _start_toy("--unsafe-legacy")
    yield url
    proc.terminate()
    proc.wait(timeout=30)


def _probe(url: str, *args: str) -> tuple[int, dict]:
    out = subprocess.run(
        [sys.executable, "-m", "kvxfer", "audit", "probe", url, "--json", "--markers", "6", *args],
        capture_output=True, text=True, timeout=120,
    )
    return out.returncode, json.loads(out.stdout) if out.stdout.strip().startswith("{") else {"stderr": out.stderr}


def _post(url: str, body: object) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.parametrize("api", ["generate", "openai"])
def test_probe_fails_against_the_legacy_path(legacy_toy: str, api: str) -> None:
    rc, report = _probe(legacy_toy, "--api", api, "--words", str(BAND_WORDS))
    assert rc == 1, report
    assert report["verdict"] == "FAIL"
    assert report["status"] == 200
    assert report["prompt_tokens"] == BAND_WORDS + 5  # the full length is reported, as in the incident
    assert report["planted"] == 6
    assert report["leaked"], "the placeholder path read stale pages, so planted markers must show up"
    assert set(report["leaked"]) <= set(report["markers"])
    assert any("success status" in r for r in report["reasons"])
    assert any("marker" in r for r in report["reasons"])


@pytest.mark.parametrize("api", ["generate", "openai"])
def test_probe_passes_against_kvxfer_checks(safe_toy: str, api: str) -> None:
    rc, report = _probe(safe_toy, "--api", api, "--tokens", str(BAND_WORDS))
    assert rc == 0, report
    assert report["verdict"] == "PASS"
    assert report["status"] == 400
    assert report["leaked"] == []
    assert "can never fit" in report["reply_excerpt"], report["reply_excerpt"]


def test_safe_toy_still_serves_prompts_that_fit(safe_toy: str) -> None:
    """The PASS above is a refusal, not a server that fails everything: short prompts get their own words."""
    status, body = _post(f"{safe_toy}/generate",
                         {"text": "Remember Alpha7 and Bravo9 please", "sampling_params": {"max_new_tokens": 8}})
    assert status == 200, body
    assert body["text"] == "Remember Alpha7 Bravo9"
    assert body["meta_info"]["prompt_tokens"] == 5
    # a prompt that fits the pool passes the probe's status test only as FAIL: the probe cannot know the band
    rc, report = _probe(safe_toy, "--words", "100")
    assert rc == 1 and report["status"] == 200 and report["leaked"] == []


def test_probe_is_bounded_by_request_count(legacy_toy: str) -> None:
    rc, report = _probe(legacy_toy, "--words", str(BAND_WORDS), "--max-requests", "3")
    assert report["planted"] == 2  # 2 markers + the long prompt = 3 requests
    assert rc == 1


def test_probe_refuses_targets_off_loopback() -> None:
    out = subprocess.run([sys.executable, "-m", "kvxfer", "audit", "probe", "http://192.0.2.1:30000", "--words", "10"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "not a loopback address" in out.stderr
    assert "--i-own-this-deployment" in out.stderr


def test_probe_refuses_a_target_where_nothing_listens() -> None:
    """Nothing listening is a bad URL, refused before any request (tests/test_cli_errors.py: a target that
    stops answering during the probe is an ERROR verdict, exit 1)."""
    out = subprocess.run([sys.executable, "-m", "kvxfer", "audit", "probe", "http://127.0.0.1:9", "--words", "10",
                          "--json", "--timeout", "5"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stdout == "" and out.stderr.count("\n") == 1
    assert out.stderr.startswith("kvxfer audit probe: URL http://127.0.0.1:9: nothing answers at 127.0.0.1:9")


@pytest.mark.parametrize(("path", "body", "needle"), [
    ("/generate", {"text": 7}, "'text' must be a string"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": "many"}}, "max_new_tokens"),
    ("/v1/completions", {"prompt": ["a"]}, "'prompt' must be a string"),
    ("/v1/completions", {"prompt": "a", "max_tokens": -1}, "max_tokens"),
    ("/generate", [1, 2], "JSON object"),
    ("/nowhere", {}, "no route"),
])
def test_toy_rejects_malformed_requests(safe_toy: str, path: str, body: object, needle: str) -> None:
    status, reply = _post(f"{safe_toy}{path}", body)
    assert status in (400, 404)
    assert needle in reply["error"]["message"]
