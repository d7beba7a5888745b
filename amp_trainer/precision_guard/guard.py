"""The guard itself: what a run set up, the check before each step, and acting on a drift."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from amp_trainer.islands import is_fp32_island
from amp_trainer.precision_guard.drift import (
    Drift,
    PrecisionDriftError,
    check_guard_mode,
    dtype_name,
    lower_precision,
)
from amp_trainer.precision_guard.fsdp_policy import (
    FsdpPolicies,
    PolicyAsk,
    guard_kwargs_for_accelerate,
)
from amp_trainer.precision_guard.tracking import TRACKER, Cast, ForwardWatch

__all__ = ["PrecisionGuard", "guard_for", "guard_run"]

logger = logging.getLogger("amp_trainer.precision_guard")


@dataclass
class _Plan:
    """A clean step's tensors and dtypes (see :meth:`PrecisionGuard._make_plan`)."""

    params: list[tuple[torch.Tensor, torch.dtype]]
    states: list[tuple[dict[str, Any], str, torch.dtype]]
    islands: list[tuple[nn.Module, str, nn.Module]]
    optimizers: list[tuple[torch.optim.Optimizer, Any, int, int]]


def _count(optimizer: torch.optim.Optimizer) -> int:
    return sum(len(group["params"]) for group in optimizer.param_groups)


class PrecisionGuard:
    """Check, before each optimizer step, that nothing lowered the run's precision since its start.

    Args:
        model: the model trained; its floating parameters' dtypes now are the expectation.
        mode: ``"raise"``, ``"repair"``, ``"warn"`` or ``"off"`` (module docstring).
        scaler: the run's :class:`~amp_trainer.scaler.DynamicLossScaler`, if any: FP16 forwards
            are expected exactly when it is enabled.
        check_autocast: whether to watch the forwards' autocast (one pre-hook on one module).
        fsdp_policy: the FSDP2 ``MixedPrecisionPolicy`` every ``fully_shard`` module was asked
            to apply (its param, reduce and output dtypes are checked from the first step on);
            ``None``: each module's policy when first seen is the expectation.
        fsdp_policy_source: who asked for ``fsdp_policy`` (named in the error).
        precision: the run's precision (``"fp16"``, ``"bf16"``): an FSDP2 policy in the other
            16-bit dtype is a drift. ``None``: ``"fp16"`` where ``scaler`` is enabled.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        mode: str = "raise",
        scaler: Any = None,
        check_autocast: bool = True,
        fsdp_policy: Any = None,
        fsdp_policy_source: str = "PrecisionGuard(fsdp_policy=...)",
        precision: str | None = None,
    ) -> None:
        self.mode = check_guard_mode(mode)
        self.model = model
        self.scaler = scaler
        self._names: dict[int, str] = {}
        self._expected: dict[int, torch.dtype] = {}
        self._casts: dict[int, Cast] = {}
        self._kept_buffers: dict[tuple[int, str], tuple[nn.Module, str, torch.Tensor, bool]] = {}
        self._state_dtypes: dict[tuple[int, str], torch.dtype] = {}
        self._plan: _Plan | None = None
        self._optimizers: list[weakref.ref[torch.optim.Optimizer]] = []
        self._hooks: list[Any] = []
        self._said: set[tuple[str, str | None]] = set()
        self._islands: dict[str, nn.Module] = {}
        if precision is None and scaler is not None and scaler.is_enabled():
            precision = "fp16"
        self._fsdp = FsdpPolicies(PolicyAsk(fsdp_policy, fsdp_policy_source, precision))
        self._checked_by_scaler: torch.optim.Optimizer | None = None
        self._forwards = self._fp16_forwards = 0
        self._check_autocast = check_autocast
        self._device_type = "cpu"
        self.closed = self.mode == "off"
        self.drifts_seen: list[Drift] = []
        if self.closed:
            return
        self.refresh()
        TRACKER.add(self)

    # -- what the run set up -------------------------------------------------------------------
    def refresh(self) -> None:
        """Take the model's current dtypes, islands and FSDP2 policies as the expectation for
        parameters not seen yet (a model re-prepared, adapters added)."""
        for name, param in self.model.named_parameters():
            self._names.setdefault(id(param), name)
            if param.is_floating_point():
                self._expected.setdefault(id(param), param.dtype)
                self._device_type = param.device.type
        for name, module in self.model.named_modules():
            if is_fp32_island(module):
                self._islands.setdefault(name, module)
            self._fsdp.watch(name, module)
        for key in [k for k, cast in self._casts.items() if cast.kept is None]:
            self._casts.pop(key)  # a cast already made good by hand: nothing to put back
        if self._check_autocast and not self._hooks:
            # A submodule, not the model itself: a wrapper that enters autocast inside the
            # model's forward (Accelerate's) has not entered it yet when the model's hooks run.
            # A model that is one module with parameters is not watched for autocast.
            model = self.model
            first = next((m for m in model.modules() if m is not model and m._parameters), None)
            if first is not None:
                self._hooks.append(first.register_forward_pre_hook(ForwardWatch(self)))

    def watch_optimizer(
        self, optimizer: torch.optim.Optimizer, *, only_own: bool = False
    ) -> PrecisionGuard:
        """Check before each ``optimizer.step()`` (a torch step pre-hook); returns ``self``.
        ``only_own``: not if the optimizer updates none of this model's parameters (another
        model's, in a loop with several)."""
        optimizer = _unwrapped(optimizer)
        if self.closed or any(ref() is optimizer for ref in self._optimizers):
            return self
        if only_own:
            own = {id(p) for p in self.model.parameters()}
            if not any(id(p) in own for p in _params_of(optimizer)):
                return self
        self._optimizers.append(weakref.ref(optimizer))
        for param in _params_of(optimizer):
            if param.is_floating_point():
                self._expected.setdefault(id(param), param.dtype)
        self._hooks.append(optimizer.register_step_pre_hook(self._before_step))
        return self

    def close(self) -> None:
        """Remove every hook; the guard checks nothing after this."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._casts.clear()
        self._kept_buffers.clear()
        self.closed = True
        TRACKER.discard(self)

    # -- what the tracker and the hooks tell it ------------------------------------------------
    def watched_in(self, module: nn.Module) -> list[tuple[Any, str | None, torch.Tensor]]:
        """``module``'s trainable parameters this guard expects something of, and its FP32
        buffers (a rotary embedding's ``inv_freq``), with their tensors now."""
        if self.closed:
            return []
        expected = self._expected
        found: list[tuple[Any, str | None, torch.Tensor]] = [
            (p, None, p.data) for p in module.parameters() if p.requires_grad and id(p) in expected
        ]
        if found:
            found += [
                (holder, key, buf)
                for holder in module.modules()
                for key, buf in holder._buffers.items()
                if buf is not None and buf.dtype in (torch.float32, torch.float64)
            ]
        return found

    def saw_apply(
        self, watched: list[tuple[Any, str | None, torch.Tensor]], site: str, no_grad: bool
    ) -> None:
        """What a ``Module._apply`` changed: casts to a lower precision are remembered, with
        the tensors they replaced (so they can be put back exactly)."""
        for owner, key, old in watched:
            if key is not None:  # a buffer
                now = owner._buffers.get(key)
                if now is not None and lower_precision(now.dtype, old.dtype):
                    self._kept_buffers.setdefault((id(owner), key), (owner, key, old, no_grad))
                continue
            param = owner
            if param.dtype is old.dtype or not lower_precision(
                param.dtype, self._expected[id(param)]
            ):
                continue
            earlier = self._casts.get(id(param))
            kept = earlier.kept if earlier is not None else old
            if kept is not None and kept.dtype is not self._expected[id(param)]:
                kept = None
            self._casts[id(param)] = Cast(site, kept, no_grad)

    def before_forward(self, module: nn.Module) -> None:
        """A forward of the watched module: note its autocast; undo casts before training."""
        if not (module.training and torch.is_grad_enabled()):
            return
        self._forwards += 1
        dev = self._device_type
        autocast = torch.is_autocast_enabled(dev) and torch.get_autocast_dtype(dev)
        half = autocast is torch.float16 or any(
            p is not None and p.dtype is torch.float16 for p in module._parameters.values()
        )
        self._fp16_forwards += half
        if self._casts or self._kept_buffers:
            self._undo_casts(only_no_grad=self.mode != "repair")
            if self._casts and self.mode == "raise":
                drifts = self._master_weight_drifts(self._trainable())
                if drifts:
                    self._act(drifts, "before a training forward")

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._checked_by_scaler is optimizer:  # checked a moment ago, before unscaling
            self._checked_by_scaler = None
            # Trainer's on_pre_optimizer_step callbacks run between the unscale (at clipping)
            # and the step: the plan's identity tests see what they changed. No plan: that
            # check found drifts and acted on them already.
            if self._plan is None or self._plan_holds():
                return
        self.check(optimizer)

    def check_before_unscale(self, optimizer: torch.optim.Optimizer) -> list[Drift]:
        """The loss scaler's call, before it unscales (where FP16 gradients would be refused
        with no cause named): :meth:`check`, and the step pre-hook that follows in this
        iteration does not check again."""
        drifts = self.check(optimizer)
        self._checked_by_scaler = _unwrapped(optimizer)
        return drifts

    # -- the check ---------------------------------------------------------------------------
    def check(self, optimizer: torch.optim.Optimizer | None = None) -> list[Drift]:
        """Check every invariant now (before an optimizer step); act per :attr:`mode`.

        Returns the drifts found (empty on a clean step). Called by the optimizer's step
        pre-hook and by the loss scaler before it unscales; a plain loop may call it itself.
        """
        if self.closed:
            return []
        if optimizer is not None:
            self.watch_optimizer(optimizer)
        if self._casts or self._kept_buffers:
            self._undo_casts(only_no_grad=True)
        drifts = self._autocast_drifts()
        if self._fsdp:
            drifts += self._fsdp.drifts()
        if not drifts and self._plan_holds():
            return drifts
        params = self._trainable()
        drifts += self._master_weight_drifts(params)
        drifts += self._gradient_drifts(params)
        drifts += self._optimizer_state_drifts()
        drifts += self._island_drifts()
        self._plan = None if drifts else self._make_plan(params)
        if drifts:
            self._act(drifts, "before the optimizer step")
        return drifts

    def _make_plan(self, params: list[tuple[str, nn.Parameter]]) -> _Plan:
        """What a clean step looks like, as flat lists: the next checks compare against it
        with identity tests only (one pass, no allocation), and fall back to the full check,
        which names what changed, when anything differs."""
        expected = self._expected
        optimizers = [ref() for ref in self._optimizers]
        states = [
            (state, key, value.dtype)
            for param, key, value in self._moment_states()
            for state in (self._optimizers_state_of(param),)
        ]
        islands = []
        for name, module in self._islands.items():
            parent_name, _, attr = name.rpartition(".")
            if name:
                islands.append((self.model.get_submodule(parent_name), attr, module))
        return _Plan(
            params=[(p, expected[id(p)]) for _, p in params if id(p) in expected],
            states=states,
            islands=islands,
            optimizers=[(o, o.state, len(o.state), _count(o)) for o in optimizers if o],
        )

    def _plan_holds(self) -> bool:
        plan = self._plan
        if plan is None or len(plan.optimizers) != len(self._optimizers):
            return False
        for optimizer, state, entries, params in plan.optimizers:
            if optimizer.state is not state or len(state) != entries or _count(optimizer) != params:
                return False
        # A gradient's dtype is checked too: autograd accumulates in the parameter's
        # ``grad_dtype`` (settable since torch 2.10), and ``grad.data = grad.data.half()`` in a
        # hook or a callback rebinds it with no check at all.
        for param, dtype in plan.params:
            grad = param.grad
            if param.dtype is not dtype or (grad is not None and grad.dtype is not dtype):
                return False
        for state, key, dtype in plan.states:
            value = state.get(key)
            if value is None or value.dtype is not dtype:
                return False
        for parent, attr, module in plan.islands:
            if parent._modules.get(attr) is not module or not is_fp32_island(module):
                return False
        return True

    def _trainable(self) -> list[tuple[str, nn.Parameter]]:
        seen: dict[int, nn.Parameter] = {}
        for ref in self._optimizers:
            optimizer = ref()
            if optimizer is not None:
                seen.update((id(p), p) for p in _params_of(optimizer))
        if not seen:
            seen = {id(p): p for p in self.model.parameters() if p.requires_grad}
        names = self._names
        if any(key not in names for key in seen):
            self.refresh()  # parameters replaced since (sharded by FSDP2, adapters added)
        return [(names.get(key, f"<parameter {key:#x}>"), p) for key, p in seen.items()]

    def _expect(self, param: torch.Tensor) -> torch.dtype | None:
        expected = self._expected.get(id(param))
        if expected is None and param.is_floating_point():
            self._expected[id(param)] = expected = param.dtype
        elif (
            expected is not None
            and param.dtype is not expected
            and not lower_precision(param.dtype, expected)
        ):
            self._expected[id(param)] = expected = param.dtype  # higher precision: kept
        return expected

    def _master_weight_drifts(self, params: list[tuple[str, nn.Parameter]]) -> list[Drift]:
        found: dict[tuple[torch.dtype, torch.dtype, str | None], list[str]] = {}
        for name, param in params:
            expected = self._expect(param)
            if expected is not None and param.dtype is not expected:
                cast = self._casts.get(id(param))
                key = (param.dtype, expected, cast.site if cast else None)
                found.setdefault(key, []).append(name)
        return [
            Drift("master weights", tuple(n), dtype_name(seen), dtype_name(exp), site)
            for (seen, exp, site), n in found.items()
        ]

    def _gradient_drifts(self, params: list[tuple[str, nn.Parameter]]) -> list[Drift]:
        found: dict[tuple[torch.dtype, torch.dtype], list[str]] = {}
        for name, param in params:
            grad, expected = param.grad, self._expected.get(id(param))
            if grad is not None and expected is not None and lower_precision(grad.dtype, expected):
                found.setdefault((grad.dtype, expected), []).append(name)
        return [
            Drift("gradients", tuple(n), dtype_name(s), dtype_name(e))
            for (s, e), n in found.items()
        ]

    def _optimizer_state_drifts(self) -> list[Drift]:
        """Moment-like state (the parameter's shape) lower than it was first seen: an optimizer
        that keeps BF16 moments by design from its first step is what the run set up."""
        found: dict[tuple[torch.dtype, torch.dtype], list[str]] = {}
        first = self._state_dtypes
        for param, key, value in self._moment_states():
            expected = first.setdefault((id(param), key), value.dtype)
            if lower_precision(value.dtype, expected):
                name = self._names.get(id(param), "?")
                found.setdefault((value.dtype, expected), []).append(f"{name}:{key}")
            elif value.dtype is not expected:
                first[(id(param), key)] = value.dtype
        return [
            Drift("optimizer state", tuple(n), dtype_name(s), dtype_name(e))
            for (s, e), n in found.items()
        ]

    def _moment_states(self) -> Iterator[tuple[torch.Tensor, str, torch.Tensor]]:
        for ref in self._optimizers:
            optimizer = ref()
            if optimizer is None:
                continue
            for param, state in _states(optimizer):
                for key, value in state.items():
                    if (
                        isinstance(value, torch.Tensor)
                        and value.shape == param.shape
                        and value.is_floating_point()
                    ):
                        yield param, key, value

    def _island_drifts(self) -> list[Drift]:
        lost = []
        for name, module in self._islands.items():
            try:
                now = self.model.get_submodule(name) if name else self.model
            except AttributeError:
                now = None
            if now is not module or not is_fp32_island(module):
                lost.append(name or "<model>")
        if not lost:
            return []
        return [Drift("FP32 islands", tuple(lost), "not computing in FP32", "FP32 islands")]

    def _autocast_drifts(self) -> list[Drift]:
        forwards, fp16 = self._forwards, self._fp16_forwards
        self._forwards = self._fp16_forwards = 0
        if not forwards:
            return []
        scaling = self.scaler is not None and self.scaler.is_enabled()
        if fp16 and not scaling:
            return [
                Drift(
                    "training forwards",
                    ("FP16 forward",),
                    "FP16 with no loss scaler",
                    "a loss scaler wherever FP16 gradients flow",
                )
            ]
        if scaling and not fp16:
            return [
                Drift(
                    "training forwards",
                    ("forward",),
                    "not FP16 (autocast off)",
                    "FP16 autocast where the loss scaler is on",
                )
            ]
        return []

    # -- acting on it ------------------------------------------------------------------------
    def _undo_casts(self, *, only_no_grad: bool) -> None:
        """Put back the FP32 tensors a cast replaced: exact, since no step ran in between."""
        self._undo_buffer_casts(only_no_grad)
        for param, name in self._params_by_id(self._casts):
            cast = self._casts[id(param)]
            if only_no_grad and not cast.under_no_grad:
                continue
            expected = self._expected[id(param)]
            with torch.no_grad():
                if cast.kept is not None and cast.kept.shape == param.shape:
                    param.data = cast.kept.to(param.device)
                else:
                    param.data = param.data.to(expected)
                if param.grad is not None and param.grad.dtype is not expected:
                    param.grad = param.grad.to(expected)
            del self._casts[id(param)]
            how = "under torch.no_grad()" if cast.under_no_grad else "during training"
            self._say_once(
                ("undone", cast.site),
                f"{cast.site} cast trained parameters (e.g. {name}) to a lower precision {how}; "
                f"their {dtype_name(expected)} values were kept and are back "
                f"{'bit for bit' if cast.kept is not None else '(rounded once)'}.",
            )

    def _undo_buffer_casts(self, only_no_grad: bool) -> None:
        for where, (holder, key, old, no_grad) in list(self._kept_buffers.items()):
            if only_no_grad and not no_grad:
                continue
            now = holder._buffers.get(key)
            if now is not None and now.shape == old.shape and lower_precision(now.dtype, old.dtype):
                holder._buffers[key] = old.to(now.device)
            del self._kept_buffers[where]

    def _params_by_id(self, ids: Iterable[int]) -> Iterator[tuple[nn.Parameter, str]]:
        wanted = set(ids)
        for name, param in self.model.named_parameters():
            if id(param) in wanted:
                yield param, name

    def _act(self, drifts: list[Drift], when: str) -> None:
        self.drifts_seen.extend(drifts)
        message = f"Precision drift {when}: " + "; ".join(d.describe() for d in drifts) + "."
        if self.mode == "raise":
            raise PrecisionDriftError(
                message + " The run was set up with these dtypes and would go on at a lower "
                "precision. precision_guard='repair' puts them back and goes on, 'warn' only "
                "says it, 'off' turns the check off.",
                tuple(drifts),
            )
        if self.mode == "repair":
            repaired = self._repair(drifts)
            message += f" Repaired: {repaired}." if repaired else " Nothing here can be repaired."
        for drift in drifts:
            if (drift.kind, drift.site) not in self._said:
                self._said.add((drift.kind, drift.site))
                logger.warning("%s", message)
                break
        if self.mode == "warn":
            self._casts.clear()  # the run goes on at the drifted dtypes: nothing to put back
        self._fsdp.accept(drifts)  # no public call puts a policy back: said once, gone on with

    def _repair(self, drifts: list[Drift]) -> str:
        done = []
        kinds = {d.kind for d in drifts}
        if "master weights" in kinds or "gradients" in kinds:
            trainable = self._trainable()
            for _, param in trainable:
                expected = self._expected.get(id(param))
                if expected is not None and param.dtype is not expected:
                    self._casts.setdefault(id(param), Cast("an assignment to .data", None, False))
            self._undo_casts(only_no_grad=False)  # the weights, and their gradients with them
            for name, param in trainable:
                expected, grad = self._expected.get(id(param)), param.grad
                if (
                    expected is not None
                    and grad is not None
                    and lower_precision(grad.dtype, expected)
                ):
                    _put_grad_back(param, name, expected, self._say_once)
            done.append("master weights and gradients")
        if "optimizer state" in kinds:
            for param, key, value in list(self._moment_states()):
                expected = self._state_dtypes[(id(param), key)]
                if lower_precision(value.dtype, expected):
                    self._optimizers_state_of(param)[key] = value.to(expected)
            done.append("optimizer state")
        if "FP32 islands" in kinds:
            from amp_trainer.islands import keep_in_fp32

            names = [d for drift in drifts if drift.kind == "FP32 islands" for d in drift.tensors]
            keep_in_fp32(self.model, [n for n in names if n != "<model>"])
            self._islands = {n: self.model.get_submodule(n) for n in self._islands}
            done.append("FP32 islands")
        return ", ".join(done)

    def _optimizers_state_of(self, param: torch.Tensor) -> dict[str, Any]:
        for ref in self._optimizers:
            optimizer = ref()
            if optimizer is not None and param in optimizer.state:
                return optimizer.state[param]
        raise KeyError("no optimizer holds state for this parameter")

    def _say_once(self, key: tuple[str, str | None], message: str) -> None:
        if key not in self._said:
            self._said.add(key)
            logger.warning("%s", message)


def guard_for(target: Any, scaler: Any) -> PrecisionGuard | None:
    """The guard :meth:`~amp_trainer.scaler.DynamicLossScaler.watch` keeps for ``target``: the
    scaler's own for the same model (refreshed), a new one for another model (the old one
    closed), the current one where ``target`` is not a model (named parameters name nothing
    whose dtypes could be checked as a whole), none for a disabled scaler."""
    current = scaler.precision_guard
    if not isinstance(target, nn.Module) or getattr(scaler, "precision_guard_off", False):
        return current
    if current is not None and current.model is target and not current.closed:
        current.refresh()
        return current
    if current is not None:
        current.close()
    return PrecisionGuard(target, scaler=scaler) if scaler.is_enabled() else None


def guard_run(
    model: nn.Module,
    mode: str,
    scaler: Any,
    current: PrecisionGuard | None,
    *,
    attach: bool = True,
    **kwargs: Any,
) -> PrecisionGuard | None:
    """The guard a trainer or an accelerator keeps for ``model`` in ``mode``: ``current`` where
    it already guards that model in that mode, else a new one (``current`` and the scaler's own
    closed). ``attach``: it is the scaler's too, so the check runs before the scaler unscales
    (where FP16 gradients would be refused with no cause named)."""
    check_guard_mode(mode)
    own = getattr(scaler, "precision_guard", None) if attach else None
    same = current is not None and current.model is model and current.mode == mode
    if same and not current.closed:  # type: ignore[union-attr]
        current.refresh()
        return current
    for old in {id(g): g for g in (current, own) if g is not None}.values():
        old.close()
    guard = None if mode == "off" else PrecisionGuard(model, mode=mode, scaler=scaler, **kwargs)
    if scaler is not None and attach:
        scaler.precision_guard = guard
        scaler.precision_guard_off = guard is None  # watch(model) builds none after this
    return guard


def guard_for_trainer(trainer: Any, model: nn.Module) -> PrecisionGuard | None:
    """The guard an :class:`~amp_trainer.AmpTrainerMixin` keeps for the model its optimizer is
    built for: its ``precision_guard`` mode (off under DeepSpeed, whose own FP16 engine keeps
    FP16 weights on purpose), the run's precision, and under Accelerate's FSDP2 the policy its
    plugin asked for."""
    deepspeed = trainer.is_deepspeed_enabled
    mode = "off" if deepspeed else getattr(trainer.args, "precision_guard", "raise")
    fsdp2 = trainer.is_fsdp_enabled and getattr(trainer.accelerator, "is_fsdp2", False)
    kwargs = guard_kwargs_for_accelerate(trainer.accelerator.state, trainer.precision, fsdp2)
    return guard_run(model, mode, trainer.loss_scaler, trainer.precision_guard, **kwargs)


def _unwrapped(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside Accelerate's ``AcceleratedOptimizer`` and the like."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _params_of(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for group in optimizer.param_groups:
        yield from group["params"]


def _states(optimizer: torch.optim.Optimizer) -> Iterator[tuple[torch.Tensor, dict[str, Any]]]:
    state = optimizer.state
    for param in _params_of(optimizer):
        entry = state.get(param)
        if entry:
            yield param, entry


def _put_grad_back(param: torch.Tensor, name: str, expected: torch.dtype, say_once: Any) -> None:
    """``param.grad`` cast back to ``expected``, and a ``grad_dtype`` (torch >= 2.10) lower than
    ``expected`` set back to it: autograd would accumulate every later gradient in it, and
    refuses the repaired gradient while it is set (and refuses a new ``grad_dtype`` while a
    gradient of the old one is there, hence the order)."""
    grad = param.grad
    grad_dtype = getattr(param, "grad_dtype", None)
    if grad_dtype is None or not lower_precision(grad_dtype, expected):
        param.grad = grad.to(expected)
        return
    param.grad = None
    param.grad_dtype = expected
    param.grad = grad.to(expected)
    say_once(
        ("grad_dtype", name),
        f"{name}.grad_dtype was {dtype_name(grad_dtype)}: set back to {dtype_name(expected)}, "
        "so that its gradients accumulate in the master weights' precision again.",
    )
