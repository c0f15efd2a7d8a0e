"""Engines in the topologies of unequal tensor parallelism: prefill ranks and decode ranks with their
own geometries (heads, page sizes, in-page order), peered the way deployments pair ranks, and the
reference that says what every rank's pages must hold.

The reference is a request's KV as one ``[token][head][byte]`` tensor per buffer; a rank's page ``i``
holds tokens ``i*P .. i*P+P-1`` of the heads it holds, in its order (:func:`page_of`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

import numpy as np

from kvxfer import DecodeEngine, EngineConfig, KVLayout, PrefillEngine, ReceiverState, SenderState
from kvxfer.core.geometry import KVGeometry, writers_of
from kvxfer.transport.faults import FaultInjector
from kvxfer.wire.auth import Keyring

from .conftest import needs, send_layerwise, wait_for

R, S = ReceiverState, SenderState


def page_of(kv: np.ndarray, heads: tuple[int, int], page_size: int, order: str, page: int) -> np.ndarray:
    """Page ``page`` of a rank holding ``heads`` (first, count), as bytes, from the reference
    ``kv[token][head][byte]``; tokens past the reference are zeros."""
    first, count = heads
    tokens = kv[page * page_size:(page + 1) * page_size, first:first + count]
    if tokens.shape[0] < page_size:
        pad = np.zeros((page_size - tokens.shape[0],) + tokens.shape[1:], dtype=kv.dtype)
        tokens = np.concatenate([tokens, pad])
    return (tokens if order == "NHD" else tokens.transpose(1, 0, 2)).reshape(-1).view(np.uint8)


def token_mask(tokens: int, heads: tuple[int, int], head_bytes: int, page_size: int, order: str,
               page: int) -> np.ndarray:
    """Which bytes of that page belong to the prompt's tokens (the rest is padding nobody reads)."""
    marks = np.zeros((tokens, heads[0] + heads[1], head_bytes), dtype=np.uint8)
    marks[:] = 1
    return page_of(marks, heads, page_size, order, page).astype(bool)


@dataclass
class Cluster:
    """``tp_prefill`` prefill ranks and ``tp_decode`` decode ranks, each decode rank peered with the
    prefill ranks it takes KV from (:func:`writers_of`); ``faults[i]`` is prefill rank i's injector."""

    prefills: list[PrefillEngine]
    decodes: list[DecodeEngine]
    faults: list[FaultInjector]
    head_bytes: int
    order: str
    refs: dict[Any, list[np.ndarray]] = field(default_factory=dict)
    tokens: dict[Any, int] = field(default_factory=dict)

    def targets(self, d: int) -> list[str]:
        geometry = self.decodes[d].layout.geometry
        return [self.prefills[p].engine_id for p in writers_of(geometry, len(self.prefills))]

    def served(self, p: int) -> list[int]:
        """The decode ranks prefill rank ``p`` writes (or is told to skip) for each request."""
        return [d for d in range(len(self.decodes)) if self.prefills[p].engine_id in self.targets(d)]

    def admit(self, rid: Any, tokens: int, *, decode_first: bool = False) -> None:
        def prefill_side() -> None:
            for prefill in self.prefills:
                prefill.admit(rid, tokens, any_peer=True)

        def decode_side() -> None:
            for d, decode in enumerate(self.decodes):
                decode.admit(rid, tokens, peers=self.targets(d))

        for step in ((decode_side, prefill_side) if decode_first else (prefill_side, decode_side)):
            step()
        self.tokens[rid] = tokens

    def fill(self, rid: Any, seed: int) -> None:
        """Draw the request's reference KV and lay it into every prefill rank's source pages."""
        tokens = self.tokens[rid]
        geometry = self.prefills[0].layout.geometry
        rng = np.random.default_rng(seed)
        total = geometry.heads[2]
        self.refs[rid] = [rng.integers(0, 256, size=(tokens, total, spec.head_bytes), dtype=np.uint8)
                          for spec in geometry.buffers]
        for prefill in self.prefills:
            prefill.wait_ready(rid)
            src = prefill.source_pages(rid)
            layout = prefill.layout
            heads = layout.geometry.heads[:2]
            for b, view in enumerate(layout.views()):
                for i, page in enumerate(src.tolist()):
                    view[page] = page_of(self.refs[rid][b], heads, layout.page_size, self.order, i)

    def send(self, rid: Any, **kw: Any) -> None:
        for prefill in self.prefills:
            if prefill.status(rid).state in (S.READY, S.TRANSFERRING):
                prefill.send(rid, **kw)

    def transfer(self, rid: Any, tokens: int, *, seed: int = 0) -> None:
        self.admit(rid, tokens)
        self.fill(rid, seed)
        self.send(rid)

    def expect_readable(self, rid: Any, timeout: float = 30.0) -> None:
        """Every decode rank READABLE, holding exactly the reference's tokens for its heads."""
        tokens = self.tokens[rid]
        for decode in self.decodes:
            req = decode.wait(rid, timeout=timeout)
            assert req.state is R.READABLE, (decode.engine_id, req.state, req.error)
            layout = decode.layout
            heads = layout.geometry.heads[:2]
            with decode.read(rid) as kv:
                for b in range(layout.num_buffers):
                    got = kv.buffer(b)
                    for i in range(len(req.pages)):
                        want = page_of(self.refs[rid][b], heads, layout.page_size, self.order, i)
                        mask = token_mask(tokens, heads, self.refs[rid][b].shape[2], layout.page_size, self.order, i)
                        assert np.array_equal(got[i][mask], want[mask]), (decode.engine_id, b, i)

    def wait_prefills(self, rid: Any, timeout: float = 30.0) -> list[Any]:
        return [prefill.wait(rid, timeout=timeout) for prefill in self.prefills]

    def release(self, rid: Any) -> None:
        for decode in self.decodes:
            decode.release(rid)

    def needs(self, capability: str) -> None:
        """Skip unless the transport declares ``capability`` (as :func:`tests.conftest.needs`)."""
        needs(SimpleNamespace(decode=self.decodes[0]), capability)

    def wait_connected(self, timeout: float = 10.0) -> None:
        """Every decode rank holds a live data connection to each of its writers (after a fence, the
        next epoch's)."""
        def ready() -> bool:
            for d, decode in enumerate(self.decodes):
                for name in self.targets(d):
                    info = decode.receiver.peers.get(name)
                    if info is None or not info.connected:
                        return False
            return True

        wait_for(ready, timeout=timeout, what="every decode rank's data connections")

    def all_free(self) -> bool:
        return all(e.pool.ledger.free_count == e.layout.num_pages for e in [*self.decodes, *self.prefills]
                   if not e._closed)


def geometry(*, rank: int, size: int, heads: int, head_bytes: int, layers: int, order: str, mla: bool,
             group: str) -> KVGeometry:
    if mla:
        return KVGeometry.latent(layers=layers, token_bytes=head_bytes, dtype="bfloat16", tp_rank=rank, tp_size=size,
                                 group=group)
    return KVGeometry.attention(layers=layers, total_heads=heads, head_dim=head_bytes // 2, itemsize=2,
                                dtype="bfloat16", tp_rank=rank, tp_size=size, order=order, group=group)


def build(*, tp_prefill: int, tp_decode: int, heads: int = 4, head_bytes: int = 16, layers: int = 2,
          order: str = "NHD", mla: bool = False, prefill_page: int = 16, decode_page: int = 16,
          prefill_pages: int = 64, decode_pages: int = 64, context: int | None = None, transport: str = "tcp",
          keyed: bool = True, made: list | None = None, decode_config: dict | None = None,
          prefill_config: dict | None = None, layerwise: bool = False) -> Cluster:
    """Start the engines (appended to ``made`` as they start, so a fixture closes them) and peer them.
    With ``layerwise`` every prefill rank sends each chunk layer by layer (:func:`send_layerwise`)."""
    made = made if made is not None else []
    context = context or min(prefill_pages * prefill_page, decode_pages * decode_page)
    names = [f"prefill{p}" for p in range(tp_prefill)] + [f"decode{d}" for d in range(tp_decode)]
    rings = Keyring.cluster(names) if keyed else dict.fromkeys(names)
    base = EngineConfig(max_context=context, heartbeat_interval=0.2, transport=transport,
                        **({"peer_timeout": 60.0} if transport == "verbs" else {}))
    prefills, decodes, faults = [], [], []
    for p in range(tp_prefill):
        layout = KVLayout.allocate(num_pages=prefill_pages, page_size=prefill_page, geometry=geometry(
            rank=p, size=tp_prefill, heads=heads, head_bytes=head_bytes, layers=layers, order=order, mla=mla,
            group="prefill-server"))
        injector = FaultInjector(seed=p + 1)
        config = replace(base, keyring=rings[f"prefill{p}"], engine_id=f"prefill{p}-{id(made):x}",
                         **(prefill_config or {}))
        prefills.append(PrefillEngine(layout, config, faults=injector))
        made.append(prefills[-1])
        if layerwise:
            send_layerwise(prefills[-1], seed=p)
        faults.append(injector)
    for d in range(tp_decode):
        layout = KVLayout.allocate(num_pages=decode_pages, page_size=decode_page, geometry=geometry(
            rank=d, size=tp_decode, heads=heads, head_bytes=head_bytes, layers=layers, order=order, mla=mla,
            group="decode-server"))
        config = replace(base, keyring=rings[f"decode{d}"], engine_id=f"decode{d}-{id(made):x}",
                         **(decode_config or {}))
        decodes.append(DecodeEngine(layout, config))
        made.append(decodes[-1])
    cluster = Cluster(prefills, decodes, faults, head_bytes=head_bytes, order=order)
    by_id = {p.engine_id: p for p in prefills}
    for d, decode in enumerate(decodes):
        for name in cluster.targets(d):
            decode.connect(by_id[name].address)
    for p, prefill in enumerate(prefills):
        wait_for(lambda prefill=prefill, p=p: all(
            prefill.peers.get(decodes[d].engine_id) is not None
            and prefill.peers[decodes[d].engine_id].link is not None for d in cluster.served(p)),
            timeout=10, what="every prefill rank's data links")
    return cluster
