"""The doctor's FP32 fix for an FP16-unfriendly layer names every module that must be FP32, and
says whether rerunning with those islands was finite."""

from __future__ import annotations

import math

import torch
from torch import nn

from amp_trainer.doctor import Verdict, diagnose
from amp_trainer.islands import keep_in_fp32
from tests.helpers.tiny_models import bert_batch, make_tiny_bert

FIRST = "bert.encoder.layer.0.intermediate.dense"
SECOND = "bert.encoder.layer.0.output.dense"


def _huge_activation_bert() -> nn.Module:
    """A tiny BERT whose first feed-forward Linear puts out values past 65504: in FP32 that
    output is finite, and the next Linear (its reader) overflows FP16 in turn."""
    model = make_tiny_bert()
    with torch.no_grad():
        model.get_submodule(FIRST).weight.mul_(5e5)
    return model


def _fp16_forward_loss(model: nn.Module) -> float:
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        return float(model(**bert_batch()).loss)


def test_two_modules_overflowing_one_after_the_other_are_both_named_and_the_fix_is_finite():
    model = _huge_activation_bert()
    diagnosis = diagnose(model, bert_batch(), steps=2)

    assert diagnosis.verdict is Verdict.FP16_UNFRIENDLY_LAYER
    assert diagnosis.culprit == FIRST
    assert diagnosis.fp32_modules == (FIRST, SECOND)
    assert f"fp32_modules=[{FIRST!r}, {SECOND!r}]" in diagnosis.suggestion
    assert "2 modules must compute in FP32" in diagnosis.explanation

    # The first module alone, as a one-module fix would have it: the next Linear overflows.
    only_first = _huge_activation_bert()
    keep_in_fp32(only_first, diagnosis.fp32_modules[:1])
    assert not math.isfinite(_fp16_forward_loss(only_first))

    # The fix as the doctor states it, through the library's own mechanism: finite.
    fixed = _huge_activation_bert()
    keep_in_fp32(fixed, list(diagnosis.fp32_modules))
    assert math.isfinite(_fp16_forward_loss(fixed))

    # ...and the doctor says it checked exactly that, with the AMP steps it ran.
    check = diagnosis.fix_check
    assert check is not None and check.ok and len(check.losses) == 2
    assert all(math.isfinite(loss) for loss in check.losses)
    assert diagnosis.fix_confirmed is True
    assert "Confirmed: rerun with these 2 FP32 islands" in diagnosis.suggestion
    assert diagnosis.to_dict()["fix_confirmed"] is True
    assert "fix check:" in str(diagnosis)


class _SquaresItsInput(nn.Module):
    """No parameters: ``x @ x.T``, which autocast runs in FP16 whatever dtype ``x`` has."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ x.transpose(-1, -2)


class _OverflowNoIslandFixes(nn.Module):
    """A Linear with huge weights, then a parameter-free FP16 matmul of its output: keeping the
    Linear in FP32 leaves that matmul overflowing, and it has no module of its own to keep."""

    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(8, 8)
        self.square = _SquaresItsInput()
        self.head = nn.Linear(4, 2)
        with torch.no_grad():
            self.big.weight.mul_(1e5)

    def forward(self, features: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        squared = self.square(self.big(features))
        logits = self.head(squared[:, :, :4].mean(dim=1) * 1e-12)
        return {"loss": nn.functional.cross_entropy(logits.float(), labels)}


def test_a_fix_that_the_rerun_does_not_confirm_says_so():
    torch.manual_seed(0)
    batch = {"features": torch.randn(4, 6, 8), "labels": torch.tensor([0, 1, 0, 1])}
    diagnosis = diagnose(_OverflowNoIslandFixes(), batch, steps=2)

    assert diagnosis.verdict is Verdict.FP16_UNFRIENDLY_LAYER
    assert diagnosis.fp32_modules == ("big",)
    assert diagnosis.fix_confirmed is False
    assert "Could not confirm" in diagnosis.suggestion
    assert "Confirmed" not in diagnosis.suggestion


def test_verdicts_without_an_fp32_fix_carry_no_islands_and_no_check():
    diagnosis = diagnose(make_tiny_bert(), bert_batch(), steps=2)
    assert diagnosis.verdict is Verdict.HEALTHY
    assert diagnosis.fp32_modules == () and diagnosis.fix_check is None
    assert diagnosis.fix_confirmed is None
    assert "fix check:" not in str(diagnosis)
