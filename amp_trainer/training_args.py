"""AmpTrainer's training arguments: the precision policy and the loss-scaler knobs.

:class:`AmpTrainingArguments` is :class:`~transformers.TrainingArguments` plus the precision policy
and one ``loss_scale_*`` field per :class:`~amp_trainer.scaler.DynamicLossScaler` argument.
:data:`LOSS_SCALER_FIELDS` is the one map from those fields to the scaler's keywords, and
:func:`in_field_names` turns a message that names the keywords (the scaler's, DeepSpeed's) back into
one that names the fields the user wrote; the trainer, its checkpoints and
:func:`~amp_trainer.deepspeed.deepspeed_fp16_config` all use these two.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from transformers import Seq2SeqTrainingArguments, TrainingArguments
from transformers.utils import is_torch_bf16_gpu_available, is_torch_xla_available

from amp_trainer.forward_overflow import check_divergence_policy, check_policy
from amp_trainer.precision import resolve_precision
from amp_trainer.precision_guard import check_guard_mode, check_rollout_mismatch_mode
from amp_trainer.scaler import DynamicLossScaler
from amp_trainer.skip_streak_replay import check_replay_arguments

__all__ = [
    "LOSS_SCALER_FIELDS",
    "AmpSeq2SeqTrainingArguments",
    "AmpTrainingArguments",
    "in_field_names",
]

logger = logging.getLogger(__name__)

_PRECISIONS = ("auto", "fp16", "bf16", "fp32")

#: AmpTrainingArguments field -> DynamicLossScaler keyword. The scaler validates the values; its
#: messages name the keyword, which :func:`in_field_names` translates back to the field the user
#: actually wrote.
LOSS_SCALER_FIELDS: Mapping[str, str] = MappingProxyType(
    {
        "loss_scale_init": "init_scale",
        "loss_scale_growth_factor": "growth_factor",
        "loss_scale_backoff_factor": "backoff_factor",
        "loss_scale_growth_interval": "growth_interval",
        "loss_scale_hysteresis": "hysteresis",
        "loss_scale_min": "min_scale",
        "loss_scale_max": "max_scale",
        "on_min_loss_scale": "on_min_scale",
        "loss_scale_grow_on_underflow": "grow_on_underflow",
    }
)


def in_field_names(message: str) -> str:
    """``message`` with each scaler keyword (``min_scale``) named as its field (``loss_scale_min``).

    Whole words only: the ``min_scale`` inside ``on_min_scale`` is left alone.
    """
    for name, key in LOSS_SCALER_FIELDS.items():
        message = re.sub(rf"\b{key}\b", name, message)
    return message


@dataclass
class AmpTrainingArguments(TrainingArguments):
    """:class:`~transformers.TrainingArguments` plus the precision policy and the loss-scaler knobs.

    ``precision`` and the inherited ``fp16``/``bf16`` flags describe the same thing, so they must
    agree: ``fp16=True`` alone means ``precision="fp16"``, ``precision="fp16"`` alone sets
    ``fp16=True``, and a contradiction (``precision="fp32", bf16=True``) is a ``ValueError``.
    After ``__post_init__``, ``precision`` holds the resolved value (never ``"auto"``) and the
    flags match it, so the arguments saved with a checkpoint say what actually ran.
    """

    precision: Literal["auto", "fp16", "bf16", "fp32"] = field(
        default="auto",
        metadata={
            "help": "Training precision. 'auto' follows --fp16/--bf16 when given, else picks for "
            "the device: fp16 on CUDA, bf16 where the hardware has it, fp32 otherwise. fp16 on a "
            "CPU is real (autocast + loss scaling), only slow."
        },
    )
    keep_norms_fp32: bool = field(
        default=True,
        metadata={
            "help": "Keep normalisation layers (LayerNorm, RMSNorm, BatchNorm, ...) in fp32, "
            "parameters and arithmetic, under fp16/bf16 autocast."
        },
    )
    loss_scale_init: float = field(
        default=2.0**16, metadata={"help": "Initial loss scale S (fp16 only)."}
    )
    loss_scale_growth_factor: float = field(
        default=2.0,
        metadata={"help": "S is multiplied by this after growth_interval clean steps (> 1)."},
    )
    loss_scale_backoff_factor: float = field(
        default=0.5, metadata={"help": "S is multiplied by this on overflow, in (0, 1)."}
    )
    loss_scale_growth_interval: int = field(
        default=2000, metadata={"help": "Consecutive clean optimizer steps before S grows."}
    )
    loss_scale_hysteresis: int = field(
        default=1,
        metadata={
            "help": "Back off on the N-th overflow; N-1 overflows are tolerated (the step is still "
            "skipped). 1 is torch.amp.GradScaler's behaviour."
        },
    )
    loss_scale_underflow_check_interval: int = field(
        default=500,
        metadata={
            "help": "fp16: every N optimizer steps (and on the first), measure the share of the "
            "gradient FP16 flushes to zero at the current loss scale and the doublings of scale "
            "left (log keys grad_underflow, grad_headroom, grad_unreachable): about five extra "
            "backward passes on that step (up to 11). 0 turns the meter off."
        },
    )
    loss_scale_grow_on_underflow: bool = field(
        default=False,
        metadata={
            "help": "fp16: when the underflow meter finds more than 0.1 percent of the gradient "
            "flushed and the headroom allows, grow the loss scale at once to the scale that "
            "fixes it (checking again on the next step) instead of after growth_interval clean "
            "steps."
        },
    )
    max_consecutive_skipped_steps: int = field(
        default=100,
        metadata={
            "help": "End the run with LossScaleError after this many optimizer steps in a row were "
            "skipped for non-finite gradients, whatever on_min_loss_scale says: such a run no "
            "longer trains. 0 disables the limit."
        },
    )
    skip_streak_replay: int = field(
        default=8,
        metadata={
            "help": "fp16: after this many optimizer steps in a row were skipped (or sooner, when "
            "the loss scale reached loss_scale_min), replay the last batch from the unchanged "
            "weights in fp32 and fp16 at lower scales and act on the verdict (scale_warmup, "
            "fp16_backward_range: the module made an fp32 island, data, divergence). 0 turns "
            "it off."
        },
    )
    skip_streak_quarantine: int = field(
        default=0,
        metadata={
            "help": "How many batches a replay's 'data' verdict (non-finite in fp32 too while "
            "other batches are finite) may drop, its update skipped, before the run stops with "
            "BadBatchError naming the batch. 0: the first one stops the run. (A batch whose "
            "loss itself is non-finite is the forward-overflow guard's first: with "
            "on_forward_overflow='fp32' and no quarantine it stops with NonFiniteForwardError.)"
        },
    )
    loss_scale_min: float | None = field(
        default=None,
        metadata={
            "help": "The loss scale never goes below this (None: 1.0, or loss_scale_init if lower)."
        },
    )
    loss_scale_max: float | None = field(
        default=None, metadata={"help": "The loss scale never grows above this (None: unbounded)."}
    )
    on_min_loss_scale: Literal["raise", "warn", "clamp"] = field(
        default="raise",
        metadata={
            "help": "What an overflow at loss_scale_min does: 'raise' LossScaleError naming the "
            "overflowing parameters, 'warn' and keep skipping, or 'clamp' silently."
        },
    )
    fp32_modules: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Modules kept in fp32 (parameters and arithmetic) under fp16/bf16: qualified "
            "names, dotted suffixes ('wo') or globs; added to the model's _keep_in_fp32_modules."
        },
    )
    on_forward_overflow: Literal["fp32", "raise", "skip"] = field(
        default="fp32",
        metadata={
            "help": "fp16: what a module whose forward output overflows (loss already inf/NaN) "
            "does: 'fp32' keep it in fp32 from then on and train on, 'raise' LossScaleError "
            "naming it, 'skip' skip the step and back the scale off like a gradient overflow."
        },
    )
    on_divergence: Literal["raise", "warn"] = field(
        default="raise",
        metadata={
            "help": "fp16: what a forward overflow that is really divergence does (the module's "
            "weights or the loss far beyond their values at the first step): 'raise' "
            "DivergenceError naming the learning rate and the evidence, 'warn' warn once and go "
            "on. Either way no fp32 island is added for it."
        },
    )
    checkpoint_digests: bool = field(
        default=True,
        metadata={
            "help": "Record the size and SHA-256 of every file of each checkpoint "
            "(checkpoint-digests.json, written last) and compare them before a resume or the "
            "best-model load reads any file: a truncated or changed file is one error naming "
            "it, and resume_from_checkpoint=True passes a damaged checkpoint over. False: "
            "neither written nor checked."
        },
    )

    precision_guard: Literal["raise", "repair", "warn", "off"] = field(
        default="raise",
        metadata={
            "help": "What a dtype drift does (master weights, optimizer state or gradients at a "
            "lower precision than at the start, an FP32 island lost, FP16 forwards without the "
            "loss scaler or the scaler without FP16 forwards): 'raise' PrecisionDriftError "
            "before the optimizer step, 'repair' put the dtypes back and go on, 'warn' only "
            "say it, 'off' no check. A cast under torch.no_grad() (a generation) is undone "
            "exactly in every mode but 'off'."
        },
    )

    rollout_precision_mismatch: Literal["raise", "allow"] = field(
        default="raise",
        metadata={
            "help": "RL (TRL GRPO/RLOO): what a rollout side sampling in another precision than "
            "the trainer's does (vLLM's dtype, from its engine or server or, before it starts, "
            "from the checkpoint's config by vLLM's 'auto' rule): 'raise' RolloutPrecisionError "
            "before the first step (before vLLM is started where it can be known then), "
            "'allow' the mismatch is intended: one warning, and a PrecisionMismatchCallback "
            "measures the rollout precision's log-probability gap. Independent of "
            "precision_guard."
        },
    )

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Note the fp16/bf16 flags a subclass instance was built with, before any __post_init__.

        In ``class A(SFTConfig, AmpTrainingArguments)`` TRL's ``__post_init__`` runs first and
        replaces its ``bf16=None`` default with ``True``; only the values the dataclass
        ``__init__`` assigned say what the user asked for.
        """
        super().__init_subclass__(**kwargs)
        post_init = cls.__post_init__

        @functools.wraps(post_init)
        def __post_init__(self: AmpTrainingArguments, *args: Any, **kw: Any) -> None:
            if "_amp_flags_given" not in self.__dict__:
                self._amp_flags_given = {"fp16": self.fp16, "bf16": self.bf16}
            post_init(self, *args, **kw)

        cls.__post_init__ = __post_init__

    def __post_init__(self) -> None:
        # Resolve before TrainingArguments.__post_init__, which derives mixed_precision (and so
        # Accelerate's autocast) from the fp16/bf16 flags. TrainingArguments 5.24 does not refuse
        # fp16 on a CPU; it just never turns it on (Accelerate drops it), which AmpTrainer fixes.
        # `accelerate launch --cpu` says "CPU" only through ACCELERATE_USE_CPU, which
        # TrainingArguments reads for the device but not for its bf16 check (it would refuse bf16).
        if os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes"):
            self.use_cpu = True
        self.precision = self._resolve_precision()
        if self.precision == "bf16" and not (
            is_torch_bf16_gpu_available() or is_torch_xla_available()
        ):
            self.use_cpu = True  # the CPU is the only bf16 device here: what bf16 means is clear
        self.fp16 = self.precision == "fp16"
        self.bf16 = self.precision == "bf16"
        super().__post_init__()
        # TrainingArguments falls back to ACCELERATE_MIXED_PRECISION when both flags are False,
        # which would run `accelerate launch`'s fp16 under an explicit precision="fp32".
        self.mixed_precision = {"fp16": "fp16", "bf16": "bf16"}.get(self.precision, "no")
        self.loss_scaler_kwargs()  # validate the knobs now, not at the first optimizer step
        check_policy(self.on_forward_overflow)
        check_divergence_policy(self.on_divergence)
        check_guard_mode(self.precision_guard)
        check_rollout_mismatch_mode(self.rollout_precision_mismatch)
        smoothing = self.label_smoothing_factor
        if not 0.0 <= smoothing <= 1.0:  # stock accepts nan: every loss NaN, every step skipped
            raise ValueError(f"label_smoothing_factor must be in [0, 1], got {smoothing!r}")
        if isinstance(self.fp32_modules, str):
            self.fp32_modules = [self.fp32_modules]
        limit = self.max_consecutive_skipped_steps
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(
                f"max_consecutive_skipped_steps must be an int >= 0 (0: no limit), got {limit!r}"
            )
        check_replay_arguments(self.skip_streak_replay, self.skip_streak_quarantine)
        interval = self.loss_scale_underflow_check_interval
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
            raise ValueError(
                "loss_scale_underflow_check_interval must be an int >= 0 (0: no checks), got "
                f"{interval!r}"
            )
        if self.loss_scale_grow_on_underflow and interval == 0:
            # The two-sided rule acts on the meter's readings; with the meter off it never would.
            raise ValueError(
                "loss_scale_grow_on_underflow=True needs the underflow meter, but "
                "loss_scale_underflow_check_interval=0 turns it off: set the interval to N > 0 "
                "(checks every N optimizer steps; default 500) or grow_on_underflow to False"
            )

    def _resolve_precision(self) -> str:
        requested = self.precision
        if requested not in _PRECISIONS:
            raise ValueError(f"precision must be one of {_PRECISIONS}, got {requested!r}")
        # The flags as the caller set them, before any parent class's __post_init__ filled in a
        # default of its own (TRL's configs turn bf16=None into bf16=not fp16 before ours runs).
        given = self.__dict__.pop("_amp_flags_given", None) or {
            name: getattr(self, name) for name in ("fp16", "bf16")
        }
        flags = [name for name in ("fp16", "bf16") if given[name]]
        if len(flags) > 1:
            raise ValueError("At most one of fp16 and bf16 can be True, got fp16=True, bf16=True")
        if flags and requested not in ("auto", flags[0]):
            raise ValueError(
                f"precision={requested!r} contradicts {flags[0]}=True: set one of them, or make "
                "them agree"
            )
        if requested == "auto" and flags:
            requested = flags[0]
        elif requested == "auto":
            # `accelerate launch --mixed_precision fp16` (or its config file) exports this:
            # "auto" follows the launcher, as a plain TrainingArguments would.
            launcher = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
            requested = {"fp16": "fp16", "bf16": "bf16"}.get(launcher, "auto")
            if requested != "auto":
                logger.info("precision='auto' picked %s: the launcher's mixed_precision", requested)
        device = "cpu" if self.use_cpu else None
        precision = resolve_precision(requested, device)
        if (
            requested == "auto"
            and precision == "bf16"
            and not self.use_cpu
            and not is_torch_bf16_gpu_available()
            and not is_torch_xla_available()
        ):
            # A bf16-capable CPU and no accelerator: TrainingArguments refuses bf16 there unless
            # use_cpu=True says the CPU is meant. "auto" must not turn that into an error.
            logger.info(
                "precision='auto' trains in fp32 after all: transformers allows bf16 on a CPU "
                "only with use_cpu=True (--use_cpu true), which gives the bf16 above"
            )
            precision = "fp32"
        return precision

    def loss_scaler_kwargs(self) -> dict[str, Any]:
        """The :class:`DynamicLossScaler` keyword arguments these fields describe (validated)."""
        kwargs = {key: getattr(self, name) for name, key in LOSS_SCALER_FIELDS.items()}
        try:
            DynamicLossScaler("cpu", **kwargs)  # validation only: allocates nothing
        except (TypeError, ValueError) as err:
            raise ValueError(in_field_names(str(err))) from err
        return kwargs


@dataclass
class AmpSeq2SeqTrainingArguments(AmpTrainingArguments, Seq2SeqTrainingArguments):
    """:class:`AmpTrainingArguments` and :class:`~transformers.Seq2SeqTrainingArguments` in one."""
