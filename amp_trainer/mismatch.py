"""The precision-mismatch meter: how far FP16 and BF16 token log-probs are from FP32.

RL fine-tuning (PPO, GRPO) divides the trained policy's probability of each sampled token by the
probability the sampler gave it. When both run the same weights in a low precision, rounding
alone moves that ratio off 1: BF16 keeps 7 mantissa bits, FP16 10, so BF16's log-probs sit
several times further from the exact ones (arXiv 2510.26788 reports up to ~24x less mismatch in
FP16). This module measures that part of the rollout/train gap and nothing else: the same model,
the same tokens, one forward in FP32 and one per precision under autocast.

* :func:`measure_precision_mismatch` answers for one batch, e.g. before choosing a precision
  for a run or a rollout engine (``amp-trainer mismatch`` is its command line).
* :class:`PrecisionMismatchCallback` measures a training run's own completions every N steps,
  in the run's precision and the alternative one, and logs ``mismatch/<precision>/<figure>``
  with the Trainer's logs.

Example::

    stats = measure_precision_mismatch(model, input_ids, attention_mask)
    print(stats)  # the table
    stats["bf16"].mean_abs_logprob_diff / stats["fp16"].mean_abs_logprob_diff  # ~8 here

A precision whose logits come out inf/NaN is reported as such (``nonfinite``), with the module
that overflowed first named (:class:`~amp_trainer.numerics.OverflowProbe`), and its figures are
NaN: a mean over the finite tokens would hide exactly the tokens that matter.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback

from amp_trainer.forward_overflow import NonFiniteForwardError
from amp_trainer.numerics import OverflowProbe, describe_module, describe_names
from amp_trainer.precision import PRECISIONS, without_autocast_wrapper

__all__ = [
    "FIGURES",
    "MismatchReport",
    "MismatchStats",
    "PrecisionMismatchCallback",
    "format_mismatch_table",
    "measure_precision_mismatch",
]

logger = logging.getLogger(__name__)

#: The figures a measurement reports per precision, as the callback's log keys name them
#: (``mismatch/<precision>/<figure>``; ``nonfinite`` is logged as 0 or 1).
FIGURES = ("mean_abs_logprob_diff", "max_abs_logprob_diff", "kl", "clip_rate", "nonfinite")
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
_IGNORE_INDEX = -100  # transformers' "not a target" label
# Forward keywords of a captured training batch that the meter cannot reproduce (the image or
# embedding inputs of a multimodal or soft-prompt model): such a batch is not measured.
_TEXT_ONLY = ("pixel_values", "inputs_embeds", "input_features", "input_values")


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
            clip range ``[1 - clip_epsilon, 1 + clip_epsilon]``: tokens a clipped objective
            would treat as off-policy from rounding alone.
        tokens: how many tokens were scored.
        nonfinite: the precision's logits held inf/NaN at a scored position; the four figures
            are then NaN, not a mean over what was left.
        nonfinite_modules: the first module whose output went inf/NaN from finite inputs, when
            ``nonfinite`` (empty when none could be singled out).
        clip_epsilon: the ``epsilon`` of ``clip_rate``.
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

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able values (NaN figures become ``None`` in JSON writers that say so)."""
        data = asdict(self)
        data["nonfinite_modules"] = list(self.nonfinite_modules)
        return data

    def log_items(self) -> dict[str, float]:
        """``{"mismatch/<precision>/<figure>": value}`` for the Trainer's logs."""
        return {f"mismatch/{self.precision}/{name}": float(getattr(self, name)) for name in FIGURES}


class MismatchReport(dict[str, MismatchStats]):
    """``{precision: MismatchStats}``, printed as a table (:func:`format_mismatch_table`)."""

    def __str__(self) -> str:
        return format_mismatch_table(self)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: stats.to_dict() for name, stats in self.items()}


# --------------------------------------------------------------------------------------------
# checks
# --------------------------------------------------------------------------------------------
def _check_precisions(precisions: Any) -> tuple[str, ...]:
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


def _check_number(name: str, value: Any, low: float, high: float) -> float:
    """``value`` as a float in the open interval ``(low, high)``, else ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not low < float(value) < high:
        raise ValueError(f"{name}={value!r} is outside ({low:g}, {high:g})")
    return float(value)


def _check_batch_size(batch_size: Any) -> int | None:
    if batch_size is None:
        return None
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be None or an integer >= 1, got {batch_size!r}")
    return batch_size


def _check_fp32_parameters(model: nn.Module) -> None:
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


def _check_causal_lm(model: nn.Module) -> None:
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


def _scored(
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
class _Tally:
    """Running sums of one precision's figures over chunks, micro-batches and steps."""

    def __init__(self) -> None:
        self.abs_sum = 0.0
        self.abs_max = 0.0
        self.kl_sum = 0.0
        self.clipped = 0
        self.tokens = 0
        self.nonfinite = False
        self.modules: list[str] = []

    def add(self, other: _Tally) -> None:
        self.abs_sum += other.abs_sum
        self.abs_max = max(self.abs_max, other.abs_max)
        self.kl_sum += other.kl_sum
        self.clipped += other.clipped
        self.tokens += other.tokens
        self.nonfinite = self.nonfinite or other.nonfinite
        self.modules += [name for name in other.modules if name not in self.modules]

    def stats(
        self, precision: str, clip_epsilon: float, *, finite_part: bool = False
    ) -> MismatchStats:
        """The figures; NaN when non-finite, unless ``finite_part`` (a run's summary, whose
        non-finite steps are flagged and counted separately) asks for the rest."""
        blank = self.nonfinite and not finite_part
        if blank or not self.tokens:
            mean = top = kl = clip = math.nan
        else:
            mean, top = self.abs_sum / self.tokens, self.abs_max
            kl, clip = self.kl_sum / self.tokens, self.clipped / self.tokens
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
        )


def _device_of(model: nn.Module) -> torch.device:
    for param in model.parameters():
        return param.device
    for buffer in model.buffers():
        return buffer.device
    return torch.device("cpu")


def _check_device_runs(precision: str, device: torch.device) -> None:
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError(
            f"precision 'bf16' cannot run on {device} ({torch.cuda.get_device_name(device)}): it "
            "has no bf16 support; measure 'fp16' (and 'fp32') there"
        )


@contextlib.contextmanager
def _measuring(model: nn.Module, device: torch.device) -> Iterator[None]:
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


def _forward_keywords(model: nn.Module) -> set[str]:
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


def _measure_batch(
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
) -> dict[str, _Tally]:
    """Tallies of one batch, ``batch_size`` rows per forward (already inside :func:`_measuring`)."""
    tallies = {precision: _Tally() for precision in precisions}
    device_type = device.type
    input_ids = input_ids.to(device)
    mask = (
        torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(device).long()
    )
    labels = None if labels is None else labels.to(device)
    valid, targets = _scored(input_ids, mask, labels)
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
    names = _check_precisions(precisions)
    epsilon = _check_number("clip_epsilon", clip_epsilon, 0.0, 1.0)
    temp = _check_number("temperature", temperature, 0.0, math.inf)
    rows = _check_batch_size(batch_size)
    _check_causal_lm(model)
    _check_fp32_parameters(model)
    device = _device_of(model)
    for name in names:
        _check_device_runs(name, device)
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
    valid, _ = _scored(input_ids, attention_mask, labels)
    if not bool(valid.any()):
        raise ValueError(
            "no token to score: every row has fewer than two attended tokens"
            + (" whose label is not -100" if labels is not None else "")
        )
    with _measuring(model, device):
        keywords = _forward_keywords(model)
        tallies = _measure_batch(
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
        )
    return MismatchReport((name, tallies[name].stats(name, epsilon)) for name in names)


# --------------------------------------------------------------------------------------------
# reporting
# --------------------------------------------------------------------------------------------
def _cell(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.3g}"


def format_mismatch_table(
    stats: Mapping[str, MismatchStats], title: str = "", *, notes: Sequence[str] = ()
) -> str:
    """A text table, one row per precision, then the BF16/FP16 ratio and what is non-finite."""
    epsilon = next(iter(stats.values())).clip_epsilon if stats else 0.2
    header = (
        "precision",
        "tokens",
        "mean |d logp|",
        "max |d logp|",
        "KL(fp32||p)",
        f"clip rate (eps={epsilon:g})",
    )
    rows = [
        (
            name,
            str(s.tokens),
            _cell(s.mean_abs_logprob_diff),
            _cell(s.max_abs_logprob_diff),
            _cell(s.kl),
            _cell(s.clip_rate),
        )
        for name, s in stats.items()
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    rule = "+" + "+".join("-" * (w + 2) for w in widths) + "+"

    def line(cells: Sequence[str]) -> str:
        first = f" {cells[0]:<{widths[0]}} "
        rest = [f" {cell:>{width}} " for cell, width in zip(cells[1:], widths[1:], strict=True)]
        return "|" + "|".join([first, *rest]) + "|"

    lines = [title] if title else []
    lines += [rule, line(header), rule, *(line(row) for row in rows), rule]
    fp16, bf16 = stats.get("fp16"), stats.get("bf16")
    if fp16 and bf16 and not (fp16.nonfinite or bf16.nonfinite) and fp16.mean_abs_logprob_diff:
        ratio = bf16.mean_abs_logprob_diff / fp16.mean_abs_logprob_diff
        line_text = f"bf16/fp16: {ratio:.3g}x the mean |d logp|"
        if fp16.kl > 0:
            line_text += f", {bf16.kl / fp16.kl:.3g}x the KL"
        lines.append(line_text)
    for name, s in stats.items():
        if s.nonfinite:
            where = describe_names([repr(m) for m in s.nonfinite_modules]) or "no single module"
            lines.append(
                f"{name}: non-finite logits (first module to overflow: {where}); keep that module "
                f"in FP32 (fp32_modules) or use another precision"
            )
    lines += list(notes)
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# the training callback
# --------------------------------------------------------------------------------------------
def _run_precision(trainer: Any, args: Any) -> str:
    """The precision a trainer runs: AmpTrainerMixin's resolved one, else the stock flags."""
    precision = getattr(trainer, "precision", None)
    if precision in PRECISIONS:
        return str(precision)
    if getattr(args, "fp16", False):
        return "fp16"
    return "bf16" if getattr(args, "bf16", False) else "fp32"


class PrecisionMismatchCallback(TrainerCallback):
    """Measure a training run's own completions against FP32 every ``every_n_steps`` steps.

    On a sampled optimizer step the callback keeps references to the tokens of that step's
    training forwards (a forward pre-hook on the trained model that only records, and only
    while the model trains with gradients: generation and reference-model forwards run without
    them), and at the step's end measures them with :func:`measure_precision_mismatch`: the
    tokens the loss scores (``labels`` not -100 when the forward is given labels, as TRL's
    GRPOTrainer gives them for the completion; every attended token otherwise), at GRPO's
    ``temperature`` when the arguments have one. The figures go into the step's log, or the
    next training log, as ``mismatch/<precision>/<figure>`` (see :data:`FIGURES`), so
    ``state.log_history``, TensorBoard and W&B get them; ``history`` holds each measured step,
    ``summary`` the whole run, logged as a table when training ends.

    The measurement is invisible to training: no gradients, eval mode for its own forwards
    only, RNG streams forked; a run with the callback ends with the parameters of the run
    without it, bit for bit (``tests/precision/test_precision_mismatch.py``). It costs three
    forwards of the step's batch (FP32 and two precisions) every ``every_n_steps`` steps.

    Why a hook on the model and not the batch: Trainer hands callbacks no batch, and TRL's
    GRPOTrainer builds its completions inside ``training_step``; the model's forward is the one
    place every Trainer shows its tokens. Why ``attach``: a callback is handed no trainer either,
    and logging into the step's log needs the callback to come before the reporting
    integrations' (TensorBoard, W&B) in the trainer's list. :class:`~amp_trainer.AmpTrainerMixin`
    trainers attach the ones passed in ``callbacks=`` themselves; with any other Trainer::

        trainer = GRPOTrainer(...)
        PrecisionMismatchCallback(every_n_steps=10).attach(trainer)

    Args:
        every_n_steps: measure the optimizer steps whose number is a multiple of it.
        precisions: what to measure; default the run's precision and the alternative one
            (``("fp16", "bf16")`` for an fp16 run, ``("bf16", "fp16")`` for bf16, both for
            fp32), leaving out one the device cannot run (bf16 on a GPU without it).
        clip_epsilon: the clip range of ``clip_rate``; default the run's ``epsilon`` (GRPO's),
            else 0.2.
        batch_size: rows per measuring forward (default: each training forward's batch).

    The figures are the local process's batch (each rank measures its own).
    """

    def __init__(
        self,
        every_n_steps: int = 10,
        precisions: Sequence[str] | None = None,
        *,
        clip_epsilon: float | None = None,
        batch_size: int | None = None,
    ) -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int):
            raise TypeError(f"every_n_steps must be an integer >= 1, got {every_n_steps!r}")
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be an integer >= 1, got {every_n_steps!r}")
        self.every_n_steps = every_n_steps
        self.precisions = None if precisions is None else _check_precisions(precisions)
        self.clip_epsilon = (
            None if clip_epsilon is None else _check_number("clip_epsilon", clip_epsilon, 0.0, 1.0)
        )
        self.batch_size = _check_batch_size(batch_size)
        #: ``{"step": n, precision: MismatchStats, ...}`` for every measured step.
        self.history: list[dict[str, Any]] = []
        self._trainer: Any = None
        self._handle: Any = None
        self._recording = False
        self._captured: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = []
        self._pending: dict[str, float] = {}
        self._run: dict[str, _Tally] = {}
        self._nonfinite_steps: dict[str, list[int]] = {}
        self._active: tuple[str, ...] = ()
        self._epsilon = 0.2
        self._temperature = 1.0
        self._warned: set[str] = set()

    # -- wiring ------------------------------------------------------------------------------
    def attach(self, trainer: Any) -> PrecisionMismatchCallback:
        """Bind to ``trainer`` and put this callback first in its callback list (added if not
        there), so that the figures are in each log before any integration reports it."""
        callbacks = trainer.callback_handler.callbacks
        if self in callbacks:
            callbacks.remove(self)
        callbacks.insert(0, self)
        self._trainer = trainer
        return self

    def on_train_begin(self, args, state, control, **kwargs):
        trainer = self._trainer
        if trainer is None:
            raise RuntimeError(
                "PrecisionMismatchCallback is not attached to its trainer, so its figures could "
                "not reach the logs: call PrecisionMismatchCallback(...).attach(trainer) instead "
                "of passing it in callbacks= (AmpTrainerMixin trainers attach it themselves)."
            )
        model = trainer.model
        _check_causal_lm(model)
        _check_fp32_parameters(model)
        device = _device_of(model)
        run = _run_precision(trainer, args)
        if self.precisions is not None:
            for name in self.precisions:
                _check_device_runs(name, device)
            self._active = self.precisions
        else:
            wanted = {"fp16": ("fp16", "bf16"), "bf16": ("bf16", "fp16")}.get(run, ("fp16", "bf16"))
            self._active = tuple(p for p in wanted if self._runs_on(p, device))
        epsilon = self.clip_epsilon
        if epsilon is None:
            run_epsilon = getattr(args, "epsilon", None)  # GRPO's (and PPO's) clip range
            epsilon = run_epsilon if isinstance(run_epsilon, float) and 0 < run_epsilon < 1 else 0.2
        self._epsilon = float(epsilon)
        temperature = getattr(args, "temperature", None)
        self._temperature = (
            float(temperature) if isinstance(temperature, (int, float)) and temperature > 0 else 1.0
        )
        self.history = []
        self._run = {p: _Tally() for p in self._active}
        self._nonfinite_steps = {p: [] for p in self._active}
        self._pending = {}
        self._remove_hook()
        self._handle = model.register_forward_pre_hook(self._capture, with_kwargs=True)
        logger.info(
            "Precision mismatch: measuring %s against FP32 every %d step(s) (run: %s)",
            ", ".join(self._active),
            self.every_n_steps,
            run,
        )

    @staticmethod
    def _runs_on(precision: str, device: torch.device) -> bool:
        try:
            _check_device_runs(precision, device)
        except ValueError as err:
            logger.warning("Precision mismatch: not measuring %s: %s", precision, err)
            return False
        return True

    def _capture(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook: keep references to a training forward's tokens (no copy, no sync)."""
        if not (self._recording and module.training and torch.is_grad_enabled()):
            return
        if any(kwargs.get(name) is not None for name in _TEXT_ONLY):
            self._warn_once(
                "inputs",
                "a training forward carries image/embedding inputs, which the meter cannot "
                "reproduce: such batches are not measured",
            )
            return
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            return
        attention_mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        labels = kwargs.get("labels")
        self._captured.append(
            (
                input_ids,
                attention_mask if isinstance(attention_mask, torch.Tensor) else None,
                labels if isinstance(labels, torch.Tensor) else None,
            )
        )

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning("Precision mismatch: %s.", message)

    def _remove_hook(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    # -- per step ----------------------------------------------------------------------------
    def on_step_begin(self, args, state, control, **kwargs):
        self._captured = []
        self._recording = (state.global_step + 1) % self.every_n_steps == 0

    def on_step_end(self, args, state, control, **kwargs):
        if not self._recording:
            return
        self._recording = False
        batches, self._captured = self._captured, []
        if not batches:
            self._warn_once(
                "no-batch",
                f"step {state.global_step} had no training forward with input_ids to measure",
            )
            return
        step_stats = self._measure(batches)
        if step_stats is None:
            return
        self.history.append({"step": state.global_step, **step_stats})
        for name, stats in step_stats.items():
            self._pending.update(stats.log_items())
            if stats.nonfinite:
                self._nonfinite_steps[name].append(state.global_step)
                where = describe_names([repr(m) for m in stats.nonfinite_modules])
                logger.warning(
                    "Precision mismatch at step %d: %s logits are non-finite (first module to "
                    "overflow: %s)",
                    state.global_step,
                    name,
                    where or "no single module",
                )

    def _measure(self, batches: list[tuple[Any, Any, Any]]) -> dict[str, MismatchStats] | None:
        model = self._trainer.model
        device = _device_of(model)
        step = {name: _Tally() for name in self._active}
        with _measuring(model, device):
            keywords = _forward_keywords(model)
            for input_ids, attention_mask, labels in batches:
                valid, _ = _scored(input_ids, attention_mask, labels)
                if not bool(valid.any()):
                    continue
                tallies = _measure_batch(
                    model,
                    input_ids,
                    attention_mask,
                    labels,
                    self._active,
                    clip_epsilon=self._epsilon,
                    temperature=self._temperature,
                    batch_size=self.batch_size,
                    device=device,
                    keywords=keywords,
                )
                for name, tally in tallies.items():
                    step[name].add(tally)
        if not any(tally.tokens for tally in step.values()):
            return None
        for name, tally in step.items():
            self._run[name].add(tally)
        return {name: tally.stats(name, self._epsilon) for name, tally in step.items()}

    def on_log(self, args, state, control, logs=None, **kwargs):
        """Put the pending figures into this log (a training log, not an evaluation's)."""
        if not self._pending or logs is None or any(k.startswith("eval_") for k in logs):
            return
        logs.update(self._pending)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(self._pending)  # Trainer.log appended a copy of logs
        self._pending = {}

    def on_train_end(self, args, state, control, **kwargs):
        self._remove_hook()
        self._recording = False
        self._captured = []
        if self.history:
            logger.info("%s", self.format_summary())

    # -- the run's summary -------------------------------------------------------------------
    @property
    def summary(self) -> MismatchReport:
        """Every measured step of the last ``train()`` together, per precision: token-weighted
        means, the largest difference. A precision non-finite on some steps is flagged
        (``nonfinite``, the modules named) and its figures cover its finite steps."""
        return MismatchReport(
            (name, tally.stats(name, self._epsilon, finite_part=True))
            for name, tally in self._run.items()
            if tally.tokens
        )

    def format_summary(self) -> str:
        """The run's summary as a table, with the steps whose logits were non-finite."""
        steps = [entry["step"] for entry in self.history]
        notes = [
            f"{name}: non-finite on step(s) {', '.join(map(str, bad))}; figures cover the rest"
            for name, bad in self._nonfinite_steps.items()
            if bad
        ]
        title = (
            f"Precision mismatch against FP32, {len(steps)} measured step(s) "
            f"({steps[0]}..{steps[-1]}, every {self.every_n_steps}):"
            if steps
            else "Precision mismatch: no step measured"
        )
        return format_mismatch_table(self.summary, title, notes=notes)
