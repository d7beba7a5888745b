"""The flags every recipe has, as plain dataclasses, and the YAML file of their values.

Kept apart from :mod:`amp_trainer.recipes.run` and :mod:`amp_trainer.recipes.config` (which
parse them with transformers' ``HfArgumentParser``) so that a recipe's ``--help`` can list them
without importing transformers or torch (:mod:`amp_trainer.recipes.help`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from amp_trainer.entry_point import UsageError, one_line
from amp_trainer.recipes.data import OFFLINE_DATASET

__all__ = [
    "RunArguments",
    "SharedDataArguments",
    "SharedModelArguments",
    "load_yaml_config",
    "split_config_flag",
]


@dataclasses.dataclass
class RunArguments:
    """Flags every recipe has about the run itself (not the model, data or training)."""

    reuse_output_dir: bool = dataclasses.field(
        default=False,
        metadata={
            "help": "Start a new run in an output_dir that holds a previous run (metrics.json or "
            "checkpoints): its final model, metrics.json and export are replaced, its "
            "checkpoints are kept (never rotated away; one this run would overwrite is moved to "
            "previous-run-checkpoints/ first). Without it such an output_dir is refused; "
            "resuming one of its own checkpoints (--resume_from_checkpoint) needs no flag."
        },
    )


def load_yaml_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a recipe YAML file: a flat mapping of argument names to values."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise UsageError(f"config file {str(path)!r} is not valid YAML: {one_line(err)}") from err
    if not isinstance(data, dict):
        raise UsageError(
            f"config file {str(path)!r} must hold a mapping of argument names to values, "
            f"got {type(data).__name__}"
        )
    return data


def split_config_flag(
    argv: Sequence[str],
    default_config: str | os.PathLike[str] | None,
    on_error: Callable[[str], NoReturn] | None = None,
) -> tuple[str | os.PathLike[str] | None, list[str]]:
    """The config file a recipe run starts from, and ``argv`` without its ``--config FILE``.

    ``--config FILE`` wins over ``default_config``; ``--config none`` (or an empty value) means
    no file: the dataclasses' own defaults. The parse of the flags and the short help both read
    it, so they agree on which file's values a run uses. ``on_error``, if given, replaces
    argparse's usage-and-exit on a malformed ``--config``.
    """
    pre = argparse.ArgumentParser(add_help=False)
    if on_error is not None:
        pre.error = on_error  # type: ignore[method-assign]
    pre.add_argument("--config", default=None)
    known, rest = pre.parse_known_args(list(argv))
    config = default_config if known.config is None else known.config
    if str(config).lower() in ("", "none"):
        config = None
    return config, rest


@dataclass
class SharedModelArguments:
    """The model flags both recipes have; a recipe subclasses it for its defaults and own flags
    (``recipes/finetune_bert.py``'s ``ModelArguments``), parsed by ``HfArgumentParser``."""

    model_name_or_path: str = field(
        metadata={"help": "A hub id or local folder for from_pretrained."}
    )
    tokenizer_vocab_size: int = field(
        default=2000,
        metadata={"help": "Vocabulary size of the tokenizer trained for from-scratch models."},
    )
    lora: bool = field(
        default=False,
        metadata={
            "help": "Train LoRA adapters on the attention projections (peft), not all weights."
        },
    )
    lora_r: int = field(default=8, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA alpha (scale = alpha / r)."})
    lora_dropout: float = field(default=0.1, metadata={"help": "Dropout on the LoRA input."})


@dataclass
class SharedDataArguments:
    """The data flags both recipes have (hub dataset, local files, sample limits); a recipe
    subclasses it for its columns and sequence length, parsed by ``HfArgumentParser``."""

    dataset_name: str | None = field(
        default=OFFLINE_DATASET,
        metadata={
            "help": f"A hub dataset (its config in --dataset_config_name; configs/*.yaml name "
            f"some) or '{OFFLINE_DATASET}' (built in, no network). Ignored when --train_file "
            "is given."
        },
    )
    dataset_config_name: str | None = field(default=None, metadata={"help": "Hub dataset config."})
    train_file: str | None = field(
        default=None, metadata={"help": "Local csv/json/jsonl (txt too for language modelling)."}
    )
    validation_file: str | None = field(
        default=None,
        metadata={"help": "Local file; default: the last 10%% of train (LM: 5%%) held out."},
    )
    max_train_samples: int | None = field(
        default=None, metadata={"help": "Use only the first N training examples (LM: blocks)."}
    )
    max_eval_samples: int | None = field(
        default=None, metadata={"help": "Use only the first N validation examples (LM: blocks)."}
    )
