"""AmpTrainingArguments and the precision that `accelerate launch` exports."""

from __future__ import annotations

import pytest

from amp_trainer import AmpTrainingArguments


@pytest.mark.parametrize("launcher", ["fp16", "bf16"])
def test_explicit_fp32_wins_over_the_launchers_mixed_precision(launcher, monkeypatch, tmp_path):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", launcher)
    args = AmpTrainingArguments(output_dir=str(tmp_path), precision="fp32", use_cpu=True)
    assert args.precision == "fp32"
    assert args.mixed_precision == "no"
    assert not args.fp16 and not args.bf16


def test_auto_follows_the_launchers_fp16(monkeypatch, tmp_path):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    args = AmpTrainingArguments(output_dir=str(tmp_path), use_cpu=True)
    assert args.precision == "fp16" and args.fp16 and args.mixed_precision == "fp16"


def test_flags_win_over_the_launcher(monkeypatch, tmp_path):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    args = AmpTrainingArguments(output_dir=str(tmp_path), bf16=True, use_cpu=True)
    assert args.precision == "bf16" and args.mixed_precision == "bf16"


def test_auto_on_a_bf16_cpu_without_use_cpu_says_why_it_trains_fp32(monkeypatch, tmp_path, caplog):
    """A CPU with BF16 and no accelerator: "auto" resolves to bf16, which TrainingArguments refuses
    on a CPU without use_cpu=True, so it trains fp32; the line says so and how to get bf16 (it
    used to read "picked fp32 here" right after "picked bf16", which contradicted itself)."""
    import logging

    import amp_trainer.training_args as training_args

    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    monkeypatch.setattr(training_args, "resolve_precision", lambda requested, device: "bf16")
    monkeypatch.setattr(training_args, "is_torch_bf16_gpu_available", lambda: False)
    monkeypatch.setattr(training_args, "is_torch_xla_available", lambda: False)
    with caplog.at_level(logging.INFO, logger="amp_trainer"):
        args = AmpTrainingArguments(output_dir=str(tmp_path), precision="auto", report_to=[])
    assert args.precision == "fp32"
    said = [r.getMessage() for r in caplog.records if "precision='auto'" in r.getMessage()]
    assert said == [
        "precision='auto' trains in fp32 after all: transformers allows bf16 on a CPU only with "
        "use_cpu=True (--use_cpu true), which gives the bf16 above"
    ]
