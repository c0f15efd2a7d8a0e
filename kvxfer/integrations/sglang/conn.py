"""SGLang's disaggregation transfer classes, implemented on kvxfer engines over SGLang's Common* classes.

* :class:`KvxferKVManager` (one per scheduler rank) is a ``CommonKVManager``: SGLang's own bookkeeping
  (``request_status``, ``failure_records``, ``prefill_info_table``, ``connection_pool``, the
  decode's heartbeat checker and node-failure handling, ``try_ensure_parallel_info``) drives what
  the schedulers see, and a kvxfer :class:`~kvxfer.PrefillEngine` / :class:`~kvxfer.DecodeEngine`
  over the rank's KV buffers (one kvxfer buffer per ``kv_data_ptrs`` entry, page ``p`` at
  ``ptr + p * item_len``) moves and verifies the pages. SGLang chooses the pages; kvxfer adopts them
  for a transfer's lifetime. The prefill registers its kvxfer control address in SGLang's bootstrap
  registry (``rank_ip``/``rank_port``), through Common's own registration, and the whole address
  (with its key, ``#curve=...``, when the engine has a keyring) as ``kvxfer_address`` beside them:
  a decode with a keyring connects only to an address that carries a key it trusts.
* :class:`KvxferKVSender` / :class:`KvxferKVReceiver` are ``CommonKVSender`` / ``CommonKVReceiver``
  whose kvxfer request id is the ``bootstrap_room`` (a reused room gets a new kvxfer generation, so an
  old room's messages never touch the new one). Each ``poll()`` first folds the kvxfer request's
  state into Common's status table, then runs Common's poll, so SGLang's bootstrap timeout (prefill)
  and waiting timeout (decode) apply unchanged.
* :class:`KvxferKVBootstrapServer` is SGLang's own HTTP registry, which also keeps and hands out each
  rank's ``kvxfer_address``.

The schedulers' contract, and how it is kept (SGLang 0.5.23's prefill.py and decode.py):

* ``KVPoll`` only moves forward and ``Failed`` is sticky (Common's ``update_status``);
  ``failure_exception()`` raises ``KVTransferError`` with the recorded reason.
* Size: kvxfer admission runs at the first call that sees it (``init`` on prefill, ``send_metadata``
  on decode); an over-capacity request fails there, on both roles, no byte moved.
* The chunk that reaches the page count given to ``init`` is the last: the metadata row (``aux_*``
  at ``aux_index``) travels inside DONE and lands in the decode's row only after verification.
  SGLang's early send under overlap scheduling hands over ``_early_send_wait_event``: the transport
  reads the source pages only after that event (and ``indices_event``) completed.
* A prefill sender aborted before admission refuses the room in kvxfer, so a decode that already
  reserved pages for it gets REJECT at once (also after SGLang's bootstrap timeout).
* Read custody: a verified request stays READABLE in kvxfer while SGLang's model reads its pages on
  the device; the custody ends when SGLang hands those pages, or the room, to a new transfer.
* Deferred decode KV release: ``is_abort_release_safe`` is true only after kvxfer has a drain proof
  for the aborted generation or fenced its connection; kvxfer's drain timeout is set below SGLang's
  deferred-release timeout, so SGLang's own timeout never frees a page kvxfer still guards.
* A dead prefill: kvxfer fails the requests on its data connection at once; SGLang's heartbeat
  checker forgets the bootstrap address, and the next request re-resolves it (a restarted prefill
  has a new kvxfer engine: the receiver re-peers when its cached peer is gone).

* Unequal attention TP: each rank's pool carries a geometry (:mod:`.layout`: its KV heads, head
  size, dtype, NHD order), so a decode rank takes every head it holds from the prefill ranks SGLang's
  rank mapping names (``bootstrap_infos``, in rank order): each writes its heads' slice of every page,
  a prefill rank none of whose heads it needs (MLA's other ranks) is told it writes nothing, and a
  prefill rank serving several decode ranks reports ``WaitingForInput`` only when all of their
  destinations arrived.
* A refusal reaches both halves: whatever the decode refuses before its admission (a prefill it
  cannot serve, a peering refused for its layout) it tells the prefill ranks of the request at once
  (:meth:`~kvxfer.DecodeEngine.refuse`), so their half fails within a second instead of at SGLang's
  bootstrap timeout.
* Trust: the decode's engine refuses, before opening anything, a prefill address it does not trust
  (with a keyring: one without a trusted key; without one: not loopback and not in
  ``KVXFER_TRUSTED_PREFILLS``). The request then fails at ``init`` with that reason, marked
  :data:`~.reasons.UNTRUSTED_PREFILL` so the client gets HTTP 403 (the package's hook); it never waits.

Refused at startup, naming the setting: DP attention or ``--dp-size`` above 1, context or pipeline
parallelism, decode-side context parallelism, hybrid state buffers, the decode radix cache
(``decode_prefix_len``), allocation policies other than ``early``. Refused at the first request to a
prefill, naming the reason: different page sizes or KV dtypes (SGLang's own check), prefill DP, CP or
PP above 1, sharded MLA KV (``--enable-kv-cache-sharding``), and unequal TP for a pool kvxfer cannot
describe (draft-model KV).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import time
from typing import Any

import numpy as np
from aiohttp import web
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
from sglang.srt.disaggregation.common.conn import (
    CommonKVBootstrapServer,
    CommonKVManager,
    CommonKVReceiver,
    CommonKVSender,
)
from sglang.srt.disaggregation.utils import DisaggregationMode

from ...core.arguments import check_host, parse_port, shown, split_control_address, split_tcp_endpoint
from ...core.geometry import fanout
from ...core.layout import KVLayout
from ...core.lifecycle import ReceiverState, SenderState
from ...engine import DecodeEngine, EngineConfig, PrefillEngine
from ...errors import AdmissionRejected, InvalidArgument, KvxferError, PeerError, TransferFailed
from ...wire.trust import refused_by_trust
from .layout import pool_geometry
from .reasons import ADMISSION_REFUSED, UNTRUSTED_PREFILL
from .settings import engine_config

log = logging.getLogger("kvxfer.sglang")


def reason_of(exc: KvxferError) -> str:
    """A failure reason for SGLang; admission refusals carry the mark that makes them HTTP 400."""
    prefix = f"{ADMISSION_REFUSED} " if isinstance(exc, AdmissionRejected) else ""
    return f"{prefix}{exc.code}: {exc}"

R, S = ReceiverState, SenderState


def rank_key(info: Any) -> tuple[str, int]:
    """A prefill rank's kvxfer control endpoint ``(rank_ip, rank_port)``, from an entry of SGLang's
    bootstrap registry (what a prefill registered over HTTP), by the strict rules of
    :mod:`kvxfer.core.arguments`: InvalidArgument names the field, never a ValueError or KeyError out
    of a scheduler call. ``rank_ip`` is kept as registered (``[v6]`` keeps its brackets)."""
    try:
        ip, port = info["rank_ip"], info["rank_port"]
    except (KeyError, IndexError, TypeError):
        raise InvalidArgument(f"bootstrap registry entry {shown(info)} has no rank_ip and rank_port") from None
    check_host(ip, "rank_ip")
    return ip, parse_port(port, "rank_port")


REGISTRY_ADDRESS = "kvxfer_address"  # a registry entry's whole kvxfer control address (keyed with a keyring)


def rank_endpoint(info: Any) -> str:
    """The kvxfer control address of a registry entry: its ``kvxfer_address`` when it has one (a kvxfer
    prefill registers it, with its key when it has a keyring), which must name the entry's own
    ``rank_ip``/``rank_port``; else ``tcp://rank_ip:rank_port`` (:func:`rank_key`). Strict
    (:func:`split_control_address`): InvalidArgument names the field."""
    ip, port = rank_key(info)
    address = info.get(REGISTRY_ADDRESS) if isinstance(info, dict) else None
    if address is None:
        return f"tcp://{ip}:{port}"
    host, at, _key = split_control_address(address, REGISTRY_ADDRESS)
    if (host.lower(), at) != (check_host(ip).lower(), port):
        raise InvalidArgument(f"{REGISTRY_ADDRESS} {shown(address)} does not name the entry's rank_ip:rank_port "
                              f"{shown(ip)}:{port}")
    return address


def rank_text(info: Any) -> str:
    """A registry entry's rank for a message: ``ip:port``, or the raw values when they are bad."""
    try:
        return "{}:{}".format(*rank_key(info))
    except InvalidArgument:
        return shown(info)


def _engine_config(server_args: Any, pool_tokens: int, rank: int) -> EngineConfig:
    """kvxfer settings for a scheduler rank: :func:`.settings.engine_config` over ``os.environ``."""
    return engine_config(server_args, pool_tokens, rank)


def _rank_geometry(args: KVArgs, server_args: Any, mode: DisaggregationMode, is_mla: bool) -> tuple[Any, str]:
    """This rank's pool as a KVGeometry (:func:`.layout.pool_geometry`), from SGLang's KV args, its
    parallel layout and the model's KV head count."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    tp_size = int(parallel.attn_tp_size or 1)
    tp_rank = int(getattr(args, "engine_rank", 0) or 0) % tp_size
    total = int(getattr(args, "total_kv_head_num", 0) or 0)
    if not total and not is_mla:
        try:
            from sglang.srt.runtime_context import process_model_config

            total = int(process_model_config().get_total_num_kv_heads())
        except Exception as exc:  # a pool without a model config: described no further
            log.debug("kvxfer: the model's KV head count is unknown: %s", exc)
    group = f"sglang-{mode.value}@{getattr(server_args, 'host', '')}:{getattr(server_args, 'port', '')}"
    return pool_geometry(item_lens=args.kv_item_lens, page_size=int(args.page_size), is_mla=is_mla,
                         total_heads=total, tp_rank=tp_rank, tp_size=tp_size,
                         dtype=str(getattr(args, "kv_cache_dtype_str", "") or ""), group=group,
                         extra_buffers=int(getattr(args, "num_draft_entries", 0) or 0))


def _fetch_prefill_info(bootstrap_addr: str) -> Any:
    """The prefill server's parallel layout from its bootstrap registry (as Common fetches it), or None."""
    import requests
    from sglang.srt.disaggregation.common.conn import PrefillServerInfo

    url = (f"http://{bootstrap_addr}/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1"
           "&target_pp_rank=-1")
    try:
        response = requests.get(url, timeout=5)
        return PrefillServerInfo(**response.json()) if response.status_code == 200 else None
    except Exception as exc:
        log.warning("prefill %s: cannot read its parallel layout: %s", bootstrap_addr, exc)
        return None


def unsupported_settings(args: KVArgs, server_args: Any, mode: DisaggregationMode) -> list[str]:
    """What this rank's SGLang configuration asks of kvxfer that it does not do (empty: nothing)."""
    problems = []
    checks = [
        ("dp_size", 1, "--dp-size"), ("attn_cp_size", 1, "--attn-cp-size"), ("pp_size", 1, "--pp-size"),
        ("dcp_size", 1, "--dcp-size"),
    ]
    for attr, allowed, flag in checks:
        value = int(getattr(server_args, attr, allowed) or allowed)
        if value != allowed:
            problems.append(f"{flag} {value} (kvxfer supports {allowed})")
    if getattr(server_args, "enable_dp_attention", False):
        problems.append("--enable-dp-attention (kvxfer supports one data-parallel rank)")
    if any(getattr(args, "state_data_ptrs", None) or []):
        problems.append("hybrid state buffers (mamba/SWA/DSA): kvxfer transfers KV pages only")
    policy = getattr(server_args, "disaggregation_decode_allocation_policy", "early") or "early"
    if policy != "early":
        problems.append(f"--disaggregation-decode-allocation-policy {policy} (kvxfer supports early)")
    if mode == DisaggregationMode.DECODE and getattr(server_args, "disaggregation_decode_enable_radix_cache", False):
        problems.append("--disaggregation-decode-enable-radix-cache (decode_prefix_len > 0): kvxfer transfers "
                        "whole prompts")
    return problems


class KvxferKVManager(CommonKVManager):
    """One scheduler rank's kvxfer engine inside SGLang's common transfer bookkeeping."""

    supports_deferred_decode_kv_release = True
    supports_role_switch = False

    def __init__(self, args: KVArgs, disaggregation_mode: DisaggregationMode, server_args: Any,
                 is_mla_backend: bool | None = False) -> None:
        problems = unsupported_settings(args, server_args, disaggregation_mode)
        if problems:
            raise RuntimeError("kvxfer transfer backend cannot serve this configuration: " + "; ".join(problems))
        self.geometry, self.no_geometry = _rank_geometry(args, server_args, disaggregation_mode, bool(is_mla_backend))
        if self.geometry is None:
            log.info("kvxfer: this rank's pool has no geometry (%s): prefill and decode need equal TP sizes",
                     self.no_geometry)
        self.layout = KVLayout.from_pointers(args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens,
                                             page_size=int(args.page_size), geometry=self.geometry)
        self.aux = [(int(p), int(n)) for p, n in zip(args.aux_data_ptrs or [], args.aux_item_lens or [])]
        self.aux_bytes = sum(n for _, n in self.aux)
        rank = int(getattr(args, "engine_rank", 0) or 0)
        self.config = _engine_config(server_args, self.layout.pool_tokens, rank)
        faults = None
        if os.environ.get("KVXFER_TEST_FAULTS") == "1":  # test-only; off unless explicitly set
            from ...transport.faults import FaultInjector

            faults = FaultInjector()
        self.engine: Any
        if disaggregation_mode == DisaggregationMode.PREFILL:
            self.engine = PrefillEngine(self.layout, self.config, faults=faults)
        elif disaggregation_mode == DisaggregationMode.DECODE:
            self.engine = DecodeEngine(self.layout, self.config)
        else:
            raise ValueError(f"kvxfer manager for mode {disaggregation_mode!r}")
        self.layerwise: Any = None  # prefill: the layer-wise sends' state (.layerwise), made at the first forward
        # decode: prefill rank (ip, port) -> kvxfer engine id; rooms aborted -> generation armed;
        # generation -> room held for SGLang (read custody); bootstrap address -> why unsupported
        self._peers: dict[tuple[str, int], str] = {}
        self._deferred: dict[int, int] = {}
        self._custody: dict[int, int] = {}
        self.unsupported_prefill: dict[str, str] = {}
        self._prefill_ranks: dict[tuple[str, int], list[str]] = {}  # bootstrap address -> rank addresses
        self.peering_error: dict[tuple[str, int], str] = {}  # prefill rank -> why its last peering failed
        self.untrusted_ranks: set[tuple[str, int]] = set()  # prefill ranks whose last peering trust refused
        try:
            super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
            # Common binds a PULL socket for its own messages; kvxfer's control plane replaces it.
            self.server_socket.close(linger=0)
            if disaggregation_mode == DisaggregationMode.DECODE:
                self._heartbeat_thread = self._start_heartbeat_checker_thread()
        except BaseException:
            self.engine.close()
            raise

    # prefill: advertise the kvxfer control address through Common's registration ------------------
    def register_to_bootstrap(self) -> None:
        endpoint = self.engine.address.split("#", 1)[0]
        _, port = split_tcp_endpoint(endpoint, "this engine's kvxfer control address")  # strict, as the decode reads it
        split_control_address(self.engine.address, "this engine's kvxfer control address")
        self.local_ip, self.rank_port = endpoint.removeprefix("tcp://").rpartition(":")[0], port
        super().register_to_bootstrap()

    def _register_topology_row(self, url: str, payload: dict[str, Any]) -> None:
        """Common's PUT of this rank's registry entry, with the whole kvxfer address (its key included)
        beside ``rank_ip``/``rank_port``: :class:`KvxferKVBootstrapServer` keeps it for the decodes."""
        super()._register_topology_row(url, {**payload, REGISTRY_ADDRESS: self.engine.address})

    # decode: prefill discovery, peering and failures ---------------------------------------------
    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """Common's lookup, with kvxfer's limits: a prefill kvxfer cannot serve is remembered with
        the reason, and its requests fail with that reason at ``init`` (the scheduler lives on)."""
        if bootstrap_addr in self.unsupported_prefill:
            return True
        try:
            if not super().try_ensure_parallel_info(bootstrap_addr):
                return False
        except (RuntimeError, AssertionError) as exc:  # Common's mismatch checks (page size, dtype, layout)
            # The scheduler resolves a request's prefill DP rank from the info table before it calls
            # init: without an entry the request would wait, unanswered, until the client gives up.
            info = _fetch_prefill_info(bootstrap_addr)
            if info is None:
                return False
            self.prefill_info_table[bootstrap_addr] = info
            self.unsupported_prefill[bootstrap_addr] = str(exc)
            log.error("prefill %s: %s", bootstrap_addr, exc)
            return True
        info = self.prefill_info_table[bootstrap_addr]
        problems = []
        if info.attn_tp_size != self.attn_tp_size and self.geometry is None:
            problems.append(f"prefill attention TP {info.attn_tp_size} != decode {self.attn_tp_size}, and kvxfer "
                            f"cannot describe this decode's pool ({self.no_geometry}), so it needs equal TP sizes")
        sizes = (int(info.attn_tp_size or 1), int(self.attn_tp_size))
        if max(sizes) % min(sizes):
            problems.append(f"prefill attention TP {sizes[0]} and decode {sizes[1]}: neither is a multiple of "
                            "the other")
        if getattr(info, "enable_kv_cache_sharding", False):
            problems.append("prefill --enable-kv-cache-sharding (sharded MLA KV): kvxfer moves whole latents")
        for name in ("dp_size", "attn_cp_size", "pp_size"):
            value = int(getattr(info, name, 1) or 1)
            if value != 1:
                problems.append(f"prefill {name} {value} (kvxfer supports 1)")
        if problems:
            self.unsupported_prefill[bootstrap_addr] = "; ".join(problems)
            log.error("prefill %s: %s", bootstrap_addr, "; ".join(problems))
        return True

    def prefill_ranks(self, bootstrap_addr: str, prefill_dp_rank: int = 0) -> list[str]:
        """The kvxfer control addresses of a prefill server's attention-TP ranks, from its bootstrap
        registry (cached): where a refusal goes when the rank mapping never ran (a prefill kvxfer
        cannot serve). Empty when the registry cannot be read."""
        cached = self._prefill_ranks.get((bootstrap_addr, prefill_dp_rank))
        if cached is not None:
            return cached
        import requests

        addresses: list[str] = []
        info = self.prefill_info_table.get(bootstrap_addr) or _fetch_prefill_info(bootstrap_addr)
        try:
            base = f"http://{bootstrap_addr}/route"
            for tp in range(int(getattr(info, "attn_tp_size", 1) or 1)):
                info = requests.get(f"{base}?prefill_dp_rank={prefill_dp_rank}&prefill_cp_rank=0&target_tp_rank={tp}"
                                    "&target_pp_rank=0", timeout=5).json()
                addresses.append(rank_endpoint(info))
        except Exception as exc:  # the refusal then reaches the prefill at its bootstrap timeout only
            log.warning("prefill %s: cannot read its ranks from the bootstrap registry: %s", bootstrap_addr, exc)
            return []
        self._prefill_ranks[(bootstrap_addr, prefill_dp_rank)] = addresses
        return addresses

    def refuse(self, room: int, addresses: list[str], reason: str, detail: str) -> None:
        """Tell each prefill rank at ``addresses`` that this decode will not take ``room``, so the
        request's prefill half fails at once (:meth:`kvxfer.DecodeEngine.refuse`)."""
        for address in addresses:
            try:
                self.engine.refuse(room, address, reason=reason, detail=detail)
            except KvxferError as exc:  # an untrusted prefill is told nothing, by design: no warning for it
                level = logging.DEBUG if refused_by_trust(exc) else logging.WARNING
                log.log(level, "room %s: could not tell prefill %s that it is refused: %s", room, address, exc)

    def submit_prefill_recompute(self, kv_receiver: Any, payload: Any) -> None:
        """PD retraction rebootstrap (the prefill recomputes a retracted request): not supported."""
        kv_receiver.fail("kvxfer does not support PD retraction rebootstrap; run decode with "
                         "--disaggregation-decode-retraction-backup none or without retraction")

    def connect_rank(self, info: dict[str, Any]) -> str | None:
        """The live kvxfer peer of a prefill rank (``rank_ip``/``rank_port`` from the registry),
        peering with it first if needed; None (and the reason logged) when it cannot be reached."""
        try:
            key, address = rank_key(info), rank_endpoint(info)
        except InvalidArgument as exc:
            log.warning("prefill rank %s: %s", rank_text(info), exc)
            try:
                self.peering_error[rank_key(info)] = exc.detail
            except InvalidArgument:
                pass
            return None
        peer = self.live_peer(info)
        if peer is not None:
            return peer
        try:  # an address this decode does not trust is refused here, before anything is opened
            peer = self.engine.connect(address, timeout=10.0)
        except KvxferError as exc:
            log.warning("prefill rank %s:%s: %s", *key, exc)
            self.peering_error[key] = exc.detail
            if refused_by_trust(exc):
                self.untrusted_ranks.add(key)
            else:
                self.untrusted_ranks.discard(key)
            return None
        self.peering_error.pop(key, None)
        self.untrusted_ranks.discard(key)
        self._peers[key] = peer
        return peer

    def live_peer(self, info: dict[str, Any]) -> str | None:
        try:
            peer = self._peers.get(rank_key(info))
        except InvalidArgument:
            return None
        return peer if peer is not None and self.engine.peer_connected(peer) else None

    def peering_problem(self, info: dict[str, Any]) -> str:
        """Why :meth:`connect_rank` returned None for ``info``: a bad registry entry, or the last peering
        error with that rank."""
        try:
            key = rank_key(info)
        except InvalidArgument as exc:
            return exc.detail
        return self.peering_error.get(key, "no answer")

    def untrusted(self, info: dict[str, Any]) -> bool:
        """Whether :meth:`connect_rank` returned None for ``info`` because this decode does not trust its
        address (refused before anything was opened), not because it could not be reached."""
        try:
            return rank_key(info) in self.untrusted_ranks
        except InvalidArgument:
            return False

    def _handle_node_failure(self, failed_bootstrap_addr: str) -> None:
        """Common's handling (rooms failed, caches dropped), and the address re-resolved next time."""
        self.unsupported_prefill.pop(failed_bootstrap_addr, None)
        for key in [k for k in self._prefill_ranks if k[0] == failed_bootstrap_addr]:
            del self._prefill_ranks[key]
        super()._handle_node_failure(failed_bootstrap_addr)

    # deferred decode KV release --------------------------------------------------------------------
    def arm_deferred_release(self, bootstrap_room: int, generation: int) -> None:
        self._deferred[bootstrap_room] = generation

    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int = 0) -> bool:
        """True once kvxfer holds a drain proof for the aborted generation's pages or fenced their
        connection (``required_acks`` is Common's ack count; kvxfer's proof is per generation)."""
        generation = self._deferred.get(bootstrap_room)
        with self.engine.lock:
            req = self.engine.receiver.by_gen.get(generation) if generation is not None else None
            if req is None:
                try:
                    req = self.engine.status(bootstrap_room)
                except KvxferError:
                    return True  # kvxfer holds nothing for this room
            return req.fsm.terminal

    def clear_deferred_abort_state(self, bootstrap_room: int) -> None:
        self._deferred.pop(bootstrap_room, None)

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

    def close(self) -> None:
        """Stop the heartbeat checker, the engine and Common's sockets (idempotent)."""
        shutdown = getattr(self, "_heartbeat_shutdown", None)
        if shutdown is not None:
            shutdown.set()
        self.engine.close()
        if not self._zmq_ctx.closed:
            self._zmq_ctx.term()

    teardown = close


class KvxferKVSender(CommonKVSender):
    """The prefill side of one request (kvxfer request id = bootstrap_room)."""

    def __init__(self, mgr: KvxferKVManager, bootstrap_addr: str, bootstrap_room: int,
                 req_has_disagg_prefill_dp_rank: bool = False) -> None:
        super().__init__(mgr, bootstrap_addr, bootstrap_room, req_has_disagg_prefill_dp_rank)
        self.engine: PrefillEngine = mgr.engine
        self.admitted = False
        self.sent_pages = 0  # pages SGLang handed to send() so far (positions 0 .. sent_pages-1)
        self.num_kv_indices = 0
        self.layer_tokens = 0  # tokens the layer-wise plans covered so far (:mod:`.layerwise`)
        self.layerwise_failed = ""  # why a layer-wise send was refused: the rest of the request goes whole

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        """The page count is known: kvxfer admission (rejects what can never fit)."""
        super().init(num_kv_indices, aux_index)
        try:
            # any_peer: SGLang's router pairs prefill and decode per request, so the decode is not
            # known here; the room is a random 63-bit id, and with keyrings only trusted decodes speak
            self.engine.admit(self.bootstrap_room, int(num_kv_indices) * self.kv_mgr.layout.page_size,
                              external_pages=True, any_peer=True)
            self.admitted = True
        except KvxferError as exc:
            self.fail(reason_of(exc))

    def send(self, kv_indices: Any, state_indices: Any = None, num_kv_tokens: int | None = None,
             indices_event: Any = None, **_: Any) -> None:
        if self.conclude_state in (KVPoll.Success, KVPoll.Failed) or not self.admitted:
            return
        wait_event, self._early_send_wait_event = self._early_send_wait_event, None
        if state_indices and any(s is not None for s in state_indices):
            self.engine.abort(self.bootstrap_room, "state buffers unsupported")
            self.fail("kvxfer does not transfer state buffers")
            return
        pages = np.asarray(kv_indices, dtype=np.int64).reshape(-1)
        if pages.size == 0:  # SGLang's final call with no new pages: DONE went with the chunk that reached the count
            if self.sent_pages >= self.num_kv_indices:
                self._finish_if_all_sent()
            return
        req = self.engine.status(self.bootstrap_room)
        if req.state is S.SUCCEEDED and not req.writing:
            return  # every decode rank takes this rank's heads from another prefill rank (MLA): nothing to send
        last = self.sent_pages + len(pages) >= self.num_kv_indices
        aux = self.kv_mgr.read_aux(self.aux_index) if (last and self.aux_index is not None) else b""
        if self._transfer_start_time is None:
            self._transfer_start_time = time.perf_counter()
        try:
            self._send_positions(pages, ready=_Both.of(wait_event, indices_event))
            if last:
                self.engine.finish(self.bootstrap_room, aux=aux)
        except KvxferError as exc:
            try:  # stop what was posted: its pages stay guarded until the decode has a drain proof
                self.engine.abort(self.bootstrap_room, f"send failed: {exc.detail}")
            except KvxferError:
                pass
            self.fail(f"{exc.code}: {exc}")
            return
        self.sent_pages += len(pages)
        self._record_transfer_indices(pages, None)

    def _finish_if_all_sent(self) -> None:
        """DONE for a request whose every page went (layer by layer) and whose DONE is still held."""
        req = self.engine.status(self.bootstrap_room)
        if req.state in (S.READY, S.TRANSFERRING) and req.sent == req.total_pages:
            aux = self.kv_mgr.read_aux(self.aux_index) if self.aux_index is not None else b""
            try:
                self.engine.finish(self.bootstrap_room, aux=aux)
            except KvxferError as exc:
                self.fail(f"{exc.code}: {exc}")

    def _send_positions(self, pages: np.ndarray, *, ready: Any) -> None:
        """SGLang's chunk ``pages`` is positions ``sent_pages ..``: every buffer already past it (sent
        layer by layer during the forward, :mod:`.layerwise`) must hold exactly these pages there, and
        every buffer not yet there gets the rest of the chunk now (all of it, without layer-wise sends).
        DONE waits for :meth:`~kvxfer.PrefillEngine.finish`: the metadata row exists only now."""
        first, end = self.sent_pages, self.sent_pages + len(pages)
        with self.engine.lock:
            req = self.engine.status(self.bootstrap_room)
            positions = req.buffer_sent.copy() if req.buffer_sent is not None else None
            order = req.order.copy() if req.order is not None else None
        if positions is None:  # nothing sent yet: the whole chunk in every buffer
            self.engine.send(self.bootstrap_room, pages, ready=ready, finish=False, at=first)
            return
        known = order[first:end]
        seen = known >= 0
        differ = np.flatnonzero(seen & (known != pages[: known.size]))
        if differ.size:
            at = int(differ[0])
            raise TransferFailed(f"the pages sent layer by layer for positions {first}..{end - 1} are not the pages "
                                 f"SGLang sends there (position {first + at}: page {int(known[at])} went layer by "
                                 f"layer, SGLang sends page {int(pages[at])}; {differ.size} of {known.size} differ)",
                                 reason="layerwise_mismatch", rid=self.bootstrap_room)
        for position in sorted({int(p) for p in positions}):
            if position >= end:
                continue
            if position < first:
                raise TransferFailed(f"buffers at position {position}, behind the {first} pages sent before this "
                                     "chunk", reason="layerwise_mismatch", rid=self.bootstrap_room)
            buffers = np.flatnonzero(positions == position)
            self.engine.send(self.bootstrap_room, pages[position - first:], ready=ready, buffers=buffers,
                             finish=False, at=position)

    def poll(self) -> int:
        self._sync()
        return super().poll()

    def _sync(self) -> None:
        """Fold the kvxfer request's state into Common's status table."""
        if self.conclude_state is not None:
            return
        room, mgr, sender = self.bootstrap_room, self.kv_mgr, self.engine.sender
        if not self.admitted:
            with self.engine.lock:
                rejection = sender.peer_rejections.get(room)
                pending = sender.pending_meta.get(room, [])
                # every decode rank this prefill rank serves for the request has sent its destination
                known = bool(pending) and len(pending) >= fanout(
                    self.engine.layout.geometry, self.engine._peer_layout(pending[0][0])[1])
            if rejection is not None:
                self.fail(f"{ADMISSION_REFUSED} rejected: decode rejected it: {rejection[0].detail}")
            elif known:
                mgr.update_status(room, KVPoll.WaitingForInput)
            return
        req = self.engine.status(room)
        if sender.settled(req):  # terminal and nothing in flight: SGLang may reuse the source pages
            if req.state is S.SUCCEEDED:
                mgr.update_status(room, KVPoll.Success)
            else:
                self.fail(reason_of(req.error) if req.error is not None else req.state.value)
        elif req.state is S.READY:
            mgr.update_status(room, KVPoll.WaitingForInput)
        elif req.state is S.ADMITTED:  # some decode ranks' destinations have not arrived yet
            mgr.update_status(room, KVPoll.Bootstrapping)
        else:
            mgr.update_status(room, KVPoll.Transferring)

    def _check_bootstrap_timeout(self) -> Any:
        """Common's bootstrap timeout, and then kvxfer refuses the room so a late destination is
        answered with REJECT at once."""
        status = super()._check_bootstrap_timeout()
        if status == KVPoll.Failed and not self.admitted:
            self.engine.refuse(self.bootstrap_room, "bootstrap_timeout", "the prefill's bootstrap timed out")
        return status

    def fail(self, reason: str) -> None:
        self.kv_mgr.record_failure(self.bootstrap_room, reason)
        self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)

    def abort(self) -> None:
        try:
            if self.admitted:
                self.engine.abort(self.bootstrap_room, "aborted by SGLang")
            else:
                self.engine.refuse(self.bootstrap_room, "aborted", "SGLang aborted the request before admission")
        except KvxferError as exc:
            log.debug("abort of room %s: %s", self.bootstrap_room, exc)
        super().abort()


class KvxferKVReceiver(CommonKVReceiver):
    """The decode side of one request (kvxfer request id = bootstrap_room)."""

    require_staging = False

    def __init__(self, mgr: KvxferKVManager, bootstrap_addr: str, bootstrap_room: int | None = None) -> None:
        super().__init__(mgr, bootstrap_addr, int(bootstrap_room or 0))
        self.engine: DecodeEngine = mgr.engine
        self.peers: list[str] | None = None
        self.aux_index: int | None = None
        self.generation: int | None = None
        self.handed_over = False

    @property
    def peer(self) -> str | None:
        return self.peers[0] if self.peers else None

    def init(self, prefill_dp_rank: int) -> None:
        """Common's lookup of the prefill ranks (registry, connection pool), then their kvxfer peers;
        a cached rank whose kvxfer engine is gone (a restarted prefill) is looked up again once. A
        prefill this decode will not serve is told so at once."""
        reason = self.kv_mgr.unsupported_prefill.get(self.bootstrap_addr)
        if reason is not None:
            self._refuse(f"prefill at {self.bootstrap_addr} is not supported: {reason}",
                         self.kv_mgr.prefill_ranks(self.bootstrap_addr, int(prefill_dp_rank or 0)))
            return
        super().init(prefill_dp_rank)
        if self.conclude_state is not None or self.bootstrap_infos is None:
            return
        self.peers = self._live_peers()
        if self.peers is None:
            self.invalidate_cached_bootstrap_infos()
            self._setup_bootstrap_infos()
            if self.conclude_state is None and self.bootstrap_infos is not None:
                self.peers = self._live_peers()
        if self.peers is None and self.conclude_state is None:
            self._refuse(f"cannot reach the prefill's kvxfer engines at {self._addresses()}", self._addresses())

    def _targets(self) -> list[dict[str, Any]]:
        """The prefill ranks this rank takes KV from, in rank order (SGLang's mapping; the ones SGLang
        marks dummy included: kvxfer tells them they write nothing)."""
        targets = list(self.bootstrap_infos or [])
        if not targets:
            raise KvxferError("the bootstrap registry names no prefill rank to pull from")
        return targets

    def _addresses(self) -> list[str]:
        """The kvxfer control endpoints of the prefill ranks in ``bootstrap_infos`` (a bad entry left out:
        nothing can be told there)."""
        addresses = []
        for info in self.bootstrap_infos or []:
            try:
                addresses.append(rank_endpoint(info))
            except InvalidArgument:
                continue
        return addresses

    def _live_peers(self) -> list[str] | None:
        peers = [self.kv_mgr.live_peer(info) for info in self._targets()]
        return None if any(p is None for p in peers) else peers  # type: ignore[return-value]

    def _register_kv_args(self) -> bool:
        """Common registers this rank with the prefill ranks it pulls from: for kvxfer that is peering
        (HELLO, then the data connection) with each. A refused peering (the two layouts cannot be
        paired) fails the request on both halves."""
        if not self.bootstrap_infos:
            return self.bootstrap_infos is not None
        for info in self._targets():
            if self.kv_mgr.connect_rank(info) is None:
                why = self.kv_mgr.peering_problem(info)
                mark = f"{UNTRUSTED_PREFILL} " if self.kv_mgr.untrusted(info) else ""  # answered 403
                self._refuse(f"{mark}cannot peer with the prefill's kvxfer engine at {rank_text(info)}: {why}",
                             self._addresses())
                return False
        return True

    def _refuse(self, reason: str, addresses: list[str]) -> None:
        """Fail this rank's half and tell the prefill ranks, so theirs fails at once too."""
        self.kv_mgr.refuse(self.bootstrap_room, addresses, "refused", reason)
        self.fail(reason)

    def send_metadata(self, kv_indices: Any, aux_index: int | None = None, state_indices: Any = None,
                      decode_prefix_len: int | None = None, destination: Any = None, **_: Any) -> None:
        """The destination pages are known: kvxfer admission, reservation, META to the prefill."""
        if self.conclude_state == KVPoll.Failed or not self.peers:
            return
        if state_indices and any(s is not None for s in state_indices):
            self.fail("kvxfer does not transfer state buffers")
            return
        if destination is not None and str(getattr(destination, "value", destination)) != "device":
            self.fail("kvxfer transfers into the KV pool only (no host destinations)")
            return
        if decode_prefix_len:
            self.fail(f"decode_prefix_len {decode_prefix_len}: kvxfer transfers whole prompts "
                      "(run decode without --disaggregation-decode-enable-radix-cache)")
            return
        pages = np.asarray(kv_indices, dtype=np.int64).reshape(-1)
        self.aux_index = aux_index
        self.kv_mgr.end_custody(bootstrap_room=self.bootstrap_room, pages=pages)
        try:
            req = self.engine.admit(self.bootstrap_room, len(pages) * self.kv_mgr.layout.page_size,
                                    peers=self.peers, pages=pages)
        except PeerError as exc:  # the prefill went away since init: look it up again next time
            self.invalidate_cached_bootstrap_infos()
            self.fail(f"{exc.code}: {exc}")
            return
        except KvxferError as exc:
            self.fail(reason_of(exc))
            return
        self.generation = req.gen
        self.init_time = time.time()  # Common's waiting timeout runs from here

    def poll(self) -> int:
        self._sync()
        return super().poll()

    def _sync(self) -> None:
        """Fold the kvxfer request's state into Common's status table (READABLE: write the metadata
        row, keep custody, Success)."""
        if self.conclude_state is not None or self.generation is None:
            return
        try:
            req = self.engine.status(self.bootstrap_room)
        except KvxferError as exc:
            self.fail(str(exc))
            return
        if req.gen != self.generation:
            self.fail(f"room {self.bootstrap_room} was reused (generation {req.gen}, expected {self.generation})")
            return
        if req.state is R.READABLE:
            try:
                if self.aux_index is not None and req.aux:
                    self.kv_mgr.write_aux(self.aux_index, req.aux)
            except KvxferError as exc:
                self.engine.abort(self.bootstrap_room, str(exc))
                self.fail(str(exc))
                return
            if not self.handed_over:
                self.handed_over = True
                self.kv_mgr.keep_custody(self.bootstrap_room, req.gen)
            self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Success)
        elif req.fsm.terminal or req.state is R.QUARANTINED:
            self.fail(reason_of(req.error) if req.error is not None else req.state.value)

    def fail(self, reason: str) -> None:
        self.kv_mgr.record_failure(self.bootstrap_room, reason)
        self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
        self.conclude_state = KVPoll.Failed

    def _send_abort_notification(self, *, force_arm: bool = False) -> None:
        """Common calls this on abort and on the waiting timeout: kvxfer quarantines the room's pages
        and asks the writer to drain (deferred release waits for the proof or a fence)."""
        if self.generation is None:
            return
        self.kv_mgr.arm_deferred_release(self.bootstrap_room, self.generation)
        try:
            self.engine.abort(self.bootstrap_room, "aborted by SGLang", generation=self.generation)
        except KvxferError as exc:
            log.debug("abort of room %s: %s", self.bootstrap_room, exc)

    def is_abort_release_safe(self) -> bool:
        return self.kv_mgr.is_abort_release_safe(self.bootstrap_room)


class _Both:
    """Wait on two optional events (SGLang's early-send event and its indices event)."""

    def __init__(self, *events: Any) -> None:
        self.events = [e for e in events if e is not None]

    @classmethod
    def of(cls, *events: Any) -> Any:
        present = [e for e in events if e is not None]
        return None if not present else present[0] if len(present) == 1 else cls(*present)

    def wait(self) -> None:
        for event in self.events:
            (getattr(event, "synchronize", None) or event.wait)()


class KvxferKVBootstrapServer(CommonKVBootstrapServer):
    """SGLang's own bootstrap registry: kvxfer prefill ranks register their control addresses.

    SGLang keeps ``rank_ip``/``rank_port`` of each rank; this registry also keeps the ``kvxfer_address`` a
    kvxfer prefill sends with them (the same endpoint, with the engine's key when it has a keyring) and
    adds it to the rank's entry it hands a decode. Kept by ``(rank_ip, rank_port)``: a rank registering
    again (a restarted prefill) replaces it. The decode checks it strictly (:func:`rank_endpoint`) and
    connects only if it trusts the key; the registry vouches for nothing."""

    MAX_ADDRESS = 512  # characters; a keyed IPv6 address is under 150

    def __init__(self, host: str, port: int) -> None:
        self._kvxfer_addresses: dict[tuple[str, str], str] = {}  # (rank_ip, rank_port) -> kvxfer address
        super().__init__(host, port)  # starts serving: the table must exist first

    async def _handle_route_put(self, request: Any) -> Any:
        response = await super()._handle_route_put(request)
        if response.status == 200:
            data = await request.json()  # aiohttp keeps the body: the same JSON Common read
            address = data.get(REGISTRY_ADDRESS)
            key = (str(data.get("rank_ip")), str(data.get("rank_port")))
            async with self.lock:
                if isinstance(address, str) and len(address) <= self.MAX_ADDRESS:
                    self._kvxfer_addresses[key] = address
                else:
                    self._kvxfer_addresses.pop(key, None)
        return response

    async def _handle_route_get(self, request: Any) -> Any:
        response = await super()._handle_route_get(request)
        if response.status != 200 or getattr(response, "content_type", "") != "application/json":
            return response
        entry = json.loads(response.text)
        if not isinstance(entry, dict) or "rank_ip" not in entry:
            return response  # the server-wide info, not a rank's entry
        async with self.lock:
            address = self._kvxfer_addresses.get((str(entry.get("rank_ip")), str(entry.get("rank_port"))))
        if address is None:
            return response
        return web.json_response({**entry, REGISTRY_ADDRESS: address}, status=200)
