"""The verbs transport: one-sided RDMA WRITEs over RC queue pairs, with pyverbs.

What it owns, per engine: one opened device (:class:`VerbsDevice`: context, protection domain, a
memory region per registered memory region of the layout) and, per peering and epoch, one RC queue
pair (:class:`Endpoint`). The receiving side (:class:`VerbsReceiver`) publishes its queue pair,
buffer addresses and rkeys (VERBS_INFO), connects to the writer's (VERBS_CONNECT), keeps receive
work requests posted for immediates and polls its completion queue. The writing side
(:class:`VerbsLink`) posts each chunk as a chain of RDMA WRITEs (runs contiguous on both sides
coalesced, every ``SIGNAL_EVERY``-th and the last signalled); a request's final write is
RDMA_WRITE_WITH_IMM whose immediate is the request's tag (:meth:`kvxfer.core.tags.Tag.imm32`).

Rules that make it as safe as tcp:

* Ordered messages (DONE, DRAIN_ACK, REJECT, ABORT) leave through the control plane only after every
  work request posted before them has a completion: on RC, a completion means the responder
  acknowledged, so the data is placed. That is the drain proof.
* The receiver cannot see plain RDMA WRITEs land, so DONE carries the write log and the receiver
  checks and records it with the same :class:`~kvxfer.core.writeguard.WriteGuard` tcp uses; it also
  requires the final write's immediate, with a matching tag, to have arrived. A completion with a
  stale or unknown tag is counted and completes nothing.
* Fencing moves the receiver's queue pair to the error state: a write that arrives afterwards is
  refused on the wire and lands nowhere; then the queue pair is destroyed and a new epoch offered.
* Per-request memory windows (:mod:`kvxfer.transport.verbs_windows`), where the device has type-2B
  windows: the receiver's regions grant no remote access by their own rkey; each request gets
  windows over its pages bound on its connection's queue pair (:meth:`VerbsReceiver.grant`, keys in
  META), invalidated when DONE arrives and always before its pages are freed
  (:meth:`VerbsReceiver.revoke`). A stale key then fails in the NIC; the queue pair that carried it
  fails, and the receiver fences the connection when its own queue pair reports the failure.
* Memory regions are deregistered only after every queue pair that could target them is destroyed,
  and windows are deallocated before their queue pair is destroyed (a bound type-2 window holds it).

The per-work-request loops run in C (``kvxfer._verbs``) when it is built; otherwise pure pyverbs.
GPU memory registers through :func:`register_region` (dma-buf), which the GPU support provides.
"""

from __future__ import annotations

import collections
import logging
import os
import random
import socket
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from ..core.layout import KVLayout
from ..core.memory import MemoryRegion
from ..core.runs import WriteBatch
from ..core.tags import Tag
from ..core.writeguard import WriteGuard
from ..errors import ConfigError, ProtocolError, TransportError, WriteRefused
from ..wire import messages as m
from .base import (
    Capabilities,
    LinkRequest,
    ReceiverBackend,
    ReceiverHooks,
    SenderLink,
    SenderTransport,
    TransportFactory,
)
from .lanes import LaneLink, SendLanes
from .options import VerbsOptions
from .verbs_windows import ReceiverWindows, WindowTable

log = logging.getLogger("kvxfer.verbs")

SQ_DEPTH = 1024
RQ_DEPTH = 256
CQ_DEPTH = 2048
SIGNAL_EVERY = 32
POLL_AGAIN_S = 0.0002  # a link with writes in flight and nothing to post polls its completions again after this
POLL_BATCH = 256
RECORD = np.dtype([("wr_id", "<u8"), ("status", "<u4"), ("opcode", "<u4"), ("byte_len", "<u4"),
                   ("imm", "<u4"), ("wc_flags", "<u4"), ("qp_num", "<u4")])
WC_SUCCESS = 0
WC_RECV_RDMA_WITH_IMM = 129  # IBV_WC_RECV_RDMA_WITH_IMM


def pyverbs_modules() -> Any:
    """Import pyverbs lazily, with an error that says how to get it."""
    try:
        import pyverbs.enums as enums
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.cq import CQ
        from pyverbs.device import Context, get_device_list
        from pyverbs.mr import MR, MW
        from pyverbs.pd import PD
        from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
        from pyverbs.wr import SGE, RecvWR, SendWR
    except ImportError as exc:
        raise ConfigError(
            "the verbs transport needs pyverbs: install Debian's python3-pyverbs; from another CPython "
            f"3.11 add /usr/lib/python3/dist-packages to PYTHONPATH ({exc})"
        ) from exc

    class _NS:
        pass

    try:  # memory windows are bound from C; pyverbs only allocates them and names their MR
        from pyverbs.mr import MWBindInfo
    except ImportError:  # an old pyverbs: no memory windows
        MWBindInfo = None  # noqa: N806

    ns = _NS()
    for name, value in dict(enums=enums, GID=GID, AHAttr=AHAttr, GlobalRoute=GlobalRoute, CQ=CQ, Context=Context,
                            get_device_list=get_device_list, MR=MR, MW=MW, MWBindInfo=MWBindInfo, PD=PD, QP=QP,
                            QPAttr=QPAttr, QPCap=QPCap, QPInitAttr=QPInitAttr, SGE=SGE, RecvWR=RecvWR,
                            SendWR=SendWR).items():
        setattr(ns, name, value)
    return ns


def native_verbs() -> Any:
    if os.environ.get("KVXFER_PURE_PYTHON") == "1":
        return None
    try:
        from .. import _verbs
    except ImportError:
        return None
    return _verbs


def available() -> tuple[bool, str]:
    """Whether a verbs device can be opened here, and why not."""
    try:
        pv = pyverbs_modules()
    except ConfigError as exc:
        return False, str(exc)
    try:
        devices = pv.get_device_list()
    except Exception as exc:  # no libibverbs providers, no /sys/class/infiniband...
        return False, f"no RDMA devices: {exc}"
    if not devices:
        return False, "no RDMA devices on this machine (run inside tools/softroce/run)"
    return True, ", ".join(d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in devices)


def gid_bytes(gid: Any) -> bytes:
    text = gid.gid if hasattr(gid, "gid") else str(gid)
    raw = bytes.fromhex(text.replace(":", ""))
    if len(raw) != 16:
        raise ConfigError(f"GID {text!r} is not 16 bytes")
    return raw


def gid_text(raw: bytes) -> str:
    h = raw.hex()
    return ":".join(h[i : i + 4] for i in range(0, 32, 4))


class VerbsDevice:
    """An opened RDMA device with its protection domain and memory registrations.

    On the receiving side (``remote_write``) it also decides how writes are admitted, once, before the
    memory is registered: ``windows`` is True when every request gets its own memory windows (the
    memory regions then grant no remote access by their own rkey at all), False when the regions'
    rkeys are published (``windows_reason`` says why)."""

    def __init__(self, options: VerbsOptions, layout: KVLayout, *, remote_write: bool) -> None:
        self.pv = pyverbs_modules()
        self.layout = layout
        pv = self.pv
        e = pv.enums
        devices = pv.get_device_list()
        names = [d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in devices]
        if not names:
            raise TransportError("no RDMA device found (the verbs transport needs one; see tools/softroce/)")
        name = options.device or names[0]
        if name not in names:
            raise TransportError(f"RDMA device {name!r} not found (have {', '.join(names)})")
        self.name = name
        self.port = options.port
        self.retry_cnt = options.retry_cnt  # every queue pair's (connect)
        self.ctx = pv.Context(name=name)
        port_attr = self.ctx.query_port(self.port)
        if port_attr.state != e.IBV_PORT_ACTIVE:
            self.ctx.close()
            raise TransportError(f"{name} port {self.port} is not active (state {port_attr.state})")
        self.mtu = int(port_attr.active_mtu)
        self.gid_index = options.gid_index if options.gid_index is not None else self._pick_gid(port_attr)
        self.gid = gid_bytes(self.ctx.query_gid(self.port, self.gid_index))
        self.pd = pv.PD(self.ctx)
        self.windows = False
        self.windows_reason = "the writing side publishes no memory"
        self.max_mw = 0
        if remote_write:
            self.windows, self.windows_reason = self._choose_windows(options)
        if self.windows:  # remote writes only through per-request windows: the regions' own rkeys grant nothing
            access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_MW_BIND
        else:
            access = e.IBV_ACCESS_LOCAL_WRITE | (e.IBV_ACCESS_REMOTE_WRITE if remote_write else 0)
        self.mrs: dict[int, Any] = {}
        for region in layout.regions:
            self.mrs[id(region)] = register_region(self, region, access)
        self.buffer_mr = [self.mrs[id(spec.region)] for spec in layout.buffers]
        # the address each buffer's byte 0 has in work requests: its virtual address for host MRs,
        # its dma-buf offset for GPU memory registered through a dma-buf (the MR's iova)
        self.buffer_addr = np.array([wire_address(self.mrs[id(spec.region)], spec) for spec in layout.buffers],
                                    dtype=np.uint64)
        self.buffer_lkey = np.array([mr.lkey for mr in self.buffer_mr], dtype=np.uint32)
        self.buffer_rkey = np.array([mr.rkey for mr in self.buffer_mr], dtype=np.uint32)
        self.scratch = pv.MR(self.pd, 64, e.IBV_ACCESS_LOCAL_WRITE)
        self._bounce: Any = None
        self._closed = False

    def _choose_windows(self, options: VerbsOptions) -> tuple[bool, str]:
        """Whether requests get memory windows here (options.windows, and what the device can do)."""
        if options.windows == "off":
            return False, "memory windows turned off (windows=off)"
        ok, why = self._probe_windows()
        if not ok and options.windows == "on":
            self.pd.close()
            self.ctx.close()
            raise TransportError(f"{self.name}: memory windows required (windows=on) but unavailable: {why}")
        return ok, why

    def _probe_windows(self) -> tuple[bool, str]:
        """Type-2B memory windows usable here? The device must say so, and one must allocate and be
        readable by the C data path (which binds and invalidates them)."""
        pv = self.pv
        e = pv.enums
        native = native_verbs()
        if native is None or not hasattr(native, "post_binds"):
            return False, "kvxfer._verbs is not built (windows are bound and invalidated from C)"
        if pv.MWBindInfo is None:
            return False, "this pyverbs has no MWBindInfo"
        try:
            attr = self.ctx.query_device()
        except Exception as exc:
            return False, f"cannot query the device: {exc}"
        self.max_mw = int(getattr(attr, "max_mw", 0))
        flags = int(getattr(attr, "device_cap_flags", 0))
        type_2b = int(getattr(e, "IBV_DEVICE_MEM_WINDOW_TYPE_2B", 1 << 24))
        if self.max_mw <= 0:
            return False, f"{self.name} reports max_mw 0"
        if not flags & type_2b:
            return False, f"{self.name} lacks type-2B memory windows (device_cap_flags {flags:#x})"
        probe = mw = mr = info = None
        try:
            probe = Endpoint(self)
            context = probe.native_context()
            mw = pv.MW(self.pd, e.IBV_MW_TYPE_2)
            native.mw_handle(mw, mw.rkey, context)
            mr = pv.MR(self.pd, 4096, e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_MW_BIND)
            info = pv.MWBindInfo(mr, mr.buf, 4096, e.IBV_ACCESS_REMOTE_WRITE)
            native.mr_handle(info, mr.lkey, context)
        except Exception as exc:
            return False, f"cannot allocate and address a type-2 memory window on {self.name}: {exc}"
        finally:
            for obj in (info, mw, mr, probe):
                if obj is not None:
                    obj.close()
        return True, f"type-2B memory windows on {self.name} (max_mw {self.max_mw})"

    def bounce(self, size: int) -> Any:
        """A registered scratch buffer of at least ``size`` bytes (fault injection only)."""
        if self._bounce is None or self._bounce.length < size:
            if self._bounce is not None:
                self._bounce.close()
            self._bounce = self.pv.MR(self.pd, max(size, 1 << 20), self.pv.enums.IBV_ACCESS_LOCAL_WRITE)
        return self._bounce

    def _pick_gid(self, port_attr: Any) -> int:
        """The first RoCE v2 GID holding an IPv4-mapped address, else the first non-zero GID."""
        fallback = None
        for index in range(port_attr.gid_tbl_len):
            try:
                raw = gid_bytes(self.ctx.query_gid(self.port, index))
            except Exception:
                continue
            if raw == bytes(16):
                continue
            if fallback is None:
                fallback = index
            if raw[:12] == bytes(10) + b"\xff\xff":
                try:
                    if self.ctx.query_gid_type(self.port, index) == self.pv.enums.IBV_GID_TYPE_SYSFS_ROCE_V2:
                        return index
                except Exception:
                    return index
        if fallback is None:
            raise TransportError(f"{self.name} port {self.port} has no usable GID")
        return fallback

    def close(self) -> None:
        """Deregister memory and close the device; every queue pair must already be destroyed."""
        if self._closed:
            return
        self._closed = True
        for mr in list(self.mrs.values()) + [self.scratch] + ([self._bounce] if self._bounce is not None else []):
            mr.close()
        self.mrs.clear()
        self.pd.close()
        self.ctx.close()


def register_region(device: VerbsDevice, region: MemoryRegion, access: int) -> Any:
    """Register one memory region with the device: host memory as a plain MR; GPU memory through
    its dma-buf (provided by kvxfer's GPU support), falling back to a plain MR on the device pointer
    when nvidia-peermem is loaded."""
    if region.device == "cpu":
        return device.pv.MR(device.pd, region.nbytes, access, address=region.address)
    register = getattr(region, "register_verbs", None)
    if register is None:
        raise ConfigError(f"region {region.name!r} ({region.device}) cannot be registered for RDMA by this build")
    return register(device, access)


def wire_address(registration: Any, spec: Any) -> int:
    """Work-request address of ``spec``'s first byte under ``registration``."""
    iova = getattr(registration, "iova", None)
    if iova is None:
        return int(spec.address)
    return int(iova) + int(spec.address - spec.region.address)


class Endpoint:
    """One RC queue pair with its completion queue, from INIT to RTS, to ERR, to destroyed.

    With ``send_cq`` (a receiver using memory windows) the send queue completes into a completion
    queue of its own, which only the window binds and invalidations use and their caller polls."""

    def __init__(self, device: VerbsDevice, *, send_cq: bool = False) -> None:
        pv = device.pv
        e = pv.enums
        self.device = device
        self.cq = pv.CQ(device.ctx, CQ_DEPTH, None, None, 0)
        self.scq = pv.CQ(device.ctx, SQ_DEPTH, None, None, 0) if send_cq else None
        cap = pv.QPCap(max_send_wr=SQ_DEPTH, max_recv_wr=RQ_DEPTH, max_send_sge=1, max_recv_sge=1)
        init = pv.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.scq or self.cq, rcq=self.cq, cap=cap)
        attr = pv.QPAttr(port_num=device.port)
        attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
        self.qp = pv.QP(device.pd, init, attr)
        self.qpn = int(self.qp.qp_num)
        self.psn = random.getrandbits(24)
        self.native = native_verbs()
        self.qp_handle = 0
        self.cq_handle = 0
        self.scq_handle = 0
        if self.native is not None:
            try:
                self.qp_handle = self.native.qp_handle(self.qp, self.qpn)
                ctx_addr = self.native_context()
                self.cq_handle = self.native.cq_handle(self.cq, ctx_addr)
                if self.scq is not None:
                    self.scq_handle = self.native.cq_handle(self.scq, ctx_addr)
            except (ValueError, OverflowError) as exc:
                log.warning("native verbs path unavailable for this pyverbs build (%s): using pyverbs", exc)
                self.native = None
        self.state = "init"
        self._closed = False
        # to_error() may come from another thread (a link closing without flush) while the owning
        # thread destroys the QP: the state changes under this lock, never on a destroyed QP
        self._state_lock = threading.Lock()

    def native_context(self) -> int:
        import ctypes

        # struct ibv_qp starts with its ibv_context pointer
        return ctypes.c_void_p.from_address(self.qp_handle).value or 0

    def connect(self, qpn: int, psn: int, gid: bytes) -> None:
        pv = self.device.pv
        attr = pv.QPAttr(port_num=self.device.port)
        attr.qp_access_flags = pv.enums.IBV_ACCESS_LOCAL_WRITE | pv.enums.IBV_ACCESS_REMOTE_WRITE
        attr.path_mtu = self.device.mtu
        attr.dest_qp_num = qpn
        attr.rq_psn = psn
        attr.sq_psn = self.psn
        attr.max_dest_rd_atomic = 1
        attr.max_rd_atomic = 1
        attr.min_rnr_timer = 12
        attr.timeout = 14
        attr.retry_cnt = self.device.retry_cnt
        attr.rnr_retry = 7
        route = pv.GlobalRoute(dgid=pv.GID(gid_text(gid)), sgid_index=self.device.gid_index, hop_limit=64)
        attr.ah_attr = pv.AHAttr(port_num=self.device.port, is_global=1, gr=route, dlid=0)
        self.qp.to_rts(attr)
        self.state = "rts"

    def to_error(self) -> None:
        """Move the QP to ERR: incoming writes are refused, outstanding work requests flush."""
        with self._state_lock:
            if self.state in ("error", "closed"):
                return
            pv = self.device.pv
            attr = pv.QPAttr()
            attr.qp_state = pv.enums.IBV_QPS_ERR
            self.qp.modify(attr, pv.enums.IBV_QP_STATE)
            self.state = "error"

    # posting and polling -----------------------------------------------------------------------
    def post_recvs(self, wr_id: int, count: int) -> None:
        scratch = self.device.scratch
        if self.native is not None:
            self.native.post_recvs(self.qp_handle, wr_id, count, scratch.buf, 64, scratch.lkey)
            return
        pv = self.device.pv
        for i in range(count):
            sge = pv.SGE(scratch.buf, 64, scratch.lkey)
            self.qp.post_recv(pv.RecvWR(wr_id=wr_id + i, num_sge=1, sg=[sge]))

    def post_writes(self, wr_id: int, local: np.ndarray, lengths: np.ndarray, lkeys: np.ndarray,
                    remote: np.ndarray, rkeys: np.ndarray, imm: int) -> None:
        """Post one chain; ``imm >= 0`` makes the last WRITE carry that immediate."""
        if self.native is not None:
            self.native.post_writes(self.qp_handle, wr_id, local.astype(np.uint64).tobytes(),
                                    lengths.astype(np.uint64).tobytes(), lkeys.astype(np.uint32).tobytes(),
                                    remote.astype(np.uint64).tobytes(), rkeys.astype(np.uint32).tobytes(),
                                    SIGNAL_EVERY, imm)
            return
        pv = self.device.pv
        e = pv.enums
        wrs = []
        n = len(local)
        for i in range(n):
            sge = pv.SGE(int(local[i]), int(lengths[i]), int(lkeys[i]))
            last = i == n - 1
            signaled = last or (i + 1) % SIGNAL_EVERY == 0
            opcode = e.IBV_WR_RDMA_WRITE_WITH_IMM if (last and imm >= 0) else e.IBV_WR_RDMA_WRITE
            wr = pv.SendWR(wr_id=wr_id + i, opcode=opcode, num_sge=1, sg=[sge],
                           send_flags=e.IBV_SEND_SIGNALED if signaled else 0)
            wr.set_wr_rdma(int(rkeys[i]), int(remote[i]))
            if last and imm >= 0:
                wr.imm_data = socket.htonl(imm)
            wrs.append(wr)
        for a, b in zip(wrs, wrs[1:]):
            a.next_wr = b
        self.qp.post_send(wrs[0])

    # memory windows (receiver; C only: kvxfer.transport.verbs_windows) ---------------------------
    def post_binds(self, wr_id: int, mws: np.ndarray, rkeys: np.ndarray, mrs: np.ndarray, addrs: np.ndarray,
                   lengths: np.ndarray, access: int) -> None:
        """One chain of type-2 window binds on this QP, the last signalled (OSError if refused)."""
        if self.native is None or not self.scq_handle:
            raise TransportError(f"queue pair {self.qpn} has no native send path for memory windows")
        self.native.post_binds(self.qp_handle, wr_id, mws.astype(np.uint64).tobytes(),
                               rkeys.astype(np.uint32).tobytes(), mrs.astype(np.uint64).tobytes(),
                               addrs.astype(np.uint64).tobytes(), lengths.astype(np.uint64).tobytes(), access)

    def post_invalidates(self, wr_id: int, rkeys: np.ndarray) -> None:
        """One chain of LOCAL_INV of these window keys on this QP, the last signalled."""
        self.native.post_invalidates(self.qp_handle, wr_id, rkeys.astype(np.uint32).tobytes())

    def wait_send(self, wr_id: int, timeout: float) -> str:
        """Wait for send work request ``wr_id`` (signalled, the last of its chain) to complete on the
        send completion queue; '' on success, else what went wrong (a failed or flushed work request,
        or no completion within ``timeout``)."""
        deadline = time.monotonic() + timeout
        spins = 0
        while True:
            records = np.frombuffer(self.native.poll(self.scq_handle, 64), dtype=RECORD)
            for rec in records:
                if rec["status"] != WC_SUCCESS:
                    return f"work request {int(rec['wr_id'])} completed with status {int(rec['status'])}"
                if int(rec["wr_id"]) == wr_id:
                    return ""
            if time.monotonic() >= deadline:
                return f"no completion for work request {wr_id} within {timeout:g} s"
            spins += 1
            if spins > 200:
                time.sleep(0.00005)

    def poll(self) -> np.ndarray:
        if self.native is not None:
            return np.frombuffer(self.native.poll(self.cq_handle, POLL_BATCH), dtype=RECORD)
        npolled, wcs = self.cq.poll(POLL_BATCH)
        out = np.zeros(npolled, dtype=RECORD)
        for i, wc in enumerate(wcs[:npolled]):
            imm = socket.ntohl(wc.imm_data) if wc.wc_flags & self.device.pv.enums.IBV_WC_WITH_IMM else 0
            out[i] = (wc.wr_id, wc.status, wc.opcode, wc.byte_len, imm, wc.wc_flags, wc.qp_num)
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.to_error()
        except Exception:  # a QP that never left RESET
            pass
        with self._state_lock:
            self.state = "closed"
            self.qp.close()
            self.cq.close()
            if self.scq is not None:
                self.scq.close()


# receiving side ---------------------------------------------------------------------------------


@dataclass
class _Peering:
    engine: str
    session: bytes
    epoch: int
    endpoint: Endpoint
    conn: Any = None
    recv_posted: int = 0


CAPABILITIES = Capabilities(write_log=True, ordered_via_control=True, requires_final=True,
                            sees_disconnect=False)


def encode_offer(epoch: int, qpn: int, psn: int, gid: bytes, mtu: int, addrs: Any, rkeys: Any) -> bytes:
    """OFFER blob of the verbs transport: the receiver's queue pair and where each buffer is."""
    return msgpack.packb({"v": 1, "epoch": int(epoch), "qpn": int(qpn), "psn": int(psn), "gid": bytes(gid),
                          "mtu": int(mtu), "addrs": [int(a) for a in addrs], "rkeys": [int(k) for k in rkeys]},
                         use_bin_type=True)


def encode_accept(qpn: int, psn: int, gid: bytes) -> bytes:
    """ACCEPT blob of the verbs transport: the writer's queue pair, already in RTS."""
    return msgpack.packb({"v": 1, "qpn": int(qpn), "psn": int(psn), "gid": bytes(gid)}, use_bin_type=True)


_U24 = (1 << 24) - 1
_BLOB_FIELDS = {"epoch": (int, (1 << 64) - 1), "qpn": (int, _U24), "psn": (int, _U24), "mtu": (int, 5)}


def decode_blob(blob: bytes, what: str, required: tuple[str, ...]) -> dict[str, Any]:
    """A verbs OFFER or ACCEPT blob, checked field by field; ProtocolError naming the problem."""
    try:
        data = msgpack.unpackb(blob, raw=False)
    except Exception as exc:
        raise ProtocolError(f"verbs {what} blob is not msgpack: {exc}") from None
    if not isinstance(data, dict) or data.get("v") != 1:
        raise ProtocolError(f"verbs {what} blob must be a map with v=1")
    for name in required:
        value = data.get(name)
        if name == "gid":
            if not isinstance(value, bytes) or len(value) != 16:
                raise ProtocolError(f"verbs {what} blob: gid must be 16 bytes")
        elif name in ("addrs", "rkeys"):
            limit = (1 << 64) - 1 if name == "addrs" else (1 << 32) - 1
            if not isinstance(value, list) or not all(
                    isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= limit for x in value):
                raise ProtocolError(f"verbs {what} blob: {name} must be a list of unsigned integers")
        else:
            kind, limit = _BLOB_FIELDS[name]
            if not isinstance(value, kind) or isinstance(value, bool) or not 0 <= value <= limit:
                raise ProtocolError(f"verbs {what} blob: {name} missing or out of range")
    return data


class VerbsReceiver(ReceiverBackend):
    """The decode side: one queue pair per writer and epoch; lands nothing itself (the NIC does)."""

    name = "verbs"
    capabilities = CAPABILITIES

    def __init__(self, layout: KVLayout, guard: WriteGuard, options: VerbsOptions, *,
                 on_closed: Callable[[Any, str], None]) -> None:
        self.layout = layout
        self.guard = guard
        guard.requires_final = True
        if options.window_max_runs < 1:
            raise ConfigError(f"verbs option 'window_max_runs' must be at least 1, not {options.window_max_runs}")
        self.device = VerbsDevice(options, layout, remote_write=True)
        self.address = f"verbs:{self.device.name}:{gid_text(self.device.gid)}"
        self.windows: ReceiverWindows | None = None
        if self.device.windows:
            self.windows = ReceiverWindows(self.device, max_runs=options.window_max_runs, max_windows=SQ_DEPTH - 64,
                                           max_mw=self.device.max_mw, on_broken=self._windows_broken)
            self.write_window = "memory_windows"
            log.info("verbs receiver on %s: writes land only through per-request memory windows (%s; one per "
                     "buffer and run of pages, up to %d runs, else one per buffer), invalidated before the "
                     "pages are freed", self.device.name, self.device.windows_reason, options.window_max_runs)
        else:
            self.write_window = "region_rkey"
            log.info("verbs receiver on %s: writes land through the regions' rkeys (no per-request memory "
                     "windows: %s); the write log is checked against the guard and a fence stops the rest",
                     self.device.name, self.device.windows_reason)
        self._on_closed = on_closed
        self._lock = threading.Lock()
        self._poll_mutex = threading.Lock()
        self._peerings: dict[tuple[str, int], _Peering] = {}
        self._by_qpn: dict[int, _Peering] = {}
        self._broken: collections.deque[tuple[Any, str]] = collections.deque()
        self._closed = False
        self.protocol_errors = 0
        self.completion_errors = 0
        self.broken_connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll_loop, name="kvxfer-verbs-recv", daemon=True)
        self._thread.start()

    def offer(self, peer: str, session: bytes, epoch: int) -> bytes:
        """A fresh queue pair for ``peer`` under ``epoch``; the writer connects to it."""
        endpoint = Endpoint(self.device, send_cq=self.windows is not None)
        peering = _Peering(peer, session, epoch, endpoint)
        endpoint.post_recvs(0, RQ_DEPTH)
        peering.recv_posted = RQ_DEPTH
        with self._lock:
            self._peerings[(peer, epoch)] = peering
            self._by_qpn[endpoint.qpn] = peering
        # with memory windows the regions' rkeys grant nothing remotely: the offer names none (0), and
        # each META carries the keys of its request's windows
        rkeys = np.zeros_like(self.device.buffer_rkey) if self.windows is not None else self.device.buffer_rkey
        return encode_offer(epoch, endpoint.qpn, endpoint.psn, self.device.gid, self.device.mtu,
                            self.device.buffer_addr, rkeys)

    def accept(self, peer: str, session: bytes, epoch: int, blob: bytes) -> Any:
        """Move our queue pair for (peer, epoch) to RTS towards the writer's; returns the conn id."""
        data = decode_blob(blob, "ACCEPT", ("qpn", "psn", "gid"))
        with self._lock:
            peering = self._peerings.get((peer, epoch))
        if peering is None or peering.session != session:
            raise ProtocolError(f"ACCEPT from {peer!r} epoch {epoch}: no such offer")
        if peering.conn is not None:
            raise ProtocolError(f"ACCEPT from {peer!r} epoch {epoch}: already connected")
        peering.endpoint.connect(data["qpn"], data["psn"], data["gid"])
        peering.conn = (peer, epoch)
        return peering.conn

    def withdraw(self, peer: str, epoch: int) -> None:
        with self._lock:
            peering = self._peerings.get((peer, epoch))
        if peering is not None and peering.conn is None:
            self.fence((peer, epoch))

    def grant(self, conn: Any, gen: int, pages: np.ndarray) -> bytes:
        """Bind ``gen``'s memory windows over ``pages`` on ``conn``'s queue pair; META's access blob
        (empty without windows: the offer's region rkeys apply)."""
        if self.windows is None:
            return b""
        with self._lock:
            peering = self._peerings.get(conn)
        if peering is None or peering.conn != conn:
            raise TransportError(f"request generation {gen}: no live verbs connection {conn}")
        return self.windows.grant(peering.endpoint, conn[1], gen, pages)

    def revoke(self, conn: Any, gen: int) -> None:
        """Invalidate ``gen``'s windows (no new write through them lands once this returns)."""
        if self.windows is not None:
            self.windows.revoke(gen)

    def _windows_broken(self, endpoint: Endpoint, reason: str) -> None:
        """A window operation failed on ``endpoint`` (its QP is in the error state by now): the poller
        fences the connection and reports it closed, outside every lock."""
        with self._lock:
            peering = next((p for p in self._peerings.values() if p.endpoint is endpoint), None)
        if peering is not None and peering.conn is not None:
            self._broken.append((peering.conn, reason))

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"protocol_errors": self.protocol_errors, "completion_errors": self.completion_errors,
                               "broken_connections": self.broken_connections, "write_window": self.write_window,
                               "write_window_reason": self.device.windows_reason}
        if self.windows is not None:
            out["windows"] = self.windows.stats()
        return out

    def sync(self, conn: Any, gen: int | None = None, *, wait: float = 2.0) -> None:
        """Process every completion already in the queue before a DONE is acted on; with ``gen``,
        wait (bounded) until that generation's final immediate has been attributed."""
        deadline = time.monotonic() + wait
        while True:
            self._poll_once()
            window = self.guard.window(gen) if gen is not None else None
            if window is None or not window.open or window.final_writes or time.monotonic() >= deadline:
                return
            time.sleep(0.001)

    def _poll_once(self) -> int:
        # One poller at a time, from polling to delivery, so that sync() returns only after the
        # completions polled by anyone have reached the guard.
        with self._poll_mutex:
            return self._poll_and_deliver()

    def _poll_and_deliver(self) -> int:
        handled = 0
        finals: list[tuple[Any, int, int]] = []
        with self._lock:
            for peering in list(self._peerings.values()):
                records = peering.endpoint.poll()
                repost = 0
                for rec in records:
                    handled += 1
                    if rec["status"] != WC_SUCCESS:
                        if peering.endpoint.state == "rts":
                            # the device moved our queue pair to the error state (a write it refused,
                            # e.g. with a stale window's key): the connection is over, and every
                            # receive still posted comes back flushed (one line for all of them)
                            self.completion_errors += 1
                            if peering.conn is not None and all(c != peering.conn for c, _ in self._broken):
                                log.warning("receive completion error %d on %s: its queue pair failed",
                                            int(rec["status"]), peering.conn)
                                self._broken.append((peering.conn, f"queue pair failed (completion status "
                                                                   f"{int(rec['status'])})"))
                        continue
                    repost += 1
                    if rec["opcode"] == WC_RECV_RDMA_WITH_IMM:
                        finals.append((peering.conn, int(rec["imm"]), int(rec["byte_len"])))
                if repost and peering.endpoint.state == "rts":
                    peering.endpoint.post_recvs(peering.recv_posted, repost)
                    peering.recv_posted += repost
        for conn, imm, nbytes in finals:  # the guard takes the engine lock: never under ours
            self.guard.final(conn, imm, nbytes)
        return handled

    def _poll_loop(self) -> None:
        idle = 0.0
        while not self._stop.is_set():
            try:
                handled = self._poll_once()
                while self._broken:
                    conn, reason = self._broken.popleft()
                    if self.fence(conn):  # reported once, by whoever fenced it
                        self.broken_connections += 1
                        self._on_closed(conn, reason)
            except Exception:
                log.exception("verbs receive poller error")
                handled = 0
            idle = 0.0 if handled else min(0.002, idle + 0.0001)
            if idle:
                time.sleep(idle)

    def fence(self, conn: Any) -> bool:
        """QP to ERR (nothing more lands), flush, destroy. True if it was live."""
        with self._lock:
            peering = self._peerings.pop(conn, None) if conn is not None else None
            if peering is None:
                return False
            self._by_qpn.pop(peering.endpoint.qpn, None)
            peering.endpoint.to_error()
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline and len(peering.endpoint.poll()):
                pass
            if self.windows is not None:  # a bound type-2 window holds its QP: deallocate them first
                self.windows.dispose(peering.endpoint)
            peering.endpoint.close()
        return True

    def connections(self) -> list[Any]:
        with self._lock:
            return [p.conn for p in self._peerings.values() if p.conn is not None]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._thread.join(timeout=5)
        for key in list(self._peerings):
            conn = self._peerings[key].conn
            if self.fence(key) and conn is not None:
                self._on_closed(conn, "receiver closed")
        if self.windows is not None:
            self.windows.close()
        self.device.close()


# sending side -----------------------------------------------------------------------------------


@dataclass
class _Posted:
    first: int
    last: int
    batch: WriteBatch | None
    on_complete: Callable[[WriteBatch, int, int], None] | None


class VerbsLink(SenderLink, LaneLink):
    """The prefill side of one peering and epoch: posts writes, tracks completions, sends ordered
    messages once everything posted before them completed."""

    def __init__(self, layout: KVLayout, device: VerbsDevice, offer: bytes, *, engine: str, epoch: int,
                 send_control: Callable[[m.Message], None], on_closed: Callable[[VerbsLink, str], None],
                 lanes: SendLanes, faults: Any = None) -> None:
        info = decode_blob(offer, "OFFER", ("epoch", "qpn", "psn", "gid", "mtu", "addrs", "rkeys"))
        if info["epoch"] != epoch:
            raise ProtocolError(f"verbs OFFER blob for epoch {info['epoch']} arrived as epoch {epoch}")
        if len(info["addrs"]) != layout.num_buffers or len(info["rkeys"]) != layout.num_buffers:
            raise ProtocolError(f"verbs OFFER names {len(info['addrs'])} buffers, the layout has {layout.num_buffers}")
        self.layout = layout
        self.device = device
        self.epoch = epoch
        self.conn_id = (engine, epoch)
        self.faults = faults
        self._send_control = send_control
        self._on_closed = on_closed
        self._remote_addr = np.array(info["addrs"], dtype=np.uint64)
        self._remote_rkey = np.array(info["rkeys"], dtype=np.uint32)
        self.endpoint = Endpoint(device)
        self.endpoint.connect(info["qpn"], info["psn"], info["gid"])
        self.accept_blob = encode_accept(self.endpoint.qpn, self.endpoint.psn, device.gid)
        self._cond = threading.Condition()
        self._queue: collections.deque[Any] = collections.deque()
        self._inflight: collections.deque[_Posted] = collections.deque()
        self._ordered: collections.deque[tuple[int, Any]] = collections.deque()
        self._held: collections.deque[tuple[float, Any]] = collections.deque()
        self._tables: collections.OrderedDict[int, WindowTable] = collections.OrderedDict()  # by generation
        self._next_wr = 1
        self._completed_upto = 0
        self._outstanding = 0
        self._alive = True
        self._closing = False
        self._reported = False
        self.bytes_sent = 0
        self.wrs_posted = 0
        self.post_seconds = 0.0
        self._init_lane(lanes)

    @property
    def alive(self) -> bool:
        return self._alive

    @property
    def ended(self) -> bool:
        """The link ended: ``_shutdown`` reported every write in flight or queued before ``_ended`` was set."""
        return self._ended.is_set()

    # posting API (any thread) -----------------------------------------------------------------------
    def post_writes(self, batch: WriteBatch, on_complete: Callable[[WriteBatch, int, int], None]) -> None:
        self._post(("write", batch, on_complete))

    def post_ordered(self, msg: m.Message, *, slot: int, gen: int) -> None:
        self._post(("ordered", msg))

    def post_raw(self, pieces: list[Any]) -> None:
        raise TransportError("raw frames exist only on the tcp transport")

    def _post(self, job: Any) -> None:
        with self._cond:
            if not self._alive or self._closing:
                raise TransportError(f"verbs connection epoch {self.epoch} is closed")
            self._queue.append(job)
            self._kick()

    # on the transport's sending lanes ------------------------------------------------------------------------
    def serve_step(self) -> None:
        """One pass on a lane: release late writes that fell due, post the next job (if the send queue
        has room), reap completions, send the ordered messages they allow. Then: another step at once
        when a job can be posted, a poll ``POLL_AGAIN_S`` later while writes are in flight, nothing when
        idle (a post schedules the next step)."""
        self._serving = threading.current_thread()
        reason = None
        try:
            reason = self._step()
        except Exception as exc:
            log.exception("verbs send step failed")
            reason = f"send thread failed: {exc}"
        finally:
            self._serving = None
        if reason is not None:
            self._end(reason)
            return
        with self._cond:
            self._scheduled = False
            if self._ended.is_set():
                return
            postable = self._queue and self._outstanding < SQ_DEPTH - 64
            busy = self._queue or self._inflight or self._ordered or self._held
            if postable or (self._closing and not busy):
                self._kick(continuing=True)
                return
        if busy:
            self._wake_later(time.monotonic() + POLL_AGAIN_S)

    def _step(self) -> str | None:
        """The body of one pass; the reason the link ends, or None."""
        with self._cond:
            busy = self._queue or self._inflight or self._ordered or self._held
            if not busy:
                return "closed" if self._closing else None
            job = self._queue.popleft() if self._queue and self._outstanding < SQ_DEPTH - 64 else None
        if self._held:
            self._release_held(force=self._closing)
        if job is not None:
            if self.faults is not None:
                self.faults.wait_if_paused()
            self._do(job)
        failure = self._reap()
        if failure:
            return failure
        self._flush_ordered()
        return None

    def _end(self, reason: str) -> None:
        if self._ended.is_set():
            return
        try:
            self._shutdown(reason)
        finally:
            with self._cond:
                self._ended.set()

    def _do(self, job: Any) -> None:
        if job[0] == "ordered":
            self._ordered.append((self._next_wr - 1, job[1]))
            return
        _, batch, on_complete = job
        if batch.cancelled:
            on_complete(batch, 0, len(batch))
            return
        decision = self.faults.on_write(batch) if self.faults is not None else None
        if decision is not None:
            if decision["slow"]:
                time.sleep(self.faults.config.slow_delay_s)
            if decision["late"]:
                # Delayed on the wire: still in flight for the protocol (no completion yet), and every
                # ordered message behind it waits until it has posted and completed.
                self._held.append((time.monotonic() + self.faults.config.late_delay_s, job))
                return
        if not batch.wait_sources():  # cancelled meanwhile, or its ready event failed: nothing is posted
            on_complete(batch, 0, len(batch))
            return
        self._post_batch(batch, on_complete, decision)

    def _batch_rkeys(self, batch: WriteBatch) -> np.ndarray:
        """The rkey of every run of ``batch``: its request's memory windows (META.access), else the
        regions' rkeys from the offer. ProtocolError when the windows do not cover a run or belong to
        another connection epoch (the request then fails; nothing is posted with a wrong key)."""
        if not batch.access:
            return self._remote_rkey[batch.buffers]
        table = self._tables.get(batch.gen)
        if table is None:
            # pages are the receiver's (its pool size is not ours): the layout bounds buffers only
            table = WindowTable.decode(batch.access, num_buffers=self.layout.num_buffers, num_pages=1 << 32)
            if table.epoch != self.epoch:
                raise ProtocolError(f"request generation {batch.gen}: its memory windows are bound on connection "
                                    f"epoch {table.epoch}, this link is epoch {self.epoch}")
            self._tables[batch.gen] = table
            while len(self._tables) > 4096:
                self._tables.popitem(last=False)
        items = batch.dst_item_lens if batch.dst_item_lens is not None else self.layout.item_lens
        return table.rkeys(batch.buffers, batch.dst_offsets, batch.lengths, items)

    def _post_batch(self, batch: WriteBatch, on_complete: Any, decision: dict[str, bool] | None = None) -> None:
        n = len(batch)
        start = 0
        try:
            batch_rkeys = self._batch_rkeys(batch)
        except ProtocolError as exc:
            log.warning("verbs: writes of request generation %d not posted: %s", batch.gen, exc)
            on_complete(batch, 0, n)
            return
        while start < n:
            room = SQ_DEPTH - 64 - self._outstanding
            if room <= 0:
                failure = self._reap()
                if failure:
                    raise TransportError(failure)
                time.sleep(0.0002)
                continue
            end = min(n, start + room)
            imm = Tag(batch.slot, batch.gen).imm32() if (batch.final and end == n) else -1
            buffers = batch.buffers[start:end]
            local = self.device.buffer_addr[buffers] + batch.src_offsets[start:end].astype(np.uint64)
            lkeys = self.device.buffer_lkey[buffers]
            lengths = batch.lengths[start:end]
            remote = self._remote_addr[buffers] + batch.dst_offsets[start:end].astype(np.uint64)
            rkeys = batch_rkeys[start:end]
            if decision is not None and decision["flip"] and start == 0:
                local, lkeys = self._flipped_copy(local, lkeys, lengths)
            first = self._next_wr
            t0 = time.perf_counter()
            self.endpoint.post_writes(first, local, lengths, lkeys, remote, rkeys, imm)
            self.post_seconds += time.perf_counter() - t0
            count = end - start
            self._next_wr += count
            self._outstanding += count
            self.wrs_posted += count
            self.bytes_sent += int(lengths.sum())
            self._inflight.append(_Posted(first, first + count - 1, batch, on_complete))
            if decision is not None and (decision["duplicate"] or decision["capture"]):
                if decision["capture"]:
                    self.faults.keep_captured(("verbs", local, lengths, lkeys, remote, rkeys))
                if decision["duplicate"]:
                    first = self._next_wr
                    self.endpoint.post_writes(first, local, lengths, lkeys, remote, rkeys, -1)
                    self._next_wr += count
                    self._outstanding += count
                    self._inflight.append(_Posted(first, first + count - 1, None, None))
            start = end

    def _flipped_copy(self, local: np.ndarray, lkeys: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Fault: the first run goes from a bounce copy with one bit flipped (the source stays intact)."""
        import ctypes

        size = int(lengths[0])
        bounce = self.device.bounce(size)
        ctypes.memmove(bounce.buf, int(local[0]), size)
        view = (ctypes.c_uint8 * size).from_address(bounce.buf)
        data = bytearray(view)
        self.faults.flip(data)
        ctypes.memmove(bounce.buf, bytes(data), size)
        local = local.copy()
        lkeys = lkeys.copy()
        local[0] = bounce.buf
        lkeys[0] = bounce.lkey
        return local, lkeys

    def _release_held(self, *, force: bool = False) -> None:
        now = time.monotonic()
        while self._held and (force or self._held[0][0] <= now):
            _, job = self._held.popleft()
            _, batch, on_complete = job
            if batch.cancelled or not self._alive:
                on_complete(batch, 0, len(batch))
            else:
                self._post_batch(batch, on_complete)

    def _reap(self) -> str:
        """Account completions; returns a failure reason when the queue pair broke."""
        records = self.endpoint.poll()
        failure = ""
        for rec in records:
            wr_id = int(rec["wr_id"])
            ok = rec["status"] == WC_SUCCESS
            # RC completes in order: everything up to wr_id is done (successfully, unless this one failed).
            self._complete_upto(wr_id, failed_last=not ok)
            if not ok and not failure:
                failure = f"work request failed with status {int(rec['status'])}"
        return failure

    def _complete_upto(self, wr_id: int, *, failed_last: bool) -> None:
        while self._inflight and self._inflight[0].first <= wr_id:
            posted = self._inflight[0]
            upto = min(wr_id, posted.last)
            done = upto - max(posted.first, self._completed_upto + 1) + 1
            if done > 0:
                self._completed_upto = upto
                self._outstanding -= done
                failed = 1 if (failed_last and upto == wr_id) else 0
                if posted.on_complete is not None and posted.batch is not None:
                    posted.on_complete(posted.batch, done - failed, failed)
            if upto == posted.last:
                self._inflight.popleft()
            else:
                break

    def _flush_ordered(self) -> None:
        while self._ordered and not self._held and self._ordered[0][0] <= self._completed_upto:
            _, msg = self._ordered.popleft()
            self._send_control(msg() if callable(msg) else msg)

    def _shutdown(self, reason: str) -> None:
        with self._cond:
            self._alive = False
            queued = list(self._queue)
            self._queue.clear()
        try:
            self.endpoint.to_error()
            deadline = time.monotonic() + 2.0
            while self._inflight and time.monotonic() < deadline:
                self._reap()
        except Exception:  # pragma: no cover - device gone
            pass
        self.endpoint.close()  # destroyed: no work request of it can touch memory any more
        for posted in list(self._inflight):
            remaining = posted.last - max(posted.first, self._completed_upto + 1) + 1
            if remaining > 0 and posted.on_complete is not None and posted.batch is not None:
                posted.on_complete(posted.batch, 0, remaining)
        self._inflight.clear()
        for job in queued + [j for _, j in self._held]:
            if job[0] == "write":
                job[2](job[1], 0, len(job[1]))
        self._held.clear()
        if not self._reported:
            self._reported = True
            self._on_closed(self, reason)

    def close(self, *, flush: bool = True) -> None:
        with self._cond:
            if not self._closing:
                self._closing = True
                if not flush:
                    for job in self._queue:
                        if job[0] == "write":
                            job[1].cancelled = True
                self._cond.notify_all()
        if not flush:
            # Do not wait out the retries of writes to a peer that is gone: the QP goes to ERR now
            # and every outstanding work request completes (flushed) at once.
            try:
                self.endpoint.to_error()
            except Exception:  # already destroyed by the sending thread
                pass
        if self.faults is not None:
            self.faults.resume()
        with self._cond:
            self._kick()
        if self._serving is not threading.current_thread():
            self._ended.wait(30)

    def post_rate(self) -> float:
        """Work requests posted per second of posting time (the measured post rate)."""
        return self.wrs_posted / self.post_seconds if self.post_seconds else 0.0


class VerbsTransport(SenderTransport):
    """The prefill side: one opened device (no remote write access), one :class:`VerbsLink` per OFFER."""

    name = "verbs"
    capabilities = CAPABILITIES

    def __init__(self, layout: KVLayout, options: VerbsOptions) -> None:
        self.layout = layout
        self.device = VerbsDevice(options, layout, remote_write=False)
        self._links: weakref.WeakSet[VerbsLink] = weakref.WeakSet()
        self.lanes = SendLanes("verbs", threads=options.send_threads, watch=False)

    def connect(self, request: LinkRequest) -> VerbsLink:
        link = VerbsLink(self.layout, self.device, request.blob, engine=request.engine, epoch=request.epoch,
                         send_control=request.send_control, on_closed=request.on_closed, faults=request.faults,
                         lanes=self.lanes)
        self._links.add(link)
        return link

    def close(self) -> None:
        """Close every link still running (their queue pairs go first), then the sending lanes, then the
        device: a lane polling a completion queue of a closed device would crash the process."""
        for link in list(self._links):
            link.close(flush=False)
        self.lanes.close()
        self.device.close()


def _options(config: Any) -> VerbsOptions:
    return config.options("verbs") if hasattr(config, "options") else VerbsOptions()


def _receiver(layout: KVLayout, guard: WriteGuard, config: Any, hooks: ReceiverHooks) -> VerbsReceiver:
    return VerbsReceiver(layout, guard, _options(config), on_closed=hooks.on_closed)


def _sender(layout: KVLayout, config: Any) -> VerbsTransport:
    return VerbsTransport(layout, _options(config))


TRANSPORT = TransportFactory(
    name="verbs",
    summary="RDMA WRITE_WITH_IMM over ibverbs RC queue pairs (pyverbs; GPU memory through dma-buf)",
    capabilities=CAPABILITIES,
    receiver=_receiver,
    sender=_sender,
    options=VerbsOptions,
    available=lambda: available(),
)

__all__ = ["TRANSPORT", "VerbsDevice", "VerbsLink", "VerbsOptions", "VerbsReceiver", "VerbsTransport",
           "WriteRefused", "available"]
