"""``kvxfer serve-toy``: a tiny serving endpoint on kvxfer engines, to test leak probes against.

A prefill and a decode engine (one process, real loopback sockets) sit behind an HTTP server that
speaks SGLang's native ``/generate`` and the OpenAI-compatible ``/v1/completions``. The "model" is
deterministic: a token is a whitespace-separated word, its KV is the word itself in a 32-byte slot
of the page, and the reply repeats the *distinctive* words (those with a capital letter or a digit)
of the context the decode side reads back from its KV pages. So a reply built from a stale page
shows another request's words, exactly as the 2026 incident showed other customers' text.

Defaults mirror the incident's shape: the prefill pool (4,096 tokens) is smaller than the advertised
context (32,768 tokens), so prompts of 4,097-32,768 tokens are the unsafe band. With kvxfer's checks
such a prompt is refused (HTTP 400). ``--unsafe-legacy`` reproduces the incident instead: the prefill
swaps the prompt for a one-token placeholder and writes one page, the decode reads every reserved
page without verification, and the answer is HTTP 200 with other requests' words, faster than a
prompt that long should take.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
import warnings
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np

from ..core.layout import KVLayout
from ..core.lifecycle import ReceiverState
from ..engine import DecodeEngine, EngineConfig, PrefillEngine
from ..errors import AdmissionRejected, ConfigError, KvxferError, PoolExhausted

log = logging.getLogger("kvxfer.toy")
SLOT = 32  # bytes of KV per token (the word, utf-8, NUL padded)


@dataclass
class ToyConfig:
    """The toy server's settings: address, pool sizes, advertised context, simulated cost, legacy (unsafe) mode."""

    host: str = "127.0.0.1"
    port: int = 0
    page_size: int = 16
    prefill_pages: int = 256
    decode_pages: int = 2048
    context: int = 32768
    token_cost_us: float = 50.0  # simulated prefill compute per prompt token
    unsafe_legacy: bool = False
    max_seconds: float | None = None


def encode(words: list[str], page_size: int) -> np.ndarray:
    """``(pages, page_size * SLOT)`` KV bytes for ``words`` (the last page zero padded)."""
    pages = max(1, -(-len(words) // page_size))
    out = np.zeros((pages * page_size, SLOT), dtype=np.uint8)
    for i, word in enumerate(words):
        raw = word.encode()[:SLOT]
        out[i, : len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    return out.reshape(pages, page_size * SLOT)


def decode_words(rows: np.ndarray, count: int) -> list[str]:
    """The first ``count`` token slots of the pages, as words (empty slots are skipped)."""
    slots = np.ascontiguousarray(rows).reshape(-1, SLOT)[:count]
    words = []
    for slot in slots:
        text = bytes(slot).rstrip(b"\0").decode(errors="replace")
        if text:
            words.append(text)
    return words


def toy_reply(words: list[str], max_new_tokens: int) -> str:
    """The distinctive words of the context, in order, deduplicated, at most ``max_new_tokens``."""
    seen: dict[str, None] = {}
    for word in words:
        token = word.strip(".,;:!?\"'")
        if token and (any(c.isupper() for c in token) or any(c.isdigit() for c in token)):
            seen.setdefault(token, None)
        if len(seen) >= max_new_tokens:
            break
    return " ".join(seen) if seen else "(nothing to repeat)"


class ToyServer:
    """The engines, the model and the request path; the HTTP handler only parses and formats."""

    def __init__(self, config: ToyConfig) -> None:
        self.config = config
        engine = EngineConfig(max_context=config.context, unsafe_legacy=config.unsafe_legacy,
                              heartbeat_interval=0.5, drain_timeout=5.0)
        prefill_layout = KVLayout.allocate(num_buffers=1, item_len=config.page_size * SLOT,
                                           num_pages=config.prefill_pages, page_size=config.page_size)
        decode_layout = KVLayout.allocate(num_buffers=1, item_len=config.page_size * SLOT,
                                          num_pages=config.decode_pages, page_size=config.page_size)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the override is logged loudly anyway
            self.prefill = PrefillEngine(prefill_layout, EngineConfig(**{**engine.to_dict(),
                                                                       "allow_undersized_pool": True}))
        self.decode = DecodeEngine(decode_layout, engine)
        self.peer = self.decode.connect(self.prefill.address)
        self.lock = threading.Lock()

    def generate(self, text: str, max_new_tokens: int) -> tuple[int, dict[str, Any]]:
        """``(http status, body)`` for one completion request."""
        words = text.split()
        if not words:
            return 400, {"error": "empty prompt"}
        rid = uuid.uuid4().hex
        started = time.monotonic()
        try:
            self._admit(rid, len(words))
        except AdmissionRejected as exc:
            return 400, {"error": str(exc), "prompt_tokens": len(words)}
        except KvxferError as exc:
            return 503, {"error": str(exc)}
        try:
            req = self.prefill.wait_ready(rid, timeout=30)
            placeholder = req.placeholder
            kv = encode(["<placeholder>"] if placeholder else words, self.config.page_size)
            view = self.prefill.layout.views()[0]
            view[req.pages] = kv[: len(req.pages)]
            # prefill "compute": proportional to what it actually processes
            time.sleep(self.config.token_cost_us * 1e-6 * (1 if placeholder else len(words)))
            self.prefill.send(rid)
            done = self.decode.wait(rid, timeout=60)
            if done.state is not ReceiverState.READABLE:
                return 500, {"error": f"KV transfer failed: {done.error}"}
            with self.decode.read(rid) as read:
                context = decode_words(read.buffer(0), len(words))
            self.decode.release(rid)
        except KvxferError as exc:
            return 500, {"error": str(exc)}
        finally:
            self._settle(rid)
        reply = toy_reply(context, max_new_tokens)
        return 200, {
            "text": reply,
            "prompt_tokens": len(words),
            "completion_tokens": len(reply.split()),
            "latency_s": time.monotonic() - started,
        }

    def _admit(self, rid: str, tokens: int) -> None:
        deadline = time.monotonic() + 30
        while True:
            try:
                self.decode.admit(rid, tokens, peer=self.peer)
                break
            except PoolExhausted:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
        try:
            while True:
                try:
                    self.prefill.admit(rid, tokens)
                    return
                except PoolExhausted:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.01)
        except KvxferError:
            self.decode.abort(rid, "prefill refused the request")
            raise

    def _settle(self, rid: str) -> None:
        for engine in (self.decode, self.prefill):
            try:
                status = engine.status(rid)
            except KvxferError:
                continue
            if not status.fsm.terminal:
                try:
                    engine.abort(rid, "request ended")
                except KvxferError:
                    pass

    def close(self) -> None:
        self.decode.close()
        self.prefill.close()


def _handler(server: ToyServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug("%s " + fmt, self.address_string(), *args)

        def _reply(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            if self.path == "/health":
                self._reply(200, {"status": "ok"})
            else:
                self._reply(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self) -> None:  # noqa: N802
            try:
                length = int(self.headers.get("Content-Length", "0"))
                if length > 64 << 20:
                    raise ValueError("request too large")
                payload = json.loads(self.rfile.read(length) or b"{}")
                if not isinstance(payload, dict):
                    raise ValueError("body must be a JSON object")
            except ValueError as exc:
                self._reply(400, {"error": {"message": f"bad request: {exc}"}})
                return
            if self.path == "/generate":
                text = payload.get("text")
                params = payload.get("sampling_params") or {}
                if not isinstance(text, str) or not isinstance(params, dict):
                    self._reply(400, {"error": {"message": "'text' must be a string"}})
                    return
                max_new = params.get("max_new_tokens", 16)
                if not isinstance(max_new, int) or isinstance(max_new, bool) or max_new < 0:
                    self._reply(400, {"error": {"message": "'max_new_tokens' must be a non-negative integer"}})
                    return
                status, body = server.generate(text, max_new)
                if status != 200:
                    self._reply(status, {"error": {"message": body["error"]}})
                    return
                self._reply(200, {"text": body["text"], "meta_info": {
                    "prompt_tokens": body["prompt_tokens"], "completion_tokens": body["completion_tokens"],
                    "e2e_latency": body["latency_s"]}})
            elif self.path == "/v1/completions":
                prompt = payload.get("prompt")
                if not isinstance(prompt, str):
                    self._reply(400, {"error": {"message": "'prompt' must be a string", "type": "invalid_request_error"}})
                    return
                max_tokens = payload.get("max_tokens", 16)
                if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0:
                    self._reply(400, {"error": {"message": "'max_tokens' must be a non-negative integer",
                                                "type": "invalid_request_error"}})
                    return
                status, body = server.generate(prompt, max_tokens)
                if status != 200:
                    self._reply(status, {"error": {"message": body["error"], "type": "invalid_request_error"}})
                    return
                self._reply(200, {
                    "id": f"cmpl-{uuid.uuid4().hex[:12]}", "object": "text_completion", "model": "kvxfer-toy",
                    "choices": [{"index": 0, "text": body["text"], "finish_reason": "length"}],
                    "usage": {"prompt_tokens": body["prompt_tokens"], "completion_tokens": body["completion_tokens"],
                              "total_tokens": body["prompt_tokens"] + body["completion_tokens"]},
                })
            else:
                self._reply(404, {"error": {"message": f"no route {self.path}"}})

    return Handler


def serve(config: ToyConfig) -> int:
    # the HTTP port first: a port that is taken is refused before any engine starts
    try:
        httpd = ThreadingHTTPServer((config.host, config.port), BaseHTTPRequestHandler)
    except (OSError, OverflowError) as exc:
        raise ConfigError(f"--port {config.port}: cannot serve HTTP on {config.host}:{config.port}: "
                          f"{getattr(exc, 'strerror', None) or exc}") from None
    try:
        server = ToyServer(config)
    except BaseException:
        httpd.server_close()
        raise
    httpd.RequestHandlerClass = _handler(server)
    httpd.daemon_threads = True
    mode = "UNSAFE LEGACY (reproduces the incident)" if config.unsafe_legacy else "kvxfer checks on"
    print(f"kvxfer toy server on http://{config.host}:{httpd.server_address[1]} ({mode}); prefill pool "
          f"{config.prefill_pages * config.page_size:,} tokens, advertised context {config.context:,}", flush=True)
    timer = threading.Timer(config.max_seconds or 0, httpd.shutdown)
    timer.daemon = True  # a stopped server must not wait for it
    if config.max_seconds:
        timer.start()
    try:
        httpd.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        timer.cancel()
        httpd.server_close()
        server.close()
    return 0
