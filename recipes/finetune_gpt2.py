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
What this recipe shares with the BERT one (common flags, parsing, logging, phase timing and
that end of the run) is in ``amp_trainer/recipes/run.py``.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

# Only what --help needs up here: it is answered before torch and transformers load (main()).
from amp_trainer.recipes import (
    SharedDataArguments,
    SharedModelArguments,
    answer_help,
    run_entry_point,
)

if TYPE_CHECKING:
    from amp_trainer.recipes import RecipeRun

logger = logging.getLogger("finetune_gpt2")

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "gpt2_offline.yaml"


@dataclass
class ModelArguments(SharedModelArguments):  # + tokenizer_vocab_size, lora, lora_r/alpha
    model_name_or_path: str = field(
        default="tiny-gpt2",
        metadata={
            "help": "A hub id or local folder for from_pretrained (e.g. 'gpt2'), or 'tiny-gpt2' "
            "(from scratch, with a byte-level BPE tokenizer trained on the train split)."
        },
    )
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on the LoRA input."})


@dataclass
class DataArguments(SharedDataArguments):  # + dataset, files, max_train/eval_samples
    text_column: str = field(default="text", metadata={"help": "Text column (csv/json)."})
    block_size: int = field(
        default=128, metadata={"help": "Tokens per training sequence (concatenate and chunk)."}
    )
    prompt: str | None = field(
        default=None,
        metadata={
            "help": "Prompt for the greedy samples. Default: the config file's prompt, unless "
            "--train_file/--validation_file is given; then (or without one) the first words of "
            "the first validation example."
        },
    )
    sample_tokens: int = field(default=24, metadata={"help": "Tokens per greedy sample."})


PROMPT_WORDS = 4  # of the first validation example, when the prompt is the data's
_OWN_FILE_FLAGS = ("train_file", "validation_file")


def choose_prompt(run: RecipeRun, validation_texts: Iterable[str]) -> tuple[str, str]:
    """The prompt of the greedy samples, and where it came from (the summary says which).

    ``--prompt`` on the command line wins. A config file's prompt is kept unless the command
    line brings the user's own files (``--train_file``/``--validation_file``): it was written
    for a dataset ("The with statement" for the Python docs), and on the user's own text it
    showed nothing of what the model had learnt. A hub ``--dataset_name`` keeps it (a shipped
    config's dataset swapped for a mirror or a larger variant). Otherwise the first words of the
    first non-empty validation example: text the model should continue.
    """
    prompt = run.data_args.prompt
    given = run.given("prompt", *_OWN_FILE_FLAGS)
    if "prompt" in given:
        return prompt, "from --prompt"
    if prompt is not None and not given.intersection(_OWN_FILE_FLAGS):
        return prompt, "from the config file"
    for text in validation_texts:
        words = text.split()
        if words:
            return " ".join(words[:PROMPT_WORDS]), (
                f"the first {PROMPT_WORDS} words of the first validation example; "
                "--prompt sets another"
            )
    return "The", "no validation text to take one from; --prompt sets one"


def greedy_sample(model, tokenizer, prompt: str, new_tokens: int) -> str:
    """A short greedy continuation of ``prompt`` (deterministic, so before/after compare;
    ``generate`` computes no gradients)."""
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


def sample_on_main_process(trainer, data_args, when: str) -> str | None:
    """The greedy sample of ``--prompt``, logged; ``None`` on the other processes."""
    if not trainer.is_world_process_zero():
        return None
    tokenizer = trainer.processing_class
    sample = greedy_sample(trainer.model, tokenizer, data_args.prompt, data_args.sample_tokens)
    logger.info("sample %s training: %r", when, sample)
    return sample


def perplexity(eval_loss: float | None) -> float | None:
    if eval_loss is None:
        return None
    return math.exp(eval_loss) if eval_loss < 700 else float("inf")


def main(argv: list[str]) -> None:
    answer_help(Path(__file__).name, argv, (ModelArguments, DataArguments), DEFAULT_CONFIG)
    from transformers import default_data_collator

    from amp_trainer import AmpTrainer
    from amp_trainer.recipes import (
        CAUSAL_LM,
        TINY_MODEL_CONFIGS,
        RecipeRun,
        apply_lora,
        apply_sample_limits,
        build_causal_lm,
        causal_lm_tokenizer,
        check_sequence_length,
        load_lm_corpus,
        tokenize_and_chunk,
        training_length_hint,
        validation_size_hint,
    )

    # ---- config: the YAML file and flags; the user's choices are checked before anything costly
    run = RecipeRun.parse(
        "finetune_gpt2", argv, ModelArguments, DataArguments, DEFAULT_CONFIG, task=CAUSAL_LM
    )
    model_args, data_args, training_args = run.model_args, run.data_args, run.training_args
    check_sequence_length(
        model_args.model_name_or_path, data_args.block_size, "--block_size", bounded=False
    )
    run.start(count_input_tokens="all")  # logging, seed, the precision line

    # ---- corpus: every check on the user's input runs before tokenization and model loading
    with run.phase("data"):
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

    # ---- tokenizer (trained on the train split for from-scratch models; rank 0 first: cache),
    # then concatenate and chunk
    with run.phase("tokenizer and map"), training_args.main_process_first(desc="tokenizer"):
        tokenizer = causal_lm_tokenizer(
            model_args.model_name_or_path,
            corpus["train"]["text"],
            model_args.tokenizer_vocab_size,
            checkpoint=training_args.resume_from_checkpoint,  # resuming: the checkpoint's own
        )
        block_size = min(data_args.block_size, tokenizer.model_max_length)
        blocks = tokenize_and_chunk(corpus, tokenizer, block_size)
    apply_sample_limits(blocks, data_args)
    logger.info(
        "%d train / %d validation blocks of %d tokens",
        blocks["train"].num_rows,
        blocks["validation"].num_rows,
        block_size,
    )

    # the greedy samples' prompt: --prompt, the config file's for its own data, else the data's
    data_args.prompt, prompt_source = choose_prompt(
        run, (row["text"] for row in corpus["validation"])
    )

    # ---- model
    with run.phase("model"):
        model = build_causal_lm(model_args.model_name_or_path, tokenizer, block_size)
        if model_args.lora:  # on the attention projection c_attn
            model = apply_lora(
                model, CAUSAL_LM, model_args.lora_r, model_args.lora_alpha, model_args.lora_dropout
            )
        run.log_model_size(model)

    # ---- trainer; evaluate untrained, train, evaluate, save
    run.settle_ddp(model)  # no search for unused parameters where none exist
    trainer = AmpTrainer(
        model=model,
        args=training_args,
        train_dataset=blocks["train"],
        eval_dataset=blocks["validation"],
        processing_class=tokenizer,
        data_collator=default_data_collator,
    )
    with run.phase("evaluate untrained"):
        # "eval_" first: TensorBoard and W&B file it under eval/, not train/.
        before = trainer.evaluate(metric_key_prefix="eval_untrained")
    sample_before = sample_on_main_process(trainer, data_args, "before")
    train_result, eval_metrics = run.train_evaluate_save(trainer)
    sample_after = sample_on_main_process(trainer, data_args, "after")

    # ---- finish: training.png, FP16 export + parity report, metrics.json, summary table
    ppl_before = perplexity(before.get("eval_untrained_loss"))
    ppl_after = perplexity(eval_metrics.get("eval_loss"))
    state = trainer.state
    length_hint = training_length_hint(
        state.global_step,
        model_args.model_name_or_path in TINY_MODEL_CONFIGS,
        model_args.model_name_or_path,
        updates_per_epoch=round(state.max_steps / max(1, state.num_train_epochs)),
        max_steps=training_args.max_steps,
    )
    run.finish(
        trainer,
        train_result,
        model,
        export_samples=[t for t in corpus["validation"]["text"][:50] if t.strip()][:8],
        results={
            "eval": {**eval_metrics, "perplexity": ppl_after},
            "untrained": {**before, "perplexity": ppl_before},
            "prompt": data_args.prompt,
            "prompt_source": prompt_source,
            "sample_before": sample_before,
            "sample_after": sample_after,
        },
        summary=[
            ("eval perplexity", ppl_after),
            ("untrained eval perplexity", ppl_before),
            ("eval loss", eval_metrics.get("eval_loss")),
        ],
        notes=[
            f"prompt: {data_args.prompt!r} ({prompt_source})",
            f"  before training: {sample_before!r}",
            f"  after training:  {sample_after!r}",
            *filter(
                None, [length_hint, validation_size_hint(blocks["validation"].num_rows, block_size)]
            ),
        ],
    )


if __name__ == "__main__":
    # Every failure is one line on stderr: exit 2 for a usage error, 1 for a runtime failure
    # (traceback in a log file named on the line, or on stderr with AMP_TRAINER_DEBUG=1).
    sys.exit(run_entry_point(lambda: main(sys.argv[1:]), "finetune_gpt2"))
