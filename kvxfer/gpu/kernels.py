"""Checksums and scrubbing of a request's pages on the GPU, and the host-side math the kernels need.

The kernels (``native/kvxfer_gpu.cu``, shipped as PTX) compute one checksum per item (page x
buffer) in the canonical order; :func:`item_checksums` returns them to the host (4 bytes per item,
never the pages) and :func:`kvxfer.checksum.checksum_pages` combines them exactly as it combines
CPU per-page checksums, so GPU and CPU values are bit-identical by construction.

CRC-32 needs, per buffer, the number of threads that split an item (a power of two dividing the
item length) and the GF(2) multipliers ``x^(8 * chunk * 2^level) mod P`` for its combine tree; both
are computed here on the host (:func:`crc_plan`). :func:`emulate_adler32_item` and
:func:`emulate_crc32_item` run the kernels' exact decomposition in Python, so the math is tested on
machines without a GPU; ``tools/gpu_check.py`` checks the kernels themselves on one.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

ADLER_MOD = 65521
CRC_POLY = 0xEDB88320
BLOCK = 256  # threads per item (block)
LEVELS = 32


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


def emulate_adler32_item(data: bytes, *, block: int = BLOCK, aligned: bool = True) -> int:
    """What adler32_items computes for one item: strided 16-byte chunks, a byte tail, a reduction."""
    d = np.frombuffer(data, dtype=np.uint8).astype(np.int64)
    length = d.size
    vec_end = length & ~15 if aligned else 0
    chunks = d[:vec_end].reshape(-1, 16)
    s = chunks.sum(axis=1)
    t = (chunks * np.arange(16)).sum(axis=1)
    starts = np.arange(chunks.shape[0], dtype=np.int64) * 16
    sa = int(s.sum())
    sb = int((((length - starts) % ADLER_MOD) * s).sum()) - int(t.sum())
    tail = np.arange(vec_end, length, dtype=np.int64)
    sa += int(d[vec_end:].sum())
    sb += int((((length - tail) % ADLER_MOD) * d[vec_end:]).sum())
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


# on the GPU -----------------------------------------------------------------------------------------------


def item_checksums(layout: Any, pages: np.ndarray, algo: str) -> np.ndarray:
    """Per-item checksums of ``pages`` (buffer-major), computed on the layout's GPU."""
    from . import driver

    device, bases, lens = _layout_args(layout)
    pages = np.ascontiguousarray(pages, dtype=np.int64)
    items = layout.num_buffers * pages.size
    if items == 0:
        return np.empty(0, dtype=np.uint32)
    with driver.Stream(device) as stream:
        args = [driver.DeviceArray(bases, device, stream), driver.DeviceArray(lens, device, stream),
                driver.DeviceArray(pages, device, stream)]
        out = driver.DeviceArray(np.zeros(items, dtype=np.uint32), device, stream)
        extra = []
        try:
            if algo == "adler32":
                driver.launch(device, "adler32_items", items, BLOCK, stream, [
                    (args[0].address, ctypes.c_void_p), (args[1].address, ctypes.c_void_p),
                    (args[2].address, ctypes.c_void_p), (pages.size, ctypes.c_int), (out.address, ctypes.c_void_p)])
            elif algo == "crc32":
                threads, ops = crc_plan(lens)
                extra = [driver.DeviceArray(threads, device, stream), driver.DeviceArray(ops, device, stream)]
                driver.launch(device, "crc32_items", items, BLOCK, stream, [
                    (args[0].address, ctypes.c_void_p), (args[1].address, ctypes.c_void_p),
                    (args[2].address, ctypes.c_void_p), (pages.size, ctypes.c_int),
                    (extra[0].address, ctypes.c_void_p), (extra[1].address, ctypes.c_void_p),
                    (out.address, ctypes.c_void_p)])
            else:
                raise ValueError(f"no GPU kernel for checksum {algo!r}")
            return out.fetch(stream)
        finally:
            for array in [*args, out, *extra]:
                array.close()


def scrub(layout: Any, pages: np.ndarray, *, zero: bool, poison_offsets: list[np.ndarray] | None = None,
          pattern: bytes = b"") -> None:
    """Zero, or write ``pattern`` at each buffer's ``poison_offsets`` of, ``pages`` on the GPU."""
    from . import driver

    device, bases, lens = _layout_args(layout)
    pages = np.ascontiguousarray(pages, dtype=np.int64)
    if pages.size == 0:
        return
    offsets = poison_offsets or [np.zeros(0, dtype=np.uint64)] * layout.num_buffers
    width = max(1, max(len(o) for o in offsets))
    table = np.zeros((layout.num_buffers, width), dtype=np.uint64)
    counts = np.zeros(layout.num_buffers, dtype=np.int32)
    for b, o in enumerate(offsets):
        table[b, : len(o)] = o
        counts[b] = len(o)
    value = int.from_bytes(pattern[:8].ljust(8, b"\0"), "little")
    with driver.Stream(device) as stream:
        arrays = [driver.DeviceArray(x, device, stream) for x in (bases, lens, pages, table, counts)]
        try:
            driver.launch(device, "scrub_items", layout.num_buffers * pages.size, BLOCK, stream, [
                (arrays[0].address, ctypes.c_void_p), (arrays[1].address, ctypes.c_void_p),
                (arrays[2].address, ctypes.c_void_p), (pages.size, ctypes.c_int), (0 if zero else 1, ctypes.c_int),
                (arrays[3].address, ctypes.c_void_p), (arrays[4].address, ctypes.c_void_p), (width, ctypes.c_int),
                (value, ctypes.c_uint64)])
            stream.synchronize()
        finally:
            for array in arrays:
                array.close()


def read_words(layout: Any, pages: np.ndarray, buffer: int, offsets: np.ndarray) -> np.ndarray:
    """The 8-byte words at ``offsets`` of ``pages`` in ``buffer``, copied to the host: ``[pages, offsets, 8]``."""
    from . import driver

    device, bases, lens = _layout_args(layout)
    out = np.empty((len(pages), len(offsets), 8), dtype=np.uint8)
    with driver.Stream(device) as stream:
        for i, page in enumerate(np.asarray(pages).tolist()):
            for k, off in enumerate(np.asarray(offsets).tolist()):
                address = int(bases[buffer]) + int(page) * int(lens[buffer]) + int(off)
                stream.to_host(out[i, k].ctypes.data, address, 8)
        stream.synchronize()
    return out


def _layout_args(layout: Any) -> tuple[int, np.ndarray, np.ndarray]:
    devices = {getattr(spec.region, "device_index", None) for spec in layout.buffers}
    if len(devices) != 1 or None in devices:
        raise ValueError("GPU kernels need every buffer of the layout on one CUDA device")
    bases = np.array([spec.address for spec in layout.buffers], dtype=np.uint64)
    lens = np.asarray(layout.item_lens, dtype=np.uint64)
    return devices.pop(), bases, lens
