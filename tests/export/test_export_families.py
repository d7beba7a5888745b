"""FP16 export beyond token-id models: sample inputs from what the model declares.

T5, BART, Whisper, ViT and Llama (tiny configs: hidden 32, 2 layers, nothing downloaded) export
with a parity report and reload; an encoder-decoder gets decoder inputs from its
decoder_start_token_id; a saved image processor / feature extractor makes the sample batch; a
model nothing can feed is refused in one line naming ``sample_inputs=``, with nothing written.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from amp_trainer.export import (
    SampleInputsError,
    export_fp16,
    load_fp16_export,
    make_sample_batch,
)
from tests.helpers.tiny_models import (
    tiny_bart,
    tiny_llama,
    tiny_t5,
    tiny_vit,
    tiny_wav2vec2_ctc,
    tiny_whisper,
)

FAMILIES = {
    "t5": (tiny_t5, ["input_ids", "attention_mask", "decoder_input_ids"]),
    "bart": (tiny_bart, ["input_ids", "attention_mask", "decoder_input_ids"]),
    "whisper": (tiny_whisper, ["input_features", "decoder_input_ids"]),
    "vit": (tiny_vit, ["pixel_values"]),
    "llama": (tiny_llama, ["input_ids", "attention_mask"]),
}


def fp16(batch):
    return {k: v.half() if v.is_floating_point() else v for k, v in batch.items()}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_exports_with_a_parity_report_and_reloads(family, tmp_path):
    make, inputs = FAMILIES[family]
    torch.manual_seed(0)
    model = make().eval()
    report = export_fp16(model, tmp_path / "out")

    assert report.passed and report.written, report.to_markdown()
    assert report.inputs == inputs
    result = report.parity["pytorch"]
    assert result.output == "logits" and result.nonfinite == 0 and result.positions > 0
    assert 0 < result.max_rel_error < 2e-2 and result.top1_agreement >= 0.98
    assert "inputs: " + ", ".join(f"`{n}`" for n in inputs) in report.to_markdown()

    batch = make_sample_batch(model, seed=1)  # other values than the export saw
    assert list(batch) == inputs
    reloaded = load_fp16_export(tmp_path / "out")
    with torch.no_grad():
        reference = model(**batch).logits
        logits = reloaded(**fp16(batch)).logits
    assert logits.dtype == torch.float16 and torch.isfinite(logits).all()
    assert (logits.float() - reference).abs().max() / reference.abs().max() < 2e-2


def test_encoder_decoder_inputs_start_with_the_configs_decoder_start_token():
    t5, whisper = tiny_t5(decoder_start_token_id=5), tiny_whisper()
    batch = make_sample_batch(t5)
    decoder, ids = batch["decoder_input_ids"], batch["input_ids"]
    assert (decoder[:, 0] == 5).all()
    assert torch.equal(decoder[:, 1:], ids[:, :-1])  # the input ids shifted right
    speech = make_sample_batch(whisper)
    assert speech["input_features"].shape == (8, 16, 64)  # what Whisper's encoder checks
    assert (speech["decoder_input_ids"][:, 0] == 1).all()
    assert speech["decoder_input_ids"].shape[1] <= 32  # max_target_positions
    assert make_sample_batch(tiny_vit())["pixel_values"].shape == (8, 3, 32, 32)


def test_an_encoder_decoder_without_a_decoder_start_token_is_refused_in_one_line(tmp_path):
    model = tiny_t5(decoder_start_token_id=None)
    model.generation_config.decoder_start_token_id = None
    with pytest.raises(SampleInputsError) as caught:
        export_fp16(model, tmp_path / "out")
    message = str(caught.value)
    assert "\n" not in message
    assert "decoder_start_token_id" in message and "sample_inputs=" in message
    assert list(tmp_path.iterdir()) == []


def test_a_model_whose_main_input_cannot_be_made_is_refused_naming_sample_inputs(tmp_path):
    config = tf.PatchTSMixerConfig(
        context_length=32, patch_length=8, num_input_channels=2, d_model=16, num_layers=2
    )
    model = tf.PatchTSMixerForPrediction(config)
    with pytest.raises(SampleInputsError) as caught:
        export_fp16(model, tmp_path / "out")
    message = str(caught.value)
    assert "\n" not in message and isinstance(caught.value, ValueError)
    assert "PatchTSMixerForPrediction" in message and "'past_values'" in message
    assert "sample_inputs=" in message
    assert list(tmp_path.iterdir()) == []


def test_a_forward_that_fails_on_the_sample_inputs_is_one_line_naming_sample_inputs(tmp_path):
    ids = torch.randint(0, 128, (2, 8))
    with pytest.raises(SampleInputsError) as caught:  # T5 needs decoder inputs too
        export_fp16(tiny_t5(), tmp_path / "out", sample_inputs={"input_ids": ids})
    message = str(caught.value)
    assert "\n" not in message
    assert "FP32 forward failed on the sample inputs (input_ids)" in message
    assert "sample_inputs=" in message
    assert list(tmp_path.iterdir()) == []


def test_sample_inputs_are_used_as_given(tmp_path):
    model = tiny_llama()
    ids = torch.randint(3, 128, (3, 10), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, 6:] = 0
    report = export_fp16(
        model, tmp_path / "out", sample_inputs={"input_ids": ids, "attention_mask": mask}
    )
    assert report.passed and report.inputs == ["input_ids", "attention_mask"]
    assert report.parity["pytorch"].positions == int(mask.sum())


@pytest.mark.parametrize(
    ("sample_inputs", "message"),
    [
        ([torch.zeros(2, 3)], "must be a non-empty dict"),
        ({}, "must be a non-empty dict"),
        ({"input_ids": [[1, 2]]}, r"sample_inputs\['input_ids'\] must be a torch.Tensor"),
        # Llama's forward takes **kwargs: the name reaches the forward, which fails, said so.
        ({"token_ids": torch.zeros(2, 3, dtype=torch.long)}, r"sample inputs \(token_ids\)"),
    ],
)
def test_bad_sample_inputs_are_refused_before_any_work(tmp_path, sample_inputs, message):
    with pytest.raises(SampleInputsError, match=message):
        export_fp16(tiny_llama(), tmp_path / "out", sample_inputs=sample_inputs)
    assert list(tmp_path.iterdir()) == []


def test_sample_texts_for_a_model_that_does_not_take_text_are_refused(tmp_path):
    with pytest.raises(SampleInputsError, match="takes pixel_values, not text"):
        export_fp16(tiny_vit(), tmp_path / "out", sample_texts=["a photo"])


def test_a_saved_image_processor_makes_the_pixels_and_is_saved_with_the_export(tmp_path):
    model = tiny_vit()
    model.save_pretrained(tmp_path / "vit")
    processor = tf.ViTImageProcessor(size={"height": 32, "width": 32}, image_mean=[0.2] * 3)
    processor.save_pretrained(tmp_path / "vit")

    report = export_fp16(tmp_path / "vit", tmp_path / "out")
    assert report.passed and report.inputs == ["pixel_values"], report.to_markdown()
    assert "preprocessor_config.json" in report.files
    # The processor's normalisation was applied: pixels of random images, not N(0, 1) noise.
    batch = make_sample_batch(model, processor=processor)
    assert batch["pixel_values"].shape == (8, 3, 32, 32)
    assert batch["pixel_values"].min() >= (0 - 0.2) / 0.5 - 1e-4  # image_std 0.5, mean 0.2


def test_a_saved_feature_extractor_makes_the_speech_features(tmp_path):
    model = tiny_whisper()
    model.save_pretrained(tmp_path / "whisper")
    extractor = tf.WhisperFeatureExtractor(  # 2 s at 1.6 kHz, hop 50: the 64 frames it takes
        feature_size=16, sampling_rate=1600, hop_length=50, chunk_length=2, n_fft=100
    )
    extractor.save_pretrained(tmp_path / "whisper")

    report = export_fp16(tmp_path / "whisper", tmp_path / "out")
    assert report.passed and report.inputs == ["input_features", "decoder_input_ids"]
    assert {"preprocessor_config.json", "processor_config.json"} & set(report.files)
    features = make_sample_batch(model, processor=extractor)["input_features"]
    assert features.shape == (8, 16, 64)
    # Whisper's log-mel features: each example clamped to 8 (log10) below its max, then / 4.
    spread = features.amax(dim=(1, 2)) - features.amin(dim=(1, 2))
    assert (spread <= 2.0 + 1e-4).all() and (spread > 0.5).all()


def test_raw_audio_models_get_enough_samples_for_their_convolutions():
    model = tiny_wav2vec2_ctc().eval()
    batch = make_sample_batch(model)
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape[:2] == (8, 16)  # 16 frames out of the convolutional front end


def test_pixels_without_an_image_size_need_an_image_processor(tmp_path):
    config = tf.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3)
    model = tf.ResNetForImageClassification(config)  # a CNN: its config has no image size
    with pytest.raises(SampleInputsError, match="no image_size and no image processor"):
        export_fp16(model, tmp_path / "refused")
    assert list(tmp_path.iterdir()) == []
    processor = tf.ViTImageProcessor(size={"height": 32, "width": 32})
    report = export_fp16(model, tmp_path / "out", processor=processor)
    assert report.passed and report.inputs == ["pixel_values"], report.to_markdown()
