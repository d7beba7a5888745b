#!/usr/bin/env python
"""Fine-tune a BERT-family encoder for text classification, in FP16 done right.

    accelerate launch recipes/finetune_bert.py                      # offline default, ~1 min on CPU
    accelerate launch recipes/finetune_bert.py --config configs/bert_sst2.yaml   # GLUE SST-2, GPU
    python recipes/finetune_bert.py --config configs/bert_offline.yaml --max_steps 20 --lora true

With no arguments it runs ``configs/bert_offline.yaml``: a tiny BERT trained from scratch, in real
FP16 (autocast + amp-trainer's loss scaler, on CPU too), on a sentence classification task built
from the Python documentation that ships with Python (no network). ``--config FILE`` loads any
YAML of these flags (without it, the offline default file is the starting point; ``--config none``
starts from the bare defaults); flags override the file. ``--help`` lists every flag.

Flow: arguments -> data (checked before anything expensive) -> tokenizer -> model (+ LoRA) ->
AmpTrainer.train/evaluate -> save model, metrics.json, training.png, FP16 export, summary table.
What this recipe shares with the GPT-2 one (common flags, parsing, logging, phase timing and
that end of the run) is in ``amp_trainer/recipes/run.py``.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# Only what --help needs up here: it is answered before torch and transformers load (main()).
from amp_trainer.recipes import (
    SharedDataArguments,
    SharedModelArguments,
    answer_help,
    run_entry_point,
)

logger = logging.getLogger("finetune_bert")

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "bert_offline.yaml"


@dataclass
class ModelArguments(SharedModelArguments):  # + tokenizer_vocab_size, lora, lora_r/alpha/dropout
    model_name_or_path: str = field(
        default="tiny-bert",
        metadata={
            "help": "A hub id or local folder for from_pretrained, 'offline:all-MiniLM-L6-v2' "
            "(the pretrained MiniLM of the offline extra), or 'tiny-bert' (from scratch, with a "
            "WordPiece tokenizer trained on the train split)."
        },
    )
    num_labels: int | None = field(
        default=None,
        metadata={"help": "Expected number of labels; an error if the data has another number."},
    )
    ignore_mismatched_sizes: bool = field(
        default=False,
        metadata={"help": "Load a classifier checkpoint whose head has another num_labels."},
    )


@dataclass
class DataArguments(SharedDataArguments):  # + dataset, files, max_train/eval_samples
    text_column: str | None = field(
        default=None, metadata={"help": "Text column; default 'sentence' or 'text'."}
    )
    text_column_2: str | None = field(
        default=None, metadata={"help": "Second text column for sentence-pair tasks."}
    )
    label_column: str = field(default="label", metadata={"help": "Label column."})
    max_seq_length: int = field(default=128, metadata={"help": "Truncate inputs to this."})


def compute_metrics(eval_pred) -> dict[str, float]:
    """Accuracy, plus F1 of class 1 for binary tasks (computed here: no `evaluate` download)."""
    logits, labels = eval_pred
    preds = np.argmax(logits, axis=-1)
    metrics = {"accuracy": float((preds == labels).mean())}
    if logits.shape[-1] == 2:
        tp = float(((preds == 1) & (labels == 1)).sum())
        fp = float(((preds == 1) & (labels == 0)).sum())
        fn = float(((preds == 0) & (labels == 1)).sum())
        metrics["f1"] = 2 * tp / (2 * tp + fp + fn) if tp else 0.0
    return metrics


def main(argv: list[str]) -> None:
    answer_help(Path(__file__).name, argv, (ModelArguments, DataArguments), DEFAULT_CONFIG)
    from transformers import DataCollatorWithPadding

    from amp_trainer import AmpTrainer
    from amp_trainer.recipes import (
        CLASSIFICATION,
        RecipeRun,
        accuracy_against_majority,
        apply_lora,
        apply_sample_limits,
        build_classifier,
        check_labels_against_model,
        check_sequence_length,
        classification_tokenizer,
        load_text_classification,
        tokenize_classification,
        validation_size_hint,
    )

    # ---- config: the YAML file and flags; the user's choices are checked before anything costly
    run = RecipeRun.parse(
        "finetune_bert", argv, ModelArguments, DataArguments, DEFAULT_CONFIG, task=CLASSIFICATION
    )
    model_args, data_args, training_args = run.model_args, run.data_args, run.training_args
    check_sequence_length(
        model_args.model_name_or_path, data_args.max_seq_length, "--max_seq_length"
    )
    run.start(count_input_tokens="non_padding")  # logging, seed, the precision line

    # ---- data: every check on the user's input runs before tokenization and model loading
    with run.phase("data"):
        data = load_text_classification(
            data_args.dataset_name,
            data_args.dataset_config_name,
            data_args.train_file,
            data_args.validation_file,
            data_args.text_column,
            data_args.text_column_2,
            data_args.label_column,
        )
        check_labels_against_model(
            model_args.model_name_or_path,
            data,
            model_args.num_labels,
            model_args.ignore_mismatched_sizes,
        )
        apply_sample_limits(data.datasets, data_args)
        labels = np.asarray(data.datasets["validation"][data.label_column])
        values, counts = np.unique(labels, return_counts=True)
        majority = float(counts.max() / counts.sum())  # the accuracy of always answering it
        top = values[counts.argmax()].item()  # a label, or a ClassLabel's id of one
        majority_label = top if top in data.label_to_id else data.label_list[top]
        logger.info(
            "%d train / %d validation examples, labels %s (majority-class accuracy %.3f)",
            data.datasets["train"].num_rows,
            data.datasets["validation"].num_rows,
            data.label_list,
            majority,
        )

    # ---- tokenizer (trained on the train split for from-scratch models; rank 0 first: cache)
    with run.phase("tokenizer and map"), training_args.main_process_first(desc="tokenizer"):
        texts = [t for c in data.text_columns for t in data.datasets["train"][c]]
        tokenizer = classification_tokenizer(
            model_args.model_name_or_path,
            texts,
            model_args.tokenizer_vocab_size,
            data_args.max_seq_length,
            checkpoint=training_args.resume_from_checkpoint,  # resuming: the checkpoint's own
        )
        encoded = tokenize_classification(data, tokenizer, data_args.max_seq_length)

    # ---- model
    with run.phase("model"):
        model = build_classifier(
            model_args.model_name_or_path,
            data.label_list,
            len(tokenizer),
            model_args.ignore_mismatched_sizes,
        )
        if model_args.lora:  # on query/value; the new classifier head stays trainable
            model = apply_lora(
                model,
                CLASSIFICATION,
                model_args.lora_r,
                model_args.lora_alpha,
                model_args.lora_dropout,
            )
        run.log_model_size(model)

    # ---- trainer; train, evaluate, save
    run.settle_ddp(model)  # no search for unused parameters where none exist
    trainer = AmpTrainer(
        model=model,
        args=training_args,
        train_dataset=encoded["train"],
        eval_dataset=encoded["validation"],
        processing_class=tokenizer,
        data_collator=DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8),
        compute_metrics=compute_metrics,
    )
    train_result, eval_metrics = run.train_evaluate_save(trainer)

    # ---- finish: training.png, FP16 export + parity report, metrics.json, summary table
    accuracy, accuracy_note = accuracy_against_majority(
        eval_metrics.get("eval_accuracy"), majority, majority_label
    )
    notes = [accuracy_note, validation_size_hint(data.datasets["validation"].num_rows)]
    run.finish(
        trainer,
        train_result,
        model,
        export_samples=list(data.datasets["validation"][data.text_columns[0]][:8]),
        results={"eval": eval_metrics, "majority_class_accuracy": majority},
        summary=[
            ("eval accuracy", accuracy),  # with the majority-class baseline beside it
            ("eval f1", eval_metrics.get("eval_f1")),
            ("eval loss", eval_metrics.get("eval_loss")),
        ],
        notes=[note for note in notes if note],
    )


if __name__ == "__main__":
    # Every failure is one line on stderr: exit 2 for a usage error, 1 for a runtime failure
    # (traceback in a log file named on the line, or on stderr with AMP_TRAINER_DEBUG=1).
    sys.exit(run_entry_point(lambda: main(sys.argv[1:]), "finetune_bert"))
