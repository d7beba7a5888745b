"""The precision guard: no silent dtype drift of what a mixed-precision run rests on.

A mixed-precision run is only as good as a few invariants set up at its start: the weights the
optimizer updates (master weights) and its state stay FP32; gradients reach the optimizer in FP32;
FP32 islands stay islands; FP16 forwards go with a loss scaler and a loss scaler with FP16
forwards; an FSDP2 ``MixedPrecisionPolicy`` is what was asked. Each can be broken later, by code
that never says so: a generation helper that casts the policy with ``model.to(torch.float16)``
and never back (TRL's continuous batching), a callback's ``model.half()`` for a quick
evaluation, an FP16 ``torch.autocast`` with no scaler (gradients flush to zero, no error). The
run then trains at a lower precision than it was set up for, or dies much later with a message
about something else.

:class:`PrecisionGuard` watches those invariants. It checks them before every optimizer step
(a step pre-hook on the optimizer, and the loss scaler's own call before it unscales, where FP16
gradients would otherwise be refused with a message that names no cause), and before a training
forward after a cast it saw. A *drift* is a change from the state at the start: a model loaded in
bf16 on purpose for pure-BF16 training is not one; the same model turning bf16 mid-run is. Moving
to a higher precision (FP16 to FP32) loses nothing and becomes the new expectation.

What it does with a drift is the ``mode``:

* ``"raise"`` (default): :class:`PrecisionDriftError` before the step that would lose precision,
  naming the tensors, the dtype seen and expected, and the call site that changed them where a
  ``Module.to()``/``.half()``/``.bfloat16()`` did it (the guard sees ``nn.Module._apply``);
* ``"repair"``: put the expected dtypes back and go on, one warning per cause;
* ``"warn"``: one warning per cause, nothing changed;
* ``"off"``: no check at all.

One cast is undone in every mode but ``"off"`` without an error: a cast of the trained parameters
made under ``torch.no_grad()`` (a generation or an evaluation). The guard keeps the FP32 tensors
the cast replaced and puts them back, bit for bit, before the next training forward or optimizer
step: nothing was lost, so nothing needs stopping (one warning names the call site).

Example (any loop; :class:`~amp_trainer.scaler.DynamicLossScaler.watch` with a model builds one,
``AmpTrainer`` and ``AmpAccelerator`` build their own)::

    guard = PrecisionGuard(model, scaler=scaler).watch_optimizer(optimizer)
    ...                                     # train as usual: the step pre-hook checks
    guard.close()                           # at the end: hooks removed

Cost: one pass over the optimizer's parameters (and their state) per step, no device sync;
``python -m benchmarks run precision_guard`` measures it side by side.

The package: :mod:`~amp_trainer.precision_guard.drift` (the modes, :class:`PrecisionDriftError`,
:class:`Drift`), :mod:`~amp_trainer.precision_guard.tracking` (who changed a dtype: the
``Module._apply`` tracker and the forward pre-hook), :mod:`~amp_trainer.precision_guard.fsdp_policy`
(FSDP2 ``MixedPrecisionPolicy`` against what was asked), :mod:`~amp_trainer.precision_guard.guard`
(:class:`PrecisionGuard`: the expectations, the check, the repair), and, checked once at the
start of an RL run rather than at every step, :mod:`~amp_trainer.precision_guard.rollout` (the
rollout side's precision against the trainer's: :func:`check_rollout_precision`).
"""

from amp_trainer.precision_guard.drift import (
    GUARD_MODES,
    Drift,
    PrecisionDriftError,
    check_guard_mode,
)
from amp_trainer.precision_guard.guard import PrecisionGuard, guard_for, guard_run
from amp_trainer.precision_guard.rollout import (
    ROLLOUT_MISMATCH_MODES,
    RolloutPrecision,
    RolloutPrecisionError,
    check_rollout_mismatch_mode,
    check_rollout_precision,
    check_trainer_rollout,
    rollout_precision,
    vllm_auto_precision,
)

__all__ = [
    "GUARD_MODES",
    "ROLLOUT_MISMATCH_MODES",
    "Drift",
    "PrecisionDriftError",
    "PrecisionGuard",
    "RolloutPrecision",
    "RolloutPrecisionError",
    "check_guard_mode",
    "check_rollout_mismatch_mode",
    "check_rollout_precision",
    "check_trainer_rollout",
    "guard_for",
    "guard_run",
    "rollout_precision",
    "vllm_auto_precision",
]
