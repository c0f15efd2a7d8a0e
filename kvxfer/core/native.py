"""Which data path runs: the C extension (``kvxfer._native``, built from ``native/``) or pure Python.

The choice is automatic: the extension is used when it imported, unless ``KVXFER_PURE_PYTHON=1``
asks for the fallback (the test suite runs both). :func:`describe` says which one, and why.
"""

from __future__ import annotations

import os
from types import ModuleType

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INSTALL_HINT = ("to get the native C data path: install a C compiler and the Python headers (Debian: apt install "
                "gcc python3-dev), then reinstall kvxfer from its source tree (pip install --force-reinstall "
                "--no-deps .); the build skips the extension silently when it cannot compile it")


def _why_not_loaded(exc: ImportError) -> str:
    """An ImportError of ``kvxfer._native`` in one readable line. A missing extension reads "cannot import
    name '_native' from partially initialized module 'kvxfer' (most likely due to a circular import)":
    that is no cycle, only no compiled file."""
    text = " ".join(str(exc).split())
    if isinstance(exc, ModuleNotFoundError) or "partially initialized module" in text or \
            "cannot import name '_native'" in text:
        return f"the C extension kvxfer._native is not built (no _native*.so in {_PACKAGE})"
    return f"the C extension kvxfer._native did not load: {text}"


_reason = ""
lib: ModuleType | None
if os.environ.get("KVXFER_PURE_PYTHON") == "1":
    lib = None
    _reason = "KVXFER_PURE_PYTHON=1 asks for it"
else:
    try:
        from .. import _native as lib
    except ImportError as exc:  # not built on this platform
        lib = None
        _reason = _why_not_loaded(exc)


checksums_in_c = False
_checksum_reason = ""
if lib is not None:
    try:
        from zlib_ng import zlib_ng as _zlib_ng

        checksums_in_c = bool(lib.load_zlib_ng(_zlib_ng.__file__))
        if not checksums_in_c:
            _checksum_reason = f"{_zlib_ng.__file__} has no zng_adler32/zng_crc32 symbols to call from C"
    except (ImportError, AttributeError, OSError) as exc:
        checksums_in_c = False
        _checksum_reason = " ".join(str(exc).split()) or type(exc).__name__


def available() -> bool:
    return lib is not None


def describe() -> str:
    if lib is None:
        return f"pure-Python data path: {_reason}"
    return "native C data path" + (" with zlib-ng checksums in C" if checksums_in_c else "")


def report() -> list[str]:
    """What ``kvxfer --version`` says about the data path: which one runs, how it checksums, and, on
    the pure-Python fallback, why and what to install to get the native one."""
    if lib is not None:
        where = os.path.basename(getattr(lib, "__file__", "") or "kvxfer._native")
        if checksums_in_c:
            checksums = "checksums: zlib-ng, called from C"
        else:
            checksums = f"checksums: zlib-ng from Python ({_checksum_reason or 'not loaded into the C extension'})"
        return [f"data path: native C ({where}); {checksums}"]
    lines = [f"data path: pure-Python fallback, because {_reason}; checksums: zlib-ng from Python"]
    if os.environ.get("KVXFER_PURE_PYTHON") == "1":
        lines.append("unset KVXFER_PURE_PYTHON to use the native C data path where it is built")
    else:
        lines.append(INSTALL_HINT)
    return lines


def provides(*names: str) -> bool:
    """Whether the loaded extension has every function in ``names``: one built from an older
    ``native/`` lacks the newer ones (the shm transport's ``ring_copy``), and its callers then take
    their pure-Python path instead of failing."""
    return lib is not None and all(hasattr(lib, name) for name in names)
