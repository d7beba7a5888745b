#!/usr/bin/env bash
# amp-trainer GPU check: one prepared, blind-safe run for a machine lent a CUDA GPU.
#
#   bash scripts/gpu_check.sh [OUTPUT_DIR]      # default OUTPUT_DIR: benchmarks/gpu/
#
# Runs the parts of the `gpu` benchmark (benchmarks/gpu/, `python -m benchmarks run gpu PART`),
# each under its own timeout, most important first. Measures, on bert-base- and gpt2-sized
# models built from configs (no hub access needed): fp32 / fp16 (DynamicLossScaler) / stock fp16
# (torch GradScaler) / bf16 train throughput and peak memory at batch 32 x seq 128; the `scaler`
# benchmark on CUDA; FP16 inference latency vs FP32; the loss-scale trajectory of a short run;
# AmpTrainer vs stock Trainer (the `trainer` benchmark) when benchmarks/trainer/ and
# amp_trainer/trainer.py exist. Results go to OUTPUT_DIR/gpu-<UTC date>.json and .md, rewritten
# after every part, so a part that fails or times out loses only itself. Under 8 minutes on one
# H100/H200; installs nothing.
#
# Without a usable CUDA device it prints "no CUDA device: nothing measured" and exits 0.

set -u

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${1:-$REPO/benchmarks/gpu}"
PYTHON="${PYTHON:-$(command -v python || command -v python3)}"
# Run the code of this checkout, installed or not.
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# The benchmarks' entry point. `python -m` puts the current folder first on sys.path, so run it
# from the checkout (OUTPUT_DIR made absolute first): no other folder's `benchmarks` can shadow it.
case "$OUT_DIR" in /*) ;; *) OUT_DIR="$PWD/$OUT_DIR" ;; esac
cd "$REPO" || exit 3
BENCH=(-m benchmarks run)

if [ -z "$PYTHON" ]; then
    echo "gpu_check: no python on PATH: nothing measured" >&2
    exit 3
fi
# GPU_CHECK_DRY_RUN_ON_CPU=1 runs every part on the CPU with tiny models: a test of this script,
# not a measurement.
DRY_RUN="${GPU_CHECK_DRY_RUN_ON_CPU:-0}"
if [ "$DRY_RUN" = 1 ]; then
    PART_ARGS=(--device cpu --quick)
    TRAINER_ARGS=(--device cpu --quick)
    why="dry run on CPU (GPU_CHECK_DRY_RUN_ON_CPU=1): tiny models, nothing meaningful measured"
    rc=0
else
    PART_ARGS=(--device cuda)
    TRAINER_ARGS=(--device cuda --model bert-base --batch-size 32 --seq-len 128 --steps 30
        --repeats 2)
    why="$(timeout 60 "$PYTHON" "${BENCH[@]}" gpu cuda-ok 2>&1)"
    rc=$?
fi
if [ "$rc" -eq 10 ]; then
    echo "no CUDA device: nothing measured (${why##*$'\n'})"
    exit 0
elif [ "$rc" -ne 0 ]; then
    echo "gpu_check: the driver cannot run with $PYTHON (exit status $rc): nothing measured" >&2
    echo "$why" >&2
    exit 3
fi
echo "gpu_check: $why"

mkdir -p "$OUT_DIR" || { echo "gpu_check: cannot create $OUT_DIR" >&2; exit 1; }
STAMP="$(date -u +%Y-%m-%dT%H%M%SZ)"
RESULTS="$OUT_DIR/gpu-$STAMP.json"
echo "gpu_check: results -> $RESULTS and ${RESULTS%.json}.md"
failures=0
last_rc=0

# run_part NAME SECONDS COMMAND...: run one part under its own timeout; record a failure.
run_part() {
    local name="$1" limit="$2"
    shift 2
    echo "gpu_check: === $name (limit ${limit}s) ==="
    timeout --kill-after=10 "$limit" "$@"
    local rc=$?
    last_rc=$rc
    if [ "$rc" -ne 0 ]; then
        echo "gpu_check: $name failed (exit status $rc)" >&2
        failures=$((failures + 1))
        "$PYTHON" "${BENCH[@]}" gpu fail --output "$RESULTS" --name "$name" --rc "$rc" || true
    fi
}

# Most important first: a budget overrun cuts the least important part.
run_part loop 150 "$PYTHON" "${BENCH[@]}" gpu loop "${PART_ARGS[@]}" --output "$RESULTS"
run_part scaler 75 "$PYTHON" "${BENCH[@]}" gpu scaler "${PART_ARGS[@]}" --output "$RESULTS"
run_part trajectory 45 "$PYTHON" "${BENCH[@]}" gpu trajectory "${PART_ARGS[@]}" --output "$RESULTS"
run_part export 45 "$PYTHON" "${BENCH[@]}" gpu export "${PART_ARGS[@]}" --output "$RESULTS"

if [ -f "$REPO/benchmarks/trainer/bench.py" ] && [ -f "$REPO/amp_trainer/trainer.py" ]; then
    TRAINER_MD="$OUT_DIR/gpu-$STAMP-trainer.md"
    run_part trainer 130 "$PYTHON" "${BENCH[@]}" trainer "${TRAINER_ARGS[@]}" \
        --modes amp-fp16,stock-fp16,amp-fp16-no-norm-hooks,amp-bf16 \
        --output "$TRAINER_MD"
    if [ -f "$TRAINER_MD" ]; then  # written after every run, so also after a timeout
        name=trainer
        [ "$last_rc" -eq 0 ] || name=trainer-partial  # keep the failure record next to it
        "$PYTHON" "${BENCH[@]}" gpu attach --output "$RESULTS" --name "$name" \
            --file "$TRAINER_MD" || true
    fi
else
    echo "gpu_check: trainer part skipped (benchmarks/trainer/ or amp_trainer/trainer.py missing)"
fi

echo "gpu_check: done, $failures part(s) failed; results in:"
ls -l "$OUT_DIR"/gpu-"$STAMP"*
exit $((failures > 0 ? 1 : 0))
