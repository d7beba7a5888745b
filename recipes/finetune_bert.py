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
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import transformers
from transformers import DataCollatorWithPadding, HfArgumentParser

from amp_trainer import AmpTrainer, AmpTrainingArguments, export_fp16
from amp_trainer.atomic_files import write_json_atomic
from amp_trainer.recipe_support.config import (
    RunArguments,
    check_output_dir,
    parse_args_with_config,
    run_entry_point,
)
from amp_trainer.recipe_support.data import (
    OFFLINE_DATASET,
    load_text_classification,
    tokenize_classification,
)
from amp_trainer.recipe_support.models import (
    CLASSIFICATION,
    apply_lora,
    build_classifier,
    check_labels_against_model,
    check_model_path,
    check_sequence_length,
    classification_tokenizer,
)
from amp_trainer.recipe_support.reporting import (
    format_table,
    peak_memory,
    plot_training,
    summarize_loss_scale,
)

logger = logging.getLogger("finetune_bert")

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "bert_offline.yaml"


# The training arguments recorded in metrics.json next to the results they produced.
_TRAINING_KEYS = (
    "precision",
    "learning_rate",
    "num_train_epochs",
    "max_steps",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "seed",
    "loss_scale_init",
    "loss_scale_growth_interval",
    "loss_scale_hysteresis",
)


@dataclass
class ModelArguments:
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
    tokenizer_vocab_size: int = field(
        default=2000, metadata={"help": "WordPiece vocabulary size for from-scratch models."}
    )
    lora: bool = field(
        default=False,
        metadata={"help": "Train LoRA adapters on query/value (peft) instead of all weights."},
    )
    lora_r: int = field(default=8, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA alpha (scale = alpha / r)."})
    lora_dropout: float = field(default=0.1, metadata={"help": "Dropout on the LoRA input."})


@dataclass
class DataArguments:
    dataset_name: str | None = field(
        default=OFFLINE_DATASET,
        metadata={
            "help": f"A hub dataset (e.g. 'glue' with --dataset_config_name sst2) or "
            f"'{OFFLINE_DATASET}' (built in, no network). Ignored when --train_file is given."
        },
    )
    dataset_config_name: str | None = field(default=None, metadata={"help": "Hub dataset config."})
    train_file: str | None = field(default=None, metadata={"help": "Local csv/json/jsonl."})
    validation_file: str | None = field(
        default=None, metadata={"help": "Local csv/json/jsonl; default: 10%% of train held out."}
    )
    text_column: str | None = field(
        default=None, metadata={"help": "Text column; default 'sentence' or 'text'."}
    )
    text_column_2: str | None = field(
        default=None, metadata={"help": "Second text column for sentence-pair tasks."}
    )
    label_column: str = field(default="label", metadata={"help": "Label column."})
    max_seq_length: int = field(default=128, metadata={"help": "Truncate inputs to this."})
    max_train_samples: int | None = field(
        default=None, metadata={"help": "Use only the first N training examples."}
    )
    max_eval_samples: int | None = field(
        default=None, metadata={"help": "Use only the first N validation examples."}
    )


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
    # Read by the CUDA caching allocator when it starts; it cuts fragmentation with mixed dtypes.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    started = time.perf_counter()
    clock = {"start": started}  # phase end times, for metrics.json's phase_seconds

    # ---- arguments
    parser = HfArgumentParser((ModelArguments, DataArguments, RunArguments, AmpTrainingArguments))
    model_args, data_args, run_args, training_args = parse_args_with_config(
        parser, argv, DEFAULT_CONFIG
    )
    # Cheap checks of the user's choices first: a bad value costs seconds, not a built model.
    check_output_dir(
        training_args.output_dir,
        reuse=run_args.reuse_output_dir,
        resuming=training_args.resume_from_checkpoint is not None,
    )
    check_model_path(model_args.model_name_or_path)
    check_sequence_length(
        model_args.model_name_or_path, data_args.max_seq_length, "--max_seq_length"
    )
    if training_args.include_num_input_tokens_seen == "no":
        training_args.include_num_input_tokens_seen = "non_padding"  # for the tokens/s figure
    logging.basicConfig(
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        level=logging.INFO if training_args.should_log else logging.WARNING,
    )
    transformers.utils.logging.set_verbosity(training_args.get_process_log_level())
    transformers.set_seed(training_args.seed)
    logger.info(
        "precision=%s device=%s world_size=%d",
        training_args.precision,
        training_args.device,
        training_args.world_size,
    )

    # ---- data: every check on the user's input runs before tokenization and model loading
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
    limits = {"train": data_args.max_train_samples, "validation": data_args.max_eval_samples}
    for split, limit in limits.items():
        if limit is not None:
            data.datasets[split] = data.datasets[split].select(
                range(min(limit, data.datasets[split].num_rows))
            )
    labels = np.asarray(data.datasets["validation"][data.label_column])
    majority = float(max(np.mean(labels == v) for v in np.unique(labels)))
    logger.info(
        "%d train / %d validation examples, labels %s (majority-class accuracy %.3f)",
        data.datasets["train"].num_rows,
        data.datasets["validation"].num_rows,
        data.label_list,
        majority,
    )

    clock["data"] = time.perf_counter()

    # ---- tokenizer (trained on the train split for from-scratch models; rank 0 first: cache)
    with training_args.main_process_first(desc="tokenizer"):
        texts = [t for c in data.text_columns for t in data.datasets["train"][c]]
        tokenizer = classification_tokenizer(
            model_args.model_name_or_path,
            texts,
            model_args.tokenizer_vocab_size,
            data_args.max_seq_length,
        )
        encoded = tokenize_classification(data, tokenizer, data_args.max_seq_length)
    clock["tokenizer and map"] = time.perf_counter()

    # ---- model
    model = build_classifier(
        model_args.model_name_or_path,
        data.label_list,
        len(tokenizer),
        model_args.ignore_mismatched_sizes,
    )
    if model_args.lora:  # on query/value; the new classifier head stays trainable
        model = apply_lora(
            model, CLASSIFICATION, model_args.lora_r, model_args.lora_alpha, model_args.lora_dropout
        )
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    logger.info("model: %d parameters, %d trainable", total, trainable)
    clock["model"] = time.perf_counter()

    # ---- train and evaluate
    trainer = AmpTrainer(
        model=model,
        args=training_args,
        train_dataset=encoded["train"],
        eval_dataset=encoded["validation"],
        processing_class=tokenizer,
        data_collator=DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8),
        compute_metrics=compute_metrics,
    )
    train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    clock["train"] = time.perf_counter()
    eval_metrics = trainer.evaluate()
    clock["evaluate"] = time.perf_counter()
    trainer.save_model()  # the final model (LoRA: the adapter) and the tokenizer
    clock["save"] = time.perf_counter()
    if not trainer.is_world_process_zero():
        # Leave the process group before exiting: a rank that just returned while gloo's threads
        # were alive was seen to abort ("terminate called without an active exception").
        trainer.accelerator.end_training()
        return

    # ---- artifacts: metrics.json, training.png, FP16 export with its parity report
    output_dir = Path(training_args.output_dir)
    scale = summarize_loss_scale(trainer.scale_history)
    runtime = train_result.metrics.get("train_runtime") or float("nan")
    tokens_per_s = trainer.state.num_input_tokens_seen / runtime if runtime else None
    memory = peak_memory(training_args.device)
    plot = plot_training(
        trainer.state.log_history,
        trainer.scale_history,
        output_dir / "training.png",
        title=f"{model_args.model_name_or_path} ({training_args.precision})",
    )
    clock["plot"] = time.perf_counter()
    export_model = model.merge_and_unload() if model_args.lora else trainer.model
    samples = list(data.datasets["validation"][data.text_columns[0]][:8])
    report = export_fp16(
        export_model,
        output_dir / "fp16_export",
        tokenizer=tokenizer,
        sample_texts=samples,
        overwrite=True,
    )
    write_json_atomic(output_dir / "fp16_export_report.json", report.to_dict())
    clock["fp16_export"] = time.perf_counter()
    wall = time.perf_counter() - started
    # Where the run's time went, phase by phase (imports and the launcher come before `started`).
    steps = itertools.pairwise(clock.items())
    phases = {name: round(end - begin, 2) for (_, begin), (name, end) in steps}
    phases["evaluations in train and after"] = round(
        sum(e.get("eval_runtime", 0) for e in trainer.state.log_history), 2
    )
    metrics = {
        "train": train_result.metrics,
        "eval": eval_metrics,
        "majority_class_accuracy": majority,
        "loss_scale": None if scale is None else scale.__dict__,
        "tokens_per_second": tokens_per_s,
        "memory": memory,
        "fp16_export_passed": report.passed,
        "wall_time_s": wall,
        "phase_seconds": phases,
        "precision": training_args.precision,
        "config": {
            "model": asdict(model_args),
            "data": asdict(data_args),
            "training": {k: getattr(training_args, k) for k in _TRAINING_KEYS},
        },
    }
    write_json_atomic(output_dir / "metrics.json", metrics)

    # ---- summary
    rows = [
        ("eval accuracy", eval_metrics.get("eval_accuracy")),
        ("eval f1", eval_metrics.get("eval_f1")),
        ("majority-class accuracy", majority),
        ("eval loss", eval_metrics.get("eval_loss")),
        ("precision", training_args.precision),
        ("optimizer steps", trainer.state.global_step),
        ("loss scale final", None if scale is None else scale.final),
        ("loss scale min", None if scale is None else scale.minimum),
        ("skipped steps", None if scale is None else scale.skipped),
        ("tokens/s (train)", tokens_per_s),
        ("train time s", runtime),
        ("wall time s", wall),
        ("peak RSS MiB", memory["peak_rss_mib"]),
        ("peak CUDA allocated MiB", memory.get("cuda_max_allocated_mib")),
        ("fp16 export parity", "passed" if report.passed else "FAILED"),
        ("output", str(output_dir)),
        ("plot", str(plot) if plot else None),
    ]
    print(format_table(rows, title=f"finetune_bert: {model_args.model_name_or_path}"))
    trainer.accelerator.end_training()


if __name__ == "__main__":
    # Every failure is one line on stderr: exit 2 for a usage error, 1 for a runtime failure
    # (traceback in a log file named on the line, or on stderr with AMP_TRAINER_DEBUG=1).
    sys.exit(run_entry_point(lambda: main(sys.argv[1:]), "finetune_bert"))
