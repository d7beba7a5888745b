"""The exported formats: torch.export ``.pt2`` next to ONNX and TorchScript.

Each format is read back and compared with FP32 like the PyTorch model; ``.pt2`` reloads with
``torch.export.load`` and keeps batch and sequence dynamic; a tracer that cannot capture a model
is a one-line failure in the report (nothing written), not a page of tracer advice; TorchScript,
deprecated by PyTorch, is only touched when asked for.
"""

from __future__ import annotations

import json

import pytest
import torch

from amp_trainer.export import FORMATS, export_fp16, make_sample_batch
from tests.helpers.tiny_models import tiny_bart, tiny_llama, tiny_t5, tiny_vit, tiny_whisper


def test_pt2_is_a_format_and_torchscript_comes_last():
    assert FORMATS == ("safetensors", "pt2", "onnx", "torchscript")


def test_pt2_reloads_with_torch_export_load_and_takes_other_batch_and_sequence_sizes(tmp_path):
    model = tiny_llama().eval()
    report = export_fp16(model, tmp_path / "out", formats=("pt2",))
    assert report.passed and report.parity["pt2"].passed, report.to_markdown()
    assert "model.pt2" in report.files
    assert report.parity["pt2"].max_abs_error == pytest.approx(
        report.parity["pytorch"].max_abs_error, rel=1e-3, abs=1e-6
    )

    program = torch.export.load(str(tmp_path / "out" / "model.pt2"))
    ids = torch.randint(3, 128, (3, 10), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        logits = program.module()(input_ids=ids, attention_mask=mask)  # 8x16 at export
        reference = model(input_ids=ids, attention_mask=mask).logits
    assert logits.dtype == torch.float16 and logits.shape == reference.shape
    assert (logits.float() - reference).abs().max() / reference.abs().max() < 2e-2


@pytest.mark.parametrize("make", [tiny_t5, tiny_whisper, tiny_vit], ids=["t5", "whisper", "vit"])
def test_pt2_of_encoder_decoders_and_vision_models_passes_its_own_parity_row(make, tmp_path):
    torch.manual_seed(0)
    model = make().eval()
    report = export_fp16(model, tmp_path / "out", formats=("pt2",))
    assert report.passed and report.parity["pt2"].passed, report.to_markdown()

    program = torch.export.load(str(tmp_path / "out" / "model.pt2")).module()
    batch = make_sample_batch(model, seed=2)
    fp16 = {k: v.half() if v.is_floating_point() else v for k, v in batch.items()}
    with torch.no_grad():
        logits = program(**fp16)
        reference = model(**batch).logits
    assert logits.dtype == torch.float16
    assert (logits.float() - reference).abs().max() / reference.abs().max() < 2e-2


def test_every_format_of_an_image_model_takes_pixel_values(tmp_path):
    pytest.importorskip("onnxruntime")  # the `export` extra
    report = export_fp16(tiny_vit(), tmp_path / "out", formats=("pt2", "onnx", "torchscript"))
    assert report.passed, report.to_markdown()
    assert sorted(report.parity) == ["onnx", "pt2", "pytorch", "torchscript"]
    assert all(result.nonfinite == 0 for result in report.parity.values())
    assert "TorchScript is deprecated by PyTorch; prefer 'pt2'" in report.notes


def test_a_model_torch_export_cannot_capture_is_a_one_line_failure_and_nothing_is_written(
    tmp_path,
):
    # BART's encoder layer branches on `torch.isfinite(hidden_states).all()` in FP16: a
    # data-dependent branch torch.export (and so ONNX's dynamo exporter) cannot trace.
    report = export_fp16(tiny_bart(), tmp_path / "out", formats=("pt2",))
    assert not report.passed and not report.written
    assert report.parity["pytorch"].passed  # the FP16 model itself is fine
    (failure,) = report.failures
    assert failure.startswith("pt2: cannot capture BartForConditionalGeneration at modeling_bart")
    assert "branches on tensor values" in failure and "\n" not in failure
    assert list(tmp_path.iterdir()) == []

    forced = export_fp16(tiny_bart(), tmp_path / "forced", formats=("pt2",), force=True)
    assert forced.written and "model.pt2" not in forced.files
    on_disk = json.loads((tmp_path / "forced" / "report.json").read_text())
    assert on_disk["failures"] == forced.failures


def test_torchscript_is_not_touched_unless_asked_for(tmp_path, monkeypatch):
    # torch 2.14 warns on torch.jit.save/load ("Please switch to torch.export"); an export that
    # did not ask for TorchScript must not call into torch.jit at all.
    def refuse(*args, **kwargs):
        raise AssertionError("torch.jit used although TorchScript was not asked for")

    for name in ("trace", "save", "load", "script"):
        monkeypatch.setattr(torch.jit, name, refuse)
    report = export_fp16(tiny_llama(), tmp_path / "out", formats=("pt2",))
    assert report.passed and not any("TorchScript" in note for note in report.notes)
    with pytest.raises(AssertionError, match=r"torch\.jit used"):
        export_fp16(tiny_llama(), tmp_path / "ts", formats=("torchscript",))


def test_the_cli_offers_every_format_and_marks_torchscript_deprecated(capsys):
    from amp_trainer.cli import build_parser, main

    for fmt in FORMATS:  # the CLI's choices are export.FORMATS (written out: no torch import)
        argv = ["export", "--model", "m", "--output", "o", "--format", fmt]
        assert build_parser().parse_args(argv).formats == [fmt]
    assert main(["export", "--help"]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert "pt2 (torch.export)" in shown and "torchscript (deprecated by PyTorch: use pt2)" in shown


def test_the_cli_writes_a_pt2_export(tmp_path, capsys):
    from amp_trainer.cli import main

    tiny_llama().save_pretrained(tmp_path / "llama")
    argv = ["export", "--model", str(tmp_path / "llama"), "--output", str(tmp_path / "out")]
    assert main([*argv, "--format", "pt2"]) == 0
    assert (tmp_path / "out" / "model.pt2").is_file()
    assert "| pt2 |" in capsys.readouterr().out
