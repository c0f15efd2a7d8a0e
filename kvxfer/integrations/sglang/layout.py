"""What a scheduler rank's KV pool holds, as a :class:`~kvxfer.core.geometry.KVGeometry` (importable
without SGLang).

SGLang hands a transfer backend its pool as ``kv_data_ptrs`` / ``kv_item_lens`` (per layer K, then
per layer V, for MHA pools; one latent buffer per layer for MLA), each page ``page_size`` tokens of the
rank's KV heads in ``[token][head][dim]`` order (NHD). With the rank's share of the heads (SGLang
splits ``total // attn_tp_size`` heads per rank, replicating a head over ``attn_tp_size // total``
ranks when there are fewer heads than ranks) that is a geometry, and kvxfer can move KV between
prefill and decode servers of different attention TP sizes. A pool this module cannot describe
(draft-model entries, items that are not whole heads) gets no geometry: kvxfer then pairs pages one to
one, which needs equal TP sizes, and says so when a peer's differs.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...core.geometry import BufferGeometry, KVGeometry, heads_of_rank
from ...errors import ConfigError


def pool_geometry(*, item_lens: Sequence[int], page_size: int, is_mla: bool, total_heads: int,
                  tp_rank: int, tp_size: int, dtype: str, group: str, extra_buffers: int = 0) -> tuple[KVGeometry | None, str]:
    """The geometry of a rank's pool, or None and why not."""
    items = [int(n) for n in item_lens]
    if extra_buffers:
        return None, f"{extra_buffers} draft-model KV buffers beside the model's"
    if not items or page_size < 1:
        return None, "no KV buffers"
    if is_mla:
        if any(n % page_size for n in items):
            return None, "MLA items are not whole tokens"
        buffers = [BufferGeometry(layer, "latent", 0, 1, 1, n // page_size, dtype or "unknown")
                   for layer, n in enumerate(items)]
        return KVGeometry(tuple(buffers), tp_rank=tp_rank, tp_size=tp_size, group=group), ""
    if total_heads < 1:
        return None, "the model's KV head count is unknown"
    if len(items) % 2:
        return None, f"{len(items)} KV buffers: not K and V per layer"
    try:
        first, count = heads_of_rank(total_heads, tp_size, tp_rank)
    except ConfigError as exc:
        return None, exc.detail
    if any(n % (page_size * count) for n in items):
        return None, f"items of {sorted(set(items))} B are not {page_size} tokens x {count} heads"
    layers = len(items) // 2
    buffers = [BufferGeometry(i % layers, "k" if i < layers else "v", first, count, total_heads,
                              n // (page_size * count), dtype or "unknown") for i, n in enumerate(items)]
    return KVGeometry(tuple(buffers), tp_rank=tp_rank, tp_size=tp_size, group=group), ""
