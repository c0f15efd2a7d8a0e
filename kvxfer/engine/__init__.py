"""Engines: the decode (receiving) and prefill (writing) roles wired to the control plane and a
transport, with the threads that drive them.

:class:`DecodeEngine` and :class:`PrefillEngine` are what an application uses (the README shows
them). Each owns a page pool over a :class:`~kvxfer.core.layout.KVLayout`, a control plane, a transport
and a control thread that receives messages, applies timeouts and sends heartbeats. The role logic
lives in :mod:`kvxfer.engine.receiver` / :mod:`kvxfer.engine.sender`; this module is plumbing.

Lifecycle: construct (the capacity invariant is checked first, before any socket opens), peer
(``DecodeEngine.connect(prefill.address)``), use, ``close()`` (idempotent; also a context manager).

Locking: one re-entrant lock per engine guards the role logic, its ledger and its write guard. The
transport's threads take it briefly to check and record writes and to deliver ordered messages; no
thread holds it while blocking on I/O, and fencing (which joins a data thread) happens outside it.
"""


from .config import EngineConfig
from .decode import DecodeEngine
from .prefill import PrefillEngine
from .reads import KVRead

__all__ = ["DecodeEngine", "EngineConfig", "KVRead", "PrefillEngine"]
