"""The sample batch the overflow guard and the parity check run on, and the forward's keywords.

Part of :mod:`amp_trainer.export`, which re-exports the names users need.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

#: Used for the parity check when a tokenizer is available but no texts were given.
DEFAULT_SAMPLE_TEXTS = (
    "The movie was a delight from start to finish.",
    "I would not recommend this restaurant to anyone.",
    "Mixed precision training keeps master weights in float32.",
    "The gradient scaler multiplies the loss before the backward pass.",
    "It rained all day, so we stayed inside and read.",
    "Stock prices fell sharply after the announcement.",
    "A quick brown fox jumps over the lazy dog.",
    "Half precision overflows above sixty-five thousand five hundred and four.",
)
_RANDOM_BATCH, _RANDOM_LENGTH = 8, 16


def make_sample_batch(
    model: nn.Module,
    tokenizer: Any | None = None,
    texts: Sequence[str] | None = None,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """One padded batch: the texts (or built-in ones) through the tokenizer, else random ids.

    Padding is done here, not by the tokenizer, so a tokenizer without a pad token (GPT-2) works;
    padded positions get id 0 and mask 0 and are excluded from parity.
    """
    config = model.config
    max_len = min(
        128,
        getattr(config, "max_position_embeddings", None)
        or getattr(config, "n_positions", None)
        or 128,
    )
    if tokenizer is None:
        if texts:
            raise ValueError("sample texts were given but there is no tokenizer to encode them")
        generator = torch.Generator().manual_seed(seed)
        vocab = int(config.vocab_size)
        length = min(_RANDOM_LENGTH, max_len)
        ids = torch.randint(0, vocab, (_RANDOM_BATCH, length), generator=generator)
        mask = torch.ones_like(ids)
        for row in range(1, _RANDOM_BATCH, 2):  # every other row padded: masks are exercised
            mask[row, length - row // 2 - 1 :] = 0
        return {"input_ids": ids * mask, "attention_mask": mask}
    encoded = [
        tokenizer(text, truncation=True, max_length=max_len)
        for text in (texts or DEFAULT_SAMPLE_TEXTS)
    ]
    width = max(len(e["input_ids"]) for e in encoded)
    batch: dict[str, torch.Tensor] = {}
    keys = [k for k in ("input_ids", "token_type_ids") if k in encoded[0]]
    for key in keys:
        batch[key] = torch.tensor(
            [list(e[key]) + [0] * (width - len(e[key])) for e in encoded], dtype=torch.long
        )
    batch["attention_mask"] = torch.tensor(
        [[1] * len(e["input_ids"]) + [0] * (width - len(e["input_ids"])) for e in encoded],
        dtype=torch.long,
    )
    return batch


def forward_kwargs(model: nn.Module) -> dict[str, Any]:
    import inspect

    params = inspect.signature(model.forward).parameters
    extra: dict[str, Any] = {"return_dict": True}
    if "use_cache" in params or "kwargs" in params:
        extra["use_cache"] = False
    return extra
