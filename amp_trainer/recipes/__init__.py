"""The recipes' building blocks, as public API: what ``recipes/finetune_bert.py`` and
``recipes/finetune_gpt2.py`` are made of, for writing a recipe of your own.

Why a public subpackage (litgpt's and trl's choice) rather than private code beside ``recipes/``
(torchtitan's): the ``amp-trainer doctor --config`` command builds a recipe's model and batch
exactly as the recipe does, and a user who adapts a recipe, or trains the same offline tokenizer
for a TRL example, should import documented names rather than copy 3k lines. The rule in both
directions (``tests/project/test_public_api.py`` enforces it):

* this package depends on the core (``amp_trainer.AmpTrainer``, the scaler, export, ...); the
  core never imports it. Only :mod:`amp_trainer.cli` does, inside ``doctor --config`` /
  ``doctor --model tiny-bert``; ``export`` and ``doctor --model DIR`` never load it;
* the names in :data:`__all__` are the API (docs/reference/recipes.md lists each); its submodules
  (``data``, ``models``, ``run``, ...) are organisation and may move between releases.

Names are resolved lazily (PEP 562), as in :mod:`amp_trainer`: importing the package costs
nothing until a name is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from amp_trainer.lazy_exports import lazy_attributes

__all__ = [
    "CAUSAL_LM",
    "CLASSIFICATION",
    "OFFLINE_DATASET",
    "OFFLINE_MINILM",
    "TINY_MODEL_CONFIGS",
    "ClassificationData",
    "DataError",
    "LossScaleSummary",
    "RecipeBatch",
    "RecipeRun",
    "RunArguments",
    "SharedDataArguments",
    "SharedModelArguments",
    "UsageError",
    "accuracy_against_majority",
    "answer_help",
    "apply_lora",
    "apply_sample_limits",
    "build_causal_lm",
    "build_classifier",
    "causal_lm_tokenizer",
    "check_labels_against_model",
    "check_sequence_length",
    "classification_tokenizer",
    "load_lm_corpus",
    "load_recipe_batch",
    "load_text_classification",
    "offline_classification_dataset",
    "offline_lm_dataset",
    "parse_args_with_config",
    "plot_training",
    "resolve_model_path",
    "run_entry_point",
    "summarize_loss_scale",
    "tokenize_and_chunk",
    "tokenize_classification",
    "train_byte_level_bpe_tokenizer",
    "train_wordpiece_tokenizer",
    "training_length_hint",
    "validation_size_hint",
]

_WHERE = {
    "RecipeRun": "amp_trainer.recipes.run",
    "SharedDataArguments": "amp_trainer.recipes.arguments",
    "SharedModelArguments": "amp_trainer.recipes.arguments",
    "apply_sample_limits": "amp_trainer.recipes.run",
    "RunArguments": "amp_trainer.recipes.arguments",
    "answer_help": "amp_trainer.recipes.help",
    "parse_args_with_config": "amp_trainer.recipes.config",
    "UsageError": "amp_trainer.entry_point",
    "run_entry_point": "amp_trainer.entry_point",
    "OFFLINE_MINILM": "amp_trainer.offline_model",
    "resolve_model_path": "amp_trainer.offline_model",
    "OFFLINE_DATASET": "amp_trainer.recipes.data",
    "ClassificationData": "amp_trainer.recipes.data",
    "DataError": "amp_trainer.recipes.data",
    "load_lm_corpus": "amp_trainer.recipes.data",
    "load_text_classification": "amp_trainer.recipes.data",
    "offline_classification_dataset": "amp_trainer.recipes.data",
    "offline_lm_dataset": "amp_trainer.recipes.data",
    "tokenize_and_chunk": "amp_trainer.recipes.data",
    "tokenize_classification": "amp_trainer.recipes.data",
    "train_byte_level_bpe_tokenizer": "amp_trainer.recipes.tokenizers",
    "train_wordpiece_tokenizer": "amp_trainer.recipes.tokenizers",
    "CAUSAL_LM": "amp_trainer.recipes.models",
    "CLASSIFICATION": "amp_trainer.recipes.models",
    "TINY_MODEL_CONFIGS": "amp_trainer.recipes.models",
    "RecipeBatch": "amp_trainer.recipes.models",
    "apply_lora": "amp_trainer.recipes.models",
    "build_causal_lm": "amp_trainer.recipes.models",
    "build_classifier": "amp_trainer.recipes.models",
    "causal_lm_tokenizer": "amp_trainer.recipes.models",
    "check_labels_against_model": "amp_trainer.recipes.models",
    "check_sequence_length": "amp_trainer.recipes.models",
    "classification_tokenizer": "amp_trainer.recipes.models",
    "load_recipe_batch": "amp_trainer.recipes.models",
    "LossScaleSummary": "amp_trainer.recipes.reporting",
    "accuracy_against_majority": "amp_trainer.recipes.reporting",
    "plot_training": "amp_trainer.recipes.reporting",
    "summarize_loss_scale": "amp_trainer.recipes.reporting",
    "training_length_hint": "amp_trainer.recipes.reporting",
    "validation_size_hint": "amp_trainer.recipes.reporting",
}

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from amp_trainer.entry_point import UsageError, run_entry_point
    from amp_trainer.offline_model import OFFLINE_MINILM, resolve_model_path
    from amp_trainer.recipes.arguments import (
        RunArguments,
        SharedDataArguments,
        SharedModelArguments,
    )
    from amp_trainer.recipes.config import parse_args_with_config
    from amp_trainer.recipes.data import (
        OFFLINE_DATASET,
        ClassificationData,
        DataError,
        load_lm_corpus,
        load_text_classification,
        offline_classification_dataset,
        offline_lm_dataset,
        tokenize_and_chunk,
        tokenize_classification,
    )
    from amp_trainer.recipes.help import answer_help
    from amp_trainer.recipes.models import (
        CAUSAL_LM,
        CLASSIFICATION,
        TINY_MODEL_CONFIGS,
        RecipeBatch,
        apply_lora,
        build_causal_lm,
        build_classifier,
        causal_lm_tokenizer,
        check_labels_against_model,
        check_sequence_length,
        classification_tokenizer,
        load_recipe_batch,
    )
    from amp_trainer.recipes.reporting import (
        LossScaleSummary,
        accuracy_against_majority,
        plot_training,
        summarize_loss_scale,
        training_length_hint,
        validation_size_hint,
    )
    from amp_trainer.recipes.run import RecipeRun, apply_sample_limits
    from amp_trainer.recipes.tokenizers import (
        train_byte_level_bpe_tokenizer,
        train_wordpiece_tokenizer,
    )


__getattr__, __dir__ = lazy_attributes(globals(), _WHERE)
