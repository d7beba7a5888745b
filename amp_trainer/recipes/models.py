"""Recipe models: the tokenizer and model a recipe's ``model_name_or_path`` names, built once.

Both recipes (``recipes/finetune_bert.py``, ``recipes/finetune_gpt2.py``) and
``amp-trainer doctor --config`` build their tokenizer and model here, so the doctor diagnoses the
model the recipe trains, not a copy that may drift from it:

* ``tiny-bert`` / ``tiny-gpt2``: from scratch, sizes in :data:`TINY_MODEL_CONFIGS`, with a tokenizer
  trained on the train split (:mod:`amp_trainer.recipes.tokenizers`);
* :data:`OFFLINE_MINILM`: the pretrained MiniLM-L6 of the ``offline`` extra;
* anything else: a hub id or local folder for ``from_pretrained`` (classifiers get the data's
  label maps and a fresh head);
* optionally LoRA adapters (peft) on the attention projections.

:func:`load_recipe_batch` reduces a recipe config to one step (model, tokenizer, first training
batch, learning rate) for the doctor.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from amp_trainer.offline_model import OFFLINE_MINILM, resolve_model_path
from amp_trainer.recipes.data import (
    OFFLINE_DATASET,
    ClassificationData,
    DataError,
    check_num_labels,
    load_lm_corpus,
    load_text_classification,
    tokenize_and_chunk,
    tokenize_classification,
)
from amp_trainer.recipes.tokenizers import (
    train_byte_level_bpe_tokenizer,
    train_wordpiece_tokenizer,
)

if TYPE_CHECKING:  # pragma: no cover - imported lazily: `transformers` is heavy
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "CAUSAL_LM",
    "CLASSIFICATION",
    "OFFLINE_MINILM",
    "TINY_MODEL_CONFIGS",
    "RecipeBatch",
    "apply_lora",
    "build_causal_lm",
    "build_classifier",
    "causal_lm_tokenizer",
    "check_labels_against_model",
    "check_model_path",
    "check_sequence_length",
    "checkpoint_tokenizer",
    "classification_tokenizer",
    "load_recipe_batch",
    "resolve_model_path",
]

logger = logging.getLogger(__name__)

# What a checkpoint holds when the Trainer saved its tokenizer (processing_class) in it.
_CHECKPOINT_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

#: Recipe task of a config: ``recipes/finetune_bert.py`` or ``recipes/finetune_gpt2.py``.
CLASSIFICATION, CAUSAL_LM = "classification", "causal-lm"
_RECIPE_SCRIPTS = {
    CLASSIFICATION: "recipes/finetune_bert.py",
    CAUSAL_LM: "recipes/finetune_gpt2.py",
}

#: The from-scratch sizes behind the recipes' ``model_name_or_path: tiny-bert`` / ``tiny-gpt2``.
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
# DataArguments (tests/cli/test_cli.py checks these against the recipes).
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


def check_model_path(name: str, task: str | None = None) -> None:
    """Refuse a local ``model_name_or_path`` that is not a model folder, in words a user reads.

    transformers would fail later, after the data is loaded, with a message about tokenizer
    backends or a missing file; a name that is no local path is left to ``from_pretrained``.
    ``task`` (:data:`CLASSIFICATION` or :data:`CAUSAL_LM`, the recipe's): the other recipe's
    from-scratch name is refused, since its sizes are another architecture's keywords (the BERT
    recipe given ``tiny-gpt2`` built an 87.6M-parameter BERT-base from them).
    """
    if task is not None and name in _TINY_TASK and _TINY_TASK[name] != task:
        own = next(tiny for tiny, kind in _TINY_TASK.items() if kind == task)
        raise DataError(
            f"--model_name_or_path {name!r} is the from-scratch model of the {_TINY_TASK[name]} "
            f"recipe ({_RECIPE_SCRIPTS[_TINY_TASK[name]]}); this {task} recipe takes {own!r}, "
            + (f"{OFFLINE_MINILM!r}, " if task == CLASSIFICATION else "")
            + "a hub id or a local model folder"
        )
    if name in TINY_MODEL_CONFIGS or name == OFFLINE_MINILM:
        return
    path = os.path.expanduser(name)
    if not os.path.exists(path):
        _check_offline_hub_id(name)
        return
    if not os.path.isdir(path):
        raise DataError(f"--model_name_or_path {name!r} is a file, not a model folder")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise DataError(
            f"--model_name_or_path {name!r} has no config.json: not a saved model folder (save one "
            "with save_pretrained, or pass tiny-bert/tiny-gpt2 or a hub id)"
        )


def _check_offline_hub_id(name: str) -> None:
    """Offline (``HF_HUB_OFFLINE=1``), a hub id that is not in the Hugging Face cache cannot load:
    say so now, with the names that would, instead of transformers' "check your internet
    connection" after the data is loaded (the likelier cause offline is a mistyped name)."""
    import difflib

    from huggingface_hub import constants, scan_cache_dir, try_to_load_from_cache

    if not constants.HF_HUB_OFFLINE:
        return  # online, from_pretrained resolves (or refuses) the id itself
    try:
        if isinstance(try_to_load_from_cache(name, "config.json"), str):
            return
    except ValueError:  # not even a valid repo id (HFValidationError)
        pass
    try:
        cached = sorted(
            repo.repo_id for repo in scan_cache_dir().repos if repo.repo_type == "model"
        )
    except Exception:  # no cache folder yet (CacheNotFound), or one that does not read
        cached = []
    local = [*TINY_MODEL_CONFIGS, OFFLINE_MINILM]
    close = difflib.get_close_matches(name, [*local, *cached], n=1, cutoff=0.6)
    raise DataError(
        f"--model_name_or_path {name!r}: no such local folder, and not in the Hugging Face cache "
        "(HF_HUB_OFFLINE=1: nothing is downloaded)"
        + (f"; did you mean {close[0]!r}?" if close else "; check the name.")
        + f" Names that load offline: {', '.join(local)}, a local model folder"
        + (
            f", or a cached id ({', '.join(cached[:5])}{' ...' if len(cached) > 5 else ''})"
            if cached
            else ""
        )
    )


def check_sequence_length(name: str, length: int, flag: str, *, bounded: bool = True) -> None:
    """Refuse ``length`` (``--max_seq_length``, ``--block_size``) outside [1, positions].

    ``0`` would disable truncation silently, and a length above the model's position table
    dies inside its embeddings after everything is built. ``bounded=False``: only ``>= 1``
    (a from-scratch GPT-2 gets as many positions as its block size).
    """
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise DataError(f"{flag} must be an integer >= 1, got {length!r}")
    if not bounded:
        return
    if name in TINY_MODEL_CONFIGS:
        sizes: dict[str, Any] = TINY_MODEL_CONFIGS[name]
    else:
        from transformers import AutoConfig

        sizes = AutoConfig.from_pretrained(resolve_model_path(name)).to_dict()
    positions = sizes.get("max_position_embeddings") or sizes.get("n_positions")
    if positions and length > positions:
        raise DataError(
            f"{flag} {length} is more than {name!r} has positions ({positions}); use at most "
            f"{positions}"
        )


# --------------------------------------------------------------------------------------------
# Tokenizer and model of a model_name_or_path (the recipes and the doctor call these)
# --------------------------------------------------------------------------------------------


def checkpoint_tokenizer(checkpoint: str | os.PathLike[str], name: str) -> Any | None:
    """The tokenizer saved in the checkpoint being resumed, ``None`` if it holds none.

    Why: a from-scratch model's tokenizer is *trained*, and tokenizer training is not
    deterministic (WordPiece ties break differently from one process to the next). Retraining it
    on resume, on a new node or with a cleared cache, would feed the checkpoint ids of another
    vocabulary: hundreds of the 2000 ids change, and the run goes on without an error. The
    checkpoint's own ``tokenizer.json`` is the only one the model was trained with. A tiny model's
    checkpoint without one cannot be resumed faithfully, so that is refused; a pretrained model's
    tokenizer is re-read from ``name`` (it is a file, not retrained).
    """
    folder = Path(checkpoint)
    if not any((folder / file).is_file() for file in _CHECKPOINT_TOKENIZER_FILES):
        if name in TINY_MODEL_CONFIGS:
            raise DataError(
                f"checkpoint {str(folder)!r} holds no tokenizer.json: the tokenizer {name!r} was "
                "trained with cannot be rebuilt identically (tokenizer training is not "
                "deterministic). Resume from a checkpoint saved with its tokenizer (the recipes "
                "save it in every checkpoint), or start a new run."
            )
        return None
    for file in ("tokenizer.json", "tokenizer_config.json"):
        if (folder / file).is_file():
            try:
                json.loads((folder / file).read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, ValueError) as err:
                raise DataError(
                    f"{folder / file} is unreadable ({_first_line(err)}): the checkpoint's "
                    "tokenizer is damaged. Restore it from a copy, or resume from another "
                    "checkpoint."
                ) from None
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except Exception as err:  # tokenizers raises bare Exceptions for a garbled file
        raise DataError(
            f"cannot load the tokenizer saved in checkpoint {str(folder)!r}: {_first_line(err)}"
        ) from None
    logger.info("Resuming: the tokenizer is the checkpoint's (%s), not retrained", folder)
    return tokenizer


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def classification_tokenizer(
    name: str,
    train_texts: Sequence[str],
    vocab_size: int,
    max_length: int,
    *,
    checkpoint: str | os.PathLike[str] | None = None,
) -> PreTrainedTokenizerBase:
    """A WordPiece tokenizer trained on ``train_texts`` for a tiny model, else ``name``'s own;
    resuming (``checkpoint``), the checkpoint's own (:func:`checkpoint_tokenizer`)."""
    if checkpoint is not None:
        tokenizer = checkpoint_tokenizer(checkpoint, name)
        if tokenizer is not None:
            tokenizer.model_max_length = max_length
            return tokenizer
    if name in TINY_MODEL_CONFIGS:
        return train_wordpiece_tokenizer(train_texts, vocab_size, max_length)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path(name))


def causal_lm_tokenizer(
    name: str,
    train_texts: Sequence[str],
    vocab_size: int,
    *,
    checkpoint: str | os.PathLike[str] | None = None,
) -> PreTrainedTokenizerBase:
    """A byte-level BPE tokenizer trained on ``train_texts`` for a tiny model, else ``name``'s own
    (with EOS as its padding token: GPT-2 has none; never used for padding, since blocks are
    chunked to one length, but ``generate()`` and collators want one); resuming
    (``checkpoint``), the checkpoint's own (:func:`checkpoint_tokenizer`)."""
    if checkpoint is not None:
        tokenizer = checkpoint_tokenizer(checkpoint, name)
        if tokenizer is not None:
            if tokenizer.pad_token is None:
                tokenizer.pad_token = tokenizer.eos_token
            return tokenizer
    if name in TINY_MODEL_CONFIGS:
        return train_byte_level_bpe_tokenizer(train_texts, vocab_size)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(name))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def check_labels_against_model(
    name: str,
    data: ClassificationData,
    num_labels: int | None = None,
    ignore_mismatched_sizes: bool = False,
) -> None:
    """Label set vs model, before loading weights: ``num_labels`` (``--num_labels``), or the
    head of a classifier checkpoint (unless ``ignore_mismatched_sizes``)."""
    if num_labels is not None:
        check_num_labels(data, num_labels, "--num_labels")
    if name in TINY_MODEL_CONFIGS or ignore_mismatched_sizes:
        return
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(resolve_model_path(name))
    is_classifier = any(a.endswith("ForSequenceClassification") for a in config.architectures or [])
    if is_classifier:
        check_num_labels(data, config.num_labels, f"the classifier checkpoint {name!r}")


def build_classifier(
    name: str, label_list: Sequence[Any], vocab_size: int, ignore_mismatched_sizes: bool = False
) -> Any:
    """The classifier: from a named tiny config, or from_pretrained with a fresh head.

    ``label_list[i]`` names class ``i``; it becomes the config's ``id2label``/``label2id``, so a
    saved model and its export report labels by name.
    """
    from transformers import (
        AutoConfig,
        AutoModelForSequenceClassification,
        BertConfig,
        BertForSequenceClassification,
    )

    id2label = {i: str(label) for i, label in enumerate(label_list)}
    label2id = {label: i for i, label in id2label.items()}
    labels = dict(num_labels=len(label_list), id2label=id2label, label2id=label2id)
    if name in TINY_MODEL_CONFIGS:
        config = BertConfig(vocab_size=vocab_size, **labels, **TINY_MODEL_CONFIGS[name])
        return BertForSequenceClassification(config)
    path = resolve_model_path(name)
    config = AutoConfig.from_pretrained(path, **labels)
    return AutoModelForSequenceClassification.from_pretrained(
        path, config=config, ignore_mismatched_sizes=ignore_mismatched_sizes
    )


def build_causal_lm(name: str, tokenizer: PreTrainedTokenizerBase, block_size: int) -> Any:
    """The LM: from a named tiny config (positions = ``block_size``), or from_pretrained."""
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    if name in TINY_MODEL_CONFIGS:
        config = GPT2Config(
            vocab_size=len(tokenizer),
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            **{**TINY_MODEL_CONFIGS[name], "n_positions": block_size},
        )
        model = GPT2LMHeadModel(config)
    else:
        model = AutoModelForCausalLM.from_pretrained(resolve_model_path(name))
    # transformers derives ``loss_type`` from the class name, and "GPT2LMHeadModel" names no
    # loss: its first loss then logs "`loss_type=None` was set in the config but it is
    # unrecognized. Using the default loss: `ForCausalLMLoss`", though nobody set anything and
    # that default is the right loss. Naming it keeps the same function and drops the line.
    if getattr(model, "loss_type", "") is None:
        model.loss_type = "ForCausalLM"
    return model


def apply_lora(model: Any, task: str, r: int, alpha: int, dropout: float) -> Any:
    """``model`` wrapped by peft with LoRA adapters on its attention projections.

    Classification: ``query``/``value`` (BERT), with the new classifier head kept trainable by
    ``TaskType.SEQ_CLS``; causal LM: GPT-2's fused ``c_attn``, whose Conv1D stores weights as
    (in, out), hence ``fan_in_fan_out``.
    """
    from peft import LoraConfig, TaskType, get_peft_model

    if task == CLASSIFICATION:
        lora = LoraConfig(
            task_type=TaskType.SEQ_CLS,
            target_modules=["query", "value"],
            r=r,
            lora_alpha=alpha,
            lora_dropout=dropout,
        )
    else:
        lora = LoraConfig(
            task_type=TaskType.CAUSAL_LM,
            target_modules=["c_attn"],
            fan_in_fan_out=True,
            r=r,
            lora_alpha=alpha,
            lora_dropout=dropout,
        )
    return get_peft_model(model, lora)


# --------------------------------------------------------------------------------------------
# A recipe config as one batch (for the NaN doctor)
# --------------------------------------------------------------------------------------------


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

    from amp_trainer.recipes.config import RunArguments
    from amp_trainer.training_args import AmpTrainingArguments

    names = {
        f.name for cls in (AmpTrainingArguments, RunArguments) for f in dataclasses.fields(cls)
    }
    # One setting, two spellings across transformers 5.x; the recipes' config loader translates
    # between them (config._spell_for_installed_transformers), so both are valid here.
    return frozenset(names | {"group_by_length", "train_sampling_strategy"})


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
        from amp_trainer.recipes.config import load_yaml_config

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


def _data_source(values: dict[str, Any]) -> tuple[str, str | None, str | None, str | None]:
    """Where a recipe config's data comes from, in the loaders' argument order: the dataset name
    (offline default), its config name, and the train / validation files."""
    return (
        _config_value(values, "dataset_name", str, OFFLINE_DATASET),
        _config_value(values, "dataset_config_name", str, None),
        _config_value(values, "train_file", str, None),
        _config_value(values, "validation_file", str, None),
    )


def _classification_batch(
    values: dict[str, Any], name: str, batch_size: int
) -> tuple[Any, Any, dict[str, Any]]:
    from datasets import DatasetDict
    from transformers import DataCollatorWithPadding

    data = load_text_classification(
        *_data_source(values),
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
    texts = [t for c in data.text_columns for t in data.datasets["train"][c]]
    vocab_size = _config_value(values, "tokenizer_vocab_size", int, 2000)
    tokenizer = classification_tokenizer(name, texts, vocab_size, max_length)
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

    mismatched = _config_value(values, "ignore_mismatched_sizes", bool, False)
    model = _seeded(
        values, lambda: build_classifier(name, data.label_list, len(tokenizer), mismatched)
    )
    return model, tokenizer, batch


def _causal_lm_batch(
    values: dict[str, Any], name: str, batch_size: int
) -> tuple[Any, Any, dict[str, Any]]:
    from datasets import DatasetDict
    from transformers import default_data_collator

    corpus = load_lm_corpus(
        *_data_source(values),
        _config_value(values, "text_column", str, "text"),
    )
    vocab_size = _config_value(values, "tokenizer_vocab_size", int, 2000)
    tokenizer = causal_lm_tokenizer(name, corpus["train"]["text"], vocab_size)
    block_size = min(_config_value(values, "block_size", int, 128), tokenizer.model_max_length)
    # Only train blocks are needed; chunking joins rows, so the whole split is tokenized.
    blocks = tokenize_and_chunk(DatasetDict(train=corpus["train"]), tokenizer, block_size)["train"]
    limit = _config_value(values, "max_train_samples", int, None)
    rows = min(batch_size, blocks.num_rows, limit or batch_size)
    batch = dict(default_data_collator([blocks[i] for i in range(rows)]))

    model = _seeded(values, lambda: build_causal_lm(name, tokenizer, block_size))
    return model, tokenizer, batch
