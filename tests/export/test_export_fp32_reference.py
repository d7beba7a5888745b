"""The FP16 export's parity reference is a real FP32 forward.

A model that went through ``Accelerator.prepare()`` (``trainer.model`` after training) keeps
Accelerate's autocast forward wrapper. Through it, the "FP32" reference ran in FP16 and the
report compared FP16 with FP16 (max abs error 0.0 on a trained BERT).
"""

from __future__ import annotations

import copy

import pytest
import torch

from amp_trainer import AmpAccelerator, export_fp16
from tests.helpers.tiny_models import make_tiny_bert


def test_parity_is_against_fp32_even_when_the_model_keeps_the_autocast_wrapper(tmp_path):
    clean = make_tiny_bert()
    with torch.no_grad():  # logits large enough that FP16 rounding shows
        clean.classifier.weight.mul_(50.0)
    model = copy.deepcopy(clean)
    model = AmpAccelerator(mixed_precision="fp16", cpu=True).prepare(model)
    assert "_original_forward" in model.__dict__  # the wrapper a trained model keeps

    wrapped = export_fp16(model, tmp_path / "wrapped").parity["pytorch"]
    plain = export_fp16(clean, tmp_path / "plain").parity["pytorch"]

    assert plain.max_abs_error > 0.0
    assert wrapped.max_abs_error == pytest.approx(plain.max_abs_error, rel=1e-3)
    assert "_original_forward" in model.__dict__  # the caller's model is left as it was
