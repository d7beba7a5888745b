"""How much evidence a parity verdict rests on: said in the report, report.json and the CLI's
output, checked against the positions the comparison really counted."""

from __future__ import annotations

import json

import pytest
import torch

from amp_trainer.cli import main
from amp_trainer.export import export_fp16
from amp_trainer.export.parity import positions_needed
from tests.helpers.tiny_models import make_tiny_bert, make_tiny_gpt2

FOUR = ["a great film", "a dull plot", "a great plot", "a dull film"]


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory):
    """A saved tiny BERT classifier with a real WordPiece tokenizer over ten words."""
    from transformers import BertTokenizerFast

    folder = tmp_path_factory.mktemp("bert")
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "great", "dull", "film", "plot"]
    (folder / "vocab.txt").write_text("\n".join(words) + "\n")
    BertTokenizerFast(vocab=str(folder / "vocab.txt")).save_pretrained(folder)
    make_tiny_bert().save_pretrained(folder)
    return folder


def test_positions_needed_follows_the_rule_of_three():
    assert positions_needed(0.98) == 150
    assert positions_needed(0.9) == 30
    assert positions_needed(None) == positions_needed(1.0) == 150  # the default threshold's


def test_four_sentences_pass_on_thin_evidence_and_the_report_says_so(classifier_dir, tmp_path):
    report = export_fp16(classifier_dir, tmp_path / "fp16", sample_texts=FOUR)
    result = report.parity["pytorch"]
    assert report.passed and result.positions == 4 == report.sample_rows  # one row per sentence
    assert report.sample == "your sample texts"
    (reason,) = report.thin_evidence  # the user's own texts: only the sample size is thin
    assert reason.startswith("4 positions compared") and "up to 75%" in reason
    assert "150 positions would rule it out" in reason
    markdown = report.to_markdown()
    assert "## FP16 export: PASSED (on thin evidence: see below)" in markdown
    assert "- evidence: 4 positions compared, from 4 rows of your sample texts" in markdown
    on_disk = json.loads((tmp_path / "fp16" / "report.json").read_text())
    assert on_disk["thin_evidence"] == [reason] and on_disk["sample_rows"] == 4


def test_built_in_sentences_are_called_a_stand_in_for_the_users_data(classifier_dir, tmp_path):
    report = export_fp16(classifier_dir, tmp_path / "fp16")
    assert report.sample == "built-in English sentences" and report.sample_rows == 8
    assert report.thin_evidence[0].startswith(
        "parity ran on built-in English sentences, not on your data"
    )


def test_enough_positions_of_the_users_own_inputs_are_not_thin(tmp_path):
    ids = torch.randint(3, 128, (16, 12))
    mask = torch.ones_like(ids)
    mask[::2, 9:] = 0  # padded positions are not compared, nor counted
    batch = {"input_ids": ids, "attention_mask": mask}
    report = export_fp16(make_tiny_gpt2(), tmp_path / "fp16", sample_inputs=batch)
    assert report.parity["pytorch"].positions == int(mask.sum()) == 168 >= positions_needed(0.98)
    assert report.passed and report.thin_evidence == []
    assert "thin evidence" not in report.to_markdown().lower()
    assert f"- evidence: {int(mask.sum())} positions compared, from 16 rows" in report.to_markdown()


def test_just_too_few_real_positions_are_thin_though_the_batch_is_larger(tmp_path):
    ids = torch.randint(3, 128, (16, 12))
    mask = torch.ones_like(ids)
    mask[:, 9:] = 0  # 16 x 9 = 144 real positions: under 150
    batch = {"input_ids": ids, "attention_mask": mask}
    report = export_fp16(make_tiny_gpt2(), tmp_path / "fp16", sample_inputs=batch)
    assert report.parity["pytorch"].positions == 144
    (reason,) = report.thin_evidence
    assert reason.startswith("144 positions compared")


def test_cli_output_says_the_evidence_and_that_it_is_thin(classifier_dir, tmp_path, capsys):
    argv = ["export", "--model", str(classifier_dir), "--output", str(tmp_path / "fp16")]
    assert main([*argv, "--texts", *FOUR]) == 0
    captured = capsys.readouterr()
    assert "- evidence: 4 positions compared, from 4 rows of your sample texts" in captured.out
    assert "amp-trainer export: PASSED on thin evidence: 4 positions compared" in captured.err
