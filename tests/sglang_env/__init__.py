"""What the SGLang tests need that the registry cannot give: a tiny random-weight Llama built locally
(no hub access), a plain-torch stand-in for the one vLLM op SGLang's CPU path imports, and the
runtime-context publication SGLang's scheduler process entry does before it builds a KV manager."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvxfer.wire.addresses import local_addresses

HERE = Path(__file__).resolve().parent  # put on the servers' PYTHONPATH: provides ``vllm._custom_ops``

WORDS = ("the quick brown fox jumps over a lazy dog kv cache transfer prefill decode server "
         "router engine page token layer attention tensor model request stream batch").split()


def make_tiny_llama(out: Path, *, hidden_size: int = 64, head_dim: int = 16) -> Path:
    """A 2-layer Llama with random weights (4 attention heads, 2 KV heads; hidden size 64 and head size
    16 unless given: vLLM's CPU attention needs a head size of 32 or more), and a byte-level BPE
    tokenizer trained on a small word list; ``save_pretrained`` layout, float32. Idempotent (about 5 s)."""
    out = Path(out)
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    corpus = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(12)) for i in range(400)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", bos)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   model_max_length=2048)
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}assistant:{% endif %}")
    fast.save_pretrained(out)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=2048,
                         rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=bos, eos_token_id=eos,
                         tie_word_embeddings=False, torch_dtype="float32")
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.save_pretrained(out, safe_serialization=True)
    cfg = json.loads((out / "config.json").read_text())
    cfg["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def publish_rank(server_args: Any) -> None:
    """Publish ``server_args`` as SGLang's scheduler process entry does before it builds a KV manager
    (rank 0 of a one-process topology, no process groups), so Common* classes can read it."""
    from sglang.srt import runtime_context as rc

    rc.publish(server_args, role="test", ranks=rc.SpawnRanks(world_rank=0))
    rc.get_parallel().override_permanently(pp_group=None)


# real servers ------------------------------------------------------------------------------------------

# --sleep-on-idle: an idle SGLang scheduler otherwise polls its sockets without blocking and keeps a core at
# 100 %; the e2e suite runs eight servers on two cores, so the idle ones starved the busy ones (a restarting
# server took minutes to come up). With it an idle scheduler blocks on its request sockets (up to 1 s); it
# is not idle, and so never sleeps, while any request, bootstrap or KV transfer is queued.
CPU_FLAGS = ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph",
             "--disable-overlap-schedule", "--dtype", "float32", "--host", "127.0.0.1", "--log-level", "warning",
             "--sleep-on-idle"]


def request_json(method: str, url: str, payload: dict[str, Any] | None = None, *, timeout: float = 60.0) -> tuple[int, Any]:
    """(status, decoded JSON or text) of one request; connection errors raise OSError."""
    data = json.dumps(payload).encode() if payload is not None else None
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = response.read()
            status = response.status
    except urllib.error.HTTPError as exc:
        body, status = exc.read(), exc.code
    text = body.decode(errors="replace")
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


class PortTaken(RuntimeError):
    """A server could not bind the port it was given (another process took it in the meantime)."""


def free_ports(n: int, low: int = 20000, high: int = 32000, *, avoid: Any = ()) -> list[int]:
    """``n`` distinct ports that bind now, none of ``avoid`` (ports handed out already, not bound yet),
    below the kernel's ephemeral range (32768 and up by default), where servers' own bind-to-0 ports
    and outgoing connections are allocated, so a port chosen here is not taken by one of them before
    its server binds it (a server binds its HTTP port only after loading its model)."""
    import random
    import socket

    ports: list[int] = []
    while len(ports) < n:
        port = random.randrange(low, high)
        if port in ports or port in avoid:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
    return ports


class Server:
    """One server process (and everything it spawns) in its own process group, with its log file."""

    def __init__(self, name: str, args: list[str], *, env: dict[str, str], log_dir: Path,
                 executable: str = sys.executable) -> None:
        self.name, self.args, self.env, self.executable = name, args, env, executable
        self.log_path = Path(log_dir) / f"{name}.log"
        self.process: subprocess.Popen | None = None

    def start(self) -> Server:
        # the server's temporary files (SGLang's and vLLM's IPC sockets, vLLM's dist files, torch's
        # compile cache) go under the test's own directory, not the system's /tmp, where a killed
        # server would leave them
        tmp = self.log_path.parent / f"{self.name}.tmp"
        tmp.mkdir(exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child
        self.process = subprocess.Popen([self.executable, *self.args], env={**self.env, "TMPDIR": str(tmp)},
                                        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        return self

    def wait_ready(self, url: str, *, timeout: float = 300.0, check: Any = None) -> None:
        """Until ``url`` answers 200 (and ``check`` accepts the body). Fails at once if the process
        exited, and raises :class:`PortTaken` if its log says a port it was given was taken, whether
        it exited of it (a kvxfer engine's metrics port) or not (SGLang's HTTP server logs the bind
        error and keeps its processes alive: waiting would only time out)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            exited = self.process is not None and self.process.poll() is not None
            if "address already in use" in self.tail(200).lower():
                raise PortTaken(f"{self.name}: a port it was given was taken before it bound it"
                                f"{' (it exited)' if exited else ''}:\n{self.tail()}")
            if exited:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.tail()}")
            try:
                status, body = request_json("GET", url, timeout=5)
                if status == 200 and (check is None or check(body)):
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready at {url} after {timeout:g} s:\n{self.tail()}")

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group (the server and the processes it spawned)."""
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM the group, SIGKILL it after ``grace`` seconds; wait until no member is left."""
        if self.process is None:
            return
        self.kill(signal.SIGTERM)
        try:
            self.process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        self.kill(signal.SIGKILL)
        self.process.wait()
        deadline = time.monotonic() + 10
        while group_members(self.process.pid) and time.monotonic() < deadline:
            self.kill(signal.SIGKILL)
            time.sleep(0.1)

    def members(self) -> list[int]:
        return group_members(self.process.pid) if self.process is not None else []


def kvxfer_host() -> str:
    """Where the kvxfer engines bind: this host's first non-loopback IPv4 address that accepts a connection
    from here (what a deployment across hosts binds), else loopback."""
    for address in local_addresses():
        if ":" in address:
            continue
        try:
            with socket.socket() as server:
                server.bind((address, 0))
                server.listen(1)
                socket.create_connection(server.getsockname(), timeout=2).close()
        except OSError:
            continue
        return address
    return "127.0.0.1"


# one request from inside a namespace: prints {"status": ..., "body": ...}; status 0 for a connection error
CLIENT = r"""
import json, sys, urllib.error, urllib.request
method, url, payload, timeout = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
data = payload.encode() if payload else None
req = urllib.request.Request(url, data=data, method=method,
                             headers={"Content-Type": "application/json"} if data else {})
try:
    with urllib.request.urlopen(req, timeout=timeout) as r:
        status, body = r.status, r.read()
except urllib.error.HTTPError as e:
    status, body = e.code, e.read()
except Exception as e:
    status, body = 0, repr(e).encode()
text = body.decode(errors="replace")
try:
    body = json.loads(text)
except ValueError:
    body = text
print(json.dumps({"status": status, "body": body}))
"""


def http_in(hosts: Any, host: str, method: str, url: str, payload: dict | None = None, *,
            timeout: float = 120.0) -> tuple[int, Any]:
    """One HTTP request made from inside network namespace ``host`` of ``hosts`` (a
    :class:`kvxfer.tools.netns.TwoHosts`, whose addresses this process cannot reach): (status, body);
    status 0 for a connection error."""
    argv = hosts.argv(host, [sys.executable, "-c", CLIENT, method, url,
                             json.dumps(payload) if payload is not None else "", str(timeout)])
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout + 30)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    return out["status"], out["body"]


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


@contextmanager
def running(make: Callable[[Path], Any], root: Path, tries: int = 3) -> Iterator[Any]:
    """A cluster (``start()``, ``stop()``, ``servers``) made by ``make(log_dir)`` and started; made again
    with new ports when a server's port was taken before it bound it. On the way out, and on any
    failure to start, every server is stopped and none may be left."""
    for attempt in range(tries):
        logs = Path(root) / f"try{attempt}"
        logs.mkdir()
        cluster = make(logs)
        try:
            cluster.start()
            break
        except PortTaken:
            stop_all(cluster)
            if attempt == tries - 1:
                raise
        except BaseException:
            stop_all(cluster)
            raise
    try:
        yield cluster
    finally:
        stop_all(cluster)


def stop_all(cluster: Any) -> None:
    cluster.stop()
    left = {s.name: s.members() for s in cluster.servers if s.members()}
    assert not left, f"server processes survived: {left}"
