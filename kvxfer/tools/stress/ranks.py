"""The node processes of a stress run: the ranks of one prefill server and of one decode server.

Each rank is its own engine node process (:mod:`kvxfer.tools.node`). With a topology
(:attr:`StressConfig.topology`) every rank's layout carries its :class:`~kvxfer.core.geometry.KVGeometry`
(its tensor-parallel rank, its share of the KV heads, its page size), and each decode rank is peered
with exactly the prefill ranks it takes KV from (:func:`~kvxfer.core.geometry.writers_of`), as
deployments pair them. The plain pair is one rank of each, without geometries.

A prefill rank can be killed and replaced (``kill_sender``): the fresh process has a new engine id,
and the decode ranks it serves peer with it again. Every process started here dies with the driver
(:func:`kvxfer.tools.node.spawn`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from ...core.geometry import KVGeometry, writers_of
from ...errors import KvxferError
from ..node import NodeClient, NodeSpec, spawn
from .workload import StressConfig

PREFILL_GROUP = "prefill-server"
DECODE_GROUP = "decode-server"


def rank_geometry(config: StressConfig, role: str, rank: int) -> KVGeometry:
    """The geometry of one rank: K then V per layer, its share of ``kv_heads`` of ``head_bytes``."""
    size = config.prefill_tp if role == "prefill" else config.decode_tp
    return KVGeometry.attention(layers=config.layers, total_heads=config.kv_heads, head_dim=config.head_bytes // 2,
                                itemsize=2, dtype="bfloat16", tp_rank=rank, tp_size=size, order="NHD",
                                group=PREFILL_GROUP if role == "prefill" else DECODE_GROUP)


def node_config(cfg: StressConfig, keyring: str) -> dict[str, Any]:
    """The engine settings every node process of a run gets (:class:`kvxfer.EngineConfig` fields)."""
    config = {
        "max_context": cfg.max_context,
        "transport": cfg.transport,
        "alloc_policy": cfg.alloc_policy,
        "free_policy": cfg.free_policy,
        "checksum": cfg.checksum,
        "seed": cfg.seed,
        "drain_timeout": cfg.drain_timeout,
        "transfer_timeout": cfg.transfer_timeout,
        "meta_timeout": cfg.transfer_timeout,
        "unsafe_legacy": cfg.unsafe_legacy,
        "heartbeat_interval": 0.5,
        "transport_options": cfg.transport_options,
        "keyring": keyring,
    }
    if cfg.transport == "verbs":
        config["peer_timeout"] = 10.0  # verbs has no EOF: a killed writer is found by its silence
    return config


@dataclass
class Route:
    """Which ranks (or, in a fleet, which processes by seat) one request goes through: its prefill and
    decode ranks, each decode rank's writers, and the decode ranks grouped by the writers they share."""

    prefills: list[int]
    decodes: list[int]
    writers: dict[int, list[int]]
    components: list[list[int]]


class Ranks:
    """The prefill and decode rank processes of a run, who peers with whom, and each prefill rank's
    incarnation (bumped when it is killed and replaced)."""

    def __init__(self, config: StressConfig, keyrings: dict[str, str], node_log: Any = None) -> None:
        self.config = config
        self.keyrings = keyrings
        self.node_log = node_log
        self.prefills: list[NodeClient | None] = [None] * config.prefill_tp
        self.decodes: list[NodeClient | None] = [None] * config.decode_tp
        self.incarnations = [0] * config.prefill_tp
        self.restarts = 0
        self.closed_fault_counts: Counter = Counter()  # link faults counted by killed prefill processes
        if config.topology:
            self.writers = [writers_of(rank_geometry(config, "decode", d), config.prefill_tp)
                            for d in range(config.decode_tp)]
        else:
            self.writers = [[0]]
        self.served = [[d for d, ws in enumerate(self.writers) if p in ws] for p in range(config.prefill_tp)]
        self.peer_ids: list[list[str]] = [[""] * len(ws) for ws in self.writers]  # decode rank -> writer ids
        # every request goes through every rank
        self.everyone = Route(prefills=list(range(config.prefill_tp)), decodes=list(range(config.decode_tp)),
                              writers=dict(enumerate(self.writers)), components=self.components())

    # processes -------------------------------------------------------------------------------------
    def spec(self, role: str, rank: int) -> NodeSpec:
        cfg = self.config
        name = cfg.key_names()[rank if role == "prefill" else cfg.prefill_tp + rank]
        config = node_config(cfg, self.keyrings[name])
        if role == "prefill":
            pages, page_size = cfg.prefill_pages, cfg.prefill_page
            config["allow_undersized_pool"] = cfg.prefill_tokens < cfg.max_context
            seed = cfg.seed + self.restarts + 1000 * rank
        else:
            pages, page_size = cfg.decode_pages, cfg.decode_page
            seed = cfg.seed + 1000 * rank
        geometry = None
        item_len = cfg.item_len
        if cfg.topology:
            shape = rank_geometry(cfg, role, rank)
            geometry = shape.wire()
            item_len = shape.buffers[0].item_len(page_size)
        return NodeSpec(role=role, num_buffers=cfg.buffers, item_len=item_len, num_pages=pages,
                        page_size=page_size, config=config,
                        faults=cfg.link_faults() if role == "prefill" else None,
                        seed=seed, log_level="ERROR", geometry=geometry)

    def start(self) -> None:
        for d in range(self.config.decode_tp):
            self.decodes[d] = spawn(self.spec("decode", d), stderr=self.node_log)
        for p in range(self.config.prefill_tp):
            self._start_prefill(p)

    def _start_prefill(self, p: int) -> None:
        node = spawn(self.spec("prefill", p), stderr=self.node_log)
        self.prefills[p] = node
        for d in self.served[p]:
            decode = self.decodes[d]
            assert decode is not None
            self.peer_ids[d][self.writers[d].index(p)] = decode.connect(address=node.control)

    def replace_prefill(self, p: int) -> int:
        """SIGKILL prefill rank ``p`` (mid-whatever) and start a fresh one in its place, peered with the
        decode ranks it serves; returns the incarnation that died."""
        node = self.prefills[p]
        assert node is not None
        try:
            self.closed_fault_counts.update(node.fault(op="counts"))
        except KvxferError:
            pass
        node.kill()
        node.close()
        self.prefills[p] = None
        dead = self.incarnations[p]
        self.incarnations[p] += 1
        self.restarts += 1
        self._start_prefill(p)
        return dead

    def close(self) -> None:
        for node in [*self.prefills, *self.decodes]:
            if node is not None:
                node.close()

    # who is who ------------------------------------------------------------------------------------
    def labelled(self) -> list[tuple[str, NodeClient]]:
        """Every rank with its name ("decode", "prefill"; with a topology "decode rank 0", ...), decode
        ranks first."""
        out = []
        for role, nodes in (("decode", self.decodes), ("prefill", self.prefills)):
            for rank, node in enumerate(nodes):
                if node is not None:
                    out.append((f"{role} rank {rank}" if self.config.topology else role, node))
        return out

    def prefill(self, p: int) -> NodeClient:
        node = self.prefills[p]
        assert node is not None
        return node

    def decode(self, d: int) -> NodeClient:
        node = self.decodes[d]
        assert node is not None
        return node

    def decode_seats(self) -> list[int]:
        return list(range(self.config.decode_tp))

    def route(self, draw: tuple[float, float]) -> tuple[Route, dict[str, int]] | None:
        """Every request goes through every rank (``draw`` is a fleet's)."""
        return self.everyone, {}

    def landed_bytes(self) -> int:
        """Bytes landed in the decode ranks' pages (their write guards' ``landed_bytes``)."""
        return sum(int(node.stats()["writes"]["landed_bytes"]) for node in self.decodes if node is not None)

    def prefill_admit_args(self, p: int, route: Route | None = None) -> dict[str, Any]:
        """How prefill rank ``p`` admits: as the plain pair does (its only peer), else naming the decode
        ranks it serves."""
        if not self.config.topology:
            return {}
        ids = [self.decode(d).engine_id for d in self.served[p]]
        return {"peer": ids[0]} if len(ids) == 1 else {"peers": ids}

    def decode_admit_args(self, d: int, route: Route | None = None) -> dict[str, Any]:
        """How decode rank ``d`` admits: its writers' engine ids, in rank order."""
        ids = self.peer_ids[d]
        return {"peer": ids[0]} if len(ids) == 1 else {"peers": list(ids)}

    def components(self) -> list[list[int]]:
        """Decode ranks grouped by the writers they share: the engines tell each other about a request
        within a group (a writer's abort reaches all its decode ranks, a decode's reaches its writers),
        never across groups (with equal TP each pair is a group of its own)."""
        groups: list[tuple[set[int], set[int]]] = []
        for d, ws in enumerate(self.writers):
            mine = ({d}, set(ws))
            for group in [g for g in groups if g[1] & mine[1]]:
                groups.remove(group)
                mine = (mine[0] | group[0], mine[1] | group[1])
            groups.append(mine)
        return sorted(sorted(g[0]) for g in groups)
