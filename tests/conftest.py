"""Shared fixtures: real engines on loopback (real ZMQ and TCP sockets), checked after every test."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pytest

from kvxfer import DecodeEngine, EngineConfig, KVLayout, PrefillEngine
from kvxfer.auth import Keyring
from kvxfer.transport import faults as faults_mod
from kvxfer.transport.faults import FaultInjector

faults_mod.enable()
logging.getLogger("kvxfer").setLevel(logging.INFO)

ITEM = 1024
BUFFERS = 3
PAGE_TOKENS = 16


def make_layout(pages: int, *, buffers: int = BUFFERS, item: int = ITEM, page_size: int = PAGE_TOKENS) -> KVLayout:
    return KVLayout.allocate(num_buffers=buffers, item_len=item, num_pages=pages, page_size=page_size)


def fill_random(layout: KVLayout, pages: np.ndarray, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for view in layout.views():
        view[pages] = rng.integers(0, 256, size=(len(pages), view.shape[1]), dtype=np.uint8)


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


@dataclass
class Pair:
    prefill: PrefillEngine
    decode: DecodeEngine
    peer: str
    faults: FaultInjector

    @property
    def link(self) -> Any:
        return self.prefill.peers[self.decode.engine_id].link

    def transfer(self, rid: Any, tokens: int, *, seed: int = 0) -> np.ndarray:
        """Admit on both sides, fill the source pages, send, wait until readable; returns src pages."""
        self.prefill.admit(rid, tokens)
        self.decode.admit(rid, tokens, peer=self.peer)
        self.prefill.wait_ready(rid)
        src = self.prefill.source_pages(rid)
        fill_random(self.prefill.layout, src, seed)
        self.prefill.send(rid)
        return src

    def expect_content(self, rid: Any, src: np.ndarray) -> None:
        kv = self.decode.read(rid)
        for b in range(self.decode.layout.num_buffers):
            assert np.array_equal(kv.buffer(b), self.prefill.layout.views()[b][src])


@pytest.fixture
def engines() -> Iterator[Callable[..., Pair]]:
    """Factory of connected (prefill, decode) pairs; every engine's accounting is checked at teardown."""
    made: list[Any] = []

    def factory(
        *,
        prefill_pages: int = 64,
        decode_pages: int = 128,
        max_context: int | None = None,
        allow_undersized: bool = False,
        decode_config: dict[str, Any] | None = None,
        prefill_config: dict[str, Any] | None = None,
        keyed: bool = True,
        **common: Any,
    ) -> Pair:
        context = max_context or prefill_pages * PAGE_TOKENS
        base = EngineConfig(max_context=context, heartbeat_interval=0.2, **common)
        faults = FaultInjector(seed=1)
        rings = Keyring.cluster(["prefill", "decode"]) if keyed else {"prefill": None, "decode": None}
        pcfg = replace(base, **{"allow_undersized_pool": allow_undersized, "keyring": rings["prefill"],
                                **(prefill_config or {})})
        dcfg = replace(base, **{"keyring": rings["decode"], **(decode_config or {})})
        prefill = PrefillEngine(make_layout(prefill_pages), pcfg, faults=faults)
        made.append(prefill)
        decode = DecodeEngine(make_layout(decode_pages), dcfg)
        made.append(decode)
        peer = decode.connect(prefill.address)
        return Pair(prefill, decode, peer, faults)

    yield factory
    errors = []
    for engine in made:
        if engine.faults is not None:
            engine.faults.resume()
        try:
            if not engine._closed:
                engine.check_accounting()
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(f"{engine.role}: {exc}")
    for engine in reversed(made):
        engine.close()
    assert not errors, "pool accounting invariant broken: " + "; ".join(errors)
