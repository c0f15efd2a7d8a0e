"""Layer-wise sends in SGLang's PD prefill: each layer's KV leaves as the forward passes that layer.

In SGLang's PD flow the decode's destination reaches the prefill (bootstrap) before the prefill's
forward runs, so each layer's pages can be sent as soon as that layer's attention wrote them, hiding
the transfer behind the layers still to compute. Nothing of SGLang is edited; two hooks do it:

* an AROUND hook on ``Scheduler.run_batch`` (through SGLang's plugin ``HookRegistry``, registered by
  :func:`kvxfer.integrations.sglang.register`) plans, before an extend batch's forward, which pages
  of which kvxfer request the forward completes (:func:`plan_for`: the chunk's whole pages, and the
  partial last page with the last chunk, as SGLang's own ``send_kv_chunk`` will cut them), and
  installs, once per scheduler, a torch forward hook on every ``RadixAttention`` module;
* that forward hook, after layer ``l``'s attention wrote its KV into the pool, sends layer ``l`` of
  every planned request (``PrefillEngine.send_layer`` with ``finish=False``, at the position the plan
  starts, with a CUDA event recorded on the forward's stream as the layer's ``ready`` on GPUs).

After the forward SGLang calls the sender's ``send(kv_indices)`` as always
(:meth:`~kvxfer.integrations.sglang.conn.KvxferKVSender.send`): every buffer already past the chunk
is checked to hold exactly those pages, every buffer not yet there (a layer whose hook did not fire:
a CUDA-graph replay, a model whose attention is not RadixAttention) is sent then, and the last chunk
posts DONE with the metadata row, which exists only after the forward (its first output token).
So a layer-wise send never changes what is sent, only when; a plan that disagrees with SGLang's pages
fails the request with a reason instead of sending anything wrong.

What stays whole-request: prompts shorter than ``layerwise_min_tokens`` (``KVXFER_LAYERWISE_MIN_TOKENS``,
see ``kvxfer bench --ttft``), ``KVXFER_LAYERWISE=0``, a pool without a geometry (no layers known),
requests still bootstrapping, decode-side prefix reuse (refused at startup anyway), and a forward's pages
from the first one the radix cache may swap for a page of its own after the forward (a repeated prompt,
the same prefix in another request of the batch: :func:`replaceable_from`). Those go whole after it.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import KvxferError

log = logging.getLogger("kvxfer.sglang")
_HOOKED = "_kvxfer_layer_hooks"
NEVER = 1 << 62  # :func:`replaceable_from`: no page of the request can be swapped


@dataclass
class Planned:
    """One request's share of a forward: its sender, and the pages of positions ``base ..`` the forward
    completes (``pages[i]`` is position ``base + i``)."""

    sender: Any
    base: int
    pages: np.ndarray
    sent_layers: set[int]


def plan_for(req: Any, *, page_size: int, start_tokens: int, token_rows: Any, translate: Any = None) -> tuple[int, Any]:
    """The positions a forward completes for ``req``: ``(first position, kv indices)``, the kv
    indices of the tokens from ``start_tokens`` (page-aligned) to the chunk's end (whole pages only,
    unless this is the request's last chunk), or ``(first, None)`` when there is nothing."""
    total = len(req.origin_input_ids)
    end = min(int(req.extend_end), total)
    if end < total:
        end -= end % page_size  # SGLang holds a partial page back until the next chunk
    if end <= start_tokens:
        return start_tokens // page_size, None
    indices = token_rows[req.kv.req_pool_idx, start_tokens:end]
    if translate is not None:
        indices = translate(indices)
    return start_tokens // page_size, indices


def replaceable_from(scheduler: Any, batch: Any, req: Any, *, page_size: int) -> int:
    """The first position of ``req`` whose page SGLang may swap after the forward, or ``NEVER``.

    The prefill's radix cache, when it takes a request's computed pages (its checkpoint, right before
    the post-forward send), frees every computed page whose tokens the tree already holds and points
    the request's row at the tree's page instead. A layer-wise send read the freed page, SGLang then
    sends the tree's, and the freed page can be reused while a write still reads it. So no computed
    page that can be swapped goes layer by layer. The computed pages start at the tree-owned prefix
    (``cache_protected_len``); since the tree holds whole pages by token prefix, the first computed
    page can be swapped exactly when its whole prefix is held by the tree now (a repeated prompt: the
    match leaves the last page to compute) or by another request of this batch or of the one before
    (their checkpoints can come first; the previous batch's under the overlap scheduler). 0 when the
    tree cannot be asked (another SGLang): the request goes whole rather than on a guess."""
    tree = getattr(scheduler, "tree_cache", None)
    if tree is None or getattr(tree, "disable", False):
        return NEVER
    computed = -(-int(getattr(req.kv, "cache_protected_len", req.prefix_len)) // page_size)
    need = (computed + 1) * page_size  # tokens a swap of the first computed page needs held
    tokens = req.origin_input_ids
    if need > len(tokens):
        return NEVER  # its first computed page is the partial last one: the tree holds no partial page
    mine = np.asarray(tokens[:need], dtype=np.int64)
    for other in (q for b in (batch, getattr(scheduler, "last_batch", None)) if b is not None
                  for q in (getattr(b, "reqs", None) or ()) if q is not req):
        theirs = other.origin_input_ids
        if len(theirs) >= need and np.array_equal(np.asarray(theirs[:need], dtype=np.int64), mine):
            return computed
    try:
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.common import _req_radix_key

        # (a match may split a tree node and refresh access times: what SGLang's own matching does)
        held = tree.match_prefix(MatchPrefixParams(key=_req_radix_key(tree, req, tokens[:need]))).device_prefix_len
    except Exception as exc:
        log.debug("radix match for a layer-wise plan failed, the request goes whole: %s", exc)
        return 0
    return computed if int(held) >= need else NEVER


class LayerwiseSends:
    """The layer-wise state of one prefill scheduler: what the forward now running completes."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.planned: list[Planned] = []
        self.layers_hooked = 0
        self.sends = 0

    # before the forward ------------------------------------------------------------------------------
    def plan(self, scheduler: Any, batch: Any) -> None:
        from sglang.srt.mem_cache.common import kv_to_page_indices

        from .conn import KvxferKVSender

        engine, config = self.manager.engine, self.manager.config
        page_size = int(self.manager.layout.page_size)
        allocator = scheduler.token_to_kv_pool_allocator
        translate = getattr(allocator, "translate_kv_indices_for_transfer", None)
        rows = scheduler.req_to_token_pool.req_to_token
        self.planned = []
        for req in batch.reqs:
            sender = getattr(req, "disagg_kv_sender", None)
            if not isinstance(sender, KvxferKVSender) or not sender.admitted or getattr(req, "pending_bootstrap", False):
                continue
            if len(req.origin_input_ids) < config.layerwise_min_tokens or sender.layerwise_failed:
                continue
            try:
                state = engine.status(sender.bootstrap_room).state
            except KvxferError:
                continue
            if state.value not in ("READY", "TRANSFERRING"):
                continue
            start = max(int(req.start_send_idx), sender.layer_tokens)
            base, indices = plan_for(req, page_size=page_size, start_tokens=start, token_rows=rows, translate=translate)
            if indices is None:
                continue
            pages = np.asarray(kv_to_page_indices(indices, page_size), dtype=np.int64)
            keep = replaceable_from(scheduler, batch, req, page_size=page_size) - base
            if keep < len(pages):
                log.debug("room %s: positions %d.. may be swapped for the tree's pages after the forward: they go "
                          "whole", sender.bootstrap_room, base + max(keep, 0))
                if keep <= 0:
                    continue
                pages = pages[:keep]
            sender.layer_tokens = (base + len(pages)) * page_size
            self.planned.append(Planned(sender, base, pages, set()))

    # during the forward -------------------------------------------------------------------------------
    def layer_written(self, layer: int) -> None:
        """Layer ``layer``'s attention has written its KV of this forward: send it for every planned request."""
        if not self.planned:
            return
        engine = self.manager.engine
        geometry = self.manager.layout.geometry
        try:
            buffers = geometry.layer_buffers(layer)
        except Exception:  # a layer the pool does not hold (a draft model's): the post-forward send covers it
            return
        ready = _layer_event()
        for item in self.planned:
            if layer in item.sent_layers:  # MLA's two attention modules share a layer id
                continue
            item.sent_layers.add(layer)
            room = item.sender.bootstrap_room
            with engine.lock:
                req = engine.status(room)
                position = int(req.buffer_sent[buffers[0]]) if req.buffer_sent is not None else 0
            offset = position - item.base
            if not 0 <= offset < len(item.pages):
                continue  # before the plan (an earlier chunk not sent yet) or already past it
            try:
                engine.send_layer(room, layer, item.pages[offset:], ready=ready, finish=False, at=position)
                self.sends += 1
            except KvxferError as exc:  # the post-forward send tells SGLang; nothing wrong was sent
                log.warning("room %s layer %d: layer-wise send refused, sending whole: %s", room, layer, exc)
                item.sender.layerwise_failed = str(exc)

    # after the forward --------------------------------------------------------------------------------
    def done(self) -> None:
        self.planned = []


def _layer_event() -> Any:
    """A CUDA event recorded on the current stream (the forward's) after this layer's kernels, or None
    on the CPU (the KV is written when the hook runs)."""
    try:
        import torch
    except ImportError:  # pragma: no cover - SGLang needs torch
        return None
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def _install_layer_hooks(scheduler: Any, state: LayerwiseSends) -> int:
    """A forward hook on every RadixAttention of the scheduler's model, once; how many."""
    from sglang.srt.layers.radix_attention import RadixAttention

    model = scheduler.tp_worker.model_runner.model
    if getattr(model, _HOOKED, None) is not None:
        return int(getattr(model, _HOOKED))
    owner = weakref.ref(state)
    count = 0
    for module in model.modules():
        if isinstance(module, RadixAttention):
            layer = int(module.layer_id) - int(getattr(scheduler.tp_worker.model_runner, "start_layer", 0) or 0)

            def hook(_module: Any, _args: Any, _output: Any, layer: int = layer) -> None:
                live = owner()
                if live is not None:
                    live.layer_written(layer)

            module.register_forward_hook(hook)
            count += 1
    setattr(model, _HOOKED, count)
    return count


def around_run_batch(original: Any, scheduler: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    """``Scheduler.run_batch`` with layer-wise sends planned around an extend batch of a kvxfer prefill."""
    state = _state_of(scheduler, batch)
    if state is None:
        return original(scheduler, batch, *args, **kwargs)
    try:
        state.plan(scheduler, batch)
    except Exception as exc:  # never fail a forward for a plan: the post-forward sends go whole
        log.warning("kvxfer layer-wise plan failed, this batch goes whole: %s", exc)
        state.planned = []
    try:
        return original(scheduler, batch, *args, **kwargs)
    finally:
        state.done()


def _state_of(scheduler: Any, batch: Any) -> LayerwiseSends | None:
    """The layer-wise state of a kvxfer prefill scheduler, for an extend batch; None otherwise."""
    from sglang.srt.disaggregation.utils import DisaggregationMode

    if getattr(scheduler, "disaggregation_mode", None) != DisaggregationMode.PREFILL or batch is None:
        return None
    mode = getattr(batch, "forward_mode", None)
    if mode is None or not mode.is_extend():
        return None
    queue = getattr(scheduler, "disagg_prefill_bootstrap_queue", None)
    manager = getattr(queue, "kv_manager", None)
    from .conn import KvxferKVManager

    if not isinstance(manager, KvxferKVManager) or not manager.config.layerwise or manager.layout.geometry is None:
        return None
    state = manager.layerwise
    if state is None:
        state = manager.layerwise = LayerwiseSends(manager)
        state.layers_hooked = _install_layer_hooks(scheduler, state)
        log.info("kvxfer: layer-wise sends on, %d attention layers hooked (prompts of %d tokens and more)",
                 state.layers_hooked, manager.config.layerwise_min_tokens)
    return state
