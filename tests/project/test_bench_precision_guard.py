"""The precision-guard benchmark runs and prints both loops side by side (structure, not timing).

Its share column is the guard's own work over a step without it; the test checks the figure is
that quotient of the row's own columns, so the README's number means what it says."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers.repo import REPO_ROOT, subprocess_env


def test_bench_precision_guard_prints_the_step_with_and_without_the_guard_and_its_share(tmp_path):
    report = tmp_path / "guard.md"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "run", "precision_guard", "--quick", "--output",
         str(report)],
        cwd=REPO_ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header[:2] == ["step, guard off (ms)", "step, guard on (ms)"]
    row = [c.strip() for c in lines[2].strip("|").split("|")]
    step_off, check_us, hook_us = float(row[0]), float(row[3]), float(row[4])
    share = float(row[5].rstrip(" %"))
    assert step_off > 0 and check_us > 0 and hook_us > 0
    assert share == pytest.approx((check_us + hook_us) / (step_off * 1e3) * 100, rel=0.05, abs=2e-3)
    assert "load average" in done.stdout and "commit" in done.stdout
    assert report.read_text().strip() == done.stdout.strip()
