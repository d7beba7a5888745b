"""The islands benchmark runs and prints a well-formed table (structure only: never timing)."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers.repo import REPO_ROOT, subprocess_env


def test_bench_islands_prints_plain_and_island_side_by_side_for_every_regime(tmp_path):
    report = tmp_path / "islands.md"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "run", "islands", "--quick", "--output", str(report)],
        cwd=REPO_ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header[:3] == ["regime", "plain", "island"]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    assert [row[0] for row in rows] == ["fp32 eager", "autocast, fp32 in", "autocast, fp16 in"]
    assert all(float(row[1]) > 0 and float(row[2]) > 0 for row in rows)
    assert "load average" in done.stdout and "LayerNorm(768)" in done.stdout
    # The quick values, and the command that reproduces the report, in the report itself.
    assert "4 interleaved rounds x 20 calls" in done.stdout
    assert f"Command: `python -m benchmarks run islands --quick --output {report}`" in done.stdout
    assert report.read_text().strip() == done.stdout.strip()
