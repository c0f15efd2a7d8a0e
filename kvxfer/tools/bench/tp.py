"""``kvxfer bench --tp P:1``: the same bytes moved with unequal tensor parallelism.

With prefill TP ``P`` and decode TP 1, each decode page is assembled from ``P`` writers, each writing
its heads' slice of every token: with the usual ``NHD`` in-page order (``[token][head][byte]``) a
writer's share of a page is one piece per token, so a page arrives as many small pieces instead of
one. :class:`UnequalTpSession` measures exactly that next to the equal-TP case of the same run
(:class:`~.cases.KvxferSession`): the same requests, the same decode pages of the same bytes, the
same pools; only the decode pages have a geometry (``kv_heads`` heads of ``head_bytes`` per token,
:func:`tp_shape`) and ``P`` prefill rank processes write them, each holding ``1/P`` of the heads.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ...core.geometry import BufferGeometry, KVGeometry, heads_of_rank
from ...errors import ConfigError
from ..node import spawn
from .cases import BenchConfig, KvxferSession, record_latency, side_cpus

KV_HEADS = 8
HEAD_BYTES = 256  # head_dim 128 in bfloat16


def parse_tp(text: str) -> int:
    """``"2:1"`` -> 2: the prefill TP of a case into decode TP 1 (``P`` of 2, 4 or 8)."""
    try:
        prefill, decode = (int(part) for part in str(text).split(":"))
    except ValueError:
        raise ConfigError(f"--tp wants PREFILL:DECODE, e.g. 2:1, got {text!r}") from None
    if decode != 1 or prefill not in (2, 4, 8):
        raise ConfigError(f"--tp {text}: the bench runs prefill TP 2, 4 or 8 into decode TP 1")
    return prefill


def tp_shape(page_bytes: int) -> tuple[int, int, int]:
    """``(tokens per page, KV heads, bytes per head per token)`` of a decode page of ``page_bytes``:
    8 heads of 256 bytes (a 128-dimensional bfloat16 head) and as many tokens as fill the page; a
    smaller page gets smaller heads, one token."""
    head_bytes = min(HEAD_BYTES, page_bytes // KV_HEADS)
    tokens = page_bytes // (KV_HEADS * head_bytes) if head_bytes else 0
    if not tokens or tokens * KV_HEADS * head_bytes != page_bytes:
        raise ConfigError(f"a {page_bytes:,} B page is no whole number of tokens of {KV_HEADS} heads")
    return tokens, KV_HEADS, head_bytes


def _geometry(rank: int, size: int, head_bytes: int) -> list[Any]:
    """One buffer (the K of one layer, as the equal-TP case has one buffer) of ``KV_HEADS`` heads, this
    rank's share, NHD, in wire form."""
    first, count = heads_of_rank(KV_HEADS, size, rank)
    buffer = BufferGeometry(0, "k", first, count, KV_HEADS, head_bytes, "bfloat16", "NHD")
    return KVGeometry((buffer,), tp_rank=rank, tp_size=size,
                      group="bench-prefill" if size > 1 else "bench-decode").wire()


class UnequalTpSession(KvxferSession):
    """``prefill_tp`` prefill rank processes into one decode process, each writing its heads' slice of
    every decode page; the rest as :class:`KvxferSession` of the same page size (whose case it is
    compared with: ``extra["equal_case"]``)."""

    def __init__(self, config: BenchConfig, page_bytes: int, checks: str, node_log: Any, prefill_tp: int) -> None:
        super().__init__(config, page_bytes, checks, node_log)
        self.prefill_tp = prefill_tp
        tokens, heads, head_bytes = tp_shape(page_bytes)
        self.result.extra.update(equal_case=self.result.transport, tp=f"{prefill_tp}:1", tokens_per_page=tokens,
                                 kv_heads=heads, head_bytes=head_bytes, order="NHD")
        self.result.transport += f"-tp{prefill_tp}:1"
        self.tokens = self.per_request * tokens  # tokens per request
        context = {"max_context": self.tokens}
        self.decode_spec = replace(self.decode_spec, page_size=tokens, geometry=_geometry(0, 1, head_bytes),
                                   config={**self.decode_spec.config, **context})
        self.prefill_specs = [
            replace(self.prefill_spec, page_size=tokens, item_len=page_bytes // prefill_tp,
                    geometry=_geometry(rank, prefill_tp, head_bytes),
                    config={**self.prefill_spec.config, **context, "seed": 2 + rank})
            for rank in range(prefill_tp)]
        self.prefills: list[Any] = []
        self.peers: list[str] = []

    def start(self) -> None:
        self.decode = spawn(self.decode_spec, stderr=self.node_log, cpus=side_cpus(self.config, "decode"))
        for spec in self.prefill_specs:
            self.prefills.append(spawn(spec, stderr=self.node_log, cpus=side_cpus(self.config, "prefill")))
            self.peers.append(self.decode.connect(address=self.prefills[-1].control))
        self.rss_start = self.decode.rss()

    def run_once(self) -> float:
        self.round += 1
        plan = [[f"r{self.round}-{i}", self.tokens] for i in range(self.requests)]
        self.decode.bench_start(requests=plan, concurrency=self.config.concurrency, peers=self.peers)
        for prefill in self.prefills:
            prefill.bench_start(requests=plan, concurrency=self.config.concurrency)
        received = self.decode.bench_wait(timeout=3600)
        sent = [prefill.bench_wait(timeout=3600) for prefill in self.prefills]
        if not received or "error" in received or received.get("failed"):
            raise RuntimeError(f"decode half: {received}")
        for rank, half in enumerate(sent):
            if not half or "error" in half or half.get("failed"):
                raise RuntimeError(f"prefill rank {rank}: {half}")
        rates = [half["post_rate"] for half in sent if half.get("post_rate")]
        if rates:
            self.post_rates.append(sum(rates))
        if self.round > 1:  # the first round is the bench's uncounted warm-up
            self.latencies.extend(received.get("latencies", ()))
        record_latency(self.result, self.latencies, self.per_request, "admit-to-READABLE")
        return float(received["seconds"])

    def close(self, *, measure: bool = True) -> None:
        self.prefill = None  # the base closes the decode; the prefill ranks are closed here
        try:
            super().close(measure=measure)
        finally:
            for prefill in self.prefills:
                prefill.close()
