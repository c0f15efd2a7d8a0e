"""``kvxfer bench --ttft``: what a user feels, from the prefill's start to the decode's READABLE.

A prefill computes a prompt layer by layer; its KV leaves either after the last layer
(**whole-request**: one send) or each layer as soon as it is computed (**layer-wise**:
``send_layer`` with that layer), hiding the transfer behind the layers still to compute. This bench
models the compute and measures the transfer for real, for prompts of 128 to 32k tokens, both ways
in one run, beside the compute-only time (the **floor**: no transfer could end before it).

The model (every figure a flag; defaults: the shape of Llama-3.1-8B, bf16):

* a layer of ``T`` tokens takes ``(2 * P / L * T + 2 * T**2 * H) / F`` seconds: the matmuls over its
  share of the ``P`` parameters, 2 FLOPs per multiply-add, and causal attention (``Q K^T`` and
  ``P V`` over half the ``T x T`` scores, ``H`` the hidden size), at ``F`` FLOP/s sustained;
* it writes ``T * 2 * kv_heads * head_dim * dtype bytes`` of KV (K and V) into its own two buffers.

The compute is a wait (the prefill's thread sleeps until the layer's modelled end), as it is for a
GPU: the host's cores stay free for the transfer meanwhile. The prefill engine runs in the bench's
process with a :class:`~kvxfer.core.geometry.KVGeometry` of those layers; the decode engine is its own
process (:mod:`kvxfer.tools.node`), peered ahead and holding its destination before the prefill starts
(SGLang's bootstrap order), and notes the moment the request became READABLE (every check run) on
the monotonic clock both processes share. ``ttft = readable - start``. Both ways run in turn for
every prompt length (``--repeat`` times each, the median reported), so drift hits both alike.

``--layerwise-min-tokens`` is the switch point an engine applies (EngineConfig ``layerwise_min_tokens``):
below it a request goes whole, because a send per layer costs more than the little transfer it
hides. The bench reports the **auto** column (layer-wise from the switch point up) and the
measured crossover: the shortest prompt from which layer-wise was never slower than whole-request.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..node import NodeSpec, spawn

DEFAULT_TOKENS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
WAIT_S = 600.0


@dataclass
class TtftModel:
    """A transformer's prefill, as the bench models it (see the module's docstring)."""

    params: float = 8.0e9
    layers: int = 32
    hidden: int = 4096
    kv_heads: int = 8
    head_dim: int = 128
    dtype_bytes: int = 2
    flops: float = 1.0e14

    def layer_seconds(self, tokens: int) -> float:
        linear = 2.0 * self.params / self.layers * tokens
        attention = 2.0 * tokens * tokens * self.hidden
        return (linear + attention) / self.flops

    def kv_bytes_per_token(self) -> int:
        """K and V of every layer, one token."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    def describe(self) -> str:
        return (f"{self.params / 1e9:g}B parameters, {self.layers} layers, hidden {self.hidden}, {self.kv_heads} KV "
                f"heads x {self.head_dim}, {8 * self.dtype_bytes}-bit KV ({self.kv_bytes_per_token() // 1024} KiB "
                f"per token), {self.flops / 1e12:g} TFLOP/s")


@dataclass
class TtftConfig:
    """One ``--ttft`` run: the model, the prompt lengths, the transport and page size, the rounds."""

    model: TtftModel = field(default_factory=TtftModel)
    tokens: list[int] = field(default_factory=lambda: list(DEFAULT_TOKENS))
    transport: str = "tcp"
    page_size: int = 64
    repeat: int = 3
    checks: str = "on"
    layerwise_min_tokens: int = 256
    transport_options: dict[str, Any] = field(default_factory=dict)


class TtftPair:
    """The prefill (here) and the decode process of one run, peered ahead, with pools for the longest prompt."""

    def __init__(self, config: TtftConfig, node_log: Any) -> None:
        from ...core.geometry import KVGeometry
        from ...core.layout import KVLayout
        from ...engine import EngineConfig, PrefillEngine

        model = config.model
        self.config = config
        self.geometry = KVGeometry.attention(layers=model.layers, total_heads=model.kv_heads, head_dim=model.head_dim,
                                             itemsize=model.dtype_bytes,
                                             dtype="bfloat16" if model.dtype_bytes == 2 else f"float{8 * model.dtype_bytes}")
        longest = max(config.tokens)
        pages = -(-longest // config.page_size) + 1
        engine = {
            "max_context": longest,
            "transport": config.transport,
            "checksum": "adler32" if config.checks == "on" else "none",
            "peer_timeout": 120.0,
            "transfer_timeout": WAIT_S,
            "transport_options": {key: dict(value) if isinstance(value, dict) else value
                                  for key, value in (config.transport_options or {}).items()},
        }
        layout = KVLayout.allocate(num_pages=pages, page_size=config.page_size, geometry=self.geometry)
        self.prefill = PrefillEngine(layout, EngineConfig(**{**engine, "seed": 2}))
        try:
            item = int(layout.item_lens[0])
            spec = NodeSpec(role="decode", num_buffers=layout.num_buffers, item_len=item, num_pages=pages,
                            page_size=config.page_size, config={**engine, "seed": 1}, geometry=self.geometry.wire())
            self.decode = spawn(spec, stderr=node_log)
        except BaseException:
            self.prefill.close()
            raise
        try:
            self.peer = self.decode.connect(address=self.prefill.address, timeout=60.0)
            self.decode.bench_start(requests=[], concurrency=1, peer=self.peer)  # the node's bench code, warmed
            self.decode.bench_wait(timeout=WAIT_S)
        except BaseException:
            self.close()
            raise
        self.serial = 0

    def close(self) -> None:
        try:
            self.decode.close()
        finally:
            self.prefill.close()

    def run(self, tokens: int, layerwise: bool) -> float:
        """One prompt: the destination first, then the modelled layers with their sends; seconds from the
        prefill's start to the decode's READABLE."""
        self.serial += 1
        rid = f"ttft-{self.serial}"
        self.decode.bench_start(requests=[[rid, tokens]], concurrency=1, peer=self.peer)
        self.prefill.admit(rid, tokens, peer=self.decode.engine_id)
        self.prefill.wait_ready(rid, timeout=WAIT_S)
        layer_s = self.config.model.layer_seconds(tokens)
        start = time.monotonic()
        for layer in range(self.config.model.layers):
            _sleep_until(start + (layer + 1) * layer_s)  # layer ``layer`` computed
            if layerwise:
                self.prefill.send_layer(rid, layer)
        if not layerwise:
            self.prefill.send(rid)
        received = self.decode.bench_wait(timeout=WAIT_S)
        self.prefill.wait(rid, timeout=WAIT_S)
        if not received or "error" in received or received.get("failed") or not received.get("readable_at"):
            raise RuntimeError(f"request {rid} ({tokens} tokens, {'layer-wise' if layerwise else 'whole'}): {received}")
        return float(received["readable_at"][0]) - start


def _sleep_until(moment: float) -> None:
    while True:
        left = moment - time.monotonic()
        if left <= 0:
            return
        time.sleep(left)


def measure(config: TtftConfig, node_log: Any) -> list[dict[str, Any]]:
    """Every prompt length, both ways in turn, ``repeat`` rounds (after one uncounted warm-up each way)."""
    from ..progress import current

    bar = current()
    bar.grow(2 + 2 * config.repeat * len(config.tokens))
    pair = TtftPair(config, node_log)
    rows = []
    try:
        bar.status("warm-up")
        for layerwise in (False, True):
            pair.run(min(config.tokens), layerwise)
            bar.advance()
        for tokens in config.tokens:
            runs: dict[str, list[float]] = {"whole": [], "layerwise": []}
            bar.status(f"{tokens:,}-token prompts")
            for _ in range(config.repeat):
                for name in ("whole", "layerwise"):
                    runs[name].append(pair.run(tokens, name == "layerwise"))
                    bar.advance()
            floor = config.model.layers * config.model.layer_seconds(tokens)
            whole, layerwise = statistics.median(runs["whole"]), statistics.median(runs["layerwise"])
            auto = layerwise if tokens >= config.layerwise_min_tokens else whole
            rows.append({
                "tokens": tokens, "kv_bytes": tokens * config.model.kv_bytes_per_token(),
                "floor_s": round(floor, 6), "whole_s": round(whole, 6), "layerwise_s": round(layerwise, 6),
                "auto_s": round(auto, 6), "runs": runs,
                "whole_over_floor": round(whole / floor, 4), "layerwise_over_floor": round(layerwise / floor, 4),
                "auto_over_floor": round(auto / floor, 4), "layerwise_over_whole": round(layerwise / whole, 4),
            })
    finally:
        pair.close()
    return rows


def crossover(rows: list[dict[str, Any]]) -> int | None:
    """The shortest prompt from which layer-wise was never slower than whole-request (None: it always was)."""
    found = None
    for row in reversed(rows):
        if row["layerwise_s"] > row["whole_s"]:
            break
        found = row["tokens"]
    return found


def run_ttft(config: TtftConfig, *, json_path: str | None = None, progress: bool | None = None) -> int:
    """Measure and print; 1 when a measurement failed."""
    import os
    import tempfile

    from rich.console import Console
    from rich.table import Table

    from ..progress import bar

    console = Console()
    started = time.monotonic()
    model = config.model
    console.print(f"model: {model.describe()}; {config.transport}, {config.page_size}-token pages, checks "
                  f"{config.checks}, {config.repeat} rounds each way per prompt (median)", markup=False,
                  highlight=False, soft_wrap=True)
    with tempfile.TemporaryFile("w+") as node_log:
        try:
            with bar("bench --ttft", console, progress):
                rows = measure(config, node_log)
        except Exception as exc:
            node_log.seek(0)
            console.print(node_log.read()[-3000:], markup=False, highlight=False)
            console.print(f"kvxfer bench --ttft: FAILED: {type(exc).__name__}: {exc}", markup=False, highlight=False)
            return 1
    table = Table(title="kvxfer bench --ttft: prefill start to READABLE, ms (median)")
    for column in ("prompt", "KV MiB", "floor", "whole", "layer-wise", "auto", "lw/floor", "lw/whole"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(f"{r['tokens']:,}", f"{r['kv_bytes'] / (1 << 20):,.0f}", f"{1e3 * r['floor_s']:.1f}",
                      f"{1e3 * r['whole_s']:.1f}", f"{1e3 * r['layerwise_s']:.1f}", f"{1e3 * r['auto_s']:.1f}",
                      f"{r['layerwise_over_floor']:.3f}", f"{r['layerwise_over_whole']:.3f}")
    console.print(table)
    cross = crossover(rows)
    long_rows = [r for r in rows if r["tokens"] >= 4096]
    worst = max((r["layerwise_over_floor"] for r in long_rows), default=None)
    console.print(f"layer-wise never slower than whole-request from {cross:,} tokens up" if cross is not None
                  else "layer-wise was slower than whole-request at the longest prompt", markup=False, highlight=False)
    if worst is not None:
        console.print(f"prompts of 4,096 tokens and more: layer-wise at most {worst:.3f}x the compute-only floor "
                      f"(goal: within 1.10x)", markup=False, highlight=False)
    console.print(f"auto: whole-request below {config.layerwise_min_tokens:,} tokens (layerwise_min_tokens), "
                  "layer-wise from there", markup=False, highlight=False)
    console.print(f"bench took {time.monotonic() - started:.1f} s on {os.cpu_count()} cores", markup=False,
                  highlight=False)
    if json_path:
        Path(json_path).write_text(json.dumps({"config": asdict(config), "model": model.describe(), "ttft": rows,
                                               "crossover_tokens": cross, "worst_layerwise_over_floor_4k_up": worst},
                                              indent=2) + "\n")
    return 0
