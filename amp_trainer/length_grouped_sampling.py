"""Length-grouped sampling whose order a resumed run reads again.

transformers' ``LengthGroupedSampler`` (``group_by_length``, the recipes' default) draws each
epoch's order from the *global* torch RNG at the moment the epoch's iterator starts. A resumed
run starts that iterator right after seeding, while the uninterrupted run started it after every
earlier step's dropout had used the RNG: the interrupted epoch is read in another order, so the
resumed run trains on other batches (other losses, skips and weights; stock ``Trainer`` does the
same). ``RandomSampler`` has no such gap: Accelerate swaps it for a sampler seeded with
``seed + epoch``.

:class:`EpochSeededLengthGroupedSampler` follows that convention: the same length grouping
(transformers' own ``get_length_grouped_indices``), its randomness from a generator seeded with
``seed + epoch``, where the epoch is the trainer's (``floor(state.epoch)``, which a resumed run
restores from ``trainer_state.json``; not ``set_epoch``, which Accelerate does not forward to
every sampler its skipping loaders wrap). It uses no global RNG at all, so the dropout stream is
unchanged by sampling. The price: for the same seed a run's order differs from stock's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers.trainer_pt_utils import LengthGroupedSampler, get_length_grouped_indices


class EpochSeededLengthGroupedSampler(LengthGroupedSampler):
    """``LengthGroupedSampler`` with each epoch's order a function of ``(seed, epoch)`` only.

    Args:
        batch_size: as upstream (the train batch size times gradient accumulation).
        lengths: each example's length, as upstream computed them.
        seed: ``data_seed`` if set, else ``seed`` (the training arguments' convention).
        epoch_of: the epoch about to be read, asked when the epoch's iterator starts.
    """

    def __init__(
        self, batch_size: int, lengths: list[int], seed: int, epoch_of: Callable[[], int]
    ) -> None:
        super().__init__(batch_size, lengths=list(lengths))
        self.seed = int(seed)
        self._epoch_of = epoch_of

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed + int(self._epoch_of()))
        indices = get_length_grouped_indices(self.lengths, self.batch_size, generator=generator)
        return iter(indices)


def epoch_seeded(sampler: Any, trainer: Any) -> Any:
    """``sampler`` made resumable where it is stock's global-RNG ``LengthGroupedSampler``
    (exactly that class, with no generator of its own); any other sampler is returned as is."""
    if type(sampler) is not LengthGroupedSampler or sampler.generator is not None:
        return sampler
    args = trainer.args
    seed = args.data_seed if getattr(args, "data_seed", None) is not None else args.seed

    def epoch_of() -> int:
        return math.floor(trainer.state.epoch or 0)

    return EpochSeededLengthGroupedSampler(sampler.batch_size, sampler.lengths, seed, epoch_of)
