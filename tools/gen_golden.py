#!/usr/bin/env python3
"""Regenerate protocol/golden/ and protocol/schema.json from the code.

Run after an intentional wire change, review the diff, and update protocol/SPEC.md with it:
    python3 tools/gen_golden.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvxfer.wire import golden  # noqa: E402

if __name__ == "__main__":
    for path in golden.write(ROOT / "protocol"):
        print(path.relative_to(ROOT))
