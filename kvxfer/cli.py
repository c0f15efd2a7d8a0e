"""The ``kvxfer`` command line: one subcommand per job, each in its own module, imported on use."""

from __future__ import annotations

import argparse
import logging
import sys


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(json_path=args.json, transport=args.transport, verbose=args.verbose)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvxfer",
        description="KV-cache transfer engine for disaggregated LLM serving: tagged one-sided writes, "
        "admission that rejects, verified completion, deferred release.",
    )
    parser.add_argument("--version", action="version", version=f"kvxfer {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run the scripted prefill/decode session on loopback (the main job)")
    demo.add_argument("--json", metavar="PATH", help="also write the outcomes as JSON")
    demo.add_argument("--transport", default="tcp", choices=["tcp"], help="data transport (default tcp)")
    demo.add_argument("--verbose", "-v", action="store_true", help="show the engines' logs")
    demo.set_defaults(func=_demo)
    return parser


def _version() -> str:
    from . import __version__

    return __version__


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
