"""The README's commands and example are real: the example runs, .ci/run calls the test command."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_readme_starts_with_the_two_commands_and_ci_runs_the_second():
    block = re.search(r"```bash\n(.*?)```", README, re.S).group(1).strip().splitlines()
    assert len(block) == 2
    assert "kvxfer demo" in block[0]
    assert block[1] in (ROOT / ".ci" / "run").read_text()


def test_readme_python_examples_run():
    """Every Python block of the README (the first pair, then unequal tensor parallelism)."""
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    assert len(blocks) >= 2
    for code in blocks:
        if "torch CUDA tensors" in code:  # the GPU snippet needs a GPU's tensors
            continue
        exec(compile(code, "README.md", "exec"), {})


def test_readme_is_documentation_not_a_log():
    """At most 400 lines (the benchmark log lives in docs/benchmarks.md), and no internal issue numbers or
    diary phrases in the user documentation."""
    assert len(README.splitlines()) <= 400, f"README.md has {len(README.splitlines())} lines"
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        for pattern in (r"\bissue #?\d+", r"(?<![\w/])#\d{1,3}\b(?!-)", r"earlier the same day", r"for the record"):
            found = re.search(pattern, text, re.I)
            assert found is None, f"{path.name}: {found.group(0)!r}"
