"""``python -m kvxfer.integrations.sglang.launch_server SGLANG_ARGS...``: SGLang's launch_server with
kvxfer registered as a transfer backend in the launcher and in every process SGLang spawns.

It puts kvxfer's sitecustomize on PYTHONPATH with KVXFER_SGLANG=1 and re-executes
``python -m sglang.launch_server`` with the same arguments, so pass
``--disaggregation-transfer-backend kvxfer`` like any other backend."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def environment(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment that makes every Python process register the backend."""
    env = dict(os.environ if base is None else base)
    site = str(Path(__file__).resolve().parent / "_site")
    env["PYTHONPATH"] = os.pathsep.join([site] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["KVXFER_SGLANG"] = "1"
    return env


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    os.execvpe(sys.executable, [sys.executable, "-m", "sglang.launch_server", *args], environment())


if __name__ == "__main__":
    main()
