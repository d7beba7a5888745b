"""What an export prints besides its report: not the noise of the tracers it drives.

torch's ONNX exporter warns four times that torchvision is not installed; TorchScript's tracer
reads transformers' ``loss_function`` property of a classifier's headless base model, which warns
that the causal-LM loss is the default. Each is dropped by its one message, only while that
format is written, and our own lines still show.
"""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from amp_trainer.export import export_fp16
from tests.helpers.repo import subprocess_env
from tests.helpers.tiny_models import make_tiny_bert

pytestmark = pytest.mark.slow  # a real ONNX export in a subprocess

CLI = [sys.executable, "-m", "amp_trainer.cli"]
FORMATS = ["torchscript", "onnx"]
_LOGGERS = ("torch.onnx._internal.exporter._registration", "transformers.modeling_utils")


def test_exporting_a_classifier_to_torchscript_and_onnx_prints_no_third_party_noise(tmp_path):
    model = tmp_path / "bert"
    make_tiny_bert().save_pretrained(model)
    out = tmp_path / "fp16"
    result = subprocess.run(
        [*CLI, "export", "--model", str(model), "--output", str(out), "--format", *FORMATS],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (out / "model.onnx").is_file() and (out / "model.torchscript.pt").is_file()
    assert "torchvision is not installed" not in result.stderr
    assert "loss_type=None" not in result.stderr and "ForCausalLMLoss" not in result.stderr


def test_the_filters_are_gone_after_an_export_and_other_messages_pass(tmp_path, caplog):
    before = {name: list(logging.getLogger(name).filters) for name in _LOGGERS}
    export_fp16(make_tiny_bert(), tmp_path / "fp16", formats=("torchscript",))
    assert {name: list(logging.getLogger(name).filters) for name in _LOGGERS} == before
    with caplog.at_level(logging.WARNING, logger="transformers.modeling_utils"):
        logging.getLogger("transformers.modeling_utils").warning("`loss_type=None` was set ...")
    assert "`loss_type=None` was set" in caplog.text  # outside an export: shown as ever
