"""The CLI on models that do not take token ids: ``doctor`` and ``export`` on saved ViT,
Whisper and Wav2Vec2 folders, T5 and BART fed from ``--sample-inputs FILE`` (the CLI's
gaps).

The doctor builds its probe batch as export does (:mod:`amp_trainer.export.sample_inputs`),
plus labels so the model has a loss; ``--sample-inputs`` reads a .safetensors or .pt file of
named tensors. The models are tiny configs from tests/helpers/tiny_models.py, saved without
any download.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import transformers as tf
from safetensors.torch import save_file

from amp_trainer.cli import main
from tests.helpers.cli import one_line_error
from tests.helpers.repo import REPO_ROOT, subprocess_env
from tests.helpers.tiny_models import tiny_bart, tiny_t5, tiny_vit, tiny_wav2vec2_ctc, tiny_whisper

MAKERS = {
    "vit": tiny_vit,
    "whisper": tiny_whisper,
    "t5": tiny_t5,
    "bart": tiny_bart,
    # A per-token mean loss (fine-tuning configs' choice); the default "sum": see below.
    "wav2vec2": lambda: tiny_wav2vec2_ctc(ctc_loss_reduction="mean"),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> a saved model folder (config.json + weights, no tokenizer or processor)."""
    folders = {}
    for family, make in MAKERS.items():
        folder = tmp_path_factory.mktemp(family)
        make().save_pretrained(folder)
        folders[family] = folder
    return folders


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "amp_trainer.cli", *argv],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        cwd=REPO_ROOT,
        timeout=300,
    )


@pytest.mark.slow
@pytest.mark.parametrize("family", ["vit", "whisper"])
def test_doctor_on_a_saved_non_text_or_encoder_decoder_model_is_healthy(family, saved, tmp_path):
    diagnosis = tmp_path / "diagnosis.json"
    done = run_cli(
        "doctor", "--model", str(saved[family]), "--steps", "2", "--json", str(diagnosis)
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "verdict: healthy" in done.stdout
    assert json.loads(diagnosis.read_text())["verdict"] == "healthy"


def test_doctor_feeds_raw_audio_to_wav2vec2_ctc(saved, capsys):
    # Two steps: the scaler's first step may skip (scale 65536 -> 32768), as in training.
    assert main(["doctor", "--model", str(saved["wav2vec2"]), "--steps", "2"]) == 0
    assert "verdict: healthy" in capsys.readouterr().out


def test_a_summed_ctc_loss_is_not_taken_for_divergence(tmp_path, capsys):
    """Wav2Vec2's default ctc_loss_reduction="sum" scores ~350 on a fresh model: far above
    ln(vocab), but no sign of diverged weights (the doctor used to say "already diverged")."""
    tiny_wav2vec2_ctc().save_pretrained(tmp_path / "w2v")
    main(["doctor", "--model", str(tmp_path / "w2v"), "--steps", "1"])
    out = capsys.readouterr().out
    assert "stages:" in out and "1. fp32 (lr=5e-05): ok" in out
    assert "already diverged" not in out and "verdict: learning_rate" not in out


def test_doctor_batch_size_cuts_a_generated_batch(saved, tmp_path, capsys):
    diagnosis = tmp_path / "d.json"
    argv = ["doctor", "--model", str(saved["vit"]), "--steps", "1", "--batch-size", "2"]
    assert main([*argv, "--json", str(diagnosis)]) == 0
    capsys.readouterr()
    # The ViT head has 3 classes: labels cycle 0, 1 over the 2 rows; healthy either way.
    assert json.loads(diagnosis.read_text())["verdict"] == "healthy"


def test_doctor_texts_for_an_image_model_name_the_sample_inputs_flag(saved, capsys):
    assert main(["doctor", "--model", str(saved["vit"]), "--texts", "a cat"]) == 2
    line = one_line_error(capsys)
    assert "takes pixel_values, not text" in line and "--sample-inputs FILE" in line
    assert "sample_inputs={" not in line  # the library's wording, not the CLI's


def test_doctor_on_a_model_inputs_cannot_be_made_for_names_the_flag(tmp_path, capsys):
    model = tiny_t5(decoder_start_token_id=None)
    model.generation_config.decoder_start_token_id = None
    model.save_pretrained(tmp_path / "t5")
    assert main(["doctor", "--model", str(tmp_path / "t5"), "--steps", "1"]) == 2
    line = one_line_error(capsys)
    assert "decoder_start_token_id" in line and "--sample-inputs FILE" in line


def test_doctor_on_a_headless_model_says_it_has_no_loss(tmp_path, capsys):
    tf.ViTModel(tiny_vit().config).save_pretrained(tmp_path / "vit-headless")
    assert main(["doctor", "--model", str(tmp_path / "vit-headless"), "--steps", "1"]) == 2
    line = one_line_error(capsys)
    assert "ViTModel takes no labels" in line and "task head" in line


# --------------------------------------------------------------------------------------------
# --sample-inputs FILE
# --------------------------------------------------------------------------------------------
def vit_pixels(rows: int = 2) -> dict[str, torch.Tensor]:
    return {
        "pixel_values": torch.randn(rows, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    }


@pytest.mark.slow
def test_doctor_and_export_take_a_safetensors_sample_inputs_file(saved, tmp_path):
    inputs = tmp_path / "pixels.safetensors"
    save_file({**vit_pixels(), "labels": torch.tensor([2, 1])}, inputs)
    diagnosis = tmp_path / "d.json"
    done = run_cli(
        "doctor", "--model", str(saved["vit"]), "--sample-inputs", str(inputs), "--steps", "1",
        "--json", str(diagnosis),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(diagnosis.read_text())["verdict"] == "healthy"
    report = tmp_path / "report.json"
    done = run_cli(
        "export", "--model", str(saved["vit"]), "--output", str(tmp_path / "out"),
        "--sample-inputs", str(inputs), "--report", str(report),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    # safetensors stores names sorted
    assert json.loads(report.read_text())["inputs"] == ["labels", "pixel_values"]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["t5", "bart"])
def test_doctor_and_export_take_a_pt_sample_inputs_file_for_an_encoder_decoder(
    family, saved, tmp_path
):
    inputs = tmp_path / "batch.pt"
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    torch.save({"input_ids": ids, "decoder_input_ids": ids[:, :4]}, inputs)
    done = run_cli(
        "doctor", "--model", str(saved[family]), "--sample-inputs", str(inputs), "--steps", "2"
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "verdict: healthy" in done.stdout
    report = tmp_path / "report.json"
    argv = ["export", "--model", str(saved[family]), "--output", str(tmp_path / "out")]
    assert main([*argv, "--sample-inputs", str(inputs), "--report", str(report)]) == 0
    assert json.loads(report.read_text())["inputs"] == ["input_ids", "decoder_input_ids"]


def test_doctor_adds_labels_to_a_sample_inputs_file_without_them(saved, tmp_path, capsys):
    inputs = tmp_path / "features.safetensors"
    features = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(0)) * 0.5
    decoder = torch.tensor([[1, 5, 9, 3], [1, 7, 2, 4]])
    save_file({"input_features": features, "decoder_input_ids": decoder}, inputs)
    argv = ["doctor", "--model", str(saved["whisper"]), "--steps", "1"]
    assert main([*argv, "--sample-inputs", str(inputs)]) == 0
    assert "verdict: healthy" in capsys.readouterr().out


def test_doctor_takes_fp16_sample_inputs_as_fp32(saved, tmp_path, capsys):
    """Features saved from an FP16 pipeline: Whisper's FP32 convolutions refuse FP16 input."""
    inputs = tmp_path / "half.pt"
    features = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(0)) * 0.5
    decoder = torch.tensor([[1, 5, 9, 3], [1, 7, 2, 4]])
    torch.save({"input_features": features.half(), "decoder_input_ids": decoder}, inputs)
    argv = ["doctor", "--model", str(saved["whisper"]), "--steps", "2"]
    assert main([*argv, "--sample-inputs", str(inputs)]) == 0
    assert "verdict: healthy" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["export", "doctor"])
def test_a_missing_sample_inputs_file_is_a_one_line_usage_error(command, saved, tmp_path, capsys):
    missing = tmp_path / "nope.safetensors"
    argv = [command, "--model", str(saved["vit"]), "--sample-inputs", str(missing)]
    if command == "export":
        argv += ["--output", str(tmp_path / "out")]
    assert main(argv) == 2
    assert f"--sample-inputs {missing}: no such file" in one_line_error(capsys)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["export", "doctor"])
def test_a_sample_inputs_file_of_an_unknown_format_names_the_valid_ones(
    command, saved, tmp_path, capsys
):
    bad = tmp_path / "inputs.npz"
    bad.write_bytes(b"x")
    argv = [command, "--model", str(saved["vit"]), "--sample-inputs", str(bad)]
    if command == "export":
        argv += ["--output", str(tmp_path / "out")]
    assert main(argv) == 2
    line = one_line_error(capsys)
    assert "unknown format '.npz'" in line and ".safetensors, .pt, .pth" in line


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("garbled.safetensors", b"\x00\x01not a safetensors header", "not a readable safetensors"),
        ("garbled.pt", b"not a zip", "not a torch.save file"),
    ],
)
def test_an_unreadable_sample_inputs_file_is_a_one_line_usage_error(
    name, content, message, saved, tmp_path, capsys
):
    bad = tmp_path / name
    bad.write_bytes(content)
    assert main(["doctor", "--model", str(saved["vit"]), "--sample-inputs", str(bad)]) == 2
    line = one_line_error(capsys)
    assert f"--sample-inputs {bad}: {message}" in line


class _WritesMarker:
    """Unpickles by running code that writes a marker file: what a malicious file would do."""

    def __init__(self, marker) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('ran')",))


@pytest.mark.parametrize("command", ["export", "doctor"])
def test_a_pt_sample_inputs_file_holding_a_pickle_is_refused_unread_without_unsafe_advice(
    command, saved, tmp_path, capsys
):
    marker = tmp_path / "payload-ran"
    bad = tmp_path / "inputs.pt"
    torch.save({"pixel_values": _WritesMarker(marker)}, bad)
    argv = [command, "--model", str(saved["vit"]), "--sample-inputs", str(bad)]
    if command == "export":
        argv += ["--output", str(tmp_path / "out")]
    assert main(argv) == 2
    line = one_line_error(capsys)
    assert f"--sample-inputs {bad}: not a torch.save file of plain tensors" in line
    assert "refused unread: loading it could run code" in line
    assert "weights_only" not in line and "arbitrary code" not in line
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_a_pt_file_that_is_not_a_dict_of_tensors_is_refused(saved, tmp_path, capsys):
    listed = tmp_path / "list.pt"
    torch.save([torch.zeros(1)], listed)
    assert main(["doctor", "--model", str(saved["vit"]), "--sample-inputs", str(listed)]) == 2
    assert "holds a list, not a non-empty {name: tensor} dict" in one_line_error(capsys)
    mixed = tmp_path / "mixed.pt"
    torch.save({"pixel_values": torch.zeros(1, 3, 32, 32), "note": 3}, mixed)
    assert main(["doctor", "--model", str(saved["vit"]), "--sample-inputs", str(mixed)]) == 2
    assert "'note' is a int, not a tensor" in one_line_error(capsys)


@pytest.mark.parametrize("command", ["export", "doctor"])
def test_a_name_the_forward_does_not_take_is_refused_naming_the_valid_ones(
    command, saved, tmp_path, capsys
):
    inputs = tmp_path / "wrong.safetensors"
    save_file({"input_ids": torch.zeros(2, 4, dtype=torch.long)}, inputs)
    argv = [command, "--model", str(saved["vit"]), "--sample-inputs", str(inputs)]
    if command == "export":
        argv += ["--output", str(tmp_path / "out")]
    assert main(argv) == 2
    line = one_line_error(capsys)
    assert f"--sample-inputs {inputs}:" in line
    assert "'input_ids' is not an argument of ViTForImageClassification.forward" in line
    assert "'pixel_values'" in line  # among the valid names
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["export", "--output", "OUT", "--texts", "hi"],
        ["doctor", "--texts", "hi"],
        ["doctor", "--data", "batch.txt"],
    ],
)
def test_sample_inputs_with_texts_or_data_is_a_usage_error(argv, saved, tmp_path, capsys):
    inputs = tmp_path / "p.safetensors"
    save_file(vit_pixels(), inputs)
    argv = [a.replace("OUT", str(tmp_path / "out")) for a in argv]
    full = [argv[0], "--model", str(saved["vit"]), *argv[1:], "--sample-inputs", str(inputs)]
    assert main(full) == 2
    assert "not allowed with argument" in one_line_error(capsys)


def test_sample_inputs_with_a_recipe_config_is_a_usage_error(tmp_path, capsys):
    inputs = tmp_path / "p.safetensors"
    save_file(vit_pixels(), inputs)
    argv = ["doctor", "--config", str(REPO_ROOT / "configs" / "bert_offline.yaml")]
    assert main([*argv, "--sample-inputs", str(inputs)]) == 2
    assert "--sample-inputs cannot be combined with --config" in one_line_error(capsys)
