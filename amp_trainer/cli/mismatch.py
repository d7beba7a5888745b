"""``amp-trainer mismatch``: how far FP16/BF16 token log-probs are from FP32 for a causal LM, over
:func:`amp_trainer.mismatch.measure_precision_mismatch`."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from amp_trainer.cli.common import (
    check_model_arg,
    load_texts,
    number,
    positive_int,
    write_json_output,
)
from amp_trainer.entry_point import EXIT_FAILED, EXIT_OK, UsageError

__all__ = ["add_parser", "run"]


def add_parser(commands: Any) -> None:
    """Add ``mismatch`` to the ``amp-trainer`` subcommands (``commands``: argparse's subparsers)."""
    mismatch = commands.add_parser(
        "mismatch",
        help="how far FP16 and BF16 token log-probs are from FP32 (the RL precision mismatch)",
        description=(
            "Scores the texts' tokens with a causal LM in FP32 and under FP16/BF16 autocast and "
            "prints, per precision, the mean and max |log p - log p_fp32|, the KL of the "
            "next-token distributions and the share of tokens whose probability ratio leaves "
            "the PPO/GRPO clip range from rounding alone: the part of an RL run's rollout/train "
            "mismatch the precision decides. Exit 1 when a precision's logits are inf/NaN (the "
            "module that overflowed is named)."
        ),
        epilog="examples:\n  amp-trainer mismatch --model runs/gpt2 --texts 'The answer is' "
        "'Two plus two'\n  amp-trainer mismatch --model Qwen/Qwen2.5-0.5B --data prompts.txt "
        "--device cuda --json mismatch.json\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    mismatch.add_argument("--model", required=True, help="causal LM folder or hub id (FP32)")
    texts = mismatch.add_mutually_exclusive_group(required=True)
    texts.add_argument("--texts", nargs="+", metavar="TEXT", help="the texts to score")
    texts.add_argument(
        "--data", metavar="FILE", help="one text per line (.txt) or JSON lines with 'text'"
    )
    mismatch.add_argument(
        "--precisions",
        nargs="+",
        default=["fp16", "bf16"],
        choices=["fp16", "bf16", "fp32"],  # precision.PRECISIONS, not imported
        help="default: %(default)s (fp32: a second FP32 run, the noise floor)",
    )
    mismatch.add_argument(
        "--clip-epsilon",
        type=number(0.0, 1.0, low_open=True),
        default=0.2,
        help="the clip range [1-eps, 1+eps] of the clip rate (default: %(default)s)",
    )
    mismatch.add_argument(
        "--temperature",
        type=number(0.0, float("inf"), low_open=True),
        default=1.0,
        help="sampling temperature the log-probs are taken at (default: %(default)s)",
    )
    mismatch.add_argument(
        "--max-length", type=positive_int, default=256, help="tokens per text (default: 256)"
    )
    mismatch.add_argument(
        "--max-texts", type=positive_int, default=64, help="texts read (default: 64)"
    )
    mismatch.add_argument(
        "--batch-size", type=positive_int, default=8, help="texts per forward (default: 8)"
    )
    mismatch.add_argument("--device", help="default: cuda if available, else cpu")
    mismatch.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    mismatch.set_defaults(handler=run)


def model_positions(config: Any) -> int | None:
    """How many positions the model embeds (GPT-2's ``n_positions``, most others'
    ``max_position_embeddings``); ``None`` for one without a fixed limit (rotary models
    usually state one anyway)."""
    for name in ("n_positions", "max_position_embeddings", "n_ctx"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def run(args: argparse.Namespace) -> int:
    """Measure ``args.model``'s precision mismatch (``amp-trainer mismatch``); the exit code: 0,
    or 1 when a precision's logits are inf/NaN."""
    import torch

    from amp_trainer.export import load_model, load_tokenizer
    from amp_trainer.mismatch import measure_precision_mismatch

    path = check_model_arg(args.model)
    texts = args.texts[: args.max_texts] if args.texts else load_texts(args.data, args.max_texts)[0]
    empty = [number for number, text in enumerate(texts, 1) if not text.strip()]
    if empty:  # its figures would come from padding and special tokens alone
        which = f"text {empty[0]}" if len(empty) == 1 else f"texts {', '.join(map(str, empty))}"
        raise UsageError(f"--texts: {which} of {len(texts)} is empty; there is nothing to score")
    if args.json and not Path(args.json).parent.is_dir():  # before the model loads
        raise UsageError(f"--json {args.json}: directory {Path(args.json).parent} does not exist")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = str(torch.device(device))
    except (RuntimeError, TypeError):
        raise UsageError(f"--device {args.device}: not a device (e.g. cpu, cuda, cuda:1)") from None
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {args.device}: no CUDA device is available here; use cpu")
    tokenizer = load_tokenizer(path)
    if tokenizer is None and not Path(path).expanduser().exists():
        raise UsageError(
            f"--model {args.model}: no such folder, and no hub model of that id could be loaded "
            "(offline, or no such id)"
        )
    if tokenizer is None:
        raise UsageError(f"--model {args.model}: no tokenizer saved there to encode the texts")
    if tokenizer.pad_token is None:  # a causal LM's tokenizer often has none; padding is masked
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
        if tokenizer.pad_token is None and len(texts) > 1:
            raise UsageError(
                f"--model {args.model}: its tokenizer has no pad, eos or unk token to pad the "
                "texts with; score one text at a time"
            )
    tokenizer.padding_side = "right"
    model = load_model(path).to(device)
    # Longer than the model's positions, a forward fails with a bare IndexError: cut there.
    positions = model_positions(model.config)
    max_length = min(args.max_length, positions) if positions else args.max_length
    batch = tokenizer(
        list(texts), padding=True, truncation=True, max_length=max_length, return_tensors="pt"
    )
    full = [len(ids) for ids in tokenizer(list(texts), verbose=False)["input_ids"]]
    cut = sum(length > max_length for length in full)
    results = measure_precision_mismatch(
        model,
        batch["input_ids"],
        batch["attention_mask"],
        precisions=tuple(args.precisions),
        clip_epsilon=args.clip_epsilon,
        temperature=args.temperature,
        batch_size=args.batch_size,
    )
    tokens = next(iter(results.values())).tokens
    print(
        f"{type(model).__name__} from {args.model}: {len(texts)} text(s), {tokens} token(s) "
        f"scored, on {device}, against FP32"
    )
    if cut:
        limit = "--max-length" if max_length == args.max_length else "the model's positions"
        print(f"note: {cut} text(s) cut at {max_length} tokens ({limit}); the rest is not scored")
    print(results)
    if args.json:
        write_json_output(
            args.json,
            {
                "model": args.model,
                "device": device,
                "texts": len(texts),
                "clip_epsilon": args.clip_epsilon,
                "temperature": args.temperature,
                "precisions": results.to_dict(),
            },
        )
    return EXIT_FAILED if any(stats.nonfinite for stats in results.values()) else EXIT_OK
