"""Parity: how an exported artifact's outputs compare with the FP32 model's on the sample batch.

Step 3 of :mod:`amp_trainer.export`'s flow; :class:`ParityResult` is re-exported there.
"""

from __future__ import annotations

import dataclasses
import functools
import keyword
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from amp_trainer.export.sample_inputs import forward_kwargs

_OUTPUT_NAMES = ("logits", "last_hidden_state")


def _autocast_wrapped(module: nn.Module) -> Any:
    """The forward under Accelerate's autocast wrapper (``prepare()`` keeps it as the instance's
    ``_original_forward``), or ``None`` when ``module`` is not wrapped."""
    return module.__dict__.get("_original_forward") if "forward" in module.__dict__ else None


def drop_autocast_wrapper(module: nn.Module) -> None:
    """Remove Accelerate's autocast forward wrapper from ``module`` (a copy we own) for good, so
    it runs as it will once saved and loaded: its own forward."""
    original = _autocast_wrapped(module)
    if original is None:
        return
    del module.__dict__["_original_forward"]
    own = getattr(original, "__self__", None) is module and getattr(
        original, "__func__", None
    ) is getattr(type(module), "forward", None)
    if own:
        del module.__dict__["forward"]  # the class's own forward again
    else:
        module.forward = original


@dataclass(frozen=True)
class ParityResult:
    """How one exported artifact's outputs compare with the FP32 model's on the sample inputs.

    Errors are taken over the real (non-padding) positions only. Relative errors are normwise
    (error divided by the reference's magnitude: ``max_rel_error = max_abs_error / max|ref|``,
    ``mean_rel_error = mean_abs_error / mean|ref|``), because elementwise relative error explodes
    on logits near zero and says nothing. ``top1_agreement`` is the fraction of positions whose
    argmax over the last dimension matches (``None`` for hidden states, where it means nothing).
    """

    format: str
    output: str
    positions: int
    max_abs_error: float
    mean_abs_error: float
    max_rel_error: float
    mean_rel_error: float
    top1_agreement: float | None
    nonfinite: int
    passed: bool
    failures: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["failures"] = list(self.failures)
        return data


def pick_output(output: Any) -> tuple[str, torch.Tensor]:
    for name in _OUTPUT_NAMES:
        value = output.get(name) if isinstance(output, Mapping) else None
        if isinstance(value, torch.Tensor):
            return name, value
    raise ValueError(
        f"model output has none of {_OUTPUT_NAMES}; cannot compare FP16 and FP32 outputs "
        f"(got {type(output).__name__})"
    )


class OutputOnly(nn.Module):
    """``model(**inputs)[output_name]`` as a module of plain tensors, for TorchScript, torch.export
    and ONNX.

    Its ``forward`` takes exactly the sample batch's names, in order, as named parameters (the
    exported artifacts are called with those keywords, and TorchScript's tracer and torch.export
    read the names from the signature, not from ``**kwargs``). Build it with :func:`output_only`.
    """

    input_names: tuple[str, ...] = ()

    def __init__(self, model: nn.Module, output_name: str) -> None:
        super().__init__()
        self.model = model
        self.output_name = output_name
        self._extra = forward_kwargs(model)

    def run(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(**inputs, **self._extra)[self.output_name]


@functools.cache
def _taking(input_names: tuple[str, ...]) -> type[OutputOnly]:
    """The :class:`OutputOnly` subclass whose ``forward`` has ``input_names`` as parameters.

    Generated source, as ``dataclasses`` and ``namedtuple`` do for their ``__init__``: the
    parameter names are the model's input names, known only at run time, and the tracers need
    real named parameters. The names were checked to be identifiers (sample_inputs).
    """
    for name in input_names:
        if not name.isidentifier() or keyword.iskeyword(name) or name == "self":
            raise ValueError(f"input name {name!r} cannot be a forward parameter")
    params = ", ".join(input_names)
    items = ", ".join(f"{name!r}: {name}" for name in input_names)
    namespace: dict[str, Any] = {}
    exec(  # identifiers only, checked above
        f"def forward(self, {params}):\n    return self.run({{{items}}})\n", namespace
    )
    forward = namespace["forward"]
    forward.__doc__ = f"The model's output for {params}, as one tensor."
    return type(
        "OutputOnly",
        (OutputOnly,),
        {"forward": forward, "input_names": input_names, "__module__": __name__},
    )


def output_only(model: nn.Module, output_name: str, input_names: Sequence[str]) -> OutputOnly:
    """:class:`OutputOnly` over ``model`` taking ``input_names`` (the sample batch's keys)."""
    return _taking(tuple(input_names))(model, output_name)


def compare(
    fmt: str,
    output_name: str,
    reference: torch.Tensor,
    candidate: torch.Tensor,
    mask: torch.Tensor,
    thresholds: Mapping[str, float | None],
) -> ParityResult:
    if candidate.shape != reference.shape:
        raise RuntimeError(
            f"{fmt}: output shape {tuple(candidate.shape)} != FP32 {tuple(reference.shape)}"
        )
    # [batch, seq, ...] outputs are compared on real tokens; [batch, classes] on every row.
    keep = mask.bool() if reference.dim() >= 3 else torch.ones(len(reference), dtype=torch.bool)
    ref = reference.float()[keep]
    cand = candidate.float()[keep]
    finite = torch.isfinite(cand)
    nonfinite = int((~finite).sum())
    diff = (cand - ref).abs()
    diff = torch.where(finite, diff, torch.zeros_like(diff))
    max_abs = float(diff.max()) if diff.numel() else 0.0
    mean_abs = float(diff.mean()) if diff.numel() else 0.0
    ref_abs = ref.abs()
    max_rel = max_abs / max(float(ref_abs.max()), 1e-12) if ref.numel() else 0.0
    mean_rel = mean_abs / max(float(ref_abs.mean()), 1e-12) if ref.numel() else 0.0
    top1 = None
    if output_name == "logits":
        top1 = float((cand.argmax(-1) == ref.argmax(-1)).float().mean()) if ref.numel() else 1.0
    failures = []
    if nonfinite:
        failures.append(f"{fmt}: {nonfinite} non-finite output value(s)")
    limit = thresholds.get("max_abs_error")
    if limit is not None and max_abs > limit:
        failures.append(f"{fmt}: max abs error {max_abs:.4g} > max_abs_error={limit}")
    limit = thresholds.get("max_rel_error")
    if limit is not None and max_rel > limit:
        failures.append(f"{fmt}: max rel error {max_rel:.4g} > max_rel_error={limit}")
    limit = thresholds.get("min_top1_agreement")
    if limit is not None and top1 is not None and top1 < limit:
        failures.append(f"{fmt}: top-1 agreement {top1:.4f} < min_top1_agreement={limit}")
    return ParityResult(
        format=fmt,
        output=output_name,
        positions=int(ref.shape[0]) if ref.dim() else 1,
        max_abs_error=max_abs,
        mean_abs_error=mean_abs,
        max_rel_error=max_rel,
        mean_rel_error=mean_rel,
        top1_agreement=top1,
        nonfinite=nonfinite,
        passed=not failures,
        failures=tuple(failures),
    )


#: The top-1 agreement a verdict's sample size is judged against when the export checks none
#: (hidden-state outputs, ``min_top1_agreement=None`` or 1): the default threshold's.
_DEFAULT_TOP1 = 0.98


def positions_needed(min_top1_agreement: float | None) -> int:
    """How many compared positions can show a top-1 agreement of ``min_top1_agreement``.

    By the rule of three, no disagreement among ``n`` positions bounds the disagreement rate
    below ``3 / n`` at 95% confidence, so showing it is below ``1 - min_top1_agreement`` takes
    ``n >= 3 / (1 - min_top1_agreement)``: 150 positions for 0.98.
    """
    level = min_top1_agreement
    if level is None or not 0.0 < level < 1.0:
        level = _DEFAULT_TOP1
    return math.ceil(3.0 / (1.0 - level) - 1e-9)


def thin_evidence(
    results: Sequence[ParityResult],
    thresholds: Mapping[str, float | None],
    sample: str,
    users_data: bool,
) -> list[str]:
    """Why a parity verdict on ``results`` says little, one sentence per reason; ``[]`` if none.

    Two reasons: the batch is not the user's data (``sample`` says what it is), and fewer
    positions were compared than :func:`positions_needed` for the top-1 threshold in force.
    """
    reasons = []
    if not users_data:
        reasons.append(
            f"parity ran on {sample}, not on your data: pass texts from it (sample_texts=, "
            "--texts) or a batch of its inputs (sample_inputs=, --sample-inputs)"
        )
    if not results:
        return reasons
    positions = min(result.positions for result in results)
    top1 = thresholds.get("min_top1_agreement")
    needed = positions_needed(top1)
    if positions >= needed:
        return reasons
    checked = top1 is not None and 0.0 < top1 < 1.0
    if checked and all(result.top1_agreement is not None for result in results):
        bound = min(3.0 / positions, 1.0) if positions else 1.0
        reasons.append(
            f"{positions} positions compared: even with no top-1 disagreement among them, a "
            f"disagreement rate up to {bound:.0%} is not ruled out (95%), against the "
            f"{1.0 - top1:.0%} that min_top1_agreement={top1} allows; {needed} positions "
            "would rule it out"
        )
    else:
        reasons.append(
            f"{positions} positions compared, fewer than {needed}: the error figures come "
            "from a small sample"
        )
    return reasons
