#!/usr/bin/env python
"""Fine-tune (or train from scratch) a GPT-2 causal language model, in FP16 done right.

    accelerate launch recipes/finetune_gpt2.py                      # offline default, ~1 min on CPU
    accelerate launch recipes/finetune_gpt2.py --config configs/gpt2_wikitext2.yaml  # GPU
    python recipes/finetune_gpt2.py --max_steps 20 --lora true

With no arguments it runs ``configs/gpt2_offline.yaml``: a tiny GPT-2 trained from scratch, in
real FP16 (autocast + amp-trainer's loss scaler, on CPU too), on the prose of the Python
documentation that ships with Python (no network). It measures the untrained model's eval
perplexity first, so the gain is visible in the same run, and prints a greedy sample before and
after training. ``--config FILE`` loads any YAML of these flags (without it, the offline default
file is the starting point; ``--config none`` starts from the bare defaults); flags override it.

Flow: arguments -> corpus (checked before anything expensive) -> tokenizer -> concatenate and
chunk -> model (+ LoRA) -> evaluate, train, evaluate -> save model, metrics.json, training.png,
FP16 export, summary table.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import transformers
from transformers import HfArgumentParser, default_data_collator

from amp_trainer import AmpTrainer, AmpTrainingArguments, export_fp16
from amp_trainer.atomic_files import write_json_atomic
from amp_trainer.recipe_support.config import (
    RunArguments,
    check_output_dir,
    parse_args_with_config,
    run_entry_point,
)
from amp_trainer.recipe_support.data import OFFLINE_DATASET, load_lm_corpus, tokenize_and_chunk
from amp_trainer.recipe_support.models import (
    CAUSAL_LM,
    apply_lora,
    build_causal_lm,
    causal_lm_tokenizer,
    check_model_path,
    check_sequence_length,
)
from amp_trainer.recipe_support.reporting import (
    format_table,
    peak_memory,
    plot_training,
    summarize_loss_scale,
)

logger = logging.getLogger("finetune_gpt2")

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "gpt2_offline.yaml"


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
        default="tiny-gpt2",
        metadata={
            "help": "A hub id or local folder for from_pretrained (e.g. 'gpt2'), or 'tiny-gpt2' "
            "(from scratch, with a byte-level BPE tokenizer trained on the train split)."
        },
    )
    tokenizer_vocab_size: int = field(
        default=2000, metadata={"help": "Byte-level BPE vocabulary size for from-scratch models."}
    )
    lora: bool = field(
        default=False,
        metadata={"help": "Train LoRA adapters on the attention projection c_attn (peft)."},
    )
    lora_r: int = field(default=8, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA alpha (scale = alpha / r)."})
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on the LoRA input."})


@dataclass
class DataArguments:
    dataset_name: str | None = field(
        default=OFFLINE_DATASET,
        metadata={
            "help": f"A hub dataset (e.g. 'wikitext' with --dataset_config_name "
            f"wikitext-2-raw-v1) or '{OFFLINE_DATASET}' (built in, no network). Ignored when "
            "--train_file is given."
        },
    )
    dataset_config_name: str | None = field(default=None, metadata={"help": "Hub dataset config."})
    train_file: str | None = field(default=None, metadata={"help": "Local txt/csv/json/jsonl."})
    validation_file: str | None = field(
        default=None, metadata={"help": "Local file; default: 5%% of train held out."}
    )
    text_column: str = field(default="text", metadata={"help": "Text column (csv/json)."})
    block_size: int = field(
        default=128, metadata={"help": "Tokens per training sequence (concatenate and chunk)."}
    )
    max_train_samples: int | None = field(
        default=None, metadata={"help": "Use only the first N training blocks."}
    )
    max_eval_samples: int | None = field(
        default=None, metadata={"help": "Use only the first N validation blocks."}
    )
    prompt: str = field(
        default="The with statement", metadata={"help": "Prompt for the greedy samples."}
    )
    sample_tokens: int = field(default=24, metadata={"help": "Tokens per greedy sample."})


@torch.no_grad()
def greedy_sample(model, tokenizer, prompt: str, new_tokens: int) -> str:
    """A short greedy continuation of ``prompt`` (deterministic, so before/after compare)."""
    device = next(model.parameters()).device
    inputs = tokenizer(prompt, return_tensors="pt").to(device)
    was_training = model.training
    model.eval()
    output = model.generate(
        **inputs,
        max_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.train(was_training)
    return tokenizer.decode(output[0], skip_special_tokens=True)


def perplexity(eval_loss: float | None) -> float | None:
    if eval_loss is None:
        return None
    return math.exp(eval_loss) if eval_loss < 700 else float("inf")


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
        model_args.model_name_or_path, data_args.block_size, "--block_size", bounded=False
    )
    if training_args.include_num_input_tokens_seen == "no":
        training_args.include_num_input_tokens_seen = "all"  # for the tokens/s figure
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

    # ---- corpus: every check on the user's input runs before tokenization and model loading
    corpus = load_lm_corpus(
        data_args.dataset_name,
        data_args.dataset_config_name,
        data_args.train_file,
        data_args.validation_file,
        data_args.text_column,
    )
    logger.info(
        "%d train / %d validation rows", corpus["train"].num_rows, corpus["validation"].num_rows
    )

    clock["data"] = time.perf_counter()

    # ---- tokenizer (trained on the train split for from-scratch models; rank 0 first: cache)
    with training_args.main_process_first(desc="tokenizer"):
        tokenizer = causal_lm_tokenizer(
            model_args.model_name_or_path, corpus["train"]["text"], model_args.tokenizer_vocab_size
        )
        block_size = min(data_args.block_size, tokenizer.model_max_length)
        blocks = tokenize_and_chunk(corpus, tokenizer, block_size)
    clock["tokenizer and map"] = time.perf_counter()
    limits = {"train": data_args.max_train_samples, "validation": data_args.max_eval_samples}
    for split, limit in limits.items():
        if limit is not None:
            blocks[split] = blocks[split].select(range(min(limit, blocks[split].num_rows)))
    logger.info(
        "%d train / %d validation blocks of %d tokens",
        blocks["train"].num_rows,
        blocks["validation"].num_rows,
        block_size,
    )

    # ---- model
    model = build_causal_lm(model_args.model_name_or_path, tokenizer, block_size)
    if model_args.lora:  # on the attention projection c_attn
        model = apply_lora(
            model, CAUSAL_LM, model_args.lora_r, model_args.lora_alpha, model_args.lora_dropout
        )
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    logger.info("model: %d parameters, %d trainable", total, trainable)
    clock["model"] = time.perf_counter()

    # ---- evaluate untrained, train, evaluate
    trainer = AmpTrainer(
        model=model,
        args=training_args,
        train_dataset=blocks["train"],
        eval_dataset=blocks["validation"],
        processing_class=tokenizer,
        data_collator=default_data_collator,
    )
    before = trainer.evaluate(metric_key_prefix="untrained")
    clock["evaluate untrained"] = time.perf_counter()
    prompt, new_tokens = data_args.prompt, data_args.sample_tokens
    sample_before = None
    if trainer.is_world_process_zero():
        sample_before = greedy_sample(trainer.model, tokenizer, prompt, new_tokens)
        logger.info("sample before training: %r", sample_before)
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
    sample_after = greedy_sample(
        trainer.model, tokenizer, data_args.prompt, data_args.sample_tokens
    )
    logger.info("sample after training: %r", sample_after)

    # ---- artifacts: metrics.json, training.png, FP16 export with its parity report
    output_dir = Path(training_args.output_dir)
    ppl_before = perplexity(before.get("untrained_loss"))
    ppl_after = perplexity(eval_metrics.get("eval_loss"))
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
    samples = [t for t in corpus["validation"]["text"][:50] if t.strip()][:8]
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
        "eval": {**eval_metrics, "perplexity": ppl_after},
        "untrained": {**before, "perplexity": ppl_before},
        "sample_before": sample_before,
        "sample_after": sample_after,
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
    print(f"prompt: {data_args.prompt!r}")
    print(f"  before training: {sample_before!r}")
    print(f"  after training:  {sample_after!r}")
    rows = [
        ("eval perplexity", ppl_after),
        ("untrained eval perplexity", ppl_before),
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
    print(format_table(rows, title=f"finetune_gpt2: {model_args.model_name_or_path}"))
    trainer.accelerator.end_training()


if __name__ == "__main__":
    # Every failure is one line on stderr: exit 2 for a usage error, 1 for a runtime failure
    # (traceback in a log file named on the line, or on stderr with AMP_TRAINER_DEBUG=1).
    sys.exit(run_entry_point(lambda: main(sys.argv[1:]), "finetune_gpt2"))
