"""kvxfer under real SGLang servers on two hosts (issue 42): a prefill server (``--disaggregation-mode
prefill``, TP 1) and the ``sglang_router`` in PD mode in network namespace a, a decode server (TP 1) in
namespace b, joined by a veth (:class:`kvxfer.tools.netns.TwoHosts`, 198.18.N.1 and 198.18.N.2).

Each server is started the way users start one on a host (docs/sglang.md, "Across hosts"): ``ip netns
exec <ns> python -m sglang.launch_server ... --host <its address> --disaggregation-transfer-backend
kvxfer`` with its own keyring (``KVXFER_KEYRING``, ``kvxfer keygen``'s directories) and kvxfer bound to its
host's address (``KVXFER_HOST``); the prefill's bootstrap server listens on a's address, and the router
points at ``http://<a>:<port> <bootstrap port>`` and ``http://<b>:<port>``. ``ip netns exec`` execs the
server (same pid), so :class:`Server`'s process group holds it and everything it spawns.

The test process lives in the machine's own namespace, which has no route to 198.18: every HTTP request is
made by a short-lived python client run inside a namespace (``ip netns exec``), the router's from host a.
No plain SGLang server is started as a reference (a fourth server on two cores): a prompt's reference is
its own greedy output through the router before any fault, checked to repeat, and kvxfer's metrics on
both hosts show the KV moved through kvxfer (not recomputed by the decode).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("sglang", reason="sglang not installed (python3 tools/install_sglang.py)")
pytest.importorskip("sglang_router", reason="sglang-router not installed (python3 tools/install_sglang.py)")

from kvxfer.wire.auth import Keyring, write_cluster  # noqa: E402

from .conftest import SESSION_MARKER  # noqa: E402
from .sglang_env import CPU_FLAGS, HERE, WORDS, Server, http_in, make_tiny_llama, running  # noqa: E402

pytestmark = pytest.mark.slow

CONTEXT, PAGE, NEW_TOKENS, LONG_TOKENS = 1024, 16, 12, 256
# each host is a namespace of its own: nothing else binds there
PREFILL_PORT, BOOTSTRAP_PORT, DECODE_PORT, ROUTER_PORT, ROUTER_METRICS_PORT = 30000, 8998, 30001, 8000, 29000
NCCL_PORT, METRICS_PORT = 25000, 9100
DROP_SECONDS = 5
CUT_BOUND = 90.0  # the longest a request in flight while the link is cut may take to answer
HEAL_BOUND = 15.0  # the longest the first request after the heal may take
TRY_SECONDS = 6.0  # a request after the heal not answered by then is tried again (a 12-token answer takes < 1 s)



def prompt_of(n_words: int, salt: int = 0) -> str:
    return " ".join(WORDS[(i * 5 + salt) % len(WORDS)] for i in range(n_words))


def token_ids(out: dict) -> list[int]:
    return [t[1] for t in out["meta_info"]["output_token_logprobs"]]


class TwoHostPD:
    """A prefill SGLang server and the PD router on host a, a decode SGLang server on host b."""

    def __init__(self, hosts, model: str, logs: Path) -> None:
        self.hosts = hosts
        a, b = hosts.a, hosts.b
        self.keys = logs / "keyrings"
        write_cluster(self.keys, ("prefill", "decode"))
        path = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env = {k: v for k, v in os.environ.items() if k == SESSION_MARKER or not k.startswith("KVXFER_")}
        # SGLang's timeouts at 60 s as in the single-host e2e; layer-wise sends for every prompt, as there
        # (these prompts are under the default KVXFER_LAYERWISE_MIN_TOKENS, below which a prefill sends whole)
        env.update(PYTHONPATH=path, PYTHONUNBUFFERED="1", SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL="2",
                   SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT="60", SGLANG_DISAGGREGATION_WAITING_TIMEOUT="60",
                   KVXFER_LAYERWISE="1", KVXFER_LAYERWISE_MIN_TOKENS="0")
        flags = list(CPU_FLAGS)
        at = flags.index("--host")
        del flags[at:at + 2]  # each server listens on its host's address instead
        launch = ["-m", "sglang.launch_server", "--model-path", model, *flags, "--context-length", str(CONTEXT),
                  "--page-size", str(PAGE), "--nccl-port", str(NCCL_PORT),
                  "--disaggregation-transfer-backend", "kvxfer"]

        def server(name: str, host: str, args: list[str], more_env: dict[str, str]) -> Server:
            # the executable is `ip`: `ip netns exec NS python ...` execs python in the namespace, same pid
            argv = hosts.argv(host, [sys.executable, *args])
            return Server(name, argv[1:], executable=argv[0], log_dir=logs, env=dict(env, **more_env))

        def engine(name: str, host: str, args: list[str]) -> Server:
            return server(name, host, [*launch, "--host", hosts.host(host).address, *args],
                          # SGLANG_HOST_IP: SGLang finds its host's IP by a route to 8.8.8.8, which a
                          # namespace has none to (it fails to start without one)
                          {"SGLANG_HOST_IP": hosts.host(host).address,
                           "KVXFER_KEYRING": str(self.keys / name), "KVXFER_HOST": hosts.host(host).address,
                           "KVXFER_METRICS_HOST": "127.0.0.1", "KVXFER_METRICS_PORT": str(METRICS_PORT)})

        self.prefill = engine("prefill", "a", ["--port", str(PREFILL_PORT), "--disaggregation-mode", "prefill",
                                               "--max-total-tokens", str(4 * CONTEXT),
                                               "--disaggregation-bootstrap-port", str(BOOTSTRAP_PORT)])
        self.decode = engine("decode", "b", ["--port", str(DECODE_PORT), "--disaggregation-mode", "decode",
                                             "--max-total-tokens", str(4 * CONTEXT),
                                             "--disaggregation-decode-retraction-backup", "none"])
        self.router = server("router", "a", [
            "-m", "sglang_router.launch_router", "--pd-disaggregation",
            "--prefill", f"http://{a.address}:{PREFILL_PORT}", str(BOOTSTRAP_PORT),
            "--decode", f"http://{b.address}:{DECODE_PORT}", "--host", "127.0.0.1", "--port", str(ROUTER_PORT),
            "--policy", "round_robin", "--prometheus-host", "127.0.0.1", "--prometheus-port", str(ROUTER_METRICS_PORT)],
            {})
        self.servers = [self.prefill, self.decode, self.router]

    # requests from inside a namespace --------------------------------------------------------------
    def http(self, host: str, method: str, url: str, payload: dict | None = None, *,
             timeout: float = 120.0) -> tuple[int, object]:
        return http_in(self.hosts, host, method, url, payload, timeout=timeout)

    def start(self) -> None:
        a, b = self.hosts.a.address, self.hosts.b.address
        self.prefill.start()
        self.decode.start()
        self.wait_ready(self.prefill, "a", f"http://{a}:{PREFILL_PORT}/health", timeout=900)
        self.wait_ready(self.decode, "b", f"http://{b}:{DECODE_PORT}/health", timeout=900)
        self.router.start()

        def both_healthy(body: object) -> bool:
            listed = body.get("workers", []) if isinstance(body, dict) else []
            return sum(bool(w.get("is_healthy")) for w in listed) == 2

        self.wait_ready(self.router, "a", f"http://127.0.0.1:{ROUTER_PORT}/workers", timeout=300, check=both_healthy)

    def wait_ready(self, server: Server, host: str, url: str, *, timeout: float, check=None) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if server.process.poll() is not None:
                raise RuntimeError(f"{server.name} exited with {server.process.returncode}:\n{server.tail()}")
            status, body = self.http(host, "GET", url, timeout=5)
            if status == 200 and (check is None or check(body)):
                return
            time.sleep(2)
        raise RuntimeError(f"{server.name} not ready at {url} after {timeout:g} s:\n{server.tail()}")

    def stop(self) -> None:
        for server in self.servers:  # all at once: each then gets its grace period in parallel
            server.kill(signal.SIGTERM)
        for server in reversed(self.servers):
            server.stop()

    def generate(self, text: str, *, max_new_tokens: int = NEW_TOKENS, timeout: float = 120.0) -> tuple[int, dict]:
        """Greedy generation through the router, from host a."""
        body = {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens,
                                                  "ignore_eos": True}, "return_logprob": True}
        status, out = self.http("a", "POST", f"http://127.0.0.1:{ROUTER_PORT}/generate", body, timeout=timeout)
        return status, out if isinstance(out, dict) else {"error": out}

    def kvxfer(self, host: str) -> dict[str, float]:
        """kvxfer's pages by state, transfers by outcome and bytes by direction on one host's server."""
        status, text = self.http(host, "GET", f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10)
        assert status == 200, text
        out: dict[str, float] = {}
        for line in str(text).splitlines():
            for series, label in (("kvxfer_pages{", "state"), ("kvxfer_transfers_total{", "outcome"),
                                  ("kvxfer_bytes_total{", "direction"), ("kvxfer_layer_sends_total{", "role")):
                if line.startswith(series):
                    key = line.split(f'{label}="', 1)[1].split('"', 1)[0]
                    out[f"{label}:{key}"] = float(line.rsplit(" ", 1)[1])
        return out

    def moved(self, host: str) -> float:
        """KV bytes this host's engine posted (prefill) or landed (decode)."""
        return sum(v for k, v in self.kvxfer(host).items() if k.startswith("direction:"))

    def held(self) -> dict[str, float]:
        """Pages a transfer holds on either host (READABLE decode pages are SGLang's requests')."""
        held = {}
        for host, states in (("a", ("reserved", "written", "quarantined", "readable")),
                             ("b", ("reserved", "written", "quarantined"))):
            pages = self.kvxfer(host)
            held.update({f"{host}_{s}": pages[f"state:{s}"] for s in states if pages.get(f"state:{s}")})
        return held

    def wait_nothing_held(self, timeout: float) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while True:
            held = self.held()
            if not held or time.monotonic() > deadline:
                return held
            time.sleep(1)


def test_sglang_prefill_on_host_a_and_decode_on_host_b_through_the_router_over_a_link_that_breaks_and_heals(
        two_hosts, tmp_path_factory):
    a = two_hosts.a
    root = tmp_path_factory.mktemp("sglang-two-hosts")
    model = str(make_tiny_llama(root / "tiny-llama"))
    t0 = time.monotonic()
    with running(lambda logs: TwoHostPD(two_hosts, model, logs), root, tries=1) as cluster:
        started = time.monotonic() - t0
        # 1. the registry on host a hands the decode the prefill's keyed address at a's address
        status, entry = cluster.http("a", "GET", f"http://{a.address}:{BOOTSTRAP_PORT}/route?prefill_dp_rank=0"
                                     "&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0", timeout=10)
        assert status == 200, entry
        key = Keyring.load(cluster.keys / "prefill").address("")  # "#curve=<its public key>"
        assert entry["kvxfer_address"] == f"tcp://{a.address}:{entry['rank_port']}{key}", entry

        # 2. greedy generations through the router, each twice: the same tokens, the KV moved by kvxfer,
        #    layer by layer where it can. A repeat of a prompt of whole pages (the 15 words are 16 tokens,
        #    one page) computes its last page again, and SGLang's radix cache swaps it for the cached page
        #    after the forward: that page went layer by layer from the freed page, so every such request
        #    failed with "the pages sent layer by layer for positions 0..0 are not the pages SGLang sends
        #    there" (HTTP 500, each router retry too) until the plan left swappable pages to go whole
        references: dict[str, list[int]] = {}
        layer_sends = cluster.kvxfer("a").get("role:prefill", 0)
        for salt, words in ((1, 40), (2, 90), (3, 15)):
            prompt = prompt_of(words, salt)
            before = cluster.moved("a"), cluster.moved("b")
            outs = [cluster.generate(prompt) for _ in range(2)]
            for status, out in outs:
                assert status == 200, out
                assert len(token_ids(out)) == NEW_TOKENS, out
            assert token_ids(outs[0][1]) == token_ids(outs[1][1]), (prompt, outs)
            after = cluster.moved("a"), cluster.moved("b")
            assert after[0] > before[0] and after[1] > before[1], f"no KV through kvxfer: {before} -> {after}"
            references[prompt] = token_ids(outs[0][1])
        assert cluster.kvxfer("a").get("role:prefill", 0) > layer_sends, "no layer-wise send from the prefill"
        #    the same new prompt (two whole pages) from three clients at once: the later ones' pages are
        #    swapped for the first one's once those are cached (in one batch or the next; SGLang's scheduler
        #    tends to keep requests of one prefix out of one batch, and here it did)
        same, answers = prompt_of(31, 5), {}

        def ask(i: int) -> None:
            answers[i] = cluster.generate(same)

        askers = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
        for t in askers:
            t.start()
        for t in askers:
            t.join(150)
        assert sorted(answers) == [0, 1, 2] and all(st == 200 for st, _ in answers.values()), answers
        assert len({tuple(token_ids(out)) for _, out in answers.values()}) == 1, answers
        held = cluster.wait_nothing_held(30)
        assert not held, held

        # 3. the link cut for 5 s while requests are in flight: each answers within the bound, either
        #    with its reference tokens or with an HTTP error
        #    the first long (its decode still generating when the link goes, its answer crossing the cut
        #    link), the second sent while the link is down
        cut, lengths = [prompt_of(60, 7), prompt_of(70, 8)], [LONG_TOKENS, NEW_TOKENS]
        for prompt, length in zip(cut, lengths):
            status, out = cluster.generate(prompt, max_new_tokens=length)
            assert status == 200, out
            references[prompt] = token_ids(out)
        results: dict[int, tuple[int, dict, float]] = {}

        def one(i: int) -> None:
            began = time.monotonic()
            status, out = cluster.generate(cut[i], max_new_tokens=lengths[i], timeout=CUT_BOUND + 30)
            results[i] = (status, out, time.monotonic() - began)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
        threads[0].start()  # one on its way when the link goes
        time.sleep(0.6)
        two_hosts.drop()
        try:
            cut_at = time.monotonic()
            first_pending = 0 not in results
            time.sleep(1)
            threads[1].start()  # one sent while the link is down
            time.sleep(DROP_SECONDS - 1)
        finally:
            two_hosts.undrop()
        healed = time.monotonic()

        # 4. after the heal a new request through the router succeeds within 15 s
        #    (retried until then: a request refused while SGLang re-peers counts as a try, and so does one
        #    the client gave up on after TRY_SECONDS: the router's HTTP request to the decode, when it went
        #    out on a connection the cut broke, hangs in the router for 60 s, "error sending request" in its
        #    log, with the decode never receiving it; seen for the request sent during the cut and, in one
        #    CI run in four, for the first one after the heal)
        fresh, tries = prompt_of(50, 11), []
        while True:
            status, out = cluster.generate(fresh, timeout=TRY_SECONDS)
            took = time.monotonic() - healed
            tries.append(status)
            if status == 200 or took > HEAL_BOUND:
                break
            time.sleep(1)
        assert status == 200, (tries, out, cluster.router.tail(20))
        assert len(token_ids(out)) == NEW_TOKENS, out
        assert took < HEAL_BOUND, f"the first request after the link healed took {took:.1f} s"
        status, again = cluster.generate(fresh)
        assert status == 200 and token_ids(again) == token_ids(out), (out, again)

        for t in threads:
            t.join(CUT_BOUND + 60)
        assert len(results) == 2, f"a request in flight during the cut never answered: {sorted(results)}"
        report = []
        for i, (status, out, seconds) in sorted(results.items()):
            report.append(f"request {i}: {status} after {seconds:.1f} s "
                          f"({'its reference tokens' if status == 200 and token_ids(out) == references[cut[i]] else json.dumps(out)[:300]})")
        held = cluster.wait_nothing_held(60)
        print(f"\nsglang two hosts: servers up in {started:.0f} s; link cut {DROP_SECONDS} s "
              f"({healed - cut_at:.1f} s measured, request 0 {'in flight' if first_pending else 'done'} at the cut): {'; '.join(report)}; after the heal a request succeeded "
              f"{took:.1f} s later (statuses {tries}); kvxfer on a: {cluster.kvxfer('a')}, on b: {cluster.kvxfer('b')}")
        for i, (status, out, seconds) in sorted(results.items()):
            assert seconds < CUT_BOUND, f"request {i} answered after {seconds:.1f} s"
            assert status == 200 or 400 <= status < 600, (i, status, out)
            if status == 200:
                assert token_ids(out) == references[cut[i]], (i, out)
        assert not held, held
