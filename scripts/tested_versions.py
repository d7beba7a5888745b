"""The "Tested versions" table of docs/development.md, read and written from a CI run.

``.ci/run`` calls this in each of its environments (``newest``, ``lowest``):

* ``check ENV`` (before the suite): prints the versions this environment resolved, then one
  notice line per package that differs from the table's row for ``ENV`` ("newer than tested").
  It always exits 0: a new upstream release must not turn unrelated work red; the suite that
  follows says whether the new release works.
* ``record ENV`` (after the suite passed): writes this environment's versions into the row for
  ``ENV``, so the table states what the last green CI run tested, not what someone typed. Run
  ``.ci/run`` in a checkout and commit the change it leaves in docs/development.md.

The table's columns name the packages; a package that is not installed is written
``not installed``. The file is rewritten through a temporary file and a rename, so an
interrupted run leaves the old table, never half a file.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
import tempfile
from pathlib import Path

from packaging.version import InvalidVersion, Version

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "development.md"
NOT_INSTALLED = "not installed"
HEADING = "## Tested versions"


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _table(lines: list[str]) -> tuple[int, list[str]]:
    """The index of the table's header line under ``HEADING`` and its package columns."""
    try:
        start = lines.index(HEADING)
    except ValueError:
        raise SystemExit(f"tested_versions: no {HEADING!r} heading in {DOC}") from None
    for index in range(start + 1, len(lines)):
        if lines[index].startswith("| environment |"):
            return index, _cells(lines[index])[1:]
    raise SystemExit(f"tested_versions: no '| environment | ...' table under {HEADING!r}")


def _row_index(lines: list[str], header: int, env: str) -> int:
    environments = []
    for index in range(header + 2, len(lines)):
        if not lines[index].startswith("|"):
            break
        name = _cells(lines[index])[0].split(" ", 1)[0]
        environments.append(name)
        if name == env:
            return index
    raise SystemExit(
        f"tested_versions: no row for environment {env!r} in {DOC.name}'s table "
        f"(rows: {', '.join(environments) or 'none'})"
    )


def read_row(text: str, env: str) -> dict[str, str]:
    """``{package: version}`` of the row for ``env`` (``newest`` or ``lowest``)."""
    lines = text.splitlines()
    header, packages = _table(lines)
    cells = _cells(lines[_row_index(lines, header, env)])[1:]
    return dict(zip(packages, cells))


def write_row(text: str, env: str, versions: dict[str, str]) -> str:
    """``text`` with the row for ``env`` holding ``versions`` (its first cell kept)."""
    lines = text.splitlines()
    header, packages = _table(lines)
    index = _row_index(lines, header, env)
    label = _cells(lines[index])[0]
    lines[index] = "| " + " | ".join([label, *(versions[p] for p in packages)]) + " |"
    return "\n".join(lines) + ("\n" if text.endswith("\n") else "")


def installed(packages: list[str]) -> dict[str, str]:
    """This interpreter's release of each package (``not installed`` where absent)."""
    versions = {}
    for package in packages:
        try:
            versions[package] = public(importlib.metadata.version(package))
        except importlib.metadata.PackageNotFoundError:
            versions[package] = NOT_INSTALLED
    return versions


def public(version: str) -> str:
    """The release without its local label: torch's CPU wheel ``2.13.0+cpu`` is release
    2.13.0, the same release a GPU user's ``2.13.0+cu130`` is."""
    try:
        return Version(version).public
    except InvalidVersion:
        return version


def _newer(found: str, tested: str) -> bool | None:
    """Whether ``found`` is a later release than ``tested``; ``None`` when either is not a
    version (``not installed``)."""
    try:
        return Version(found) > Version(tested)
    except InvalidVersion:
        return None


def notices(env: str, tested: dict[str, str], found: dict[str, str]) -> list[str]:
    """One line per package whose resolved version differs from the tested row's."""
    lines = []
    for package, version in found.items():
        was = tested.get(package, NOT_INSTALLED)
        if version == was:
            continue
        newer = _newer(version, was)
        how = "newer than" if newer else "older than" if newer is False else "differs from"
        lines.append(
            f"notice: {package} {version} is {how} the {was} of docs/development.md's tested "
            f"row '{env}' (a notice, not a failure; the suite below tests it)"
        )
    return lines


def _replace_atomically(path: Path, text: str) -> None:
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.chmod(temp, path.stat().st_mode & 0o777)
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def main(argv: list[str] | None = None, doc: Path = DOC) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["check", "record"])
    parser.add_argument("env", help="the table's environment: newest or lowest")
    args = parser.parse_args(argv)
    text = doc.read_text(encoding="utf-8")
    tested = read_row(text, args.env)
    found = installed(list(tested))
    if args.action == "check":
        print(f"{args.env} environment resolved:", *(f"{p}=={v}" for p, v in found.items()))
        for line in notices(args.env, tested, found):
            print(line)
        return 0
    updated = write_row(text, args.env, found)
    if updated != text:
        _replace_atomically(doc, updated)
        print(f"tested_versions: wrote the '{args.env}' row of {doc.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
