"""What a page of each KV buffer holds, head by head, and which writer owes a receiver which heads.

A :class:`~kvxfer.core.layout.KVLayout` says where each page of each buffer lies; a
:class:`KVGeometry` says what a page *is*: per buffer the layer, whether it holds K, V or an MLA
latent, which KV heads of how many this rank holds, bytes per head per token, the dtype and the
in-page order (``NHD``: ``[token][head][byte]``, ``HND``: ``[head][token][byte]``), and where the
engine sits in its tensor-parallel group. Engines exchange it at peering (HELLO / HELLO_ACK), so a
prefill and a decode with different tensor parallelism or page sizes agree on every byte, and a pair
kvxfer cannot translate between is refused then, naming both layouts.

Invariants:

* every buffer of one geometry holds the same heads (``head_start``, ``head_count`` of
  ``total_heads``): one tensor-parallel split per engine; an MLA latent is one head of one, held by
  every rank (replicated);
* a buffer's bytes per page are ``page_size * head_count * head_bytes``;
* two geometries pair buffer ``b`` with buffer ``b``: the same layers and kinds in the same order,
  the same total heads, head size, dtype and order; page sizes and TP sizes each one a multiple of
  the other (:func:`pair_problem`);
* a receiver takes each head it holds from exactly one writer: the first, in the order the caller
  gives its writers, that holds it (:func:`plan_legs`); a writer's share is an interval of heads,
  possibly empty (it then writes nothing, and is told so);
* which receiver ranks a writer rank serves, and so how many destinations one request has on the
  writer, follows the deployments' rule (SGLang's, vLLM's): with receiver TP ``k`` times the writer's,
  receiver rank ``r`` takes from writer rank ``r // k``; with writer TP ``k`` times the receiver's,
  from writer ranks ``r*k .. r*k+k-1`` (:func:`serves`, :func:`fanout`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError

ORDERS = ("NHD", "HND")
KINDS = ("k", "v", "latent")
MAX_DTYPE = 32
MAX_GROUP = 256


def heads_of_rank(total_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """``(first head, count)`` a rank holds under the usual split (SGLang's and vLLM's): ``total // tp``
    heads each; with more ranks than heads, each head is replicated on ``tp // total`` consecutive ranks."""
    if total_heads < 1 or tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ConfigError(f"no head split for rank {tp_rank} of {tp_size} over {total_heads} heads")
    per_rank = max(1, total_heads // tp_size)
    replicas = max(1, tp_size // total_heads)
    return (tp_rank // replicas) * per_rank, per_rank


@dataclass(frozen=True)
class BufferGeometry:
    """What one buffer's page holds: ``head_count`` heads (from ``head_start``, of ``total_heads``) of
    ``head_bytes`` bytes per token each, in ``order``, for ``layer``'s ``kind`` (``k``, ``v`` or
    ``latent``)."""

    layer: int
    kind: str
    head_start: int
    head_count: int
    total_heads: int
    head_bytes: int
    dtype: str
    order: str = "NHD"

    def __post_init__(self) -> None:
        for name in ("layer", "head_start", "head_count", "total_heads", "head_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"buffer geometry: {name} must be a non-negative integer, got {value!r}")
        if self.kind not in KINDS:
            raise ConfigError(f"buffer geometry: kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if self.order not in ORDERS:
            raise ConfigError(f"buffer geometry: order {self.order!r} is not one of {', '.join(ORDERS)}")
        if not isinstance(self.dtype, str) or not 0 < len(self.dtype) <= MAX_DTYPE:
            raise ConfigError(f"buffer geometry: dtype must be a name of 1..{MAX_DTYPE} characters")
        if self.head_count < 1 or self.total_heads < 1 or self.head_bytes < 1:
            raise ConfigError("buffer geometry: head_count, total_heads and head_bytes must be at least 1")
        if self.head_start + self.head_count > self.total_heads:
            raise ConfigError(f"buffer geometry: heads {self.head_start}..{self.head_start + self.head_count - 1} "
                              f"outside the {self.total_heads} heads")
        if self.kind == "latent" and (self.head_start, self.head_count, self.total_heads) != (0, 1, 1):
            raise ConfigError("buffer geometry: an MLA latent is one head of one (every rank holds it whole)")

    @property
    def key(self) -> tuple[int, str]:
        return (self.layer, self.kind)

    @property
    def heads(self) -> tuple[int, int, int]:
        return (self.head_start, self.head_count, self.total_heads)

    def item_len(self, page_size: int) -> int:
        """Bytes of one page of this buffer."""
        return int(page_size) * self.head_count * self.head_bytes

    def wire(self) -> list[Any]:
        return [self.layer, self.kind, self.head_start, self.head_count, self.total_heads, self.head_bytes,
                self.dtype, self.order]


@dataclass(frozen=True)
class KVGeometry:
    """Every buffer's :class:`BufferGeometry`, in layout order, and the engine's place in its
    tensor-parallel group (``tp_rank`` of ``tp_size``; ``group`` names the group, so a writer can tell
    the ranks of one receiving server from another's)."""

    buffers: tuple[BufferGeometry, ...]
    tp_rank: int = 0
    tp_size: int = 1
    group: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "buffers", tuple(self.buffers))
        if not self.buffers or not all(isinstance(b, BufferGeometry) for b in self.buffers):
            raise ConfigError("a KV geometry needs at least one BufferGeometry")
        for name in ("tp_rank", "tp_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"KV geometry: {name} must be an integer, got {value!r}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError(f"KV geometry: tp_rank {self.tp_rank} outside a group of {self.tp_size}")
        if not isinstance(self.group, str) or len(self.group) > MAX_GROUP:
            raise ConfigError(f"KV geometry: group must be a string of at most {MAX_GROUP} characters")
        keys = [b.key for b in self.buffers]
        if len(set(keys)) != len(keys):
            raise ConfigError("KV geometry: two buffers describe the same layer and kind")
        heads = {b.heads for b in self.buffers}
        if len(heads) != 1:
            raise ConfigError(f"KV geometry: buffers hold different heads ({sorted(heads)}); kvxfer needs one "
                              "tensor-parallel split per engine (MLA latents and per-head K/V are not mixed)")

    # construction ---------------------------------------------------------------------------------
    @classmethod
    def attention(cls, *, layers: int, total_heads: int, head_dim: int, itemsize: int, dtype: str,
                  tp_rank: int = 0, tp_size: int = 1, order: str = "NHD", group: str = "",
                  head_start: int | None = None, head_count: int | None = None) -> KVGeometry:
        """Per-head K and V: one K buffer per layer, then one V buffer per layer (SGLang's
        ``kv_data_ptrs`` order). The rank's heads follow :func:`heads_of_rank` unless given."""
        if head_start is None or head_count is None:
            head_start, head_count = heads_of_rank(total_heads, tp_size, tp_rank)
        bufs = [BufferGeometry(layer, kind, head_start, head_count, total_heads, head_dim * itemsize, dtype, order)
                for kind in ("k", "v") for layer in range(layers)]
        return cls(tuple(bufs), tp_rank=tp_rank, tp_size=tp_size, group=group)

    @classmethod
    def latent(cls, *, layers: int, token_bytes: int, dtype: str, tp_rank: int = 0, tp_size: int = 1,
               group: str = "") -> KVGeometry:
        """MLA: one latent buffer per layer, ``token_bytes`` per token, the same on every rank."""
        bufs = [BufferGeometry(layer, "latent", 0, 1, 1, token_bytes, dtype) for layer in range(layers)]
        return cls(tuple(bufs), tp_rank=tp_rank, tp_size=tp_size, group=group)

    # queries --------------------------------------------------------------------------------------
    @property
    def heads(self) -> tuple[int, int, int]:
        """``(first head, count, total)``, the same for every buffer."""
        return self.buffers[0].heads

    @property
    def order(self) -> str:
        return self.buffers[0].order

    @property
    def layers(self) -> list[int]:
        """The layers the buffers hold, in first-buffer order."""
        return list(dict.fromkeys(b.layer for b in self.buffers))

    def layer_buffers(self, layer: int) -> list[int]:
        """The indices of the buffers of ``layer`` (its K and V, or its latent): one layer-wise send."""
        found = [i for i, b in enumerate(self.buffers) if b.layer == layer]
        if not found:
            raise ConfigError(f"the layout has no buffer of layer {layer!r} (layers {self.layers[0]}.."
                              f"{self.layers[-1]})")
        return found

    def check_items(self, page_size: int, item_lens: Sequence[int]) -> None:
        """Raise unless the geometry describes exactly these buffers' bytes per page."""
        if len(item_lens) != len(self.buffers):
            raise ConfigError(f"geometry describes {len(self.buffers)} buffers, the layout has {len(item_lens)}")
        for index, (spec, item) in enumerate(zip(self.buffers, item_lens)):
            if spec.item_len(page_size) != int(item):
                raise ConfigError(
                    f"buffer {index} ({spec.kind} of layer {spec.layer}): {page_size} tokens x {spec.head_count} "
                    f"heads x {spec.head_bytes} B = {spec.item_len(page_size)} B/page, the layout has {int(item)}")

    def describe(self, page_size: int) -> str:
        """``"TP rank 1 of 2, heads 4..7 of 8, 2 layers K+V, 128 B/head/token bfloat16 NHD, 16 tokens/page"``."""
        first, count, total = self.heads
        kinds = "+".join(k.upper() if k != "latent" else "MLA latent" for k in dict.fromkeys(b.kind for b in self.buffers))
        layers = len({b.layer for b in self.buffers})
        sizes = sorted({b.head_bytes for b in self.buffers})
        dtypes = "/".join(sorted({b.dtype for b in self.buffers}))
        heads = f"heads {first}..{first + count - 1} of {total}" if kinds != "MLA latent" else "replicated"
        group = f" ({self.group})" if self.group else ""
        return (f"TP rank {self.tp_rank} of {self.tp_size}{group}, {heads}, {layers} layer"
                f"{'s' if layers != 1 else ''} {kinds}, {'/'.join(map(str, sizes))} B/head/token {dtypes} "
                f"{self.order}, {page_size} tokens/page")

    # wire form ------------------------------------------------------------------------------------
    def wire(self) -> list[Any]:
        """``[tp_rank, tp_size, group, [[layer, kind, head_start, head_count, total_heads, head_bytes,
        dtype, order], ...]]`` (HELLO / HELLO_ACK ``geometry``; ``[]`` for a layout without one)."""
        return [self.tp_rank, self.tp_size, self.group, [b.wire() for b in self.buffers]]

    @classmethod
    def from_wire(cls, value: Any) -> KVGeometry | None:
        """The geometry a peer sent, or None for ``[]``; raises ValueError/TypeError on anything else."""
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"geometry must be an array, got {type(value).__name__}")
        if not value:
            return None
        if len(value) != 4 or not isinstance(value[3], (list, tuple)):
            raise ValueError("geometry must be [tp_rank, tp_size, group, buffers]")
        tp_rank, tp_size, group, buffers = value
        if not buffers or len(buffers) > 65536:
            raise ValueError("geometry must describe 1..65536 buffers")
        specs = []
        for entry in buffers:
            if not isinstance(entry, (list, tuple)) or len(entry) != 8:
                raise ValueError("a buffer geometry is [layer, kind, head_start, head_count, total_heads, "
                                 "head_bytes, dtype, order]")
            for i in (0, 2, 3, 4, 5):
                if isinstance(entry[i], bool) or not isinstance(entry[i], int) or not 0 <= entry[i] < 1 << 32:
                    raise ValueError("buffer geometry numbers must be unsigned 32-bit integers")
            if not all(isinstance(entry[i], str) for i in (1, 6, 7)):
                raise TypeError("buffer geometry kind, dtype and order must be strings")
            try:
                specs.append(BufferGeometry(*entry))
            except ConfigError as exc:  # a peer's bad value (an unknown order or dtype) is its protocol error
                raise ValueError(str(exc)) from None
        for v in (tp_rank, tp_size):
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 16:
                raise ValueError("tp_rank and tp_size must be integers below 65536")
        if not isinstance(group, str):
            raise TypeError("geometry group must be a string")
        try:
            return cls(tuple(specs), tp_rank=tp_rank, tp_size=tp_size, group=group)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None


# pairing -------------------------------------------------------------------------------------------

def pair_problem(local: KVGeometry, local_page: int, peer: KVGeometry, peer_page: int) -> str:
    """Why ``local`` and ``peer`` cannot exchange KV, or ``""``: buffers paired in order (same layers
    and kinds), the same heads in all, head size, dtype and in-page order, page sizes and TP sizes each
    a multiple of the other."""
    if len(local.buffers) != len(peer.buffers):
        return f"{len(peer.buffers)} buffers != local {len(local.buffers)}"
    for index, (a, b) in enumerate(zip(local.buffers, peer.buffers)):
        if a.key != b.key:
            return (f"buffer {index} is {b.kind} of layer {b.layer} there, {a.kind} of layer {a.layer} here "
                    "(buffers must pair in order)")
        if a.total_heads != b.total_heads:
            return f"{b.total_heads} KV heads in all != local {a.total_heads}"
        if a.head_bytes != b.head_bytes:
            return f"buffer {index}: {b.head_bytes} B per head and token != local {a.head_bytes}"
        if a.dtype != b.dtype:
            return f"buffer {index}: dtype {b.dtype} != local {a.dtype}"
        if a.order != b.order:
            return f"in-page order {b.order} != local {a.order} (kvxfer does not transpose pages)"
    if max(local_page, peer_page) % min(local_page, peer_page):
        return f"page size {peer_page} tokens and local {local_page}: neither is a multiple of the other"
    if max(local.tp_size, peer.tp_size) % min(local.tp_size, peer.tp_size):
        return f"TP size {peer.tp_size} and local {local.tp_size}: neither is a multiple of the other"
    return ""


def serves(writer: KVGeometry, receiver: KVGeometry) -> bool:
    """Whether ``writer``'s rank is one a ``receiver`` rank takes KV from (the deployments' rank rule)."""
    if receiver.tp_size >= writer.tp_size:
        return receiver.tp_rank // (receiver.tp_size // writer.tp_size) == writer.tp_rank
    return writer.tp_rank // (writer.tp_size // receiver.tp_size) == receiver.tp_rank


def fanout(writer: KVGeometry | None, receiver: KVGeometry | None) -> int:
    """How many receiver ranks of one group a writer rank serves per request."""
    if writer is None or receiver is None:
        return 1
    return max(1, receiver.tp_size // writer.tp_size)


def writers_of(receiver: KVGeometry, writer_tp_size: int) -> list[int]:
    """The writer ranks a receiver rank takes KV from, in order."""
    if receiver.tp_size >= writer_tp_size:
        return [receiver.tp_rank // (receiver.tp_size // writer_tp_size)]
    k = writer_tp_size // receiver.tp_size
    return list(range(receiver.tp_rank * k, receiver.tp_rank * k + k))


def plan_legs(receiver: KVGeometry, writers: Sequence[KVGeometry]) -> list[tuple[int, int]]:
    """Each writer's share of the receiver's heads, as ``(first head, count)`` (count 0: nothing):
    each head goes to the first writer, in the given order, that holds it. Raises :class:`ConfigError`
    when some head has no writer or a writer's share is not one interval."""
    first, count, _total = receiver.heads
    owner: dict[int, int] = {}
    for h in range(first, first + count):
        for index, w in enumerate(writers):
            wf, wc, _ = w.heads
            if wf <= h < wf + wc:
                owner[h] = index
                break
        else:
            held = ", ".join(f"{w.heads[0]}..{w.heads[0] + w.heads[1] - 1}" for w in writers) or "none"
            raise ConfigError(f"head {h} is held by none of the {len(writers)} writer(s) given (they hold {held})")
    legs = []
    for index in range(len(writers)):
        mine = sorted(h for h, o in owner.items() if o == index)
        if mine and mine[-1] - mine[0] + 1 != len(mine):
            raise ConfigError(f"writer {index} would write heads {mine}: not one interval")
        legs.append((mine[0], len(mine)) if mine else (0, 0))
    return legs
