"""What a failed vLLM load tells the client: an HTTP status and a reason (importable without vLLM).

vLLM ends a request whose KV load failed with ``finish_reason="error"`` and, left alone, answers
HTTP 500 "Internal server error" without saying why. kvxfer's connector records, per request, why the
load failed and whose fault it is; the API server asks for it when vLLM reports the error
(:mod:`.frontend`) and answers with that status and reason instead:

* 400: the request is at fault (its ``kv_transfer_params`` are malformed, name KV that was already
  used or never existed, belong to another prompt, or the prompt cannot fit);
* 403: the params name a prefill this decode does not trust (``untrusted_prefill``, :mod:`.trust`):
  nothing was opened toward it;
* 503: a peer failed (the prefill is unreachable, died mid-transfer, or did not deliver in time);
  retrying later may succeed;
* 502: the prefill delivered KV that did not verify (coverage, bytes or checksum);
* 500: the two servers cannot work together (unequal tensor parallelism, for now).

The reasons travel worker -> scheduler connector in vLLM's worker metadata, and the scheduler connector
serves them to its API server on a local socket (:class:`ReasonServer`, :func:`ask_reason`). Invariant:
an answer is only ever given for a request id the engine itself recorded; unknown ids get no answer, and
the API server then keeps vLLM's own 500.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("vllm.kvxfer.outcomes")

# kvxfer reasons (AdmissionRejected.reason / TransferFailed.reason and the connector's own) that are the
# request's fault: its params or its prompt, not a peer.
CLIENT_REASONS = frozenset({
    "invalid_params", "prompt_mismatch", "consumed", "not_admitted", "size_mismatch", "exceeds_context",
    "exceeds_pool", "empty", "duplicate",
})
CONFIG_REASONS = frozenset({"unsupported_layout"})
BAD_DATA_CODES = frozenset({"verification_failed"})
REMEMBERED = 4096  # reasons kept per engine (the oldest go first)
KEEP_SECONDS = 600.0


@dataclass(frozen=True)
class LoadFailure:
    """Why one request's load failed: HTTP status, kvxfer's reason code, and a sentence."""

    status: int
    reason: str
    text: str

    def message(self) -> str:
        return f"kvxfer: {self.reason}: {self.text}"


def classify(error: Any, *, default_reason: str = "transfer_failed") -> LoadFailure:
    """A kvxfer error (or None) as a :class:`LoadFailure`."""
    if error is None:
        return LoadFailure(503, default_reason, "the transfer ended without a result")
    reason = getattr(error, "reason", None) or getattr(error, "code", None) or default_reason
    code = getattr(error, "code", "")
    if reason in CLIENT_REASONS:
        status = 400
    elif reason in CONFIG_REASONS:
        status = 500
    elif code in BAD_DATA_CODES:
        status = 502
    else:
        status = 503
    return LoadFailure(status, str(reason), str(error))


class ReasonBook:
    """Reasons by request id, bounded in count and age; thread-safe."""

    def __init__(self, limit: int = REMEMBERED, keep: float = KEEP_SECONDS) -> None:
        self.limit, self.keep = limit, keep
        self._lock = threading.Lock()
        self._items: OrderedDict[str, tuple[float, LoadFailure]] = OrderedDict()

    def record(self, request_id: str, failure: LoadFailure) -> None:
        with self._lock:
            self._items[request_id] = (time.monotonic(), failure)
            self._items.move_to_end(request_id)
            while len(self._items) > self.limit:
                self._items.popitem(last=False)

    def lookup(self, request_id: str) -> LoadFailure | None:
        """The reason recorded for ``request_id``, or for an engine id that extends it (vLLM's engine
        adds ``-<index>`` and a random suffix to the id the API server knows)."""
        now = time.monotonic()
        with self._lock:
            while self._items:
                first = next(iter(self._items.values()))
                if now - first[0] <= self.keep:
                    break
                self._items.popitem(last=False)
            found = self._items.get(request_id)
            if found is None:
                prefix = request_id + "-"
                for key in reversed(self._items):
                    if key.startswith(prefix):
                        found = self._items[key]
                        break
            return found[1] if found is not None else None


def reason_address(engine_id: str) -> str:
    """The local (Linux abstract) socket where an engine serves its reasons."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in str(engine_id))
    return f"ipc://@kvxfer-vllm-reasons-{safe}"


class ReasonServer:
    """Answers ``{"id": request_id}`` with the recorded reason (or nothing) on :func:`reason_address`."""

    def __init__(self, book: ReasonBook, address: str) -> None:
        import zmq

        self.book, self.address = book, address
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(address)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvxfer-vllm-reasons", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not poller.poll(200):
                    continue
                ask = self._sock.recv_json()
                found = self.book.lookup(str(ask.get("id", ""))) if isinstance(ask, dict) else None
                self._sock.send_json(None if found is None else
                                     {"status": found.status, "reason": found.reason, "text": found.text})
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                log.exception("kvxfer reason server")

    def close(self) -> None:
        """Stop serving (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(linger=0)
        self._ctx.term()


def ask_reason(address: str, request_id: str, *, timeout: float = 1.0) -> LoadFailure | None:
    """The reason an engine recorded for ``request_id`` (None: none recorded, or no answer in time)."""
    import zmq

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        sock.send_json({"id": request_id})
        if not sock.poll(int(timeout * 1000)):
            return None
        answer = sock.recv_json()
    except zmq.ZMQError:
        return None
    finally:
        sock.close(linger=0)
    if not isinstance(answer, dict):
        return None
    return LoadFailure(int(answer["status"]), str(answer["reason"]), str(answer["text"]))
