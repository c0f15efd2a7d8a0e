"""Every error kvxfer raises, and how each names what went wrong.

Invariant: an error about a request names the request id and its generation; an error about pages
names (some of) the pages. Callers branch on the class, operators read the message, and the wire
protocol carries :attr:`KvxferError.code`, so the same failure reads the same on both engines.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

_MAX_PAGES_SHOWN = 8


def describe_pages(pages: Iterable[int] | None) -> str:
    """``"pages [3, 4, 9] (3 pages)"``, shortened for long lists."""
    if pages is None:
        return ""
    page_list = [int(p) for p in pages]
    shown = ", ".join(str(p) for p in page_list[:_MAX_PAGES_SHOWN])
    more = ", ..." if len(page_list) > _MAX_PAGES_SHOWN else ""
    return f"pages [{shown}{more}] ({len(page_list)} page{'s' if len(page_list) != 1 else ''})"


class KvxferError(Exception):
    """Base class. ``code`` is the stable name used on the wire and in metrics."""

    code = "error"

    def __init__(
        self,
        message: str,
        *,
        rid: Any = None,
        generation: int | None = None,
        pages: Iterable[int] | None = None,
    ) -> None:
        self.rid = rid
        self.generation = generation
        self.pages = None if pages is None else [int(p) for p in pages]
        self.detail = message
        super().__init__(self._compose(message))

    def _compose(self, message: str) -> str:
        parts = []
        if self.rid is not None:
            parts.append(f"request {self.rid!r}")
        if self.generation is not None:
            parts.append(f"generation {self.generation}")
        where = " ".join(parts)
        text = f"{where}: {message}" if where else message
        if self.pages:
            text += f" [{describe_pages(self.pages)}]"
        return text


class ConfigError(KvxferError):
    """A configuration that cannot work (layout mismatch, bad policy name, ...)."""

    code = "config"


class GpuError(ConfigError):
    """GPU memory cannot be used as asked: no CUDA driver API, no device, a failing CUDA call, or a
    registration path (dma-buf, nvidia-peermem) that this machine lacks."""

    code = "gpu"


class CapacityError(ConfigError):
    """The startup capacity invariant failed: the pool holds fewer tokens than the context."""

    code = "capacity"


class InvalidArgument(KvxferError, ValueError):
    """A caller passed something the API cannot take (request id, token count, page list, chunk
    size, metadata); refused before anything was reserved, opened or sent."""

    code = "invalid_argument"


class AdmissionRejected(KvxferError):
    """The request can never be served here; nothing was reserved and no byte moved."""

    code = "rejected"

    def __init__(self, message: str, *, reason: str, **kw: Any) -> None:
        self.reason = reason
        super().__init__(message, **kw)


class PoolExhausted(KvxferError):
    """Not enough free pages right now. Retryable: nothing was reserved."""

    code = "pool_exhausted"
    retryable = True


class DuplicateRequest(KvxferError):
    """A request id is admitted while an earlier request with the same id is still active."""

    code = "duplicate"


class UnknownRequest(KvxferError):
    """A call or message names a request this engine does not know (or no longer knows)."""

    code = "unknown_request"


class StaleGeneration(KvxferError):
    """A call or message carries an older generation than the request's current one."""

    code = "stale_generation"


class IllegalTransition(KvxferError):
    """A request state machine was asked for a transition its table does not allow."""

    code = "illegal_transition"

    def __init__(self, *, rid: Any, generation: int | None, role: str, old: str, new: str) -> None:
        self.old = old
        self.new = new
        super().__init__(
            f"illegal {role} transition {old} -> {new}", rid=rid, generation=generation
        )


class PageStateError(KvxferError):
    """The page ledger was asked to move pages that are not in the expected state or owner."""

    code = "page_state"


class LedgerInvariantError(KvxferError):
    """The page accounting invariant does not hold (a bookkeeping bug: never ignore)."""

    code = "ledger_invariant"


class WriteRefused(KvxferError):
    """A one-sided write was refused by the receiving transport; it landed nowhere."""

    code = "write_refused"

    def __init__(self, message: str, *, reason: str, **kw: Any) -> None:
        self.reason = reason
        super().__init__(message, **kw)


class VerificationFailed(KvxferError):
    """Completion verification failed; the request's pages are never readable."""

    code = "verification_failed"

    def __init__(self, message: str, *, check: str, **kw: Any) -> None:
        self.check = check
        super().__init__(message, **kw)


class OwnershipError(KvxferError):
    """A read named pages whose owner or generation is not the reading request's."""

    code = "ownership"


class NotReadable(KvxferError):
    """A read was attempted on a request that is not (or no longer) readable."""

    code = "not_readable"


class TransferFailed(KvxferError):
    """The transfer ended in failure; ``reason`` names the cause the peer or transport gave."""

    code = "transfer_failed"

    def __init__(self, message: str, *, reason: str = "failed", **kw: Any) -> None:
        self.reason = reason
        super().__init__(message, **kw)


class TransferAborted(TransferFailed):
    """The transfer was aborted (by the caller or by the peer) rather than failing on its own."""

    code = "aborted"


class ProtocolError(KvxferError):
    """A control message or data frame is malformed, unknown, oversized or of another version."""

    code = "protocol"


class PeerError(KvxferError):
    """A peer is unknown, unreachable, incompatible or dead."""

    code = "peer"


class NotPeered(PeerError):
    """A message from an engine this one holds no peering with (never had one, or forgot it): the
    sender must HELLO again."""

    code = "not_peered"


class TransportError(KvxferError):
    """The transport could not do what was asked (connect, post, fence)."""

    code = "transport"


class EngineClosed(KvxferError):
    """The engine was closed; it takes no further calls."""

    code = "closed"


ERROR_CLASSES: dict[str, type[KvxferError]] = {
    cls.code: cls
    for cls in (
        KvxferError,
        ConfigError,
        InvalidArgument,
        GpuError,
        CapacityError,
        AdmissionRejected,
        PoolExhausted,
        DuplicateRequest,
        UnknownRequest,
        StaleGeneration,
        IllegalTransition,
        PageStateError,
        LedgerInvariantError,
        WriteRefused,
        VerificationFailed,
        OwnershipError,
        NotReadable,
        TransferFailed,
        TransferAborted,
        ProtocolError,
        PeerError,
        NotPeered,
        TransportError,
        EngineClosed,
    )
}
