"""kvxfer as SGLang's transfer backend, driven the way SGLang's prefill and decode schedulers drive it.

Uses the real, pinned ``sglang`` package (installed by ``tools/install_sglang.py``; skipped with the
reason when absent): its base classes, ``KVArgs``, ``KVPoll``, ``KVTransferError``, ``ServerArgs``,
``MetadataBuffers``, its bootstrap registry and ``get_kv_class`` after :func:`register`. KV buffers are
CPU tensors laid out as SGLang's MHA pool lays them (per layer K then V, item = page_size x heads x
head_dim), and every check is on the bytes that arrived.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import types
from http import HTTPStatus

import numpy as np
import pytest

sglang = pytest.importorskip("sglang", reason="sglang not installed (python3 tools/install_sglang.py)")
torch = pytest.importorskip("torch")

os.environ.setdefault("KVXFER_TEST_FAULTS", "1")  # lets tests reach the prefill engine's fault injector
os.environ.setdefault("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT", "4")
os.environ.setdefault("SGLANG_HOST_IP", "127.0.0.1")  # the soft-RoCE VM has no address SGLang can detect

from kvxfer.integrations.sglang import register  # noqa: E402

register()

from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll  # noqa: E402
from sglang.srt.disaggregation.common.conn import KVTransferError  # noqa: E402
from sglang.srt.disaggregation.utils import (  # noqa: E402
    DisaggregationMode,
    KVClassType,
    MetadataBuffers,
    TransferBackend,
    get_kv_class,
)
from sglang.srt.server_args import ServerArgs  # noqa: E402

from kvxfer.wire import messages as m  # noqa: E402

from .sglang_env import free_ports, make_tiny_llama, publish_rank  # noqa: E402

LAYERS, HEADS, HEAD_DIM, PAGE = 2, 2, 16, 4
BACKEND = TransferBackend("kvxfer")


class Rank:
    """One scheduler rank's KV pool (SGLang's MHA layout), metadata buffers and kvxfer manager."""

    def __init__(self, mode: DisaggregationMode, pages: int, port: int, context: int, model: str,
                 page: int = PAGE, **extra_args: object) -> None:
        slots = (pages + 1) * page  # SGLang pads the pool by one page
        self.k = [torch.zeros((slots, HEADS, HEAD_DIM), dtype=torch.bfloat16) for _ in range(LAYERS)]
        self.v = [torch.zeros((slots, HEADS, HEAD_DIM), dtype=torch.bfloat16) for _ in range(LAYERS)]
        bufs = self.k + self.v
        self.meta = MetadataBuffers(8, hidden_size=16, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=0)
        args = KVArgs()
        args.engine_rank = 0
        args.kv_data_ptrs = [b.data_ptr() for b in bufs]
        args.kv_data_lens = [b.nbytes for b in bufs]
        args.kv_item_lens = [b[0].nbytes * page for b in bufs]
        args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = self.meta.get_buf_infos()
        args.state_data_ptrs = []
        args.page_size = page
        args.kv_cache_dtype_str = "bfloat16"
        args.ib_device = None
        args.state_item_lens, args.state_types, args.kv_layout, args.system_dp_rank, args.pp_rank = [], [], None, 0, 0
        args.total_kv_head_num = HEADS  # what SGLang's model config says: the pool gets a geometry (its layers)
        server_args = ServerArgs(model_path=model, device="cpu", disaggregation_mode=mode.value,
                                 disaggregation_transfer_backend="kvxfer", disaggregation_bootstrap_port=port,
                                 host="127.0.0.1", context_length=context, page_size=page, **extra_args)
        publish_rank(server_args)  # what SGLang's scheduler process does before it builds the manager
        self.mgr = get_kv_class(BACKEND, KVClassType.MANAGER)(args, mode, server_args, False)
        self.bootstrap_addr = f"127.0.0.1:{port}"

    def page_bytes(self, pages: np.ndarray) -> list[np.ndarray]:
        out = []
        for buf in self.k + self.v:
            raw = buf.view(torch.uint8).numpy().reshape(-1, PAGE * HEADS * HEAD_DIM * 2)
            out.append(raw[pages].copy())
        return out

    def fill(self, pages: np.ndarray, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for buf in self.k + self.v:
            for p in pages.tolist():
                buf[p * PAGE : (p + 1) * PAGE] = torch.randn((PAGE, HEADS, HEAD_DIM), generator=gen).to(torch.bfloat16)

    def close(self) -> None:
        self.mgr.close()


def _verbs_ready() -> tuple[bool, str]:
    from .conftest import verbs_skip_reason

    why = verbs_skip_reason()
    return why is None, why or ""


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return str(make_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(params=["tcp", pytest.param("verbs", marks=pytest.mark.verbs)])
def pd(request, monkeypatch, tiny_model):
    """A bootstrap server, a prefill rank and a decode rank (decode pool twice the prefill's), over
    the tcp transport, and over verbs where a verbs device exists (the soft-RoCE VM)."""
    if request.param == "verbs":
        ok, why = _verbs_ready()
        if not ok:
            pytest.skip(why)
        monkeypatch.setenv("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT", "20")
    monkeypatch.setenv("KVXFER_TRANSPORT", request.param)
    port = free_ports(1)[0]
    server = get_kv_class(BACKEND, KVClassType.BOOTSTRAP_SERVER)("127.0.0.1", port)
    prefill = Rank(DisaggregationMode.PREFILL, 24, port, context=24 * PAGE, model=tiny_model)
    decode = Rank(DisaggregationMode.DECODE, 48, port, context=24 * PAGE, model=tiny_model)
    yield prefill, decode
    for rank in (decode, prefill):
        if rank.mgr.engine.faults is not None:
            rank.mgr.engine.faults.resume()
        rank.mgr.engine.check_accounting()
        rank.close()
    server.close()


def _poll_until(obj, targets, timeout: float = 60.0) -> int:
    deadline = time.monotonic() + timeout
    state = obj.poll()
    while state not in targets and time.monotonic() < deadline:
        time.sleep(0.01)
        state = obj.poll()
    return state


def _bootstrap(prefill: Rank, decode: Rank, room: int, src: np.ndarray, dst: np.ndarray, aux: tuple[int, int]):
    """SGLang's handshake: decode receiver init + send_metadata; prefill sender polled to
    WaitingForInput, then init(num_pages, metadata_buffer_index)."""
    sender = get_kv_class(BACKEND, KVClassType.SENDER)(mgr=prefill.mgr, bootstrap_addr=prefill.bootstrap_addr,
                                                        bootstrap_room=room)
    receiver = get_kv_class(BACKEND, KVClassType.RECEIVER)(mgr=decode.mgr, bootstrap_addr=decode.bootstrap_addr,
                                                            bootstrap_room=room)
    assert sender.poll() == KVPoll.Bootstrapping and receiver.poll() == KVPoll.Bootstrapping
    assert decode.mgr.try_ensure_parallel_info(decode.bootstrap_addr)  # the decode scheduler's lookup
    receiver.init(prefill_dp_rank=0)
    assert receiver.poll() == KVPoll.WaitingForInput
    receiver.send_metadata(dst.astype(np.int32), aux_index=aux[1], state_indices=None, decode_prefix_len=0)
    if receiver.poll() == KVPoll.Failed:
        return sender, receiver
    assert _poll_until(sender, {KVPoll.WaitingForInput, KVPoll.Failed}) == KVPoll.WaitingForInput
    sender.init(len(src), aux[0])
    return sender, receiver


def _ordered(prefill: Rank, decode: Rank, msg: m.Message) -> None:
    """Deliver an ordered message as the writer's transport would (a hostile or replaying writer)."""
    engine = prefill.mgr.engine
    if engine.config.transport == "tcp":
        from kvxfer.wire.frames import FrameKind, message_frame

        link = engine.peers[decode.mgr.engine.engine_id].link
        link.post_raw([message_frame(FrameKind.ORDERED, m.encode(msg), generation=msg.gen)])
    else:
        engine._send_to_peer(decode.mgr.engine.engine_id, msg)


def _metadata(rank: Rank, index: int, room: int, token: int) -> None:
    rank.meta.output_ids[index][0] = token
    rank.meta.bootstrap_room[index][0] = room


def test_prefill_and_decode_sequences_reach_success_with_the_bytes(pd):
    prefill, decode = pd
    room = 0xC0FFEE
    src = np.array([3, 4, 5, 9, 10, 20, 21], dtype=np.int64)
    dst = np.array([40, 2, 3, 4, 30, 31, 7], dtype=np.int64)
    prefill.fill(src, seed=1)
    _metadata(prefill, 1, room, token=4242)
    sender, receiver = _bootstrap(prefill, decode, room, src, dst, aux=(1, 5))
    assert sender.poll() == KVPoll.WaitingForInput
    for chunk in (src[:3], src[3:5], src[5:]):  # chunked prefill: one send per chunk, last one detected
        sender.send(chunk.astype(np.int32), None, num_kv_tokens=len(chunk) * PAGE)
    assert _poll_until(receiver, {KVPoll.Success, KVPoll.Failed}) == KVPoll.Success
    assert _poll_until(sender, {KVPoll.Success, KVPoll.Failed}) == KVPoll.Success
    for got, want in zip(decode.page_bytes(dst), prefill.page_bytes(src)):
        assert np.array_equal(got, want)
    assert int(decode.meta.bootstrap_room[5][0]) == room and int(decode.meta.output_ids[5][0]) == 4242
    assert sender.get_transfer_metric().transfer_total_bytes == len(src) * sum(decode.mgr.kv_args.kv_item_lens)
    receiver.clear()
    sender.clear()
    # polls never go backwards; the pages stay in kvxfer's read custody while SGLang's request
    # reads them, and that custody ends when SGLang transfers into them again (it freed them)
    assert receiver.poll() == KVPoll.Success and sender.poll() == KVPoll.Success
    engine = decode.mgr.engine
    assert engine.status(room).state.value == "READABLE"
    assert engine.pool.ledger.free_count == decode.mgr.layout.num_pages - len(dst)
    reuse_src, reuse_dst = np.array([1, 2]), np.array([dst[3], 11])  # page dst[3] handed out again
    prefill.fill(reuse_src, seed=2)
    sender2, receiver2 = _bootstrap(prefill, decode, room + 1, reuse_src, reuse_dst, aux=(2, 6))
    assert engine.status(room).state.value == "RELEASED"
    sender2.send(reuse_src.astype(np.int32), None)
    assert _poll_until(receiver2, {KVPoll.Success, KVPoll.Failed}) == KVPoll.Success
    for got, want in zip(decode.page_bytes(reuse_dst), prefill.page_bytes(reuse_src)):
        assert np.array_equal(got, want)
    receiver2.clear()
    sender2.clear()
    # the same room reused: its held generation ends, the new one transfers
    sender3, receiver3 = _bootstrap(prefill, decode, room + 1, src[:1], dst[:1], aux=(3, 7))
    sender3.send(src[:1].astype(np.int32), None)
    assert _poll_until(receiver3, {KVPoll.Success, KVPoll.Failed}) == KVPoll.Success
    assert engine.pool.ledger.free_count == decode.mgr.layout.num_pages - 1


def test_over_capacity_request_fails_on_both_sides_and_moves_nothing(pd):
    prefill, decode = pd
    room = 77
    pages = 30  # fits the decode pool (48), not the prefill pool (24)
    src = np.arange(pages, dtype=np.int64) % 24
    dst = np.arange(pages, dtype=np.int64)
    sender, receiver = _bootstrap(prefill, decode, room, src, dst, aux=(0, 0))
    assert receiver.poll() == KVPoll.Failed
    with pytest.raises(KVTransferError, match="rejected"):
        receiver.failure_exception()
    sender.init(pages, 0)  # the prefill sees the size here and rejects it too
    assert sender.poll() == KVPoll.Failed
    with pytest.raises(KVTransferError) as err:
        sender.failure_exception()
    assert err.value.bootstrap_room == room
    assert decode.mgr.engine.stats()["writes"]["landed_bytes"] == 0
    assert prefill.mgr.engine.stats()["bytes_sent"] == 0
    assert decode.mgr.engine.pool.ledger.free_count == decode.mgr.layout.num_pages


def test_abort_mid_transfer_keeps_decode_pages_unreleasable_until_drained(pd):
    prefill, decode = pd
    room = 5150
    src = np.arange(8, dtype=np.int64)
    dst = np.arange(10, 18, dtype=np.int64)
    faults = prefill.mgr.engine.faults
    faults.pause()  # the link stalls with writes posted
    sender, receiver = _bootstrap(prefill, decode, room, src, dst, aux=(0, 1))
    sender.send(src[:4].astype(np.int32))
    receiver.abort()  # the client went away
    assert receiver.poll() == KVPoll.Failed
    receiver.ensure_abort_notified(force_arm=True)
    assert decode.mgr.is_abort_release_safe(room, len(receiver.bootstrap_infos)) is False
    time.sleep(0.3)
    assert decode.mgr.is_abort_release_safe(room, 1) is False  # still in flight: never free
    faults.resume()
    deadline = time.monotonic() + 30
    while not decode.mgr.is_abort_release_safe(room, 1) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert decode.mgr.is_abort_release_safe(room, 1)
    assert _poll_until(sender, {KVPoll.Failed, KVPoll.Success}) == KVPoll.Failed


def test_reused_room_gets_a_new_generation_and_old_messages_cannot_touch_it(pd):
    prefill, decode = pd
    room = 31337
    src = np.array([1, 2, 3], dtype=np.int64)
    dst = np.array([5, 6, 7], dtype=np.int64)
    prefill.fill(src, seed=5)
    sender, receiver = _bootstrap(prefill, decode, room, src, dst, aux=(2, 2))
    sender.send(src.astype(np.int32))
    assert _poll_until(receiver, {KVPoll.Success, KVPoll.Failed}) == KVPoll.Success
    assert _poll_until(sender, {KVPoll.Success, KVPoll.Failed}) == KVPoll.Success
    old_gen = receiver.generation
    receiver.clear()  # SGLang clears a concluded request before its room can come back
    sender.clear()
    # the same room again: a new request, a new generation; its writer stalls and it is aborted
    prefill.mgr.engine.faults.pause()
    sender2, receiver2 = _bootstrap(prefill, decode, room, src, dst, aux=(2, 2))
    assert receiver2.generation != old_gen
    sender2.send(src[:1].astype(np.int32))
    prefill.mgr.engine.sender.on_abort = lambda peer, msg: None  # hold back the genuine ack
    receiver2.abort()
    # a drain acknowledgement of the OLD generation arrives: it must not release the new one
    stale = m.DrainAck(rid=room, gen=old_gen, posted=0, completed=0)
    prefill.mgr.engine.faults.resume()
    _ordered(prefill, decode, stale)
    time.sleep(0.3)
    assert decode.mgr.is_abort_release_safe(room, 1) is False
    _ordered(prefill, decode, m.DrainAck(rid=room, gen=receiver2.generation, posted=0, completed=0))
    deadline = time.monotonic() + 30
    while not decode.mgr.is_abort_release_safe(room, 1) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert decode.mgr.is_abort_release_safe(room, 1)
    prefill.mgr.engine.sender.abort(room)


def test_corrupted_transfer_fails_poll(pd):
    prefill, decode = pd
    room = 404
    src = np.array([6, 7, 8, 9], dtype=np.int64)
    dst = np.array([1, 11, 21, 31], dtype=np.int64)
    prefill.fill(src, seed=9)
    prefill.mgr.engine.faults.flip_next_write()
    sender, receiver = _bootstrap(prefill, decode, room, src, dst, aux=(3, 3))
    sender.send(src.astype(np.int32))
    assert _poll_until(receiver, {KVPoll.Success, KVPoll.Failed}) == KVPoll.Failed
    with pytest.raises(KVTransferError, match="checksum"):
        receiver.failure_exception()
    assert _poll_until(sender, {KVPoll.Success, KVPoll.Failed}) == KVPoll.Failed
    assert int(decode.meta.bootstrap_room[3][0]) == 0  # no metadata row for an unverified transfer


def test_sglangs_own_plugin_loader_registers_the_backend_in_a_fresh_process():
    """The entry point in pyproject.toml (group ``sglang.srt.plugins``): SGLang loads it in
    launch_server before parsing arguments and in every process it spawns; nothing imported early."""
    code = ("from sglang.srt.plugins import load_plugins; load_plugins(); "
            "import sglang.srt.disaggregation.utils as u; "
            "from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES as c; "
            "print(u.get_kv_class(u.TransferBackend('kvxfer'), u.KVClassType.SENDER).__name__, 'kvxfer' in c)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["KvxferKVSender", "True"]


def test_an_admission_refusal_aborts_with_http_400_through_the_plugins_hook():
    """SGLang aborts every failed transfer with 500; kvxfer's hook (registered by the plugin, applied
    by SGLang's loader) makes a prompt refused at admission a 400 and a prefill the decode does not
    trust a 403; other failures stay 500."""
    code = ("import types; from sglang.srt.plugins import load_plugins; load_plugins(); "
            "from sglang.srt.disaggregation import decode; "
            "from kvxfer.integrations.sglang.reasons import ADMISSION_REFUSED, UNTRUSTED_PREFILL; "
            "r1, r2, r3 = (types.SimpleNamespace(return_logprob=False) for _ in range(3)); "
            "decode.prepare_abort(r1, ADMISSION_REFUSED + ' prompt of 608 tokens can never fit', status_code=500); "
            "decode.prepare_abort(r2, 'connection lost', status_code=500); "
            "decode.prepare_abort(r3, 'handshake failed with exception ' + UNTRUSTED_PREFILL + ' cannot peer', "
            "status_code=500); "
            "print(*(int(r.finished_reason.status_code) for r in (r1, r2, r3)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-3:] == ["400", "500", "403"]


def test_plain_launch_server_accepts_the_backend_and_refuses_unsupported_layouts(tiny_model):
    """``python -m sglang.launch_server --disaggregation-transfer-backend kvxfer`` parses (no wrapper),
    and a layout kvxfer cannot serve is refused at startup naming the setting."""
    out = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--model-path", tiny_model, "--device", "cpu",
                          "--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "kvxfer",
                          "--disaggregation-decode-enable-radix-cache", "--help"],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0 and "invalid choice" not in out.stderr, out.stderr[-2000:]
    from kvxfer.integrations.sglang.conn import unsupported_settings

    server_args = ServerArgs(model_path=tiny_model, device="cpu", disaggregation_mode="decode",
                             disaggregation_decode_enable_radix_cache=True, pp_size=2)
    problems = unsupported_settings(KVArgs(), server_args, DisaggregationMode.DECODE)
    assert any("--pp-size 2" in p for p in problems) and any("radix-cache" in p for p in problems), problems


def test_importing_kvxfer_never_imports_sglang():
    code = "import kvxfer, kvxfer.integrations, kvxfer.integrations.sglang, sys; " \
           "print(any(k.startswith('sglang') for k in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_prefill_bootstrap_timeout_fails_the_sender_and_refuses_a_late_destination(pd):
    """SGLang's bootstrap timeout (no decode metadata in time) applies to kvxfer's sender, and a
    destination the decode reserves afterwards is answered with REJECT at once."""
    prefill, decode = pd
    prefill.mgr.bootstrap_timeout = 0.5  # SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT, read at startup
    room = 4242
    sender = get_kv_class(BACKEND, KVClassType.SENDER)(mgr=prefill.mgr, bootstrap_addr=prefill.bootstrap_addr,
                                                        bootstrap_room=room)
    assert _poll_until(sender, {KVPoll.Failed}, timeout=10) == KVPoll.Failed
    with pytest.raises(KVTransferError, match="timed out"):
        sender.failure_exception()
    receiver = get_kv_class(BACKEND, KVClassType.RECEIVER)(mgr=decode.mgr, bootstrap_addr=decode.bootstrap_addr,
                                                            bootstrap_room=room)
    assert decode.mgr.try_ensure_parallel_info(decode.bootstrap_addr)
    receiver.init(prefill_dp_rank=0)
    receiver.send_metadata(np.array([1, 2], dtype=np.int32), aux_index=1, state_indices=None, decode_prefix_len=0)
    assert _poll_until(receiver, {KVPoll.Failed, KVPoll.Success}, timeout=10) == KVPoll.Failed
    with pytest.raises(KVTransferError, match="bootstrap timed out"):
        receiver.failure_exception()
    assert decode.mgr.engine.pool.ledger.free_count == decode.mgr.layout.num_pages


def test_decode_waiting_timeout_aborts_and_the_pages_wait_for_the_drain(pd):
    prefill, decode = pd
    decode.mgr.waiting_timeout = 0.5  # SGLANG_DISAGGREGATION_WAITING_TIMEOUT, read at startup
    src, dst = np.array([1, 2, 3]), np.array([4, 5, 6])
    prefill.mgr.engine.faults.pause()  # the writer stalls mid-transfer
    sender, receiver = _bootstrap(prefill, decode, 777, src, dst, aux=(1, 1))
    sender.send(src[:1].astype(np.int32))
    assert _poll_until(receiver, {KVPoll.Failed, KVPoll.Success}, timeout=10) == KVPoll.Failed
    assert decode.mgr.engine.status(777).state.value == "QUARANTINED"
    assert decode.mgr.is_abort_release_safe(777, 1) is False
    prefill.mgr.engine.faults.resume()
    deadline = time.monotonic() + 20
    while not decode.mgr.is_abort_release_safe(777, 1) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert decode.mgr.is_abort_release_safe(777, 1)
    assert _poll_until(sender, {KVPoll.Failed, KVPoll.Success}) == KVPoll.Failed


def test_an_early_send_waits_for_the_forward_pass_event(pd):
    """Overlap scheduling: SGLang hands the sender an event recorded after the forward pass that
    writes the prefix pages; nothing may read those pages before it completes."""
    import threading

    prefill, decode = pd
    src, dst = np.array([7, 8]), np.array([9, 10])
    sender, receiver = _bootstrap(prefill, decode, 555, src, dst, aux=(1, 1))

    class Event:
        def __init__(self) -> None:
            self.done = threading.Event()

        def synchronize(self) -> None:
            self.done.wait(30)

    event = Event()
    sender._early_send_wait_event = event
    sender.send(src.astype(np.int32))
    time.sleep(0.3)
    assert decode.mgr.engine.stats()["writes"]["landed_bytes"] == 0
    prefill.fill(src, seed=9)  # the forward pass finishes writing
    event.done.set()
    assert _poll_until(receiver, {KVPoll.Success, KVPoll.Failed}) == KVPoll.Success
    for got, want in zip(decode.page_bytes(dst), prefill.page_bytes(src)):
        assert np.array_equal(got, want)


def test_a_decode_with_another_page_size_fails_both_halves_at_once(tiny_model):
    """SGLang's own check refuses to pair pages of different sizes (it raises in the decode's lookup of
    the prefill): the request is answered at once on both halves, not left waiting for a DP rank or a
    bootstrap timeout."""
    port = free_ports(1)[0]
    server = get_kv_class(BACKEND, KVClassType.BOOTSTRAP_SERVER)("127.0.0.1", port)
    prefill = Rank(DisaggregationMode.PREFILL, 8, port, context=8 * PAGE, model=tiny_model)
    decode = Rank(DisaggregationMode.DECODE, 16, port, context=8 * PAGE, model=tiny_model, page=PAGE // 2)
    try:
        sender = get_kv_class(BACKEND, KVClassType.SENDER)(mgr=prefill.mgr, bootstrap_addr=prefill.bootstrap_addr,
                                                            bootstrap_room=98)
        receiver = get_kv_class(BACKEND, KVClassType.RECEIVER)(mgr=decode.mgr, bootstrap_addr=decode.bootstrap_addr,
                                                                bootstrap_room=98)
        t0 = time.monotonic()
        assert decode.mgr.try_ensure_parallel_info(decode.bootstrap_addr)
        assert decode.mgr.prefill_info_table[decode.bootstrap_addr].dp_size == 1  # the scheduler resolves DP rank 0
        receiver.init(prefill_dp_rank=0)
        assert receiver.poll() == KVPoll.Failed
        with pytest.raises(KVTransferError, match="Page size mismatch"):
            receiver.failure_exception()
        assert _poll_until(sender, {KVPoll.Failed}, timeout=5) == KVPoll.Failed
        assert time.monotonic() - t0 < 2.0, time.monotonic() - t0
        with pytest.raises(KVTransferError, match="page_size=4, but decode server has page_size=2"):
            sender.failure_exception()
    finally:
        decode.close()
        prefill.close()
        server.close()


def test_a_prefill_the_decode_cannot_serve_fails_both_halves_at_once(tiny_model):
    """A decode that refuses a prefill before its own admission runs (here: unequal TP with a pool kvxfer
    cannot describe) fails its half and tells the prefill ranks, read from the bootstrap registry: the
    prefill's sender fails within a second, not at SGLang's bootstrap timeout."""
    port = free_ports(1)[0]
    server = get_kv_class(BACKEND, KVClassType.BOOTSTRAP_SERVER)("127.0.0.1", port)
    prefill = Rank(DisaggregationMode.PREFILL, 8, port, context=8 * PAGE, model=tiny_model)
    decode = Rank(DisaggregationMode.DECODE, 8, port, context=8 * PAGE, model=tiny_model)
    try:
        assert decode.mgr.geometry is not None and prefill.mgr.geometry is not None  # described pools
        decode.mgr.attn_tp_size, decode.mgr.geometry, decode.mgr.no_geometry = 2, None, "draft-model KV buffers"
        sender = get_kv_class(BACKEND, KVClassType.SENDER)(mgr=prefill.mgr, bootstrap_addr=prefill.bootstrap_addr,
                                                            bootstrap_room=99)
        receiver = get_kv_class(BACKEND, KVClassType.RECEIVER)(mgr=decode.mgr, bootstrap_addr=decode.bootstrap_addr,
                                                                bootstrap_room=99)
        assert decode.mgr.try_ensure_parallel_info(decode.bootstrap_addr)
        t0 = time.monotonic()
        receiver.init(prefill_dp_rank=0)
        assert receiver.poll() == KVPoll.Failed
        with pytest.raises(KVTransferError, match="prefill attention TP 1 != decode 2, and kvxfer cannot describe"):
            receiver.failure_exception()
        assert _poll_until(sender, {KVPoll.Failed}, timeout=5) == KVPoll.Failed
        assert time.monotonic() - t0 < 1.0, time.monotonic() - t0
        with pytest.raises(KVTransferError, match="cannot describe this decode's pool"):
            sender.failure_exception()
    finally:
        decode.close()
        prefill.close()
        server.close()


def test_layers_sent_during_the_forward_then_sglangs_send_complete_the_request_with_its_metadata(pd):
    """What the layer-wise hooks do (kvxfer/integrations/sglang/layerwise.py): during the forward each
    layer of the chunk goes with send_layer(finish=False); SGLang's own send(kv_indices) after the
    forward then finds those buffers past the chunk, sends what no hook sent (layer 1 of the last
    chunk here, as after a CUDA-graph replay), and the last chunk's send posts DONE with the
    metadata row, written only after the forward."""
    prefill, decode = pd
    room = 0xBEEF
    src = np.array([3, 4, 5, 9, 10, 20], dtype=np.int64)
    dst = np.array([40, 2, 3, 4, 30, 31], dtype=np.int64)
    prefill.fill(src, seed=5)
    sender, receiver = _bootstrap(prefill, decode, room, src, dst, aux=(2, 6))
    engine = prefill.mgr.engine
    assert engine.layout.geometry.layer_buffers(1) == [1, 3]
    for layer in (0, 1):  # chunk 1's forward
        engine.send_layer(room, layer, src[:4], finish=False, at=0)
    sender.send(src[:4].astype(np.int32), None)  # SGLang's send after it: nothing left to post
    engine.send_layer(room, 0, src[4:], finish=False, at=4)  # chunk 2's forward: layer 1's hook did not fire
    time.sleep(0.2)
    assert receiver.poll() == KVPoll.WaitingForInput  # every page of layer 0, not of layer 1: no DONE
    _metadata(prefill, 2, room, token=777)  # the forward's first output token, written after it
    sender.send(src[4:].astype(np.int32), None)
    assert _poll_until(receiver, {KVPoll.Success, KVPoll.Failed}) == KVPoll.Success
    assert _poll_until(sender, {KVPoll.Success, KVPoll.Failed}) == KVPoll.Success
    for got, want in zip(decode.page_bytes(dst), prefill.page_bytes(src)):
        assert np.array_equal(got, want)
    assert int(decode.meta.output_ids[6][0]) == 777
    assert engine.sender.stats["layer_sends"] == 4  # three from the "hooks", layer 1 of chunk 2 by SGLang's send
    receiver.clear()
    sender.clear()


def test_a_layer_sent_from_other_pages_than_sglangs_send_fails_the_request_and_sends_nothing_wrong(pd):
    prefill, decode = pd
    room = 0xBAD
    src = np.array([1, 2, 3, 4], dtype=np.int64)
    dst = np.array([10, 11, 12, 13], dtype=np.int64)
    prefill.fill(src, seed=6)
    sender, receiver = _bootstrap(prefill, decode, room, src, dst, aux=(3, 7))
    engine = prefill.mgr.engine
    engine.send_layer(room, 0, src[::-1], finish=False, at=0)  # a plan that disagrees with SGLang
    sender.send(src.astype(np.int32), None)
    assert sender.poll() == KVPoll.Failed
    with pytest.raises(KVTransferError, match="not the pages SGLang sends there"):
        sender.failure_exception()
    assert _poll_until(receiver, {KVPoll.Success, KVPoll.Failed}) == KVPoll.Failed
    assert decode.mgr.engine.status(room).state.value not in ("READABLE", "RELEASED")


# -- issue 42: authenticated control planes --------------------------------------------------------------


def _keyed_ranks(monkeypatch, tmp_path, tiny_model, prefill_ring: str, decode_ring: str | None):
    """A bootstrap server, a prefill rank and a decode rank, each given its keyring directory the way a
    deployment gives it (``KVXFER_KEYRING``, read when the rank's manager is built); None: no keyring."""
    port = free_ports(1)[0]
    server = get_kv_class(BACKEND, KVClassType.BOOTSTRAP_SERVER)("127.0.0.1", port)
    ranks = []
    try:
        for mode, ring in ((DisaggregationMode.PREFILL, prefill_ring), (DisaggregationMode.DECODE, decode_ring)):
            if ring is None:
                monkeypatch.delenv("KVXFER_KEYRING", raising=False)
            else:
                monkeypatch.setenv("KVXFER_KEYRING", str(tmp_path / ring))
            ranks.append(Rank(mode, 16, port, context=16 * PAGE, model=tiny_model))
    except BaseException:
        for rank in ranks:
            rank.close()
        server.close()
        raise
    return server, ranks[0], ranks[1]


def test_with_keyrings_the_registry_carries_the_prefills_key_and_the_transfer_verifies(monkeypatch, tmp_path,
                                                                                       tiny_model):
    """Issue 42: SGLang's registry keeps rank_ip/rank_port only, so a decode with a keyring (what kvxfer
    requires off loopback) was handed the prefill's address without its key and refused it: every request
    failed. The prefill now registers its whole address, the registry hands it out, the decode peers."""
    from kvxfer.wire.auth import write_cluster

    write_cluster(tmp_path, ["prefill", "decode"])
    server, prefill, decode = _keyed_ranks(monkeypatch, tmp_path, tiny_model, "prefill", "decode")
    try:
        import requests

        entry = requests.get(f"http://{prefill.bootstrap_addr}/route?prefill_dp_rank=0&prefill_cp_rank=0"
                             "&target_tp_rank=0&target_pp_rank=0", timeout=5).json()
        assert entry["kvxfer_address"] == prefill.mgr.engine.address and "#curve=" in entry["kvxfer_address"]
        room = 4242
        src, dst = np.array([1, 2, 3], dtype=np.int64), np.array([7, 8, 9], dtype=np.int64)
        prefill.fill(src, seed=3)
        sender, receiver = _bootstrap(prefill, decode, room, src, dst, aux=(1, 2))
        sender.send(src.astype(np.int32), None)
        assert _poll_until(receiver, {KVPoll.Success, KVPoll.Failed}) == KVPoll.Success
        assert _poll_until(sender, {KVPoll.Success, KVPoll.Failed}) == KVPoll.Success
        for got, want in zip(decode.page_bytes(dst), prefill.page_bytes(src)):
            assert np.array_equal(got, want)
        assert [p.control for p in decode.mgr.engine.receiver.peers.values()] == [prefill.mgr.engine.address]
        receiver.clear()
        sender.clear()
    finally:
        decode.close()
        prefill.close()
        server.close()


@pytest.mark.parametrize("decode_ring", ["stranger", None, "unlisted"],
                         ids=["key-not-trusted", "no-keyring", "not-in-trusted-prefills"])
def test_a_prefill_the_decode_does_not_trust_fails_the_request_at_once_and_opens_nothing(monkeypatch, tmp_path,
                                                                                          tiny_model, decode_ring):
    """A decode whose keyring does not hold the prefill's key (or that has no keyring, so cannot check a
    keyed address; or, both open, whose KVXFER_TRUSTED_PREFILLS does not list the prefill's non-loopback
    address) fails the request at ``init`` with the reason, within a second: no wait for a timeout,
    and no socket toward the prefill. The reason carries kvxfer's untrusted-prefill mark, so the abort
    SGLang's decode makes of it answers the client 403, not 500."""
    from sglang.srt.disaggregation.utils import prepare_abort

    from kvxfer.integrations.sglang import _admission_refusals_are_client_errors
    from kvxfer.integrations.sglang.reasons import ADMISSION_REFUSED, UNTRUSTED_PREFILL
    from kvxfer.wire.auth import write_cluster

    write_cluster(tmp_path, ["prefill", "decode"])
    write_cluster(tmp_path / "other", ["stranger"])
    prefill_ring, ring = "prefill", None if decode_ring is None else f"other/{decode_ring}"
    if decode_ring == "unlisted":  # no keyrings: both ranks open on this host's address, the decode's list elsewhere
        from kvxfer.wire.addresses import local_addresses

        found = [address for address in local_addresses() if ":" not in address]
        if not found:
            pytest.skip("this host has no non-loopback IPv4 address")
        for name, value in (("KVXFER_HOST", found[0]), ("KVXFER_ALLOW_OPEN_CONTROL", "1"),
                            ("KVXFER_TRUSTED_PREFILLS", "198.18.0.0/15")):
            monkeypatch.setenv(name, value)
        prefill_ring = ring = None
    server, prefill, decode = _keyed_ranks(monkeypatch, tmp_path, tiny_model, prefill_ring, ring)
    try:
        receiver = get_kv_class(BACKEND, KVClassType.RECEIVER)(mgr=decode.mgr, bootstrap_addr=decode.bootstrap_addr,
                                                                bootstrap_room=77)
        assert decode.mgr.try_ensure_parallel_info(decode.bootstrap_addr)
        t0 = time.monotonic()
        receiver.init(prefill_dp_rank=0)
        assert receiver.poll() == KVPoll.Failed and time.monotonic() - t0 < 1.0
        why = {"stranger": "not in this engine's keyring", None: "give this engine a keyring",
               "unlisted": "not in trusted_prefills"}[decode_ring]
        with pytest.raises(KVTransferError, match=why) as err:
            receiver.failure_exception()
        assert prefill.mgr.engine.address.split("#")[0] in str(err.value) or "127.0.0.1" in str(err.value)
        assert decode.mgr.engine.control.open_sockets() == 0 and not decode.mgr.engine.receiver.peers
        assert UNTRUSTED_PREFILL in str(err.value) and ADMISSION_REFUSED not in str(err.value)
        # SGLang's decode (disaggregation/decode.py, a Failed poll) aborts with this message and 500; the
        # plugin's hook around prepare_abort turns it into 403 (applied by SGLang's loader in a server)
        req = types.SimpleNamespace(return_logprob=False)
        message = f"Decode handshake failed for request rank=0 req.rid='r' req.bootstrap_room=77 with exception {err.value}"
        _admission_refusals_are_client_errors(prepare_abort, req, message, status_code=HTTPStatus.INTERNAL_SERVER_ERROR)
        assert req.finished_reason.status_code == HTTPStatus.FORBIDDEN and str(err.value) in req.finished_reason.message
    finally:
        decode.close()
        prefill.close()
        server.close()
