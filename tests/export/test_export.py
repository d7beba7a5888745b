"""FP16 export: round trip, parity numbers, overflow guard, atomic output, TorchScript, ONNX."""

from __future__ import annotations

import json

import pytest
import torch

from amp_trainer.export import (
    CONFIG_KEY,
    export_fp16,
    load_fp16_export,
    make_sample_batch,
)
from tests.helpers.tiny_models import make_tiny_bert, make_tiny_gpt2

WORDS = [
    "the",
    "a",
    "movie",
    "was",
    "great",
    "bad",
    "film",
    "i",
    "liked",
    "it",
    "not",
    "at",
    "all",
    "good",
    "fun",
    "dull",
    "and",
    "very",
    "plot",
    "actors",
    "story",
    "long",
    "short",
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A real WordPiece tokenizer over a 30-word vocabulary (ids fit the 128-id tiny models)."""
    from transformers import BertTokenizerFast

    folder = tmp_path_factory.mktemp("vocab")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    return BertTokenizerFast(vocab=str(folder / "vocab.txt"))


def overflowing_bert():
    """A tiny BERT whose first FFN up-projection outputs ~1e5 on normal inputs.

    Pure FP32 is fine (the block's closing LayerNorm rescales), but in FP16 that Linear's
    output is inf, and everything after it NaN.
    """
    model = make_tiny_bert()
    with torch.no_grad():
        model.bert.encoder.layer[0].intermediate.dense.weight.mul_(5e5)
    return model


def fp32_logits(model, batch):
    model.eval()
    with torch.no_grad():
        return model(**batch).logits.float()


def test_round_trip_reloads_with_from_pretrained_fp16_and_matches_the_report(tmp_path, tokenizer):
    from transformers import AutoModelForSequenceClassification

    model = make_tiny_bert()
    texts = ["the movie was great", "i liked it not at all", "a long and dull plot"]
    report = export_fp16(model, tmp_path / "out", tokenizer=tokenizer, sample_texts=texts)
    assert report.passed and report.written

    out = tmp_path / "out"
    on_disk = json.loads((out / "report.json").read_text())
    assert on_disk["passed"] is True
    assert on_disk["parity"]["pytorch"]["positions"] == len(texts)
    batch = make_sample_batch(model, tokenizer, texts)
    reference = fp32_logits(model, batch)

    exact = load_fp16_export(out)
    with torch.no_grad():
        logits = exact(**batch).logits
    assert logits.dtype == torch.float16
    error = (logits.float() - reference).abs().max().item()
    assert error == pytest.approx(report.parity["pytorch"].max_abs_error, rel=1e-6, abs=1e-9)
    assert exact.bert.embeddings.LayerNorm.weight.dtype == torch.float32

    # The plain transformers path loads too; it casts the FP32 norms to FP16 (see the module doc)
    # but stays within the report's thresholds on this model.
    plain = AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float16).eval()
    assert plain.bert.embeddings.LayerNorm.weight.dtype == torch.float16
    with torch.no_grad():
        plain_logits = plain(**batch).logits.float()
    assert (plain_logits - reference).abs().max() / reference.abs().max() < 2e-2


def test_report_states_fp16_size_against_the_fp32_source_on_disk(tmp_path):
    model = make_tiny_gpt2()
    model.save_pretrained(tmp_path / "src")
    report = export_fp16(tmp_path / "src", tmp_path / "out")
    source = (tmp_path / "src" / "model.safetensors").stat().st_size
    assert report.source_bytes == source and report.source_bytes_measured
    assert report.export_bytes == (tmp_path / "out" / "model.safetensors").stat().st_size
    assert 0.45 < report.size_ratio < 0.65  # FP16 weights plus the FP32-kept norms
    assert "FP16 vs" in report.to_markdown()


def test_parity_numbers_are_small_nonzero_and_cover_only_real_tokens(tmp_path):
    model = make_tiny_gpt2()
    report = export_fp16(model, tmp_path / "out")
    result = report.parity["pytorch"]
    batch = make_sample_batch(model)  # random valid ids: no tokenizer
    assert result.positions == int(batch["attention_mask"].sum())
    assert 0 < result.max_abs_error < 1e-2
    assert 0 < result.mean_abs_error <= result.max_abs_error
    assert 0 < result.max_rel_error < 1e-2
    assert result.top1_agreement is not None and result.top1_agreement >= 0.98
    assert result.nonfinite == 0


def test_norm_layers_stay_fp32_in_the_saved_weights_and_config(tmp_path):
    from safetensors import safe_open

    report = export_fp16(make_tiny_bert(), tmp_path / "out")
    assert "bert.embeddings.LayerNorm" in report.fp32_modules
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config[CONFIG_KEY]["fp32_modules"] == report.fp32_modules
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as weights:
        assert weights.get_tensor("bert.embeddings.LayerNorm.weight").dtype == torch.float32
        assert weights.get_tensor("bert.pooler.dense.weight").dtype == torch.float16


def test_overflow_guard_keeps_the_overflowing_block_fp32_and_parity_passes(tmp_path):
    model = overflowing_bert()
    unguarded = export_fp16(model, tmp_path / "plain", overflow_guard=False)
    assert not unguarded.passed and unguarded.parity["pytorch"].nonfinite > 0

    report = export_fp16(model, tmp_path / "out")
    assert report.passed, report.to_markdown()
    (guarded,) = report.overflow_guarded_modules
    assert guarded.startswith("bert.encoder.layer.0")
    assert f"`{guarded}`" in report.to_markdown()

    batch = make_sample_batch(model)
    reloaded = load_fp16_export(tmp_path / "out")
    with torch.no_grad():
        logits = reloaded(**batch).logits
    assert torch.isfinite(logits).all()
    assert (logits.float() - fp32_logits(model, batch)).abs().max() < 1e-2


def test_failed_parity_leaves_no_output_folder_and_says_why(tmp_path):
    report = export_fp16(overflowing_bert(), tmp_path / "out", overflow_guard=False)
    assert not report.passed and not report.written
    assert any("non-finite" in reason for reason in report.failures)
    assert "nothing written" in report.to_markdown()
    assert list(tmp_path.iterdir()) == []  # no target, no leftover staging folder


def test_force_writes_a_failed_export_whose_report_says_failed(tmp_path):
    report = export_fp16(overflowing_bert(), tmp_path / "out", overflow_guard=False, force=True)
    assert report.written and not report.passed and report.forced
    on_disk = json.loads((tmp_path / "out" / "report.json").read_text())
    assert on_disk["passed"] is False and on_disk["failures"]
    assert "FAILED" in (tmp_path / "out" / "report.md").read_text()


def test_existing_output_is_refused_unless_overwrite(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="overwrite"):
        export_fp16(make_tiny_gpt2(), tmp_path / "out")
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
    export_fp16(make_tiny_gpt2(), tmp_path / "new")
    with pytest.raises(FileExistsError, match="overwrite"):
        export_fp16(make_tiny_gpt2(), tmp_path / "new")
    export_fp16(make_tiny_gpt2(seed=1), tmp_path / "new", overwrite=True)
    assert (tmp_path / "new" / "model.safetensors").exists()


def test_the_callers_model_is_not_modified(tmp_path):
    model = make_tiny_bert()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    export_fp16(model, tmp_path / "out")
    after = model.state_dict()
    assert all(after[k].dtype == torch.float32 for k in before if before[k].is_floating_point())
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not model._forward_hooks and not model.bert.embeddings.LayerNorm._forward_pre_hooks


def test_torchscript_export_of_gpt2_runs_with_keyword_inputs_and_matches(tmp_path):
    model = make_tiny_gpt2()
    report = export_fp16(model, tmp_path / "out", formats=("torchscript",))
    assert report.parity["torchscript"].passed
    traced = torch.jit.load(str(tmp_path / "out" / "model.torchscript.pt"))
    batch = make_sample_batch(model, seed=1)
    with torch.no_grad():
        logits = traced(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    assert logits.dtype == torch.float16
    mask = batch["attention_mask"].bool()
    reference = fp32_logits(model, batch)
    assert (logits.float()[mask] - reference[mask]).abs().max() < 1e-2


def test_onnx_export_runs_in_onnxruntime_with_its_own_parity_row(tmp_path):
    onnxruntime = pytest.importorskip("onnxruntime")  # the `export` extra
    model = overflowing_bert()  # guarded FP32 island and FP32 norms inside the FP16 graph
    report = export_fp16(model, tmp_path / "out", formats=("onnx",))
    onnx_parity = report.parity["onnx"]
    assert onnx_parity.passed and onnx_parity.nonfinite == 0, report.to_markdown()
    session = onnxruntime.InferenceSession(
        str(tmp_path / "out" / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    batch = make_sample_batch(model, seed=3)  # other ids than the export saw
    feeds = {i.name: batch[i.name].numpy() for i in session.get_inputs()}
    (logits,) = session.run(None, feeds)
    assert logits.dtype.name == "float16"
    error = (torch.from_numpy(logits).float() - fp32_logits(model, batch)).abs().max()
    assert error < 1e-2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_rel_error": 1.5}, "max_rel_error must be a number in"),
        ({"min_top1_agreement": -0.1}, "min_top1_agreement must be a number in"),
        ({"max_abs_error": -1.0}, "max_abs_error must be a number in"),
        ({"formats": ("tflite",)}, "unknown export format"),
    ],
)
def test_bad_settings_are_refused_before_any_work(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        export_fp16(make_tiny_gpt2(), tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()
