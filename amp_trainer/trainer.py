"""AmpTrainer: a :class:`transformers.Trainer` that gets FP16 right.

Stock ``Trainer(fp16=True)`` (transformers 5.24, accelerate 1.15) has four defects this subclass
fixes, each reproduced against the stock class in ``tests/test_trainer_regressions.py``:

1. With the default optimizer (``adamw_torch_fused``) an overflow step is not seen as skipped:
   torch's GradScaler calls a fused optimizer's ``step()`` even on overflow, so Accelerate's
   skip detection (which watches ``step()``) reports nothing and the LR scheduler advances.
   Here :class:`~amp_trainer.scaler.DynamicLossScaler` does not call ``step()`` on overflow, so
   every optimizer kind reports the skip and the scheduler holds.
2. ``gradient_accumulation_steps=N`` with a model whose ``forward`` takes ``**kwargs`` but does
   not use ``num_items_in_batch`` (``BertForSequenceClassification``): Trainer assumes the model
   normalises the loss itself, so loss and gradients come out N times too large. Here the model's
   ``forward`` source is checked for a consumer of ``num_items_in_batch``.
3. ``fp16=True`` on a CPU trains in plain FP32 without a word. Here it is real FP16 (autocast plus
   the scaler, through :func:`amp_trainer.accelerate_hooks.install_scaler`).
4. PEFT ``modules_to_save`` copies (e.g. the LoRA ``SEQ_CLS`` classifier) of an FP16-loaded model
   stay FP16 and training dies with "Attempting to unscale FP16 gradients". Here trainable
   parameters are cast to FP32 master weights before the optimizer is built.

And it makes the scaler observable: ``loss_scale``, ``skipped_steps`` and ``step_skipped`` go into
the normal Trainer logs (so ``state.log_history`` and every ``report_to`` integration get them), an
overflow step logs no ``grad_norm: inf``, the overflowing parameters are named at INFO level,
``trainer.scale_history`` keeps one entry per optimizer step, and the full scaler state travels
with every checkpoint (Trainer saves ``accelerator.scaler.state_dict()`` as ``scaler.pt``; that
object is our scaler).

A forward overflow (the unscaled loss already inf/NaN) is told from a gradient overflow on
skipped steps and handled by :mod:`amp_trainer.forward_overflow` (``on_forward_overflow``): by
default the module that overflowed becomes an FP32 island, named in one warning, recorded in
``model.config`` (so checkpoints carry it) and restored on resume.

``global_step`` still counts optimizer step *attempts*, skipped ones included, as in stock Trainer
(``max_steps``, ``save_steps`` and ``logging_steps`` keep their meaning); skipped steps are
recorded rather than hidden.

Only public Trainer surface is overridden (checked against transformers 5.24):
``create_accelerator_and_postprocess`` (install the scaler before ``prepare``), ``create_optimizer``
(precision policy on the model actually trained), ``log`` (scaler fields), ``training_step``
(remembers each micro-batch's loss for the forward-overflow check, no sync) and the
``model_accepts_loss_kwargs`` attribute; the skip rule itself is stock Trainer's
(``lr_scheduler.step()`` unless ``accelerator.optimizer_step_was_skipped``), made truthful.
Checkpointing and resume need three private hooks, the only places stock Trainer saves a
checkpoint and loads ``scaler.pt`` and the weights: ``_save_checkpoint`` (amp_trainer_state.json,
a full disk as one error without a half-written folder, rotation that spares another run's
checkpoints), ``_load_scaler`` (another precision, a missing ``scaler.pt``, overridden flags:
said, not silent) and ``_load_from_checkpoint`` (the FP32 islands back from the checkpoint's
config.json);
``train`` itself only gains the finished-run check in front of stock ``train``.
"""

from __future__ import annotations

import errno
import functools
import inspect
import json
import logging
import math
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from transformers import (
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.trainer_callback import TrainerState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, TrainOutput
from transformers.utils import is_torch_bf16_gpu_available, is_torch_xla_available

from amp_trainer.atomic_files import is_disk_full, write_json_atomic
from amp_trainer.forward_overflow import ForwardOverflowGuard, check_policy
from amp_trainer.islands import apply_fp32_policy, recorded_fp32_islands, restore_fp32_islands
from amp_trainer.precision import cast_trainable_params_to_fp32, resolve_precision
from amp_trainer.scaler import DynamicLossScaler, LossScaleError

try:
    from transformers.trainer_utils import unwrap_peft_model
except ImportError:  # transformers 5.0 and 5.1 have no public unwrap_peft_model

    def unwrap_peft_model(model: nn.Module) -> nn.Module:
        """The model under a PEFT wrapper (``PeftModel``, ``PeftMixedModel``), else ``model``."""
        from transformers.utils import is_peft_available

        if is_peft_available():
            from peft import PeftMixedModel, PeftModel

            if isinstance(model, PeftModel):
                return model.get_base_model()
            if isinstance(model, PeftMixedModel):  # has no get_base_model
                return model.base_model.model
        return model


__all__ = [
    "AmpSeq2SeqTrainer",
    "AmpSeq2SeqTrainingArguments",
    "AmpTrainer",
    "AmpTrainerMixin",
    "AmpTrainingArguments",
]

logger = logging.getLogger(__name__)

_PRECISIONS = ("auto", "fp16", "bf16", "fp32")
# Stock Trainer's checkpoint file names (transformers.trainer module constants).
_SCALER_FILE, _TRAINER_STATE_FILE = "scaler.pt", "trainer_state.json"
#: What amp-trainer adds to every checkpoint: the precision and loss-scaler settings the run
#: started with and the whole run's scale history, so that a resumed run can tell what changed
#: and report all of its steps, not just those since the resume.
AMP_STATE_FILE = "amp_trainer_state.json"
# Default runaway guard for arguments without the field (a plain TrainingArguments or SFTConfig):
# the limit transformers' own Trainer applies to consecutive skipped optimizer steps.
_MAX_CONSECUTIVE_SKIPS = 100

# AmpTrainingArguments field -> DynamicLossScaler keyword. The scaler validates the values; its
# messages name the keyword, which we translate back to the field the user actually wrote.
_SCALER_FIELDS = {
    "loss_scale_init": "init_scale",
    "loss_scale_growth_factor": "growth_factor",
    "loss_scale_backoff_factor": "backoff_factor",
    "loss_scale_growth_interval": "growth_interval",
    "loss_scale_hysteresis": "hysteresis",
    "loss_scale_min": "min_scale",
    "loss_scale_max": "max_scale",
    "on_min_loss_scale": "on_min_scale",
}


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
    max_consecutive_skipped_steps: int = field(
        default=100,
        metadata={
            "help": "End the run with LossScaleError after this many optimizer steps in a row were "
            "skipped for non-finite gradients, whatever on_min_loss_scale says: such a run no "
            "longer trains. 0 disables the limit."
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
        if isinstance(self.fp32_modules, str):
            self.fp32_modules = [self.fp32_modules]
        limit = self.max_consecutive_skipped_steps
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(
                f"max_consecutive_skipped_steps must be an int >= 0 (0: no limit), got {limit!r}"
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
            logger.info("precision='auto' picked fp32 here; pass use_cpu=True to get bf16 on CPU")
            precision = "fp32"
        return precision

    def loss_scaler_kwargs(self) -> dict[str, Any]:
        """The :class:`DynamicLossScaler` keyword arguments these fields describe (validated)."""
        kwargs = {key: getattr(self, name) for name, key in _SCALER_FIELDS.items()}
        try:
            DynamicLossScaler("cpu", **kwargs)  # validation only: allocates nothing
        except (TypeError, ValueError) as err:
            message = str(err)
            for name, key in _SCALER_FIELDS.items():
                message = re.sub(rf"\b{key}\b", name, message)
            raise ValueError(message) from err
        return kwargs


def _precision_of(args: TrainingArguments) -> str:
    """The precision a (possibly plain) TrainingArguments asks for."""
    if isinstance(args, AmpTrainingArguments):
        return args.precision
    if args.fp16:
        return resolve_precision("fp16", args.device)
    return "bf16" if args.bf16 else "fp32"


def _forward_consumes_num_items(model: nn.Module) -> bool:
    """Whether ``model.forward`` really uses ``num_items_in_batch`` to normalise its loss.

    Stock Trainer (5.24, ``Trainer.__init__``) answers "yes" for any ``forward`` with ``**kwargs``
    and then skips its own division by ``gradient_accumulation_steps``. Models that compute the
    loss with a plain ``CrossEntropyLoss`` (``BertForSequenceClassification``) swallow the kwarg,
    so loss and gradients grow N-fold. transformers' models that honour it do so through
    ``self.loss_function`` (or by naming the argument); when in doubt we answer "no", which gives
    the per-micro-batch mean divided by N: the right magnitude for every model.
    """
    unwrapped = unwrap_peft_model(model)
    explicit = getattr(unwrapped, "accepts_loss_kwargs", None)
    if explicit is not None:  # the model's author said so
        return bool(explicit)
    forward = unwrapped.forward
    params = inspect.signature(forward).parameters
    if "num_items_in_batch" in params:
        return True
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return False
    try:
        source = inspect.getsource(type(unwrapped).forward)
    except (OSError, TypeError):
        return False
    return "loss_function" in source or "num_items_in_batch" in source


class _LossScaleMonitor(TrainerCallback):
    """Records one ``scale_history`` entry per optimizer step and names overflowing parameters.

    Runs first among the callbacks, so user callbacks see an up-to-date history. Costs two Python
    floats per step: the skip verdict is the one the scaler already synced to the host.
    """

    def __init__(self, trainer: AmpTrainerMixin) -> None:
        self._trainer = trainer
        self._scale_before_step = 1.0
        self._skips_in_a_row = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self._skips_in_a_row = 0

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        scaler = self._trainer.loss_scaler
        if scaler is not None:
            self._scale_before_step = scaler.get_scale()

    def on_optimizer_step(self, args, state, control, **kwargs):
        scaler = self._trainer.loss_scaler
        if scaler is None:
            return
        forward = None
        if self._trainer._forward_overflow is not None:
            forward = self._trainer._forward_overflow.after_step()  # work only on skipped steps
        skipped = scaler.step_was_skipped
        step = state.global_step + 1  # global_step is incremented right after this event
        self._trainer.scale_history.append(
            {"step": step, "scale": self._scale_before_step, "skipped": skipped}
        )
        self._trainer._last_step_skipped = skipped
        if skipped and forward is None:  # a forward overflow was reported as such already
            names = scaler.stats.last_overflow_params
            logger.info(
                "Step %d skipped: non-finite gradients at loss scale %g (now %g)%s",
                step,
                self._scale_before_step,
                scaler.get_scale(),
                f" in {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}" if names else "",
            )
        self._skips_in_a_row = self._skips_in_a_row + 1 if skipped else 0
        limit = getattr(args, "max_consecutive_skipped_steps", _MAX_CONSECUTIVE_SKIPS)
        if limit and self._skips_in_a_row >= limit:
            # Every on_min_loss_scale mode ends here: "warn"/"clamp" (and "raise" with a low
            # loss_scale_min or hysteresis) would otherwise skip to max_steps and return normally.
            names = scaler.stats.last_overflow_params
            raise LossScaleError(
                f"{self._skips_in_a_row} consecutive optimizer steps were skipped (steps "
                f"{step - self._skips_in_a_row + 1}-{step}, non-finite gradients; loss scale now "
                f"{scaler.get_scale():g}): the run is no longer training, so it stops here "
                f"(max_consecutive_skipped_steps={limit})."
                + (f" Last overflowing parameters: {', '.join(names[:8])}." if names else "")
                + " Rerun the batch in FP32 (`amp-trainer doctor`) to tell a model/data/learning "
                "rate bug from an FP16 range problem."
            )


class AmpTrainerMixin(Trainer):
    """All of :class:`AmpTrainer`'s behaviour, for any :class:`transformers.Trainer` subclass.

    Mix it into any Trainer class, in either order: ``class X(AmpTrainerMixin, Seq2SeqTrainer)``
    or ``class X(SFTTrainer, AmpTrainerMixin)``. It derives from ``Trainer`` itself so that the
    method resolution order always puts it between the other class and ``Trainer`` (a plain
    ``object`` mixin listed second would come after ``Trainer`` and never run).

    Use it exactly like ``Trainer``; pass :class:`AmpTrainingArguments` for the scaler knobs (a
    plain ``TrainingArguments`` works too, with the scaler's defaults). ``loss_scaler`` replaces
    the scaler built from the arguments, e.g. to share one across trainers or to set
    ``process_group``.

    Attributes:
        loss_scaler: the :class:`DynamicLossScaler` in use (``None`` for bf16/fp32 and DeepSpeed,
            whose engine scales the loss itself).
        scale_history: one ``{"step", "scale", "skipped"}`` dict per optimizer step of this run;
            ``scale`` is the loss scale the step ran with. A resumed run starts from the
            checkpoint's history, so it covers the whole run, not just this process.
        resume_overrides: ``{field: {"given": ..., "used": ...}}`` for each loss-scaler argument
            that the checkpoint's scaler state overrode on resume (also logged, and written back
            into ``args`` so that what is recorded is what ran).
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Take ``loss_scaler=`` before any ``__init__`` in the chain sees it.

        In ``class X(Seq2SeqTrainer, AmpTrainerMixin)`` ``Seq2SeqTrainer.__init__`` runs first and
        names its parameters, so it would refuse the keyword: each subclass's ``__init__`` is
        wrapped to set the scaler aside, and the mixin's ``__init__`` picks it up.
        """
        super().__init_subclass__(**kwargs)
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self: AmpTrainerMixin, *args: Any, **kw: Any) -> None:
            if "loss_scaler" in kw:
                self._amp_loss_scaler_given = kw.pop("loss_scaler")
            init(self, *args, **kw)

        cls.__init__ = __init__

    def __init__(
        self, *args: Any, loss_scaler: DynamicLossScaler | None = None, **kwargs: Any
    ) -> None:
        if loss_scaler is None:  # set aside by a subclass's __init__ (see __init_subclass__)
            loss_scaler = self.__dict__.pop("_amp_loss_scaler_given", None)
        if loss_scaler is not None and not isinstance(loss_scaler, DynamicLossScaler):
            raise TypeError(
                f"loss_scaler must be a DynamicLossScaler or None, got {type(loss_scaler).__name__}"
            )
        self._requested_scaler = loss_scaler
        self.loss_scaler: DynamicLossScaler | None = None
        self.scale_history: list[dict[str, Any]] = []
        self.resume_overrides: dict[str, dict[str, Any]] = {}
        self._resume_step: int | None = None
        self._checkpoints_at_start: dict[str, int] = {}
        self._last_step_skipped = False
        self._forward_overflow: ForwardOverflowGuard | None = None
        super().__init__(*args, **kwargs)
        self.callback_handler.callbacks.insert(0, _LossScaleMonitor(self))

        stock = self.model_accepts_loss_kwargs
        self.model_accepts_loss_kwargs = _forward_consumes_num_items(
            self.accelerator.unwrap_model(self.model)
        )
        if stock and not self.model_accepts_loss_kwargs:
            logger.info(
                "%s.forward takes **kwargs but does not use num_items_in_batch: the loss is "
                "divided by gradient_accumulation_steps here (stock Trainer would not).",
                type(unwrap_peft_model(self.model)).__name__,
            )
        if getattr(self, "loss_is_scaled_for_ga", None) is not None:
            # The trainer class says how its own compute_loss scales (TRL's DPO, GRPO, ...; and TRL
            # sets model_accepts_loss_kwargs from it on transformers < 5.19): keep its answer.
            self.model_accepts_loss_kwargs = stock

    # -- accelerator -------------------------------------------------------------------------
    def create_accelerator_and_postprocess(self) -> None:
        """Build the stock accelerator, then put our scaler (and real CPU fp16) into it."""
        from amp_trainer.accelerate_hooks import install_scaler  # imports accelerate internals

        super().create_accelerator_and_postprocess()
        self.precision = _precision_of(self.args)
        if self._requested_scaler is not None and self.precision != "fp16":
            raise ValueError(
                f"A loss_scaler was passed but the run is {self.precision}, which uses no loss "
                "scaling (the scaler and fp16 autocast go on and off together)."
            )
        if self.precision == "fp16" and self.is_deepspeed_enabled:
            logger.warning(
                "DeepSpeed runs its own FP16 loss scaler; amp-trainer's is not installed. Map the "
                "loss_scale_* arguments with amp_trainer.accelerate_hooks.deepspeed_fp16_config()."
            )
        elif self.precision == "fp16":
            scaler = self._requested_scaler
            if scaler is None:
                scaler_kwargs = (
                    self.args.loss_scaler_kwargs()
                    if isinstance(self.args, AmpTrainingArguments)
                    else {}
                )
                scaler = DynamicLossScaler(self.args.device.type, **scaler_kwargs)
            self.loss_scaler = install_scaler(self.accelerator, scaler)
        self._apply_precision_policy(self.model)

    def _apply_precision_policy(self, model: nn.Module | None) -> None:
        """FP32 master weights, FP32 norms and named overflows for ``model``; idempotent."""
        if model is None or self.precision == "fp32":
            return
        if self.precision == "fp16":
            cast = cast_trainable_params_to_fp32(model)
            if cast:
                logger.warning(
                    "Cast %d trainable parameter(s) to fp32 master weights for fp16 training "
                    "(e.g. %s); the loss scaler cannot unscale fp16 gradients.",
                    len(cast),
                    cast[0],
                )
        apply_fp32_policy(
            model,
            self.precision,
            norms=getattr(self.args, "keep_norms_fp32", True),
            modules=getattr(self.args, "fp32_modules", ()),
        )
        if self.loss_scaler is not None:
            self.loss_scaler.watch(model)
            policy = getattr(self.args, "on_forward_overflow", "fp32")
            guard = self._forward_overflow
            if policy != "skip" and (guard is None or guard.model is not model):
                self._forward_overflow = ForwardOverflowGuard(
                    model, self.loss_scaler, policy=policy
                )

    def training_step(self, model: nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        loss = super().training_step(model, inputs, *args, **kwargs)
        if self._forward_overflow is not None:
            self._forward_overflow.observe(loss, inputs)  # no sync; read only on skipped steps
        return loss

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        # The FP32 islands the run had added are in the checkpoint's config.json: put them back.
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        config = os.path.join(resume_from_checkpoint, "config.json")
        if self.precision != "fp32" and os.path.isfile(config):
            with open(config, encoding="utf-8") as handle:
                names = recorded_fp32_islands(json.load(handle))
            if names and self.model is not None:
                restore_fp32_islands(self.model, names)
                guard = self._forward_overflow
                if guard is not None:
                    guard.islands = list(dict.fromkeys([*names, *guard.islands]))

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        # The model trained may differ from the one at __init__ (model_init, hyperparameter
        # search), so the policy is applied again on the model the optimizer is built for.
        self._apply_precision_policy(self.model if model is None else model)
        if model is None:  # before transformers 5.3, create_optimizer(self) takes no model
            return super().create_optimizer()
        return super().create_optimizer(model)

    # -- observability -----------------------------------------------------------------------
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add the loss scale and skip counts to training logs; never log an inf grad_norm."""
        if self.loss_scaler is not None and "loss" in logs:
            grad_norm = logs.get("grad_norm")
            if grad_norm is not None and not math.isfinite(grad_norm):
                del logs["grad_norm"]  # an overflow step: its norm is meaningless, not "inf"
            logs["loss_scale"] = self.loss_scaler.get_scale()
            logs["skipped_steps"] = self.loss_scaler.stats.skipped
            logs["step_skipped"] = int(self._last_step_skipped)
            if self._forward_overflow is not None:
                logs["fp32_islands_added"] = len(self._forward_overflow.islands)
        super().log(logs, start_time)

    # -- checkpoints and resume: say what happens, never lose a finished run ------------------
    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
        **kwargs: Any,
    ) -> TrainOutput:
        """Stock ``train``, except that resuming a finished run trains nothing and says so.

        Stock Trainer, resumed from the checkpoint of the last step (``global_step ==
        max_steps``), trains one more step every time. Here the checkpoint's model and state are
        loaded and its final training metrics returned, with a warning naming the checkpoint.
        """
        checkpoint = resume_from_checkpoint
        if checkpoint is True:
            from transformers.trainer_utils import get_last_checkpoint

            checkpoint = get_last_checkpoint(self.args.output_dir) or True  # stock raises
        self._note_checkpoints_at_start(checkpoint)
        if isinstance(checkpoint, (str, os.PathLike)):
            done = self._finished_run(str(checkpoint))
            if done is not None:
                return done
        return super().train(
            resume_from_checkpoint=checkpoint,
            trial=trial,
            ignore_keys_for_eval=ignore_keys_for_eval,
            **kwargs,
        )

    def _note_checkpoints_at_start(self, checkpoint: Any) -> None:
        """Remember the checkpoints already in output_dir and the step resumed from."""
        self._resume_step = None
        if isinstance(checkpoint, (str, os.PathLike)):
            self._resume_step = _checkpoint_step(Path(checkpoint))
        folder = Path(self.args.output_dir)
        self._checkpoints_at_start = {
            path.name: step
            for path in (folder.glob(f"{PREFIX_CHECKPOINT_DIR}-*") if folder.is_dir() else ())
            if path.is_dir() and (step := _checkpoint_step(path)) is not None
        }

    def _finished_run(self, checkpoint: str) -> TrainOutput | None:
        """The run's result if ``checkpoint`` is its last step, else ``None`` (train on)."""
        state_file = Path(checkpoint) / _TRAINER_STATE_FILE
        if not state_file.is_file():
            return None  # stock train refuses a checkpoint without its state
        state = TrainerState.load_from_json(str(state_file))
        if self.args.max_steps > 0:
            target = self.args.max_steps
        elif self.args.num_train_epochs > (state.num_train_epochs or 0):
            return None  # more epochs asked for than the checkpoint's run had
        else:
            target = state.max_steps
        if not target or state.global_step < target:
            return None
        logger.warning(
            "%s is the end of its run (step %d of max_steps %d): nothing to train. The model is "
            "the checkpoint's; pass a larger max_steps (or num_train_epochs) to train on.",
            checkpoint,
            state.global_step,
            target,
        )
        self._load_from_checkpoint(checkpoint)
        self.state = state
        self._restore_scale_history(Path(checkpoint))
        final = next((e for e in reversed(state.log_history) if "train_loss" in e), {})
        metrics = {k: v for k, v in final.items() if k.startswith("train_") or k == "total_flos"}
        return TrainOutput(state.global_step, final.get("train_loss", float("nan")), metrics)

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        """Stock checkpointing plus :data:`AMP_STATE_FILE`; a full disk is one clear error.

        On a full disk torch says only "[enforce fail at inline_container.cc] ... file write
        failed" and leaves a half-written ``checkpoint-N``: here that folder is removed and an
        ``OSError(ENOSPC)`` names it. Checkpoints that were in output_dir before this run (and
        are not the earlier steps of the run resumed) are left out of ``save_total_limit``
        rotation: they belong to another run.
        """
        run_dir = Path(self._get_output_dir(trial=trial))
        folder = run_dir / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        existed = folder.exists()
        limit = self.args.save_total_limit
        foreign = self._foreign_checkpoints(run_dir)
        try:
            if foreign and limit:
                self.args.save_total_limit = None  # rotated below, without the foreign ones
            super()._save_checkpoint(model, trial)
            if self.args.should_save:
                write_json_atomic(folder / AMP_STATE_FILE, self._amp_state())
        except Exception as err:
            if not is_disk_full(err, run_dir):
                raise
            if self.args.should_save and not existed:
                shutil.rmtree(folder, ignore_errors=True)
            raise OSError(
                errno.ENOSPC,
                f"no space left on device saving {folder.name} in {run_dir}; the partial "
                "checkpoint was removed. Free some space and resume from the previous checkpoint.",
            ) from err
        finally:
            self.args.save_total_limit = limit
        if foreign and limit and self.args.should_save:
            self._rotate_own_checkpoints(run_dir, foreign, limit)

    def _foreign_checkpoints(self, run_dir: Path) -> set[str]:
        """Checkpoints of another run that were in ``run_dir`` when training started."""
        if Path(self.args.output_dir).resolve() != run_dir.resolve():
            return set()  # hyperparameter-search trial folders: stock behaviour
        resumed = self._resume_step
        foreign = {
            name
            for name, step in self._checkpoints_at_start.items()
            if resumed is None or step > resumed
        }
        if foreign and not getattr(self, "_warned_foreign", False):
            self._warned_foreign = True
            logger.warning(
                "output_dir %s holds checkpoint(s) of another run (%s); save_total_limit "
                "rotation leaves them alone.",
                run_dir,
                ", ".join(sorted(foreign)),
            )
        return {name for name in foreign if (run_dir / name).is_dir()}

    def _rotate_own_checkpoints(self, run_dir: Path, foreign: set[str], limit: int) -> None:
        """``save_total_limit`` over this run's checkpoints only (the best one is kept)."""
        own = sorted(
            (step, path)
            for path in run_dir.glob(f"{PREFIX_CHECKPOINT_DIR}-*")
            if path.is_dir()
            and path.name not in foreign
            and (step := _checkpoint_step(path)) is not None
        )
        best = self.state.best_model_checkpoint
        keep = {path for _, path in own[-limit:]}
        for _, path in own:
            if path not in keep and (best is None or Path(best).resolve() != path.resolve()):
                logger.info("Deleting older checkpoint %s (save_total_limit=%d)", path, limit)
                shutil.rmtree(path, ignore_errors=True)

    def _amp_state(self) -> dict[str, Any]:
        args = self.args
        return {
            "precision": self.precision,
            "loss_scaler": args.loss_scaler_kwargs()
            if isinstance(args, AmpTrainingArguments)
            else {},
            "scale_history": self.scale_history,
        }

    def _restore_scale_history(self, checkpoint: Path) -> dict[str, Any] | None:
        """Start :attr:`scale_history` from the checkpoint's (the run so far); its saved state."""
        saved = _read_amp_state(checkpoint)
        step = _checkpoint_step(checkpoint)
        if saved is not None:
            history = saved.get("scale_history") or []
            self.scale_history = [e for e in history if step is None or e["step"] <= step]
        elif self.loss_scaler is not None:
            logger.warning(
                "%s has no %s: the loss-scale summary covers only the steps after it.",
                checkpoint,
                AMP_STATE_FILE,
            )
        return saved

    def _load_scaler(self, checkpoint: str | None) -> None:
        """Resume the loss scaler honestly: say when its state is dropped, missing or overrides.

        Stock Trainer crashes (``'NoneType' object has no attribute 'load_state_dict'``) when an
        fp16 checkpoint is resumed in bf16/fp32 (what LossScaleError advises), and starts a fresh
        scaler without a word when ``scaler.pt`` is missing.
        """
        if checkpoint is None:
            return
        path = Path(checkpoint)
        saved = self._restore_scale_history(path)
        has_state = (path / _SCALER_FILE).is_file()
        was = (saved or {}).get("precision")
        if self.loss_scaler is None:
            if has_state and self.accelerator.scaler is None:
                scale = _saved_scale(path / _SCALER_FILE)
                logger.warning(
                    "Resuming an fp16 checkpoint (%s) in %s: its loss-scaler state%s is dropped; "
                    "%s trains without loss scaling.",
                    path.name,
                    self.precision,
                    "" if scale is None else f" (scale {scale:g})",
                    self.precision,
                )
                return
            super()._load_scaler(checkpoint)
            return
        if not has_state:
            if was is not None and was != "fp16":
                logger.warning(
                    "Resuming a %s checkpoint (%s) in fp16: the loss scaler starts afresh at "
                    "scale %g.",
                    was,
                    path.name,
                    self.loss_scaler.get_scale(),
                )
            else:
                logger.warning(
                    "%s has no %s: the loss scaler starts afresh at scale %g instead of where the "
                    "run left it (expect extra skipped steps, and a shifted LR schedule).",
                    path,
                    _SCALER_FILE,
                    self.loss_scaler.get_scale(),
                )
            return
        given = self.loss_scaler.state_dict()
        super()._load_scaler(checkpoint)
        self._report_scaler_overrides(given, self.loss_scaler.state_dict(), saved, path.name)

    def _report_scaler_overrides(
        self,
        given: dict[str, Any],
        used: dict[str, Any],
        saved: dict[str, Any] | None,
        checkpoint: str,
    ) -> None:
        """Log the loss_scale_* arguments the checkpoint overrode; write the used ones back."""
        overrides: dict[str, dict[str, Any]] = {}
        for name, key in _SCALER_FIELDS.items():
            if key == "init_scale":
                started = ((saved or {}).get("loss_scaler") or {}).get("init_scale")
                if started is not None and started != getattr(self.args, name, started):
                    overrides[name] = {"given": getattr(self.args, name), "used": started}
            elif key in given and key in used and given[key] != used[key]:
                overrides[name] = {"given": given[key], "used": used[key]}
        self.resume_overrides = overrides
        if not overrides:
            return
        for name, values in overrides.items():
            if hasattr(self.args, name):
                setattr(self.args, name, values["used"])
        logger.warning(
            "Resumed the loss scaler from %s (scale %g): its state overrides %s. To change them, "
            "start a new run.",
            checkpoint,
            self.loss_scaler.get_scale(),
            ", ".join(
                f"{name}={v['given']!r} (given) with {v['used']!r}" for name, v in overrides.items()
            ),
        )


def _checkpoint_step(path: Path) -> int | None:
    """N of a ``checkpoint-N`` folder (``None`` for another name)."""
    prefix = f"{PREFIX_CHECKPOINT_DIR}-"
    name = path.name
    if name.startswith(prefix) and name[len(prefix) :].isdigit():
        return int(name[len(prefix) :])
    return None


def _read_amp_state(checkpoint: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((checkpoint / AMP_STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _saved_scale(path: Path) -> float | None:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        return float(state["scale"])
    except Exception:  # only for the message; the state is being dropped anyway
        return None


class AmpTrainer(AmpTrainerMixin, Trainer):
    """:class:`transformers.Trainer` with amp-trainer's loss scaler and precision policy.

    Everything lives in :class:`AmpTrainerMixin`; this is the mixin on stock ``Trainer``.
    """


class AmpSeq2SeqTrainer(AmpTrainerMixin, Seq2SeqTrainer):
    """:class:`transformers.Seq2SeqTrainer` with amp-trainer's loss scaler and precision policy.

    Pair it with :class:`AmpSeq2SeqTrainingArguments` for both argument sets (``precision``,
    ``loss_scale_*`` and ``predict_with_generate``, ``generation_max_length``, ...).
    """


@dataclass
class AmpSeq2SeqTrainingArguments(AmpTrainingArguments, Seq2SeqTrainingArguments):
    """:class:`AmpTrainingArguments` and :class:`~transformers.Seq2SeqTrainingArguments` in one."""
