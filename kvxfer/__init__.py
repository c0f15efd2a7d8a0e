"""kvxfer: a KV-cache transfer engine for disaggregated LLM serving that cannot leak a tenant's pages.

Public API (see README.md): :class:`KVLayout` describes the KV memory (and :class:`KVGeometry` what its
pages hold, for unequal tensor parallelism and page sizes), :class:`PrefillEngine` writes it, :class:`DecodeEngine` receives, verifies and gates reads, :class:`EngineConfig` configures both.
Errors live in :mod:`kvxfer.errors`. Heavy and GPU-only dependencies are imported lazily.
"""

from ._version import __version__
from .core.geometry import BufferGeometry, KVGeometry
from .core.layout import KVLayout
from .core.ledger import AllocPolicy, PageState
from .core.lifecycle import ReceiverState, SenderState
from .core.pool import FreePolicy
from .engine import DecodeEngine, EngineConfig, PrefillEngine
from .engine.reads import KVRead
from .errors import (
    AdmissionRejected,
    CapacityError,
    InvalidArgument,
    KvxferError,
    OwnershipError,
    PoolExhausted,
    TransferFailed,
    VerificationFailed,
    WriteRefused,
)

__all__ = [
    "AdmissionRejected",
    "AllocPolicy",
    "BufferGeometry",
    "CapacityError",
    "DecodeEngine",
    "EngineConfig",
    "FreePolicy",
    "InvalidArgument",
    "KVGeometry",
    "KVLayout",
    "KVRead",
    "KvxferError",
    "OwnershipError",
    "PageState",
    "PoolExhausted",
    "PrefillEngine",
    "ReceiverState",
    "SenderState",
    "TransferFailed",
    "VerificationFailed",
    "WriteRefused",
    "__version__",
]
