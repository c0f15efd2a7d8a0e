"""Build script: the package metadata lives in pyproject.toml; this adds the native data paths.

Both extensions are optional: if one cannot be compiled (no C compiler, no libibverbs headers, an
unusual platform) the install still succeeds and kvxfer uses its pure-Python fallback, which
`kvxfer.core.native.describe()` reports.

* kvxfer._native (native/kvxfer_native.c, native/kvxfer_guard.c): the tcp and shm transports' byte-moving
  loops, and the write guard's per-frame rules.
* kvxfer._verbs (native/kvxfer_verbs.c): chained RDMA WRITE posting and CQ polling for the verbs
  transport; built only where libibverbs' headers are installed (Debian: libibverbs-dev). It calls
  the inline verbs entry points, so it needs no link-time libibverbs.
"""

import os

from setuptools import Extension, setup

COMMON = ["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Werror=implicit-function-declaration"]

extensions = [
    Extension("kvxfer._native", sources=["native/kvxfer_native.c", "native/kvxfer_guard.c"],
              depends=["native/kvxfer_guard.h"], extra_compile_args=COMMON, libraries=["dl"], optional=True)
]
if os.path.exists("/usr/include/infiniband/verbs.h"):
    extensions.append(
        Extension("kvxfer._verbs", sources=["native/kvxfer_verbs.c"], extra_compile_args=COMMON, optional=True)
    )

setup(ext_modules=extensions)
