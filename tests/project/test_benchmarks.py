"""The benchmarks run and print well-formed tables (structure only: never timing)."""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from types import ModuleType

import pytest
import torch

from tests.helpers.repo import REPO_ROOT, subprocess_env

GPU_CHECK = REPO_ROOT / "scripts" / "gpu_check.sh"


def _load_topic(name: str) -> ModuleType:
    """A topic's module, ``benchmarks/<name>/bench.py``, as ``python -m benchmarks run`` runs it."""
    return importlib.import_module(f"benchmarks.{name}.bench")


def _run(*command: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(command),
        cwd=REPO_ROOT,
        env=subprocess_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _table_rows(output: str, first_header: str) -> tuple[list[str], list[list[str]]]:
    """The header and data rows of the Markdown table whose first column is ``first_header``."""
    lines = [line for line in output.splitlines() if line.startswith("|")]
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |"))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    assert set(lines[start + 1].strip("|").split("|")) == {"---"}
    rows = []
    for line in lines[start + 2 :]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) != len(header):
            break
        rows.append(cells)
    return header, rows


TOPICS = sorted(path.parent.name for path in (REPO_ROOT / "benchmarks").glob("*/bench.py"))


def test_list_names_every_benchmark_folder_with_what_it_measures():
    done = _run(sys.executable, "-m", "benchmarks", "list")

    assert done.returncode == 0, done.stderr
    listed = [line.split()[0] for line in done.stdout.splitlines()[: len(TOPICS)]]
    assert listed == TOPICS
    assert {
        "clip", "fidelity", "gpu", "islands", "mismatch", "recipes", "scaler", "trainer",
        "underflow",
    } <= set(TOPICS)  # fmt: skip
    first_line = _load_topic("scaler").__doc__.split("\n")[0]
    width = max(map(len, TOPICS))
    assert f"{'scaler':<{width}}  {first_line}" in done.stdout


def test_run_of_an_unknown_benchmark_fails_and_names_the_valid_ones(capsys):
    main = importlib.import_module("benchmarks.__main__").main

    assert main(["run", "scalar"]) == 2

    err = capsys.readouterr().err
    assert "unknown benchmark 'scalar': valid are " + ", ".join(TOPICS) in err


@pytest.mark.parametrize("topic", TOPICS)
def test_each_benchmark_has_help_under_the_command_a_user_types(topic, capsys):
    with pytest.raises(SystemExit) as exit_:
        _load_topic(topic).main(["--help"])

    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: python -m benchmarks run {topic} ")


@pytest.mark.parametrize("topic", TOPICS)
def test_each_benchmark_folder_has_a_readme_with_the_command_that_reproduces_its_results(topic):
    readme = REPO_ROOT / "benchmarks" / topic / "README.md"

    text = readme.read_text()
    assert f"python -m benchmarks run {topic}" in text
    assert "```bash" in text


def test_quick_sets_small_defaults_that_a_flag_given_explicitly_overrides():
    bench_scaler = _load_topic("scaler")

    quick = bench_scaler.parse_args(["--quick", "--repeats", "5"])
    full = bench_scaler.parse_args([])

    assert (quick.size, quick.repeats, quick.warmup) == (20_000, 5, 0)
    assert (full.size, full.repeats, full.warmup) == (None, 15, 2)
    assert quick.command == "python -m benchmarks run scaler --quick --repeats 5"


# What benchmarks/machine.py's format_machine writes: CPU model and flags, cores, load, commit.
MACHINE_LINE = re.compile(
    r"CPU .+? \((?!flags unknown)[^)]*\), torch capability \S+, native BF16: \w+; "
    r"\d+ logical cores, \S+ usable; load average [\d. ]+; GPU: .*; commit [0-9a-f]{7,}"
)
NOT_RECORDED = "> **Not recorded by this run:** "
RESULT_FILES = sorted(
    path
    for path in (REPO_ROOT / "benchmarks").glob("*/**/*")
    if path.suffix in (".md", ".json", ".jsonl") and path.name != "README.md"
)


def test_every_result_file_names_cpu_flags_cores_load_and_commit_or_says_what_it_lacks():
    assert len(RESULT_FILES) >= 40  # the results are where this test looks
    incomplete = []
    for path in RESULT_FILES:
        text = path.read_text()
        if path.suffix == ".md":
            complete = bool(MACHINE_LINE.search(text)) or text.startswith(NOT_RECORDED)
        else:
            record = json.loads(text.splitlines()[0] if path.suffix == ".jsonl" else text)
            machine = record.get("machine") or record.get("meta", {}).get("machine") or {}
            named = {"cpu", "cpu_flags", "cores", "load_average", "git"} <= set(machine)
            complete = named or bool(record.get("not_recorded"))
        if not complete:
            incomplete.append(str(path.relative_to(REPO_ROOT)))
    assert not incomplete, (
        f"result files without the machine line or a not-recorded note: {incomplete}"
    )


def test_describe_machine_records_cpu_cores_load_and_commit_of_this_machine():
    machine = importlib.import_module("benchmarks.machine")

    info = machine.describe_machine()

    assert info["cpu"] and info["cpu"] != "unknown"
    assert info["cores"] == os.cpu_count()
    if hasattr(os, "sched_getaffinity"):
        assert info["usable_cores"] == len(os.sched_getaffinity(0))
    assert len(info["load_average"]) == 3 and all(v >= 0 for v in info["load_average"])
    assert set(info["cpu_flags"] or []) <= set(machine.CPU_FLAGS)
    if (REPO_ROOT / ".git").exists() and shutil.which("git"):  # a checkout (worktree: a file)
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True
        )
        assert info["git"]["commit"] == head.stdout.strip()
        assert isinstance(info["git"]["dirty"], bool)
    assert info["torch"] == torch.__version__ and info["torch_threads"] >= 1
    line = machine.format_machine(info)
    assert info["cpu"] in line and "load average" in line and "logical cores" in line
    if info["cpu_flags"] is not None and info["git"] is not None:
        assert MACHINE_LINE.search(line), line  # what the result-file check looks for


def test_a_child_process_imports_this_checkout_and_its_wall_time_and_load_are_recorded(tmp_path):
    child = importlib.import_module("benchmarks.child")
    env = child.repo_env(PYTHONPATH="elsewhere", AMP_TRAINER_CACHE=str(tmp_path))
    assert env["PYTHONPATH"].split(os.pathsep) == [str(REPO_ROOT), "elsewhere"]
    script = "import amp_trainer, os, time; time.sleep(0.3)\n"
    script += "print(amp_trainer.__file__, os.environ['AMP_TRAINER_CACHE'])"

    proc, timing = child.timed_run([sys.executable, "-c", script], tmp_path, env)

    assert proc.returncode == 0, proc.stderr
    module, cache = proc.stdout.split()
    assert module == str(REPO_ROOT / "amp_trainer" / "__init__.py") and cache == str(tmp_path)
    assert timing["wall_s"] >= 0.3
    assert len(timing["load_before"]) == len(timing["load_after"]) == 3


@pytest.mark.skipif(shutil.which("bash") is None, reason="gpu_check.sh is a bash script")
def test_gpu_check_without_cuda_exits_cleanly_and_says_nothing_was_measured(tmp_path):
    # CUDA_VISIBLE_DEVICES="" hides any GPU, so this holds on a GPU machine too.
    done = _run("bash", str(GPU_CHECK), str(tmp_path), CUDA_VISIBLE_DEVICES="")

    assert done.returncode == 0, done.stderr
    assert "no CUDA device: nothing measured" in done.stdout
    assert list(tmp_path.iterdir()) == []


def test_gpu_check_driver_writes_json_and_markdown_after_a_part(tmp_path):
    gpu_check = _load_topic("gpu")
    results = tmp_path / "gpu.json"

    gpu_check.main(["trajectory", "--output", str(results), "--device", "cpu", "--quick"])

    part = json.loads(results.read_text())["parts"]["trajectory"]
    assert part["status"] == "ok"
    steps = part["result"]["trajectory"]
    assert [s["step"] for s in steps] == list(range(len(steps)))
    assert all(s["scale"] > 0 for s in steps)
    assert "## trajectory (ok" in results.with_suffix(".md").read_text()


def test_gpu_check_driver_keeps_a_failed_parts_reason_next_to_earlier_results(tmp_path):
    gpu_check = _load_topic("gpu")
    results = tmp_path / "gpu.json"
    gpu_check.save_part(results, "scaler", {"status": "ok", "seconds": 1.0, "result": {}})

    gpu_check.main(["fail", "--output", str(results), "--name", "loop", "--rc", "124"])

    parts = json.loads(results.read_text())["parts"]
    assert parts["scaler"]["status"] == "ok"
    assert parts["loop"] == {"status": "failed", "reason": "timed out", "seconds": 0.0}
    assert "Incomplete: timed out" in results.with_suffix(".md").read_text()


def test_bench_scaler_prints_one_row_per_optimizer_and_step_kind(tmp_path, capsys):
    bench_scaler = _load_topic("scaler")
    report = tmp_path / "scaler.md"

    argv = ["--size", "2e4", "--repeats", "2", "--warmup", "0", "--output", str(report)]
    assert bench_scaler.main(argv) == 0

    out = capsys.readouterr().out
    header, rows = _table_rows(out, "optimizer")
    assert header[:3] == ["optimizer", "step", "bare step ms"]
    assert "ours/torch" in header and header[-1] == "bar"
    assert [(r[0], r[1]) for r in rows] == [
        (opt, step)
        for opt in ("sgd", "adamw-foreach", "adamw-fused")
        for step in ("clean", "overflow")
    ]
    assert all(r[-1] in {"ok", "~", "MISS"} for r in rows)
    assert "torch threads: " in out
    assert "Physical floor" in out
    assert report.read_text().strip() == out.split("\nwritten to")[0].strip()


def test_bench_scaler_rejects_a_size_too_small_to_hold_the_model():
    bench_scaler = _load_topic("scaler")

    with pytest.raises(ValueError, match="--size must be >= 1000"):
        bench_scaler.main(["--size", "10"])


def test_bench_step_cost_prints_one_row_per_optimizer_with_the_ratios(tmp_path, capsys):
    bench_step_cost = _load_topic("clip")
    report = tmp_path / "step-cost.md"

    argv = ["--size", "2e4", "--repeats", "2", "--warmup", "0", "--output", str(report)]
    assert bench_step_cost.main(argv) == 0

    out = capsys.readouterr().out
    header, rows = _table_rows(out, "optimizer")
    assert header[:2] == ["optimizer", "bare step ms"]
    assert {"ours/torch unscale+clip", "ours/torch extra", "ours/torch total"} <= set(header)
    assert [r[0] for r in rows] == ["sgd", "adamw-foreach", "adamw-fused"]
    assert "Machine (before): CPU " in out and "load average" in out
    assert report.read_text().strip() == out.strip()
    # The passes alone, and the floor they predict for the exact fold.
    header, rows = _table_rows(out, "pass over every gradient")
    assert [r[0] for r in rows] == [
        "unscale (read + write, inf check)",
        "norm (read)",
        "multiply (read + write)",
    ]
    match = re.search(r"\(unscale \+ norm \+ multiply\) = (\d+\.\d+)\.", out)
    assert match is not None, out
    floor = float(match.group(1))
    assert 0 < floor < 1


def test_bench_step_cost_checks_that_ours_and_torch_step_identically():
    bench_step_cost = _load_topic("clip")
    shapes = bench_step_cost.shapes_for_size(5_000)

    for kind in bench_step_cost.OPTIMIZERS:
        bench_step_cost.check_identical(shapes, kind, 1.0)  # raises if they differ


@pytest.mark.slow
def test_bench_trainer_prints_ampTrainer_against_stock_fp16(tmp_path):
    done = _run(
        sys.executable,
        "-m",
        "benchmarks",
        "run",
        "trainer",
        "--quick",
        "--modes",
        "amp-fp16,stock-fp16,stock-fp16-again",
        "--profile",
        str(tmp_path / "profile"),
        timeout=240,
    )

    assert done.returncode == 0, done.stderr
    header, rows = _table_rows(done.stdout, "mode")
    assert header[:6] == [
        "mode",
        "steps/s",
        "tokens/s",
        "vs stock fp16 (paired)",
        "CPU ms/step",
        "vs stock, CPU time (paired)",
    ]
    by_mode = {r[0]: dict(zip(header, r)) for r in rows}
    assert set(by_mode) == {"amp-fp16", "stock-fp16", "stock-fp16-again"}
    assert by_mode["stock-fp16"]["vs stock fp16 (paired)"] == "1.000x"
    assert by_mode["stock-fp16"]["vs stock, CPU time (paired)"] == "1.000x"
    assert float(by_mode["amp-fp16"]["CPU ms/step"]) > 0
    # The profile: the same model trains the same GEMMs (shapes, dtypes, count) in every mode,
    # which the diff states, for AmpTrainer and for the A/A control alike.
    for mode in by_mode:
        profile = json.loads((tmp_path / "profile" / f"{mode}.json").read_text())
        assert profile["ops"]["aten::mm"]["calls"] > 0
        assert any("Half" in signature for signature in profile["gemm"])
    diff = (tmp_path / "profile" / "diff.md").read_text()
    assert (
        diff.count("the GEMM calls (operator, shapes, dtypes, calls per step) are identical") == 2
    )
    assert "### amp-fp16 vs stock-fp16" in diff and "### stock-fp16-again vs stock-fp16" in diff
    # Both really ran FP16 with a loss scaler, the stock one on accelerate's own fp16 path.
    assert by_mode["amp-fp16"]["scaler (final scale)"].startswith("DynamicLossScaler (")
    assert by_mode["stock-fp16"]["scaler (final scale)"].startswith("GradScaler (")
    assert by_mode["amp-fp16"]["autocast"] == by_mode["stock-fp16"]["autocast"] == "fp16"


def test_bench_trainer_profile_needs_one_repeat():
    bench_trainer = _load_topic("trainer")
    with pytest.raises(SystemExit):
        bench_trainer.parse_args(["--profile", "somewhere", "--repeats", "3"])
    assert bench_trainer.parse_args(["--profile", "somewhere"]).repeats == 1
    assert bench_trainer.parse_args([]).repeats == 3


def test_diff_profiles_says_when_the_gemm_calls_differ(tmp_path):
    bench_trainer = _load_topic("trainer")

    def profile(mm_calls: int, mm_us: float) -> dict:
        return {
            "ops": {
                "aten::mm": {"self_cpu_us": mm_us, "calls": mm_calls},
                "aten::add": {"self_cpu_us": 50.0, "calls": 2},
            },
            "gemm": {"aten::mm [4, 8]x[8, 2] Half,Half": {"self_cpu_us": mm_us, "calls": mm_calls}},
        }

    (tmp_path / "a.json").write_text(json.dumps(profile(2, 1000.0)))
    (tmp_path / "b.json").write_text(json.dumps(profile(3, 1500.0)))
    (tmp_path / "c.json").write_text(json.dumps(profile(2, 1200.0)))

    assert "are DIFFERENT (2 vs 3 per step)" in bench_trainer.diff_profiles(tmp_path, "a", "b")
    text = bench_trainer.diff_profiles(tmp_path, "a", "c")
    assert "are identical (2 vs 2 per step)" in text
    assert "GEMM (aten::mm, aten::addmm, aten::bmm, aten::baddbmm): a 1.0 ms, c 1.2 ms" in text
    assert "everything else: a 0.1 ms (4.8 % of its step), c 0.1 ms (4.0 %)" in text
    assert "| `aten::mm` | 1.00 | 1.20 | +0.20 | 2 | 2 |" in text
