#!/usr/bin/env python3
"""Coverage-guided fuzzing of kvxfer's wire decoders with atheris (libFuzzer), bounded in time.

    python3 tools/fuzz.py                      # every target, 60 s each (what CI runs)
    python3 tools/fuzz.py --seconds 600 frames # one target, longer
    python3 tools/fuzz.py --seed-corpus        # (re)write the seed inputs from protocol/golden
    python3 tools/fuzz.py --keep               # also fold inputs with new coverage into the kept corpus

Each target runs in its own process over the kept corpus in ``protocol/fuzz-corpus/<target>/``
(read-only during a run: new inputs go to a scratch directory, so CI never dirties the clone).
A crash (an exception other than ProtocolError/WriteRefused, see :mod:`kvxfer.wire.fuzzing`) or a
hang (an input taking over ``--timeout`` seconds) fails the run; libFuzzer writes the input to
``crash-*``/``timeout-*`` in the scratch directory and this script prints its path and bytes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "protocol" / "fuzz-corpus"
TARGETS = ("messages", "frames", "results")


CHILD_ENV = "KVXFER_FUZZ_TARGET"  # set: this process is libFuzzer's (it may re-execute itself to merge)


def child(target: str) -> None:
    """Runs inside the fuzzing process: instrument kvxfer, then hand over to libFuzzer (all of argv)."""
    import atheris

    with atheris.instrument_imports(include=["kvxfer"]):
        from kvxfer.wire import fuzzing

    atheris.Setup(sys.argv, fuzzing.TARGETS[target])
    atheris.Fuzz()


def seed_corpus() -> None:
    """Seeds: every golden vector, plus writes aimed at the fuzz guard's open window."""
    sys.path.insert(0, str(ROOT))
    import numpy as np

    from kvxfer.wire import frames as f
    from kvxfer.wire import fuzzing
    from kvxfer.wire import messages as m

    for target in TARGETS:
        (CORPUS / target).mkdir(parents=True, exist_ok=True)
    for path in sorted((ROOT / "protocol" / "golden").glob("*.bin")):
        target = ("results" if path.stem == "FRAME_RESULT" else "frames" if path.stem.startswith("FRAME_")
                  else "messages")
        (CORPUS / target / f"golden-{path.stem}").write_bytes(path.read_bytes())
    page = fuzzing._fuzz_guard()._windows[fuzzing.FUZZ_GEN].pages[0]
    item = fuzzing.FUZZ_ITEM
    runs = f.pack_runs(np.array([0, 1]), np.array([page * item, page * item]), np.array([item, item]))
    write = f.write_header(fuzzing.FUZZ_SLOT, fuzzing.FUZZ_GEN, 2, 2 * item) + runs + b"\x5a" * (2 * item)
    done = m.encode(m.Done(rid="fuzz", gen=fuzzing.FUZZ_GEN, bytes=2 * item, pages=1, checksum=1, algo="adler32"))
    ordered = f.message_frame(f.FrameKind.ORDERED, done, slot=fuzzing.FUZZ_SLOT, generation=fuzzing.FUZZ_GEN)
    (CORPUS / "frames" / "window-write-then-done").write_bytes(write + ordered)
    done_frame = f.done_frame(m.Done(rid="fuzz", gen=fuzzing.FUZZ_GEN, bytes=2 * item, pages=1, checksum=1,
                                     algo="adler32"), slot=fuzzing.FUZZ_SLOT)
    (CORPUS / "frames" / "window-write-then-done-frame").write_bytes(write + done_frame)
    verbs_done = m.encode(m.Done(rid="fuzz", gen=fuzzing.FUZZ_GEN, bytes=2 * item, pages=1, checksum=1,
                                 algo="adler32", runs=runs))
    (CORPUS / "messages" / "window-done-with-write-log").write_bytes(verbs_done)
    ok = f.result_frame(m.Result(rid="fuzz", gen=fuzzing.FUZZ_GEN, ok=True, reason="", detail=""))
    failed = f.result_frame(m.Result(rid=7, gen=8, ok=False, reason="coverage", detail="1 of 2 pages not written"))
    (CORPUS / "results" / "two-results").write_bytes(ok + failed)
    (CORPUS / "results" / "result-then-ordered").write_bytes(ok + ordered)
    (CORPUS / "results" / "result-cut-short").write_bytes(ok + failed[:40])
    print(f"seed corpus written under {CORPUS.relative_to(ROOT)}")


def _child(target: str, args: list[str], log: Path) -> int:
    """libFuzzer's chatter goes to ``log``; its tail is printed (all of it on failure)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env[CHILD_ENV] = target
    with open(log, "w") as out:
        code = subprocess.run([sys.executable, __file__, *args], env=env, stdout=out,
                              stderr=subprocess.STDOUT).returncode
    lines = log.read_text(errors="replace").splitlines()
    keep = [line for line in lines if line.startswith(("stat::", "Done ", "INFO: seed corpus", "#"))][-6:]
    print("\n".join(lines[-80:] if code else keep), flush=True)
    return code


def run(target: str, seconds: int, timeout: int, keep: bool) -> int:
    kept = CORPUS / target
    kept.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"kvxfer-fuzz-{target}-") as scratch:
        new = Path(scratch) / "new"
        new.mkdir()
        print(f"== fuzz {target}: {seconds} s over {len(list(kept.iterdir()))} kept inputs", flush=True)
        code = _child(target, [f"-max_total_time={seconds}", f"-timeout={timeout}", "-rss_limit_mb=2048",
                               f"-artifact_prefix={scratch}/", "-print_final_stats=1", str(new), str(kept)],
                      Path(scratch) / "fuzz.log")
        artifacts = sorted(p for p in Path(scratch).iterdir() if p.name.startswith(("crash-", "timeout-", "oom-")))
        for artifact in artifacts:
            print(f"!! {artifact.name}: {artifact.read_bytes()[:512]!r}")
            findings = ROOT / "protocol" / "fuzz-findings"
            findings.mkdir(exist_ok=True)
            shutil.copy(artifact, findings / f"{target}-{artifact.name}")
            print(f"   kept as {findings.relative_to(ROOT)}/{target}-{artifact.name}")
        if code != 0 or artifacts:
            print(f"== fuzz {target}: FAILED (exit {code})")
            return 1
        found = len(list(new.iterdir()))
        if keep and found:
            before = len(list(kept.iterdir()))
            _child(target, ["-merge=1", str(kept), str(new)], Path(scratch) / "merge.log")  # new coverage only
            print(f"== fuzz {target}: kept {len(list(kept.iterdir())) - before} of {found} new inputs")
        print(f"== fuzz {target}: no crash or hang in {seconds} s ({found} new inputs this run)")
        return 0


def main() -> int:
    if os.environ.get(CHILD_ENV):
        child(os.environ[CHILD_ENV])
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("targets", nargs="*", metavar="TARGET", help=f"any of {', '.join(TARGETS)} (default: all)")
    parser.add_argument("--seconds", type=int, default=60, help="fuzzing time per target (default 60)")
    parser.add_argument("--timeout", type=int, default=5, help="seconds one input may take before it is a hang")
    parser.add_argument("--seed-corpus", action="store_true", help="write the seed inputs from protocol/golden")
    parser.add_argument("--keep", action="store_true", help="merge inputs with new coverage into the kept corpus")
    args = parser.parse_args()
    if args.seed_corpus:
        seed_corpus()
        return 0
    try:
        import atheris  # noqa: F401
    except ImportError:
        print("atheris is not installed (pip install atheris; Linux x86_64 wheels)", file=sys.stderr)
        return 2
    unknown = set(args.targets) - set(TARGETS)
    if unknown:
        parser.error(f"unknown target(s) {', '.join(sorted(unknown))}; choose from {', '.join(TARGETS)}")
    status = 0
    for target in args.targets or TARGETS:
        status |= run(target, args.seconds, args.timeout, args.keep)
    return status


if __name__ == "__main__":
    sys.exit(main())
