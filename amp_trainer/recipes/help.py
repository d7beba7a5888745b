"""A recipe's ``--help``, answered before torch and transformers are imported.

Why: building transformers' argument parser to answer ``--help`` imports transformers and
torch: 20-60 s on a busy laptop to print a page of text.
Here the page is made from what needs neither: the recipe's own flag dataclasses (plain
dataclasses), :class:`~amp_trainer.recipes.config.RunArguments`, and two tables: amp-trainer's
precision and loss-scaler flags (:data:`AMP_TRAINER_FLAGS`, the fields of
:class:`~amp_trainer.AmpTrainingArguments` as they are declared there) and the training flags a
recipe user reaches for first (:data:`TRAINING_FLAGS`, transformers' defaults, described here).
``tests/recipes/test_recipe_help.py`` checks both tables against the installed classes, and
that ``--help`` imports neither library. ``--help-all`` still prints transformers' full
parser: every flag, at the full cost.

A recipe calls :func:`answer_help` first thing (``recipes/finetune_bert.py``)::

    def main(argv):
        answer_help("finetune_bert.py", argv, (ModelArguments, DataArguments), DEFAULT_CONFIG)
        from transformers import ...   # only now, for a run
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from amp_trainer.entry_point import EXIT_OK, UsageError
from amp_trainer.recipes.arguments import RunArguments, load_yaml_config, split_config_flag
from amp_trainer.recipes.launcher import LauncherPrecision

__all__ = [
    "AMP_TRAINER_FLAGS",
    "TRAINING_FLAGS",
    "Flag",
    "answer_help",
    "short_help",
    "wants_short_help",
]

_HELP_FLAGS = ("-h", "--help")


@dataclass(frozen=True)
class Flag:
    """One flag of the short help: its name (no ``--``), what it does, its default, and its
    choices or type (``bool`` flags take ``true``/``false``; ``list`` ones several values)."""

    name: str
    help: str
    default: Any = None
    type: str = "str"
    choices: tuple[str, ...] = ()


#: :class:`~amp_trainer.AmpTrainingArguments`' own fields, help and defaults as declared there
#: (a test compares them).
AMP_TRAINER_FLAGS: tuple[Flag, ...] = (
    Flag(
        "precision",
        "Training precision. 'auto' follows --fp16/--bf16 when given, else picks for the device: "
        "fp16 on CUDA, bf16 where the hardware has it, fp32 otherwise. fp16 on a CPU is real "
        "(autocast + loss scaling), only slow.",
        "auto",
        choices=("auto", "fp16", "bf16", "fp32"),
    ),
    Flag(
        "keep_norms_fp32",
        "Keep normalisation layers (LayerNorm, RMSNorm, BatchNorm, ...) in fp32, parameters and "
        "arithmetic, under fp16/bf16 autocast.",
        True,
        "bool",
    ),
    Flag("loss_scale_init", "Initial loss scale S (fp16 only).", 65536.0, "float"),
    Flag(
        "loss_scale_growth_factor",
        "S is multiplied by this after growth_interval clean steps (> 1).",
        2.0,
        "float",
    ),
    Flag(
        "loss_scale_backoff_factor",
        "S is multiplied by this on overflow, in (0, 1).",
        0.5,
        "float",
    ),
    Flag(
        "loss_scale_growth_interval",
        "Consecutive clean optimizer steps before S grows.",
        2000,
        "int",
    ),
    Flag(
        "loss_scale_hysteresis",
        "Back off on the N-th overflow; N-1 overflows are tolerated (the step is still skipped). "
        "1 is torch.amp.GradScaler's behaviour.",
        1,
        "int",
    ),
    Flag(
        "loss_scale_underflow_check_interval",
        "fp16: every N optimizer steps (and on the first), measure the share of the gradient "
        "FP16 flushes to zero at the current loss scale and the doublings of scale left (log "
        "keys grad_underflow, grad_headroom, grad_unreachable): about five extra backward "
        "passes on that step (up to 11). 0 turns the meter off.",
        500,
        "int",
    ),
    Flag(
        "loss_scale_grow_on_underflow",
        "fp16: when the underflow meter finds more than 0.1 percent of the gradient flushed and "
        "the headroom allows, grow the loss scale at once to the scale that fixes it (checking "
        "again on the next step) instead of after growth_interval clean steps.",
        False,
        "bool",
    ),
    Flag(
        "max_consecutive_skipped_steps",
        "End the run with LossScaleError after this many optimizer steps in a row were skipped "
        "for non-finite gradients, whatever on_min_loss_scale says: such a run no longer "
        "trains. 0 disables the limit.",
        100,
        "int",
    ),
    Flag(
        "skip_streak_replay",
        "fp16: after this many optimizer steps in a row were skipped (or sooner, when the "
        "loss scale reached loss_scale_min), replay the last batch from the unchanged weights"
        " in fp32 and fp16 at lower scales and act on the verdict (scale_warmup, "
        "fp16_backward_range: the module made an fp32 island, data, divergence). 0 turns it "
        "off.",
        8,
        "int",
    ),
    Flag(
        "skip_streak_quarantine",
        "How many batches a replay's 'data' verdict (non-finite in fp32 too while other "
        "batches are finite) may drop, its update skipped, before the run stops with "
        "BadBatchError naming the batch. 0: the first one stops the run. (A batch whose loss "
        "itself is non-finite is the forward-overflow guard's first: with "
        "on_forward_overflow='fp32' and no quarantine it stops with NonFiniteForwardError.)",
        0,
        "int",
    ),
    Flag(
        "loss_scale_min",
        "The loss scale never goes below this (None: 1.0, or loss_scale_init if lower).",
        None,
        "float",
    ),
    Flag(
        "loss_scale_max",
        "The loss scale never grows above this (None: unbounded).",
        None,
        "float",
    ),
    Flag(
        "on_min_loss_scale",
        "What an overflow at loss_scale_min does: 'raise' LossScaleError naming the overflowing "
        "parameters, 'warn' and keep skipping, or 'clamp' silently.",
        "raise",
        choices=("raise", "warn", "clamp"),
    ),
    Flag(
        "fp32_modules",
        "Modules kept in fp32 (parameters and arithmetic) under fp16/bf16: qualified names, "
        "dotted suffixes ('wo') or globs; added to the model's _keep_in_fp32_modules.",
        [],
        "list",
    ),
    Flag(
        "on_forward_overflow",
        "fp16: what a module whose forward output overflows (loss already inf/NaN) does: 'fp32' "
        "keep it in fp32 from then on and train on, 'raise' LossScaleError naming it, 'skip' "
        "skip the step and back the scale off like a gradient overflow.",
        "fp32",
        choices=("fp32", "raise", "skip"),
    ),
    Flag(
        "on_divergence",
        "fp16: what a forward overflow that is really divergence does (the module's weights or "
        "the loss far beyond their values at the first step): 'raise' DivergenceError naming "
        "the learning rate and the evidence, 'warn' warn once and go on. Either way no fp32 "
        "island is added for it.",
        "raise",
        choices=("raise", "warn"),
    ),
    Flag(
        "checkpoint_digests",
        "Record the size and SHA-256 of every file of each checkpoint (checkpoint-"
        "digests.json, written last) and compare them before a resume or the best-model load "
        "reads any file: a truncated or changed file is one error naming it, and "
        "resume_from_checkpoint=True passes a damaged checkpoint over. False: neither written"
        " nor checked.",
        True,
        "bool",
    ),
    Flag(
        "precision_guard",
        "What a dtype drift does (master weights, optimizer state or gradients at a lower "
        "precision than at the start, an FP32 island lost, FP16 forwards without the loss "
        "scaler or the scaler without FP16 forwards): 'raise' PrecisionDriftError before the "
        "optimizer step, 'repair' put the dtypes back and go on, 'warn' only say it, 'off' no"
        " check. A cast under torch.no_grad() (a generation) is undone exactly in every mode "
        "but 'off'.",
        "raise",
        choices=("raise", "repair", "warn", "off"),
    ),
    Flag(
        "rollout_precision_mismatch",
        "RL (TRL GRPO/RLOO): what a rollout side sampling in another precision than the "
        "trainer's does (vLLM's dtype, from its engine or server or, before it starts, from the"
        " checkpoint's config by vLLM's 'auto' rule): 'raise' RolloutPrecisionError before the "
        "first step (before vLLM is started where it can be known then), 'allow' the mismatch "
        "is intended: one warning, and a PrecisionMismatchCallback measures the rollout "
        "precision's log-probability gap. Independent of precision_guard.",
        "raise",
        choices=("raise", "allow"),
    ),
)

#: The TrainingArguments flags a recipe user reaches for first, with transformers' defaults (a
#: test compares them); ``--help-all`` lists the rest.
TRAINING_FLAGS: tuple[Flag, ...] = (
    Flag("output_dir", "Where the model, checkpoints, metrics.json and the export go."),
    Flag(
        "resume_from_checkpoint",
        "Continue a run: 'true' (the output_dir's last checkpoint), a run folder or a "
        "checkpoint-N folder.",
    ),
    Flag("max_steps", "Optimizer steps to train; > 0 overrides num_train_epochs.", -1, "int"),
    Flag("num_train_epochs", "Passes over the training data.", 3.0, "float"),
    Flag("learning_rate", "Peak learning rate (AdamW).", 5e-05, "float"),
    Flag(
        "lr_scheduler_type",
        "Learning-rate schedule after warmup: linear, cosine, constant, ...",
        "linear",
    ),
    Flag(
        "warmup_steps",
        "Steps of linear warmup from 0 to learning_rate; a value below 1 is a fraction of "
        "all steps.",
        0,
        "float",
    ),
    Flag("weight_decay", "AdamW weight decay (not on biases and norm weights).", 0.0, "float"),
    Flag(
        "max_grad_norm",
        "Clip the gradient norm to this (unscaled first, so the loss scale never enters it); "
        "0 turns clipping off.",
        1.0,
        "float",
    ),
    Flag("per_device_train_batch_size", "Training batch size per device.", 8, "int"),
    Flag("per_device_eval_batch_size", "Evaluation batch size per device.", 8, "int"),
    Flag(
        "gradient_accumulation_steps",
        "Micro-batches per optimizer step (effective batch = batch size x devices x this).",
        1,
        "int",
    ),
    Flag("eval_strategy", "When to evaluate.", "no", choices=("no", "steps", "epoch")),
    Flag(
        "save_strategy",
        "When to save a checkpoint.",
        "steps",
        choices=("no", "steps", "epoch", "best"),
    ),
    Flag("save_steps", "Save a checkpoint every N optimizer steps.", 500, "float"),
    Flag("save_total_limit", "Keep at most N checkpoints (older ones are deleted).", None, "int"),
    Flag("logging_steps", "Log loss, loss scale and learning rate every N steps.", 500, "float"),
    Flag("seed", "Random seed for weights, data order and dropout.", 42, "int"),
    Flag(
        "torch_compile",
        "Compile the model with torch.compile (slow first steps, faster after).",
        False,
        "bool",
    ),
    Flag("use_cpu", "Train on the CPU even where a GPU is available.", False, "bool"),
    Flag(
        "report_to",
        "Where logs also go: none, tensorboard, wandb, ... (several allowed).",
        "none",
    ),
    Flag("disable_tqdm", "Hide the progress bars.", None, "bool"),
)


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, wrapping only at spaces.

    The stock one wraps with :func:`textwrap.wrap`'s defaults, which break at hyphens and inside
    long words: at some terminal widths ``--help-all`` came out as ``--help-`` / ``all`` and a
    config path was cut mid-name, so a flag the user must type was not on one line.
    """

    def _split_lines(self, text: str, width: int) -> list[str]:
        text = " ".join(text.split())
        return textwrap.wrap(text, width, break_on_hyphens=False, break_long_words=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        text = " ".join(text.split())
        return textwrap.fill(
            text,
            width,
            initial_indent=indent,
            subsequent_indent=indent,
            break_on_hyphens=False,
            break_long_words=False,
        )


def wants_short_help(argv: Sequence[str]) -> bool:
    """``-h``/``--help`` on the command line (``--help-all`` is the full parser's)."""
    return "--help-all" not in argv and any(arg in _HELP_FLAGS for arg in argv)


def _flags_of(kind: type) -> list[Flag]:
    """A plain flag dataclass's fields as :class:`Flag` s (the recipe's own, RunArguments)."""
    flags = []
    for f in dataclasses.fields(kind):
        if not f.init:
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None
        kind_name = str(f.type).replace("None", "").replace("|", "").strip()
        flags.append(
            Flag(f.name, f.metadata.get("help", ""), default, kind_name if kind_name else "str")
        )
    return flags


def _format_default(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return " ".join(str(item) for item in value) or "(none)"
    return str(value)


def _add(group: Any, flag: Flag, defaults: dict[str, Any]) -> None:
    default = defaults.get(flag.name, flag.default)
    option = f"--{flag.name}"
    # The help is argparse's format string: the recipes' own texts already write % as %%.
    help_text = f"{flag.help} (default: {_format_default(default)})"
    if flag.choices:
        group.add_argument(option, choices=flag.choices, help=help_text)
    elif flag.type == "bool":
        group.add_argument(option, metavar="true|false", nargs="?", help=help_text)
        if flag.default is True:  # the parser's negated spelling: what it really does
            group.add_argument(
                f"--no_{flag.name}",
                action="store_true",
                help=f"The same as --{flag.name} false: turns off what --{flag.name} does.",
            )
    elif flag.type.startswith("list"):
        group.add_argument(option, metavar="VALUE", nargs="+", help=help_text)
    else:
        group.add_argument(option, metavar=flag.name.upper(), help=help_text)


def shown_config_path(config: str | os.PathLike[str] | None, default_config: Any = None) -> str:
    """How the help names the config file: relative to the current folder when it is inside
    it; the recipe's own default as ``configs/NAME`` (where it lives in the checkout) wherever
    the command runs; anything else as the user gave it. Never this machine's absolute path for
    a file the user did not type."""
    if config is None:
        return "none"
    path = Path(config)
    if path.is_absolute():
        try:
            return str(path.relative_to(Path.cwd()))
        except ValueError:
            pass
        if default_config is not None and path == Path(default_config):
            return f"{path.parent.name}/{path.name}"
    return str(config)


def short_help(
    prog: str,
    recipe_classes: Iterable[type],
    config: str | os.PathLike[str] | None,
    *,
    defaults: dict[str, Any] | None = None,
    default_config: str | os.PathLike[str] | None = None,
) -> str:
    """``--help``: ``--config``, the recipe's own flags, amp-trainer's and the common training
    flags, in that order, with ``defaults`` (the config file's values) over the fields' own."""
    defaults = defaults or {}
    shown = shown_config_path(config, default_config)
    parser = argparse.ArgumentParser(
        prog=prog,
        add_help=False,
        usage=f"{prog} [--config FILE.yaml] [--FLAG VALUE ...]",
        formatter_class=_HelpFormatter,
        description=(
            "Flags override the config file. The defaults shown are "
            + (f"{shown}'s (the config file in use)." if config else "the flags' own.")
            + " --help-all lists every flag (all of transformers' TrainingArguments; slower: it "
            "loads transformers)."
        ),
    )
    parser.add_argument_group("config").add_argument(
        "--config",
        metavar="FILE.yaml",
        help=f"YAML of these flags (keys without '--'); 'none': the flags' own defaults. "
        f"(default: {shown})",
    )
    recipe = parser.add_argument_group("the recipe's flags")
    for kind in (*recipe_classes, RunArguments):
        for flag in _flags_of(kind):
            _add(recipe, flag, defaults)
    amp = parser.add_argument_group("amp-trainer's precision and loss-scaler flags")
    for flag in AMP_TRAINER_FLAGS:
        _add(amp, flag, defaults)
    training = parser.add_argument_group(
        "the most used TrainingArguments (--help-all: all of them)"
    )
    for flag in TRAINING_FLAGS:
        _add(training, flag, defaults)
    return parser.format_help()


def _precision_flags() -> argparse.ArgumentParser:
    """The flags that choose a precision, as the full parser reads them (for the launcher
    rule, which asks whether the command line named one)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--precision")
    for flag in ("fp16", "bf16"):
        parser.add_argument(
            f"--{flag}", nargs="?", const=True, type=lambda text: text.lower() in ("true", "1")
        )
    return parser


def answer_help(
    prog: str,
    argv: Sequence[str],
    recipe_classes: Iterable[type],
    default_config: str | os.PathLike[str] | None,
) -> None:
    """Print the short help and exit 0 when ``argv`` asks for it; else return at once.

    ``--config FILE`` in ``argv`` (else ``default_config``) supplies the defaults shown, as
    the run would use them (with ``accelerate launch``'s precision over the file's, the
    :class:`~amp_trainer.recipes.launcher.LauncherPrecision` rule). Imports neither torch nor
    transformers.
    """
    if not wants_short_help(argv):
        return
    config, rest = split_config_flag(argv, default_config)
    values: dict[str, Any] = {}
    if config is not None:
        try:
            values = load_yaml_config(config)
        except FileNotFoundError as err:
            raise UsageError(str(err)) from None
        values = LauncherPrecision(_precision_flags(), argv).settle_config(values, config, rest)
    print(short_help(prog, recipe_classes, config, defaults=values, default_config=default_config))
    sys.stdout.flush()
    raise SystemExit(EXIT_OK)
