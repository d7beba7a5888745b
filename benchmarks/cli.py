"""The command line every topic shares, so that a flag means one thing wherever it appears.

Each topic's ``main(argv)`` builds its parser with :func:`topic_parser` (whose ``prog`` is the
command a user types, ``python -m benchmarks run NAME``) and adds the shared flags through the
functions here, which fix their spelling and wording:

* ``--output PATH``: also write the report (Markdown) there; a topic that writes JSON too puts it
  next to it;
* ``--repeats N``: timed repetitions, interleaved across the variants being compared, over
  which medians and paired ratios are taken;
* ``--quick``: a smoke run of seconds that exercises the whole benchmark (a test of it, not a
  measurement); it only changes defaults, so a flag given explicitly still wins.

Other flags (``--threads``, ``--warmup``, ``--device``, ``--size``, ``--optimizers``) are spelled
the same in every topic that has them. :func:`command` is the line a report records, so that the
report says how to reproduce it.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from amp_trainer.atomic_files import write_text_atomic
from benchmarks.machine import REPO

PROG = "python -m benchmarks"


def topic_parser(topic: str, doc: str | None) -> argparse.ArgumentParser:
    """A parser named as the user runs it, described by the first paragraph of ``doc``."""
    description = (doc or "").strip().split("\n\n")[0]
    return argparse.ArgumentParser(prog=f"{PROG} run {topic}", description=description)


def add_output(
    parser: argparse.ArgumentParser,
    default: Path | None = None,
    help: str = "also write the report here (Markdown)",
) -> None:
    """``--output PATH``: where the report goes (besides stdout)."""
    if default is not None:
        help += f" (default: {shown_path(default)})"
    parser.add_argument("--output", type=Path, default=default, metavar="PATH", help=help)


def emit(text: str, output: Path | None) -> None:
    """Print the report, and write it to ``output`` (``--output``) too when one is given."""
    print(text)
    if output is not None:
        write_text_atomic(output, text + "\n")


def add_repeats(
    parser: argparse.ArgumentParser, default: int | None, help: str = "timed repeats (>= 1)"
) -> None:
    """``--repeats N``: how many timed, interleaved repetitions the medians are taken over."""
    parser.add_argument("--repeats", type=int, default=default, metavar="N", help=help)


def add_quick(parser: argparse.ArgumentParser, values: Mapping[str, Any]) -> None:
    """``--quick``: ``values`` (dest -> value) become the defaults; see :func:`parse`."""
    shown = " ".join(f"--{dest.replace('_', '-')} {value}" for dest, value in values.items())
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run in seconds, not a measurement: {shown} unless given",
    )
    parser.set_defaults(_quick_values=dict(values))


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse ``argv``; with ``--quick``, parse again with the quick values as defaults.

    Two passes, because a default must be known before parsing while ``--quick`` is only known
    after it; explicit flags win over the quick values since they are parsed on top of them.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if getattr(args, "quick", False):
        parser.set_defaults(**args._quick_values)
        args = parser.parse_args(argv)
    if hasattr(args, "_quick_values"):
        del args._quick_values
    return args


def shown_path(path: Path) -> str:
    """``path`` relative to the checkout where it lies inside it, as help and reports show it."""
    resolved = path.resolve()
    return str(resolved.relative_to(REPO)) if resolved.is_relative_to(REPO) else str(path)


def command(topic: str, argv: Sequence[str] | None) -> str:
    """The command line that reproduces a report: ``python -m benchmarks run TOPIC ARGS``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return " ".join([PROG, "run", topic, *([shlex.join(argv)] if argv else [])])
