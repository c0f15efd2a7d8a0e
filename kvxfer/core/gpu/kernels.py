"""Checksums and scrubbing of a request's pages on the GPU, and the host-side math the kernels need.

The kernels (``native/kvxfer_gpu.cu``, shipped as PTX) compute one checksum per item (page x
buffer) in the canonical order; :func:`item_checksums` returns them to the host (4 bytes per item,
never the pages) and :func:`kvxfer.core.checksum.checksum_pages` combines them exactly as it combines
CPU per-page checksums, so GPU and CPU values are bit-identical by construction.

CRC-32 needs, per buffer, the number of threads that split an item (a power of two dividing the
item length) and the GF(2) multipliers ``x^(8 * chunk * 2^level) mod P`` for its combine tree; both
are computed here on the host (:func:`crc_plan`). :func:`emulate_adler32_item` and
:func:`emulate_crc32_item` run the kernels' exact decomposition in Python, so the math is tested on
machines without a GPU; ``tools/gpu_check.py`` checks the kernels themselves on one.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import numpy as np

ADLER_MOD = 65521
CRC_POLY = 0xEDB88320
BLOCK = 256  # threads per item (block)
LEVELS = 32
PIECE = 64 << 10  # copy_runs: the most bytes one block copies


# host-side math -------------------------------------------------------------------------------------


def gf2_mulmod(a: int, b: int) -> int:
    """``a * b`` in GF(2)[x] modulo the CRC-32 polynomial, reflected bit order (bit 31 is x^0)."""
    product = 0
    m = 1 << 31
    while m:
        if a & m:
            product ^= b
        b = (b >> 1) ^ CRC_POLY if b & 1 else b >> 1
        m >>= 1
    return product


def x_pow_8n(n: int) -> int:
    """``x^(8n) mod P``: the operator that shifts a CRC over ``n`` zero bytes."""
    result = 1 << 31  # x^0
    square = 1 << 23  # x^8 in reflected order (bit 31 - 8)
    while n:
        if n & 1:
            result = gf2_mulmod(square, result)
        square = gf2_mulmod(square, square)
        n >>= 1
    return result


def threads_for(length: int, block: int = BLOCK) -> int:
    """Threads splitting an item of ``length`` bytes for CRC: the largest power of two <= block dividing it."""
    threads = 1
    while threads * 2 <= block and length % (threads * 2) == 0:
        threads *= 2
    return threads


def crc_plan(item_lens: np.ndarray, block: int = BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """``(threads per buffer, shift operators [buffers, 32])`` for the crc32_items kernel."""
    threads = np.array([threads_for(int(n), block) for n in item_lens], dtype=np.int32)
    ops = np.zeros((len(item_lens), LEVELS), dtype=np.uint32)
    for b, (length, t) in enumerate(zip(item_lens.tolist(), threads.tolist())):
        chunk = int(length) // t
        level, width = 0, 1
        while width < t:
            ops[b, level] = x_pow_8n(chunk * width)
            level, width = level + 1, width * 2
    return threads, ops


# the kernels' decomposition, in Python -----------------------------------------------------------------


def emulate_adler32_item(data: bytes, *, block: int = BLOCK, misalign: int = 0) -> int:
    """What adler32_items computes for one item starting ``misalign`` bytes past a 16-byte boundary:
    strided 16-byte chunks, the odd bytes at both ends one by one, a reduction."""
    d = np.frombuffer(data, dtype=np.uint8).astype(np.int64)
    length = d.size
    head = min((16 - misalign % 16) % 16, length)
    vec_end = head + ((length - head) & ~15)
    chunks = d[head:vec_end].reshape(-1, 16)
    s = chunks.sum(axis=1)
    t = (chunks * np.arange(16)).sum(axis=1)
    starts = head + np.arange(chunks.shape[0], dtype=np.int64) * 16
    sa = int(s.sum())
    sb = int((((length - starts) % ADLER_MOD) * s).sum()) - int(t.sum())
    odd = np.concatenate([np.arange(head), np.arange(vec_end, length)]).astype(np.int64)
    sa += int(d[odd].sum())
    sb += int((((length - odd) % ADLER_MOD) * d[odd]).sum())
    a = (1 + sa) % ADLER_MOD
    b = (length + sb) % ADLER_MOD
    return (b << 16) | a


def emulate_crc32_item(data: bytes, *, block: int = BLOCK) -> int:
    """What crc32_items computes for one item: per-thread chunk CRCs joined by the shift tree."""
    import zlib

    length = len(data)
    threads, ops = crc_plan(np.array([length]), block)
    t = int(threads[0])
    chunk = length // t
    partial = [zlib.crc32(data[i * chunk : (i + 1) * chunk]) for i in range(t)]
    level, width = 0, 1
    while width < t:
        for left in range(0, t, 2 * width):
            if left + width < t:
                partial[left] = gf2_mulmod(int(ops[0, level]), partial[left]) ^ partial[left + width]
        level, width = level + 1, width * 2
    return partial[0]


def split_runs(sources: np.ndarray, destinations: np.ndarray, lengths: np.ndarray,
               piece: int = PIECE) -> np.ndarray:
    """The copy_runs descriptor table ``[pieces, 3]`` (source, destination, length) for copying each
    run ``sources[i] -> destinations[i]`` of ``lengths[i]`` bytes, long runs cut into ``piece``-byte
    pieces so that every block has a bounded share of the work."""
    sources = np.asarray(sources, dtype=np.uint64)
    destinations = np.asarray(destinations, dtype=np.uint64)
    lengths = np.asarray(lengths, dtype=np.uint64)
    counts = np.maximum((lengths + np.uint64(piece - 1)) // np.uint64(piece), 1).astype(np.int64)
    run = np.repeat(np.arange(lengths.size), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    offset = ((np.arange(run.size) - first) * piece).astype(np.uint64)
    table = np.empty((run.size, 3), dtype=np.uint64)
    table[:, 0] = sources[run] + offset
    table[:, 1] = destinations[run] + offset
    table[:, 2] = np.minimum(lengths[run] - offset, np.uint64(piece))
    return table


# kernel calls: the exact arguments, built on the host -------------------------------------------------


@dataclass
class KernelCall:
    """One launch of a kernel of ``kvxfer_gpu.cu``: ``grid`` blocks of :data:`BLOCK` threads.

    ``args`` are in the kernel's parameter order: a numpy array is passed as a pointer to its bytes
    (copied to the device for a GPU launch), anything else as ``(value, ctypes type)``. ``out`` is
    the index of the array the kernel writes its result into, if any."""

    name: str
    grid: int
    args: list[Any]
    out: int | None = None


def checksum_call(bases: np.ndarray, item_lens: np.ndarray, pages: np.ndarray, algo: str) -> KernelCall:
    """The launch computing one checksum per item (buffer-major) of ``pages``."""
    pages = np.ascontiguousarray(pages, dtype=np.int64)
    bases = np.ascontiguousarray(bases, dtype=np.uint64)
    item_lens = np.ascontiguousarray(item_lens, dtype=np.uint64)
    items = len(bases) * pages.size
    out = np.zeros(items, dtype=np.uint32)
    head = [bases, item_lens, pages, (pages.size, ctypes.c_int)]
    if algo == "adler32":
        return KernelCall("adler32_items", items, [*head, out], out=4)
    if algo == "crc32":
        threads, ops = crc_plan(item_lens)
        return KernelCall("crc32_items", items, [*head, threads, ops, out], out=6)
    raise ValueError(f"no GPU kernel for checksum {algo!r}")


def _poison_table(buffers: int, poison_offsets: list[np.ndarray] | None) -> tuple[np.ndarray, np.ndarray, int]:
    offsets = poison_offsets or [np.zeros(0, dtype=np.uint64)] * buffers
    width = max(1, max(len(o) for o in offsets))
    table = np.zeros((buffers, width), dtype=np.uint64)
    counts = np.zeros(buffers, dtype=np.int32)
    for b, o in enumerate(offsets):
        table[b, : len(o)] = o
        counts[b] = len(o)
    return table, counts, width


def _pattern_word(pattern: bytes) -> int:
    return int.from_bytes(pattern[:8].ljust(8, b"\0"), "little")


def scrub_call(bases: np.ndarray, item_lens: np.ndarray, pages: np.ndarray, *, zero: bool,
               poison_offsets: list[np.ndarray] | None = None, pattern: bytes = b"") -> KernelCall:
    """The launch zeroing ``pages``, or writing ``pattern`` at each buffer's ``poison_offsets`` of them."""
    pages = np.ascontiguousarray(pages, dtype=np.int64)
    table, counts, width = _poison_table(len(bases), poison_offsets)
    return KernelCall("scrub_items", len(bases) * pages.size, [
        np.ascontiguousarray(bases, dtype=np.uint64), np.ascontiguousarray(item_lens, dtype=np.uint64), pages,
        (pages.size, ctypes.c_int), (0 if zero else 1, ctypes.c_int), table, counts, (width, ctypes.c_int),
        (_pattern_word(pattern), ctypes.c_uint64)])


def find_poison_call(bases: np.ndarray, item_lens: np.ndarray, pages: np.ndarray,
                     poison_offsets: list[np.ndarray], pattern: bytes) -> KernelCall:
    """The launch flagging (1) each item that still holds ``pattern`` at one of its poison offsets."""
    pages = np.ascontiguousarray(pages, dtype=np.int64)
    table, counts, width = _poison_table(len(bases), poison_offsets)
    out = np.zeros(len(bases) * pages.size, dtype=np.uint32)
    return KernelCall("find_poison_items", out.size, [
        np.ascontiguousarray(bases, dtype=np.uint64), np.ascontiguousarray(item_lens, dtype=np.uint64), pages,
        (pages.size, ctypes.c_int), table, counts, (width, ctypes.c_int), (_pattern_word(pattern), ctypes.c_uint64),
        out], out=8)


def copy_runs_call(table: np.ndarray) -> KernelCall:
    """The launch performing every copy of a :func:`split_runs` table."""
    table = np.ascontiguousarray(table, dtype=np.uint64)
    return KernelCall("copy_runs", len(table), [table, (len(table), ctypes.c_int)])


class PreparedCall:
    """A :class:`KernelCall` with its arrays copied to ``device``, ready to launch (again) on ``stream``."""

    def __init__(self, device: int, call: KernelCall, stream: Any) -> None:
        from . import driver

        self.device, self.call, self.stream = device, call, stream
        self._arrays: dict[int, Any] = {}
        self._params: list[tuple[Any, Any]] = []
        try:
            for i, arg in enumerate(call.args):
                if isinstance(arg, np.ndarray):
                    self._arrays[i] = driver.DeviceArray(arg, device, stream)
                    self._params.append((self._arrays[i].address, ctypes.c_void_p))
                else:
                    self._params.append(arg)
        except BaseException:
            self.close()
            raise

    def launch(self) -> None:
        from . import driver

        if self.call.grid:
            driver.launch(self.device, self.call.name, self.call.grid, BLOCK, self.stream, self._params)

    def result(self) -> np.ndarray | None:
        """Wait for the stream; the ``out`` array copied back (``None`` for kernels without one)."""
        if self.call.out is None:
            self.stream.synchronize()
            return None
        return self._arrays[self.call.out].fetch(self.stream)

    def close(self) -> None:
        arrays, self._arrays = self._arrays, {}
        for array in arrays.values():
            array.close()

    def __enter__(self) -> PreparedCall:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_on_gpu(device: int, call: KernelCall) -> np.ndarray | None:
    """Launch ``call`` on ``device`` and wait; returns the ``out`` array copied back, if any."""
    from . import driver

    with driver.Stream(device) as stream, PreparedCall(device, call, stream) as prepared:
        prepared.launch()
        return prepared.result()


# on the GPU -----------------------------------------------------------------------------------------------


def item_checksums(layout: Any, pages: np.ndarray, algo: str) -> np.ndarray:
    """Per-item checksums of ``pages`` (buffer-major), computed on the layout's GPU."""
    device, bases, lens = _layout_args(layout)
    result = run_on_gpu(device, checksum_call(bases, lens, pages, algo))
    assert result is not None
    return result


def scrub(layout: Any, pages: np.ndarray, *, zero: bool, poison_offsets: list[np.ndarray] | None = None,
          pattern: bytes = b"") -> None:
    """Zero, or write ``pattern`` at each buffer's ``poison_offsets`` of, ``pages`` on the GPU."""
    device, bases, lens = _layout_args(layout)
    run_on_gpu(device, scrub_call(bases, lens, pages, zero=zero, poison_offsets=poison_offsets, pattern=pattern))


def poisoned_pages(layout: Any, pages: np.ndarray, poison_offsets: list[np.ndarray], pattern: bytes) -> np.ndarray:
    """The subset of ``pages`` still carrying ``pattern`` at a poison offset of any buffer (on the GPU)."""
    device, bases, lens = _layout_args(layout)
    pages = np.ascontiguousarray(pages, dtype=np.int64)
    flags = run_on_gpu(device, find_poison_call(bases, lens, pages, poison_offsets, pattern))
    assert flags is not None
    return pages[flags.reshape(len(bases), pages.size).any(axis=0)]


def _layout_args(layout: Any) -> tuple[int, np.ndarray, np.ndarray]:
    devices = {getattr(spec.region, "device_index", None) for spec in layout.buffers}
    if len(devices) != 1 or None in devices:
        raise ValueError("GPU kernels need every buffer of the layout on one CUDA device")
    bases = np.array([spec.address for spec in layout.buffers], dtype=np.uint64)
    lens = np.asarray(layout.item_lens, dtype=np.uint64)
    return devices.pop(), bases, lens
