"""Datasets for the recipes: hub names, local files, and an offline default, checked and tokenized.

Three sources, one shape. A recipe asks for a classification task or a language-modelling corpus
and gets a :class:`datasets.DatasetDict` with ``train`` and ``validation`` splits, whether the data
came from the Hugging Face Hub (``glue``/``sst2``, ``wikitext``), from local csv/json/jsonl/txt
files, or from the embedded offline default.

The offline default needs no network and no download on any machine that has Python: it is
built from :mod:`pydoc_data.topics`, the English text of the Python reference documentation that
ships with CPython (the source of ``help("if")``). From it we derive

* a balanced binary sentence classification task, *does this sentence describe a statement
  (control flow, definitions, imports, exceptions) or the data model and built-in types?*
  (chance level 50 %), and
* a language-modelling corpus (its prose paragraphs).

The split is a hash of each sentence/paragraph, so it is fixed and identical on every machine
running the same Python version. Tokenizers for from-scratch runs are trained by
:mod:`amp_trainer.recipes.tokenizers`; models are built by
:mod:`amp_trainer.recipes.models`.

Every check on user input happens here, before tokenization or model loading, and fails with a
:class:`DataError` that names the bad value and what would have been valid.
"""

from __future__ import annotations

import codecs
import hashlib
import itertools
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - imported lazily: `datasets` and `transformers` are heavy
    from datasets import DatasetDict
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "OFFLINE_DATASET",
    "ClassificationData",
    "DataError",
    "check_num_labels",
    "load_lm_corpus",
    "load_text_classification",
    "tokenize_and_chunk",
    "tokenize_classification",
]

logger = logging.getLogger(__name__)

#: ``--dataset_name`` value that selects the embedded offline data (also the default).
OFFLINE_DATASET = "offline:pydoc-topics"
#: Label names of the offline classification task, in label-id order.
OFFLINE_LABELS = ("statement", "data-model")

# Which topics of pydoc_data.topics feed which class. Topics missing from a given Python version
# are skipped, so the task exists (with slightly different sizes) on every CPython 3.10+.
_STATEMENT_TOPICS = (
    "assert", "assignment", "async", "augassign", "await", "break", "class", "compound",
    "context-managers", "continue", "del", "dynamic-features", "else", "exceptions", "execmodel",
    "for", "function", "global", "if", "import", "lambda", "naming", "nonlocal", "pass", "raise",
    "return", "try", "while", "with", "yield",
)  # fmt: skip
_DATA_MODEL_TOPICS = (
    "attribute-access", "bltin-code-objects", "bltin-ellipsis-object", "bltin-null-object",
    "bltin-type-objects", "callable-types", "customization", "dict", "formatstrings", "lists",
    "numeric-types", "objects", "sequence-types", "specialattrs", "specialnames",
    "string-methods", "truth", "types", "typesfunctions", "typesmapping", "typesmethods",
    "typesmodules", "typesseq", "typesseq-mutable",
)  # fmt: skip
# One item in _VALIDATION_BUCKETS goes to validation: a 20 % held-out split.
_VALIDATION_BUCKETS = 5

_TEXT_FILE_TYPES = {".csv": "csv", ".json": "json", ".jsonl": "json", ".txt": "text"}
_CLASSIFICATION_FILE_TYPES = {".csv", ".json", ".jsonl"}
_DEFAULT_TEXT_COLUMNS = ("sentence", "text")


class DataError(ValueError):
    """The data a user pointed at cannot be used as given (missing column, empty file, ...).

    Raised before any tokenization or model loading, so a bad flag costs seconds, not a run.
    """


@dataclass
class ClassificationData:
    """A text classification task, checked and ready to tokenize.

    ``label_list`` holds the distinct labels of the train split in label-id order (sorted, or the
    dataset's own ``ClassLabel`` names), so ``label_list[i]`` is the name of class ``i``.
    """

    datasets: DatasetDict
    text_columns: tuple[str, ...]
    label_column: str
    label_list: list[Any]

    @property
    def num_labels(self) -> int:
        return len(self.label_list)

    @property
    def label_to_id(self) -> dict[Any, int]:
        return {label: i for i, label in enumerate(self.label_list)}


# --------------------------------------------------------------------------------------------
# The embedded offline corpus: pydoc_data.topics
# --------------------------------------------------------------------------------------------

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(“])")
_PROSE_WORD = re.compile(r"[(\"'“*]*[A-Za-z][A-Za-z'’\-]*[\"'”*)]*[,.;:!?]*")


def _is_prose(text: str, min_words: int) -> bool:
    """True for English prose; False for grammar rules, code, tables and headings.

    The topics interleave prose with ``::=`` grammar productions and code samples; a sentence
    counts as prose when at least 70 % of its tokens look like words.
    """
    words = text.split()
    if len(words) < min_words or "::=" in text or ">>>" in text:
        return False
    return sum(bool(_PROSE_WORD.fullmatch(w)) for w in words) >= 0.7 * len(words)


def _topic_paragraphs(topic_text: str) -> list[str]:
    """The prose paragraphs of one topic, each joined onto one line."""
    paragraphs = []
    for block in re.split(r"\n\s*\n", topic_text):
        paragraph = " ".join(line.strip() for line in block.splitlines()).strip()
        if _is_prose(paragraph, min_words=4):
            paragraphs.append(paragraph)
    return paragraphs


def _topic_sentences(topic_text: str) -> list[str]:
    sentences = []
    for paragraph in _topic_paragraphs(topic_text):
        for sentence in _SENTENCE_END.split(paragraph):
            if 6 <= len(sentence.split()) <= 64 and sentence.endswith((".", "?", "!", ":")):
                sentences.append(sentence)
    return sentences


def _bucket(text: str) -> int:
    """A stable pseudo-random bucket for a string (``hash()`` is salted per process)."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")


def _pydoc_topics() -> dict[str, str]:
    from pydoc_data.topics import topics

    return topics


def offline_classification_dataset() -> DatasetDict:
    """The offline binary task: is a sentence about a statement (0) or the data model (1)?

    Sentences come from :mod:`pydoc_data.topics`; a sentence that occurs under topics of both
    groups is dropped (its label would be ambiguous). Both splits are balanced exactly by keeping
    the same number of sentences per class (the larger class is cut in hash order), so chance
    level is 50 % accuracy. Columns: ``sentence`` (str), ``label`` (``ClassLabel`` with names
    :data:`OFFLINE_LABELS`).
    """
    from datasets import ClassLabel, Dataset, DatasetDict, Features, Value

    topics = _pydoc_topics()
    groups = []
    for names in (_STATEMENT_TOPICS, _DATA_MODEL_TOPICS):
        found = [name for name in names if name in topics]
        groups.append({s for name in found for s in _topic_sentences(topics[name])})
    ambiguous = groups[0] & groups[1]
    groups = [sorted(group - ambiguous, key=_bucket) for group in groups]

    features = Features(
        {"sentence": Value("string"), "label": ClassLabel(names=list(OFFLINE_LABELS))}
    )
    splits = {}
    for split, keep in (("train", True), ("validation", False)):
        per_class = [
            [s for s in group if (_bucket(s) % _VALIDATION_BUCKETS != 0) == keep]
            for group in groups
        ]
        n = min(len(sentences) for sentences in per_class)
        rows = [(s, label) for label, sentences in enumerate(per_class) for s in sentences[:n]]
        rows.sort(key=lambda row: _bucket(row[0]))  # interleave the classes, deterministically
        splits[split] = Dataset.from_dict(
            {"sentence": [s for s, _ in rows], "label": [y for _, y in rows]}, features=features
        )
    return DatasetDict(splits)


def offline_lm_dataset() -> DatasetDict:
    """The offline LM corpus: every prose paragraph of :mod:`pydoc_data.topics`, one per row.

    Paragraphs (not sentences) are the unit of the split so that held-out text is coherent; one
    paragraph in five goes to ``validation``. Column: ``text``.
    """
    from datasets import Dataset, DatasetDict

    topics = _pydoc_topics()
    seen: set[str] = set()
    splits: dict[str, list[str]] = {"train": [], "validation": []}
    for name in sorted(topics):
        for paragraph in _topic_paragraphs(topics[name]):
            if paragraph in seen:  # `compound` repeats the text of `if`, `while`, ...
                continue
            seen.add(paragraph)
            held_out = _bucket(paragraph) % _VALIDATION_BUCKETS == 0
            splits["validation" if held_out else "train"].append(paragraph)
    return DatasetDict({k: Dataset.from_dict({"text": v}) for k, v in splits.items()})


# --------------------------------------------------------------------------------------------
# User data: hub datasets and local files
# --------------------------------------------------------------------------------------------


def _has_content(path: Path, chunk_bytes: int = 1 << 20) -> bool:
    """Whether the file holds anything but whitespace; reads only up to the first content."""
    with path.open("rb") as handle:
        while chunk := handle.read(chunk_bytes):
            if chunk.strip():
                return True
    return False


def _check_utf8(path: Path, split: str, chunk_bytes: int = 1 << 20) -> None:
    """Refuse a file that is not UTF-8, naming the byte offset (datasets says it vaguely)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with path.open("rb") as handle:
        while True:
            chunk = handle.read(chunk_bytes)
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as err:
                raise DataError(
                    f"{split} file {str(path)!r} is not UTF-8 text (byte {offset + err.start}: "
                    f"{err.reason}); re-save it as UTF-8"
                ) from None
            if not chunk:
                return
            offset += len(chunk)


def _check_files(files: dict[str, str | None], allowed: Iterable[str]) -> dict[str, str]:
    """Existing, non-empty files of one allowed type; returns ``{split: path}``."""
    allowed = sorted(allowed)
    checked: dict[str, str] = {}
    for split, file in files.items():
        if file is None:
            continue
        path = Path(file)
        if path.suffix.lower() not in allowed:
            raise DataError(
                f"{split} file {file!r} has extension {path.suffix!r}; expected one of {allowed}"
            )
        if not path.is_file():
            raise DataError(f"{split} file {file!r} does not exist")
        if not _has_content(path):
            raise DataError(f"{split} file {file!r} is empty")
        _check_utf8(path, split)
        checked[split] = str(path)
    if len({Path(p).suffix.lower().replace("jsonl", "json") for p in checked.values()}) > 1:
        raise DataError(f"train and validation files must have the same type, got {checked}")
    return checked


def _load_raw(
    dataset_name: str | None,
    dataset_config_name: str | None,
    train_file: str | None,
    validation_file: str | None,
    allowed_suffixes: Iterable[str],
    validation_split_percentage: int,
) -> DatasetDict:
    """Load a hub dataset or local files as a DatasetDict with ``train`` and ``validation``.

    Without a validation split (a lone train file, or a hub dataset with only ``train``), the
    last ``validation_split_percentage`` % of train is held out, as run_glue/run_clm do.
    """
    from datasets import DatasetDict, load_dataset

    if train_file is not None:
        files = _check_files({"train": train_file, "validation": validation_file}, allowed_suffixes)
        builder = _TEXT_FILE_TYPES[Path(files["train"]).suffix.lower()]
        try:
            raw = load_dataset(builder, data_files=files)
        except ValueError as err:  # a csv with a header only: datasets finds "no data"
            if "no data" in str(err):
                raise DataError(f"no rows in the data file(s) {sorted(files.values())}") from err
            # A malformed JSON line: pandas' "Expected object or value at position 27".
            raise DataError(
                f"cannot read the data file(s) {sorted(files.values())}: {_root_cause(err)}"
            ) from err
        except Exception as err:
            # datasets wraps other parse failures in a DatasetGenerationError that says only
            # "An error occurred while generating the dataset"; the reason is its cause.
            if type(err).__name__ != "DatasetGenerationError":
                raise
            raise DataError(
                f"cannot read the data file(s) {sorted(files.values())}: {_root_cause(err)}"
            ) from err
    elif validation_file is not None:
        raise DataError("--validation_file was given without --train_file; pass both or neither")
    else:
        if not dataset_name:
            raise DataError("no data: pass --dataset_name, or --train_file (and --validation_file)")
        raw = load_dataset(dataset_name, dataset_config_name)
    if not isinstance(raw, DatasetDict) or "train" not in raw:
        raise DataError(f"dataset {dataset_name!r} has no 'train' split")
    for split, ds in raw.items():
        if ds.num_rows == 0:
            raise DataError(f"the {split} split of {dataset_name or train_file!r} has no rows")
    if "validation" not in raw:
        if not 0 < validation_split_percentage < 100:
            raise DataError(
                f"validation_split_percentage must be in 1..99, got {validation_split_percentage}"
            )
        n_val = max(1, raw["train"].num_rows * validation_split_percentage // 100)
        if raw["train"].num_rows - n_val < 1:
            raise DataError(
                f"train split has {raw['train'].num_rows} rows: "
                "too few to hold out a validation set"
            )
        n_train = raw["train"].num_rows - n_val
        raw = DatasetDict(
            train=raw["train"].select(range(n_train)),
            validation=raw["train"].select(range(n_train, raw["train"].num_rows)),
        )
    return DatasetDict(train=raw["train"], validation=raw["validation"])


def _root_cause(err: BaseException) -> str:
    """The innermost cause of ``err`` as one line, with a hint for the common one."""
    while err.__cause__ is not None or err.__context__ is not None:
        err = err.__cause__ or err.__context__  # type: ignore[assignment]
    text = " ".join(str(err).split()) or type(err).__name__
    if isinstance(err, UnicodeDecodeError):
        return f"not UTF-8 text ({text}); re-save the file as UTF-8"
    return text


def _require_columns(raw: DatasetDict, columns: dict[str, str], source: str) -> None:
    """Fail if any of ``columns`` (``{column: its flag}``) is missing from any split, naming every
    missing column in one error: a file with two wrong names is fixed in one run, not two."""
    problems = _missing_columns(raw, columns)
    if problems:
        raise DataError(_columns_error(raw, problems, source))


def _missing_columns(raw: DatasetDict, columns: dict[str, str]) -> list[str]:
    """One phrase per missing column: which column, its flag, and the splits that lack it."""
    problems = []
    for column, flag in columns.items():
        lacking = [split for split, ds in raw.items() if column not in ds.column_names]
        if lacking:
            where = " and ".join(lacking)
            problems.append(
                f"column {column!r} ({flag}) not found in the {where} split"
                + ("s" if len(lacking) > 1 else "")
            )
    return problems


def _columns_error(raw: DatasetDict, problems: list[str], source: str) -> str:
    """``problems`` about ``source`` as one message that ends with the columns there are."""
    names = {split: ds.column_names for split, ds in raw.items()}
    if len({tuple(v) for v in names.values()}) == 1:
        available = f"available columns: {next(iter(names.values()))}"
    else:
        available = "available columns: " + ", ".join(f"{k} {v}" for k, v in names.items())
    return f"{source}: " + "; ".join(problems) + f"; {available}"


def load_text_classification(
    dataset_name: str | None = OFFLINE_DATASET,
    dataset_config_name: str | None = None,
    train_file: str | None = None,
    validation_file: str | None = None,
    text_column: str | None = None,
    text_column_2: str | None = None,
    label_column: str = "label",
    validation_split_percentage: int = 10,
) -> ClassificationData:
    """Load and check a text classification task (single sentences or sentence pairs).

    ``dataset_name`` is a hub dataset (``"glue"`` with ``dataset_config_name="sst2"``) or
    :data:`OFFLINE_DATASET`; local ``train_file``/``validation_file`` (csv, json, jsonl) take
    precedence. ``text_column=None`` picks ``sentence`` or ``text``, whichever exists. Labels may
    be strings or integers; every validation label must occur in train. Raises :class:`DataError`
    on anything unusable, before tokenization.
    """
    if train_file is None and validation_file is None and dataset_name == OFFLINE_DATASET:
        raw = offline_classification_dataset()
    else:
        raw = _load_raw(
            dataset_name,
            dataset_config_name,
            train_file,
            validation_file,
            _CLASSIFICATION_FILE_TYPES,
            validation_split_percentage,
        )
    source = repr(train_file or dataset_name)
    # Every column the task needs is checked in one pass, so that one run reports them all.
    problems = []
    if text_column is None:
        columns = raw["train"].column_names
        text_column = next((c for c in _DEFAULT_TEXT_COLUMNS if c in columns), None)
        if text_column is None:
            problems.append(
                f"no text column: none of {list(_DEFAULT_TEXT_COLUMNS)} exists, "
                "name yours with --text_column"
            )
    wanted = {text_column: "--text_column", text_column_2: "--text_column_2"}
    wanted = {column: flag for column, flag in wanted.items() if column is not None}
    wanted.setdefault(label_column, "--label_column")
    problems += _missing_columns(raw, wanted)
    if problems:
        raise DataError(_columns_error(raw, problems, source))
    text_columns = tuple(c for c in (text_column, text_column_2) if c is not None)

    feature = raw["train"].features[label_column]
    names = getattr(feature, "names", None)
    if names is not None:  # a ClassLabel: ids are already 0..n-1, keep the dataset's names
        label_list: list[Any] = list(names)
        known: set[Any] = set(range(len(names)))
    else:
        train_labels = set(raw["train"].unique(label_column))
        if None in train_labels:
            raise DataError(
                f"column {label_column!r} of the train split of {source} has empty labels"
            )
        label_list = sorted(train_labels, key=lambda v: (str(type(v)), v))
        known = train_labels
        fractional = [v for v in label_list if isinstance(v, float) and not v.is_integer()]
        if fractional:
            # 0.5/1.5 or STS-B's 0..5 in halves would silently become 2 or 11 "classes".
            raise DataError(
                f"column {label_column!r} of {source} holds fractional labels "
                f"{fractional[:4]}{' ...' if len(fractional) > 4 else ''}: a regression target, "
                "but this recipe trains a classifier (each distinct value would become a class). "
                "Map the values to class ids or names first."
            )
    for split in ("train", "validation"):
        found = set(raw[split].unique(label_column))
        unknown = sorted(map(str, found - known))
        if unknown:
            raise DataError(
                f"labels {unknown} in the {split} split of {source} (column {label_column!r}) "
                f"are not among the train labels {[str(v) for v in label_list]}"
            )
    if len(label_list) < 2:
        raise DataError(
            f"column {label_column!r} of {source} has {len(label_list)} distinct label(s) "
            f"{label_list}: classification needs at least 2"
        )
    return ClassificationData(raw, text_columns, label_column, label_list)


def check_num_labels(data: ClassificationData, num_labels: int, where: str) -> None:
    """Fail if the model's ``num_labels`` (from ``where``) differs from the data's label set."""
    if num_labels != data.num_labels:
        raise DataError(
            f"the data has {data.num_labels} labels {[str(v) for v in data.label_list]} "
            f"(column {data.label_column!r}) but {where} has num_labels={num_labels}; "
            f"make them match (or drop the explicit num_labels)"
        )


def load_lm_corpus(
    dataset_name: str | None = OFFLINE_DATASET,
    dataset_config_name: str | None = None,
    train_file: str | None = None,
    validation_file: str | None = None,
    text_column: str = "text",
    validation_split_percentage: int = 5,
) -> DatasetDict:
    """Load a language-modelling corpus as a DatasetDict whose only column is ``text``.

    Sources as :func:`load_text_classification`, plus plain ``.txt`` files (one row per line, as
    ``datasets``' text builder reads them). Raises :class:`DataError` before tokenization.
    """
    if train_file is None and validation_file is None and dataset_name == OFFLINE_DATASET:
        return offline_lm_dataset()
    raw = _load_raw(
        dataset_name,
        dataset_config_name,
        train_file,
        validation_file,
        _TEXT_FILE_TYPES,
        validation_split_percentage,
    )
    _require_columns(raw, {text_column: "--text_column"}, repr(train_file or dataset_name))
    raw = raw.select_columns([text_column])
    if text_column != "text":
        raw = raw.rename_column(text_column, "text")
    for split, ds in raw.items():
        if not any(isinstance(t, str) and t.strip() for t in ds["text"]):
            raise DataError(f"the {split} split of {train_file or dataset_name!r} has no text")
    return raw


# --------------------------------------------------------------------------------------------
# Preprocessing
# --------------------------------------------------------------------------------------------


def tokenize_classification(
    data: ClassificationData,
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    label_to_id: dict[Any, int] | None = None,
) -> DatasetDict:
    """Tokenize (truncating to ``max_length``, no padding: the collator pads per batch).

    Labels become integer ids in a ``labels`` column; all other columns are dropped.
    """
    mapping = label_to_id if label_to_id is not None else data.label_to_id
    is_class_label = getattr(data.datasets["train"].features[data.label_column], "names", None)
    columns = data.text_columns

    def encode(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        texts = [batch[c] for c in columns]
        encoded = tokenizer(*texts, truncation=True, max_length=max_length)
        labels = batch[data.label_column]
        encoded["labels"] = labels if is_class_label else [mapping[v] for v in labels]
        return encoded

    return data.datasets.map(
        encode,
        batched=True,
        remove_columns=data.datasets["train"].column_names,
        desc="Tokenizing",
    )


def tokenize_and_chunk(
    corpus: DatasetDict, tokenizer: PreTrainedTokenizerBase, block_size: int
) -> DatasetDict:
    """Tokenize every row, join them (EOS between rows) and cut into ``block_size`` chunks.

    run_clm's concatenate-and-chunk: no padding is ever needed, every token is a training
    target, and the tail shorter than a block is dropped. ``labels`` equal ``input_ids`` (the
    model shifts them). Raises :class:`DataError` when a split is shorter than one block.
    """
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2, got {block_size}")
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []

    def encode(batch: dict[str, list[str]]) -> dict[str, list[list[int]]]:
        texts = [t for t in batch["text"] if t and t.strip()]
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        return {"input_ids": [row + eos for row in ids]}

    def chunk(batch: dict[str, list[list[int]]]) -> dict[str, list[list[int]]]:
        joined = list(itertools.chain.from_iterable(batch["input_ids"]))
        usable = len(joined) // block_size * block_size
        blocks = [joined[i : i + block_size] for i in range(0, usable, block_size)]
        return {"input_ids": blocks, "labels": [list(b) for b in blocks]}

    tokenized = corpus.map(encode, batched=True, remove_columns=["text"], desc="Tokenizing")
    # One map batch of 2000 rows: chunk boundaries only lose < block_size tokens per batch.
    chunked = tokenized.map(chunk, batched=True, batch_size=2000, desc=f"Chunking ({block_size})")
    for split, ds in chunked.items():
        if ds.num_rows == 0:
            raise DataError(
                f"the {split} split has fewer than block_size={block_size} tokens; "
                f"lower --block_size or add text"
            )
    return chunked
