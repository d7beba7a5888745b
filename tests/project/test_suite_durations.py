"""scripts/suite_durations.py: each test file's tests and seconds, summed from a JUnit XML."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

from tests.helpers.repo import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "suite_durations.py"

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="5">
<testcase classname="tests.scaler.test_scaler" name="test_a" time="1.25"/>
<testcase classname="tests.scaler.test_scaler" name="test_b[x]" time="0.75"/>
<testcase classname="tests.scaler.test_scaler.TestGroup" name="test_c" time="2.0"/>
<testcase classname="tests.recipes.test_recipes" name="test_d" time="10.5">
  <failure message="boom">boom</failure></testcase>
<testcase classname="tests.recipes.test_recipes" name="test_e" time="0.0">
  <skipped message="no GPU"/></testcase>
</testsuite></testsuites>
"""


def load_script():
    spec = importlib.util.spec_from_file_location("suite_durations", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # the dataclass looks its module up while the file runs
    spec.loader.exec_module(module)
    return module


def test_each_files_tests_are_counted_and_summed_slowest_file_first(tmp_path):
    for path in ("tests/scaler/test_scaler.py", "tests/recipes/test_recipes.py"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("")
    junit = tmp_path / "junit.xml"
    junit.write_text(JUNIT)

    totals = load_script().file_totals(junit, tmp_path)

    got = [(t.path, t.tests, t.seconds, t.failed, t.skipped) for t in totals]
    assert got == [
        ("tests/recipes/test_recipes.py", 2, 10.5, 1, 1),
        ("tests/scaler/test_scaler.py", 3, 4.0, 0, 0),  # a test in a class counts for its file
    ]


def test_the_command_prints_a_markdown_table_with_the_sum(tmp_path):
    (tmp_path / "tests" / "scaler").mkdir(parents=True)
    (tmp_path / "tests" / "scaler" / "test_scaler.py").write_text("")
    junit = tmp_path / "junit.xml"
    junit.write_text(JUNIT)

    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(junit), "--root", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )

    assert done.stdout.splitlines() == [
        "| file | tests | seconds |",
        "|---|---:|---:|",
        "| `tests/recipes/test_recipes.py` | 2 (1 skipped, 1 failed) | 10.5 |",
        "| `tests/scaler/test_scaler.py` | 3 | 4.0 |",
        "| all 2 files | 5 | 14.5 |",
    ]
