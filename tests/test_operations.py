"""What operators see: the Prometheus endpoint (in-process and through ``kvxfer demo``) and the
structured event lines for every lifecycle step off the happy path."""

from __future__ import annotations

import json
import logging
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvxfer import DecodeEngine, EngineConfig
from kvxfer.engine.events import EventLog
from kvxfer.errors import AdmissionRejected, ConfigError

from .conftest import PAGE_TOKENS, free_port_pair, make_layout, wait_for


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the endpoint, keyed by (name, sorted labels without ``role``)."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "role"))
            out[(sample.name, labels)] = sample.value
    return out


@pytest.mark.slow
def test_demo_metrics_endpoint_counts_the_scripted_failures():
    port = free_port_pair()
    proc = subprocess.Popen([sys.executable, "-m", "kvxfer", "demo", "--metrics-port", str(port), "--linger", "60"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("lingering"):
                break
        assert any("all expectations held" in line for line in lines), "".join(lines)
        decode = scrape(f"http://127.0.0.1:{port}/metrics")
        prefill = scrape(f"http://127.0.0.1:{port + 1}/metrics")
    finally:
        proc.terminate()  # SIGTERM: the demo stops its engine processes and removes its files
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    assert proc.returncode == 128 + signal.SIGTERM
    # the scripted rejection, abort and checksum failure, as the decode engine counted them
    assert decode[("kvxfer_rejections_total", (("reason", "exceeds_peer_pool"),))] >= 1
    assert decode[("kvxfer_aborts_total", (("cause", "caller"),))] >= 1
    assert decode[("kvxfer_verification_failures_total", (("check", "checksum"),))] >= 1
    assert decode[("kvxfer_transfers_total", (("outcome", "FAILED"),))] >= 1
    assert decode[("kvxfer_transfers_total", (("outcome", "RELEASED"),))] >= 4
    assert decode[("kvxfer_transfer_seconds_count", ())] >= 4
    assert decode[("kvxfer_bytes_total", (("direction", "received"),))] > 0
    assert decode[("kvxfer_writes_refused_total", (("reason", "stale_tag"),))] >= 1  # the late write
    assert decode[("kvxfer_quarantined_pages", ())] == 0
    assert decode[("kvxfer_pages", (("state", "free"),))] == 256
    # and the prefill engine's view: its own rejection and the stranger refused at the handshake
    assert prefill[("kvxfer_rejections_total", (("reason", "exceeds_pool"),))] >= 1
    assert prefill[("kvxfer_control_events_total", (("kind", "auth_denied"),))] >= 1
    assert prefill[("kvxfer_bytes_total", (("direction", "sent"),))] > 0
    assert prefill[("kvxfer_inflight_writes", ())] == 0


def test_in_process_metrics_follow_the_engine(engines):
    pair = engines(decode_config={"metrics_port": 0}, prefill_config={"metrics_port": 0})
    url = pair.decode.metrics_address
    assert url.startswith("http://127.0.0.1:")
    pair.transfer("ok", 3 * PAGE_TOKENS)
    pair.decode.wait("ok")
    pair.prefill.wait("ok")
    with pytest.raises(AdmissionRejected):
        pair.decode.admit("huge", 10**6, peer=pair.peer)
    pair.prefill.admit("held", PAGE_TOKENS)
    pair.decode.admit("held", PAGE_TOKENS, peer=pair.peer)
    pair.prefill.wait_ready("held")
    during = scrape(url)
    assert during[("kvxfer_open_windows", ())] == 1
    assert during[("kvxfer_pages", (("state", "reserved"),))] == 1
    assert during[("kvxfer_rejections_total", (("reason", "exceeds_context"),))] == 1
    assert during[("kvxfer_transfer_seconds_count", ())] == 1
    pair.decode.abort("held")
    pair.prefill.wait("held")
    pair.decode.wait("held")
    pair.decode.release("ok")
    after = scrape(url)
    assert after[("kvxfer_aborts_total", (("cause", "caller"),))] == 1
    assert after[("kvxfer_transfers_total", (("outcome", "ABORTED"),))] == 1
    assert after[("kvxfer_transfers_total", (("outcome", "RELEASED"),))] == 1
    assert after[("kvxfer_transfers_total", (("outcome", "REJECTED"),))] == 1
    assert after[("kvxfer_open_windows", ())] == 0
    prefill = scrape(pair.prefill.metrics_address)
    assert prefill[("kvxfer_transfers_total", (("outcome", "SUCCEEDED"),))] == 1
    assert prefill[("kvxfer_aborts_total", (("cause", "peer"),))] == 1
    pair.decode.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(url, timeout=2)


def test_metrics_are_off_by_default_and_a_taken_port_is_a_clear_error(engines):
    pair = engines()
    assert pair.decode.metrics is None and not hasattr(pair.decode, "metrics_address")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"cannot serve metrics on port {port}"):
            DecodeEngine(make_layout(16), EngineConfig(max_context=16 * PAGE_TOKENS, metrics_port=port))


def _events(caplog: pytest.LogCaptureFixture) -> list[dict]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == "kvxfer.events"]


def test_every_step_off_the_happy_path_is_one_json_line_naming_request_and_generation(engines, caplog):
    caplog.set_level(logging.INFO, logger="kvxfer.events")
    pair = engines()
    pair.transfer("fine", 2 * PAGE_TOKENS)
    pair.decode.wait("fine")
    pair.decode.release("fine")
    pair.prefill.wait("fine")
    assert _events(caplog) == [], "the happy path logs no events"

    pair.faults.pause()  # the writer stalls, so the abort has to quarantine
    pair.prefill.admit("cut", 4 * PAGE_TOKENS)
    req = pair.decode.admit("cut", 4 * PAGE_TOKENS, peer=pair.peer)
    pair.prefill.wait_ready("cut")
    pair.prefill.send("cut")
    pair.decode.abort("cut", "client went away")
    pair.faults.resume()
    pair.decode.wait("cut")
    pair.prefill.wait("cut")
    with pytest.raises(AdmissionRejected):
        pair.prefill.admit("big", 10**7)
    events = _events(caplog)
    decode_steps = [(e["from"], e["to"]) for e in events
                    if e["event"] == "transition" and e["role"] == "decode" and e["rid"] == "cut"]
    assert decode_steps == [("RESERVED", "QUARANTINED"), ("QUARANTINED", "ABORTED")]
    for event in events:
        assert {"event", "engine", "role"} <= set(event)
        if event["event"] == "transition":
            assert event["rid"] in ("cut", "big")
            if event["rid"] == "cut":
                assert event["gen"] == req.gen
    assert any(e["role"] == "prefill" and e["rid"] == "cut" and e["to"] in ("DRAINING", "ABORTED") for e in events)
    assert any(e["rid"] == "big" and e["to"] == "REJECTED" and e["reason"] == "exceeds_context" for e in events)
    for record in caplog.records:
        if record.name == "kvxfer.events":
            assert "\n" not in record.getMessage()


def test_event_lines_a_peer_can_provoke_are_rate_limited(caplog):
    caplog.set_level(logging.INFO, logger="kvxfer.events")
    log = EventLog("e", "decode", burst=5)
    for _ in range(1000):
        log.emit("write_refused", limit_key="stale_tag", reason="stale_tag")
    log.emit("write_refused", limit_key="other", reason="other")
    lines = _events(caplog)
    assert len([e for e in lines if e["reason"] == "stale_tag"]) == 5
    assert lines[-1]["reason"] == "other"
    time.sleep(1.05)
    log.emit("write_refused", limit_key="stale_tag", reason="stale_tag")
    last = _events(caplog)[-1]
    assert last["suppressed"] == 995


def test_refused_writes_and_fences_become_events(engines, caplog):
    caplog.set_level(logging.INFO, logger="kvxfer.events")
    pair = engines(drain_timeout=0.3)
    pair.faults.config.ignore_aborts = True
    pair.prefill.admit("f", 2 * PAGE_TOKENS)
    pair.decode.admit("f", 2 * PAGE_TOKENS, peer=pair.peer)
    pair.prefill.wait_ready("f")
    pair.decode.abort("f", "test")
    wait_for(lambda: any(e["event"] == "fence" for e in _events(caplog)), what="fence event")
    pair.faults.config.ignore_aborts = False
    fence = next(e for e in _events(caplog) if e["event"] == "fence")
    assert fence["peer"] == pair.prefill.engine_id and "drain" in fence["reason"]
    pair.prefill.wait("f", timeout=30)
    pair.decode.wait("f", timeout=30)
