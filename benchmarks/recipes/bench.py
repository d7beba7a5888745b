"""Wall time of each recipe's offline default, as a new user runs it, with the machine it ran on.

Each run is exactly the README's command, ``accelerate launch recipes/finetune_X.py`` with no
arguments, in a fresh empty working directory (so ``runs/`` starts empty) with a fresh tokenizer
cache (``AMP_TRAINER_CACHE`` in a new temporary folder: the tokenizer is trained, as on a first
run). The wall time is the whole process: the launcher, imports, data, tokenizer training,
training, evaluation, the FP16 export with its parity check and the plot. Next to it: the CPU
model, core count, load average before and after, and the recipe's own phase times
(``phase_seconds`` in its metrics.json), plus the checks the defaults promise: the loss scale
grew, at least one step was skipped on overflow, BERT accuracy >= 85 %, GPT-2 perplexity far
below the untrained model's (at most a third of it), and a wall time of at most 90 s.

The machine is shared: read the load average column before trusting a time. One command reruns
everything and rewrites ``benchmarks/recipes/cpu-recipes.md`` (and ``.json``)::

    python -m benchmarks run recipes                  # both recipes, 1 run each
    python -m benchmarks run recipes --repeats 3      # median of 3
    python -m benchmarks run recipes --recipes bert --output /tmp/bench.md

There is no ``--quick``: a recipe's default run is what is measured, and a shorter one would
neither meet its checks nor time anything a user runs.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import shutil
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from amp_trainer.atomic_files import write_text_atomic
from benchmarks import cli
from benchmarks.child import repo_env, timed_run
from benchmarks.machine import REPO, describe_machine, format_machine

RECIPES = {
    "bert": ("recipes/finetune_bert.py", "runs/bert_offline"),
    "gpt2": ("recipes/finetune_gpt2.py", "runs/gpt2_offline"),
}
MAX_WALL_S = 90.0
# The recipes' phase_seconds keys in the order they happen (metrics.json stores them sorted).
PHASES = (
    "data",
    "tokenizer and map",
    "model",
    "evaluate untrained",
    "train",
    "evaluate",
    "save",
    "plot",
    "fp16_export",
    "evaluations in train and after",
)


def accelerate_command() -> str:
    """The ``accelerate`` of this interpreter's environment (a venv's, not the first on PATH)."""
    local = Path(sys.executable).with_name("accelerate")
    return str(local) if local.exists() else (shutil.which("accelerate") or "accelerate")


def run_recipe(recipe: str) -> dict[str, Any]:
    script, output = RECIPES[recipe]
    work = Path(tempfile.mkdtemp(prefix=f"bench-{recipe}-"))
    env = repo_env(AMP_TRAINER_CACHE=str(work / "cache"), HF_HUB_OFFLINE="1")
    cmd = [accelerate_command(), "launch", str(REPO / script)]
    proc, timing = timed_run(cmd, work, env)
    record: dict[str, Any] = {
        "recipe": recipe,
        "command": f"accelerate launch {script}",
        "returncode": proc.returncode,
        "wall_s": round(timing["wall_s"], 1),
        "load_before": timing["load_before"],
        "load_after": timing["load_after"],
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "unset (torch default)"),
    }
    if proc.returncode != 0:
        record["error"] = proc.stderr[-2000:]
        shutil.rmtree(work, ignore_errors=True)
        return record
    metrics = json.loads((work / output / "metrics.json").read_text())
    shutil.rmtree(work, ignore_errors=True)
    scale = metrics.get("loss_scale") or {}
    init = metrics["config"]["training"]["loss_scale_init"]
    record.update(
        recipe_wall_s=round(metrics["wall_time_s"], 1),
        phase_seconds=metrics.get("phase_seconds"),
        skipped_steps=scale.get("skipped"),
        loss_scale_max=scale.get("maximum"),
        scale_grew=bool(scale) and scale.get("maximum", 0) > init,
    )
    if recipe == "bert":
        accuracy = metrics["eval"]["eval_accuracy"]
        record.update(result=f"accuracy {accuracy:.1%}", result_ok=accuracy >= 0.85)
    else:
        after, before = metrics["eval"]["perplexity"], metrics["untrained"]["perplexity"]
        record.update(
            result=f"perplexity {after:.1f} (untrained {before:.1f})",
            result_ok=after <= before / 3,
        )
    record["passed"] = (
        record["result_ok"]
        and record["scale_grew"]
        and (record["skipped_steps"] or 0) >= 1
        and timing["wall_s"] <= MAX_WALL_S
    )
    return record


def report(records: list[dict[str, Any]], info: dict[str, Any], argv: Sequence[str]) -> str:
    lines = [
        "# Recipe wall times (offline defaults, whole process)",
        "",
        f"- command: `{cli.command('recipes', argv)}`",
        f"- date: {_dt.datetime.now(_dt.timezone.utc).isoformat(timespec='seconds')}",
        f"- machine: {format_machine(info)}",
        f"- OMP_NUM_THREADS: {os.environ.get('OMP_NUM_THREADS', 'unset (torch default)')}",
        "- each run: `accelerate launch recipes/finetune_X.py` in an empty folder, fresh tokenizer "
        f"cache; pass = result ok, scale grew, >= 1 skipped step, wall <= {MAX_WALL_S:.0f} s",
        "",
        "| recipe | wall s | in recipe s | result | skipped steps | max loss scale | load before "
        "-> after (1/5/15 min) | pass |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        if r["returncode"] != 0:
            lines.append(f"| {r['recipe']} | {r['wall_s']} | FAILED (exit {r['returncode']}) |||||")
            continue
        load = f"{' '.join(map(str, r['load_before']))} -> {' '.join(map(str, r['load_after']))}"
        lines.append(
            f"| {r['recipe']} | {r['wall_s']} | {r['recipe_wall_s']} | {r['result']} "
            f"| {r['skipped_steps']} | {r['loss_scale_max']:.4g} | {load} "
            f"| {'yes' if r['passed'] else 'no'} |"
        )
    for recipe in RECIPES:
        walls = [r["wall_s"] for r in records if r["recipe"] == recipe and r["returncode"] == 0]
        if len(walls) > 1:
            lines.append(f"\n{recipe}: median wall {statistics.median(walls):.1f} s of {walls}")
    lines += ["", "Phase seconds inside the recipe (after imports), per run:", ""]
    for r in records:
        if r.get("phase_seconds"):
            seconds = r["phase_seconds"]
            phases = ", ".join(f"{k} {seconds[k]}" for k in PHASES if k in seconds)
            lines.append(f"- {r['recipe']}: {phases}")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = cli.topic_parser("recipes", __doc__)
    parser.add_argument("--recipes", nargs="+", choices=sorted(RECIPES), default=list(RECIPES))
    cli.add_repeats(parser, 1, "runs of each recipe (>= 1; the table gives each and the median)")
    cli.add_output(
        parser,
        Path(__file__).resolve().parent / "cpu-recipes.md",
        "write the report here (Markdown), and the runs as JSON next to it",
    )
    args = cli.parse(parser, argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    info = describe_machine()
    records = []
    for _ in range(args.repeats):
        for recipe in args.recipes:
            record = run_recipe(recipe)
            print(json.dumps(record), flush=True)
            records.append(record)
    text = report(records, info, argv)
    write_text_atomic(args.output, text)
    write_text_atomic(
        args.output.with_suffix(".json"),
        json.dumps({"machine": info, "runs": records}, indent=2) + "\n",
    )
    print(text)
    return 0 if all(r.get("passed") for r in records) else 1
