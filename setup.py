"""Build script: the package metadata lives in pyproject.toml; this adds the native data path.

The extension is optional: if it cannot be compiled (no C compiler, an unusual platform) the
install still succeeds and kvxfer runs its pure-Python fallback, which `kvxfer.native.describe()`
reports.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvxfer._native",
            sources=["native/kvxfer_native.c"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            optional=True,
        )
    ]
)
