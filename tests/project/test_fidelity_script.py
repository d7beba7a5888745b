"""The fidelity benchmark: the summary statistics and the resume rule (no recipe is run here)."""

from __future__ import annotations

import importlib
import json
import statistics


def load_fidelity():
    return importlib.import_module("benchmarks.fidelity.bench")


def record(recipe, precision, seed, **metrics):
    return {"recipe": recipe, "precision": precision, "seed": seed, "returncode": 0, **metrics}


def test_summary_gives_mean_sd_and_the_fp16_minus_fp32_difference_paired_by_seed():
    fidelity = load_fidelity()
    fp32 = {1: 90.0, 2: 88.0, 3: 89.0}
    fp16 = {1: 89.5, 2: 87.0, 3: 89.0}
    records = [record("bert", "fp32", s, **{"accuracy %": v, "F1 %": v}) for s, v in fp32.items()]
    records += [record("bert", "fp16", s, **{"accuracy %": v, "F1 %": v}) for s, v in fp16.items()]
    table = fidelity.summarize(records)
    row = next(line for line in table.splitlines() if "| accuracy % | fp16 |" in line)
    diffs = [fp16[s] - fp32[s] for s in fp32]
    assert f"{statistics.fmean(fp16.values()):.2f} ± {statistics.stdev(fp16.values()):.2f}" in row
    assert f"{statistics.fmean(diffs):+.2f} ± {statistics.stdev(diffs):.2f} (n=3)" in row


def test_a_sweep_skips_runs_whose_result_file_exists(tmp_path, monkeypatch):
    fidelity = load_fidelity()
    done = fidelity.result_path(tmp_path, "bert", "fp32", 7)
    done.write_text(json.dumps(record("bert", "fp32", 7, **{"accuracy %": 90.0, "F1 %": 90.0})))
    ran = []

    def fake_run(recipe, precision, seed, threads, cache):
        ran.append((recipe, precision, seed))
        return {
            **record(recipe, precision, seed, **{"accuracy %": 1.0, "F1 %": 1.0}),
            "process_wall_s": 0.0,
            "load_before": [0.0, 0.0, 0.0],
        }

    monkeypatch.setattr(fidelity, "run_one", fake_run)
    argv = ["--recipes", "bert", "--precisions", "fp32", "fp16", "--seeds", "7"]
    argv += ["--results", str(tmp_path), "--output", str(tmp_path / "s.md")]
    assert fidelity.main(argv) == 0
    assert ran == [("bert", "fp16", 7)]
    assert fidelity.result_path(tmp_path, "bert", "fp16", 7).is_file()
    summary = (tmp_path / "s.md").read_text()
    assert f"- command: `python -m benchmarks run fidelity {' '.join(argv)}`" in summary
    assert "| bert | accuracy % | fp16 | 1.00 ± 0.00 (n=1) | -89.00 |" in summary
