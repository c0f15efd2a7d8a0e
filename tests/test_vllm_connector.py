"""kvxfer's vLLM connector halves without vLLM: the scheduler half on duck-typed requests, the worker
half on real kvxfer engines (real ZMQ and TCP on loopback), the reason channel on a real socket, and
the settings. What only vLLM can show (its scheduler, its HTTP statuses) is in test_vllm_e2e.py."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

from kvxfer.errors import AdmissionRejected, ConfigError, TransferFailed, VerificationFailed
from kvxfer.integrations.vllm.binding import prompt_binding
from kvxfer.integrations.vllm.outcomes import (
    LoadFailure,
    ReasonBook,
    ReasonServer,
    ask_reason,
    classify,
    reason_address,
)
from kvxfer.integrations.vllm.params import ParamsError, TransferParams, parse
from kvxfer.integrations.vllm.scheduler import SchedulerSide
from kvxfer.integrations.vllm.settings import engine_config
from kvxfer.integrations.vllm.trust import PrefillTrust
from kvxfer.integrations.vllm.worker import WorkerSide
from kvxfer.wire.auth import Keyring, z85_to_hex

from .conftest import fill_random, make_layout

BLOCK = 16


def request(rid: str, tokens: list[int], params: dict | None, status: str = "FINISHED_LENGTH_CAPPED"):
    return SimpleNamespace(request_id=rid, prompt_token_ids=list(tokens), kv_transfer_params=params,
                           status=SimpleNamespace(name=status), num_computed_tokens=len(tokens))


class Pair:
    """A prefill and a decode 'engine' as vLLM would run them: scheduler half + one worker each.

    ``p_config``/``d_config`` add settings to one side (its keyring, say); ``scheduler_trust=False`` builds
    the decode's scheduler half without the trust settings, so only its worker's engine checks them."""

    def __init__(self, *, p_config: dict | None = None, d_config: dict | None = None, scheduler_trust: bool = True,
                 **config) -> None:
        base = dict(heartbeat_interval=0.2, **config)
        self.p_layout, self.d_layout = make_layout(64, page_size=BLOCK), make_layout(64, page_size=BLOCK)
        p_cfg = engine_config(512, {**base, **(p_config or {})}, 0, environ={})
        d_cfg = engine_config(512, {**base, **(d_config or {})}, 0, environ={})
        self.p_worker = WorkerSide(producer=True, config=p_cfg, tp_rank=0)
        self.d_worker = WorkerSide(producer=False, config=d_cfg, tp_rank=0)
        self.p_worker.register(self.p_layout)
        self.d_worker.register(self.d_layout)
        self.p_sched = SchedulerSide(engine_id="p", block_size=BLOCK, tp_size=1, producer=True, consumer=False)
        self.d_sched = SchedulerSide(engine_id=f"d-{id(self)}", block_size=BLOCK, tp_size=1, producer=False,
                                     consumer=True, trust=PrefillTrust.from_config(d_cfg) if scheduler_trust else None)
        self.p_sched.set_addresses({0: SimpleNamespace(address=self.p_worker.address)})
        self.sent: set[str] = set()
        self.received: set[str] = set()
        self.failed: set[str] = set()

    def prefill(self, rid: str, tokens: list[int], blocks: list[int]) -> dict:
        fill_random(self.p_layout, np.asarray(blocks), seed=len(rid))
        delay, params = self.p_sched.finished(request(rid, tokens, {"do_remote_decode": True}), blocks)
        assert delay and params is not None
        self.p_worker.take(self.p_sched.take_jobs())
        return params

    def decode(self, rid: str, tokens: list[int], params: dict, blocks: list[int]) -> None:
        req = request(rid, tokens, dict(params), status="WAITING_FOR_REMOTE_KVS")
        count, is_async = self.d_sched.matched_tokens(req, 0)
        assert count == len(tokens) and is_async
        self.d_sched.after_alloc(req, blocks, count)
        self.d_worker.take(self.d_sched.take_jobs())

    def step(self) -> None:
        """One vLLM step on both engines: results to the scheduler halves, new jobs to the workers."""
        for sched, worker in ((self.p_sched, self.p_worker), (self.d_sched, self.d_worker)):
            worker.take(sched.take_jobs())
            sent, received, failed = worker.results()
            sched.on_output(sent, received, worker.take_reasons())
            self.sent |= sent
            self.received |= received
            self.failed |= failed

    def until(self, predicate, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, "timed out"
            self.step()
            time.sleep(0.01)

    def close(self) -> None:
        for side in (self.p_worker, self.d_worker):
            side.engine.check_accounting()
            side.close()
        self.d_sched.close()


@pytest.fixture
def pair():
    made = []

    def factory(**config) -> Pair:
        made.append(Pair(**config))
        return made[-1]

    yield factory
    for p in made:
        p.close()


PROMPT = list(range(100, 140))  # 40 tokens: 3 blocks of 16


def test_a_load_is_verified_bound_and_reported_once_and_the_blocks_hold_the_prefill_kv(pair):
    p = pair()
    params = p.prefill("req-a", PROMPT, [5, 6, 7])
    p.decode("dec-a", PROMPT, params, [20, 21, 22])
    p.until(lambda: "dec-a" in p.received and "req-a" in p.sent)
    assert not p.failed
    for src, dst in zip(p.p_layout.views(), p.d_layout.views()):
        assert (src[[5, 6, 7]] == dst[[20, 21, 22]]).all()
    assert p.d_worker.stats["loaded"] == 1 and p.p_worker.stats["sent_succeeded"] == 1
    assert p.d_worker.engine.stats()["pages"]["free"] == 64, "a verified load must leave the blocks to vLLM"
    assert not p.p_sched.sending and not p.d_sched.loading
    # the same params again: refused by the prefill at once, with the reason, as the client's fault
    p.decode("dec-replay", PROMPT, params, [30, 31, 32])
    p.until(lambda: "dec-replay" in p.received)
    assert "dec-replay" in p.failed
    failure = p.d_sched.reasons.lookup("dec-replay")
    assert failure.status == 400 and failure.reason == "consumed", failure


def test_b_kv_of_another_prompt_of_the_same_length_is_refused_after_verification(pair):
    p = pair()
    params = p.prefill("req-b", PROMPT, [1, 2, 3])
    other = [t + 1 for t in PROMPT]
    p.decode("dec-b", other, params, [40, 41, 42])
    p.until(lambda: "dec-b" in p.received)
    assert "dec-b" in p.failed and p.d_worker.stats["binding_refused"] == 1
    failure = p.d_sched.reasons.lookup("dec-b")
    assert failure.status == 400 and failure.reason == "prompt_mismatch"
    assert p.d_worker.engine.stats()["pages"]["free"] == 64


def test_c_bad_params_fail_before_any_page_is_reserved(pair):
    p = pair()
    params = p.prefill("req-c", PROMPT, [8, 9, 10])
    cases = {
        "dec-junk": ({"do_remote_prefill": True, "kvxfer": "junk"}, PROMPT, "invalid_params", 400),
        "dec-size": (params, PROMPT + [1], "size_mismatch", 400),
        "dec-tp": ({**params, "kvxfer": {**params["kvxfer"], "tp_size": 2,
                                        "addresses": params["kvxfer"]["addresses"] * 2}}, PROMPT,
                   "unsupported_layout", 500),
    }
    for rid, (bad, tokens, _, _) in cases.items():
        p.decode(rid, tokens, bad, [50, 51, 52, 53][: -(-len(tokens) // BLOCK)])
    p.until(lambda: set(cases) <= p.received)
    for rid, (_, _, reason, status) in cases.items():
        failure = p.d_sched.reasons.lookup(rid)
        assert (failure.reason, failure.status) == (reason, status), failure
    assert p.d_worker.engine.stats()["requests"].get("admitted", 0) == 0


def test_c2_a_layout_the_decode_will_not_take_fails_the_prefills_half_at_once(pair):
    """Issue 24: the decode refuses the KV's layout (another TP size) before reserving anything, and tells
    the prefill: its request ends (vLLM gets its blocks back) within a second, not at meta_timeout."""
    p = pair(meta_timeout=30.0)
    params = p.prefill("req-l", PROMPT, [11, 12, 13])
    other = {**params, "kvxfer": {**params["kvxfer"], "block_size": BLOCK * 2}}
    t0 = time.monotonic()
    p.decode("dec-l", PROMPT, other, [54, 55, 56])
    p.until(lambda: "req-l" in p.sent and "dec-l" in p.received, timeout=5)
    assert time.monotonic() - t0 < 1.0
    assert p.d_sched.reasons.lookup("dec-l").reason == "unsupported_layout"
    req = p.p_worker.engine.status("req-l")
    assert req.state.value == "FAILED" and "block size" in str(req.error)
    assert p.d_worker.stats["refused_layout"] == 1


def test_d_an_abort_mid_load_is_reported_only_once_kvxfer_holds_nothing_for_it(pair):
    p = pair()
    for rid, admitted_first in (("dec-d1", True), ("dec-d2", False)):
        params = p.prefill(f"req-{rid}", PROMPT, [11, 12, 13])
        req = request(rid, PROMPT, dict(params), status="WAITING_FOR_REMOTE_KVS")
        p.d_sched.after_alloc(req, [60, 61, 62], len(PROMPT))
        p.d_worker.take(p.d_sched.take_jobs())
        if admitted_first:  # the destination reached the prefill; abort while the load is in flight
            deadline = time.monotonic() + 10
            while p.d_worker.loads[rid].generation is None:
                assert time.monotonic() < deadline
                time.sleep(0.01)
        assert p.d_sched.finished(req, [60, 61, 62]) == (False, None)  # vLLM itself holds the blocks meanwhile
        jobs = p.d_sched.take_jobs()
        assert jobs.aborts == [rid]
        p.d_worker.take(jobs)
        deadline = time.monotonic() + 10
        while True:
            _, received, failed = p.d_worker.results()
            if rid in received:
                break
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert rid not in failed  # an aborted request is not a failed load
        if admitted_first:  # reported only once kvxfer's request is terminal (drained or fenced)
            assert p.d_worker.engine.status(f"req-{rid}").fsm.terminal
        assert p.d_worker.engine.stats()["pages"]["free"] == 64
        assert p.d_worker.stats["load_aborted"] == (1 if admitted_first else 2)


def test_e_an_abandoned_prefill_gives_its_blocks_back_after_meta_timeout_counted(pair):
    p = pair(meta_timeout=0.5)
    p.prefill("req-e", PROMPT, [14, 15, 16])
    p.until(lambda: "req-e" in p.sent, timeout=5)
    assert p.p_worker.stats["sent_abandoned"] == 1 and not p.p_sched.sending


def test_f_an_unreachable_prefill_is_a_503_naming_its_address(pair):
    p = pair()
    params = p.prefill("req-f", PROMPT, [17, 18, 19])
    dead = {**params, "kvxfer": {**params["kvxfer"], "addresses": ["tcp://127.0.0.1:9"]}}
    p.d_worker.peer_timeout = 1.0
    p.decode("dec-f", PROMPT, dead, [1, 2, 3])
    p.until(lambda: "dec-f" in p.received, timeout=15)
    failure = p.d_sched.reasons.lookup("dec-f")
    assert failure.status == 503 and "tcp://127.0.0.1:9" in failure.text, failure


def _sockets_and_refusals(p: Pair) -> tuple[int, int]:
    """What the decode opened toward prefills, and how many addresses its engine refused as untrusted."""
    return p.d_worker.engine.control.open_sockets(), p.d_worker.engine.counters["untrusted_addresses"]


def _refused_403(p: Pair, rid: str) -> LoadFailure:
    p.until(lambda: rid in p.received, timeout=5)
    assert rid in p.failed
    failure = p.d_sched.reasons.lookup(rid)
    assert (failure.status, failure.reason) == (403, "untrusted_prefill"), failure
    return failure


def test_g_with_keyrings_params_carry_the_prefills_key_and_the_load_is_verified(pair):
    """Issue 42, finding 6: with a keyring (what kvxfer requires off loopback) the prefill's address carries
    its key; request_finished raised ValueError on it (after queuing the send) and parse() refused it."""
    rings = Keyring.cluster(["prefill", "decode"])
    p = pair(p_config={"keyring": rings["prefill"]}, d_config={"keyring": rings["decode"]})
    params = p.prefill("req-k", PROMPT, [5, 6, 7])
    (address,) = params["kvxfer"]["addresses"]
    endpoint = p.p_worker.address.split("#")[0]
    assert address == f"{endpoint}#curve={z85_to_hex(rings['prefill'].public)}"
    assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", int(endpoint.rsplit(":", 1)[1]))
    assert parse(params).addresses == (address,)
    p.decode("dec-k", PROMPT, params, [20, 21, 22])
    p.until(lambda: "dec-k" in p.received and "req-k" in p.sent)
    assert not p.failed and p.d_worker.stats["loaded"] == 1
    for src, dst in zip(p.p_layout.views(), p.d_layout.views()):
        assert (src[[5, 6, 7]] == dst[[20, 21, 22]]).all()
    # the same pair, params naming the prefill without its key or with a key this decode does not trust:
    # 403 at once, nothing opened; and the real params still serve after them
    stranger = Keyring.generate("stranger")
    params = p.prefill("req-k2", PROMPT, [8, 9, 10])
    before = _sockets_and_refusals(p)
    for rid, bad in (("dec-nokey", endpoint), ("dec-stranger", stranger.address(endpoint))):
        t0 = time.monotonic()
        p.decode(rid, PROMPT, {**params, "kvxfer": {**params["kvxfer"], "addresses": [bad]}}, [30, 31, 32])
        assert "keyring" in _refused_403(p, rid).text
        assert time.monotonic() - t0 < 1.0
    assert p.d_worker.engine.control.open_sockets() == before[0]
    p.decode("dec-k2", PROMPT, params, [40, 41, 42])
    p.until(lambda: "dec-k2" in p.received and "req-k2" in p.sent)
    assert "dec-k2" not in p.failed


@pytest.mark.parametrize("scheduler_trust", [True, False], ids=["scheduler-refuses", "engine-refuses"])
def test_g2_an_address_the_decode_does_not_trust_is_a_403_and_opens_nothing(pair, scheduler_trust):
    """Issue 42, finding 7: without a keyring the decode connected wherever the params said (a 503 after the
    attempt). Now the scheduler half refuses it in the request's first step (the workers never see it); the
    worker's engine refuses it too, before a socket, and that refusal is the same 403."""
    p = pair(scheduler_trust=scheduler_trust)
    params = p.prefill("req-u", PROMPT, [1, 2, 3])
    key = "ab" * 32
    cases = {"dec-remote": "tcp://198.51.100.7:5555",  # not loopback, not in trusted_prefills
             "dec-keyed": f"{params['kvxfer']['addresses'][0]}#curve={key}"}  # a key, and no keyring to check it
    sockets, refusals = _sockets_and_refusals(p)
    for rid, address in cases.items():
        t0 = time.monotonic()
        p.decode(rid, PROMPT, {**params, "kvxfer": {**params["kvxfer"], "addresses": [address]}}, [4, 5, 6])
        failure = _refused_403(p, rid)
        assert address[:40] in failure.text and time.monotonic() - t0 < 1.0
    assert p.d_worker.engine.control.open_sockets() == sockets
    assert p.d_worker.engine.stats()["requests"].get("admitted", 0) == 0
    engine_refused = p.d_worker.engine.counters["untrusted_addresses"] - refusals
    assert engine_refused == (0 if scheduler_trust else 2)  # both counted by the engine's own check
    assert p.d_worker.stats["load_failed_untrusted_prefill"] == 2
    # an open deployment lists its prefills: then the same address passes the check
    listed = engine_config(512, {"trusted_prefills": "198.51.100.0/24"}, 0, environ={})
    assert PrefillTrust.from_config(listed).problem("tcp://198.51.100.7:5555") is None


def test_c3_a_layout_refusal_comes_first_and_is_told_only_to_trusted_prefills(pair):
    """Finding 7: a load the decode's layout refuses anyway made rank 0 tell every address the params named
    (up to 256, each a connection). The size and layout checks run first, and the refusal goes only to
    addresses the decode trusts: here none, so nothing is opened and the engine is not even asked."""
    p = pair()
    params = p.prefill("req-l3", PROMPT, [11, 12, 13])
    many = [f"tcp://198.51.100.{i % 250 + 1}:{2000 + i}" for i in range(256)]
    forged = {**params, "kvxfer": {**params["kvxfer"], "tp_size": 256, "addresses": many}}
    sockets, refusals = _sockets_and_refusals(p)
    t0 = time.monotonic()
    p.decode("dec-l3", PROMPT, forged, [54, 55, 56])
    p.decode("dec-s3", PROMPT + [1], {**forged, "kvxfer": {**forged["kvxfer"], "tp_size": 1, "addresses": many[:1]}},
             [57, 58, 59])
    p.until(lambda: {"dec-l3", "dec-s3"} <= p.received, timeout=5)
    assert time.monotonic() - t0 < 1.0
    assert p.d_sched.reasons.lookup("dec-l3").reason == "unsupported_layout"  # the layout, before trust
    assert p.d_sched.reasons.lookup("dec-s3").reason == "size_mismatch"  # the prompt's size, before trust
    assert _sockets_and_refusals(p) == (sockets, refusals)
    assert p.d_worker.stats["refusal_untrusted_skipped"] == 256 and p.d_worker.stats["refused_layout"] == 0
    assert p.p_worker.engine.status("req-l3").state.value != "FAILED"  # nobody told the real prefill


TRUST_CASES = [
    # (decode's settings, the address: "{p}" is a live-looking loopback port, "{k}" a key the keyring trusts)
    ({}, "tcp://127.0.0.1:{p}"),
    ({}, "tcp://198.51.100.7:{p}"),
    ({}, "tcp://127.0.0.1:{p}#curve={k}"),
    ({"trusted_prefills": "198.51.100.0/24"}, "tcp://198.51.100.7:{p}"),
    ({"trusted_prefills": "198.51.100.0/24"}, "tcp://198.51.101.7:{p}"),
    ({"keyring": True}, "tcp://127.0.0.1:{p}"),
    ({"keyring": True}, "tcp://127.0.0.1:{p}#curve={k}"),
    ({"keyring": True}, "tcp://198.51.100.7:{p}#curve={k}"),
    ({"keyring": True}, "tcp://127.0.0.1:{p}#curve=" + "cd" * 32),
    ({"keyring": True, "trusted_prefills": "10.0.0.0/8"}, "tcp://198.51.100.7:{p}#curve={k}"),
    ({"keyring": True, "trusted_prefills": "10.0.0.0/8"}, "tcp://10.1.2.3:{p}#curve={k}"),
]


@pytest.mark.parametrize(("settings", "template"), TRUST_CASES, ids=[f"{sorted(c[0])}-{c[1][6:24]}" for c in TRUST_CASES])
def test_the_connectors_trust_check_agrees_with_the_engines(settings, template):
    """PrefillTrust (the scheduler half's check) refuses exactly what the decode engine refuses before
    opening a socket (DecodeEngine.connect), and never lets through what the engine would refuse."""
    from kvxfer import DecodeEngine
    from kvxfer.errors import PeerError
    from kvxfer.wire.trust import refused_by_trust

    rings = Keyring.cluster(["decode", "prefill"])
    config = dict(settings, keyring=rings["decode"] if settings.get("keyring") else None)
    engine = DecodeEngine(make_layout(32, page_size=BLOCK), engine_config(512, config, 0, environ={}))
    try:
        address = template.format(p=9, k=z85_to_hex(rings["prefill"].public))
        trusted = PrefillTrust.from_config(engine.config, engine.control.keyring).problem(address) is None
        with pytest.raises(PeerError) as err:  # nothing answers there: a refusal, or no answer in time
            engine.connect(address, timeout=0.2)
        assert refused_by_trust(err.value) == (not trusted), (trusted, str(err.value))
        assert engine.control.open_sockets() == 0
    finally:
        engine.close()


def test_keyed_params_round_trip_through_to_json_and_parse():
    key = "0123456789abcdefABCDEF" + "0" * 42
    for first, host, port in ((f"tcp://10.0.0.1:40123#curve={key}", "10.0.0.1", 40123),
                              (f"tcp://[fd00::1]:5#curve={key}", "fd00::1", 5),
                              ("tcp://node-1.example:65535", "node-1.example", 65535)):
        params = TransferParams(engine_id="e", request_id="r", addresses=(first, f"tcp://10.0.0.2:1#curve={key}"),
                                tokens=40, tp_size=2, block_size=16)
        out = params.to_json()
        assert (out["remote_host"], out["remote_port"]) == (host, port)
        assert parse(out) == params


def test_request_finished_never_raises_into_vllm_and_queues_nothing_it_cannot_name(monkeypatch):
    """Finding 6: the send job was queued, then building the params raised into vLLM's scheduler. The params
    are built first now, and any failure there leaves the request unsent (vLLM frees its blocks)."""
    sched = SchedulerSide(engine_id="p-order", block_size=BLOCK, tp_size=1, producer=True, consumer=False)
    keyed = "tcp://10.0.0.1:5000#curve=" + "ab" * 32
    sched.set_addresses({0: SimpleNamespace(address=keyed)})
    delay, params = sched.finished(request("req-1", PROMPT, {"do_remote_decode": True}), [1, 2, 3])
    assert delay and params["kvxfer"]["addresses"] == [keyed] and params["remote_port"] == 5000
    assert [job.request_id for job in sched.take_jobs().sends] == ["req-1"]

    def broken(self):
        raise RuntimeError("boom")

    monkeypatch.setattr(TransferParams, "to_json", broken)
    assert sched.finished(request("req-2", PROMPT, {"do_remote_decode": True}), [1, 2, 3]) == (False, None)
    assert sched.take_jobs().empty() and sched.sending == {"req-1"}
    for bad in ("tcp://10.0.0.1:5000#curve=abc", "tcp://10.0.0.1:٤٠"):  # a worker reporting what no decode reads
        with pytest.raises(ConfigError, match="TP rank 0"):
            sched.set_addresses({0: SimpleNamespace(address=bad)})


def test_binding_is_equal_only_for_equal_token_sequences():
    assert prompt_binding([1, 2, 3]) == prompt_binding(np.array([1, 2, 3]))
    assert prompt_binding([1, 2, 3]) != prompt_binding([1, 2, 4])
    assert prompt_binding([1, 2]) != prompt_binding([1, 2, 0])
    assert len(prompt_binding([])) == 32


def test_params_name_the_first_bad_field():
    good = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_request_id": "r",
            "kvxfer": {"version": 1, "addresses": ["tcp://127.0.0.1:5000"], "tokens": 3, "tp_size": 1,
                       "block_size": 16}}
    assert parse(good).addresses == ("tcp://127.0.0.1:5000",)
    for change, needle in (({"remote_request_id": ""}, "remote_request_id"),
                           ({"kvxfer": {**good["kvxfer"], "version": 9}}, "version"),
                           ({"kvxfer": {**good["kvxfer"], "addresses": ["http://x"]}}, "addresses"),
                           ({"kvxfer": {**good["kvxfer"], "tokens": True}}, "tokens"),
                           ({"kvxfer": {**good["kvxfer"], "tp_size": 2}}, "tp_size")):
        with pytest.raises(ParamsError, match=needle):
            parse({**good, **change})
    with pytest.raises(ParamsError, match="object"):
        parse([1])


GOOD_PARAMS = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_request_id": "r",
               "kvxfer": {"version": 1, "addresses": ["tcp://127.0.0.1:5000"], "tokens": 3, "tp_size": 1,
                          "block_size": 16}}


def _with(field: str, value) -> dict:
    if field.startswith("kvxfer."):
        return {**GOOD_PARAMS, "kvxfer": {**GOOD_PARAMS["kvxfer"], field.removeprefix("kvxfer."): value}}
    return {**GOOD_PARAMS, field: value}


STRICT_CASES = [
    # issue 41, finding 3: each used to be accepted (or escaped as another exception)
    ("kvxfer.addresses", ["tcp://127.0.0.1:٤٠١٢٣"], r"kvxfer\.addresses"),  # Arabic-Indic digits
    ("kvxfer.addresses", ["tcp://127.0.0.1:４０１２３"], r"kvxfer\.addresses"),  # fullwidth digits
    ("kvxfer.addresses", ["tcp://127.0.0.1:²"], r"kvxfer\.addresses"),  # isdigit(), but int() raises
    ("kvxfer.addresses", ["tcp://127.0.0.1:" + "9" * 5000], r"kvxfer\.addresses"),  # int() refuses the length
    ("kvxfer.addresses", ["tcp://127.0.0.1:0"], r"kvxfer\.addresses"),
    ("kvxfer.addresses", ["tcp://127.0.0.1:65536"], r"kvxfer\.addresses"),
    ("kvxfer.addresses", ["tcp://host name:5000"], r"kvxfer\.addresses"),
    ("kvxfer.addresses", ["tcp://h\ud800:5000"], r"kvxfer\.addresses"),
    ("kvxfer.addresses", ["tcp://[::1:5000"], r"kvxfer\.addresses"),
    ("kvxfer.addresses", [5000], r"kvxfer\.addresses"),
    # issue 42: a key follows the endpoint as #curve= and exactly 64 ASCII hex digits, nothing else
    ("kvxfer.addresses", ["tcp://127.0.0.1:5000#curve=" + "a" * 63], r"kvxfer\.addresses"),
    ("kvxfer.addresses", ["tcp://127.0.0.1:5000#curve=" + "a" * 65], r"kvxfer\.addresses"),
    ("kvxfer.addresses", ["tcp://127.0.0.1:5000#curve=" + "g" * 64], r"kvxfer\.addresses"),
    ("kvxfer.addresses", ["tcp://127.0.0.1:5000#curve=" + "٤" * 64], r"kvxfer\.addresses"),
    ("kvxfer.addresses", ["tcp://127.0.0.1:5000#curve=" + "ａ" * 64], r"kvxfer\.addresses"),
    ("kvxfer.addresses", ["tcp://127.0.0.1:5000#curve="], r"kvxfer\.addresses"),
    ("kvxfer.addresses", ["tcp://127.0.0.1:5000#curve=" + "a" * 64 + "\n"], r"kvxfer\.addresses"),
    ("kvxfer.addresses", ["tcp://127.0.0.1:5000#CURVE=" + "a" * 64], r"kvxfer\.addresses"),
    ("kvxfer.addresses", ["tcp://127.0.0.1:5000#key=" + "a" * 64], r"kvxfer\.addresses"),
    ("kvxfer.addresses", ["tcp://127.0.0.1:5000#curve=" + "a" * 64 + "#curve=" + "a" * 64], r"kvxfer\.addresses"),
    ("kvxfer.addresses", ["tcp://127.0.0.1#curve=" + "a" * 64], r"kvxfer\.addresses"),
    ("kvxfer.addresses", ["tcp://127.0.0.1:٤٠#curve=" + "a" * 64], r"kvxfer\.addresses"),
    ("kvxfer.version", True, r"kvxfer\.version"),  # True == 1
    ("kvxfer.version", 1.0, r"kvxfer\.version"),
    ("kvxfer.tokens", 3.0, r"kvxfer\.tokens"),
    ("kvxfer.block_size", False, r"kvxfer\.block_size"),
    ("remote_request_id", "\ud800", r"remote_request_id.*UTF-8"),  # JSON can carry a lone surrogate
    ("remote_request_id", "req-\udfff-1", r"remote_request_id.*UTF-8"),
    ("remote_request_id", 7, r"remote_request_id"),
    ("remote_engine_id", "\ud800", r"remote_engine_id.*UTF-8"),
    ("remote_engine_id", "", r"remote_engine_id"),
    ("remote_engine_id", "e" * 5000, r"remote_engine_id"),
]


@pytest.mark.parametrize(("field", "value", "needle"), STRICT_CASES, ids=[f"{c[0]}={c[1]!r:.30}" for c in STRICT_CASES])
def test_params_are_parsed_strictly_and_every_refusal_names_the_field(field, value, needle):
    with pytest.raises(ParamsError, match=needle) as err:
        parse(_with(field, value))
    str(err.value).encode("utf-8")  # the reason reaches the client as it is: no lone surrogate in it


def test_good_params_in_every_accepted_form_parse():
    key = "0123456789abcdefABCDEF" + "f" * 42
    for address in ("tcp://127.0.0.1:1", "tcp://node-1.example:65535", "tcp://[::1]:5000",
                    f"tcp://127.0.0.1:1#curve={key}", f"tcp://[::1]:5000#curve={key}"):
        assert parse(_with("kvxfer.addresses", [address])).addresses == (address,)
    assert parse(_with("remote_request_id", "cmpl-é-😀")).request_id == "cmpl-é-😀"


@pytest.mark.parametrize("address", ["tcp://127.0.0.1:²", "tcp://127.0.0.1:٤٠١٢٣", "tcp://127.0.0.1:" + "9" * 5000],
                         ids=["superscript", "arabic-indic", "5000-digits"])
def test_the_scheduler_hook_turns_bad_params_into_a_400_never_an_exception(address):
    """A superscript port used to raise a bare ValueError out of ``after_alloc`` into vLLM's scheduler;
    Arabic-Indic digits were accepted and the load failed later as a 503."""
    sched = SchedulerSide(engine_id="d-strict", block_size=BLOCK, tp_size=1, producer=False, consumer=True,
                          serve_reasons=False)
    try:
        params = _with("kvxfer.addresses", [address])
        params["kvxfer"]["tokens"] = len(PROMPT)  # _with copied the kvxfer object
        req = request("dec-strict", PROMPT, params, status="WAITING_FOR_REMOTE_KVS")
        assert sched.matched_tokens(req, 0) == (len(PROMPT), True)
        sched.after_alloc(req, [1, 2, 3], len(PROMPT))
        (job,) = sched.take_jobs().loads
        assert job.params is None and job.failure is not None
        assert (job.failure.status, job.failure.reason) == (400, "invalid_params"), job.failure
        assert "kvxfer.addresses" in job.failure.text
    finally:
        sched.close()


def test_the_scheduler_hook_turns_a_surrogate_request_id_into_a_400():
    sched = SchedulerSide(engine_id="d-strict2", block_size=BLOCK, tp_size=1, producer=False, consumer=True,
                          serve_reasons=False)
    try:
        params = {**GOOD_PARAMS, "remote_request_id": "req-\ud800",
                  "kvxfer": {**GOOD_PARAMS["kvxfer"], "tokens": len(PROMPT)}}
        req = request("dec-strict2", PROMPT, params, status="WAITING_FOR_REMOTE_KVS")
        sched.after_alloc(req, [1, 2, 3], len(PROMPT))
        (job,) = sched.take_jobs().loads
        assert (job.failure.status, job.failure.reason) == (400, "invalid_params"), job.failure
        assert "remote_request_id" in job.failure.text
        job.failure.text.encode("utf-8")
    finally:
        sched.close()


def test_a_prefill_request_whose_id_does_not_encode_as_utf8_is_not_sent_and_gets_no_params():
    """vLLM's request id goes into the params and onto the wire: one with a lone surrogate is refused
    at request_finished (vLLM frees its blocks at once), not by msgpack on the way to the decode."""
    sched = SchedulerSide(engine_id="p-strict", block_size=BLOCK, tp_size=1, producer=True, consumer=False)
    sched.set_addresses({0: SimpleNamespace(address="tcp://127.0.0.1:5000")})
    assert sched.finished(request("req-\ud800", PROMPT, {"do_remote_decode": True}), [1, 2, 3]) == (False, None)
    assert sched.take_jobs().empty() and not sched.sending
    delay, params = sched.finished(request("req-ok", PROMPT, {"do_remote_decode": True}), [1, 2, 3])
    assert delay and parse(params).request_id == "req-ok"


def test_failures_are_classified_by_whose_fault():
    assert classify(AdmissionRejected("x", reason="consumed")).status == 400
    assert classify(AdmissionRejected("x", reason="exceeds_context")).status == 400
    assert classify(TransferFailed("x", reason="connection")).status == 503
    assert classify(VerificationFailed("x", check="checksum")).status == 502
    assert classify(None).status == 503


def test_reasons_travel_to_the_api_server_on_a_local_socket():
    book = ReasonBook()
    address = reason_address(f"test-{time.monotonic_ns()}")
    server = ReasonServer(book, address)
    try:
        book.record("cmpl-abc-0-1234", LoadFailure(400, "consumed", "used once"))
        found = ask_reason(address, "cmpl-abc")  # the API server knows the id without vLLM's suffixes
        assert found == LoadFailure(400, "consumed", "used once")
        assert ask_reason(address, "cmpl-other") is None
    finally:
        server.close()
        server.close()  # idempotent
    t0 = time.monotonic()
    assert ask_reason(address, "cmpl-abc", timeout=0.3) is None  # nobody serves: vLLM's own 500 stays
    assert time.monotonic() - t0 < 2


def test_reason_book_is_bounded():
    book = ReasonBook(limit=3)
    for i in range(5):
        book.record(f"r{i}", LoadFailure(503, "x", str(i)))
    assert book.lookup("r0") is None and book.lookup("r4").text == "4"


def test_settings_come_from_the_environment_and_the_extra_config():
    config = engine_config(1024, {"drain_timeout": 4.0}, 2,
                           environ={"KVXFER_META_TIMEOUT": "7", "KVXFER_CONTROL_PORT": "41000",
                                    "KVXFER_FREE_POLICY": "zero", "KVXFER_DRAIN_TIMEOUT": "9"})
    assert config.max_context == 1024 and config.meta_timeout == 7.0
    assert config.drain_timeout == 4.0, "the extra config wins over the variable"
    assert config.control_port == 41002, "rank r binds the fixed port + r"
    assert config.free_policy == "keep", "vLLM owns the bytes of its blocks"
    with pytest.raises(ConfigError, match="unknown kvxfer setting"):
        engine_config(1024, {"no_such": 1}, 0, environ={})
    with pytest.raises(ConfigError, match="KVXFER_META_TIMEOUT"):
        engine_config(1024, {}, 0, environ={"KVXFER_META_TIMEOUT": "soon"})
