"""What a recipe run reports agrees with the files it describes.

One real run of the BERT recipe (the offline default, a few steps, a checkpoint at the end), read
back three ways:

* the final loss scale: the scale after the last update (what a resume starts from) is the same
  in the summary table, ``metrics.json``, the last log line and the checkpoint's ``scaler.pt``;
* the FP16 parity report compares the export with a real FP32 forward of the same weights: an
  independent computation (the saved FP32 model, never under autocast, against the written
  export, on the same texts) gives the same error;
* the activation memory AMP saves against FP32 (bytes saved for backward in one step, measured
  in each precision) is in the summary and ``metrics.json``.
"""

from __future__ import annotations

import ast
import json
import re
import sys

import pytest
import torch

from amp_trainer import load_fp16_export
from amp_trainer.export import load_model, load_tokenizer, make_sample_batch
from tests.helpers.recipes import BERT, expect_success, run
from tests.helpers.repo import REPO_ROOT

pytestmark = pytest.mark.slow

STEPS = 4
# growth every 2 clean steps: 65536 -> 131072 after step 2 -> 262144 after step 4, so the scale
# a step ran with (131072 at step 4) and the scale after it (262144) differ at the end.
ARGS = [
    "--config",
    str(REPO_ROOT / "configs" / "bert_offline.yaml"),
    "--max_steps",
    str(STEPS),
    "--max_train_samples",
    "64",
    "--max_eval_samples",
    "32",
    "--loss_scale_growth_interval",
    "2",
    "--logging_steps",
    "1",
    "--save_strategy",
    "steps",
    "--save_steps",
    str(STEPS),
    "--eval_strategy",
    "no",
]


@pytest.fixture(scope="module")
def bert_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("truth") / "r"
    cache = tmp_path_factory.mktemp("cache")
    command = [sys.executable, BERT, *ARGS, "--output_dir", str(out)]
    result = expect_success(run(command, str(cache), timeout=300))
    return out, result.stdout + result.stderr


def table_value(output: str, row: str) -> str:
    """The value cell of a summary-table row (``| name | value |``)."""
    match = re.search(rf"^\| {re.escape(row)}\s*\|\s*(.*?)\s*\|$", output, re.MULTILINE)
    assert match is not None, f"no row {row!r} in the summary:\n{output[-3000:]}"
    return match.group(1)


def last_logged(output: str, key: str) -> float:
    """``key`` in the last training log line that has it (the Trainer prints dicts)."""
    values = []
    for line in output.splitlines():
        line = line.strip()
        if line.startswith("{") and f"'{key}'" in line:
            values.append(float(ast.literal_eval(line)[key]))
    assert values, f"no log line with {key!r}"
    return values[-1]


def test_the_final_loss_scale_is_the_same_in_summary_metrics_log_and_checkpoint(bert_run):
    out, output = bert_run
    scaler = torch.load(out / f"checkpoint-{STEPS}" / "scaler.pt", weights_only=True)
    resumed_from = float(scaler["scale"])
    metrics = json.loads((out / "metrics.json").read_text())

    assert resumed_from == 2.0**18  # grew after step 2 and after step 4
    assert metrics["loss_scale"]["final"] == resumed_from
    # The Trainer prints floats to 4 significant digits ('loss_scale': 2.621e+05).
    assert last_logged(output, "loss_scale") == pytest.approx(resumed_from, rel=1e-3)
    summary = table_value(output, "loss scale final (after the last update)")
    assert float(summary) == resumed_from
    # The scale the last step ran with is still there, under its own name.
    assert metrics["loss_scale"]["last_step_ran_with"] == 2.0**17


def test_the_parity_report_is_fp16_export_against_a_real_fp32_forward(bert_run):
    out, _ = bert_run
    metrics = json.loads((out / "metrics.json").read_text())
    report = json.loads((out / "fp16_export_report.json").read_text())
    texts = metrics["fp16_export_sample_texts"]
    assert len(texts) == 8

    fp32 = load_model(out).eval()
    fp16 = load_fp16_export(out / "fp16_export").eval()
    tokenizer = load_tokenizer(out)
    batch = make_sample_batch(fp32, tokenizer, texts)
    assert not torch.is_autocast_enabled("cpu")
    with torch.no_grad():
        reference = fp32(**batch).logits.float()
        exported = fp16(**batch).logits.float()
    independent = float((exported - reference).abs().max())

    reported = report["parity"]["pytorch"]["max_abs_error"]
    assert independent > 0.0  # FP16 weights never reproduce FP32 logits exactly
    assert reported == pytest.approx(independent, rel=1e-3, abs=1e-7)


def test_activation_memory_saved_against_fp32_is_reported(bert_run):
    out, output = bert_run
    memory = json.loads((out / "metrics.json").read_text())["memory"]
    saved = memory["activations_saved_for_backward"]

    assert saved["fp32_bytes"] > saved["fp16_bytes"] > 0
    assert saved["fp16_over_fp32"] == pytest.approx(saved["fp16_bytes"] / saved["fp32_bytes"])
    assert 0.4 < saved["fp16_over_fp32"] < 0.95  # FP16 activations, FP32 norms and masks
    shown = table_value(output, "activation memory fp16 / fp32 (saved for backward)")
    assert shown.startswith(f"{saved['fp16_over_fp32']:.2f}x")


def test_the_underflow_check_is_the_same_in_summary_metrics_and_log(bert_run):
    """The recipe's first step is checked: one figure, the same in all three places."""
    out, output = bert_run
    checks = json.loads((out / "metrics.json").read_text())["underflow_checks"]
    assert [c["step"] for c in checks] == [1]
    share = checks[0]["grad_underflow"]
    assert 0.0 <= share <= 1.0
    assert last_logged(output, "grad_underflow") == pytest.approx(share, rel=1e-3, abs=1e-6)
    assert table_value(output, "gradient underflow (last check)").startswith(
        f"{100 * share:.2f}%, headroom {checks[0]['grad_headroom']:.1f} doublings "
        "(logged at step 1; 1 check(s))"
    )


def test_the_export_row_gives_the_positions_and_says_the_evidence_is_thin(bert_run):
    """The summary's parity row carries the positions the written report compared and says that
    they are thin evidence, as the report does: a sequence classifier compares one position per
    sentence, and the recipe's 8 export texts are far fewer than the top-1 threshold needs
    (3 / (1 - 0.98) = 150 by the rule of three). ``metrics.json`` holds the report's reasons."""
    out, output = bert_run
    metrics = json.loads((out / "metrics.json").read_text())
    report = json.loads((out / "fp16_export_report.json").read_text())
    positions = min(result["positions"] for result in report["parity"].values())
    assert positions == len(metrics["fp16_export_sample_texts"]) == 8
    assert report["passed"] and metrics["fp16_export_passed"]
    assert (
        report["thin_evidence"] and metrics["fp16_export_thin_evidence"] == report["thin_evidence"]
    )
    assert table_value(output, "fp16 export parity") == (
        "passed on thin evidence (8 positions; fp16_export/report.md says why)"
    )
    assert "thin evidence" in (out / "fp16_export" / "report.md").read_text()
