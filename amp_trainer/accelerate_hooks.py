"""Our loss scaler inside Hugging Face Accelerate.

Accelerate already routes every step through ``accelerator.scaler``: ``backward()`` calls
``scaler.scale(loss).backward()``, the :class:`~accelerate.optimizer.AcceleratedOptimizer` calls
``scaler.step(optimizer, closure)`` then ``scaler.update()`` on sync steps and reports a skip when
the wrapped ``optimizer.step`` was never called, and
:class:`~accelerate.scheduler.AcceleratedScheduler` holds the learning rate on such skips.
:class:`~amp_trainer.scaler.DynamicLossScaler` speaks the same protocol, so the hook is small:
put our scaler in ``accelerator.scaler`` *before* ``prepare()`` wraps the optimizers (the wrapper
captures the scaler at wrap time) and fix the places where upstream Accelerate is silently wrong:

* ``mixed_precision="fp16"`` on a CPU is a no-op upstream (no autocast, no scaler). Here it runs:
  autocast to float16 plus loss scaling, with one warning that it is slow on CPUs.
* torch's ``GradScaler`` calls ``step()`` on fused optimizers even on overflow (it hands them its
  found-inf tensor), so ``optimizer_step_was_skipped`` is never true for ``AdamW(fused=True)`` and
  the scheduler advances on skipped steps. Our scaler skips ``step()`` itself for every optimizer.
* ``unscale_gradients()`` twice in one step (an explicit call, then ``clip_grad_norm_``) raises
  upstream; here it unscales each optimizer once per step and is a no-op after that.
* ``clip_grad_norm_`` on an overflow step returns ``inf`` and leaves the (discarded) gradients
  alone instead of multiplying infs by zero; "overflow" is that of the optimizers owning the
  parameters, so a GAN's clean generator is clipped while its discriminator overflows. With one
  optimizer it unscales and clips in one pass (:func:`clip_grad_norm_in_one_pass`).
* ``save_state``/``load_state`` move checkpoints both ways with stock Accelerate: no empty
  ``scaler.pt`` in bf16/fp32, and checkpoints without one (or with torch's) resume.
* ``prepare(model)`` calls ``scaler.watch(model)``, so overflows name parameters in plain loops.
* ``prepare`` on a model the user already sharded (``fully_shard``: DTensor parameters) leaves it
  to FSDP2 instead of wrapping it in DDP, which fails on DTensors; under Accelerate's own FSDP2
  (whose ``prepare`` never calls ``prepare_model``) the FP32 islands go on before sharding and the
  scaler watches the sharded parameters after.

DeepSpeed runs its own loss scaler inside its engine:
:func:`~amp_trainer.deepspeed.deepspeed_fp16_config` writes our knobs as DeepSpeed's ``"fp16"``
config section instead.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import weakref
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import SCALER_NAME, DistributedType
from accelerate.utils.other import model_has_dtensor

from amp_trainer.checkpointing.file_checks import check_resume_files, check_torch_file
from amp_trainer.ddp_teardown import release_ddp_reducers
from amp_trainer.forward_overflow import (
    ForwardOverflow,
    ForwardOverflowGuard,
    check_divergence_policy,
    check_policy,
)
from amp_trainer.islands import apply_fp32_policy
from amp_trainer.precision import resolve_precision
from amp_trainer.precision_guard import PrecisionGuard, check_guard_mode, guard_run
from amp_trainer.precision_guard.fsdp_policy import guard_kwargs_for_accelerate
from amp_trainer.scaler import DynamicLossScaler

__all__ = ["AmpAccelerator", "clip_grad_norm_in_one_pass", "install_scaler"]

logger = logging.getLogger(__name__)

# Accelerate spells FP32 "no"; fp8 is Accelerate's own (TransformerEngine/torchao/MS-AMP) path.
_ACCELERATE_TO_OURS = {"no": "fp32", "fp16": "fp16", "bf16": "bf16"}
_ENGINE_OWNS_SCALING = (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM)


def _precision_of(accelerator: Accelerator) -> str | None:
    """fp16/bf16/fp32 as resolved for the accelerator's device; ``None`` for fp8."""
    requested = _ACCELERATE_TO_OURS.get(accelerator.mixed_precision)
    if requested is None:
        return None
    return resolve_precision(requested, accelerator.device)


def _scaler_kwargs_from_handler(accelerator: Accelerator) -> dict[str, Any]:
    # GradScalerKwargs(init_scale=..., growth_factor=..., backoff_factor=..., growth_interval=...,
    # enabled=...) uses torch's names, which are ours too; to_kwargs() holds only non-defaults.
    handler = getattr(accelerator, "scaler_handler", None)
    return dict(handler.to_kwargs()) if handler is not None else {}


def install_scaler(
    accelerator: Accelerator, scaler: DynamicLossScaler | None = None, **scaler_kwargs: Any
) -> DynamicLossScaler:
    """Make ``scaler`` (or a new :class:`DynamicLossScaler`) the loss scaler of ``accelerator``.

    For an :class:`~accelerate.Accelerator` built elsewhere (a Trainer's, a library's). Call it
    before ``accelerator.prepare(optimizer)``: each ``AcceleratedOptimizer`` keeps the scaler it
    was created with, so installing one later would leave those optimizers stepping without it.

    Under fp16 the scaler is enabled and autocast is switched on, on CPUs too. Under bf16/fp32 a
    disabled scaler (exact pass-through) is installed, so ``accelerator.scaler.get_scale()``
    works in every precision. ``scaler_kwargs`` (``init_scale``, ``hysteresis``, ...) build the
    scaler; the accelerator's ``GradScalerKwargs`` handler, if any, supplies defaults for them.

    Raises:
        RuntimeError: optimizers were already prepared.
        ValueError: DeepSpeed/Megatron-LM own the scaling (use
            :func:`~amp_trainer.deepspeed.deepspeed_fp16_config`), or an enabled scaler was given
            for a bf16/fp32 run.
    """
    if scaler is not None and scaler_kwargs:
        raise TypeError(
            f"install_scaler() takes a scaler or scaler keyword arguments, not both; got a scaler "
            f"and {sorted(scaler_kwargs)}"
        )
    if accelerator.distributed_type in _ENGINE_OWNS_SCALING:
        raise ValueError(
            f"{accelerator.distributed_type.value} runs its own loss scaler inside its engine; "
            "configure it there: amp_trainer.deepspeed_fp16_config(...) returns our knobs as "
            "DeepSpeed's 'fp16' config section."
        )
    if accelerator._optimizers:
        raise RuntimeError(
            f"install_scaler() was called after accelerator.prepare() wrapped "
            f"{len(accelerator._optimizers)} optimizer(s); they captured the old scaler "
            f"({type(accelerator.scaler).__name__ if accelerator.scaler is not None else None}) "
            "and would step without ours. Install the scaler before prepare()."
        )
    if scaler is not None and not isinstance(scaler, DynamicLossScaler):
        raise TypeError(f"scaler must be a DynamicLossScaler, got {type(scaler).__name__}")

    precision = _precision_of(accelerator)
    if precision is None:
        raise ValueError(
            f"mixed_precision={accelerator.mixed_precision!r} is handled by Accelerate's own "
            "backend; install_scaler() supports 'fp16', 'bf16' and 'no'."
        )
    if precision == "fp16":
        if scaler is None:
            kwargs = {**_scaler_kwargs_from_handler(accelerator), **scaler_kwargs}
            scaler = DynamicLossScaler(accelerator.device.type, **kwargs)
        if not scaler.is_enabled():
            logger.warning(
                "fp16 autocast with a disabled loss scaler: gradients below ~6e-8 flush to zero "
                "in fp16 and the model may silently stop learning. Enable the scaler or use bf16."
            )
        # native_amp is what makes prepare_model() wrap the forward in autocast, makes
        # accelerator.autocast() autocast and makes unscale_gradients() unscale; upstream
        # leaves it False on CPU, which silently turns fp16 into fp32.
        accelerator.native_amp = True
        if accelerator._models and accelerator.device.type == "cpu":
            logger.warning(
                "install_scaler(): %d model(s) were prepared before it and run their forward "
                "without autocast on CPU; prepare models after install_scaler() or wrap the "
                "forward in accelerator.autocast().",
                len(accelerator._models),
            )
    else:
        if scaler is not None and scaler.is_enabled():
            raise ValueError(
                f"An enabled loss scaler was given but the run is {precision}, which needs no "
                "loss scaling (the scaler and fp16 autocast go on and off together). Drop it or "
                "pass DynamicLossScaler(enabled=False)."
            )
        scaler = scaler or DynamicLossScaler(accelerator.device.type, enabled=False)
    accelerator.scaler = scaler
    logger.debug("Installed %r on the accelerator (%s)", scaler, precision)
    return scaler


# Where Accelerate clips its own way (sharded or engine-owned gradients): left to it.
_CLIPS_ITS_OWN_WAY = (
    DistributedType.FSDP,
    DistributedType.DEEPSPEED,
    DistributedType.XLA,
    DistributedType.MEGATRON_LM,
)


def clip_grad_norm_in_one_pass(
    accelerator: Accelerator,
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
) -> torch.Tensor | None:
    """``accelerator.clip_grad_norm_`` with unscale and clip in one pass, where that is exact.

    Why: upstream unscales every gradient (read + write), takes the norm (read) and clips (read +
    write); :meth:`DynamicLossScaler.clip_grad_norm_in_one_pass` reads the still-scaled
    gradients once for the norm and multiplies once by ``min(1, max_norm / norm) / S``,
    bit-identical to that.
    Returns the unscaled total norm (``inf`` on an overflow step), or ``None`` (nothing done; clip
    the usual way) unless: the accelerator's scaler is an enabled :class:`DynamicLossScaler`, the
    run is not FSDP/DeepSpeed/XLA/Megatron, exactly one optimizer is prepared, it was not unscaled
    yet this step, and the parameters with gradients are exactly that optimizer's.
    """
    scaler = accelerator.scaler
    if not isinstance(scaler, DynamicLossScaler) or not scaler.is_enabled():
        return None
    if accelerator.distributed_type in _CLIPS_ITS_OWN_WAY or len(accelerator._optimizers) != 1:
        return None
    optimizer = accelerator._optimizers[0]
    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    if scaler.found_inf(optimizer) is not None:
        return None  # already unscaled this step
    with_grad = [p for p in parameters if p.grad is not None]
    owned = {
        id(p) for group in optimizer.param_groups for p in group["params"] if p.grad is not None
    }
    if len(with_grad) != len(owned) or any(id(p) not in owned for p in with_grad):
        return None
    return scaler.clip_grad_norm_in_one_pass(optimizer, with_grad, max_norm, norm_type)


class AmpAccelerator(Accelerator):
    """An :class:`~accelerate.Accelerator` whose fp16 is real everywhere and skips are exact.

    Everything is as in Accelerate (same arguments, same loop) except:

    * under fp16 the loss scaler is a :class:`~amp_trainer.scaler.DynamicLossScaler`
      (``accelerator.scaler`` and :attr:`loss_scaler` are that object), also on CPU, where
      upstream silently runs fp32; under bf16/fp32 it is a disabled, pass-through one;
    * ``prepare(model)`` keeps normalisation layers in FP32 under fp16/bf16
      (:func:`~amp_trainer.islands.keep_norms_in_fp32`) unless ``keep_norms_fp32=False``;
    * a skipped step is a skipped step for every optimizer kind, so the prepared scheduler holds
      its learning rate and :attr:`optimizer_step_was_skipped` tells the truth;
    * ``mixed_precision="auto"`` picks fp16 on CUDA, bf16 where the hardware has it, else fp32;
    * ``prepare(model)`` watches the model (overflow reports name its parameters);
    * ``save_state``/``load_state`` read and write stock Accelerate's checkpoints, in every
      precision, with or without ``scaler.pt`` (torch's or ours).

    Example::

        accelerator = AmpAccelerator(mixed_precision="fp16", loss_scaler={"hysteresis": 2})
        model, optimizer, loader, scheduler = accelerator.prepare(
            model, optimizer, loader, scheduler
        )
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)                  # scaled
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)  # unscaled once, clipped
                optimizer.step()                            # skipped on inf/NaN
                scheduler.step()                            # held on a skip
                optimizer.zero_grad()

    Args:
        loss_scaler: a :class:`DynamicLossScaler` to use, or a mapping of its keyword arguments
            (``{"init_scale": 2.0**12, "hysteresis": 2}``), or ``None`` for the defaults (and
            the values of a ``GradScalerKwargs`` handler, if one is passed).
        keep_norms_fp32: keep normalisation layers in FP32 in the models ``prepare()`` sees.
        fp32_modules: more modules ``prepare()`` keeps in FP32 (names, dotted suffixes, globs;
            see :func:`~amp_trainer.islands.keep_in_fp32`), on top of the model's own
            ``_keep_in_fp32_modules``.
        on_forward_overflow: ``"fp32"``, ``"raise"`` or ``"skip"``: what
            :meth:`check_forward_overflow` does about a module whose FP16 output overflows.
        on_divergence: ``"raise"`` (``DivergenceError``) or ``"warn"`` (warn once, go on): what
            it does when that overflow is really divergence (weights or loss far beyond their
            values at the start); no FP32 island is added for it either way.
        precision_guard: ``"raise"``, ``"repair"``, ``"warn"`` or ``"off"``: what a dtype drift
            of a prepared model's master weights, gradients, optimizer state or islands does
            (:mod:`~amp_trainer.precision_guard`), checked before each optimizer step.
        *args, **kwargs: as :class:`accelerate.Accelerator`; ``mixed_precision`` may also come
            from ``ACCELERATE_MIXED_PRECISION`` or an ``accelerate config`` file, as there.
    """

    def __init__(
        self,
        *args: Any,
        loss_scaler: DynamicLossScaler | Mapping[str, Any] | None = None,
        keep_norms_fp32: bool = True,
        fp32_modules: Iterable[str] | str = (),
        on_forward_overflow: str = "fp32",
        on_divergence: str = "raise",
        precision_guard: str = "raise",
        **kwargs: Any,
    ) -> None:
        self.precision_guard_mode = check_guard_mode(precision_guard)
        self.precision_guards: list[PrecisionGuard] = []  # one per prepared model
        self.fp32_modules = [fp32_modules] if isinstance(fp32_modules, str) else list(fp32_modules)
        self.on_forward_overflow = check_policy(on_forward_overflow)
        self.on_divergence = check_divergence_policy(on_divergence)
        self._forward_overflow: ForwardOverflowGuard | None = None
        # The DDP wrappers prepare_model() made, for end_training() (see ddp_teardown).
        self._ddp_wrappers: list[weakref.ref[torch.nn.Module]] = []
        if kwargs.get("mixed_precision") == "auto":
            device = "cpu" if kwargs.get("cpu") else None
            resolved = resolve_precision("auto", device)
            kwargs["mixed_precision"] = "no" if resolved == "fp32" else resolved
        super().__init__(*args, **kwargs)
        self.keep_norms_fp32 = bool(keep_norms_fp32)
        self._amp_precision: str | None = None

        if self.distributed_type in _ENGINE_OWNS_SCALING:
            logger.warning(
                "%s is in use: its engine runs its own loss scaler and our DynamicLossScaler is "
                "not installed. Put the equivalent settings in its config with "
                "amp_trainer.deepspeed_fp16_config(...).",
                self.distributed_type.value,
            )
            return
        self._amp_precision = _precision_of(self)
        if self._amp_precision is None:
            logger.info(
                "mixed_precision=%r runs on Accelerate's own backend; no loss scaler installed.",
                self.mixed_precision,
            )
            return
        # Upstream may already have built a torch GradScaler (fp16 on a GPU); ours replaces it
        # here, before prepare() can hand it to any AcceleratedOptimizer.
        self.scaler = None
        if isinstance(loss_scaler, Mapping):
            install_scaler(self, **dict(loss_scaler))
        else:
            if loss_scaler is not None and _scaler_kwargs_from_handler(self):
                raise ValueError(
                    "Pass either loss_scaler=DynamicLossScaler(...) or a GradScalerKwargs "
                    "handler, not both: it is ambiguous which settings should win."
                )
            install_scaler(self, loss_scaler)

    @property
    def loss_scaler(self) -> DynamicLossScaler | None:
        """The :class:`DynamicLossScaler` in use (``accelerator.scaler``); None under DeepSpeed."""
        return self.scaler if isinstance(self.scaler, DynamicLossScaler) else None

    @property
    def precision(self) -> str | None:
        """The precision that runs: ``"fp16"``, ``"bf16"`` or ``"fp32"`` (``None`` for engines)."""
        return self._amp_precision

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """Whether the last optimizer step was skipped for inf/NaN gradients.

        Accelerate's own answer (an ``AcceleratedOptimizer`` whose wrapped ``step`` was not
        called) is right here for fused, foreach and for-loop optimizers alike, because our
        scaler does not call ``step()`` at all on overflow.
        """
        return super().optimizer_step_was_skipped

    def prepare_model(
        self,
        model: torch.nn.Module,
        device_placement: bool | None = None,
        evaluation_mode: bool = False,
    ) -> torch.nn.Module:
        self._amp_prepare(model)
        self._watch(model)
        if not evaluation_mode and self._sharded_by_user(model):
            # The user ran fully_shard (or another DTensor engine) before prepare(): its hooks
            # already reduce the gradients, and DDP on top of DTensor parameters fails
            # (c10d.broadcast_ has no sharding strategy). Autocast and the scaler still apply;
            # only the data-parallel wrapper is left out.
            logger.info(
                "prepare(): %s is already sharded (DTensor parameters, e.g. fully_shard): not "
                "wrapping it in DistributedDataParallel; its engine reduces the gradients.",
                type(model).__name__,
            )
            evaluation_mode = True
            device_placement = False
        prepared = super().prepare_model(
            model, device_placement=device_placement, evaluation_mode=evaluation_mode
        )
        if isinstance(prepared, torch.nn.parallel.DistributedDataParallel):
            self._ddp_wrappers.append(weakref.ref(prepared))
        return prepared

    def end_training(self) -> None:
        """As upstream (trackers finished, process group destroyed), after freeing the gradient
        Reducer of every DDP wrapper :meth:`prepare_model` made: on gloo, a Reducer left to
        destroy the process group when the model is freed can deadlock the process after its
        work is done (see :mod:`amp_trainer.ddp_teardown`). The wrappers cannot train
        afterwards; the unwrapped models are untouched."""
        release_ddp_reducers(*(ref() for ref in self._ddp_wrappers))
        self._ddp_wrappers.clear()
        for guard in self.precision_guards:
            guard.close()
        super().end_training()

    def _amp_prepare(self, model: torch.nn.Module) -> None:
        """FP32 islands and the forward-overflow guard, before DDP or FSDP2 wraps the model.

        Islands never re-cast parameters a sharding engine swapped in (FSDP2's FP16 unsharded
        copies under its ``MixedPrecisionPolicy``): they upcast those on the fly (see
        :func:`~amp_trainer.islands.keep_in_fp32`). Not under FSDP1, whose flat parameters are
        views this has not been tested with (use its ``MixedPrecision`` policy).
        """
        fsdp1 = self.distributed_type == DistributedType.FSDP and not self.is_fsdp2
        if self._amp_precision in ("fp16", "bf16") and not fsdp1:
            apply_fp32_policy(
                model, self._amp_precision, norms=self.keep_norms_fp32, modules=self.fp32_modules
            )
        scaler = self.loss_scaler
        if (
            self._amp_precision is not None
            and not fsdp1
            and not any(g.model is model for g in self.precision_guards)
        ):
            # The scaler checks with the first model's guard before it unscales; every guard
            # checks before its own optimizers' steps.
            fsdp2 = self.distributed_type == DistributedType.FSDP and self.is_fsdp2
            asked = guard_kwargs_for_accelerate(self.state, self._amp_precision, fsdp2)
            guard = guard_run(
                model, self.precision_guard_mode, scaler, None, attach=not self.precision_guards,
                **asked,
            )  # fmt: skip
            if guard is not None:
                self.precision_guards.append(guard)
        if scaler is not None and scaler.is_enabled() and self.on_forward_overflow != "skip":
            # Made now, so that it knows the scale the first step runs with.
            self._forward_overflow = ForwardOverflowGuard(
                model, scaler, policy=self.on_forward_overflow, on_divergence=self.on_divergence
            )
            # The weights divergence is measured against: check_forward_overflow() is first
            # called after the first optimizer step, too late to see them untrained.
            self._forward_overflow.remember_start()

    def prepare(self, *args: Any, device_placement: list[bool | None] | None = None) -> Any:
        """As upstream. Under Accelerate's FSDP2 (whose ``prepare`` shards the model without
        calling :meth:`prepare_model`) the islands and the guard go on before sharding, and the
        scaler watches the sharded parameters afterwards (FSDP2 replaces the parameter objects;
        their names stay).

        ``distributed_type`` is read first, as upstream's ``prepare`` does: after
        ``AcceleratorState._reset_state()`` that raises Accelerate's own message (re-create the
        Accelerator), where ``is_fsdp2`` would say only that the attribute is missing."""
        if not (self.distributed_type == DistributedType.FSDP and self.is_fsdp2):
            return super().prepare(*args, device_placement=device_placement)
        for obj in args:
            if isinstance(obj, torch.nn.Module):
                self._amp_prepare(obj)
        result = super().prepare(*args, device_placement=device_placement)
        scaler = self.loss_scaler
        if scaler is not None and scaler.is_enabled():
            for obj in result if isinstance(result, (tuple, list)) else (result,):
                if isinstance(obj, torch.nn.Module):
                    scaler.watch(self.unwrap_model(obj).named_parameters())
        return result

    def prepare_optimizer(self, optimizer: Any, device_placement: bool | None = None) -> Any:
        """As upstream; the precision guard of the model it updates checks before each step."""
        prepared = super().prepare_optimizer(optimizer, device_placement=device_placement)
        for guard in self.precision_guards:
            guard.watch_optimizer(optimizer, only_own=True)
        return prepared

    def _sharded_by_user(self, model: torch.nn.Module) -> bool:
        """Whether ``model`` already holds DTensor parameters in a run Accelerate would wrap in
        DDP (its own FSDP, tensor-parallel, DeepSpeed and XLA paths handle DTensors themselves)."""
        if self.distributed_type in (
            DistributedType.NO,
            DistributedType.FSDP,
            DistributedType.XLA,
            *_ENGINE_OWNS_SCALING,
        ):
            return False
        config = getattr(self, "parallelism_config", None)
        if config is not None and getattr(config, "tp_enabled", False):
            return False
        return model_has_dtensor(model)

    def check_forward_overflow(
        self, loss: torch.Tensor, batch: Any, model: torch.nn.Module | None = None
    ) -> ForwardOverflow | None:
        """Call after ``optimizer.step()``: handle a forward overflow, as AmpTrainer does itself.

        ``loss`` and ``batch`` are the micro-batch's (call it after every ``backward``; on
        accumulation steps it only remembers them). Free on clean steps; on a skipped step whose
        loss was already non-finite it names the module, keeps it in FP32 (or raises, per
        ``on_forward_overflow``) and puts back the loss scale. See
        :class:`~amp_trainer.forward_overflow.ForwardOverflowGuard`; ``model`` defaults to the
        one prepared model.
        """
        scaler = self.loss_scaler
        if scaler is None or not scaler.is_enabled() or self.on_forward_overflow == "skip":
            return None
        if model is None:
            if len(self._models) != 1:
                raise ValueError(
                    f"check_forward_overflow() needs model=... when {len(self._models)} models "
                    "are prepared"
                )
            model = self._models[0]
        model = self.unwrap_model(model)
        guard = self._forward_overflow
        if guard is None or guard.model is not model:
            guard = self._forward_overflow = ForwardOverflowGuard(
                model, scaler, policy=self.on_forward_overflow, on_divergence=self.on_divergence
            )
        if guard.optimizer is None and len(self._optimizers) == 1:
            guard.optimizer = self._optimizers[0]  # names the learning rate if it diverges
        if not self.sync_gradients:
            guard.observe(loss, batch)
            return None
        return guard.after_step(loss, batch)

    def _watch(self, model: torch.nn.Module) -> None:
        """Name the model's parameters in overflow reports, as AmpTrainer does.

        Before DDP wraps it, so names carry no ``module.`` prefix. The second and later models get
        Accelerate's checkpoint names as prefix (``model_1.``), so a GAN's G and D stay apart.
        """
        scaler = self.loss_scaler
        if scaler is None or not scaler.is_enabled():
            return
        index = len(self._models)
        prefix = f"model_{index}." if index else ""
        scaler.watch((prefix + name, param) for name, param in model.named_parameters())

    def _raw_optimizers(self, optimizer: Any) -> list[torch.optim.Optimizer]:
        if optimizer is None:
            optimizers: Iterable[Any] = self._optimizers
        elif isinstance(optimizer, (list, tuple)):
            optimizers = optimizer
        else:
            optimizers = [optimizer]
        raw = []
        for opt in optimizers:
            while isinstance(opt, AcceleratedOptimizer):
                opt = opt.optimizer
            raw.append(opt)
        return raw

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Unscale each optimizer's gradients once per step (later calls in the step are no-ops).

        Patched: upstream calls ``scaler.unscale_`` unconditionally, so an explicit call followed
        by ``clip_grad_norm_`` (which unscales again) raises.
        """
        scaler = self.loss_scaler
        if scaler is None or not scaler.is_enabled():
            return super().unscale_gradients(optimizer)
        for opt in self._raw_optimizers(optimizer):
            if scaler.found_inf(opt) is None:
                scaler.unscale_(opt)

    def clip_grad_norm_(
        self, parameters: Iterable[torch.nn.Parameter], max_norm: float, norm_type: float = 2
    ) -> torch.Tensor:
        """Unscale (once), then clip; on an overflow step return ``inf`` and clip nothing.

        Patched: upstream clips the overflowing gradients too, which turns their infs into NaNs
        (``inf * 0``) for no benefit: the step is skipped either way.
        """
        scaler = self.loss_scaler
        if scaler is not None and scaler.is_enabled():
            parameters = list(parameters)
            norm = clip_grad_norm_in_one_pass(self, parameters, max_norm, norm_type)
            if norm is not None:
                return norm
            # Every optimizer is unscaled, as upstream: update() then decides the scale on all of
            # them, as torch's scaler does. Whether to clip follows only the optimizers that own
            # these parameters: a GAN's clean G is clipped (and stepped) while D overflows.
            self.unscale_gradients()
            if any(scaler.found_inf(opt) for opt in self._owners(parameters)):
                device = parameters[0].device if parameters else self.device
                return torch.full((), math.inf, device=device)
        return super().clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def _owners(self, parameters: list[torch.Tensor]) -> list[torch.optim.Optimizer]:
        """The prepared optimizers holding any of ``parameters`` (all of them if none does)."""
        wanted = {id(p) for p in parameters}
        optimizers = self._raw_optimizers(None)
        owners = [
            opt
            for opt in optimizers
            if any(id(p) in wanted for group in opt.param_groups for p in group["params"])
        ]
        return owners or optimizers

    # ----------------------------------------------------------------------------------------
    # checkpoints that stock Accelerate and torch's GradScaler read, and that we read from them
    # ----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _scaler_set_to(self, scaler: Any) -> Iterator[None]:
        # Accelerate's save/load read self.scaler; the prepared optimizers keep their own
        # reference, so swapping it for the duration of one call changes nothing else.
        saved = self.scaler
        self.scaler = scaler
        try:
            yield
        finally:
            self.scaler = saved

    def save_state(
        self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any
    ) -> str:
        """As upstream; a disabled (bf16/fp32) scaler writes no ``scaler.pt``, as stock does.

        Patched: upstream saves ``accelerator.scaler`` whenever it is not ``None``, which would
        write our pass-through scaler's ``{}``, a file torch's ``GradScaler`` refuses to load.
        """
        scaler = self.loss_scaler
        keep = self.scaler if scaler is None or scaler.is_enabled() else None
        with self._scaler_set_to(keep):
            return super().save_state(output_dir, safe_serialization=safe_serialization, **kwargs)

    def load_state(
        self, input_dir: str | None = None, load_kwargs: dict | None = None, **kwargs: Any
    ) -> None:
        """As upstream, and resumes any checkpoint stock Accelerate wrote.

        Patched: upstream loads ``scaler.pt`` whenever ``accelerator.scaler`` is set, so resuming
        a bf16/fp32 checkpoint (no ``scaler.pt``) dies with ``FileNotFoundError``. Here a bf16/fp32
        run ignores any ``scaler.pt``; an fp16 run loads ours or torch's, and without one starts a
        fresh scaler and says so once.
        """
        folder = self._checkpoint_folder(input_dir)
        if folder is not None:
            # A damaged file is named and an unsafe one refused before anything reads it (see
            # amp_trainer.checkpointing.file_checks): upstream's loaders say neither.
            check_resume_files(folder)
            if (folder / SCALER_NAME).is_file():
                check_torch_file(folder / SCALER_NAME)
        scaler = self.loss_scaler
        if scaler is None:
            return super().load_state(input_dir, load_kwargs, **kwargs)
        has_state = folder is not None and _holds_scaler_state(folder / SCALER_NAME)
        use = scaler
        if not scaler.is_enabled():
            use = None
            if has_state and self.is_main_process:  # one line per run, not one per rank
                logger.warning(
                    "%s holds loss-scaler state from an fp16 run; this run is %s and uses no "
                    "loss scaling, so it is dropped.",
                    folder / SCALER_NAME,
                    self._amp_precision,
                )
        elif folder is not None and not has_state:
            use = None
            if self.is_main_process:
                logger.warning(
                    "%s has no %s state (a bf16/fp32 checkpoint, or stock Accelerate without a "
                    "scaler): resuming fp16 with a fresh loss scaler at scale %g; expect a few "
                    "skipped steps while it settles.",
                    folder,
                    SCALER_NAME,
                    scaler.get_scale(),
                )
        with self._scaler_set_to(use):
            return super().load_state(input_dir, load_kwargs, **kwargs)

    def _checkpoint_folder(self, input_dir: str | None) -> Path | None:
        """The folder ``Accelerator.load_state`` will read (``None``: it will raise itself)."""
        if input_dir is not None:
            folder = Path(os.path.expanduser(input_dir))
            return folder if folder.is_dir() else None
        if not self.project_configuration.automatic_checkpoint_naming:
            return None
        # Accelerate 1.15's rule: under checkpoints/, the folder whose name holds the largest
        # (first) number.
        root = Path(self.project_dir) / "checkpoints"
        numbered = [
            (int(m.group(1)), child)
            for child in (root.iterdir() if root.is_dir() else ())
            if (m := re.search(r"([0-9]+)[^/]*$", child.name))
        ]
        return max(numbered)[1] if numbered else None


def _holds_scaler_state(path: Path) -> bool:
    """Whether ``path`` is a scaler.pt with something in it.

    Earlier AmpAccelerator versions wrote ``{}`` (a disabled scaler's state) in bf16/fp32 runs;
    such a file means "no scaler state", as a missing one does.
    """
    if not path.is_file():
        return False
    return bool(torch.load(path, weights_only=True))
