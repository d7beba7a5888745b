"""The precision-mismatch meter's measurement: :func:`measure_precision_mismatch` on one batch,
its figures (:class:`MismatchStats`, :class:`MismatchReport`) and their table.

The checks and the measuring steps below that have public names are shared with
:class:`~amp_trainer.mismatch.callback.PrecisionMismatchCallback`, which measures a training
run's own batches with them; they are not part of the package's API (``__all__``).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from amp_trainer.forward_overflow import NonFiniteForwardError
from amp_trainer.mismatch.objective_clip import (
    check_advantages,
    objective_clipped,
    token_advantages,
)
from amp_trainer.mismatch.table import format_mismatch_table
from amp_trainer.numerics import OverflowProbe, describe_module
from amp_trainer.precision import PRECISIONS, without_autocast_wrapper

__all__ = [
    "FIGURES",
    "MismatchReport",
    "MismatchStats",
    "format_mismatch_table",
    "measure_precision_mismatch",
]

logger = logging.getLogger(__name__)

#: The figures a measurement reports per precision, as the callback's log keys name them
#: (``mismatch/<precision>/<figure>``; ``nonfinite`` is logged as 0 or 1).
FIGURES = ("mean_abs_logprob_diff", "max_abs_logprob_diff", "kl", "clip_rate", "nonfinite")
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
_IGNORE_INDEX = -100  # transformers' "not a target" label


@dataclass(frozen=True)
class MismatchStats:
    """One precision against FP32 on the same tokens.

    Attributes:
        precision: ``"fp16"``, ``"bf16"`` or ``"fp32"`` (FP32 re-run: the noise floor, exactly
            0 where the kernels are deterministic, as on a CPU).
        mean_abs_logprob_diff: mean over the scored tokens of ``|log p_prec - log p_fp32|``,
            the log-prob of each token under the position before it.
        max_abs_logprob_diff: the largest of those.
        kl: mean over the scored positions of ``KL(p_fp32 || p_prec)`` of the whole next-token
            distribution (nats).
        clip_rate: share of scored tokens whose ratio ``p_prec / p_fp32`` leaves the PPO/GRPO
            clip range ``[1 - clip_epsilon, 1 + clip_epsilon]`` on either side, whatever the
            advantage: tokens a clipped objective would treat as off-policy from rounding alone.
        tokens: how many tokens were scored.
        nonfinite: the precision's logits held inf/NaN at a scored position; the four figures
            are then NaN, not a mean over what was left.
        nonfinite_modules: the first module whose output went inf/NaN from finite inputs, when
            ``nonfinite`` (empty when none could be singled out).
        clip_epsilon: the ``epsilon`` of ``clip_rate``, and the lower bound's of
            ``objective_clip_rate``.
        objective_clip_rate: share of the scored tokens with an advantage that a clipped
            objective really clips from rounding alone: ratio above ``1 + clip_epsilon_high``
            with a positive advantage, below ``1 - clip_epsilon`` with a negative one (the rule
            of TRL's ``clip_ratio/region_mean``; :mod:`amp_trainer.mismatch.objective_clip`).
            NaN when no advantages were given.
        objective_tokens: how many scored tokens had an advantage (0: none given).
        clip_epsilon_high: the upper bound's epsilon of ``objective_clip_rate`` (clip-higher;
            ``None``: ``clip_epsilon``).
    """

    precision: str
    mean_abs_logprob_diff: float
    max_abs_logprob_diff: float
    kl: float
    clip_rate: float
    tokens: int
    nonfinite: bool = False
    nonfinite_modules: tuple[str, ...] = ()
    clip_epsilon: float = 0.2
    objective_clip_rate: float = math.nan
    objective_tokens: int = 0
    clip_epsilon_high: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able values (NaN figures become ``None`` in JSON writers that say so)."""
        data = asdict(self)
        data["nonfinite_modules"] = list(self.nonfinite_modules)
        if not self.objective_tokens:
            data["objective_clip_rate"] = None  # not measured (no advantages), not a NaN result
        return data

    def log_items(self) -> dict[str, float]:
        """``{"mismatch/<precision>/<figure>": value}`` for the Trainer's logs, with
        ``objective_clip_rate`` when advantages were measured."""
        names = FIGURES + (("objective_clip_rate",) if self.objective_tokens else ())
        return {f"mismatch/{self.precision}/{name}": float(getattr(self, name)) for name in names}


class MismatchReport(dict[str, MismatchStats]):
    """``{precision: MismatchStats}``, printed as a table (:func:`format_mismatch_table`)."""

    def __str__(self) -> str:
        return format_mismatch_table(self)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: stats.to_dict() for name, stats in self.items()}


# --------------------------------------------------------------------------------------------
# checks
# --------------------------------------------------------------------------------------------
def check_precisions(precisions: Any) -> tuple[str, ...]:
    if isinstance(precisions, str):
        precisions = (precisions,)
    try:
        names = tuple(precisions)
    except TypeError:
        raise TypeError(
            f"precisions must be a sequence of names from {PRECISIONS}, got {precisions!r}"
        ) from None
    if not names:
        raise ValueError(f"precisions is empty; give one or more of {PRECISIONS}")
    for name in names:
        if name not in PRECISIONS:
            raise ValueError(f"Unknown precision {name!r}; valid: {', '.join(PRECISIONS)}")
    return tuple(dict.fromkeys(names))


def check_number(name: str, value: Any, low: float, high: float) -> float:
    """``value`` as a float in the open interval ``(low, high)``, else ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not low < float(value) < high:
        raise ValueError(f"{name}={value!r} is outside ({low:g}, {high:g})")
    return float(value)


def check_batch_size(batch_size: Any) -> int | None:
    if batch_size is None:
        return None
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be None or an integer >= 1, got {batch_size!r}")
    return batch_size


def check_fp32_parameters(model: nn.Module) -> None:
    """The FP32 reference and the autocast forwards all compute from the model's weights as
    they are: weights stored in FP16/BF16 would make the "FP32" forward a low-precision one."""
    for name, param in model.named_parameters():
        if param.is_floating_point() and param.dtype != torch.float32:
            dtype = str(param.dtype).removeprefix("torch.")
            raise ValueError(
                f"The precision-mismatch meter needs float32 parameters (its reference is an FP32 "
                f"forward of the same weights); {name!r} is {dtype}. Load the model with "
                "dtype=torch.float32 (mixed-precision training keeps FP32 master weights anyway), "
                "or measure a float32 copy: copy.deepcopy(model).float()."
            )


def check_causal_lm(model: nn.Module) -> None:
    name = type(model).__name__
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"{name} is an encoder-decoder model; the precision-mismatch meter needs a causal "
            "(decoder-only) language model, e.g. a ...ForCausalLM or ...LMHeadModel"
        )
    can_generate = getattr(model, "can_generate", None)
    if callable(can_generate) and not can_generate():
        raise ValueError(
            f"{name} is not a causal language model (it cannot generate); the "
            "precision-mismatch meter needs next-token logits, e.g. from a ...ForCausalLM or "
            "...LMHeadModel"
        )


def _check_tokens(
    input_ids: Any, attention_mask: Any, labels: Any
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
    if input_ids.dim() != 2 or input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise ValueError(
            f"input_ids must be a 2-D integer tensor (batch, sequence), got shape "
            f"{tuple(input_ids.shape)} of {str(input_ids.dtype).removeprefix('torch.')}"
        )
    if input_ids.shape[0] < 1 or input_ids.shape[1] < 2:
        raise ValueError(
            f"input_ids of shape {tuple(input_ids.shape)} holds no next token to score: it needs "
            "at least one row and two positions"
        )
    for name, tensor in (("attention_mask", attention_mask), ("labels", labels)):
        if tensor is None:
            continue
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(tensor).__name__}")
        if tuple(tensor.shape) != tuple(input_ids.shape):
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)}; it must match input_ids' "
                f"{tuple(input_ids.shape)}"
            )
    if attention_mask is not None and not bool((attention_mask.eq(0) | attention_mask.eq(1)).all()):
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (a token)")
    if labels is not None and (labels.dtype.is_floating_point or labels.dtype == torch.bool):
        raise ValueError(
            f"labels must be integer token ids (-100: not scored), got "
            f"{str(labels.dtype).removeprefix('torch.')}"
        )
    return input_ids, attention_mask, labels


def scored(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None, labels: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(valid, targets)``, both ``(batch, sequence - 1)``: whether the token at ``t + 1`` is
    scored under position ``t``, and which token that is.

    Both positions must be attended (the position after left padding predicts from nothing);
    with ``labels``, only tokens whose label is not -100 count, and the label is the target, as
    a causal LM's loss reads it.
    """
    targets = (input_ids if labels is None else labels)[:, 1:]
    valid = torch.ones_like(targets, dtype=torch.bool)
    if attention_mask is not None:
        attended = attention_mask.bool()
        valid = attended[:, 1:] & attended[:, :-1]
    if labels is not None:
        valid = valid & (targets != _IGNORE_INDEX)
    return valid, targets


# --------------------------------------------------------------------------------------------
# measuring
# --------------------------------------------------------------------------------------------
class Tally:
    """Running sums of one precision's figures over chunks, micro-batches and steps."""

    def __init__(self) -> None:
        self.abs_sum = 0.0
        self.abs_max = 0.0
        self.kl_sum = 0.0
        self.clipped = 0
        self.tokens = 0
        self.objective_clipped = 0
        self.objective_tokens = 0
        self.nonfinite = False
        self.modules: list[str] = []

    def add(self, other: Tally) -> None:
        self.abs_sum += other.abs_sum
        self.abs_max = max(self.abs_max, other.abs_max)
        self.kl_sum += other.kl_sum
        self.clipped += other.clipped
        self.tokens += other.tokens
        self.objective_clipped += other.objective_clipped
        self.objective_tokens += other.objective_tokens
        self.nonfinite = self.nonfinite or other.nonfinite
        self.modules += [name for name in other.modules if name not in self.modules]

    def stats(
        self,
        precision: str,
        clip_epsilon: float,
        *,
        clip_epsilon_high: float | None = None,
        finite_part: bool = False,
    ) -> MismatchStats:
        """The figures; NaN when non-finite, unless ``finite_part`` (a run's summary, whose
        non-finite steps are flagged and counted separately) asks for the rest."""
        blank = self.nonfinite and not finite_part
        objective = math.nan
        if blank or not self.tokens:
            mean = top = kl = clip = math.nan
        else:
            mean, top = self.abs_sum / self.tokens, self.abs_max
            kl, clip = self.kl_sum / self.tokens, self.clipped / self.tokens
            if self.objective_tokens:
                objective = self.objective_clipped / self.objective_tokens
        return MismatchStats(
            precision=precision,
            mean_abs_logprob_diff=mean,
            max_abs_logprob_diff=top,
            kl=kl,
            clip_rate=clip,
            tokens=self.tokens,
            nonfinite=self.nonfinite,
            nonfinite_modules=tuple(self.modules),
            clip_epsilon=clip_epsilon,
            objective_clip_rate=objective,
            objective_tokens=self.objective_tokens,
            clip_epsilon_high=clip_epsilon_high,
        )


def device_of(model: nn.Module) -> torch.device:
    for param in model.parameters():
        return param.device
    for buffer in model.buffers():
        return buffer.device
    return torch.device("cpu")


def check_device_runs(precision: str, device: torch.device) -> None:
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError(
            f"precision 'bf16' cannot run on {device} ({torch.cuda.get_device_name(device)}): it "
            "has no bf16 support; measure 'fp16' (and 'fp32') there"
        )


@contextlib.contextmanager
def measuring(model: nn.Module, device: torch.device) -> Iterator[None]:
    """No grad, eval mode, the model's own forward, the RNG streams forked; all put back.

    Eval mode because the figure is the deterministic policy's: dropout noise would dwarf the
    rounding being measured. Each module's ``training`` flag is restored as it was (a model
    with some submodules frozen in eval mode keeps them so), and the RNG is forked so that a
    training run's later dropout masks and samples are those it would have drawn anyway.
    """
    modes = [(module, module.training) for module in model.modules()]
    devices = []
    if device.type == "cuda":
        devices = [torch.cuda.current_device() if device.index is None else device.index]
    try:
        with (
            torch.random.fork_rng(devices=devices),
            torch.no_grad(),
            without_autocast_wrapper(model),
        ):
            model.eval()
            yield
    finally:
        for module, training in modes:
            module.training = training


@contextlib.contextmanager
def _precision_context(precision: str, device_type: str) -> Iterator[None]:
    if precision == "fp32":
        # The reference is true FP32: no autocast a caller may be inside, no TF32 matmuls.
        matmul = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")
        try:
            with torch.autocast(device_type, enabled=False):
                yield
        finally:
            torch.set_float32_matmul_precision(matmul)
    else:
        with torch.autocast(device_type, dtype=_DTYPES[precision]):
            yield


def forward_keywords(model: nn.Module) -> set[str]:
    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


def _logits(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    keep: int,
    keywords: set[str],
) -> torch.Tensor:
    """The model's logits for the last ``keep`` positions, as a (rows, keep, vocab) tensor."""
    kwargs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask}
    if "use_cache" in keywords:
        kwargs["use_cache"] = False
    if "logits_to_keep" in keywords and keep < input_ids.shape[1]:
        kwargs["logits_to_keep"] = keep  # the LM head only where a scored token is predicted
    output = model(**kwargs)
    logits = output if isinstance(output, torch.Tensor) else getattr(output, "logits", None)
    if logits is None and isinstance(output, (tuple, list)) and output:
        logits = output[0]
    rows, length = input_ids.shape
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or logits.shape[0] != rows:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(output).__name__
        raise ValueError(
            f"{type(model).__name__} returned logits of shape {shape} for input_ids of shape "
            f"({rows}, {length}); the precision-mismatch meter needs a causal language model's "
            "next-token logits (batch, sequence, vocabulary), e.g. from a ...ForCausalLM"
        )
    if logits.shape[1] < keep:
        raise ValueError(
            f"{type(model).__name__} returned logits for {logits.shape[1]} positions of "
            f"{length}; a causal language model returns one per position"
        )
    return logits[:, -keep:]


def _first_nonfinite_module(
    model: nn.Module,
    precision: str,
    device_type: str,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    keep: int,
    keywords: set[str],
) -> str | None:
    """Re-run one chunk with :class:`OverflowProbe`'s hooks: which module went inf/NaN first.

    Only on a non-finite chunk: the hooks sync on every module's output."""
    with OverflowProbe(model, limit=math.inf) as probe, _precision_context(precision, device_type):
        _logits(model, input_ids, attention_mask, keep, keywords)
    return probe.first


def _log_softmax_at(
    logits: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, temperature: float
) -> torch.Tensor:
    """Log-probs at the scored positions, from the logits as the model returned them.

    The logits of an autocast forward come out rounded to FP16/BF16; that rounding is part of
    what is measured. The softmax itself is taken in float64: an FP32 one normalises only to
    ~1e-7, an offset that would swamp an FP16 KL of ~1e-8 (and turn it negative)."""
    picked = logits[rows, cols].double()
    if temperature != 1.0:
        picked = picked / temperature
    return torch.log_softmax(picked, dim=-1)


def measure_batch(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    labels: torch.Tensor | None,
    precisions: tuple[str, ...],
    *,
    clip_epsilon: float,
    temperature: float,
    batch_size: int | None,
    device: torch.device,
    keywords: set[str],
    advantages: torch.Tensor | None = None,
    clip_epsilon_high: float | None = None,
) -> dict[str, Tally]:
    """Tallies of one batch, ``batch_size`` rows per forward (already inside :func:`measuring`).

    ``advantages``: one per scored position, ``(batch, sequence - 1)``, NaN where a token has
    none (:func:`~amp_trainer.mismatch.objective_clip.token_advantages`)."""
    tallies = {precision: Tally() for precision in precisions}
    device_type = device.type
    input_ids = input_ids.to(device)
    mask = (
        torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(device).long()
    )
    labels = None if labels is None else labels.to(device)
    valid, targets = scored(input_ids, mask, labels)
    step = batch_size or input_ids.shape[0]
    low, high = math.log1p(-clip_epsilon), math.log1p(clip_epsilon)
    for start in range(0, input_ids.shape[0], step):
        chunk = slice(start, start + step)
        rows, cols = valid[chunk].nonzero(as_tuple=True)
        if rows.numel() == 0:
            continue
        ids, attended = input_ids[chunk], mask[chunk]
        length = ids.shape[1]
        first = int(cols.min())
        keep = length - first  # positions first..length-1 predict every scored token
        at = cols - first
        tokens = targets[chunk][rows, cols].unsqueeze(-1)
        token_advantage = None if advantages is None else advantages[chunk][rows, cols].to(device)
        known = 0 if token_advantage is None else int(torch.isfinite(token_advantage).sum())
        with _precision_context("fp32", device_type):
            reference = _logits(model, ids, attended, keep, keywords)
        if not bool(torch.isfinite(reference[rows, at]).all()):
            culprit = _first_nonfinite_module(
                model, "fp32", device_type, ids, attended, keep, keywords
            )
            where = describe_module(model, culprit) if culprit else "no single module"
            raise NonFiniteForwardError(
                f"The FP32 reference forward of {type(model).__name__} is non-finite (first "
                f"module to produce inf/NaN: {where}): the model's weights or arithmetic, not "
                "the precision, so there is nothing to measure the precisions against."
            )
        vocabulary = reference.shape[-1]
        if int(tokens.min()) < 0 or int(tokens.max()) >= vocabulary:
            bad = int(tokens.min()) if int(tokens.min()) < 0 else int(tokens.max())
            raise ValueError(
                f"token id {bad} is outside the model's vocabulary [0, {vocabulary - 1}] "
                "(labels: -100 marks a token that is not scored)"
            )
        ref_logp = _log_softmax_at(reference, rows, at, temperature)
        del reference
        ref_token = ref_logp.gather(-1, tokens).squeeze(-1)
        ref_p = ref_logp.exp()
        for precision in precisions:
            tally = tallies[precision]
            with _precision_context(precision, device_type):
                logits = _logits(model, ids, attended, keep, keywords)
            picked = logits[rows, at]
            if not bool(torch.isfinite(picked).all()):
                tally.nonfinite = True
                tally.tokens += int(rows.numel())
                tally.objective_tokens += known
                culprit = _first_nonfinite_module(
                    model, precision, device_type, ids, attended, keep, keywords
                )
                if culprit is not None and culprit not in tally.modules:
                    tally.modules.append(culprit)
                continue
            logp = _log_softmax_at(logits, rows, at, temperature)
            del logits, picked
            delta = logp.gather(-1, tokens).squeeze(-1) - ref_token  # log(p_prec / p_fp32)
            kl = torch.where(ref_p > 0, ref_p * (ref_logp - logp), 0.0).sum(-1)
            tally.abs_sum += float(delta.abs().sum())
            tally.abs_max = max(tally.abs_max, float(delta.abs().max()))
            tally.kl_sum += float(kl.sum())
            tally.clipped += int(((delta < low) | (delta > high)).sum())
            tally.tokens += int(rows.numel())
            if token_advantage is not None:
                high_epsilon = clip_epsilon if clip_epsilon_high is None else clip_epsilon_high
                clipped = objective_clipped(delta, token_advantage, clip_epsilon, high_epsilon)
                tally.objective_clipped += int(clipped.sum())
                tally.objective_tokens += known
    return tallies


def _prepare(
    model: Any,
    precisions: Any,
    clip_epsilon: Any,
    temperature: Any,
    batch_size: Any,
) -> tuple[tuple[str, ...], float, float, int | None, torch.device]:
    """Every argument check that needs no tokens: done before any forward."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    names = check_precisions(precisions)
    epsilon = check_number("clip_epsilon", clip_epsilon, 0.0, 1.0)
    temp = check_number("temperature", temperature, 0.0, math.inf)
    rows = check_batch_size(batch_size)
    check_causal_lm(model)
    check_fp32_parameters(model)
    device = device_of(model)
    for name in names:
        check_device_runs(name, device)
    return names, epsilon, temp, rows, device


def measure_precision_mismatch(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    precisions: Sequence[str] = ("fp16", "bf16"),
    clip_epsilon: float = 0.2,
    labels: torch.Tensor | None = None,
    temperature: float = 1.0,
    batch_size: int | None = None,
    advantages: torch.Tensor | None = None,
    clip_epsilon_high: float | None = None,
) -> MismatchReport:
    """How far each precision's token log-probs are from FP32's, on the same model and tokens.

    One FP32 forward is the reference; each precision is one forward under
    ``torch.autocast`` (FP16 or BF16, on whatever device the model is on: CPU or CUDA), with
    the model's FP32 islands (norms kept in FP32, ``fp32_modules``) computing in FP32 as they do
    in training. ``"fp32"`` is a second FP32 forward: exactly 0 where the kernels are
    deterministic. The token at ``t + 1`` is scored by its log-prob under position ``t``.

    The forwards run in eval mode (no dropout) without gradients, bypassing the autocast
    wrapper Accelerate puts on a prepared model; the model's per-module training flags, its
    parameters and dtypes, and the RNG streams are as they were afterwards.

    Args:
        model: a causal language model (``...ForCausalLM``; a PEFT model around one) with
            float32 parameters. Anything ``from_pretrained`` loads in float32 works.
        input_ids: ``(batch, sequence)`` token ids.
        attention_mask: 1 for a token, 0 for padding (left or right); padding is never scored,
            nor the first token after left padding (nothing predicts it).
        precisions: which of ``"fp16"``, ``"bf16"``, ``"fp32"`` to measure.
        clip_epsilon: the PPO/GRPO clip range ``[1 - eps, 1 + eps]`` of ``clip_rate``.
        labels: the tokens to score, written as a causal LM's ``labels`` (-100: not scored,
            e.g. a prompt); default every attended token after the first of its row.
        temperature: the logits are divided by it before the softmax, as a sampler at that
            temperature (and GRPO's loss) do.
        batch_size: rows per forward (default: the whole batch at once); bounds the memory
            of the logits, which are ``rows x positions x vocabulary``.
        advantages: the PPO/GRPO advantages of the tokens, for ``objective_clip_rate``:
            ``(batch,)``, one per row (GRPO's), or ``(batch, T)``, one per token of the last
            ``T`` positions. Default none: ``objective_clip_rate`` is NaN.
        clip_epsilon_high: the upper bound's epsilon of ``objective_clip_rate`` (TRL's
            ``epsilon_high``, clip-higher); default ``clip_epsilon``.

    Returns:
        ``{precision: MismatchStats}`` in the order asked for (a :class:`MismatchReport`:
        ``print`` it for the table).

    Raises:
        ValueError: an unknown precision, tensors of the wrong shape or kind, a model that is
            not a causal LM or whose parameters are not float32, no token to score.
        NonFiniteForwardError: the FP32 reference itself is inf/NaN (the model, not the
            precision; the first module to go non-finite is named).
    """
    names, epsilon, temp, rows, device = _prepare(
        model, precisions, clip_epsilon, temperature, batch_size
    )
    input_ids, attention_mask, labels = _check_tokens(input_ids, attention_mask, labels)
    advantages = check_advantages(advantages, input_ids)
    high = (
        None
        if clip_epsilon_high is None
        else check_number("clip_epsilon_high", clip_epsilon_high, 0.0, math.inf)
    )
    valid, _ = scored(input_ids, attention_mask, labels)
    if not bool(valid.any()):
        raise ValueError(
            "no token to score: every row has fewer than two attended tokens"
            + (" whose label is not -100" if labels is not None else "")
        )
    with measuring(model, device):
        keywords = forward_keywords(model)
        tallies = measure_batch(
            model,
            input_ids,
            attention_mask,
            labels,
            names,
            clip_epsilon=epsilon,
            temperature=temp,
            batch_size=rows,
            device=device,
            keywords=keywords,
            advantages=None
            if advantages is None
            else token_advantages(advantages, input_ids.shape[1]),
            clip_epsilon_high=high,
        )
    return MismatchReport(
        (name, tallies[name].stats(name, epsilon, clip_epsilon_high=high)) for name in names
    )
