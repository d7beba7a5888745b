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
