"""A model whose FP16 backward overflows at every loss scale while its forward is exact, and the
regression data it trains on: the provoked faults of the skip-streak replay's tests.

``Amplifier`` adds ``C * (h - h.detach())`` and takes it away again: the forward is ``h``
exactly (the branch is 0), the backward carries ``C * g`` through both branches. In FP16 that is
``inf - inf = NaN`` as soon as ``|g| > 65504 / C``, at loss scale 1 too; in FP32 it cancels to
``g`` exactly. So the module's gradient output is finite, its gradient input is not: only an FP32
island fixes it.
"""

from __future__ import annotations

import torch
from torch import nn

#: The backward amplification: ``|g| > 65504 / 2**24`` (about 0.004) overflows FP16.
AMPLIFICATION = 2.0**24


class Amplifier(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        branch = h - h.detach()  # 0 in the forward, the identity in the backward
        return h + branch * AMPLIFICATION - branch * AMPLIFICATION


class BackwardOverflowRegression(nn.Module):
    """``x -> inp -> amp (Amplifier) -> relu -> head``, mean squared error against ``labels``."""

    def __init__(self, seed: int = 0, width: int = 16) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(4, width)
        self.amp = Amplifier(width)
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        out = self.head(torch.relu(self.amp(self.inp(x)))).float().squeeze(-1)
        return {"loss": ((out - labels) ** 2).mean(), "logits": out}


class PlainRegression(BackwardOverflowRegression):
    """The same network without the amplifying branch: a clean FP16 model."""

    def __init__(self, seed: int = 0, width: int = 16) -> None:
        super().__init__(seed, width)
        self.amp = nn.Linear(width, width)


class Regression(torch.utils.data.Dataset):
    """``y = x . w + noise`` on 4 features; ``inf_at`` puts an inf into that sample's features."""

    def __init__(self, n: int = 32, seed: int = 0, inf_at: int | None = None) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 4, generator=g)
        self.y = self.x @ torch.tensor([1.0, -2.0, 0.5, 1.5]) + 0.3 * torch.randn(n, generator=g)
        if inf_at is not None:
            self.x[inf_at, 2] = float("inf")

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}
