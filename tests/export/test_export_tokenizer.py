"""A model folder's saved tokenizer: used when it works, refused in one line when it is there but
broken, never read as "no tokenizer" (random-id parity, no tokenizer written, PASSED).

The folders are real saves (``save_pretrained`` of a real WordPiece or byte-level BPE tokenizer)
with real damage: a ``tokenizer.json`` emptied to ``{}``, the vocabulary files deleted beside a
``tokenizer_config.json``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from amp_trainer.cli import main
from amp_trainer.export import export_fp16, load_tokenizer
from tests.helpers.cli import one_line_error
from tests.helpers.tiny_models import colour_bpe_tokenizer, make_tiny_bert, tiny_gpt2_for

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "great", "dull", "film", "plot"]


def bert_folder(folder: Path) -> Path:
    """A saved tiny BERT classifier with its real WordPiece tokenizer (tokenizer.json,
    tokenizer_config.json, vocab.txt)."""
    from transformers import BertTokenizerFast

    folder.mkdir(parents=True)
    (folder / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    BertTokenizerFast(vocab=str(folder / "vocab.txt")).save_pretrained(folder)
    make_tiny_bert().save_pretrained(folder)
    return folder


def export_args(model: Path, out: Path) -> list[str]:
    return ["export", "--model", str(model), "--output", str(out)]


def test_a_working_saved_tokenizer_is_used_and_written_with_the_export(tmp_path):
    model = bert_folder(tmp_path / "bert")
    report = export_fp16(model, tmp_path / "fp16")
    assert report.passed and (tmp_path / "fp16" / "tokenizer.json").is_file()
    assert report.sample == "built-in English sentences"


def test_a_tokenizer_json_emptied_to_braces_is_one_line_naming_it_and_nothing_is_written(
    tmp_path, capsys
):
    model = bert_folder(tmp_path / "bert")
    (model / "tokenizer.json").write_text("{}")
    capsys.readouterr()  # the saves' progress bars
    assert main(export_args(model, tmp_path / "fp16")) == 2
    line = one_line_error(capsys)
    assert f"{model / 'tokenizer.json'} is not a tokenizers file" in line
    assert "Restore the tokenizer files" in line
    assert not (tmp_path / "fp16").exists()


def test_vocabulary_files_deleted_beside_a_tokenizer_config_is_refused_not_an_empty_tokenizer(
    tmp_path, capsys
):
    model = bert_folder(tmp_path / "bert")
    (model / "tokenizer.json").unlink()
    (model / "vocab.txt").unlink()
    capsys.readouterr()  # the saves' progress bars
    assert main(export_args(model, tmp_path / "fp16")) == 2
    line = one_line_error(capsys)
    assert f"saved in {model} (tokenizer_config.json) loads with no vocabulary" in line
    assert "5 ids, all special tokens" in line
    assert not (tmp_path / "fp16").exists()


def test_a_byte_level_bpe_tokenizer_json_deleted_beside_its_config_is_refused(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("AMP_TRAINER_CACHE", str(tmp_path / "cache"))
    tokenizer = colour_bpe_tokenizer()
    model = tmp_path / "gpt2"
    tiny_gpt2_for(tokenizer).save_pretrained(model)
    tokenizer.save_pretrained(model)
    (model / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match=r"\(tokenizer_config.json\) does not load"):
        export_fp16(model, tmp_path / "fp16")
    assert not (tmp_path / "fp16").exists()


def test_tokenizer_json_deleted_but_vocab_txt_kept_still_loads_the_real_vocabulary(tmp_path):
    model = bert_folder(tmp_path / "bert")
    (model / "tokenizer.json").unlink()
    assert len(load_tokenizer(model)) == len(VOCAB)


def test_a_folder_without_any_tokenizer_file_exports_on_random_ids_and_says_so(tmp_path):
    model = tmp_path / "bert"
    make_tiny_bert().save_pretrained(model)
    report = export_fp16(model, tmp_path / "fp16")
    assert report.passed and report.sample == "random token ids (no tokenizer)"
    assert any("not on your data" in reason for reason in report.thin_evidence)
