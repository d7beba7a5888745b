"""FP16 export and FP32 islands: tied weights, islands a model was trained with, nothing partial."""

from __future__ import annotations

import json

import torch
from safetensors import safe_open

from amp_trainer import export_fp16, keep_in_fp32
from amp_trainer.export import load_fp16_export
from amp_trainer.islands import ISLANDS_CONFIG_KEY, is_fp32_island, record_fp32_islands
from tests.helpers.tiny_models import make_tiny_bert, make_tiny_gpt2, tiny_phi3, tiny_t5
from tests.helpers.training import ToyClassification, ToyLanguageModeling, tiny_training_args


def gpt2_whose_block0_mlp_overflows():
    """Block 0's MLP output is > 65504 on every token of any batch (finite in FP32)."""
    model = make_tiny_gpt2()
    with torch.no_grad():
        model.transformer.h[0].mlp.c_proj.weight.mul_(2e7)
    return model


def test_the_gpt2_test_model_overflows_fp16_on_every_token():
    model = gpt2_whose_block0_mlp_overflows()
    seen = {}
    model.transformer.h[0].mlp.register_forward_hook(lambda m, a, out: seen.update(out=out))
    with torch.no_grad():
        logits = model(input_ids=torch.randint(0, 128, (8, 16))).logits
    assert seen["out"].abs().amax(-1).min() > 65504
    assert torch.isfinite(logits).all()


def test_gpt2_with_tied_weights_and_an_overflowing_block_exports_with_consistent_islands(tmp_path):
    report = export_fp16(gpt2_whose_block0_mlp_overflows(), tmp_path / "out")

    assert report.passed and report.written, report.to_markdown()
    assert report.overflow_guarded_modules == ["transformer"]
    assert report.fp32_islands == ["lm_head"]  # shares transformer.wte.weight: FP32 as well
    assert any("weights stay FP32" in note for note in report.notes)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging left behind
    reloaded = load_fp16_export(tmp_path / "out")
    assert is_fp32_island(reloaded.transformer) and is_fp32_island(reloaded.lm_head)
    with torch.no_grad():
        logits = reloaded(input_ids=torch.randint(0, 128, (2, 8))).logits
    assert torch.isfinite(logits).all()


def test_islands_a_model_was_trained_with_are_kept_fp32_in_the_export(tmp_path):
    model = make_tiny_bert()
    keep_in_fp32(model, "bert.pooler.dense")  # as fp32_modules / the fallback would
    record_fp32_islands(model)
    model.save_pretrained(tmp_path / "trained")  # the config carries the island
    assert json.loads((tmp_path / "trained" / "config.json").read_text())[ISLANDS_CONFIG_KEY] == [
        "bert.pooler.dense"
    ]
    for source in (model, tmp_path / "trained"):
        out = tmp_path / f"export-{len(list(tmp_path.iterdir()))}"
        report = export_fp16(source, out)
        assert report.written and report.fp32_islands == ["bert.pooler.dense"]
        with safe_open(str(out / "model.safetensors"), framework="pt") as handle:
            assert handle.get_tensor("bert.pooler.dense.weight").dtype == torch.float32
            assert handle.get_tensor("bert.encoder.layer.0.output.dense.weight").dtype == (
                torch.float16
            )
        assert is_fp32_island(load_fp16_export(out).bert.pooler.dense)


def test_a_model_trained_by_amptrainer_exports_with_the_island_training_added(tmp_path):
    from amp_trainer import AmpTrainer

    model = make_tiny_bert()
    culprit = "bert.encoder.layer.0.intermediate.dense"
    with torch.no_grad():  # FP16 activations past 65504 there, finite in FP32
        model.get_submodule(culprit).weight.mul_(5e5)
    trainer = AmpTrainer(
        model=model,
        args=tiny_training_args(tmp_path / "run", max_steps=2),
        train_dataset=ToyClassification(),
    )
    trainer.train()
    assert is_fp32_island(model.get_submodule(culprit))  # the fallback added it

    report = export_fp16(model, tmp_path / "out", min_top1_agreement=None, max_rel_error=None)
    assert report.written
    assert culprit in report.fp32_islands
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as handle:
        assert handle.get_tensor(f"{culprit}.weight").dtype == torch.float32


def boost_phi3_block0(model, factor: float = 1e8):
    """Block 0's MLP output past 65504 (finite in FP32). Phi3's blocks are pre-norm: the residual
    stream carries it to the final norm, so only the whole backbone brings it back into range."""
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(factor)
    return model


def assert_reload_runs_like_the_report(out, model, report):
    ids = torch.randint(0, 128, (4, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        reference = model.eval()(input_ids=ids).logits
    reloaded = load_fp16_export(out)
    assert is_fp32_island(reloaded.model)
    assert reloaded.lm_head.weight.dtype == torch.float16  # the head stays FP16
    with torch.no_grad():
        logits = reloaded(input_ids=ids).logits  # raised "float != c10::Half" before the fix
    assert logits.dtype == torch.float16 and torch.isfinite(logits).all()
    relative = (logits.float() - reference).abs().max() / reference.abs().max()
    assert relative < 2e-2, (relative, report.to_markdown())


def test_phi3_whose_guard_widened_to_the_backbone_reloads_and_runs(tmp_path):
    model = boost_phi3_block0(tiny_phi3())
    report = export_fp16(model, tmp_path / "out")
    assert report.passed and report.written, report.to_markdown()
    assert report.overflow_guarded_modules == ["model"]  # widened from block 0's MLP
    assert_reload_runs_like_the_report(tmp_path / "out", model, report)


def test_phi3_trained_by_amptrainer_with_an_overflow_island_exports_reloads_and_runs(tmp_path):
    from amp_trainer import AmpTrainer

    model = boost_phi3_block0(tiny_phi3())
    culprit = "model.layers.0.mlp.down_proj"
    trainer = AmpTrainer(
        model=model,
        args=tiny_training_args(tmp_path / "run", max_steps=1, learning_rate=0.0),
        train_dataset=ToyLanguageModeling(n=4),
    )
    trainer.train()
    assert is_fp32_island(model.get_submodule(culprit))  # the forward-overflow fallback added it

    report = export_fp16(model, tmp_path / "out")
    assert report.passed and report.written, report.to_markdown()
    assert culprit in report.fp32_islands and report.overflow_guarded_modules == ["model"]
    assert_reload_runs_like_the_report(tmp_path / "out", model, report)


def test_t5_whose_ffn_output_overflows_exports_reloads_and_runs(tmp_path):
    """T5's classic FP16 failure: the FFN's ``wo`` output passes 65504. T5 casts wo's input to
    wo's weight dtype, so a wo island gets FP32 and hands FP32 on (the guard widens it); the
    widened encoder shares its embedding with the decoder and the head, and the decoder's tied
    embedding, fed only ids, must still hand FP16 to the FP16 decoder."""
    model = tiny_t5().eval()
    with torch.no_grad():
        model.encoder.block[0].layer[1].DenseReluDense.wo.weight.mul_(1e7)
    report = export_fp16(model, tmp_path / "out")
    assert report.passed and report.written, report.to_markdown()
    assert report.overflow_guarded_modules == ["encoder"]
    assert {"shared", "decoder.embed_tokens", "lm_head"} <= set(report.fp32_islands)

    ids = torch.randint(1, 128, (2, 9), generator=torch.Generator().manual_seed(6))
    decoder_ids = torch.cat([torch.zeros(2, 1, dtype=torch.long), ids[:, :4]], dim=1)
    with torch.no_grad():
        reference = model(input_ids=ids, decoder_input_ids=decoder_ids).logits
        logits = load_fp16_export(tmp_path / "out")(
            input_ids=ids, decoder_input_ids=decoder_ids
        ).logits
    assert logits.dtype == torch.float16 and torch.isfinite(logits).all()
    assert (logits.float() - reference).abs().max() / reference.abs().max() < 2e-2
