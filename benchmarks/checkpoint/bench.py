"""What checkpoint digests cost: an AmpTrainer checkpoint's save time with and without them.

A BERT built from a config (nothing downloaded) trains one step, so that ``optimizer.pt`` holds
AdamW's moments, then its checkpoint is saved again and again through the trainer's own
``_save_checkpoint`` (model, optimizer, scheduler, scaler, RNG and trainer state, amp state)
with ``checkpoint_digests`` off and on, alternately, each save into an emptied folder. Two
sizes: ``tiny`` (the tests' size, a few hundred KB) and ``100mb`` (about 100 MB of files). Also
timed: comparing a saved checkpoint's files with their digests, what a resume adds before
loading. Medians over ``--repeats``; the files are in the page cache, as right after a save.

Usage::

    python -m benchmarks run checkpoint                 # ~20 s on 2 cores
    python -m benchmarks run checkpoint --quick         # smoke run, seconds
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import cli
from benchmarks.machine import describe_machine, format_machine

# BertConfig sizes: (hidden, layers, intermediate, vocab).
SIZES = {"tiny": (32, 2, 64, 128), "100mb": (384, 4, 1536, 4096)}


def _sizes(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in names if name not in SIZES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give sizes from {', '.join(SIZES)}, comma-separated"
        )
    return names


def _trained_trainer(size: str, out: Path) -> Any:
    """An AmpTrainer on a BERT of ``size`` after one optimizer step."""
    import torch
    from datasets import Dataset
    from transformers import BertConfig, BertForSequenceClassification

    from amp_trainer import AmpTrainer, AmpTrainingArguments

    hidden, layers, intermediate, vocab = SIZES[size]
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=intermediate,
        max_position_embeddings=64,
        num_labels=2,
    )
    model = BertForSequenceClassification(config)
    ids = torch.randint(5, vocab, (8, 16), generator=torch.Generator().manual_seed(0))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": [i % 2 for i in range(8)]})
    args = AmpTrainingArguments(
        output_dir=str(out),
        use_cpu=True,
        precision="fp32",
        max_steps=1,
        per_device_train_batch_size=8,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    trainer = AmpTrainer(model=model, args=args, train_dataset=data)
    trainer.train()
    return trainer


def _measure(size: str, repeats: int, root: Path) -> dict[str, Any]:
    """Median save seconds without and with digests, and the compare's, for one size."""
    from amp_trainer.checkpointing.digests import why_damaged

    out = root / size
    trainer = _trained_trainer(size, out)
    folder = out / f"checkpoint-{trainer.state.global_step}"
    saves: dict[bool, list[float]] = {False: [], True: []}
    compares: list[float] = []
    trainer._save_checkpoint(trainer.model, trial=None)  # warm-up: first-call costs, untimed
    for repeat in range(repeats):
        for digests in (False, True) if repeat % 2 == 0 else (True, False):
            shutil.rmtree(folder, ignore_errors=True)
            trainer.args.checkpoint_digests = digests
            start = time.perf_counter()
            trainer._save_checkpoint(trainer.model, trial=None)
            saves[digests].append(time.perf_counter() - start)
            if digests:
                start = time.perf_counter()
                assert why_damaged(folder) is None
                compares.append(time.perf_counter() - start)
    files = [path for path in folder.rglob("*") if path.is_file()]
    return {
        "size": size,
        "bytes": sum(path.stat().st_size for path in files),
        "files": len(files),
        "off": statistics.median(saves[False]),
        "on": statistics.median(saves[True]),
        "compare": statistics.median(compares),
    }


def main(argv: list[str] | None = None) -> int:
    parser = cli.topic_parser("checkpoint", __doc__)
    parser.add_argument(
        "--sizes", type=_sizes, default=list(SIZES), help=f"of {', '.join(SIZES)} (default all)"
    )
    cli.add_repeats(parser, 7, "saves per mode, interleaved (>= 1)")
    cli.add_output(parser)
    cli.add_quick(parser, {"sizes": "tiny", "repeats": "1"})
    args = cli.parse(parser, argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            rows = [_measure(size, args.repeats, Path(tmp)) for size in args.sizes]
    finally:
        hf_logging.set_verbosity(verbosity)
    lines = [
        "## Checkpoint digests: AmpTrainer save time without and with them, CPU",
        "",
        f"Command: `{cli.command('checkpoint', argv)}`",
        "",
        f"Machine: {format_machine(describe_machine())}.",
        "",
        f"Median of {args.repeats} save(s) per mode, interleaved; each into an emptied folder, "
        "through `_save_checkpoint`, after one untimed warm-up save. Compare: `why_damaged` "
        "over the saved files (what a resume adds before loading).",
        "",
        "| checkpoint | MB | files (the list included) | save, no digests (s) | "
        "save, digests (s) | added (s) | ratio | compare on resume (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['size']} | {row['bytes'] / 1e6:.1f} | {row['files']} | {row['off']:.3f} | "
            f"{row['on']:.3f} | {row['on'] - row['off']:+.3f} | {row['on'] / row['off']:.2f}x | "
            f"{row['compare']:.3f} |"
        )
    cli.emit("\n".join(lines), args.output)
    return 0
