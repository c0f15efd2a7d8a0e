#!/usr/bin/env python3
"""One-run device check of kvxfer's GPU support (run it on the GPU machine; about a minute).

    python3 tools/gpu_check.py [--gib 2] [--json PATH]      # JSON also goes to $OUT/gpu_check.json

Checks, on random data that is never zero:
  1. GPU checksums (adler32, crc32; several page sizes; random page order) equal the CPU's (zlib-ng);
  2. the checksum kernels' throughput against the measured device-to-device copy bandwidth
     (acceptance: adler32 >= 50% of the copy bandwidth);
  3. dma-buf export of a torch allocation (cuMemGetHandleForAddressRange), and RDMA registration of
     it when the machine has an RDMA device;
  4. the tcp transport moving CUDA pages between two processes, verified on both sides;
  5. zero and poison scrubbing of freed pages on the GPU;
  6. layer-wise sends behind CUDA ready events (issue 26): each layer's pages are written by work
     still queued on a stream when its send is posted (a spin of ~60 ms, then the copy of the
     layer's final bytes), last layer first; the decode must hold the final bytes, verified, and the
     posting caller must not have waited for the GPU. Needs torch.
Needs: the CUDA driver, cuda-python, numpy and kvxfer's own dependencies; torch is used when present
(else device memory comes from cuMemAlloc). Prints a table; exit status 0 when every check held.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import sys
import time
import traceback
import zlib
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvxfer.core.gpu import driver  # noqa: E402
from kvxfer.core.gpu import kernels as K  # noqa: E402
from kvxfer.core.gpu.region import CudaRegion  # noqa: E402
from kvxfer.core.layout import BufferSpec, KVLayout  # noqa: E402

PAGE_TOKENS = 16
RESULTS: list[dict] = []


def record(check: str, ok: bool, detail: str, **numbers: float) -> None:
    RESULTS.append({"check": check, "ok": bool(ok), "detail": detail, **numbers})
    print(f"[{'PASS' if ok else 'FAIL'}] {check}: {detail}", flush=True)


class DeviceBuffer:
    """Device memory from torch when installed (so dma-buf export is tested on a torch allocation)."""

    def __init__(self, nbytes: int, device: int = 0) -> None:
        self.nbytes = nbytes
        self.tensor = None
        try:
            import torch

            self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
            self.address = self.tensor.data_ptr()
            self.source = "torch"
        except ImportError:
            driver.use_device(device)
            self.address = int(driver.check(driver.cuda().cuMemAlloc(nbytes), "cuMemAlloc"))
            self.source = "cuMemAlloc"

    def fill_random(self, seed: int) -> np.ndarray:
        data = np.random.default_rng(seed).integers(1, 256, self.nbytes, dtype=np.uint8)  # never zero
        with driver.Stream(0) as stream:
            stream.to_device(self.address, data.ctypes.data, self.nbytes)
            stream.synchronize()
        return data

    def fetch(self) -> np.ndarray:
        out = np.empty(self.nbytes, dtype=np.uint8)
        with driver.Stream(0) as stream:
            stream.to_host(out.ctypes.data, self.address, self.nbytes)
            stream.synchronize()
        return out

    def close(self) -> None:
        if self.tensor is None:
            driver.check(driver.cuda().cuMemFree(self.address), "cuMemFree")
        self.tensor = None


def layout_over(buffers: list[DeviceBuffer], pages: int) -> KVLayout:
    specs = [BufferSpec(CudaRegion(b.address, b.nbytes, device_index=0, owner=b, name=f"buf{i}"), 0,
                        b.nbytes // pages) for i, b in enumerate(buffers)]
    return KVLayout(specs, num_pages=pages, page_size=PAGE_TOKENS)


# 1. correctness -------------------------------------------------------------------------------------


def check_checksums() -> None:
    from kvxfer.core.checksum import checksum_pages

    for item in (4096, 4100, 65536, 1 << 20):
        pages = max(8, min(512, (64 << 20) // item))
        buffers = [DeviceBuffer(item * pages) for _ in range(2)]
        host = [b.fill_random(seed=item + i) for i, b in enumerate(buffers)]
        gpu_layout = layout_over(buffers, pages)
        cpu_layout = KVLayout.from_arrays([h.reshape(pages, item) for h in host], page_size=PAGE_TOKENS)
        order = np.random.default_rng(item).permutation(pages)[: pages * 3 // 4]
        for algo in ("adler32", "crc32"):
            got = checksum_pages(gpu_layout, order, algo)
            want = checksum_pages(cpu_layout, order, algo)
            per_item = K.item_checksums(gpu_layout, order[:4], algo)
            ref = [(zlib.adler32 if algo == "adler32" else zlib.crc32)(host[0].reshape(pages, item)[p].tobytes())
                   for p in order[:4]]
            ok = got == want and per_item.tolist() == ref
            record(f"checksum {algo} {item} B pages", ok, f"GPU {got:#010x}, CPU {want:#010x}, {len(order)} pages x 2 buffers")
        for b in buffers:
            b.close()


# 2. speed ----------------------------------------------------------------------------------------------


def _events() -> tuple:
    cuda = driver.cuda()
    return (driver.check(cuda.cuEventCreate(0), "cuEventCreate"), driver.check(cuda.cuEventCreate(0), "cuEventCreate"))


def _elapsed(start, stop) -> float:
    cuda = driver.cuda()
    driver.check(cuda.cuEventSynchronize(stop), "cuEventSynchronize")
    return float(driver.check(cuda.cuEventElapsedTime(start, stop), "cuEventElapsedTime")) / 1e3


def check_speed(gib: float) -> None:
    cuda = driver.cuda()
    nbytes = int(gib * (1 << 30))
    src, dst = DeviceBuffer(nbytes), DeviceBuffer(nbytes)
    src.fill_random(seed=1)
    start, stop = _events()
    with driver.Stream(0) as stream:
        copies = []
        for _ in range(5):
            driver.check(cuda.cuEventRecord(start, stream.handle), "cuEventRecord")
            driver.check(cuda.cuMemcpyDtoDAsync(dst.address, src.address, nbytes, stream.handle), "cuMemcpyDtoDAsync")
            driver.check(cuda.cuEventRecord(stop, stream.handle), "cuEventRecord")
            copies.append(nbytes / _elapsed(start, stop))
        copy_bw = float(np.median(copies[1:]))
        for item in (4096, 65536, 1 << 20):
            pages = nbytes // item
            page_list = np.random.default_rng(2).permutation(pages).astype(np.int64)
            for algo in ("adler32", "crc32"):
                call = K.checksum_call(np.array([src.address]), np.array([item]), page_list, algo)
                rates = []
                with K.PreparedCall(0, call, stream) as prepared:
                    for _ in range(5):
                        driver.check(cuda.cuEventRecord(start, stream.handle), "cuEventRecord")
                        prepared.launch()
                        driver.check(cuda.cuEventRecord(stop, stream.handle), "cuEventRecord")
                        rates.append(nbytes / _elapsed(start, stop))
                rate = float(np.median(rates[1:]))
                ratio = rate / copy_bw
                needed = 0.5 if algo == "adler32" else 0.0  # the acceptance bar is on the default (adler32)
                record(f"speed {algo} {item} B pages", ratio >= needed,
                       f"{rate / 1e9:.0f} GB/s = {ratio:.2f} x the D2D copy's {copy_bw / 1e9:.0f} GB/s "
                       f"({nbytes / 2**30:.1f} GiB, random page order)",
                       gbps=rate / 1e9, copy_gbps=copy_bw / 1e9, ratio=ratio)
    src.close()
    dst.close()


# 3. dma-buf -------------------------------------------------------------------------------------------


def check_dmabuf() -> None:
    buffer = DeviceBuffer(64 << 20)
    try:
        with driver.export_dmabuf(buffer.address + 4096, 1 << 20) as export:
            record("dma-buf export", export.fd >= 0,
                   f"{buffer.source} allocation {export.base:#x}+{export.size} exported as fd {export.fd}, "
                   f"range at offset {export.offset}")
    except Exception as exc:
        record("dma-buf export", False, f"{buffer.source} allocation: {exc}")
    try:
        from kvxfer.transport.verbs import VerbsDevice, VerbsOptions, available

        ok, why = available()
        if not ok:
            record("RDMA registration of GPU memory", True, f"skipped: {why}")
        else:
            layout = layout_over([buffer], 64)
            device = VerbsDevice(VerbsOptions(), layout, remote_write=True)
            path = device.buffer_mr[0].path
            record("RDMA registration of GPU memory", True, f"{device.name}: registered through {path}")
            device.close()
    except Exception as exc:
        record("RDMA registration of GPU memory", False, str(exc))
    buffer.close()


# 4. tcp between two processes ----------------------------------------------------------------------


def _decode_process(conn, nbuffers: int = 2) -> None:
    from kvxfer import DecodeEngine, EngineConfig

    buffers = [DeviceBuffer(256 * 16384) for _ in range(nbuffers)]
    for b in buffers:
        b.fill_random(seed=99)  # stale data the transfer must overwrite
    layout = layout_over(buffers, 256)
    with DecodeEngine(layout, EngineConfig(max_context=128 * PAGE_TOKENS)) as decode:
        conn.send(decode.address)
        prefill_address = conn.recv()
        peer = decode.connect(prefill_address)
        conn.send(peer)
        results = []
        while True:
            try:
                job = conn.recv()
            except EOFError:  # the prefill side ended without saying so (a failed check)
                break
            if job is None:
                break
            rid, tokens = job
            decode.admit(rid, tokens, peer=peer)
            req = decode.wait(rid, timeout=120)
            from kvxfer.core.checksum import checksum_pages

            results.append((rid, req.state.value, checksum_pages(layout, req.pages, "adler32") if
                            req.state.value == "READABLE" else None))
            conn.send(results[-1])
            decode.release(rid)


def _answer(conn, what: str, timeout: float = 120.0):
    """The decode process's next message, or an error naming what did not come."""
    if not conn.poll(timeout):
        raise TimeoutError(f"the decode process sent no {what} within {timeout:g} s")
    return conn.recv()


@contextlib.contextmanager
def _prefill_with_decode(nbuffers: int, pages: int):
    """A prefill engine over ``nbuffers`` CUDA buffers of ``pages`` pages, peered with a decode process
    (:func:`_decode_process`): yields (prefill, pipe to the decode, buffers, decode address). The decode
    process is told to end (or killed) and the buffers freed when the block ends, however it ends."""
    from kvxfer import EngineConfig, PrefillEngine

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_decode_process, args=(child, nbuffers), daemon=True)
    proc.start()
    buffers: list[DeviceBuffer] = []
    try:
        buffers = [DeviceBuffer(pages * 16384) for _ in range(nbuffers)]
        with PrefillEngine(layout_over(buffers, pages), EngineConfig(max_context=pages * PAGE_TOKENS)) as prefill:
            decode_address = _answer(parent, "address")
            parent.send(prefill.address)
            _answer(parent, "peer")
            yield prefill, parent, buffers, decode_address
            parent.send(None)
    finally:
        parent.close()  # a check that failed midway: the decode process sees EOF and ends
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
        for b in buffers:
            b.close()


def check_tcp_two_processes() -> None:
    from kvxfer.core.checksum import checksum_pages

    try:
        with _prefill_with_decode(2, 128) as (prefill, parent, buffers, decode_address):
            layout = prefill.layout
            moved, started, ok = 0, time.monotonic(), True
            for i, pages in enumerate((1, 37, 128)):
                rid = f"g{i}"
                prefill.admit(rid, pages * PAGE_TOKENS)
                for b in buffers:
                    b.fill_random(seed=i)
                parent.send((rid, pages * PAGE_TOKENS))
                prefill.wait_ready(rid, timeout=60)
                src = prefill.source_pages(rid)
                want = checksum_pages(layout, src, "adler32")
                prefill.send(rid)
                got_rid, state, got = _answer(parent, "result")
                prefill.wait(rid, timeout=60)
                ok &= state == "READABLE" and got == want
                moved += layout.bytes_for_pages(pages)
            seconds = time.monotonic() - started
        record("tcp between two processes, CUDA pages", ok,
               f"3 requests, {moved / 2**20:.1f} MiB, verified on decode (checksums equal) in {seconds:.2f} s; "
               f"decode at {decode_address}")
    except Exception as exc:
        record("tcp between two processes, CUDA pages", False, f"{type(exc).__name__}: {exc}")


# 5. scrubbing ---------------------------------------------------------------------------------------------


def check_scrub() -> None:
    from kvxfer.core.pool import PagePool

    buffers = [DeviceBuffer(64 * 4096) for _ in range(2)]
    for b in buffers:
        b.fill_random(seed=5)
    layout = layout_over(buffers, 64)
    pages = np.array([1, 2, 40, 63])
    PagePool(layout, free_policy="zero").scrub(pages)
    data = [b.fetch().reshape(64, 4096) for b in buffers]
    zero_ok = all((d[pages] == 0).all() and (np.delete(d, pages, axis=0) != 0).any() for d in data)
    pool = PagePool(layout, free_policy="poison")  # poisons every page at start
    at_start = pool.poisoned(np.arange(64)).size == 64
    for b in buffers:
        b.fill_random(seed=7)
    pool.scrub(pages)
    marked = set(pool.poisoned(np.arange(64)).tolist()) if at_start else set()
    for b in buffers:
        b.fill_random(seed=6)  # a writer overwrote everything: no page may still look unwritten
    cleared = pool.poisoned(np.arange(64)).size == 0
    poison_ok = marked == set(pages.tolist()) and cleared
    record("scrub on free (GPU)", zero_ok and poison_ok,
           f"zero: only the 4 freed pages cleared ({zero_ok}); poison: exactly the freed pages found "
           f"({marked == set(pages.tolist())}), none after a rewrite ({cleared})")
    for b in buffers:
        b.close()


# 6. layer-wise sends behind CUDA events ---------------------------------------------------------------

SPIN_CYCLES = 100_000_000  # torch.cuda._sleep: ~60 ms at an H100's or H200's ~1.7 GHz


def check_layerwise_ready_events() -> None:
    """A prefill computing layer by layer posts each layer's send with the layer's own CUDA event while
    the stream still has that layer's work queued (a spin, then the copy of the layer's final bytes
    over stale ones). A transport that read a layer before its event completed would send the stale
    bytes, consistently checksummed: the decode would turn READABLE with the wrong KV. So the check
    compares the decode's checksum with the final bytes' (computed on the CPU), and that posting took
    a fraction of the queued GPU time (the caller did not synchronize)."""
    name = "layer-wise sends behind CUDA ready events"
    try:
        import torch
    except ImportError:
        record(name, False, "needs torch (torch.cuda.Event, torch.cuda._sleep) on the GPU machine")
        return
    from kvxfer.core.checksum import checksum_pages

    layers, pages, request_pages = 4, 128, 96
    try:
        with _prefill_with_decode(layers, pages) as (prefill, parent, buffers, _address):
            rid, tokens = "layerwise", request_pages * PAGE_TOKENS
            prefill.admit(rid, tokens)
            finals = [np.random.default_rng(100 + i).integers(1, 256, b.nbytes, dtype=np.uint8)
                      for i, b in enumerate(buffers)]
            staged = [torch.from_numpy(f).to("cuda") for f in finals]
            for b in buffers:
                b.fill_random(seed=7)  # stale bytes: what a read before the event would send
            torch.cuda.synchronize()
            parent.send((rid, tokens))
            prefill.wait_ready(rid, timeout=60)
            src = prefill.source_pages(rid)
            want = checksum_pages(KVLayout.from_arrays([f.reshape(pages, -1) for f in finals], page_size=PAGE_TOKENS),
                                  src, "adler32")
            stream = torch.cuda.Stream()
            started = time.monotonic()
            with torch.cuda.stream(stream):
                for layer in reversed(range(layers)):  # any order: the last layer first
                    torch.cuda._sleep(SPIN_CYCLES)  # the layer's compute, still queued when its send is posted
                    buffers[layer].tensor.copy_(staged[layer])
                    event = torch.cuda.Event()
                    event.record(stream)
                    prefill.send(rid, src, buffers=[layer], ready=event, finish=False)
            posted = time.monotonic() - started
            prefill.finish(rid)
            _got_rid, state, got = _answer(parent, "result")
            prefill.wait(rid, timeout=60)
            elapsed = time.monotonic() - started
        ok = state == "READABLE" and got == want and posted < elapsed / 2
        record(name, ok, f"{layers} layers x {request_pages} pages, last first: decode {state}, checksum "
               f"{'equal to' if got == want else 'NOT equal to'} the final bytes'; posting took "
               f"{1e3 * posted:.1f} ms of {1e3 * elapsed:.1f} ms to READABLE", posted_s=posted, elapsed_s=elapsed)
    except Exception as exc:
        record(name, False, f"{type(exc).__name__}: {exc}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=2.0, help="bytes timed per speed case (GiB)")
    parser.add_argument("--json", help="write the results here (default $OUT/gpu_check.json when $OUT is set)")
    args = parser.parse_args()
    ok, why = driver.available()
    if not ok:
        print(f"no usable CUDA device: {why}")
        return 2
    cuda = driver.cuda()
    device = driver.check(cuda.cuDeviceGet(0), "cuDeviceGet")
    name = driver.check(cuda.cuDeviceGetName(100, device), "cuDeviceGetName")
    version = driver.check(cuda.cuDriverGetVersion(), "cuDriverGetVersion")
    label = name.split(b"\0")[0].decode()
    print(f"device 0: {label}, CUDA driver {version // 1000}.{version % 1000 // 10}")
    driver.use_device(0)
    for check in (check_checksums, lambda: check_speed(args.gib), check_dmabuf, check_tcp_two_processes, check_scrub,
                  check_layerwise_ready_events):
        try:
            check()
        except Exception as exc:
            record(getattr(check, "__name__", "check"), False, f"{type(exc).__name__}: {exc}")
            traceback.print_exc()
    print()
    print(f"{'check':44} {'held':5} detail")
    for r in RESULTS:
        print(f"{r['check']:44} {'yes' if r['ok'] else 'NO':5} {r['detail']}")
    path = args.json or (os.path.join(os.environ["OUT"], "gpu_check.json") if os.environ.get("OUT") else None)
    if path:
        Path(path).write_text(json.dumps({"results": RESULTS}, indent=2) + "\n")
    return 0 if RESULTS and all(r["ok"] for r in RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main())
