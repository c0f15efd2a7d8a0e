"""Which data path runs: the C extension (``kvxfer._native``, built from ``native/``) or pure Python.

The choice is automatic: the extension is used when it imported, unless ``KVXFER_PURE_PYTHON=1``
asks for the fallback (the test suite runs both). :func:`describe` says which one, and why.
"""

from __future__ import annotations

import os
from types import ModuleType

_reason = ""
lib: ModuleType | None
if os.environ.get("KVXFER_PURE_PYTHON") == "1":
    lib = None
    _reason = "KVXFER_PURE_PYTHON=1"
else:
    try:
        from .. import _native as lib
    except ImportError as exc:  # not built on this platform
        lib = None
        _reason = f"extension not built ({exc})"


checksums_in_c = False
if lib is not None:
    try:
        from zlib_ng import zlib_ng as _zlib_ng

        checksums_in_c = bool(lib.load_zlib_ng(_zlib_ng.__file__))
    except (ImportError, AttributeError, OSError):
        checksums_in_c = False


def available() -> bool:
    return lib is not None


def describe() -> str:
    if lib is None:
        return f"pure-Python data path: {_reason}"
    return "native C data path" + (" with zlib-ng checksums in C" if checksums_in_c else "")


def provides(*names: str) -> bool:
    """Whether the loaded extension has every function in ``names``: one built from an older
    ``native/`` lacks the newer ones (the shm transport's ``ring_copy``), and its callers then take
    their pure-Python path instead of failing."""
    return lib is not None and all(hasattr(lib, name) for name in names)
