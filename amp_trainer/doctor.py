"""The NaN doctor: mixed-precision training's standard four-step inf/NaN triage (FP32, FP16
without the scaler, full AMP, a lower learning rate), automated, with culprits named.

When FP16 training produces NaN, the practitioner's checklist is always the same, and each step
rules out one cause:

1. run the same batch in pure FP32: NaN there too means the data, the model or the learning rate,
   not mixed precision;
2. autocast FP16 with the scaler off: breaks only now means an FP16-unfriendly operation (a
   layer whose activations leave FP16's range, |x| > 65504);
3. full AMP with :class:`~amp_trainer.scaler.DynamicLossScaler` watching the model: which
   parameters' gradients are non-finite, by name, and how the loss scale behaves;
4. rerun at lr/10 (then /100, /1000): "fine for a few steps, then NaN" is usually the learning
   rate;
5. when every stage is finite, the scaler's other danger: how much of the gradient FP16 flushes
   to zero at the run's loss scale (:mod:`amp_trainer.underflow`), "the loss is a flat line",
   and how much it flushes at every usable scale (no loss scale fixes that: bf16 or FP32 does).

:func:`diagnose` runs all of them on *copies* of the model (the caller's model, optimizer and
RNG-free state are untouched) and one batch, with forward hooks (:class:`OverflowProbe`) that name
the first module whose output went non-finite or out of the FP16 range although its inputs were
fine: the module that *made* the overflow, not the dozens it propagated through. It returns a
:class:`Diagnosis` with a :class:`Verdict`, plain words and a suggested fix.

An FP16-unfriendly layer rarely comes alone: once the first overflowing module computes in FP32,
its large (finite) output reaches the next FP16 layer, which overflows in turn. So the doctor
keeps going as the training guard does (:mod:`amp_trainer.forward_overflow`): it makes each
module it names an FP32 island on a copy and re-runs the forward until it is finite, then
confirms the whole set by rerunning the AMP stage with those islands; the fix names every module
(:attr:`Diagnosis.fp32_modules`) and says whether that rerun confirmed it.

Example::

    from amp_trainer.doctor import diagnose
    diagnosis = diagnose(model, batch, lr=5e-5, steps=4)
    print(diagnosis)                  # verdict, culprit, suggested fix, one line per stage
    assert diagnosis.verdict is Verdict.HEALTHY
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from torch import nn

from amp_trainer.doctor_stages import (
    LossFn,
    OptimizerFactory,
    StageResult,
    default_loss,
    default_optimizer,
    exactly,
    islands_until_finite,
    run_stage,
    to_device,
)
from amp_trainer.islands import is_norm_module, keep_in_fp32
from amp_trainer.numerics import FP16_MAX, describe_module, nonfinite_inputs
from amp_trainer.underflow import UnderflowReading, measure_underflow

__all__ = [
    "Diagnosis",
    "StageResult",
    "Verdict",
    "diagnose",
]

logger = logging.getLogger(__name__)

# More than this share of the gradient flushed at the run's scale is a verdict, not noise.
_UNDERFLOW_VERDICT = 0.01
# lr / 10, / 100, / 1000: the standard triage says "try lr/10 first"; an absurd lr needs more
# than one rung.
_LR_DIVISORS = (10.0, 100.0, 1000.0)
# A loss that blows up in FP32 is the learning rate for sure: keep going down until it descends
# (lr 100 on a tiny BERT: lr 10, 1 and 0.1 stay finite but climb; 0.01 descends).
_DIVERGENCE_DIVISORS = (*_LR_DIVISORS, 1e4, 1e5)


class Verdict(str, Enum):
    """What the triage concluded. A ``str`` enum so it serialises as its value."""

    HEALTHY = "healthy"
    DATA = "data"
    MODEL = "model"
    LEARNING_RATE = "learning_rate"
    FP16_UNFRIENDLY_LAYER = "fp16_unfriendly_layer"
    GRADIENT_UNDERFLOW = "gradient_underflow"
    UNRESOLVED = "unresolved"


@dataclass(frozen=True)
class Diagnosis:
    """The triage's conclusion: :attr:`verdict`, why (:attr:`explanation`), what to do
    (:attr:`suggestion`), the module or input to blame (:attr:`culprit`), and the evidence."""

    verdict: Verdict
    explanation: str
    suggestion: str
    culprit: str | None
    stages: tuple[StageResult, ...]
    #: The underflow check at the run's loss scale (``None`` when the triage stopped earlier).
    underflow: UnderflowReading | None = None
    #: ``fp16_unfriendly_layer``: every module the fix keeps in FP32, in the order they
    #: overflowed (the culprit first; each next one overflowed once the ones before it were FP32
    #: islands). Empty for the other verdicts.
    fp32_modules: tuple[str, ...] = ()
    #: ``fp16_unfriendly_layer``: the AMP stage rerun with :attr:`fp32_modules` as FP32 islands
    #: (``keep_in_fp32``), the evidence that the fix works; ``None`` for the other verdicts.
    fix_check: StageResult | None = None

    @property
    def fix_confirmed(self) -> bool | None:
        """Whether the rerun with the suggested FP32 islands stayed finite (``None``: the
        verdict's fix is not one that a rerun can check)."""
        return None if self.fix_check is None else self.fix_check.ok

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["verdict"] = self.verdict.value
        data["fix_confirmed"] = self.fix_confirmed
        return data

    def __str__(self) -> str:
        lines = [f"verdict: {self.verdict.value}", f"why: {self.explanation}"]
        if self.culprit:
            lines.append(f"culprit: {self.culprit}")
        lines.append(f"fix: {self.suggestion}")
        lines += ["stages:"] + [f"  {stage.summary()}" for stage in self.stages]
        if self.fix_check is not None:
            lines.append(f"  {self.fix_check.summary()}")
        reading = self.underflow
        if reading is not None and reading.underflow is not None:
            headroom = "" if reading.headroom is None else f", headroom {reading.headroom:.1f}"
            lines.append(
                f"  5. underflow at loss scale {reading.scale:g}: {100 * reading.underflow:.2f}% "
                f"of the gradient flushed to zero{headroom}"
                + (
                    f"; {100 * reading.unreachable:.2f}% at every usable scale"
                    if reading.unreachable
                    else ""
                )
            )
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# the triage
# --------------------------------------------------------------------------------------------
def diagnose(
    model: nn.Module,
    batch: Mapping[str, Any],
    *,
    optimizer_factory: OptimizerFactory | None = None,
    lr: float = 5e-5,
    steps: int = 4,
    device: str | torch.device | None = None,
    loss_fn: LossFn | None = None,
    loss_scale: float = 2.0**16,
) -> Diagnosis:
    """Run the four-step triage on copies of ``model`` and ``batch`` and return a verdict.

    Args:
        model: the model to examine; never modified (every stage trains a deep copy, in FP32
            master weights, as AMP does).
        batch: keyword inputs for ``model(**batch)``, labels included so the output has a loss
            (or give ``loss_fn``).
        optimizer_factory: ``(params, lr) -> optimizer``; default ``torch.optim.AdamW``.
        lr: the learning rate the failing run used.
        steps: optimizer steps per stage (a few: "fine for N steps, then NaN" needs N+1).
        device: default CUDA when available, else CPU (CPU autocast FP16 is real in torch >= 2.4,
            though it keeps more ops in FP16 than CUDA's: ``layer_norm`` and ``softmax`` too).
        loss_fn: ``(output, batch) -> loss``; default ``output.loss``.
        loss_scale: the loss scale the run trains at (its logged ``loss_scale``; default
            torch's initial 65536): the AMP stage starts there and the underflow check
            measures there.

    The verdicts, in the order they are tested:
    ``DATA`` (the batch itself holds inf/NaN), ``MODEL`` (pure FP32 fails before any update:
    a module computes NaN, e.g. a LayerNorm with ``eps=0`` on constant input),
    ``LEARNING_RATE`` (fails only after some steps and a smaller lr is clean; or pure FP32 stays
    finite but its loss blows up, or starts far above a uniform guess's: divergence, whatever
    the FP16 stages show; a smaller lr is only suggested when its loss goes down),
    ``FP16_UNFRIENDLY_LAYER`` (FP32 is clean, FP16 overflows in the very first forward, or
    later at every lr tried), ``UNRESOLVED`` (FP32 fails after some updates at every lr tried),
    ``GRADIENT_UNDERFLOW`` (every stage is finite, but at ``loss_scale`` more than 1 % of the
    gradient is flushed to zero by FP16), ``HEALTHY``.
    """
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    if (
        not isinstance(lr, (int, float))
        or isinstance(lr, bool)
        or not (lr > 0 and math.isfinite(lr))
    ):
        raise ValueError(f"lr must be a positive finite number, got {lr!r}")
    if (
        isinstance(loss_scale, bool)
        or not isinstance(loss_scale, (int, float))
        or not (0 < loss_scale < math.inf)
    ):
        raise ValueError(f"loss_scale must be a positive finite number, got {loss_scale!r}")
    if not isinstance(batch, Mapping):
        raise TypeError(f"batch must be a mapping of keyword inputs, got {type(batch).__name__}")
    dev = (
        torch.device(device)
        if device is not None
        else (torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    )
    batch = to_device(batch, dev)
    common: dict[str, Any] = {
        "steps": steps,
        "device": dev,
        "optimizer_factory": optimizer_factory or default_optimizer,
        "loss_fn": loss_fn or default_loss,
        "loss_scale": float(loss_scale),
    }
    fp32 = run_stage("1. fp32", model, batch, precision="fp32", use_scaler=False, lr=lr, **common)
    stages = [fp32]

    def ladder(
        precision: str, use_scaler: bool, divisors: tuple[float, ...] = _LR_DIVISORS
    ) -> StageResult | None:
        """Step 4: rerun at lr/10, /100, /1000; the first whose loss goes down, else None."""
        for divisor in divisors:
            label = f"4. {'amp' if use_scaler else precision} lr/{divisor:g}"
            result = run_stage(
                label,
                model,
                batch,
                precision=precision,
                use_scaler=use_scaler,
                lr=lr / divisor,
                **common,
            )
            stages.append(result)
            if result.improving:  # finite is not enough: the loss must go down
                return result
        return None

    bad_inputs = nonfinite_inputs(batch)
    if bad_inputs:
        return Diagnosis(
            Verdict.DATA,
            f"the batch itself holds non-finite values: {', '.join(bad_inputs)}; every "
            "precision will produce NaN from it.",
            "Fix the data pipeline (look for division by zero, log(0), missing values read as "
            "NaN, overflowing feature scaling); filter or clamp bad rows before training.",
            bad_inputs[0].split(" ")[0].strip("'"),
            tuple(stages),
        )
    if not fp32.ok:
        if fp32.first_bad_step == 0:
            culprit = fp32.overflow_module
            where = describe_module(model, culprit) if culprit is not None else "the loss"
            return Diagnosis(
                Verdict.MODEL,
                f"pure FP32 already produces inf/NaN in the first step, before any update; "
                f"the first module to do so is {where}. This is a model (or loss) bug, not "
                "mixed precision.",
                "Fix that module's arithmetic: e.g. a normalisation layer needs eps > 0 (eps=0 "
                "divides 0 by 0 on constant input), a log/sqrt/division needs a guard; check its "
                "weights for inf/NaN.",
                culprit,
                tuple(stages),
            )
        found = ladder("fp32", False)
        if found is not None:
            return _lr_diagnosis(lr, found, "pure FP32", tuple(stages))
        return Diagnosis(
            Verdict.UNRESOLVED,
            f"pure FP32 becomes non-finite at step {fp32.first_bad_step} and stays so at "
            f"lr/{_LR_DIVISORS[-1]:g}: the updates themselves break the model.",
            "Check the loss for a numerically unsafe term, clip gradients, and check the model "
            f"code around {fp32.overflow_module or 'its output'}.",
            fp32.overflow_module,
            tuple(stages),
        )

    if fp32.already_diverged or fp32.diverged:
        return _divergence_diagnosis(model, batch, lr, fp32, stages, common, ladder)

    autocast_only = run_stage(
        "2. fp16 autocast, no scaler",
        model,
        batch,
        precision="fp16",
        use_scaler=False,
        lr=lr,
        **common,
    )
    amp = run_stage(
        "3. fp16 amp + DynamicLossScaler",
        model,
        batch,
        precision="fp16",
        use_scaler=True,
        lr=lr,
        **common,
    )
    stages += [autocast_only, amp]
    first_forward_overflow = next(
        (s for s in (autocast_only, amp) if s.overflow_module is not None and s.overflow_step == 0),
        None,
    )
    broke_at_once = any(s.first_bad_step == 0 for s in (autocast_only, amp))
    if first_forward_overflow is not None and (broke_at_once or not amp.ok):
        return _fp16_layer_diagnosis(
            model, batch, first_forward_overflow, amp, tuple(stages), common
        )
    if not amp.ok or not autocast_only.ok:
        found = ladder("fp16", True)
        if found is not None:
            return _lr_diagnosis(lr, found, "FP16 AMP", tuple(stages))
        culprit_stage = next((s for s in (autocast_only, amp) if s.overflow_module), amp)
        if culprit_stage.overflow_module is not None:
            return _fp16_layer_diagnosis(model, batch, culprit_stage, amp, tuple(stages), common)
        return Diagnosis(
            Verdict.UNRESOLVED,
            "FP32 is clean but FP16 becomes non-finite, at every lr tried, without a module "
            "whose forward output overflows: the overflow is in the backward pass.",
            "Run the AMP stage with more steps and look at the named non-finite gradients; "
            "try bf16, which has FP32's exponent range.",
            amp.nonfinite_grads[0] if amp.nonfinite_grads else None,
            tuple(stages),
        )
    stages.append(
        run_stage(
            f"4. amp lr/{_LR_DIVISORS[0]:g}",
            model,
            batch,
            precision="fp16",
            use_scaler=True,
            lr=lr / _LR_DIVISORS[0],
            **common,
        )
    )
    reading = _underflow_reading(model, batch, common)
    if any(
        share is not None and share > _UNDERFLOW_VERDICT
        for share in (reading.underflow, reading.unreachable)
    ):
        return _underflow_diagnosis(reading, tuple(stages))
    return Diagnosis(
        Verdict.HEALTHY,
        f"no inf/NaN in {steps} step(s) of pure FP32, FP16 autocast and full AMP; loss scale "
        f"{amp.final_scale:g} with {amp.skipped_steps} skipped step(s).",
        "Nothing to fix on this batch. If a long run still diverges, rerun the doctor on the batch "
        "where it happens, with more steps.",
        None,
        tuple(stages),
        reading,
    )


def _underflow_reading(
    model: nn.Module, batch: Mapping[str, Any], common: Mapping[str, Any]
) -> UnderflowReading:
    """Stage 5: the share of the first step's gradient FP16 flushes at the run's loss scale."""
    device = common["device"]
    work = copy.deepcopy(model).to(device).float().train()
    with torch.autocast(device.type, dtype=torch.float16):
        loss = common["loss_fn"](work(**batch), batch)
    return measure_underflow(loss, work, common["loss_scale"])


def _underflow_diagnosis(reading: UnderflowReading, stages: tuple[StageResult, ...]) -> Diagnosis:
    if reading.unreachable is not None and reading.unreachable > _UNDERFLOW_VERDICT:
        return _unreachable_diagnosis(reading, stages)
    worst = sorted(reading.by_param.items(), key=lambda item: -item[1])[:3]
    where = ", ".join(f"{name} {100 * share:.0f}%" for name, share in worst)
    fix_scale = reading.fixing_scale
    if reading.fixable and fix_scale is not None:
        fix = (
            f"Train at a loss scale of about {fix_scale:g}: start there "
            f"(loss_scale_init={fix_scale:g} / DynamicLossScaler(init_scale={fix_scale:g})), or "
            "let the scale grow out of it (loss_scale_grow_on_underflow=True / "
            "grow_on_underflow=True). Without loss scaling at all (autocast alone), enable it."
        )
    else:
        fix = (
            "No FP16 loss scale holds both ends of this gradient: the largest would overflow "
            f"before the smallest stop flushing (best: {fix_scale:g}). Train in bf16 (FP32's "
            "exponent range), or rescale the loss."
        )
    return Diagnosis(
        Verdict.GRADIENT_UNDERFLOW,
        f"every stage is finite, but at loss scale {reading.scale:g} FP16 flushes "
        f"{100 * reading.underflow:.1f}% of the gradient to zero ({reading.flushed} of "
        f"{reading.nonzero} elements that a higher scale keeps; most: {where}): those "
        "parameters barely learn, and the loss looks like a flat line.",
        fix,
        worst[0][0] if worst else None,
        stages,
        reading,
    )


def _unreachable_diagnosis(reading: UnderflowReading, stages: tuple[StageResult, ...]) -> Diagnosis:
    """Gradient FP16 flushes at every scale that does not overflow: a loss scale is no fix (the
    largest gradient caps it), so the verdict names FP32 for the modules owning those
    parameters, or bf16 for all."""
    names = reading.unreachable_params
    modules = sorted({name.rpartition(".")[0] or name for name in names})
    where = ", ".join(f"{n} {100 * reading.unreachable_by_param[n]:.0f}%" for n in names[:3])
    also = ""
    if reading.underflow is not None and reading.underflow > _UNDERFLOW_VERDICT:
        also = (
            f" Another {100 * reading.underflow:.1f}% is flushed at {reading.scale:g} that a "
            f"scale of {reading.fixing_scale:g} keeps."
        )
    return Diagnosis(
        Verdict.GRADIENT_UNDERFLOW,
        f"every stage is finite, but FP16 flushes {100 * reading.unreachable:.1f}% of the "
        f"gradient to zero at every loss scale that does not overflow "
        f"({reading.unreachable_elements} elements, zero even at {reading.reference_scale:g}, "
        f"the highest that does not; most: {where}): no loss scale fixes it, and those "
        "parameters never learn in FP16." + also,
        "Train in bf16 (FP32's exponent range), or keep the modules that own those parameters "
        f"in FP32 (fp32_modules={modules!r} / keep_in_fp32(model, {modules!r})), with any "
        "FP16 op between them and the loss.",
        names[0] if names else None,
        stages,
        reading,
    )


def _divergence_diagnosis(
    model: nn.Module,
    batch: Mapping[str, Any],
    lr: float,
    fp32: StageResult,
    stages: list[StageResult],
    common: dict[str, Any],
    ladder: Callable[..., StageResult | None],
) -> Diagnosis:
    """FP32 stays finite but the run is blowing up (or already blew up): the learning rate, not
    FP16. The FP16 stages still run, as evidence: their overflows follow from the divergence, so
    keeping the module they name in FP32 would only hide it (the training guard agrees: it
    raises ``DivergenceError`` and adds no island)."""
    for name, use_scaler in (
        ("2. fp16 autocast, no scaler", False),
        ("3. fp16 amp + DynamicLossScaler", True),
    ):
        stages.append(
            run_stage(name, model, batch, precision="fp16", use_scaler=use_scaler, lr=lr, **common)
        )
    overflow = next((s.overflow_module for s in stages[1:] if s.overflow_module), None)
    follows = (
        f" The FP16 overflow in {describe_module(model, overflow)} follows from it; it is not "
        "the cause, and an FP32 island for it would only hide the divergence."
        if overflow is not None
        else ""
    )
    if fp32.already_diverged:
        return Diagnosis(
            Verdict.LEARNING_RATE,
            f"the model has already diverged: its first FP32 loss, {fp32.losses[0]:.4g}, is far "
            f"above the {fp32.uniform_loss:.3g} (ln of the number of classes) that a uniform "
            "guess scores, which only confidently wrong logits from blown-up weights reach."
            + follows,
            "Go back to a checkpoint saved before the loss rose (or to the start) and train at a "
            "lower learning rate than the one that diverged, with warmup and gradient clipping "
            "(max_grad_norm=1.0). Keeping layers in FP32 will not repair these weights.",
            None,
            tuple(stages),
        )
    rose = f"from {fp32.losses[0]:.4g} to {max(fp32.losses[1:]):.4g}"
    found = ladder("fp16", True, _DIVERGENCE_DIVISORS)
    if found is None:
        return Diagnosis(
            Verdict.UNRESOLVED,
            f"pure FP32 stays finite but its loss rises {rose} at lr={lr:g}, and no lower lr "
            f"down to lr/{_DIVERGENCE_DIVISORS[-1]:g} makes it go down on this batch." + follows,
            "Check the loss and the labels (a loss that rises at every lr is rarely the "
            "optimizer), add warmup and gradient clipping, and rerun the doctor with more steps.",
            None,
            tuple(stages),
        )
    return Diagnosis(
        Verdict.LEARNING_RATE,
        f"the run diverges at lr={lr:g}: pure FP32 stays finite but its loss rises {rose}."
        + follows
        + f" At lr={found.lr:g} the loss goes down ({found.losses[0]:.4g} -> "
        f"{found.losses[-1]:.4g}) under FP16 AMP.",
        f"Lower the learning rate to about {found.lr:g} (or add warmup and gradient clipping: "
        "scaler.clip_grad_norm_(optimizer, 1.0)).",
        None,
        tuple(stages),
    )


def _lr_diagnosis(
    lr: float, found: StageResult, where: str, stages: tuple[StageResult, ...]
) -> Diagnosis:
    return Diagnosis(
        Verdict.LEARNING_RATE,
        f"{where} is fine for the first step(s) and then becomes non-finite at lr={lr:g}; at "
        f"lr={found.lr:g} it stays finite and the loss goes down ({found.losses[0]:.4g} -> "
        f"{found.losses[-1]:.4g}). The updates are too large, not the precision.",
        f"Lower the learning rate to about {found.lr:g} (or add warmup and gradient clipping: "
        "scaler.clip_grad_norm_(optimizer, 1.0)).",
        None,
        stages,
    )


def _fp16_layer_diagnosis(
    model: nn.Module,
    batch: Mapping[str, Any],
    culprit_stage: StageResult,
    amp: StageResult,
    stages: tuple[StageResult, ...],
    common: Mapping[str, Any],
) -> Diagnosis:
    culprit = culprit_stage.overflow_module
    assert culprit is not None
    names = islands_until_finite(model, batch, culprit, common["device"])
    fixed = copy.deepcopy(model)
    keep_in_fp32(fixed, exactly(names))
    check = run_stage(
        "fix check: fp16 amp + DynamicLossScaler, FP32 islands as suggested",
        fixed,
        batch,
        precision="fp16",
        use_scaler=True,
        lr=amp.lr,
        probe_limit=math.inf,
        **common,
    )
    listed = ", ".join(repr(name) for name in names)
    which = f"{listed} in FP32" if len(names) > 1 else f"{culprit!r} in FP32"
    module = dict(model.named_modules()).get(culprit)
    if module is not None and is_norm_module(module) and len(names) == 1:
        fix = (
            f"Keep {which}: amp_trainer.keep_norms_in_fp32(model) does it for every "
            "normalisation layer. Or train in bf16 (FP32's exponent range, no loss scaling)."
        )
    else:
        fix = (
            f"Keep {which}: amp_trainer.keep_in_fp32(model, [{listed}]), or "
            f"fp32_modules=[{listed}] in AmpTrainingArguments / AmpAccelerator (AmpTrainer's "
            "default on_forward_overflow='fp32' does it by itself at the first overflowing step). "
            "module.float() alone is not enough: autocast would cast it back to FP16. Or rescale "
            "its weights/inputs, or train in bf16 (FP32's exponent range, no loss scaling)."
        )
    fix += " " + _fix_check_words(names, check)
    grads = ""
    if amp.nonfinite_grads:
        grads = f" Non-finite gradients under AMP: {', '.join(amp.nonfinite_grads[:5])}."
    chain = ""
    if len(names) > 1:
        chain = (
            " With it in FP32, its output (finite, beyond FP16's range) overflows the next FP16 "
            f"layer: {len(names)} modules must compute in FP32 ({listed})."
        )
    return Diagnosis(
        Verdict.FP16_UNFRIENDLY_LAYER,
        f"pure FP32 is clean, but under FP16 autocast {describe_module(model, culprit)} produces "
        f"values beyond FP16's range (|x| > {FP16_MAX:g}) or NaN from finite inputs at step "
        f"{culprit_stage.overflow_step}.{grads}{chain}",
        fix,
        culprit,
        stages,
        fp32_modules=names,
        fix_check=check,
    )


def _fix_check_words(names: tuple[str, ...], check: StageResult) -> str:
    """What the AMP rerun with the suggested islands showed, in one sentence."""
    islands = f"these {len(names)} FP32 islands" if len(names) > 1 else "this FP32 island"
    if check.ok:
        losses = check.losses
        trend = f"losses {losses[0]:.4g} -> {losses[-1]:.4g}" if losses else "no losses"
        return (
            f"Confirmed: rerun with {islands}, full AMP ran {check.steps} step(s) finite "
            f"({trend}, {check.skipped_steps} skipped)."
        )
    where = f", first overflow in {check.overflow_module!r}" if check.overflow_module else ""
    return (
        f"Could not confirm: rerun with {islands}, full AMP is still non-finite at step "
        f"{check.first_bad_step}{where}; compute that part in FP32 too, or train in bf16."
    )
