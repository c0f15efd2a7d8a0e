"""Per-transport settings, importable without any fabric's libraries.

One dataclass per registered transport. ``EngineConfig.transport_options`` holds them nested by
transport name (``{"verbs": {"device": "rxe0"}}``); :meth:`EngineConfig.options` returns the
validated dataclass for the configured transport. Each field's metadata names its one environment
variable (``env``) and any older names still accepted with a deprecation warning (``deprecated_env``),
which :meth:`EngineConfig.from_env` reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def _check_threads(transport: str, value: Any) -> None:
    """A transport's ``send_threads``: a positive integer, else ConfigError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        from ..errors import ConfigError

        raise ConfigError(f"{transport} option 'send_threads' must be a positive integer, not {value!r}")


def _check_busy_poll(transport: str, value: Any) -> None:
    """A transport's ``busy_poll_us``: an integer from 0 to 1,000,000 (a second), else ConfigError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 1_000_000:
        from ..errors import ConfigError

        raise ConfigError(f"{transport} option 'busy_poll_us' must be an integer from 0 to 1000000 "
                          f"(microseconds), not {value!r}")


@dataclass
class TcpOptions:
    """Settings of the software transport (:mod:`kvxfer.transport.tcp`)."""

    # "host": send and land host pages through the staging buffers GPU pages use (tests and
    # diagnostics of that pipeline on machines without a GPU); None: only GPU pages are staged
    staging: str | None = field(default=None, metadata={"env": "KVXFER_TCP_STAGING", "choices": (None, "host")})
    # threads that send for every data connection of a prefill (one link is served by one at a time):
    # threads do not grow with peers; this many receivers that stop reading can stall sends at once
    send_threads: int = field(default=8, metadata={"env": "KVXFER_TCP_SEND_THREADS"})
    # a small request (one frame with its DONE) posted on an idle connection leaves from the thread that
    # posts it, never waiting for the socket (what it does not take at once goes on a sending thread);
    # off: every send goes through the sending threads
    inline_send: bool = field(default=True, metadata={"env": "KVXFER_TCP_INLINE_SEND"})
    # the decode sends a request's RESULT back on the data connection its DONE came on (no hop through
    # either control plane's threads); off, or while a writer leaves them unread: on the control plane
    answer_on_data: bool = field(default=True, metadata={"env": "KVXFER_TCP_ANSWER_ON_DATA"})
    # a receiving thread about to sleep until its connection's next frame polls the socket this long
    # first (with the GIL released, yielding the CPU between looks; at most one thread of a process
    # polls at once), so a frame that comes meanwhile costs no wake-up on either side: the CPU of up to
    # one core for this long after each frame, for about 45 us less per small request on the 2-core VM
    # (docs/benchmarks.md, "Busy polling"); 0: sleep at once. Needs the native extension.
    busy_poll_us: int = field(default=1000, metadata={"env": "KVXFER_TCP_BUSY_POLL_US"})

    def __post_init__(self) -> None:
        _check_threads("tcp", self.send_threads)
        _check_busy_poll("tcp", self.busy_poll_us)


@dataclass
class ShmOptions:
    """Settings of the same-host shared-memory transport (:mod:`kvxfer.transport.shm`)."""

    # per connection; frames stream through it (they may be larger), so a small ring that stays in
    # cache between the writer's and the reader's copy is the fastest (measured: 4 MiB beat 64 MiB)
    ring_bytes: int = field(default=4 << 20, metadata={"env": "KVXFER_SHM_RING_BYTES"})
    directory: str = field(default="/dev/shm", metadata={"env": "KVXFER_SHM_DIR"})  # where rings are created
    # threads that put frames into the rings of every connection of a prefill (one ring at a time each)
    send_threads: int = field(default=8, metadata={"env": "KVXFER_SHM_SEND_THREADS"})
    # a small request (its writes in one frame, then its DONE) posted on an idle connection goes into the
    # ring from the posting thread when the ring has room for it (else from a sending thread); off: always
    # from a sending thread
    inline_send: bool = field(default=True, metadata={"env": "KVXFER_SHM_INLINE_SEND"})
    # the decode puts a request's RESULT into the ring's result area, which the writer's watcher reads (no
    # hop through either control plane's threads); off, or while a writer leaves it full: on the control
    # plane. Needs the native extension on the writer's side.
    answer_on_data: bool = field(default=True, metadata={"env": "KVXFER_SHM_ANSWER_ON_DATA"})
    # a landing thread about to sleep until its ring's next frame polls the ring this long first, as
    # tcp's busy_poll_us (at most one thread of a process polls at once, tcp's and shm's together);
    # 0: a few microseconds, then sleep. Needs the native extension.
    busy_poll_us: int = field(default=1000, metadata={"env": "KVXFER_SHM_BUSY_POLL_US"})

    def __post_init__(self) -> None:
        _check_threads("shm", self.send_threads)
        _check_busy_poll("shm", self.busy_poll_us)


@dataclass
class VerbsOptions:
    """Settings of the RDMA transport (:mod:`kvxfer.transport.verbs`)."""

    device: str | None = field(default=None, metadata={"env": "KVXFER_IB_DEVICE",
                                                       "deprecated_env": ("KVXFER_RDMA_DEVICE",)})
    port: int = field(default=1, metadata={"env": "KVXFER_IB_PORT"})
    gid_index: int | None = field(default=None, metadata={"env": "KVXFER_GID_INDEX"})
    # per-request memory windows (type 2B) over each request's pages, so the NIC refuses a write outside
    # them: "auto" uses them where the device has them, "on" refuses to start without them, "off" keeps
    # the region rkey (the decode's write guard then checks the write log and the fence stops the rest)
    windows: str = field(default="auto", metadata={"env": "KVXFER_IB_WINDOWS", "choices": ("auto", "on", "off")})
    # a request whose pages form more contiguous runs than this gets one window per buffer over the
    # whole buffer (still bound to its connection and invalidated with the request), not one per run
    window_max_runs: int = field(default=64, metadata={"env": "KVXFER_IB_WINDOW_MAX_RUNS"})
    # threads that post and poll for every queue pair of a prefill (one queue pair is served by one at a time)
    send_threads: int = field(default=8, metadata={"env": "KVXFER_IB_SEND_THREADS"})
    # how often a queue pair resends a write the peer did not acknowledge before it fails with "retry
    # exceeded" (each wait about 67 ms: ack timeout 14); 7 is the verbs maximum, which rxe (soft-RoCE)
    # takes as "for ever": a smaller value lets a cut-off peer fail the queue pair there too
    retry_cnt: int = field(default=7, metadata={"env": "KVXFER_IB_RETRY_CNT"})

    def __post_init__(self) -> None:
        _check_threads("verbs", self.send_threads)
        if isinstance(self.retry_cnt, bool) or not isinstance(self.retry_cnt, int) or not 0 <= self.retry_cnt <= 7:
            from ..errors import ConfigError

            raise ConfigError(f"verbs option 'retry_cnt' must be an integer in 0..7, not {self.retry_cnt!r}")


OPTIONS: dict[str, type] = {"tcp": TcpOptions, "shm": ShmOptions, "verbs": VerbsOptions}
