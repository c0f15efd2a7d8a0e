"""The stress workload: prompt lengths, fault plans and their settings.

Prompt lengths are log-normal around a configurable median (long-context traffic has a heavy right
tail). Each request draws its own plan of request-level faults (aborts at each phase, client
disconnects, an oversized prompt in the unsafe band, killing the writer process); link-level faults
(flipped bytes, duplicated and late writes, slow frames) are per-frame rates handed to the writer's
transport. Everything derives from ``seed``, so a failing run can be replayed.

A topology (``prefill_tp`` and ``decode_tp`` ranks of one prefill and one decode server, ``kv_heads``
of ``head_bytes`` each split between the ranks, page sizes per role) runs each rank as its own
process with a :class:`~kvxfer.core.geometry.KVGeometry`; one prefill and one decode rank of equal
page sizes is the plain pair, as without these options.

A fleet (``prefills`` prefill and ``decodes`` decode processes, every decode peered with every
prefill) routes each request to a random (prefill, decode) pair, drawn from a stream of its own;
with ``churn`` a request's start may also kill and restart a process, add one (a join) or retire
one cleanly (a leave), each drawn from another stream of its own, so the plain pair's and the
topologies' draws stay what they were.

Two hosts (``two_hosts``) run a fleet's prefill processes in one network namespace ("host a") and its
decode processes in another ("host b"), joined by a veth (:class:`kvxfer.tools.netns.TwoHosts`), over
tcp with keyrings. ``net_faults`` is the network fault timeline played while requests start: each
``(name, seconds)`` in turn, after ``net_fault_gap`` seconds of healthy network, for ``seconds``,
``net_fault_rounds`` times (:mod:`.netfaults`); names in :data:`NET_FAULTS`.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ...errors import ConfigError

REQUEST_FAULTS = (
    "abort_before_bootstrap",
    "abort_mid_transfer",
    "abort_after_done",
    "client_disconnect",
    "oversized",
    "kill_sender",
)
LINK_FAULTS = ("late_write", "duplicate_write", "flip_byte", "slow_link")
CHURN_KINDS = ("kill", "join", "leave")  # SIGKILL and restart; a process more; one retired cleanly
ROLES = ("prefill", "decode")
MAX_FLEET = 16  # processes per role at the start of a fleet run
ALL_FAULTS = REQUEST_FAULTS + LINK_FAULTS
# --two-hosts: faults of the wire between the hosts (a: the prefills, b: the decodes) and of the processes
NET_FAULTS = (
    "link_down",  # the veth loses carrier on both ends
    "drop", "drop_a_to_b", "drop_b_to_a",  # every IPv4 packet silently dropped, both ways or one way
    "blackhole", "blackhole_a_to_b", "blackhole_b_to_a",  # sends to the other host fail locally
    "kill_prefill", "kill_decode",  # SIGKILL one process of the role (restarted in its seat)
    "stop_prefill", "stop_decode",  # SIGSTOP one process of the role, SIGCONT when the window ends
)
DEFAULT_NET_FAULT_SECONDS = 2.0
MAX_NET_FAULT_SECONDS = 300.0
_LINK_RATE_NAMES = {
    "late_write": "late_rate",
    "duplicate_write": "duplicate_rate",
    "flip_byte": "flip_rate",
    "slow_link": "slow_rate",
}


@dataclass
class StressConfig:
    """A stress run's parameters; checked on construction (known faults, rates in [0, 1], a way to stop)."""

    transport: str = "tcp"
    requests: int | None = 200
    duration: float | None = None
    concurrency: int = 16
    median_tokens: int = 1500
    sigma: float = 1.0
    page_size: int = 16
    layers: int = 2
    item_len: int = 1024
    prefill_pages: int = 2048
    decode_pages: int = 8192
    context: int | None = None
    alloc_policy: str = "lifo"
    free_policy: str = "keep"
    checksum: str = "adler32"
    seed: int = 0
    max_chunks: int = 4
    unsafe_legacy: bool = False
    drain_timeout: float = 2.0
    transfer_timeout: float = 30.0
    settle_timeout: float = 60.0
    transport_options: dict[str, Any] = field(default_factory=dict)  # EngineConfig.transport_options
    faults: dict[str, float] = field(default_factory=dict)
    prefill_tp: int = 1
    decode_tp: int = 1
    kv_heads: int = 4
    head_bytes: int = 64
    prefill_page_size: int | None = None  # None: page_size
    decode_page_size: int | None = None  # None: page_size
    prefills: int = 1  # prefill processes (a fleet when either count is above 1, or with churn)
    decodes: int = 1  # decode processes, each peered with every prefill
    churn: float = 0.0  # per request started: the chance of a kill and restart, a join or a leave
    max_joins: int = 2  # a fleet grows by at most this many processes per role above its start
    layerwise: bool = False  # each chunk sent layer by layer, one layer per step, layers in a random order
    two_hosts: bool = False  # prefills in one network namespace, decodes in another, joined by a veth
    peer_agent: str = ""  # two hosts: host b is another machine, reached through its agent here (kvxfer.tools.guests)
    net_faults: list[tuple[str, float]] = field(default_factory=list)  # (name, seconds), played in turn
    net_fault_gap: float = 0.5  # seconds of healthy network before each net fault
    net_fault_rounds: int = 1  # times the timeline is played (0: for as long as requests start)

    def __post_init__(self) -> None:
        unknown = set(self.faults) - set(ALL_FAULTS)
        if unknown:
            raise ConfigError(f"unknown fault types {sorted(unknown)} (known: {', '.join(ALL_FAULTS)})")
        for name, rate in self.faults.items():
            if not 0.0 <= rate <= 1.0:
                raise ConfigError(f"--fault {name}={rate:g}: fault rate {name}={rate} outside [0, 1]")
        if self.requests is None and self.duration is None:
            raise ConfigError("give --requests, --duration or both: the workload must stop by itself")
        if self.requests is not None and self.requests < 1:
            raise ConfigError(f"--requests {self.requests}: run at least 1 request")
        if self.duration is not None and not self.duration > 0:
            raise ConfigError(f"--duration {self.duration:g}: must be above 0 seconds")
        if self.concurrency < 1:
            raise ConfigError(f"--concurrency {self.concurrency}: concurrency must be at least 1")
        if self.item_len % 8 or self.item_len < 32:
            raise ConfigError(f"--item-len {self.item_len}: item_len must be a multiple of 8 bytes, at least 32")
        if self.prefill_pages < 1 or self.decode_pages < 1:
            raise ConfigError(f"--prefill-pages {self.prefill_pages} / --decode-pages {self.decode_pages}: pools need "
                              "at least one page")
        for flag, value in (("--layers", self.layers), ("--median-tokens", self.median_tokens),
                            ("--max-chunks", self.max_chunks), ("--context", self.context)):
            if value is not None and value < 1:
                raise ConfigError(f"{flag} {value}: must be at least 1")
        self._check_topology()
        self._check_two_hosts()
        self._check_fleet()

    def _check_topology(self) -> None:
        for name in ("prefill_tp", "decode_tp"):
            if getattr(self, name) not in (1, 2, 4):
                raise ConfigError(f"--{name.replace('_', '-')} {getattr(self, name)}: {name.replace('_', ' ')} must "
                                  f"be 1, 2 or 4, got {getattr(self, name)}")
        for name in ("page_size", "prefill_page_size", "decode_page_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} {value}: {name.replace('_', ' ')} must be at least "
                                  f"1 token, got {value}")
        small, large = sorted((self.prefill_page, self.decode_page))
        if large % small:
            raise ConfigError(f"--prefill-page-size/--decode-page-size: page sizes {self.prefill_page} (prefill) and "
                              f"{self.decode_page} (decode): one must be a multiple of the other")
        if not self.topology:
            return
        if not 1 <= self.kv_heads <= 256:
            raise ConfigError(f"--kv-heads {self.kv_heads}: kv heads must be 1..256, got {self.kv_heads}")
        for tp in (self.prefill_tp, self.decode_tp):
            if self.kv_heads % tp and tp % self.kv_heads:
                raise ConfigError(f"--kv-heads {self.kv_heads}: {self.kv_heads} KV heads cannot be split over {tp} "
                                  "TP ranks (one must be a multiple of the other)")
        if self.head_bytes % 8 or self.head_bytes < 32:
            raise ConfigError(f"--head-bytes {self.head_bytes}: head bytes must be a multiple of 8, at least 32 "
                              f"(each cell carries the oracle's 32-byte header), got {self.head_bytes}")

    def _check_fleet(self) -> None:
        for name in ("prefills", "decodes"):
            if not 1 <= getattr(self, name) <= MAX_FLEET:
                raise ConfigError(f"--{name} {getattr(self, name)}: {name} must be 1..{MAX_FLEET} processes, "
                                  f"got {getattr(self, name)}")
        if not 0.0 <= self.churn <= 1.0:
            raise ConfigError(f"--churn {self.churn:g}: churn rate {self.churn} outside [0, 1]")
        if not 0 <= self.max_joins <= MAX_FLEET:
            raise ConfigError(f"--max-joins {self.max_joins}: max joins must be 0..{MAX_FLEET}, got {self.max_joins}")
        if self.fleet and self.topology:
            raise ConfigError("--prefills/--decodes/--churn run processes of one rank each with equal page sizes: "
                              "they do not combine with --prefill-tp/--decode-tp or unequal page sizes (run the "
                              "topology with one process of each, or the fleet without a topology)")

    def _check_two_hosts(self) -> None:
        """The flags named, as a user typed them: these errors are one line each on the command line."""
        self.net_faults = [(str(name), float(seconds)) for name, seconds in self.net_faults]
        for name, seconds in self.net_faults:
            if name not in NET_FAULTS:
                raise ConfigError(f"--net-fault: unknown fault {name!r} (known: {', '.join(NET_FAULTS)})")
            if not 0.0 < seconds <= MAX_NET_FAULT_SECONDS:
                raise ConfigError(f"--net-fault {name}={seconds:g}: the seconds must be above 0 and at most "
                                  f"{MAX_NET_FAULT_SECONDS:g}")
        if self.net_fault_rounds < 0:
            raise ConfigError(f"--net-fault-rounds {self.net_fault_rounds}: must be 0 (no limit) or more")
        if not 0.0 <= self.net_fault_gap <= MAX_NET_FAULT_SECONDS:
            raise ConfigError(f"--net-fault-gap {self.net_fault_gap:g}: must be 0..{MAX_NET_FAULT_SECONDS:g} seconds")
        if self.net_faults and not self.two_hosts:
            raise ConfigError("--net-fault needs --two-hosts (the faults act on the wire between the two hosts)")
        if self.peer_agent and not self.two_hosts:
            raise ConfigError("--peer-agent needs --two-hosts (it names the machine that is host b)")
        if not self.two_hosts:
            return
        if self.peer_agent:
            from ..remote import _endpoint

            _endpoint(self.peer_agent)  # ConfigError naming the agent address
            if self.transport not in ("tcp", "verbs"):
                raise ConfigError(f"--two-hosts --peer-agent runs over tcp or verbs, not {self.transport!r} (shm "
                                  "needs one host)")
            if any(name == "stop_decode" for name, _ in self.net_faults):
                raise ConfigError("--net-fault stop_decode: a process on the other machine (--peer-agent) runs "
                                  "behind a stand-in here, which cannot pass SIGSTOP on")
        elif self.transport != "tcp":
            raise ConfigError(f"--two-hosts runs over tcp only, not {self.transport!r} (shm needs one host; "
                              "soft-RoCE does not route inside network namespaces on this kernel: give "
                              "--peer-agent to use another machine as host b)")
        if self.topology:
            raise ConfigError("--two-hosts runs processes of one rank each with equal page sizes: it does not "
                              "combine with --prefill-tp/--decode-tp or unequal page sizes")

    # topology ------------------------------------------------------------------------------------
    @property
    def fleet(self) -> bool:
        """Several prefill or decode processes (each request to one pair), processes coming and going, or
        processes on two hosts."""
        return self.prefills > 1 or self.decodes > 1 or self.churn > 0 or self.two_hosts

    def describe_fleet(self) -> str:
        """``"3 prefill x 4 decode processes, churn 0.05"`` ("" without a fleet); on two hosts,
        ``"... on two hosts (prefills on a, decodes on b), net faults link_down 2s, drop 2s"``."""
        if not self.fleet:
            return ""
        text = (f"{self.prefills} prefill x {self.decodes} decode processes"
                + (f", churn {self.churn:g}" if self.churn else ""))
        if self.two_hosts:
            text += " on two hosts (prefills on a, decodes on b)"
            if self.net_faults:
                text += ", net faults " + ", ".join(f"{name} {seconds:g}s" for name, seconds in self.net_faults)
        return text

    @property
    def prefill_page(self) -> int:
        return self.prefill_page_size or self.page_size

    @property
    def decode_page(self) -> int:
        return self.decode_page_size or self.page_size

    @property
    def topology(self) -> bool:
        """More than one rank on a side, or unequal page sizes: ranks carry geometries and the cell oracle."""
        return self.prefill_tp > 1 or self.decode_tp > 1 or self.prefill_page != self.decode_page

    @property
    def sliced(self) -> bool:
        """Writers and receivers do not pair page for page (unequal TP or page sizes)."""
        return self.prefill_tp != self.decode_tp or self.prefill_page != self.decode_page

    def describe_topology(self) -> str:
        """``"prefill TP 2 -> decode TP 1, 4 KV heads x 64 B, 16/16 tokens per page"`` ("" for the plain pair)."""
        if not self.topology:
            return ""
        return (f"prefill TP {self.prefill_tp} -> decode TP {self.decode_tp}, {self.kv_heads} KV heads x "
                f"{self.head_bytes} B, {self.prefill_page}/{self.decode_page} tokens per page")

    @property
    def buffers(self) -> int:
        return 2 * self.layers  # K and V per layer

    @property
    def max_context(self) -> int:
        return self.context or self.decode_pages * self.decode_page

    @property
    def prefill_tokens(self) -> int:
        return self.prefill_pages * self.prefill_page

    @property
    def unsafe_band(self) -> tuple[int, int] | None:
        """Prompt lengths that pass the context check but cannot fit the prefill pool."""
        low, high = self.prefill_tokens + 1, min(self.max_context, self.decode_pages * self.decode_page)
        return (low, high) if low <= high else None

    def link_faults(self) -> dict[str, float] | None:
        """The prefill's fault injector rates, or None when no link fault is on: its links then run as in
        production, with no injector (the caller's-thread sends, the prepared frames and the DONE filled in
        C are taken only without one), so a run of request and process faults alone drives those paths."""
        rates = {_LINK_RATE_NAMES[name]: self.faults.get(name, 0.0) for name in LINK_FAULTS}
        return rates if any(rates.values()) else None

    def seats(self, role: str) -> int:
        """A fleet's seats of a role: the processes it starts with, and room for ``max_joins`` more."""
        return (self.prefills if role == "prefill" else self.decodes) + self.max_joins

    def key_names(self) -> list[str]:
        """One key pair per rank (a replaced prefill rank keeps its rank's key); a fleet's: one per seat
        (every process in a seat uses its seat's key)."""
        if self.fleet:
            return [f"{role}{seat}" for role in ROLES for seat in range(self.seats(role))]
        if not self.topology:
            return ["prefill", "decode"]
        return [f"prefill{p}" for p in range(self.prefill_tp)] + [f"decode{d}" for d in range(self.decode_tp)]

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        if not self.fleet:  # the plain pair's and the topologies' JSON stay as they were
            for name in ("prefills", "decodes", "churn", "max_joins"):
                del data[name]
        if not self.layerwise:
            del data["layerwise"]
        if not self.two_hosts:  # the JSON of a run on one host stays as it was
            for name in ("two_hosts", "peer_agent", "net_faults", "net_fault_gap", "net_fault_rounds"):
                del data[name]
        return data


@dataclass
class RequestPlan:
    """One request as the workload drew it: id, prompt tokens, the fault it carries (at most one), chunks."""

    rid: str
    tokens: int
    faults: set[str]
    chunks: int
    decode_first: bool = False
    disconnect_at: int = 0  # client_disconnect: 0 after prefill admission, 1 after decode's, 2 mid-transfer
    prefill_rank: int = 0  # kill_sender: the prefill rank killed
    decode_rank: int = 0  # abort_mid_transfer: the decode rank the abort starts on
    route: tuple[float, float] = (0.0, 0.0)  # a fleet: where in the live prefills and decodes it goes
    churn: tuple[str, str, float] | None = None  # a fleet: (kind, role, which) fired as it starts


class Workload:
    """Draws request plans from a :class:`StressConfig`, deterministically for a given seed."""

    def __init__(self, config: StressConfig) -> None:
        self.config = config
        self._rng = random.Random(config.seed)
        self._np = np.random.default_rng(config.seed)
        self._ranks = random.Random(f"ranks-{config.seed}")  # its own stream: the plain pair's draws stay as they were
        self._routes = random.Random(f"routes-{config.seed}")  # a fleet's pairs and churn: streams of their own
        self._churn = random.Random(f"churn-{config.seed}")
        self._count = 0

    def next(self) -> RequestPlan:
        cfg = self.config
        self._count += 1
        # At most one request-level fault per request, each drawn with exactly its configured rate
        # (a categorical draw; rates are scaled down only if they add up to more than 1).
        rates = [(name, cfg.faults.get(name, 0.0)) for name in REQUEST_FAULTS]
        if cfg.unsafe_band is None:
            rates = [(n, r) for n, r in rates if n != "oversized"]
        total = sum(r for _, r in rates)
        scale = 1.0 / total if total > 1.0 else 1.0
        draw = self._rng.random()
        faults: set[str] = set()
        cumulative = 0.0
        for name, rate in rates:
            cumulative += rate * scale
            if draw < cumulative:
                faults = {name}
                break
        band = cfg.unsafe_band
        if "oversized" in faults:
            assert band is not None
            # Stay in the lower part of the band so a legacy (unsafe) decode can still reserve it.
            high = min(band[1], band[0] + max(1, (band[1] - band[0]) // 4))
            tokens = self._rng.randint(band[0], high)
        else:
            limit = min(cfg.prefill_tokens, cfg.max_context) // 2
            tokens = int(self._np.lognormal(np.log(cfg.median_tokens), cfg.sigma))
            tokens = max(1, min(tokens, limit))
        chunks = self._rng.randint(1, max(1, cfg.max_chunks))
        route = (self._routes.random(), self._routes.random()) if cfg.fleet else (0.0, 0.0)
        churn = None
        if cfg.churn and self._churn.random() < cfg.churn:
            churn = (self._churn.choice(CHURN_KINDS), self._churn.choice(("prefill", "decode")), self._churn.random())
        return RequestPlan(
            rid=f"s{self._count}",
            tokens=tokens,
            faults=faults,
            chunks=chunks,
            decode_first=self._rng.random() < 0.5,
            disconnect_at=self._rng.randrange(3),
            prefill_rank=self._ranks.randrange(cfg.prefill_tp),
            decode_rank=self._ranks.randrange(cfg.decode_tp),
            route=route,
            churn=churn,
        )
