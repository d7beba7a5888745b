"""FSDP2 ``MixedPrecisionPolicy``: what each ``fully_shard`` module applies, against what was asked.

A ``fully_shard`` module keeps its policy twice: on its FSDP state (which casts the forward's
inputs and outputs) and on its parameter group (whose parameters are all-gathered in
``param_dtype`` and reduce-scattered in ``reduce_dtype``). Neither can be changed through a public
call once sharded (``fully_shard`` refuses a second application), so a change mid-run is code
reaching into them; either copy changing is a drift.

"Asked" is, where it can be known (:class:`PolicyAsk`):

* the policy the run passed: Accelerate's FSDP2 plugin ``mixed_precision_policy`` (what its
  ``prepare`` gives ``fully_shard``, and silently does not where the model came already sharded),
  or ``PrecisionGuard(fsdp_policy=...)``; its ``param_dtype``, ``reduce_dtype`` and
  ``output_dtype`` must be what each module applies, from the first step on;
* else the policy a module had when the guard first saw it;
* and in either case the run's 16-bit dtype: an fp16 run (a loss scaler) whose policy computes
  or reduces in bf16 trains in a precision nobody asked for, and a bf16 run in fp16 loses range
  with no scaler. FP32 (``None``) in a policy is never lower than the run's precision.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from amp_trainer.precision_guard.drift import Drift, dtype_name

__all__ = [
    "FSDP_KIND",
    "FsdpPolicies",
    "PolicyAsk",
    "applied_policies",
    "guard_kwargs_for_accelerate",
    "policy_drift",
]

FSDP_KIND = "FSDP2 MixedPrecisionPolicy"

_FIELDS = ("param_dtype", "reduce_dtype", "output_dtype")
_SIXTEEN = {"fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class PolicyAsk:
    """What the run asked of every ``fully_shard`` module's policy.

    Args:
        policy: the ``MixedPrecisionPolicy`` asked for, or ``None`` (then each module's policy
            at the start is the expectation).
        source: who asked for ``policy`` (named in the error).
        precision: the run's precision (``"fp16"``, ``"bf16"``, or ``None``: not known / FP32).
    """

    policy: Any = None
    source: str = "PrecisionGuard(fsdp_policy=...)"
    precision: str | None = None


class FsdpPolicies:
    """Every ``fully_shard`` module of a guarded model: its policy when first seen, and what
    it is checked against (the run's :class:`PolicyAsk`, until a drift was gone on with)."""

    def __init__(self, ask: PolicyAsk) -> None:
        self.ask = ask
        self.modules: dict[str, tuple[nn.Module, Any, PolicyAsk]] = {}

    def __bool__(self) -> bool:
        return bool(self.modules)

    def watch(self, name: str, module: nn.Module) -> None:
        """``module`` (named ``name`` in the model), if FSDP2 sharded it and it is new."""
        if name not in self.modules:
            policies = applied_policies(module)
            if policies:
                self.modules[name] = (module, policies[0], self.ask)

    def drifts(self) -> list[Drift]:
        """Each module's policies now against what was asked (:func:`policy_drift`)."""
        found = (
            policy_drift(name, applied_policies(module), start, ask)
            for name, (module, start, ask) in self.modules.items()
        )
        return [drift for drift in found if drift is not None]

    def accept(self, drifts: list[Drift]) -> None:
        """The policies a ``"warn"``/``"repair"`` run goes on with become the expectation: the
        guard cannot put one back (FSDP2 has no public call to change a policy), so a cause is
        said once, not at every step."""
        for drift in drifts:
            if drift.kind == FSDP_KIND:
                name = "" if drift.tensors[0] == "<model>" else drift.tensors[0]
                module = self.modules[name][0]
                self.modules[name] = (module, applied_policies(module)[0], PolicyAsk())


def applied_policies(module: nn.Module) -> tuple[Any, ...]:
    """``module``'s policies as FSDP2 applies them: its state's, and its parameter group's
    where it manages parameters; ``()`` where ``fully_shard`` has not made it an FSDP module."""
    get_state = getattr(module, "_get_fsdp_state", None)
    if get_state is None:
        return ()
    try:
        state = get_state()
        policies = [state._mp_policy]
    except (AttributeError, RuntimeError, AssertionError):  # not sharded (yet)
        return ()
    group = getattr(state, "_fsdp_param_group", None)
    if group is not None and getattr(group, "mp_policy", None) is not None:
        policies.append(group.mp_policy)
    return tuple(policies)


def policy_drift(name: str, now: tuple[Any, ...], start: Any, ask: PolicyAsk) -> Drift | None:
    """The drift of one module whose applied policies are ``now`` (:func:`applied_policies`)
    and whose policy at the guard's start was ``start``, or ``None``."""
    label = (name or "<model>",)
    for policy in now:
        if ask.policy is not None:  # what was asked is the expectation, run precision or not
            differ = [f for f in _FIELDS if getattr(policy, f) != getattr(ask.policy, f)]
            if differ:
                return Drift(
                    FSDP_KIND, label, _fields(policy, differ), _fields(ask.policy, differ),
                    f"asked for by {ask.source}",
                )  # fmt: skip
            continue
        if policy != start:
            differ = [f for f in _FIELDS if getattr(policy, f) != getattr(start, f)]
            return Drift(
                FSDP_KIND, label, _fields(policy, differ) or str(policy),
                _fields(start, differ) or str(start), "as at the start",
            )  # fmt: skip
        run = _SIXTEEN.get(ask.precision or "")
        other = [f for f in _FIELDS if getattr(policy, f) in _SIXTEEN.values()]
        other = [f for f in other if getattr(policy, f) is not run]
        if run is not None and other:
            wanted = ", ".join(f"{f}={dtype_name(run)} or None" for f in other)
            return Drift(
                FSDP_KIND, label, _fields(policy, other), wanted,
                f"the run's precision is {ask.precision}",
            )  # fmt: skip
    return None


def _fields(policy: Any, fields: list[str]) -> str:
    return ", ".join(f"{f}={_dtype(getattr(policy, f))}" for f in fields)


def _dtype(dtype: torch.dtype | None) -> str:
    return "None" if dtype is None else dtype_name(dtype)


def guard_kwargs_for_accelerate(state: Any, precision: str | None, fsdp2: bool) -> dict[str, Any]:
    """:class:`~amp_trainer.precision_guard.PrecisionGuard`'s FSDP2 keywords for a run that
    Accelerate prepares: the run's ``precision``, and under its FSDP2 the plugin's policy as
    ``fsdp2_prepare_model`` passes it to ``fully_shard`` (``MixedPrecisionPolicy()`` where it
    holds none). Its ``prepare`` leaves a model the user sharded before as it is, whatever
    policy it has: this is where that is caught."""
    kwargs: dict[str, Any] = {"precision": precision}
    plugin = getattr(state, "fsdp_plugin", None)
    if fsdp2 and plugin is not None:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        kwargs["fsdp_policy"] = plugin.mixed_precision_policy or MixedPrecisionPolicy()
        kwargs["fsdp_policy_source"] = "Accelerate's FSDP plugin (mixed_precision_policy)"
    return kwargs
