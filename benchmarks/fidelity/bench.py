"""FP16 fidelity of the recipes: their offline defaults in fp32, fp16 and bf16, several seeds.

The claim behind amp-trainer is that FP16 with a dynamic loss scaler keeps FP32's accuracy. This
script measures it on the two recipes as shipped (``configs/bert_offline.yaml``,
``configs/gpt2_offline.yaml``): every (recipe, precision, seed) is one subprocess running the
recipe with only ``--precision``, ``--seed`` and ``--output_dir`` changed, and the result is
written to its own JSON file in ``--results`` as soon as the run ends. A rerun skips every run
whose file exists, so an interrupted sweep resumes where it stopped and partial results survive;
``--summary-only`` prints the table from whatever is there.

The table gives mean ± sample standard deviation over seeds of BERT's validation accuracy and F1
and GPT-2's validation perplexity, and the fp16 - fp32 (and bf16 - fp32) difference, both as the
difference of the means and as mean ± sd of the per-seed paired differences (same seed = same
initial weights and data order, so the pairing removes most of the seed noise).

Runs are serial and single-threaded by default (``--threads 1``: on a shared 2-core machine two
intra-op threads lose more to waiting for each other than they gain); the thread count, CPU model,
core count and load average before and after each run are stored with its result.

Usage::

    python -m benchmarks run fidelity                  # 2 recipes x 3 precisions x 3 seeds
    nice -n 15 python -m benchmarks run fidelity > /tmp/fidelity.log 2>&1 &   # in the background
    python -m benchmarks run fidelity --summary-only   # table from the results so far
    python -m benchmarks run fidelity --recipes bert --precisions fp32 fp16 --seeds 1 2

There is no ``--quick``: a run is a recipe's whole default run, and a shorter one would measure
a different training.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import statistics
import sys
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from amp_trainer.atomic_files import write_text_atomic
from benchmarks import cli
from benchmarks.child import repo_env, timed_run
from benchmarks.machine import REPO, describe_machine, format_machine

HERE = Path(__file__).resolve().parent
RECIPES = {"bert": "recipes/finetune_bert.py", "gpt2": "recipes/finetune_gpt2.py"}
PRECISIONS = ("fp32", "fp16", "bf16")
SEEDS = (42, 43, 44)
# What each recipe is judged on: (name in the table, how to read it from metrics.json).
METRICS = {
    "bert": (
        ("accuracy %", ("eval", "eval_accuracy"), 100.0),
        ("F1 %", ("eval", "eval_f1"), 100.0),
    ),
    "gpt2": (("perplexity", ("eval", "perplexity"), 1.0),),
}


def result_path(results: Path, recipe: str, precision: str, seed: int) -> Path:
    return results / f"{recipe}-{precision}-seed{seed}.json"


def _dig(data: dict[str, Any], keys: Sequence[str]) -> Any:
    for key in keys:
        data = data.get(key) if isinstance(data, dict) else None
    return data


def run_one(recipe: str, precision: str, seed: int, threads: int, cache: str) -> dict[str, Any]:
    """Run one recipe default in a subprocess and return what its metrics.json says."""
    with tempfile.TemporaryDirectory(prefix=f"fidelity-{recipe}-") as out:
        cmd = [sys.executable, str(REPO / RECIPES[recipe]), "--precision", precision]
        cmd += ["--seed", str(seed), "--output_dir", out, "--disable_tqdm", "true"]
        env = repo_env(AMP_TRAINER_CACHE=cache, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        if threads > 0:
            env["OMP_NUM_THREADS"] = str(threads)
        proc, timing = timed_run(cmd, REPO, env)
        record: dict[str, Any] = {
            "recipe": recipe,
            "precision": precision,
            "seed": seed,
            "threads": threads or "torch default",
            "command": " ".join(cmd[1:]),
            "returncode": proc.returncode,
            "process_wall_s": round(timing["wall_s"], 1),
            "load_before": timing["load_before"],
            "load_after": timing["load_after"],
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        }
        if proc.returncode != 0:
            record["error"] = proc.stderr[-2000:]
            return record
        metrics = json.loads((Path(out) / "metrics.json").read_text())
    for name, keys, factor in METRICS[recipe]:
        value = _dig(metrics, keys)
        record[name] = None if value is None else value * factor
    record["loss_scale"] = metrics.get("loss_scale")
    record["tokenizers"] = {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()[:16]
        for p in sorted((Path(cache) / "tokenizers").glob("*.json"))
    }
    record["train_runtime_s"] = _dig(metrics, ("train", "train_runtime"))
    return record


def mean_sd(values: Iterable[float]) -> tuple[float, float, int]:
    """Mean, sample standard deviation (0 for one value) and count."""
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return math.nan, math.nan, 0
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return statistics.fmean(values), sd, len(values)


def fmt(mean: float, sd: float, n: int, digits: int) -> str:
    if n == 0:
        return "-"
    return f"{mean:.{digits}f} ± {sd:.{digits}f} (n={n})"


def load_results(results: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(results.glob("*-seed*.json"))]


def summarize(records: list[dict[str, Any]]) -> str:
    """The Markdown table: per recipe, metric and precision, mean ± sd; differences to fp32."""
    ok = [r for r in records if r.get("returncode") == 0]
    lines = [
        "| recipe | metric | precision | mean ± sd over seeds | minus fp32 (means) "
        "| minus fp32, paired by seed | relative to fp32 |",
        "|---|---|---|---|---|---|---|",
    ]
    for recipe in RECIPES:
        for name, _, _ in METRICS[recipe]:
            by = {
                p: {r["seed"]: r[name] for r in ok if r["recipe"] == recipe and r["precision"] == p}
                for p in PRECISIONS
            }
            base_mean, _, base_n = mean_sd(by["fp32"].values())
            digits = 1 if name == "perplexity" else 2
            for precision in PRECISIONS:
                mean, sd, n = mean_sd(by[precision].values())
                diff = paired = rel = "-"
                if precision != "fp32" and n and base_n:
                    diff = f"{mean - base_mean:+.{digits}f}"
                    seeds = sorted(set(by[precision]) & set(by["fp32"]))
                    d_mean, d_sd, d_n = mean_sd(by[precision][s] - by["fp32"][s] for s in seeds)
                    if d_n:
                        paired = f"{d_mean:+.{digits}f} ± {d_sd:.{digits}f} (n={d_n})"
                    rel = f"{(mean - base_mean) / base_mean * 100:+.2f} %"
                lines.append(
                    f"| {recipe} | {name} | {precision} | {fmt(mean, sd, n, digits)} | {diff} "
                    f"| {paired} | {rel} |"
                )
    failed = [r for r in records if r.get("returncode") != 0]
    for r in failed:
        lines.append(f"\nFAILED: {r['recipe']} {r['precision']} seed {r['seed']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = cli.topic_parser("fidelity", __doc__)
    parser.add_argument("--recipes", nargs="+", choices=sorted(RECIPES), default=list(RECIPES))
    parser.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    parser.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    parser.add_argument(
        "--results",
        type=Path,
        default=HERE / "results",
        metavar="DIR",
        help="folder of the results, one JSON per run; existing ones are not rerun (default: "
        f"{cli.shown_path(HERE / 'results')})",
    )
    cli.add_output(parser, HERE / "fidelity.md", "write the summary table here (Markdown)")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS; 0: torch's own")
    parser.add_argument("--summary-only", action="store_true", help="no runs, table only")
    parser.add_argument(
        "--cache",
        type=Path,
        default=Path(tempfile.gettempdir()) / "amp-trainer-fidelity-cache",
        help="AMP_TRAINER_CACHE shared by all runs (keep it to resume with the same tokenizers)",
    )
    args = cli.parse(parser, argv)

    args.results.mkdir(parents=True, exist_ok=True)
    info = describe_machine()
    print(f"machine: {json.dumps(info)}", flush=True)
    if not args.summary_only:
        # One tokenizer for the whole sweep: the first run trains it, the others load it. This
        # matters: `tokenizers`' WordPiece/BPE training is not deterministic (hash-map order
        # breaks ties; huggingface/tokenizers#1794), so a fresh cache per run would change the
        # vocabulary between the runs being compared. Each result records the tokenizer's hash.
        cache = str(args.cache)
        # fp32 and fp16 (the comparison that matters) for every seed first, bf16 (up to 5x
        # slower on CPUs without native BF16) after them, so a partial sweep answers the question.
        groups = [
            [p for p in args.precisions if p != "bf16"],
            [p for p in args.precisions if p == "bf16"],
        ]
        runs = [
            (seed, recipe, precision)
            for group in groups
            for seed in args.seeds
            for recipe in args.recipes
            for precision in group
        ]
        for seed, recipe, precision in runs:
            path = result_path(args.results, recipe, precision, seed)
            if path.is_file():
                continue
            record = run_one(recipe, precision, seed, args.threads, cache)
            record["machine"] = {**info, "load_average": record["load_before"]}
            write_text_atomic(path, json.dumps(record, indent=2) + "\n")
            shown = {k: record.get(k) for k, *_ in METRICS[recipe]}
            print(
                f"{recipe} {precision} seed {seed}: rc={record['returncode']} {shown} "
                f"{record['process_wall_s']} s, load {record['load_before']}",
                flush=True,
            )
    records = load_results(args.results)
    table = summarize(records)
    loads = [r["load_before"][0] for r in records if "load_before" in r]
    header = [
        "# FP16 fidelity of the recipes' offline defaults",
        "",
        f"- command: `{cli.command('fidelity', argv)}` (one subprocess per run, results in "
        f"`{cli.shown_path(args.results)}/`)",
        f"- machine: {format_machine(info)}",
        f"- threads per run: {args.threads or 'torch default'}",
        f"- {len(records)} run(s); 1-min load average before the runs: "
        + (f"{min(loads):.2f}-{max(loads):.2f}" if loads else "-"),
        f"- written {_dt.datetime.now(_dt.timezone.utc).isoformat(timespec='seconds')}",
        "",
    ]
    text = "\n".join(header) + "\n" + table + "\n"
    write_text_atomic(args.output, text)
    print(text)
    return 0
