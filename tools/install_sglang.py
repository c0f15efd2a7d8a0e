#!/usr/bin/env python3
"""Install the pinned SGLang release the integration tests drive, and what its servers need on a CPU.

SGLang's wheel depends on CUDA kernels, flash-attention and more; its disaggregation classes and its
CPU serving path (torch_native attention) need none of them. This installs the pinned `sglang` with
--no-deps, the pure-Python packages its imports and its HTTP server reach, `sglang-router` for PD
mode, and the torch/torchvision pair its module graph imports. That pair is PyPI's CUDA build (the
CPU torch wheel has no torchvision that imports beside it): about 5.6 GB of the install, most of it
CUDA libraries nothing here loads. Already installed: nothing to do. Used by .ci/run and the README's
test command.

    python3 tools/install_sglang.py [--check]
"""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys

SGLANG = "sglang==0.5.23"
TORCH = ["torch==2.14.1", "torchvision==0.29.1"]
LIGHT = [
    "aiohttp", "requests", "psutil", "pybase64", "starlette", "msgspec", "tqdm", "transformers", "dill",
    "apache-tvm-ffi==0.1.11", "sentencepiece", "compressed-tensors", "gguf", "pydantic", "orjson", "ipython",
]
# What `python -m sglang.launch_server` and the PD router need beyond the classes (the e2e tests run
# real servers on the CPU): the HTTP stack, SGLang's imports at server start, the router.
SERVER = [
    "uvloop", "fastapi", "uvicorn", "setproctitle", "openai==2.8.0", "partial_json_parser", "einops", "soundfile",
    "python-multipart", "jsonschema", "sglang-router==0.3.2",
]
NO_DEPS = ["xgrammar"]  # its dependency list would replace the pinned torch


def installed(spec: str) -> bool:
    name, _, version = spec.partition("==")
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        return False
    return not version or have.split("+")[0] == version


def importable() -> bool:
    # what the servers the e2e test starts import, not only the classes kvxfer subclasses: a missing
    # server dependency must fail here, at install time, not as a server that exits at start
    code = ("import sglang.srt.disaggregation.utils, sglang.srt.disaggregation.common.conn, "
            "sglang.srt.disaggregation.base.conn, sglang.srt.entrypoints.http_server, sglang.launch_server, "
            "sglang.srt.managers.scheduler, sglang.srt.managers.tokenizer_manager, "
            "sglang.srt.managers.detokenizer_manager, sglang_router.launch_router")
    return subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True).returncode == 0


def main() -> int:
    if "--check" in sys.argv:
        return 0 if importable() else 1
    pip = [sys.executable, "-m", "pip", "install", "-q"]
    if not all(installed(s) for s in TORCH):
        subprocess.run(pip + TORCH, check=True)
    missing = [s for s in LIGHT + SERVER if not installed(s)]
    if missing:
        subprocess.run(pip + missing, check=True)
    missing = [s for s in NO_DEPS if not installed(s)]
    if missing:
        subprocess.run(pip + ["--no-deps", *missing], check=True)
    if not installed(SGLANG):
        subprocess.run(pip + ["--no-deps", SGLANG], check=True)
    if not importable():
        print("sglang installed but its disaggregation or server modules do not import", file=sys.stderr)
        return 1
    print(f"{SGLANG} ready (disaggregation classes import)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
