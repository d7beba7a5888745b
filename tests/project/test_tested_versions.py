"""scripts/tested_versions.py: the "Tested versions" row is read and written from a CI run, and a
release newer than the row is a one-line notice, never a failure."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import subprocess
import sys

import pytest
from packaging.version import Version

from tests.helpers.repo import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "tested_versions.py"
DOC = REPO_ROOT / "docs" / "development.md"
PACKAGES = "torch transformers accelerate peft datasets tokenizers safetensors numpy pyyaml trl"


def load_script():
    spec = importlib.util.spec_from_file_location("tested_versions", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def version_or_absent(package: str) -> str:
    try:
        return Version(importlib.metadata.version(package)).public
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def doc_copy(tmp_path, **row_versions: str):
    """docs/development.md copied to ``tmp_path``, the newest row's packages set as given."""
    script = load_script()
    text = DOC.read_text()
    if row_versions:
        row = script.read_row(text, "newest")
        text = script.write_row(text, "newest", {**row, **row_versions})
    path = tmp_path / "development.md"
    path.write_text(text)
    return path


def test_the_table_names_each_package_ci_prints_for_both_environments():
    script = load_script()
    for env in ("newest", "lowest"):
        assert list(script.read_row(DOC.read_text(), env)) == PACKAGES.split()


def test_check_prints_what_this_environment_resolved_and_one_notice_per_differing_package(
    tmp_path, capsys
):
    doc = doc_copy(tmp_path, accelerate="1.0.0", peft="99.0")
    assert load_script().main(["check", "newest"], doc=doc) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "newest environment resolved: " + " ".join(
        f"{p}=={version_or_absent(p)}" for p in PACKAGES.split()
    )
    accelerate = importlib.metadata.version("accelerate")
    peft = importlib.metadata.version("peft")
    row = load_script().read_row(DOC.read_text(), "newest")
    expected = {"accelerate": f"accelerate {accelerate} is newer than the 1.0.0"}
    expected["peft"] = f"peft {peft} is older than the 99.0"
    # Packages this environment resolved differently from the real row are noticed too.
    others = [p for p in PACKAGES.split() if p not in expected and version_or_absent(p) != row[p]]
    notices = out[1:]
    assert len(notices) == 2 + len(others)
    for package, start in expected.items():
        (line,) = [n for n in notices if n.startswith(f"notice: {package} ")]
        assert line.startswith(f"notice: {start} of docs/development.md's tested row 'newest'")
        assert line.endswith("(a notice, not a failure; the suite below tests it)")


def test_record_writes_this_environments_row_and_nothing_else_then_check_is_quiet(tmp_path, capsys):
    doc = doc_copy(tmp_path, accelerate="1.0.0", transformers="4.0.0")
    before = doc.read_text().splitlines()
    script = load_script()
    assert script.main(["record", "newest"], doc=doc) == 0
    after = doc.read_text().splitlines()
    changed = [i for i, (a, b) in enumerate(zip(before, after)) if a != b]
    assert len(before) == len(after) and len(changed) == 1
    assert script.read_row(doc.read_text(), "newest") == {
        p: version_or_absent(p) for p in PACKAGES.split()
    }
    assert after[changed[0]].startswith("| newest (what `pip install")  # the label is kept
    assert script.read_row(doc.read_text(), "lowest") == script.read_row(DOC.read_text(), "lowest")
    capsys.readouterr()
    script.main(["check", "newest"], doc=doc)
    assert [line for line in capsys.readouterr().out.splitlines() if "notice" in line] == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["development.md"]  # no temp file left


def test_an_interrupted_record_leaves_the_old_table_and_no_temp_file(tmp_path, monkeypatch):
    doc = doc_copy(tmp_path, accelerate="1.0.0")
    before = doc.read_text()
    script = load_script()

    def disk_full(*_args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(script.os, "replace", disk_full)
    with pytest.raises(OSError, match="No space left"):
        script.main(["record", "newest"], doc=doc)
    assert doc.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["development.md"]


def test_an_unknown_environment_is_one_error_naming_the_rows(tmp_path):
    doc = doc_copy(tmp_path)
    with pytest.raises(SystemExit, match=r"no row for environment 'oldest' .*rows: newest, lowest"):
        load_script().main(["check", "oldest"], doc=doc)


def test_the_check_ci_runs_exits_0_whatever_it_notices():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "check", "newest"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("newest environment resolved: torch==")


def test_a_local_label_is_the_same_release():
    # torch's CPU wheel (2.13.0+cpu) is the release the row names (2.13.0): no notice for it.
    script = load_script()
    assert script.public("2.13.0+cpu") == "2.13.0"
    cpu_wheel = {"torch": script.public("2.13.0+cpu")}
    assert script.notices("newest", {"torch": "2.13.0"}, cpu_wheel) == []
    assert script.notices("newest", {"torch": "2.13.0"}, {"torch": "2.14.1"}) == [
        "notice: torch 2.14.1 is newer than the 2.13.0 of docs/development.md's tested row "
        "'newest' (a notice, not a failure; the suite below tests it)"
    ]
