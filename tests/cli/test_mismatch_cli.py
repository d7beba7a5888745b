"""``amp-trainer mismatch``: the precision-mismatch table for a saved causal LM and some texts."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from amp_trainer import measure_precision_mismatch
from amp_trainer.cli import main
from tests.helpers.cli import one_line_error
from tests.helpers.tiny_models import make_tiny_bert

TEXTS = ["The red car is next to the house.", "Which bird is it?", "The blue stone."]


def _save_gpt2(folder, tokenizer, *, overflow: bool = False):
    torch.manual_seed(0)
    eos = tokenizer.eos_token_id
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_embd=128,
        n_layer=4,
        n_head=4,
        n_positions=64,
        bos_token_id=eos,
        eos_token_id=eos,
    )
    model = GPT2LMHeadModel(config)
    if overflow:
        with torch.no_grad():  # beyond FP16's 65504 in FP16, finite in FP32 and BF16
            model.transformer.h[1].mlp.c_fc.weight.mul_(1e6)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from amp_trainer.recipes import train_byte_level_bpe_tokenizer

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AMP_TRAINER_CACHE", str(tmp_path_factory.mktemp("cache")))
        return train_byte_level_bpe_tokenizer(TEXTS * 8, vocab_size=300, model_max_length=64)


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory, tokenizer):
    return _save_gpt2(tmp_path_factory.mktemp("gpt2"), tokenizer)


def test_mismatch_has_help(capsys):
    assert main(["mismatch", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--model" in out and "--texts" in out and "--data" in out and "--json" in out


def test_mismatch_prints_the_table_and_writes_the_functions_figures_as_json(
    gpt2_dir, tokenizer, tmp_path, capsys
):
    report = tmp_path / "mismatch.json"
    argv = ["mismatch", "--model", str(gpt2_dir), "--texts", *TEXTS, "--json", str(report)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| fp16 " in out and "| bf16 " in out and "bf16/fp16:" in out
    assert "on cpu, against FP32" in out

    saved = json.loads(report.read_text())["precisions"]
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    model = GPT2LMHeadModel.from_pretrained(gpt2_dir)
    direct = measure_precision_mismatch(model, batch["input_ids"], batch["attention_mask"])
    for name in ("fp16", "bf16"):
        assert saved[name] == direct[name].to_dict()  # JSON round-trips floats exactly
    assert saved["fp16"]["tokens"] == int(batch["attention_mask"][:, 1:].sum())
    assert saved["bf16"]["mean_abs_logprob_diff"] > saved["fp16"]["mean_abs_logprob_diff"]


def test_mismatch_reads_texts_from_a_file(gpt2_dir, tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"text": text}) for text in TEXTS) + "\n")
    argv = ["mismatch", "--model", str(gpt2_dir), "--data", str(data), "--precisions", "fp32"]
    assert main(argv) == 0
    assert "3 text(s)" in capsys.readouterr().out


def test_an_fp16_overflow_exits_one_naming_the_module(tokenizer, tmp_path, capsys):
    folder = _save_gpt2(tmp_path / "overflowing", tokenizer, overflow=True)
    assert main(["mismatch", "--model", str(folder), "--texts", *TEXTS]) == 1
    out = capsys.readouterr().out
    assert "fp16: non-finite logits" in out and "'transformer.h.1.mlp.c_fc'" in out


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--texts", "x", "--precisions", "fp8"], "invalid choice: 'fp8'"),
        ([], "one of the arguments --texts --data is required"),
        (["--texts", "x", "--clip-epsilon", "0"], "--clip-epsilon: 0 is outside (0, 1]"),
        (["--data", "nope.txt"], "--data nope.txt: no such file"),
        (["--texts", "x", "--json", "no/such/dir/m.json"], "directory no/such/dir does not exist"),
    ],
    ids=["unknown-precision", "no-texts", "clip-epsilon", "missing-data", "json-folder"],
)
def test_usage_errors_are_one_line_exit_two(
    gpt2_dir, argv, expected, capsys, monkeypatch, tmp_path
):
    monkeypatch.chdir(tmp_path)
    assert main(["mismatch", "--model", str(gpt2_dir), *argv]) == 2
    assert expected in one_line_error(capsys)


def test_a_model_that_is_not_a_causal_lm_is_a_one_line_error(tmp_path, capsys):
    from transformers import BertTokenizerFast

    (tmp_path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "a"]))
    BertTokenizerFast(vocab=str(tmp_path / "vocab.txt")).save_pretrained(tmp_path)
    make_tiny_bert().save_pretrained(tmp_path)
    assert main(["mismatch", "--model", str(tmp_path), "--texts", "a a a"]) == 2
    assert "BertForSequenceClassification is not a causal language model" in one_line_error(capsys)


def test_a_text_longer_than_the_models_positions_is_cut_there_with_a_note(gpt2_dir, capsys):
    # The tiny GPT-2 embeds 64 positions; --max-length defaults to 256. Uncut, the forward
    # would fail with a bare IndexError from the position embedding.
    long_text = " ".join(TEXTS * 12)
    assert main(["mismatch", "--model", str(gpt2_dir), "--texts", long_text, TEXTS[1]]) == 0
    out = capsys.readouterr().out
    assert "note: 1 text(s) cut at 64 tokens (the model's positions); the rest is not scored" in out
    assert "| fp16 " in out


def test_a_text_cut_at_max_length_names_the_flag(gpt2_dir, capsys):
    argv = ["mismatch", "--model", str(gpt2_dir), "--texts", TEXTS[0], "--max-length", "4"]
    assert main(argv) == 0
    assert "note: 1 text(s) cut at 4 tokens (--max-length)" in capsys.readouterr().out


def test_a_model_folder_that_does_not_exist_is_not_called_tokenizer_less(tmp_path, capsys):
    missing = "runs/no-such-run"  # shaped like a hub id, so it is tried as one (offline here)
    assert main(["mismatch", "--model", missing, "--texts", "x"]) == 2
    assert one_line_error(capsys) == (
        "amp-trainer mismatch: error: --model runs/no-such-run: no such folder, and no hub model "
        "of that id could be loaded (offline, or no such id)"
    )


@pytest.mark.parametrize(
    "texts, expected",
    [(["", "Which bird is it?"], "text 1 of 2"), (["The cat.", " ", "\t"], "texts 2, 3 of 3")],
    ids=["one", "two-blank"],
)
def test_an_empty_text_is_one_line_not_a_table_of_special_tokens(gpt2_dir, texts, expected, capsys):
    assert main(["mismatch", "--model", str(gpt2_dir), "--texts", *texts]) == 2
    assert one_line_error(capsys).endswith(
        f"--texts: {expected} is empty; there is nothing to score"
    )
