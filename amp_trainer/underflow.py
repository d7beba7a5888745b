"""The underflow meter: how much of a step's gradient FP16 flushes to zero at the current scale.

Overflow announces itself (inf/NaN, a skipped step); underflow does not: a gradient element below
FP16's smallest subnormal (2**-24, about 6e-8) after scaling becomes 0 and the step goes on, so
"the loss is a flat line" while nothing looks wrong. Counting zeros is no meter: a tiny BERT has
over half its gradient exactly zero at any scale (unused embedding rows), legitimately.

What is measured, on the step's own loss and graph (nothing is re-run forward):

1. ``autograd.grad(loss * S)``: the gradient the step's backward computes at the current scale S;
2. ``autograd.grad(loss * S_ref)`` with ``S_ref = S * 2**k`` as high as the headroom allows
   (halved if it overflows): the counterfactual, the same backward at a much higher scale;
3. an element is *flushed* when it is nonzero at ``S_ref`` and exactly zero at S.
   ``underflow`` = flushed / nonzero-at-``S_ref``. Legitimate zeros are zero at both scales and
   count in neither. Why a higher scale rather than an FP32 backward: it is what loss scaling can
   fix, on the very same FP16 graph (same autocast casts, same dropout mask), with no second
   forward; an element too small for FP16 at every usable scale is FP16's range, not the scale's
   (the doctor says bf16 then).

Both backward passes keep the graph (``retain_graph=True``) and write no ``.grad``: the real
backward that follows is untouched, bit for bit, and no RNG stream, buffer or optimizer state is
read or written. The cost is two backward passes on the steps that check (up to eight when the
reference overflows in an activation and is bisected), three more for the probe below, one
gradient-sized copy at a time and a bool mask of the gradient's size in memory.

``headroom``: doublings of S left before the largest scaled gradient that went through FP16
overflows 65504: ``log2(65504 / max|S * g|)`` over the parameters whose gradients hold only FP16
values (an autocast matmul's weight gradient); FP32-computed gradients (norms kept in FP32,
embeddings) cannot overflow FP16 and do not count. Activation gradients are not seen, so when
a reference try overflows, the bisection closes to one doubling and the headroom is capped at
the highest whole number of doublings that ran finite: a lower bound, exact in whole doublings.

The blind spot of (3), and the probe that covers it: an element FP16 flushes at every usable
scale is zero at S and at ``S_ref`` alike, so ``underflow`` counts it nowhere (two parallel
heads, one with its loss multiplied by 1e-9, read 0 % where an FP32 backward finds half the
gradient flushed). The probe runs the backward at the first overflowing scale and 16 and 32
doublings above it; an element zero at ``S_ref`` and finite and nonzero there is *unreachable*
(``unreachable``, named per parameter). No scale fixes it: ``fixable`` is ``False`` above
:data:`UNDERFLOW_TARGET`, and bf16, or FP32 for the modules owning it, is the fix.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from amp_trainer.grad_unscale import distributed
from amp_trainer.numerics import FP16_MAX
from amp_trainer.scale_policy import UNDERFLOW_TARGET

__all__ = ["UnderflowChecks", "UnderflowReading", "measure_underflow", "setup_pitfall"]

_SMALLEST_SUBNORMAL_EXP = -24  # 2**-24, FP16's smallest subnormal
_MAX_REFERENCE_DOUBLINGS = 40
# One try at what the headroom promises, then enough bisection steps to close [0, 41) to a single
# doubling: the reference is then the highest usable power of two, exactly.
_REFERENCE_TRIES = 1 + math.ceil(math.log2(_MAX_REFERENCE_DOUBLINGS + 1))
# The probe past the first overflowing scale: backward passes at S * 2**(hi + 16 j), j < 3. A
# stride under FP16's 40 doublings keeps an element that turns nonzero between two probes finite
# at the next; three reach gradients 2**-33 below FP16's smallest subnormal at the highest usable
# scale (a branch whose loss is 1e-9 of the rest).
_PROBE_STRIDE = 16
_PROBES = 3


@dataclass(frozen=True)
class UnderflowReading:
    """One measurement of the step's gradient against FP16's lower end.

    Attributes:
        scale: the loss scale measured at (the one the step runs with).
        underflow: share (0..1) of the gradient elements nonzero at ``reference_scale`` that are
            exactly zero at ``scale``; ``None`` when no higher scale could be compared (the
            gradient overflows at ``scale`` or just above it: then nothing is flushed that a
            scale could save).
        headroom: doublings of ``scale`` left before the largest FP16-valued gradient overflows
            (can be below 0 when one already did); ``None`` when no gradient went through FP16.
        reference_scale: the higher scale the step was compared with (``None`` if none).
        flushed: how many elements were flushed; ``nonzero``: how many were nonzero at
            ``reference_scale``.
        fixing_scale: the smallest power of two at which at most :data:`UNDERFLOW_TARGET` of
            those elements would be flushed, never above what the headroom allows; ``None`` if
            not measured.
        fixable: whether ``fixing_scale`` reaches that target within the headroom and no more
            than that target (:data:`UNDERFLOW_TARGET`, 0.1 %) of the gradient is
            ``unreachable`` (``False``: FP16's range cannot hold both the smallest and the
            largest gradients; bf16 can).
        fp16_gradients: whether any gradient holds FP16 values: ``False`` means no FP16 ran in
            the backward, so loss scaling is pure cost.
        by_param: parameter name -> its share flushed (parameters with a nonzero reference).
        unreachable: share (0..1) of the gradient that FP16 flushes at every usable scale:
            elements zero at ``reference_scale`` (the highest power of two that does not
            overflow) and nonzero at a higher, overflowing one, over those plus the ``nonzero``
            ones. ``underflow`` cannot see them (they are zero at both of its scales) and no
            loss scale can fix them. ``None`` when not probed (no reference, or no higher scale
            was seen to overflow).
        unreachable_elements: how many elements that share counts.
        unreachable_by_param: parameter name -> its share unreachable (parameters with any).
    """

    scale: float
    underflow: float | None
    headroom: float | None
    reference_scale: float | None = None
    flushed: int = 0
    nonzero: int = 0
    fixing_scale: float | None = None
    fixable: bool = True
    fp16_gradients: bool = True
    by_param: Mapping[str, float] = field(default_factory=dict)
    unreachable: float | None = None
    unreachable_elements: int = 0
    unreachable_by_param: Mapping[str, float] = field(default_factory=dict)

    @property
    def unreachable_params(self) -> tuple[str, ...]:
        """The parameters with gradient FP16 cannot reach at any usable scale, most first: the
        modules owning them are the ones to train in FP32 (or the whole model in bf16)."""
        ranked = sorted(self.unreachable_by_param.items(), key=lambda item: -item[1])
        return tuple(name for name, _ in ranked)


def _named(params: nn.Module | Iterable[Any]) -> list[tuple[str, torch.Tensor]]:
    if isinstance(params, nn.Module):
        named = list(params.named_parameters())
    else:
        named = []
        for index, item in enumerate(params):
            if isinstance(item, tuple):
                named.append((str(item[0]), item[1]))
            else:
                named.append((f"params[{index}]", item))
    return [(name, p) for name, p in named if isinstance(p, torch.Tensor) and p.requires_grad]


def _grads(loss: torch.Tensor, params: Sequence[torch.Tensor], scale: float) -> list[Any]:
    """The gradient of ``loss * scale`` (as the scaler multiplies: by a float32 tensor)."""
    factor = torch.full((), scale, dtype=torch.float32, device=loss.device)
    return list(torch.autograd.grad(loss * factor, params, retain_graph=True, allow_unused=True))


def _finite(grads: Sequence[Any]) -> bool:
    checks = [torch.isfinite(g).all() for g in grads if g is not None and g.numel()]
    return bool(torch.stack(checks).all()) if checks else True


def _fp16_values(grad: torch.Tensor) -> int:
    """How many nonzero values ``grad`` holds if every one of them is an FP16 value (the mark of
    a gradient that went through an FP16 op, such as autocast's weight cast), else -1. A
    gradient computed in FP32 essentially never is, once it holds a few nonzero values."""
    nonzero = grad[grad != 0]
    if not bool((nonzero == nonzero.half().float()).all()):
        return -1
    return nonzero.numel()


# A gradient counts as proof that FP16 ran once this many of its values are all FP16 values.
_FP16_EVIDENCE = 16


@dataclass
class _Tally:
    """One rank's counts behind an :class:`UnderflowReading`, in the form ranks can reduce:
    sums (the counts and the magnitude histogram), extremes (headrooms, flags)."""

    scale: float
    finite: bool  # the step's own gradient is finite at ``scale``
    fp16_at_scale: bool  # FP16 evidence in the gradient at ``scale``
    scale_headroom: float  # log2(65504 / max|S*g|) over FP16-valued gradients; inf: none
    cap: float = math.inf  # a reference trial overflowed: the headroom is at most this
    has_reference: bool = False
    reference_scale: float = math.inf
    fp16_seen: bool = False  # FP16 evidence at ``scale`` or at ``reference_scale``
    reference_headroom: float = math.inf  # the same headroom read at the reference; inf: none
    flushed: list[int] = field(default_factory=list)  # per parameter (``None`` gradients: 0)
    nonzero: list[int] = field(default_factory=list)
    probed: bool = False  # the unreachable probe ran (a scale above the reference overflowed)
    unreachable: list[int] = field(default_factory=list)  # per parameter
    exponents: torch.Tensor = field(default_factory=lambda: torch.zeros(400, dtype=torch.float64))


def _local_tally(
    loss: torch.Tensor, named: Sequence[tuple[str, torch.Tensor]], scale: float
) -> _Tally:
    """This rank's measurement (the module docstring says what is compared)."""
    tensors = [p for _, p in named]
    at_scale = _grads(loss, tensors, scale)
    with torch.no_grad():
        zero_at_scale: list[torch.Tensor | None] = []
        largest = 0.0
        fp16_seen = False
        for grad in at_scale:
            if grad is None:
                zero_at_scale.append(None)
                continue
            values = _fp16_values(grad)
            if values > 0:
                largest = max(largest, float(grad.abs().max()))
                fp16_seen = fp16_seen or values >= _FP16_EVIDENCE
            zero_at_scale.append(grad == 0)
        finite = _finite(at_scale)
    del at_scale
    measurable = finite and fp16_seen and largest > 0  # an inf gradient leaves no headroom
    tally = _Tally(
        scale=scale,
        finite=finite,
        fp16_at_scale=fp16_seen,
        scale_headroom=math.log2(FP16_MAX / largest) if measurable else math.inf,
        fp16_seen=fp16_seen,
        flushed=[0] * len(named),
        nonzero=[0] * len(named),
        unreachable=[0] * len(named),
    )
    if not finite:  # the step overflows at this scale: no doubling is left, nothing to compare
        return tally
    headroom = tally.scale_headroom if tally.scale_headroom < math.inf else None

    # The reference scale: as high as the gradients allow, found by bisection on the number of
    # doublings (each try is one backward). lo is known finite (the step's own scale), hi not.
    lo, hi = 0, _MAX_REFERENCE_DOUBLINGS + 1
    if headroom is not None:
        hi = max(1, min(hi, math.floor(headroom) + 1))
    hi = min(hi, math.floor(math.log2(3.0e38 / scale)) + 1)
    reference, doublings, overflowed = None, 0, False
    for attempt in range(_REFERENCE_TRIES):
        if hi - lo <= 1:
            break
        # First the highest the headroom promises (it usually holds), then bisect.
        trial = hi - 1 if attempt == 0 else (lo + hi) // 2
        candidate = _grads(loss, tensors, scale * 2.0**trial)
        if _finite(candidate):
            reference, doublings, lo = candidate, trial, trial
        else:
            # The reference overflowed where the parameter gradients did not: an activation
            # gradient is larger, and the true headroom is below this.
            hi, overflowed = trial, True
        del candidate
    if overflowed:
        # The headroom is capped at the highest number of doublings seen finite: a lower bound,
        # exact in whole doublings once the bisection closed (hi == lo + 1). Not ``hi - 1``
        # before it closed: that doubling may overflow too.
        tally.cap = float(lo)
    if reference is None:
        return tally

    tally.has_reference = True
    tally.reference_scale = reference_scale = scale * 2.0**doublings
    largest_ref = 0.0
    zero_at_reference: list[torch.Tensor | None] = []
    with torch.no_grad():
        for index, (ref, zero) in enumerate(zip(reference, zero_at_scale)):
            zero_at_reference.append(None if ref is None else ref == 0)
            if ref is None:
                continue
            nonzero = ref != 0
            count = int(nonzero.sum())
            if not count:
                continue
            values = _fp16_values(ref)
            if values > 0:
                # At S most of it may be flushed, too little to show FP16; at S_ref it shows.
                largest_ref = max(largest_ref, float(ref.abs().max()))
                tally.fp16_seen = tally.fp16_seen or values >= _FP16_EVIDENCE
            tally.flushed[index] = int((nonzero & zero).sum()) if zero is not None else count
            tally.nonzero[index] = count
            # log2 magnitudes of the nonzero reference elements (unscaled), for the fixing scale.
            true = ref[nonzero].double().abs() / reference_scale
            _, exp = torch.frexp(true)
            tally.exponents += torch.bincount(
                (exp.flatten() + 200).clamp(0, 399).cpu(), minlength=400
            )
    if largest_ref > 0:
        tally.reference_headroom = math.log2(FP16_MAX * 2.0**doublings / largest_ref)
    del reference
    if hi == doublings + 1:  # the reference is the highest usable power of two, or the meter
        # cannot tell what lies between it and the first overflow: then no probe
        _probe_unreachable(loss, tensors, zero_at_reference, scale, hi, overflowed, tally)
    return tally


def _probe_unreachable(
    loss: torch.Tensor,
    tensors: Sequence[torch.Tensor],
    zero_at_reference: list[torch.Tensor | None],
    scale: float,
    first_overflow: int,
    overflowed: bool,
    tally: _Tally,
) -> None:
    """Count, into ``tally.unreachable``, the elements zero at the highest usable scale
    (``scale * 2**(first_overflow - 1)``) that turn finite and nonzero at a higher, overflowing
    one: gradient FP16 flushes at every scale the step can run with.

    Why this works with no FP32 forward: scaling by a power of two changes which FP16 values
    flush or overflow and nothing else, so an element that a larger scale makes nonzero is a
    true gradient that FP16's range loses; the overflow elsewhere (the large gradients, which
    cap the scale) does not reach a branch that does not share it. What it cannot see: an
    element whose own path overflows before it stops flushing, and gradients more than
    ``2**-(16 * _PROBES + 1)`` below FP16's smallest subnormal at the highest usable scale.

    ``overflowed``: a backward at ``first_overflow`` doublings was seen non-finite; if not (the
    ceiling came from the parameter gradients' headroom), the first probe must show it, or
    nothing is counted (the usable scales may go higher than the meter knows).
    Costs up to :data:`_PROBES` backward passes and one bool mask per parameter.
    """
    limit = math.floor(math.log2(3.0e38 / scale)) - 1  # keep the loss finite in FP32
    for probe in range(_PROBES):
        doublings = first_overflow + probe * _PROBE_STRIDE
        if doublings > limit:
            break
        grads = _grads(loss, tensors, scale * 2.0**doublings)
        if probe == 0 and not overflowed and _finite(grads):
            return  # the scale above the reference is usable after all: no probe
        tally.probed = True
        with torch.no_grad():
            for index, (grad, pending) in enumerate(zip(grads, zero_at_reference)):
                if grad is None or pending is None:
                    continue
                reached = pending & (grad != 0) & torch.isfinite(grad)
                tally.unreachable[index] += int(reached.sum())
                pending &= ~reached  # counted once, at the first probe that reaches it
        del grads


def _reduce_tally(tally: _Tally, process_group: Any, device: torch.device) -> _Tally:
    """Every rank's tally combined, identically on each: counts and histograms summed, flags
    OR-ed, headrooms and the reference scale the lowest of any rank (the gradient nearest to
    overflow decides for all), so every rank reads the same figures and the two-sided rule takes
    the same decision on each (as the found-inf flag is reduced for the skip). Two all-reduces
    of ``3 * parameters + 400`` and 9 numbers, on the checked steps only, on ``device`` (the
    loss's; the CPU under gloo)."""
    import torch.distributed as dist

    if dist.get_backend(process_group) == "gloo":
        device = torch.device("cpu")
    sums = torch.cat(
        [
            torch.tensor(tally.flushed + tally.nonzero + tally.unreachable, dtype=torch.float64),
            tally.exponents.double().cpu(),
        ]
    ).to(device)
    # MAX of each; the minima go in negated.
    extremes = torch.tensor(
        [
            float(not tally.finite),
            float(tally.fp16_at_scale),
            float(tally.fp16_seen),
            float(not tally.has_reference),
            -tally.scale_headroom,
            -tally.cap,
            -tally.reference_scale,
            -tally.reference_headroom,
            float(tally.probed),
        ],
        dtype=torch.float64,
    ).to(device)
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=process_group)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=process_group)
    sums, extremes = sums.cpu(), extremes.cpu().tolist()
    count = len(tally.flushed)
    return _Tally(
        scale=tally.scale,
        finite=not extremes[0],
        fp16_at_scale=bool(extremes[1]),
        scale_headroom=-extremes[4],
        cap=-extremes[5],
        has_reference=not extremes[3],
        reference_scale=-extremes[6],
        fp16_seen=bool(extremes[2]),
        reference_headroom=-extremes[7],
        flushed=[int(v) for v in sums[:count].tolist()],
        nonzero=[int(v) for v in sums[count : 2 * count].tolist()],
        probed=bool(extremes[8]),
        unreachable=[int(v) for v in sums[2 * count : 3 * count].tolist()],
        exponents=sums[3 * count :].clone(),
    )


def _reading(tally: _Tally, names: Sequence[str]) -> UnderflowReading:
    """The figures of a (reduced or local) tally."""
    scale = tally.scale
    if not tally.finite:
        return UnderflowReading(scale, None, 0.0, fp16_gradients=tally.fp16_at_scale)
    headroom = tally.scale_headroom if tally.scale_headroom < math.inf else None
    if tally.cap < math.inf:
        headroom = tally.cap if headroom is None else min(headroom, tally.cap)
    if not tally.has_reference:
        return UnderflowReading(scale, None, headroom, fp16_gradients=tally.fp16_at_scale)
    flushed_total, nonzero_total = sum(tally.flushed), sum(tally.nonzero)
    by_param = {
        name: flushed / count
        for name, flushed, count in zip(names, tally.flushed, tally.nonzero)
        if count
    }
    underflow = flushed_total / nonzero_total if nonzero_total else 0.0
    if headroom is None and tally.fp16_seen and tally.reference_headroom < math.inf:
        headroom = tally.reference_headroom
    fixing, fixable = _fixing_scale(tally.exponents, scale, headroom)
    unreachable_total = sum(tally.unreachable)
    unreachable = None
    if tally.probed:
        reached = nonzero_total + unreachable_total
        unreachable = unreachable_total / reached if reached else 0.0
        # No scale fixes these: the rule (``underflow``, ``fixing_scale``) does not chase them,
        # but the reading says no FP16 loss scale holds this gradient.
        fixable = fixable and unreachable <= UNDERFLOW_TARGET
    unreachable_by_param = {
        name: lost / (lost + count)
        for name, lost, count in zip(names, tally.unreachable, tally.nonzero)
        if lost
    }
    return UnderflowReading(
        scale=scale,
        underflow=underflow,
        headroom=headroom,
        reference_scale=tally.reference_scale,
        flushed=flushed_total,
        nonzero=nonzero_total,
        fixing_scale=fixing,
        fixable=fixable,
        fp16_gradients=tally.fp16_seen,
        by_param=by_param,
        unreachable=unreachable,
        unreachable_elements=unreachable_total,
        unreachable_by_param=unreachable_by_param,
    )


def measure_underflow(
    loss: torch.Tensor,
    params: nn.Module | Iterable[Any],
    scale: float,
    *,
    across_ranks: bool = False,
    process_group: Any = None,
) -> UnderflowReading:
    """Measure how much of ``loss``'s gradient FP16 flushes to zero at ``scale``.

    ``loss`` is the step's loss *before* its backward (its graph is kept; call this, then run
    the backward as usual); ``params`` a model or its parameters (``(name, parameter)`` pairs
    name them). About five backward passes (up to 11), no forward; no ``.grad``, RNG or buffer
    is touched. See the module docstring for what is compared.

    ``across_ranks=True`` (what the scaler passes) combines the readings of every rank of
    ``process_group`` (default: the world) when ``torch.distributed`` runs with more than one:
    the figures are then the whole step's, the same on every rank. It is a collective: every
    rank must call it on the same step, with the same parameters (DDP replicas).
    """
    if not isinstance(loss, torch.Tensor) or loss.grad_fn is None:
        raise ValueError(
            "measure_underflow needs the step's loss with its autograd graph (before backward); "
            f"got {type(loss).__name__}"
            + (" without a grad_fn" if isinstance(loss, torch.Tensor) else "")
        )
    named = _named(params)
    if not named:
        raise ValueError("measure_underflow: no parameter requires grad")
    tally = _local_tally(loss, named, scale)
    if across_ranks and distributed(process_group):
        tally = _reduce_tally(tally, process_group, loss.device)
    return _reading(tally, [name for name, _ in named])


def _fixing_scale(
    exponents: torch.Tensor, scale: float, headroom: float | None
) -> tuple[float | None, bool]:
    """The smallest power of two S' at which at most :data:`UNDERFLOW_TARGET` of the elements
    would be flushed, capped at ``scale * 2**floor(headroom)``; and whether the cap let it."""
    total = float(exponents.sum())
    if total == 0:
        return None, True
    cumulative = torch.cumsum(exponents, 0) / total
    # The element magnitudes below bin e (frexp exponent e: |x| in [2**(e-1), 2**e)) that may be
    # flushed are at most the target share; an element of bin e survives S' = 2**(-23 - e).
    allowed = int(torch.nonzero(cumulative > UNDERFLOW_TARGET)[0]) - 200
    wanted = 2.0 ** (_SMALLEST_SUBNORMAL_EXP + 1 - allowed)
    wanted = max(wanted, 2.0 ** math.floor(math.log2(scale))) if scale > 0 else wanted
    if headroom is None:
        return wanted, True
    cap = 2.0 ** math.floor(math.log2(scale) + math.floor(headroom))
    return (wanted, True) if wanted <= cap else (cap, False)


def setup_pitfall(reading: UnderflowReading, scaling: bool) -> tuple[str, str] | None:
    """The two classic FP16 set-up mistakes, as ``(key, message)``, when ``reading`` shows one,
    or ``"zero-gradient"`` when the gradient has no nonzero element to tell them by.

    ``"no-fp16"``: loss scaling on a computation with no FP16 in it (no autocast, FP32 weights):
    pure cost. ``"no-scaling"``: FP16 compute with no loss scaling (``scaling`` false) while part
    of the gradient is flushed: "fake training". An overflowing step (``underflow is None``)
    shows neither.
    """
    if reading.underflow is None:
        return None
    if reading.nonzero == 0:  # no element to judge by: neither mistake can be told
        return "zero-gradient", (
            "This step's gradient is zero in every element, at the loss scale and far above it: "
            "nothing to measure (in RL, every completion may have scored alike)."
        )
    if scaling and not reading.fp16_gradients:
        return "no-fp16", (
            "Loss scaling is on but no gradient went through FP16 (no autocast?): with FP32 "
            "weights and FP32 compute the scaler only costs time. Run the forward under "
            "torch.autocast(dtype=torch.float16), or turn the scaler off."
        )
    if not scaling and reading.fp16_gradients and reading.underflow > 0:
        return "no-scaling", (
            f"FP16 compute with no loss scaling: {100 * reading.underflow:.1f}% of the gradient "
            "is flushed to zero (the loss may go down while those parameters never move: 'fake "
            "training'). Enable the loss scaler (DynamicLossScaler(enabled=True))."
        )
    return None


class UnderflowChecks:
    """A loss scaler's side of the meter: the last reading, a check requested for the next
    loss, and the setup pitfalls already said (each once per scaler, on ``logger``).

    Why a request: a caller that does not hold the loss (a Trainer callback) asks for a check,
    and the scaler's ``scale()`` runs it on the step's exact loss (Accelerate's ``backward``
    hands it there, gradient-accumulation division included).
    """

    def __init__(self, logger: logging.Logger) -> None:
        self.last: UnderflowReading | None = None
        self.requested: Any = None  # parameters to measure at the next loss
        self._logger = logger
        self._pitfalls_said: set[str] = set()

    def grow_if_flushed(self, reading: UnderflowReading, policy: Any) -> bool:
        """Apply the two-sided rule (``policy.on_underflow``) to ``reading``; a growth is one INFO
        line with the reading behind it, as an overflow's skip is (a scale that jumps by 2**20
        in silence reads as a bug). Returns whether the scale grew."""
        before = policy.scale
        if not policy.on_underflow(reading.underflow, reading.fixing_scale, reading.headroom):
            return False
        headroom = "unknown" if reading.headroom is None else f"{reading.headroom:.1f}"
        self._logger.info(
            "Loss scale %g -> %g (grow_on_underflow): %.2f%% of the gradient was flushed to zero "
            "at %g (%d of %d elements; headroom %s doublings); checking again next step.",
            before,
            policy.scale,
            100 * (reading.underflow or 0.0),
            before,
            reading.flushed,
            reading.nonzero,
            headroom,
        )
        return True

    def take_request(self) -> Any:
        """The parameters a check was requested for (``None`` if none), clearing the request."""
        requested, self.requested = self.requested, None
        return requested

    def measure(
        self,
        loss: torch.Tensor,
        params: nn.Module | Iterable[Any],
        scale: float,
        scaling: bool,
        process_group: Any = None,
    ) -> UnderflowReading:
        """:func:`measure_underflow` at ``scale`` across the ranks of ``process_group``, kept as
        :attr:`last`; a setup pitfall it shows (:func:`setup_pitfall`; ``scaling``: whether loss
        scaling is on) is warned about once."""
        reading = measure_underflow(
            loss, params, scale, across_ranks=True, process_group=process_group
        )
        self.last = reading
        found = setup_pitfall(reading, scaling)
        if found is not None and found[0] not in self._pitfalls_said:
            self._pitfalls_said.add(found[0])
            # A zero gradient is no mistake of the set-up; the two others are.
            level = logging.INFO if found[0] == "zero-gradient" else logging.WARNING
            self._logger.log(level, "%s", found[1])
        return reading
