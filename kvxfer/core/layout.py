"""The KV layout: which bytes belong to which page, described the way serving engines do.

An engine's KV cache is a list of *buffers* (SGLang: one per layer and K/V, ``kv_data_ptrs``);
buffer ``b`` holds ``num_pages`` items of ``item_len[b]`` bytes (``kv_item_lens``), so page ``p``
of buffer ``b`` is ``base[b] + p * item_len[b]`` for ``item_len[b]`` bytes. A request owns page
indices; its bytes are that page in every buffer.

Invariants: buffers never overlap; every buffer has room for ``num_pages`` items; a layout never
changes after construction. A layout may carry a :class:`~kvxfer.core.geometry.KVGeometry` saying
what each page holds (layer, K/V/latent, the KV heads this rank holds, head size, dtype, in-page
order, tensor-parallel rank); its bytes per page must match. Two engines can exchange pages when their
layouts are *compatible*: without a geometry on either side, the same number of buffers, the same
item length per buffer and the same tokens per page (page for page); with one on both sides, what
:func:`~kvxfer.core.geometry.pair_problem` allows (other TP sizes and page sizes included).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ConfigError
from .geometry import KVGeometry, pair_problem
from .memory import MemoryRegion, as_region


@dataclass(frozen=True)
class BufferSpec:
    """One buffer of the layout: ``item_len`` bytes per page starting at ``offset`` in a region."""

    region: MemoryRegion
    offset: int
    item_len: int

    @property
    def address(self) -> int:
        return self.region.address + self.offset


class KVLayout:
    """Buffers x pages, with numpy views of every buffer as a ``(num_pages, item_len)`` matrix."""

    def __init__(self, buffers: Sequence[BufferSpec], *, num_pages: int, page_size: int,
                 geometry: KVGeometry | None = None) -> None:
        if not buffers:
            raise ConfigError("a KV layout needs at least one buffer")
        if num_pages <= 0:
            raise ConfigError(f"a KV layout needs at least one page (got {num_pages})")
        if page_size <= 0:
            raise ConfigError(f"page_size must be a positive number of tokens (got {page_size})")
        self.buffers = list(buffers)
        self.num_pages = int(num_pages)
        self.page_size = int(page_size)
        for index, spec in enumerate(self.buffers):
            if spec.item_len <= 0:
                raise ConfigError(f"buffer {index}: item_len must be positive (got {spec.item_len})")
            end = spec.offset + self.num_pages * spec.item_len
            if spec.offset < 0 or end > spec.region.nbytes:
                raise ConfigError(
                    f"buffer {index}: {self.num_pages} pages of {spec.item_len} bytes at offset "
                    f"{spec.offset} do not fit its region of {spec.region.nbytes} bytes"
                )
        self._check_no_overlap()
        self.item_lens = np.array([b.item_len for b in self.buffers], dtype=np.int64)
        self.item_lens.setflags(write=False)  # fixed with the buffers: page_bytes is computed once
        self._page_bytes = int(self.item_lens.sum())
        if geometry is not None:
            if not isinstance(geometry, KVGeometry):
                raise ConfigError(f"geometry must be a KVGeometry, got {type(geometry).__name__}")
            geometry.check_items(self.page_size, [int(x) for x in self.item_lens])
        self.geometry = geometry
        self._views: list[np.ndarray] | None = None

    # construction helpers -------------------------------------------------------------------
    @classmethod
    def from_arrays(cls, arrays: Sequence[Any], *, page_size: int, num_pages: int | None = None,
                    geometry: KVGeometry | None = None) -> KVLayout:
        """One buffer per array; an array's first dimension is pages unless ``num_pages`` says.

        Accepts anything :func:`as_region` accepts (numpy, torch CPU tensors, bytearray, mmap)."""
        regions = [as_region(a, name=f"buffer{i}") for i, a in enumerate(arrays)]
        if num_pages is None:
            shape0 = {int(getattr(a, "shape", (0,))[0]) for a in arrays}
            if len(shape0) != 1 or 0 in shape0:
                raise ConfigError(
                    "cannot infer num_pages: arrays disagree on their first dimension; pass num_pages"
                )
            num_pages = shape0.pop()
        specs = []
        for i, region in enumerate(regions):
            if region.nbytes % num_pages:
                raise ConfigError(
                    f"buffer {i}: {region.nbytes} bytes is not a whole number of {num_pages} pages"
                )
            specs.append(BufferSpec(region, 0, region.nbytes // num_pages))
        return cls(specs, num_pages=num_pages, page_size=page_size, geometry=geometry)

    @classmethod
    def from_pointers(
        cls,
        data_ptrs: Sequence[int],
        data_lens: Sequence[int],
        item_lens: Sequence[int],
        *,
        page_size: int,
        device: str = "auto",
        geometry: KVGeometry | None = None,
    ) -> KVLayout:
        """SGLang's description: per-buffer base pointer, total bytes and bytes per page.

        ``device`` says where the pointers point: ``"cpu"``, ``"cuda"``, or ``"auto"`` (ask the CUDA
        driver when one is installed, else host memory)."""
        if not (len(data_ptrs) == len(data_lens) == len(item_lens)):
            raise ConfigError("data_ptrs, data_lens and item_lens must have the same length")
        pages = {int(n) // int(i) for n, i in zip(data_lens, item_lens) if int(i) > 0}
        if len(pages) != 1:
            raise ConfigError(f"buffers disagree on the page count: {sorted(pages)}")
        num_pages = pages.pop()
        from .memory import region_at

        specs = [
            BufferSpec(region_at(int(p), int(n), device=device, name=f"buffer{i}"), 0, int(item))
            for i, (p, n, item) in enumerate(zip(data_ptrs, data_lens, item_lens))
        ]
        return cls(specs, num_pages=num_pages, page_size=page_size, geometry=geometry)

    @classmethod
    def allocate(
        cls, *, num_buffers: int | None = None, item_len: int | None = None, num_pages: int, page_size: int,
        prefault: bool = True, geometry: KVGeometry | None = None,
    ) -> KVLayout:
        """Allocate fresh host memory for a layout (tools, tests, the demo): ``num_buffers`` of
        ``item_len`` bytes per page, or as many buffers, each as large, as ``geometry`` describes."""
        from .memory import allocate_host

        if geometry is not None:
            items = [spec.item_len(page_size) for spec in geometry.buffers]
        elif num_buffers is not None and item_len is not None:
            items = [int(item_len)] * int(num_buffers)
        else:
            raise ConfigError("allocate needs num_buffers and item_len, or a geometry")
        region = allocate_host(sum(items) * num_pages, name="kv", prefault=prefault)
        offsets = np.concatenate(([0], np.cumsum(items)[:-1])) * num_pages
        specs = [BufferSpec(region, int(off), item) for off, item in zip(offsets, items)]
        return cls(specs, num_pages=num_pages, page_size=page_size, geometry=geometry)

    # geometry ---------------------------------------------------------------------------------
    @property
    def num_buffers(self) -> int:
        return len(self.buffers)

    @property
    def page_bytes(self) -> int:
        """Bytes one page occupies across all buffers."""
        return self._page_bytes

    @property
    def pool_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def regions(self) -> list[MemoryRegion]:
        seen: dict[int, MemoryRegion] = {}
        for spec in self.buffers:
            seen.setdefault(id(spec.region), spec.region)
        return list(seen.values())

    @property
    def device(self) -> str:
        devices = {spec.region.device for spec in self.buffers}
        return devices.pop() if len(devices) == 1 else "mixed"

    def pages_for_tokens(self, tokens: int) -> int:
        return -(-int(tokens) // self.page_size)

    def bytes_for_pages(self, pages: int) -> int:
        return int(pages) * self.page_bytes

    def views(self) -> list[np.ndarray]:
        """Per buffer, a writable ``(num_pages, item_len)`` uint8 view (host layouts only)."""
        if self._views is None:
            views = []
            for index, spec in enumerate(self.buffers):
                array = getattr(spec.region, "array", None)
                if array is None:
                    raise ConfigError(f"buffer {index} is {spec.region.device} memory: no host view")
                flat = array[spec.offset : spec.offset + self.num_pages * spec.item_len]
                views.append(flat.reshape(self.num_pages, spec.item_len))
            self._views = views
        return self._views

    def flat_view(self, buffer: int) -> np.ndarray:
        """Buffer ``buffer`` as one flat uint8 array of ``num_pages * item_len`` bytes."""
        return self.views()[buffer].reshape(-1)

    def check_pages(self, pages: np.ndarray) -> None:
        """Raise if any page index is outside ``[0, num_pages)``."""
        if pages.size and (int(pages.min()) < 0 or int(pages.max()) >= self.num_pages):
            bad = pages[(pages < 0) | (pages >= self.num_pages)]
            raise ConfigError(
                f"page index out of range [0, {self.num_pages}): {bad[:8].tolist()}", pages=bad
            )

    # compatibility ------------------------------------------------------------------------------
    def descriptor(self) -> dict[str, Any]:
        """What a peer needs to know of this layout (carried in HELLO)."""
        return {
            "num_pages": self.num_pages,
            "page_size": self.page_size,
            "item_lens": [int(x) for x in self.item_lens],
            "geometry": self.geometry,
        }

    def describe(self) -> str:
        """This layout in a few words, the way refusals name both sides: buffers, bytes per page of
        each (runs of equal lengths folded), tokens per page, and what a page holds when known."""
        return describe_layout(self.page_size, [int(x) for x in self.item_lens], self.geometry)

    def check_compatible(self, peer: dict[str, Any], *, peer_name: str = "peer") -> None:
        """Raise :class:`ConfigError` naming both layouts and the first difference from a peer's
        descriptor (``page_size``, ``item_lens`` and, when it has one, ``geometry``)."""
        theirs = [int(x) for x in peer["item_lens"]]
        geometry = peer.get("geometry")
        difference = ""
        if geometry is not None:
            try:
                geometry.check_items(int(peer["page_size"]), theirs)
            except ConfigError as exc:
                difference = f"its geometry does not describe its buffers: {exc.detail}"
        if difference:
            pass
        elif geometry is not None and self.geometry is not None:
            difference = pair_problem(self.geometry, self.page_size, geometry, int(peer["page_size"]))
        elif int(peer["page_size"]) != self.page_size:
            difference = f"page_size {peer['page_size']} tokens != local {self.page_size}"
        elif len(theirs) != self.num_buffers:
            difference = f"{len(theirs)} buffers != local {self.num_buffers}"
        else:
            for index, (a, b) in enumerate(zip(theirs, self.item_lens)):
                if a != int(b):
                    difference = f"buffer {index} item_len {a} != local {int(b)}"
                    break
        if difference:
            raise ConfigError(
                f"layout mismatch with {peer_name}: {difference} (theirs: "
                f"{describe_layout(int(peer['page_size']), theirs, geometry)}; local: {self.describe()})"
            )

    def _check_no_overlap(self) -> None:
        spans = sorted(
            (spec.address, spec.address + self.num_pages * spec.item_len, i)
            for i, spec in enumerate(self.buffers)
            if spec.region.device == "cpu"
        )
        for (_s0, e0, i0), (s1, _e1, i1) in zip(spans, spans[1:]):
            if s1 < e0:
                raise ConfigError(f"buffers {i0} and {i1} overlap")

    def __repr__(self) -> str:
        return (
            f"KVLayout(buffers={self.num_buffers}, num_pages={self.num_pages}, "
            f"page_size={self.page_size}, page_bytes={self.page_bytes})"
        )


def describe_layout(page_size: int, item_lens: Sequence[int], geometry: KVGeometry | None = None) -> str:
    """``"4 buffers of 1024 B/page, 16 tokens/page"`` (``"2 x 1024 + 2 x 512 B/page"`` when they differ),
    followed by what a page holds (``KVGeometry.describe``) when the layout says."""
    runs: list[list[int]] = []
    for n in item_lens:
        if runs and runs[-1][1] == n:
            runs[-1][0] += 1
        else:
            runs.append([1, int(n)])
    if len(runs) == 1:
        sizes = f"{runs[0][0]} buffer{'s' if runs[0][0] != 1 else ''} of {runs[0][1]} B/page"
    else:
        sizes = " + ".join(f"{count} x {n}" for count, n in runs) + " B/page"
    if geometry is not None:
        return f"{sizes}: {geometry.describe(page_size)}"
    return f"{sizes}, {page_size} tokens/page"
