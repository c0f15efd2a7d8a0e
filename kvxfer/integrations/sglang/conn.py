"""SGLang's disaggregation transfer classes, implemented on kvxfer engines.

* :class:`KvxferKVManager` (one per scheduler rank) owns a kvxfer :class:`~kvxfer.PrefillEngine` or
  :class:`~kvxfer.DecodeEngine` over the rank's KV buffers (``kv_data_ptrs/lens/item_lens``: one
  kvxfer buffer each, page ``p`` at ``ptr + p * item_len``). Its pool mirrors SGLang's allocator:
  SGLang chooses the pages, kvxfer adopts them for the transfer's lifetime.
* :class:`KvxferKVSender` / :class:`KvxferKVReceiver` (one per request and role) map SGLang's call
  sequence onto a kvxfer request whose id is the ``bootstrap_room`` (reused rooms get a new kvxfer
  generation, so an old room's messages never touch the new one).
* :class:`KvxferKVBootstrapServer` is SGLang's own HTTP registry: prefill ranks register their kvxfer
  control address there, decode ranks look it up.

The contract SGLang's schedulers rely on, and how it is kept:

* ``KVPoll`` values only move forward and ``Failed`` is sticky (:class:`_Status`).
* ``failure_exception()`` raises SGLang's ``KVTransferError(bootstrap_room, reason)``.
* The size is checked at the first call that sees it (``init`` on prefill, ``send_metadata`` on
  decode) by kvxfer admission; an over-capacity request fails there, both sides, no byte moved.
* The last chunk is the one that reaches the page count given to ``init``; the metadata row
  (``aux_*`` buffers at the request's ``aux_index``) travels inside DONE and lands in the decode's
  row at its ``aux_index`` only after the transfer verified.
* A prefill sender reports a terminal state only once every write it posted has completed, so
  SGLang frees source pages only when nothing still reads them.
* Read custody: a verified request stays READABLE in kvxfer while SGLang's model reads its pages
  on the device; the custody ends when SGLang hands those pages (or the room) to a new transfer,
  which is SGLang saying it freed the request. kvxfer never allocates pages of its own here.
* Deferred decode KV release: ``is_abort_release_safe(room, acks)`` is true only after kvxfer has a
  drain proof or fenced the connection; kvxfer's drain timeout is set below SGLang's deferred-release
  timeout, so SGLang's own timeout never frees a page kvxfer still guards.

Limits (clear errors, not silent fallbacks): equal TP sizes on both roles, no pipeline/context
parallel, no hybrid state buffers (mamba/SWA/DSA), host KV memory unless GPU support is available.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import time
import urllib.error
import urllib.request
from typing import Any

import numpy as np
from sglang.srt.disaggregation.base.conn import (
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVArgs,
    KVPoll,
    KVTransferMetric,
)
from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer, KVTransferError
from sglang.srt.disaggregation.utils import DisaggregationMode

from ...engine import DecodeEngine, EngineConfig, PrefillEngine
from ...errors import KvxferError
from ...layout import KVLayout
from ...lifecycle import ReceiverState, SenderState

log = logging.getLogger("kvxfer.sglang")

R, S = ReceiverState, SenderState


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


def _engine_config(server_args: Any, pool_tokens: int) -> EngineConfig:
    """kvxfer settings for a scheduler rank, from SGLang's arguments and KVXFER_* variables."""
    context = getattr(server_args, "context_length", None) or pool_tokens
    deferred_timeout = _env_float("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT", 30.0)
    waiting_timeout = _env_float("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", 300.0)
    gid = os.environ.get("KVXFER_GID_INDEX")
    return EngineConfig(
        max_context=int(context),
        transport=os.environ.get("KVXFER_TRANSPORT", "tcp"),
        host=os.environ.get("KVXFER_HOST", "127.0.0.1"),
        checksum=os.environ.get("KVXFER_CHECKSUM", "adler32"),
        free_policy="keep",  # SGLang owns the bytes of pages it reads; kvxfer never rewrites them
        allow_undersized_pool=os.environ.get("KVXFER_ALLOW_UNDERSIZED_POOL") == "1",
        # Fence before SGLang's deferred-release timeout could free a page kvxfer still guards.
        drain_timeout=max(0.5, min(_env_float("KVXFER_DRAIN_TIMEOUT", 10.0), deferred_timeout / 2)),
        transfer_timeout=waiting_timeout,
        meta_timeout=waiting_timeout,
        ib_device=os.environ.get("KVXFER_IB_DEVICE") or getattr(server_args, "disaggregation_ib_device", None),
        gid_index=int(gid) if gid else None,
        keyring=os.environ.get("KVXFER_KEYRING") or None,  # a `kvxfer keygen` directory: CURVE-authenticated
    )


def _http_json(url: str, *, method: str = "GET", payload: dict[str, Any] | None = None,
               timeout: float = 5.0) -> tuple[int, Any]:
    data = json.dumps(payload).encode() if payload is not None else None
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = response.read()
            return response.status, (json.loads(body) if body and body[:1] in b"[{" else body.decode())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


class _Status:
    """KVPoll that only moves forward; Failed is sticky."""

    def __init__(self, initial: int) -> None:
        self.value = initial

    def advance(self, value: int) -> int:
        if self.value == KVPoll.Failed:
            return self.value
        if value == KVPoll.Failed or value > self.value:
            self.value = value
        return self.value


class KvxferKVManager(BaseKVManager):
    """One scheduler rank's kvxfer engine, and the bootstrap bookkeeping around it."""

    supports_deferred_decode_kv_release = True
    enable_deferred_decode_kv_release = True
    supports_role_switch = False

    def __init__(self, args: KVArgs, disaggregation_mode: DisaggregationMode, server_args: Any,
                 is_mla_backend: bool | None = False) -> None:
        self.kv_args = args
        self.disaggregation_mode = disaggregation_mode
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        if any(getattr(args, "state_data_ptrs", None) or []):
            raise RuntimeError("kvxfer does not transfer hybrid state buffers (mamba/SWA/DSA) yet")
        if int(getattr(server_args, "pp_size", 1) or 1) != 1:
            raise RuntimeError("kvxfer's SGLang backend does not support pipeline parallelism yet")
        self.layout = KVLayout.from_pointers(args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens,
                                             page_size=int(args.page_size))
        self.aux = [(int(p), int(n)) for p, n in zip(args.aux_data_ptrs or [], args.aux_item_lens or [])]
        self.aux_bytes = sum(n for _, n in self.aux)
        self.config = _engine_config(server_args, self.layout.pool_tokens)
        self.tp_size = int(getattr(server_args, "tp_size", 1) or 1)
        self.tp_rank = int(getattr(args, "engine_rank", 0) or 0) % self.tp_size
        self.bootstrap_port = int(getattr(server_args, "disaggregation_bootstrap_port", 8998))
        self._peers: dict[tuple[str, int], str] = {}
        # Decode: verified requests whose pages SGLang's model now reads (on the device), by
        # generation -> room. kvxfer keeps them READABLE, its read custody, until SGLang hands
        # those pages (or the room) to a new transfer, which shows SGLang freed the request.
        self._custody: dict[int, int] = {}
        self.engine: Any
        faults = None
        if os.environ.get("KVXFER_TEST_FAULTS") == "1":  # test-only; off unless explicitly set
            from ...transport.faults import FaultInjector

            faults = FaultInjector()
        if disaggregation_mode == DisaggregationMode.PREFILL:
            self.engine = PrefillEngine(self.layout, self.config, faults=faults)
            self.register_to_bootstrap()
        elif disaggregation_mode == DisaggregationMode.DECODE:
            self.engine = DecodeEngine(self.layout, self.config)
        else:
            raise ValueError(f"kvxfer manager for mode {disaggregation_mode!r}")

    # prefill: advertise; decode: discover ------------------------------------------------------
    def register_to_bootstrap(self) -> None:
        """PUT this rank's kvxfer control address into SGLang's bootstrap registry."""
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.server_args.host, self.server_args.host)
        address = self.engine.address.removeprefix("tcp://")
        rank_ip, _, rank_port = address.rpartition(":")
        payload = {
            "attn_tp_size": self.tp_size, "attn_tp_rank": self.tp_rank,
            "attn_cp_size": 1, "attn_cp_rank": 0,
            "attn_dp_size": 1, "attn_dp_rank": 0,
            "pp_size": 1, "pp_rank": 0,
            "system_dp_size": 1, "system_dp_rank": 0,
            "rank_ip": rank_ip, "rank_port": int(rank_port),
            "page_size": int(self.kv_args.page_size),
            "kv_cache_dtype": getattr(self.kv_args, "kv_cache_dtype_str", None) or "auto",
            "load_balance_method": "follow_bootstrap_room",
        }
        url = f"http://{host}:{self.bootstrap_port}/route"
        delay = 0.2
        for attempt in range(8):
            try:
                status, body = _http_json(url, method="PUT", payload=payload)
                if status == 200:
                    return
                log.warning("bootstrap registration answered %s: %s", status, body)
            except OSError as exc:
                log.warning("bootstrap server at %s not reachable (attempt %d): %s", url, attempt + 1, exc)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)
        raise RuntimeError(f"could not register with the bootstrap server at {url}")

    def peer_for(self, bootstrap_addr: str, prefill_dp_rank: int) -> str:
        """Connect (once) to the prefill rank paired with this decode rank; its kvxfer engine id."""
        key = (bootstrap_addr, int(prefill_dp_rank))
        peer = self._peers.get(key)
        if peer is not None and self.engine.receiver.peers.get(peer) is not None:
            return peer
        status, info = _http_json(f"http://{bootstrap_addr}/route?prefill_dp_rank=-1&prefill_cp_rank=-1"
                                  "&target_tp_rank=-1&target_pp_rank=-1")
        if status != 200 or not isinstance(info, dict):
            raise KvxferError(f"bootstrap server {bootstrap_addr} has no prefill registered yet ({status})")
        if int(info.get("attn_tp_size", 1)) != self.tp_size:
            raise KvxferError(f"prefill TP size {info.get('attn_tp_size')} != decode TP size {self.tp_size}: "
                              "kvxfer needs equal TP sizes")
        if int(info.get("page_size") or self.kv_args.page_size) != int(self.kv_args.page_size):
            raise KvxferError(f"prefill page size {info.get('page_size')} != decode {self.kv_args.page_size}")
        status, rank = _http_json(f"http://{bootstrap_addr}/route?prefill_dp_rank={int(prefill_dp_rank)}"
                                  f"&prefill_cp_rank=0&target_tp_rank={self.tp_rank}&target_pp_rank=0")
        if status != 200 or not isinstance(rank, dict):
            raise KvxferError(f"bootstrap server {bootstrap_addr}: no prefill rank {self.tp_rank} ({status})")
        peer = self.engine.connect(f"tcp://{rank['rank_ip']}:{rank['rank_port']}")
        self._peers[key] = peer
        return peer

    # deferred decode KV release ---------------------------------------------------------------
    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int = 0) -> bool:
        """True once kvxfer holds a drain proof for the room's pages or fenced their connection."""
        try:
            req = self.engine.status(bootstrap_room)
        except KvxferError:
            return True  # kvxfer holds nothing for this room
        return req.fsm.terminal

    def clear_deferred_abort_state(self, bootstrap_room: int) -> None:
        return None

    # read custody (decode) ----------------------------------------------------------------------
    def keep_custody(self, bootstrap_room: int, generation: int) -> None:
        """A verified request goes to SGLang's model: kvxfer holds its pages READABLE meanwhile."""
        self._custody[generation] = bootstrap_room

    def end_custody(self, *, bootstrap_room: int, pages: np.ndarray) -> None:
        """SGLang is about to transfer into ``pages`` for ``bootstrap_room``: it freed whichever held
        request owned those pages (or that room) before, so kvxfer's custody of them ends."""
        ledger = self.engine.pool.ledger
        with self.engine.lock:
            in_range = pages[(pages >= 0) & (pages < ledger.num_pages)]
            gens = {int(g) for g in ledger.generation[in_range]}
        for gen, room in list(self._custody.items()):
            if gen in gens or room == bootstrap_room:
                del self._custody[gen]
                try:
                    self.engine.release(room, generation=gen)
                except KvxferError as exc:  # already gone (a newer generation of the room, a close)
                    log.debug("custody of room %s generation %d: %s", room, gen, exc)

    # aux (metadata) rows ---------------------------------------------------------------------
    def read_aux(self, index: int) -> bytes:
        return b"".join(ctypes.string_at(ptr + index * n, n) for ptr, n in self.aux)

    def write_aux(self, index: int, data: bytes) -> None:
        if len(data) != self.aux_bytes:
            raise KvxferError(f"metadata row of {len(data)} bytes, this rank's rows are {self.aux_bytes}")
        offset = 0
        for ptr, n in self.aux:
            ctypes.memmove(ptr + index * n, data[offset : offset + n], n)
            offset += n

    def teardown(self) -> None:
        self.engine.close()

    def close(self) -> None:
        self.engine.close()


class KvxferKVSender(BaseKVSender):
    """The prefill side of one request (kvxfer request id = bootstrap_room)."""

    def __init__(self, mgr: KvxferKVManager, bootstrap_addr: str, bootstrap_room: int,
                 req_has_disagg_prefill_dp_rank: bool = False) -> None:
        self.kv_mgr = mgr
        self.engine: PrefillEngine = mgr.engine
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = int(bootstrap_room)
        self.status = _Status(KVPoll.Bootstrapping)
        self.num_kv_indices = 0
        self.aux_index: int | None = None
        self.sent_pages = 0
        self.failure: str | None = None
        self.started = time.monotonic()
        self.finished: float | None = None
        self.admitted = False

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        """The page count is known: kvxfer admission (rejects what can never fit)."""
        self.num_kv_indices = int(num_kv_indices)
        self.aux_index = aux_index
        try:
            self.engine.admit(self.bootstrap_room, self.num_kv_indices * self.kv_mgr.layout.page_size,
                              external_pages=True)
            self.admitted = True
        except KvxferError as exc:
            self._fail(f"{exc.code}: {exc}")

    def send(self, kv_indices: Any, state_indices: Any = None, num_kv_tokens: int | None = None, **_: Any) -> None:
        if self.status.value == KVPoll.Failed or not self.admitted:
            return
        if state_indices:
            self._fail("kvxfer does not transfer state buffers")
            self.engine.abort(self.bootstrap_room, "state buffers unsupported")
            return
        pages = np.asarray(kv_indices, dtype=np.int64).reshape(-1)
        last = self.sent_pages + len(pages) >= self.num_kv_indices
        aux = self.kv_mgr.read_aux(self.aux_index) if (last and self.aux_index is not None) else b""
        try:
            self.engine.send(self.bootstrap_room, pages, aux=aux)
            self.sent_pages += len(pages)
        except KvxferError as exc:
            self._fail(f"{exc.code}: {exc}")

    def poll(self) -> int:
        if self.status.value == KVPoll.Failed:
            return KVPoll.Failed
        if not self.admitted:
            rejection = self.engine.sender.peer_rejections.get(self.bootstrap_room)
            if rejection is not None:
                self._fail(f"rejected: decode rejected it: {rejection[0].detail}")
                return KVPoll.Failed
            if self.bootstrap_room in self.engine.sender.pending_meta:
                return self.status.advance(KVPoll.WaitingForInput)
            return self.status.value
        req = self.engine.status(self.bootstrap_room)
        state = req.state
        if self.engine.sender.settled(req):  # terminal and nothing in flight: sources reusable
            if state is S.SUCCEEDED:
                self.finished = self.finished or time.monotonic()
                return self.status.advance(KVPoll.Success)
            self._fail(f"{req.error.code}: {req.error}" if req.error is not None else state.value)
            return KVPoll.Failed
        if state in (S.ADMITTED, S.READY):
            return self.status.advance(KVPoll.WaitingForInput)
        return self.status.advance(KVPoll.Transferring)

    def _fail(self, reason: str) -> None:
        self.failure = self.failure or reason
        self.status.advance(KVPoll.Failed)

    def failure_exception(self) -> None:
        raise KVTransferError(self.bootstrap_room, self.failure or "kvxfer transfer failed")

    def get_transfer_metric(self) -> KVTransferMetric:
        try:
            req = self.engine.status(self.bootstrap_room)
        except KvxferError:
            return KVTransferMetric()
        latency = (self.finished - self.started) if self.finished else None
        return KVTransferMetric(transfer_latency_s=latency, transfer_total_bytes=req.bytes_posted)

    def abort(self) -> None:
        if self.admitted:
            try:
                self.engine.abort(self.bootstrap_room, "aborted by SGLang")
            except KvxferError:
                pass
        self._fail("aborted")

    def clear(self) -> None:
        return None


class KvxferKVReceiver(BaseKVReceiver):
    """The decode side of one request (kvxfer request id = bootstrap_room)."""

    require_staging = False

    def __init__(self, mgr: KvxferKVManager, bootstrap_addr: str, bootstrap_room: int | None = None) -> None:
        self.kv_mgr = mgr
        self.engine: DecodeEngine = mgr.engine
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = int(bootstrap_room or 0)
        self.status = _Status(KVPoll.Bootstrapping)
        self.conclude_state: int | None = None
        self.peer: str | None = None
        self.bootstrap_infos: list[dict[str, Any]] = []
        self.aux_index: int | None = None
        self.generation: int | None = None
        self.abort_notified = False
        self.failure: str | None = None
        self.released = False

    def init(self, prefill_dp_rank: int) -> None:
        try:
            self.peer = self.kv_mgr.peer_for(self.bootstrap_addr, prefill_dp_rank)
            self.bootstrap_infos = [{"peer": self.peer, "prefill_dp_rank": prefill_dp_rank}]
            self.status.advance(KVPoll.WaitingForInput)
        except KvxferError as exc:
            self._fail(f"{exc.code}: {exc}")

    def send_metadata(self, kv_indices: Any, aux_index: int | None = None, state_indices: Any = None,
                      decode_prefix_len: int | None = None, destination: Any = None) -> None:
        """The destination pages are known: kvxfer admission, reservation, META to the prefill."""
        if self.status.value == KVPoll.Failed:
            return
        if state_indices and any(s is not None for s in state_indices):
            self._fail("kvxfer does not transfer state buffers")
            return
        if destination is not None and str(getattr(destination, "value", destination)) != "device":
            self._fail("kvxfer transfers into the KV pool only (no host destinations)")
            return
        pages = np.asarray(kv_indices, dtype=np.int64).reshape(-1)
        self.aux_index = aux_index
        self.kv_mgr.end_custody(bootstrap_room=self.bootstrap_room, pages=pages)
        try:
            req = self.engine.admit(self.bootstrap_room, len(pages) * self.kv_mgr.layout.page_size,
                                    peer=self.peer, pages=pages)
            self.generation = req.gen
            self.status.advance(KVPoll.Transferring)
        except KvxferError as exc:
            self._fail(f"{exc.code}: {exc}")

    def poll(self) -> int:
        if self.status.value in (KVPoll.Failed, KVPoll.Success) or self.generation is None:
            return self.status.value
        try:
            req = self.engine.status(self.bootstrap_room)
        except KvxferError as exc:
            self._fail(str(exc))
            return KVPoll.Failed
        if req.gen != self.generation:
            self._fail(f"room {self.bootstrap_room} was reused (generation {req.gen}, expected {self.generation})")
            return KVPoll.Failed
        if req.state is R.READABLE:
            try:
                if self.aux_index is not None and req.aux:
                    self.kv_mgr.write_aux(self.aux_index, req.aux)
            except KvxferError as exc:
                self.engine.abort(self.bootstrap_room, str(exc))
                self._fail(str(exc))
                return KVPoll.Failed
            self._hand_over(req.gen)
            self.conclude_state = KVPoll.Success
            return self.status.advance(KVPoll.Success)
        if req.fsm.terminal or req.state is R.QUARANTINED:
            self._fail(f"{req.error.code}: {req.error}" if req.error is not None else req.state.value)
            return KVPoll.Failed
        return self.status.value

    def _hand_over(self, generation: int) -> None:
        """The verified pages now belong to SGLang's request, whose model reads them on the device.
        kvxfer keeps them READABLE (its custody) until SGLang reuses the pages or the room."""
        if not self.released:
            self.released = True
            self.kv_mgr.keep_custody(self.bootstrap_room, generation)

    def _fail(self, reason: str) -> None:
        self.failure = self.failure or reason
        self.conclude_state = KVPoll.Failed
        self.status.advance(KVPoll.Failed)

    def failure_exception(self) -> None:
        raise KVTransferError(self.bootstrap_room, self.failure or "kvxfer transfer failed")

    def abort(self) -> None:
        self.ensure_abort_notified()
        self._fail("aborted")

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        """Quarantine the room's pages and ask the writer to drain (kvxfer's abort)."""
        if self.abort_notified or self.generation is None:
            return
        self.abort_notified = True
        try:
            self.engine.abort(self.bootstrap_room, "aborted by SGLang")
        except KvxferError:
            pass

    def clear(self) -> None:
        return None


class KvxferKVBootstrapServer(CommonKVBootstrapServer):
    """SGLang's own bootstrap registry: kvxfer prefill ranks register their control addresses."""
