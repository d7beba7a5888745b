"""The share of tokens a PPO/GRPO clipped objective clips because of the precision alone.

``clip_rate`` counts the tokens whose ratio ``p_prec / p_fp32`` leaves ``[1 - eps, 1 + eps]``
on either side, whatever the advantage. A clipped objective, ``min(r * A, clip(r, 1 - eps_low,
1 + eps_high) * A)``, only clips (zeroes the gradient of) a token whose ratio is past the bound
the advantage pushes it towards: above ``1 + eps_high`` with a positive advantage, below
``1 - eps_low`` with a negative one. A token past the other bound keeps its gradient, and the
two bounds differ under clip-higher (TRL's ``epsilon_high``, DAPO's 0.28 against 0.2). This is
the rule TRL's GRPOTrainer counts its own ``clip_ratio/region_mean`` with (token level); here
the ratio is the one rounding alone makes, ``exp(log p_prec - log p_fp32)``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["check_advantages", "objective_clipped", "token_advantages"]


def objective_clipped(
    log_ratio: torch.Tensor, advantages: torch.Tensor, epsilon_low: float, epsilon_high: float
) -> torch.Tensor:
    """Which tokens the clipped objective clips: ``log_ratio`` (``log r``) against the bound
    the sign of each token's advantage selects; a zero advantage is never clipped.

    Compared in log space (``log r > log(1 + eps_high)``), which is ``r > 1 + eps_high``
    without rounding the ratio to a float first.
    """
    high = (log_ratio > math.log1p(epsilon_high)) & (advantages > 0)
    low = (log_ratio < math.log1p(-epsilon_low)) & (advantages < 0)
    return high | low


def check_advantages(advantages: Any, input_ids: torch.Tensor) -> torch.Tensor | None:
    """``advantages`` checked against ``input_ids`` (``(batch, sequence)``): ``(batch,)``, one
    per row (GRPO's), or ``(batch, T)`` with ``1 <= T < sequence``, one per token of the last
    ``T`` positions (a completion's, as per-token advantages are)."""
    if advantages is None:
        return None
    if not isinstance(advantages, torch.Tensor):
        raise TypeError(
            f"advantages must be a torch.Tensor or None, got {type(advantages).__name__}"
        )
    rows, length = input_ids.shape
    shape = tuple(advantages.shape)
    per_row = shape == (rows,)
    per_token = len(shape) == 2 and shape[0] == rows and 1 <= shape[1] < length
    if not (per_row or per_token) or not advantages.dtype.is_floating_point:
        raise ValueError(
            f"advantages of shape {shape} ({str(advantages.dtype).removeprefix('torch.')}) do "
            f"not fit input_ids of shape {(rows, length)}: give floats of shape ({rows},), one "
            f"per row, or ({rows}, T) with 1 <= T < {length}, one per token of the last T "
            "positions"
        )
    return advantages


def token_advantages(advantages: torch.Tensor, length: int) -> torch.Tensor:
    """Checked ``advantages`` as one float64 value per scored position (``(batch, length -
    1)``: position ``t`` predicts token ``t + 1``); NaN where a token has none (before the last
    ``T`` positions of per-token advantages)."""
    values = advantages.detach().double()
    if values.dim() == 1:
        return values.unsqueeze(1).expand(-1, length - 1)
    per_position = values.new_full((values.shape[0], length - 1), math.nan)
    per_position[:, -values.shape[1] :] = values
    return per_position
