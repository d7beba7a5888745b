"""Per-file totals of a pytest run, from its JUnit XML: which test files keep the suite slow.

``pytest --durations=N`` lists single tests, but the suite runs in xdist workers a file at a time
(``--dist loadfile``), and a file's module fixtures (a trained run several tests read) are charged
to whichever of its tests runs first. What decides how long a worker is busy, and which file is
worth making cheaper, is the file's total: the sum of its tests' times (setup, call and teardown,
as pytest writes each ``<testcase time=...>``). This prints those totals as a Markdown table,
slowest first, for docs/development.md::

    python -m pytest --junitxml=/tmp/junit.xml
    python scripts/suite_durations.py /tmp/junit.xml

The sum over files is CPU-side test time, not wall time: with two workers the run takes about
half of it.
"""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass
class FileTotal:
    path: str
    tests: int = 0
    seconds: float = 0.0
    failed: int = 0
    skipped: int = 0


def file_of(classname: str, root: Path = REPO) -> str:
    """The test file a JUnit ``classname`` (``tests.scaler.test_scaler``, with ``.TestClass`` for
    a test in a class) belongs to, as a path relative to ``root``; the longest dotted prefix that
    names an existing ``.py`` file, else the classname with dots as slashes."""
    parts = classname.split(".")
    for end in range(len(parts), 0, -1):
        candidate = "/".join(parts[:end]) + ".py"
        if (root / candidate).is_file():
            return candidate
    return "/".join(parts) + ".py"


def file_totals(junit_xml: Path, root: Path = REPO) -> list[FileTotal]:
    """Each test file's count of tests and total seconds in ``junit_xml``, slowest first."""
    totals: dict[str, FileTotal] = defaultdict(lambda: FileTotal(""))
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        path = file_of(case.get("classname", ""), root)
        total = totals[path]
        total.path = path
        total.tests += 1
        total.seconds += float(case.get("time", 0.0))
        if case.find("failure") is not None or case.find("error") is not None:
            total.failed += 1
        if case.find("skipped") is not None:
            total.skipped += 1
    return sorted(totals.values(), key=lambda t: (-t.seconds, t.path))


def to_markdown(totals: list[FileTotal]) -> str:
    """A table: file, tests (with how many were skipped or failed), seconds; then the sum."""
    lines = ["| file | tests | seconds |", "|---|---:|---:|"]
    for total in totals:
        counted = ((total.skipped, "skipped"), (total.failed, "failed"))
        notes = [f"{n} {what}" for n, what in counted if n]
        tests = f"{total.tests}" + (f" ({', '.join(notes)})" if notes else "")
        lines.append(f"| `{total.path}` | {tests} | {total.seconds:.1f} |")
    count = sum(t.tests for t in totals)
    seconds = sum(t.seconds for t in totals)
    lines.append(f"| all {len(totals)} files | {count} | {seconds:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit_xml", type=Path, help="the file pytest --junitxml= wrote")
    parser.add_argument(
        "--root", type=Path, default=REPO, help="the checkout the run was in (default: this one)"
    )
    args = parser.parse_args(argv)
    print(to_markdown(file_totals(args.junit_xml, args.root)))


if __name__ == "__main__":
    main()
