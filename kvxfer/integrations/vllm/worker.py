"""The worker half of kvxfer's vLLM connector: one kvxfer engine per worker, over vLLM's KV blocks.

A prefill worker owns a :class:`~kvxfer.PrefillEngine`, a decode worker a
:class:`~kvxfer.DecodeEngine`, over the layer tensors vLLM registers (one kvxfer buffer per layer, or
per layer and K/V where K and V are separate planes; kvxfer page ``p`` is vLLM block ``p``). vLLM's
allocator chooses the blocks; kvxfer adopts them for one transfer. Jobs arrive in the step's connector
metadata (:class:`~.scheduler.StepJobs`); results leave through ``get_transfer_results`` and the
worker metadata (failure reasons). Decode worker rank r takes its KV from prefill worker rank r.

Invariants:

* prefill: a request's blocks are reported in ``finished_sending`` (vLLM may free and reuse them) only
  when kvxfer's request is *settled*: terminal and every write and DONE's checksum read done. After that
  the request is refused in kvxfer, so its ``kv_transfer_params`` cannot be used a second time (a
  replayed destination gets REJECT at once);
* decode: a request is reported in ``finished_recving`` only when kvxfer's request is terminal, and as
  loaded only if it was READABLE (coverage, bytes and checksum verified) *and* the prompt binding DONE
  carried equals this request's; in every other case it is also in ``failed_recving`` with its reason.
  A request aborted mid-transfer stays unreported (its blocks held by vLLM) until the writer's drain
  proof or a fence made kvxfer's request terminal: no late write can land in a block vLLM reuses;
* a verified load is released in kvxfer at once (free policy ``keep``): the blocks are vLLM's again,
  and they are FREE in kvxfer's ledger when vLLM hands them to the next transfer;
* peering (which can wait on a dead prefill) runs on the worker's own thread, never in vLLM's step;
* decode: nothing is opened toward an address this decode does not trust (:mod:`.trust`). The engine
  refuses such an address in :meth:`~kvxfer.DecodeEngine.connect` before any socket, and that refusal
  answers the load 403 ``untrusted_prefill``, as the scheduler half does when it sees it first; a layout
  refusal is told only to the prefill addresses this decode trusts.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...core.layout import KVLayout
from ...core.lifecycle import ReceiverState, SenderState
from ...engine import DecodeEngine, EngineConfig, PrefillEngine
from ...errors import ConfigError, KvxferError
from ...wire.trust import refused_by_trust
from .outcomes import LoadFailure, classify
from .scheduler import LoadJob, SendJob, StepJobs
from .trust import PrefillTrust, untrusted

log = logging.getLogger("vllm.kvxfer.worker")
R, S = ReceiverState, SenderState
TERMINAL_R = (R.REJECTED, R.FAILED, R.ABORTED, R.RELEASED)


def layout_of(kv_caches: dict[str, Any], num_blocks: int, block_size: int) -> KVLayout:
    """kvxfer's view of vLLM's per-layer KV tensors: block ``b`` of every buffer is page ``b``.

    A tensor whose first dimension is the block count is one buffer (vLLM's CPU layout,
    ``(blocks, kv_heads, block_size, 2 * head_size)``); one shaped ``(2, blocks, ...)`` is two (K and V
    planes). Each block must be contiguous."""
    ptrs, lens, items = [], [], []
    for name, tensor in kv_caches.items():
        planes = [tensor] if tensor.shape[0] == num_blocks else \
            [tensor[0], tensor[1]] if tensor.dim() > 1 and tensor.shape[0] == 2 and tensor.shape[1] == num_blocks \
            else None
        if planes is None:
            raise ConfigError(f"kvxfer: KV cache of layer {name} has shape {tuple(tensor.shape)}; expected "
                              f"({num_blocks} blocks, ...) or (2, {num_blocks} blocks, ...)")
        for plane in planes:
            item = plane.stride(0) * plane.element_size()
            if not plane[0].is_contiguous() or plane[0].numel() * plane.element_size() != item:
                raise ConfigError(f"kvxfer: a block of layer {name} is not contiguous (strides {plane.stride()})")
            ptrs.append(plane.data_ptr())
            lens.append(item * num_blocks)
            items.append(item)
    device = "cpu" if next(iter(kv_caches.values())).device.type == "cpu" else "cuda"
    return KVLayout.from_pointers(ptrs, lens, items, page_size=block_size, device=device)


@dataclass
class _Load:
    job: LoadJob
    generation: int | None = None  # kvxfer's generation once admitted
    aborted: bool = False  # vLLM finished the request (client gone, timeout) while loading
    failure: LoadFailure | None = None
    done: bool = False  # peering thread is finished with it (admitted or failed)


class WorkerSide:
    """kvxfer's connector state in one vLLM worker."""

    def __init__(self, *, producer: bool, config: EngineConfig, tp_rank: int, peer_timeout: float = 10.0,
                 tp_size: int = 1) -> None:
        self.producer, self.config, self.tp_rank, self.tp_size = producer, config, int(tp_rank), int(tp_size)
        self.peer_timeout = peer_timeout
        self.engine: Any = None
        self.trust: PrefillTrust | None = None  # decode: the engine's trust settings, for what it tells prefills
        self.lock = threading.Lock()
        self.sends: dict[str, SendJob] = {}
        self.posted: set[str] = set()
        self.loads: dict[str, _Load] = {}
        self.reasons: dict[str, LoadFailure] = {}  # recorded this step, for the scheduler
        self.stats: Counter[str] = Counter()
        self._peers: dict[str, str] = {}  # prefill address -> kvxfer peer id
        self._jobs: queue.Queue[Any] = queue.Queue()
        self._thread: threading.Thread | None = None

    # startup -----------------------------------------------------------------------------------------
    def register(self, layout: KVLayout) -> None:
        if self.producer:
            self.engine = PrefillEngine(layout, self.config)
        else:
            self.engine = DecodeEngine(layout, self.config)
            self.trust = PrefillTrust.from_config(self.config, self.engine.control.keyring)
            self._thread = threading.Thread(target=self._peering, name=f"kvxfer-vllm-peering-{self.tp_rank}",
                                            daemon=True)
            self._thread.start()
        log.info("kvxfer %s engine %s at %s over %s: %d blocks x %d buffers", self.engine.role, self.engine.engine_id,
                 self.engine.address, self.config.transport, layout.num_pages, layout.num_buffers)

    @property
    def address(self) -> str:
        return str(self.engine.address)

    # jobs of a step --------------------------------------------------------------------------------
    def take(self, jobs: StepJobs) -> None:
        for send in jobs.sends:
            self._start_send(send)
        for load in jobs.loads:
            entry = _Load(job=load)
            with self.lock:
                self.loads[load.request_id] = entry
            if load.failure is not None:
                entry.failure, entry.done = load.failure, True
                if load.failure.reason == "unsupported_layout":
                    self._refuse(load)
            else:
                self._jobs.put(entry)
        for rid in jobs.aborts:
            self._abort_load(rid)

    def _refuse(self, load: LoadJob) -> None:
        """This decode will never take the request's KV (its layout): tell the prefill ranks, so their
        half fails now and vLLM frees its blocks there, instead of at meta_timeout. Rank r tells prefill
        rank r; rank 0 also those no decode rank matches. Only addresses this decode trusts are told
        (the params are a client's): the others are skipped before the engine sees them, so they cost
        neither a socket nor a log line each."""
        params = load.params
        if params is None or self.engine is None:
            return
        addresses = list(params.addresses)
        mine = [addresses[self.tp_rank]] if self.tp_rank < len(addresses) else []
        if self.tp_rank == 0:
            mine += addresses[self.tp_size:]
        mine = list(dict.fromkeys(mine))
        trusted = [a for a in mine if self.trust is None or self.trust.problem(a) is None]
        if len(trusted) < len(mine):
            self.stats["refusal_untrusted_skipped"] += len(mine) - len(trusted)
            log.debug("kvxfer: request %s refused (%s); %d of its %d prefill address(es) are not trusted and are "
                      "not told", params.request_id, load.failure.reason, len(mine) - len(trusted), len(mine))
        for address in trusted:
            try:
                self.engine.refuse(params.request_id, address, reason="unsupported_layout", detail=load.failure.text)
                self.stats["refused_layout"] += 1
            except KvxferError as exc:
                log.warning("kvxfer: could not tell prefill %s that request %s is refused: %s", address,
                            params.request_id, exc)

    def _start_send(self, job: SendJob) -> None:
        try:
            # any_peer: the decode is chosen per request by the router; the request id is vLLM's (random),
            # the prompt binding inside DONE makes the KV useless to any other prompt, and the first
            # destination binds it (with KVXFER_KEYRING only trusted decodes can send one)
            self.engine.admit(job.request_id, job.tokens, external_pages=True, any_peer=True)
        except KvxferError as exc:
            log.warning("kvxfer: request %s not sent: %s", job.request_id, exc)
            self.stats["send_refused"] += 1
        self.sends[job.request_id] = job

    def _abort_load(self, rid: str) -> None:
        with self.lock:
            entry = self.loads.get(rid)
            if entry is None:
                return
            entry.aborted = True
            generation = entry.generation
        if generation is not None:
            try:
                self.engine.abort(entry.job.params.request_id, "vLLM finished the request while loading",
                                  generation=generation)
            except KvxferError as exc:
                log.debug("kvxfer: abort of %s: %s", rid, exc)

    # decode peering thread ------------------------------------------------------------------------
    def _peering(self) -> None:
        while True:
            entry = self._jobs.get()
            if entry is None:
                return
            try:
                self._admit(entry)
            except Exception as exc:  # never lose a load: report it failed
                log.exception("kvxfer: load of %s", entry.job.request_id)
                entry.failure = LoadFailure(503, "internal", f"kvxfer connector error: {exc}")
            finally:
                entry.done = True

    def _peer(self, address: str) -> str:
        peer = self._peers.get(address)
        if peer is not None and self.engine.peer_connected(peer):
            return peer
        peer = self.engine.connect(address, timeout=self.peer_timeout)
        self._peers[address] = peer
        return peer

    def _admit(self, entry: _Load) -> None:
        job = entry.job
        params = job.params
        assert params is not None
        if entry.aborted:
            return
        address = params.addresses[self.tp_rank]
        try:
            peer = self._peer(address)  # the engine refuses an untrusted address before opening anything
        except KvxferError as exc:
            if refused_by_trust(exc):
                entry.failure = untrusted(address, str(exc))
                return
            entry.failure = LoadFailure(503, "prefill_unreachable", f"cannot reach the prefill's kvxfer engine "
                                                                    f"at {address}: {exc}")
            return
        try:
            req = self.engine.admit(params.request_id, job.tokens, peer=peer,
                                    pages=np.asarray(job.block_ids, dtype=np.int64))
        except KvxferError as exc:
            entry.failure = classify(exc)
            return
        with self.lock:
            entry.generation = req.gen
            aborted = entry.aborted
        if aborted:
            self._abort_load(job.request_id)

    # results -------------------------------------------------------------------------------------
    def results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) of this step."""
        if self.producer:
            return self._sent(), set(), set()
        finished, failed = self._loaded()
        return set(), finished, failed

    def _sent(self) -> set[str]:
        done = set()
        sender = self.engine.sender
        for rid, job in list(self.sends.items()):
            try:
                req = self.engine.status(rid)
            except KvxferError:
                req = None
            if req is not None and req.state is S.READY and rid not in self.posted:
                self.posted.add(rid)
                try:
                    self.engine.send(rid, np.asarray(job.block_ids, dtype=np.int64), aux=job.binding)
                except KvxferError as exc:
                    log.warning("kvxfer: request %s: %s", rid, exc)
                    self.engine.abort(rid, f"send failed: {exc}")
            if req is None or sender.settled(req):
                done.add(rid)
                del self.sends[rid]
                self.posted.discard(rid)
                outcome = "never_admitted" if req is None else req.state.value.lower()
                if req is not None and req.error is not None and getattr(req.error, "reason", "") == "timeout":
                    outcome = "abandoned"  # no decode asked for it within meta_timeout: blocks back to vLLM
                self.stats[f"sent_{outcome}"] += 1
                if outcome != "succeeded":
                    log.warning("kvxfer: request %s %s (%s); its %d blocks go back to vLLM (%s so far: %d)", rid,
                                outcome, req.error if req is not None else "not admitted", len(job.block_ids),
                                outcome, self.stats[f"sent_{outcome}"])
                try:  # single use: a destination for this request from now on gets REJECT at once
                    self.engine.refuse(rid, "consumed", "the KV of this request was already delivered, refused "
                                                        "or expired: kv_transfer_params can be used once")
                except KvxferError:
                    pass
        return done

    def _loaded(self) -> tuple[set[str], set[str]]:
        finished, failed = set(), set()
        with self.lock:
            entries = [e for e in self.loads.values() if e.done]
        for entry in entries:
            job = entry.job
            failure = entry.failure
            if failure is None:
                try:
                    req = self.engine.status(job.params.request_id)
                except KvxferError as exc:
                    failure = classify(exc)
                    req = None
                if req is not None:
                    if req.gen != entry.generation:
                        failure = LoadFailure(400, "duplicate", f"another load of request "
                                              f"{job.params.request_id!r} replaced this one")
                    elif req.state is R.READABLE:
                        if req.aux != job.binding:
                            failure = LoadFailure(400, "prompt_mismatch", "kv_transfer_params name KV computed "
                                                  f"for another prompt (request {job.params.request_id!r}); "
                                                  "none of it is used")
                            self.stats["binding_refused"] += 1
                        self.engine.release(job.params.request_id, generation=req.gen)
                    elif req.state in TERMINAL_R:
                        failure = classify(req.error)
                        if failure.status >= 500:
                            failure = LoadFailure(failure.status, failure.reason, f"from the prefill at "
                                                  f"{job.params.addresses[self.tp_rank]}: {failure.text}")
                    else:
                        continue  # in flight, verifying, or quarantined until drained or fenced
            with self.lock:
                del self.loads[job.request_id]
            finished.add(job.request_id)
            if failure is None:
                self.stats["loaded"] += 1
            elif entry.aborted:
                self.stats["load_aborted"] += 1
            else:
                self.stats[f"load_failed_{failure.reason}"] += 1
                failed.add(job.request_id)
                self.reasons[job.request_id] = failure
        return finished, failed

    def take_reasons(self) -> dict[str, LoadFailure]:
        reasons, self.reasons = self.reasons, {}
        return reasons

    def close(self) -> None:
        """Stop the peering thread and the engine (idempotent)."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout=5)
            self._thread = None
        if self.engine is not None:
            self.engine.close()
