"""``python -m benchmarks``: list the benchmarks, or run one.

Usage::

    python -m benchmarks list
    python -m benchmarks run NAME [flags]       # python -m benchmarks run NAME --help

A benchmark is a folder ``benchmarks/NAME/`` that holds ``bench.py`` (whose ``main(argv)`` this
runs with the flags), a README.md with the command that reproduces its results and what the
numbers mean, and the result files. Run it from the repository root: ``python -m`` puts the
current folder first on ``sys.path``, so ``amp_trainer`` and ``benchmarks`` are this checkout's.
"""

from __future__ import annotations

import ast
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
USAGE = "usage: python -m benchmarks list | run NAME [flags]   (flags: run NAME --help)"


def topics() -> dict[str, Path]:
    """Every benchmark, by name: the folders of ``benchmarks/`` that hold a ``bench.py``."""
    return {path.parent.name: path for path in sorted(HERE.glob("*/bench.py"))}


def summary(bench: Path) -> str:
    """The first line of a topic's docstring, read without importing it (no torch import)."""
    doc = ast.get_docstring(ast.parse(bench.read_text(encoding="utf-8"))) or ""
    return doc.strip().split("\n")[0]


def _error(message: str) -> int:
    print(f"{USAGE}\npython -m benchmarks: error: {message}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        return _error("say `list` or `run NAME`")
    if argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    known = topics()
    if argv[0] == "list":
        if len(argv) > 1:
            return _error(f"list takes no arguments, got {' '.join(argv[1:])!r}")
        width = max(map(len, known))
        for name, bench in known.items():
            print(f"{name:<{width}}  {summary(bench)}")
        print("\nEach: benchmarks/NAME/README.md. Flags: python -m benchmarks run NAME --help")
        return 0
    if argv[0] != "run":
        return _error(f"unknown command {argv[0]!r}: valid are list, run")
    if len(argv) < 2 or argv[1].startswith("-"):
        return _error(f"run needs a NAME, one of: {', '.join(known)}")
    name = argv[1]
    if name not in known:
        return _error(f"unknown benchmark {name!r}: valid are {', '.join(known)}")
    module = importlib.import_module(f"benchmarks.{name}.bench")
    return int(module.main(argv[2:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
