"""The precision-mismatch meter's text table: one row per precision, then what it means."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from amp_trainer.numerics import describe_names

__all__ = ["format_mismatch_table"]


def _cell(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.3g}"


def format_mismatch_table(
    stats: Mapping[str, Any], title: str = "", *, notes: Sequence[str] = ()
) -> str:
    """A text table, one row per precision (``stats``: ``{precision: MismatchStats}``), then the
    BF16/FP16 ratio and what is non-finite."""
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
    first = next(iter(stats.values()), None)
    if first is not None and any(s.objective_tokens for s in stats.values()):
        high = first.clip_epsilon if first.clip_epsilon_high is None else first.clip_epsilon_high
        header += (f"objective clip rate (eps={epsilon:g}/{high:g})",)
        rows = [(*row, _cell(s.objective_clip_rate)) for row, s in zip(rows, stats.values())]
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
