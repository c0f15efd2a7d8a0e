"""The command line explains itself: every option of every subcommand has help text, and the help
shows the default of every option that has one."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from kvxfer.tools.cli import build_parser


def _subcommands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command path, parser) for the parser and every subcommand under it, nested ones included."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _subcommands(sub, (*path, name))


def _shows_default(action: argparse.Action) -> bool:
    default = action.default
    return bool(action.option_strings) and not (default is None or default is False or default == []
                                                or default is argparse.SUPPRESS)


def test_every_option_of_every_subcommand_has_help_and_shows_its_default():
    commands = list(_subcommands(build_parser()))
    names = {" ".join(path) for path, _ in commands}
    assert {"demo", "stress", "bench", "serve-toy", "keygen", "simulate", "audit capacity", "audit probe"} <= names
    missing, no_default = [], []
    for path, parser in commands:
        formatter = parser._get_formatter()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            label = f"kvxfer {' '.join(path)} {'/'.join(action.option_strings) or action.dest}"
            if not action.help or action.help is argparse.SUPPRESS:
                missing.append(label)
                continue
            text = formatter._expand_help(action)
            if _shows_default(action) and "default" not in text.lower():
                no_default.append(f"{label}: {text!r}")
    assert not missing, "options without help text: " + ", ".join(missing)
    assert not no_default, "options whose help does not show the default: " + "; ".join(no_default)


def test_help_output_shows_defaults():
    out = subprocess.run([sys.executable, "-m", "kvxfer", "stress", "--help"], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())  # an option's help may start on the line after it
    assert "--concurrency CONCURRENCY requests in flight at once (default: 16)" in text
    assert "--decode-pages DECODE_PAGES pages in the decode (reader) pool (default: 8192)" in text
    assert "(default: lifo)" in text and "--seed SEED seed of the workload, its faults and page contents (default: 0)" in text
