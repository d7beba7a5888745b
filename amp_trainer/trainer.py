"""AmpTrainer: a :class:`transformers.Trainer` that gets FP16 right.

Stock ``Trainer(fp16=True)`` (transformers 5.24, accelerate 1.15) has four defects this subclass
fixes, each reproduced against the stock class in ``tests/trainer/test_trainer_regressions.py``:

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
``trainer.scale_history`` keeps the run's loss-scale events (see
:mod:`amp_trainer.loss_scale_monitor`), and the full scaler state travels with every
checkpoint (Trainer saves ``accelerator.scaler.state_dict()`` as ``scaler.pt``; that object is
our scaler).

A forward overflow (the unscaled loss already inf/NaN) is told from a gradient overflow on
skipped steps and handled by :mod:`amp_trainer.forward_overflow` (``on_forward_overflow``): by
default the module that overflowed becomes an FP32 island, named in one warning, recorded in
``model.config`` (so checkpoints carry it) and restored on resume. A streak of skipped updates is
replayed and its verdict acted on by :mod:`amp_trainer.skip_streak_replay` (``skip_streak_replay``).

A skipped update is not a step: ``global_step``, ``max_steps`` and the epochs count applied
updates, ``state.optimizer_step_attempts`` every attempt, and a resume continues from the batch
position the attempts reached (transformers' main-branch semantics, given to the released
transformers by :mod:`amp_trainer.step_accounting` through ``set_initial_training_values``,
``get_batch_samples``, ``floating_point_ops``, the private ``_load_callback_state`` and the
callback handler; a transformers that has them runs its own).

Only public Trainer surface is overridden (checked against transformers 5.24):
``create_accelerator_and_postprocess`` (install the scaler before ``prepare``), ``create_optimizer``
(precision policy on the model actually trained), ``log`` (scaler fields), ``training_step``
(remembers each micro-batch's loss for the forward-overflow check, no sync), the
``model_accepts_loss_kwargs`` attribute and, for the step accounting,
``set_initial_training_values``, ``get_batch_samples``, ``floating_point_ops`` and the callback
handler's class; the skip rule itself is stock Trainer's
(``lr_scheduler.step()`` unless ``accelerator.optimizer_step_was_skipped``), made truthful.
Checkpointing and resume need three private hooks, the only places stock Trainer saves a
checkpoint and loads ``scaler.pt`` and the weights: ``_save_checkpoint`` (amp_trainer_state.json,
a full disk as one error without a half-written folder, rotation that spares another run's
checkpoints), ``_load_scaler`` (another precision, a missing ``scaler.pt``, overridden flags:
said, not silent) and ``_load_from_checkpoint`` (the FP32 islands back from the checkpoint's
config.json);
``train`` itself only gains the finished-run check and, in RL, the rollout-precision check
(:mod:`amp_trainer.precision_guard.rollout`) in front of stock ``train`` (and the training loss
over every attempt after it). The step accounting needs one more, ``_load_callback_state``
(the resume position; see :mod:`amp_trainer.step_accounting`). Two more private
hooks save work, not correctness: ``_clip_grad_norm`` and ``_get_grad_norm``, where stock Trainer
unscales and clips, do both in one pass (bit-identical; see
:func:`~amp_trainer.accelerate_hooks.clip_grad_norm_in_one_pass`); a transformers without them
runs the stock path. The checkpoint and
resume behaviour lives in :mod:`amp_trainer.checkpointing` (those hooks delegate to it in a few
lines), the arguments in :mod:`amp_trainer.training_args`.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import math
import os
from typing import Any

import torch
from torch import nn
from transformers import Seq2SeqTrainer, Trainer, TrainingArguments
from transformers.trainer_utils import TrainOutput
from transformers.utils import is_sagemaker_mp_enabled

from amp_trainer.accelerate_hooks import clip_grad_norm_in_one_pass, install_scaler
from amp_trainer.checkpointing import CheckpointKeeper
from amp_trainer.checkpointing.file_checks import check_best_model_checkpoint
from amp_trainer.forward_overflow import ForwardOverflowGuard
from amp_trainer.islands import apply_fp32_policy, recorded_fp32_islands, restore_fp32_islands
from amp_trainer.length_grouped_sampling import epoch_seeded
from amp_trainer.loss_scale_monitor import LossScaleMonitor
from amp_trainer.mismatch import PrecisionMismatchCallback
from amp_trainer.overflow_step_loss import OverflowStepLoss
from amp_trainer.precision import cast_trainable_params_to_fp32, resolve_precision
from amp_trainer.precision_guard import PrecisionGuard
from amp_trainer.precision_guard.guard import guard_for_trainer
from amp_trainer.precision_guard.rollout import check_trainer_rollout
from amp_trainer.scaler import DynamicLossScaler
from amp_trainer.skip_streak_replay import SkipStreakReplay
from amp_trainer.skip_streak_replay.for_trainer import replay_for_trainer
from amp_trainer.step_accounting import PADDING, StepAccounting, install_step_aware_handler
from amp_trainer.training_args import AmpSeq2SeqTrainingArguments, AmpTrainingArguments

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


# The min_scale a torch.amp.GradScaler swapped in gets (it has none): the smallest normal
# float32, 2**-126, far below what 100 halvings (max_consecutive_skipped_steps) reach from 2**16.
_NO_MINIMUM = 2.0**-126


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
        scale_history: ``{"step", "scale", "skipped"}`` dicts (``scale``: the loss scale the
            step ran with; a step skipped for a forward overflow also has ``"fp32_islands"``,
            the modules made FP32 islands for it, possibly none) for the run's events: every
            skipped step, the first step at each new scale, every logging step
            (``logging_steps``) and the latest step, so its size does not grow with the run's
            length (with ``logging_steps=1`` that is every step). The
            scale of a step not listed is that of the entry before it. A resumed run starts
            from the checkpoint's history, so it covers the whole run, not just this process.
        resume_overrides: ``{field: {"given": ..., "used": ...}}`` for each loss-scaler argument
            that the checkpoint's scaler state overrode on resume (also logged, and written back
            into ``args`` so that what is recorded is what ran).
        jit_checkpoint: the ``checkpoint-N`` folder the last ``train()`` saved on SIGTERM
            (``enable_jit_checkpoint``) before it stopped early and returned, else ``None``. It
            is saved between two optimizer steps with that step's scaler state and scale
            history, so resuming from it continues the run as if it had not stopped.
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
        self.jit_checkpoint: str | None = None
        self._checkpoints = CheckpointKeeper(self)
        self._last_step_skipped = False
        self._underflow_logged: Any = None
        self._forward_overflow: ForwardOverflowGuard | None = None
        self.precision_guard: PrecisionGuard | None = None  # see amp_trainer.precision_guard
        self.replay_verdicts: list[dict[str, Any]] = []  # see amp_trainer.skip_streak_replay
        self._skip_replay: SkipStreakReplay | None = None
        self._overflow_step_loss = OverflowStepLoss()
        self._steps = StepAccounting(self)
        super().__init__(*args, **kwargs)
        self._place_loss_scale_monitor()
        self._tensorboard_under_output_dir()
        for callback in list(self.callback_handler.callbacks):
            if isinstance(callback, PrecisionMismatchCallback):
                callback.attach(self)  # it logs through this trainer (see its docstring)
        self._checkpoints.take_over_jit_checkpoint()
        install_step_aware_handler(self.callback_handler, self._steps)

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
                "loss_scale_* arguments with amp_trainer.deepspeed_fp16_config()."
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
        if hasattr(self, "callback_handler"):  # again for a hyperparameter-search trial
            self._place_loss_scale_monitor()
        self.rollout_precision = check_trainer_rollout(self, before_engine=True)  # vLLM's

    def _tensorboard_under_output_dir(self) -> None:
        """Give TensorBoard's callback its folder now, under ``output_dir``.

        Stock ``TensorBoardCallback`` picks ``output_dir/runs/<date>_<host>`` only in
        ``on_train_begin``; anything logged before it (an ``evaluate()`` of the untrained model,
        as the GPT-2 recipe does) opens a writer with no folder, i.e. ``./runs/...`` of the
        current directory, and training then writes there too: ``tensorboard --logdir
        output_dir`` showed no loss scale. ``TENSORBOARD_LOGGING_DIR`` still wins, as in stock.
        """
        from transformers.integrations import TensorBoardCallback
        from transformers.integrations.integration_utils import default_logdir

        for callback in self.callback_handler.callbacks:
            if isinstance(callback, TensorBoardCallback) and callback.logging_dir is None:
                callback.logging_dir = os.path.join(self.args.output_dir, default_logdir())

    def _place_loss_scale_monitor(self) -> None:
        """Put :class:`LossScaleMonitor` in the callback list only where it has work to do.

        Without a loss scaler (bf16, fp32, DeepSpeed's own) the list is stock Trainer's, so code
        that looks callbacks up by position (``callbacks[0]`` is ``DefaultFlowCallback``) sees
        what it would see with ``Trainer``. With one, the monitor goes right after stock's
        default callbacks (flow control, reporting integrations, JIT checkpointing) and before
        the user's, so user callbacks see an up-to-date ``scale_history``.
        """
        callbacks = self.callback_handler.callbacks
        present = [cb for cb in callbacks if isinstance(cb, LossScaleMonitor)]
        if self.loss_scaler is None:
            for callback in present:
                callbacks.remove(callback)
            return
        if present:
            return
        from transformers.integrations import get_reporting_integration_callbacks
        from transformers.trainer import DEFAULT_CALLBACKS

        defaults = len(DEFAULT_CALLBACKS) + len(
            get_reporting_integration_callbacks(self.args.report_to)
        )
        defaults += int(bool(getattr(self.args, "enable_jit_checkpoint", False)))
        callbacks.insert(min(defaults, len(callbacks)), LossScaleMonitor(self))

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
                    model,
                    self.loss_scaler,
                    policy=policy,
                    on_divergence=getattr(self.args, "on_divergence", "raise"),
                    forward=self._loss_of_batch,
                )
            replay = self._skip_replay
            if replay is None or replay.model is not model or replay.scaler is not self.loss_scaler:
                self._skip_replay = replay_for_trainer(self, model)

    def _loss_of_batch(self, model: nn.Module, inputs: Any) -> Any:
        """The forward-overflow guard's re-run of a batch: the loss this Trainer trains on.

        Why not ``model(**inputs)``: a loss computed outside the model (a custom
        ``compute_loss``, ``label_smoothing_factor``, ``compute_loss_func``) could be NaN while
        the model's own output is finite, and the re-run then saw nothing wrong: the step was
        skipped without a word, every step after it too. ``_prepare_inputs`` copies the batch,
        since ``compute_loss`` pops ``labels`` from what it is given.
        """
        return self.compute_loss(model, self._prepare_inputs(inputs))

    def training_step(self, model: nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        if not self._steps.micro_batch(inputs):  # a stream's last window padded: no batch here
            return torch.zeros((), device=self.args.device)
        loss = super().training_step(model, inputs, *args, **kwargs)
        guard = self._forward_overflow
        if guard is not None:
            guard.observe(loss, inputs)  # no sync; read only on skipped steps
            if guard.optimizer is not self.optimizer:
                guard.optimizer = self.optimizer  # names the learning rate if it diverges
        if self._skip_replay is not None:
            self._skip_replay.observe(inputs, loss)  # a reference; replayed after a skip streak
        return loss

    def _load_best_model(self) -> None:
        # load_best_model_at_end reads the folder trainer_state.json names (under FSDP through
        # DCP's plain pickle.load): checked as a resumed folder is, refused outside output_dir.
        check_best_model_checkpoint(
            self.state.best_model_checkpoint,
            self.args.output_dir,
            "trainer_state.json",
            digests=getattr(self.args, "checkpoint_digests", True),
        )
        super()._load_best_model()

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
        # before transformers 5.3, create_optimizer(self) takes no model
        optimizer = super().create_optimizer(*(() if model is None else (model,)))
        self.precision_guard = guard_for_trainer(self, self.model if model is None else model)
        self.precision_guard = self.precision_guard and self.precision_guard.watch_optimizer(
            optimizer
        )
        return optimizer

    def _clip_grad_norm(self, model: nn.Module) -> Any:
        """Unscale and clip in one pass where that is exact (bit-identical), else stock.

        See :func:`~amp_trainer.accelerate_hooks.clip_grad_norm_in_one_pass`: two passes over
        the gradients instead of three reads and two writes.
        """
        if self.loss_scaler is not None and not is_sagemaker_mp_enabled():
            norm = clip_grad_norm_in_one_pass(
                self.accelerator, model.parameters(), self.args.max_grad_norm
            )
            if norm is not None:
                return norm
        return super()._clip_grad_norm(model)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        """With ``max_grad_norm=0`` stock Trainer still unscales and takes the norm (clipping at
        ``inf``) every step: that too in one pass."""
        if grad_norm is None and self.loss_scaler is not None and not is_sagemaker_mp_enabled():
            grad_norm = clip_grad_norm_in_one_pass(self.accelerator, model.parameters(), math.inf)
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    # -- what a step is: amp_trainer.step_accounting (skipped updates are not steps) ---------
    def _get_train_sampler(self, *args: Any, **kwargs: Any) -> Any:
        """Stock's sampler, except that a length-grouped one draws each epoch's order from
        ``seed + epoch`` instead of the global RNG, so that a resumed run reads the interrupted
        epoch's batches again (:mod:`amp_trainer.length_grouped_sampling`)."""
        return epoch_seeded(super()._get_train_sampler(*args, **kwargs), self)

    def set_initial_training_values(self, args: TrainingArguments, dataloader: Any, *rest: Any):
        """Stock's plan, with the epochs a run with skipped updates needs (see StepAccounting)."""
        values = super().set_initial_training_values(args, dataloader, *rest)
        return self._steps.planned(values, args, dataloader)

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> Any:
        """Stock's batches for one optimizer step attempt, counted as the data position."""
        return self._steps.fetch(epoch_iterator, num_batches, device, super().get_batch_samples)

    def floating_point_ops(self, inputs: Any) -> int:
        return 0 if inputs is PADDING else super().floating_point_ops(inputs)

    def _load_callback_state(self) -> None:
        # Stock calls this right after loading trainer_state.json on resume and right before it
        # derives the data position from global_step: the saved position goes in there.
        super()._load_callback_state()
        self._steps.present_resume_position(self.state)

    # -- observability -----------------------------------------------------------------------
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add the loss scale and skip counts to training logs; never log an inf grad_norm.

        ``step_skipped`` is the number of updates skipped since the previous training log (a
        skipped update is not a step, so no log is ever "at" one); ``optimizer_step_attempts``
        counts every attempt, applied or skipped.
        """
        if self.loss_scaler is not None and "loss" in logs:
            grad_norm = logs.get("grad_norm")
            if grad_norm is not None and not math.isfinite(grad_norm):
                del logs["grad_norm"]  # an overflow step: its norm is meaningless, not "inf"
            logs["loss_scale"] = self.loss_scaler.get_scale()
            logs["skipped_steps"] = self.loss_scaler.stats.skipped
            logs["step_skipped"] = self._steps.skipped_since_last_log(self.state)
            if self.loss_scaler.policy.grow_on_underflow:
                logs["underflow_growths"] = self.loss_scaler.stats.underflow_growths
            reading = self.loss_scaler.last_underflow
            if reading is not None and reading is not self._underflow_logged:
                self._underflow_logged = reading  # each measurement logged once, when it is new
                if reading.underflow is not None:
                    logs["grad_underflow"] = reading.underflow
                if reading.headroom is not None:
                    logs["grad_headroom"] = reading.headroom
                if reading.unreachable is not None:  # flushed at every usable scale
                    logs["grad_unreachable"] = reading.unreachable
            if self._forward_overflow is not None:
                logs["fp32_islands_added"] = len(self._forward_overflow.islands)
            self._overflow_step_loss.add_to(logs)
        self._steps.adjust_logs(logs, self.state)
        super().log(logs, start_time)

    def _maybe_log_save_evaluate(self, tr_loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Stock logging, with a forward-overflow step's loss its FP32 re-run's, not stock's 0.0
        (``tr_loss`` is stock's on-device loss sum; see :mod:`amp_trainer.overflow_step_loss`)."""
        self._overflow_step_loss.correct(tr_loss)
        if self.loss_scaler is not None and self._steps.last_log_due(self.state, self.control):
            self.control.should_log = True  # the run's last figures in its last log
            # Stock logs only past the last logged step; attempts skipped since are logged too.
            self._globalstep_last_logged = min(
                self._globalstep_last_logged, self.state.global_step - 1
            )
        super()._maybe_log_save_evaluate(tr_loss, *args, **kwargs)
        if self._forward_overflow is not None:
            self._overflow_step_loss.remember(tr_loss)

    # -- checkpoints and resume: the behaviour is amp_trainer.checkpointing's ----------------
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
        self.jit_checkpoint = None
        self._follow_a_swapped_scaler()
        self.rollout_precision = check_trainer_rollout(self)  # before step 1, engine now built
        checkpoint = self._checkpoints.start(resume_from_checkpoint)
        done = self._checkpoints.finished_run(checkpoint, load=self._load_from_checkpoint)
        if done is not None:
            return done
        self._forget_evaluation_prepare()
        self._checkpoints.report_missing_state(checkpoint)
        self._steps.begin(checkpoint)
        try:
            output = super().train(
                resume_from_checkpoint=checkpoint,
                trial=trial,
                ignore_keys_for_eval=ignore_keys_for_eval,
                **kwargs,
            )
        finally:  # the guard's hooks and its Module._apply wrapper end with the run
            if self.precision_guard is not None:
                self.precision_guard.close()
        if self._steps.active and "train_loss" in output.metrics:
            output = output._replace(training_loss=output.metrics["train_loss"])  # per attempt
        return output

    def _follow_a_swapped_scaler(self) -> None:
        """Run the scaler ``trainer.accelerator.scaler`` holds now, if code replaced ours there
        after ``__init__`` (transformers' own tests do; so do scripts that wanted torch's knobs).

        ``train()`` prepares the optimizer with whatever ``accelerator.scaler`` is, so that one
        steps; ``loss_scaler`` and everything reading it (the logged ``loss_scale`` and
        ``skipped_steps``, the consecutive-skip guard, the forward-overflow guard) must read it
        too. A :class:`DynamicLossScaler` is taken as it is; a ``torch.amp.GradScaler`` becomes
        one with its settings and state and no minimum scale (torch's rule, step for step), so
        that a skip is still a skip for every optimizer. ``None`` or another object: one error.
        """
        ours, now = self.loss_scaler, self.accelerator.scaler
        if ours is None or now is ours:
            return
        if isinstance(now, torch.amp.GradScaler):
            adopted = DynamicLossScaler(
                self.args.device.type,
                init_scale=now.get_scale() if now.is_enabled() else 2.0**16,
                growth_factor=now.get_growth_factor(),
                backoff_factor=now.get_backoff_factor(),
                growth_interval=now.get_growth_interval(),
                # torch's has no minimum: none a run reaches before the skip guard stops it
                min_scale=_NO_MINIMUM,
                on_min_scale="clamp",
                enabled=now.is_enabled(),
            )
            adopted.load_state_dict(now.state_dict())
            what = (
                "a torch.amp.GradScaler (run as a DynamicLossScaler with its settings, scale "
                f"{adopted.get_scale():g})"
            )
        elif isinstance(now, DynamicLossScaler):
            adopted, what = now, f"a DynamicLossScaler (scale {now.get_scale():g})"
        else:
            raise ValueError(
                f"trainer.accelerator.scaler was replaced by "
                f"{type(now).__name__ if now is not None else None} after the trainer was "
                "built; AmpTrainer needs a DynamicLossScaler or a "
                "torch.amp.GradScaler there. Pass the scaler instead: AmpTrainer(..., "
                "loss_scaler=DynamicLossScaler(init_scale=..., enabled=...))"
            )
        logger.info(
            "trainer.accelerator.scaler was replaced after __init__: training with %s.", what
        )
        self.loss_scaler = install_scaler(self.accelerator, adopted)
        self._forward_overflow = None  # made again on the scaler that steps
        self._apply_precision_policy(self.model)

    def _forget_evaluation_prepare(self) -> None:
        """Let ``train()`` wrap a model that ``evaluate()`` prepared first (DDP, several ranks).

        Stock Trainer's evaluation prepares the bare model with ``evaluation_mode=True`` (no DDP:
        evaluation needs no gradient reduction), and Accelerate marks it prepared; the
        ``prepare`` inside ``train()`` then returns it unwrapped, so every rank trains its own
        replica on its own data while the loss-scale histories still agree (the found-inf flag
        is all-reduced) and hide it. Here that evaluation-only preparation is undone before
        training: the model leaves the accelerator's list, loses the mark and gets its forward
        back (Accelerate's autocast wrapper would otherwise be applied twice).
        Under DeepSpeed/FSDP evaluation already runs the full prepare: nothing to undo.
        """
        from accelerate.utils import DistributedType  # accelerate is imported by Trainer

        model, accelerator = self.model, self.accelerator
        if (
            model is None
            or accelerator.distributed_type == DistributedType.NO
            or self.is_deepspeed_enabled
            or self.is_fsdp_enabled
            or self.model_wrapped is not model
            or not getattr(model, "_is_accelerate_prepared", False)
            or not any(m is model for m in accelerator._models)
        ):
            return
        accelerator._models[:] = [m for m in accelerator._models if m is not model]
        del model._is_accelerate_prepared
        original = model.__dict__.pop("_original_forward", None)
        if original is not None:
            if getattr(original, "__self__", None) is model and getattr(
                original, "__func__", None
            ) is getattr(type(model), "forward", None):
                model.__dict__.pop("forward", None)  # the class's own forward again
            else:
                model.forward = original
        logger.debug(
            "Undid the evaluation-only prepare of %s before training", type(model).__name__
        )

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        """Stock checkpointing plus :data:`~amp_trainer.checkpointing.AMP_STATE_FILE`.

        A full disk is one clear error without a half-written folder, and ``save_total_limit``
        rotation spares another run's checkpoints (see :meth:`CheckpointKeeper.save`).
        """
        stock = functools.partial(super()._save_checkpoint, model, trial)
        self._checkpoints.save(self._get_output_dir(trial=trial), stock)

    def _load_scaler(self, checkpoint: str | None) -> None:
        """Resume the loss scaler honestly: say when its state is dropped, missing or overrides.

        Stock Trainer crashes when an fp16 checkpoint is resumed in bf16/fp32 and starts a fresh
        scaler without a word when ``scaler.pt`` is missing (see
        :meth:`CheckpointKeeper.load_scaler`).
        """
        self._checkpoints.load_scaler(checkpoint, super()._load_scaler)


class AmpTrainer(AmpTrainerMixin, Trainer):
    """:class:`transformers.Trainer` with amp-trainer's loss scaler and precision policy.

    Everything lives in :class:`AmpTrainerMixin`; this is the mixin on stock ``Trainer``.
    """


class AmpSeq2SeqTrainer(AmpTrainerMixin, Seq2SeqTrainer):
    """:class:`transformers.Seq2SeqTrainer` with amp-trainer's loss scaler and precision policy.

    Pair it with :class:`AmpSeq2SeqTrainingArguments` for both argument sets (``precision``,
    ``loss_scale_*`` and ``predict_with_generate``, ``generation_max_length``, ...).
    """
