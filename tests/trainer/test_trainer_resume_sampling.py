"""A resumed run reads the batches the uninterrupted one read, for every train sampler the
recipes and AmpTrainer offer: random, and length-grouped (the recipes' default), whose order
stock transformers draws from the global RNG when the epoch starts, so with stock's sampler a
resumed run reads other batches from its second epoch on. Mid-epoch checkpoints
in the first and the second epoch, each resumed and compared bit for bit."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import TrainingArguments

from amp_trainer import AmpTrainer
from amp_trainer.length_grouped_sampling import EpochSeededLengthGroupedSampler
from tests.helpers.tiny_models import make_tiny_bert
from tests.helpers.training import reset_accelerate_state, tiny_training_args

BATCH = 4
EXAMPLES = 24  # 6 batches an epoch
EPOCHS = 2
SAVE_STEPS = 4  # checkpoint-4 in epoch 0, checkpoint-8 in epoch 1

_FIELDS = {f.name for f in dataclasses.fields(TrainingArguments)}
# The strategies this transformers offers: 5.0 has random and length grouping; later 5.x add
# sequential and batch_rebalance (its own batch sampler, seeded with seed + epoch upstream).
STRATEGIES = ["random", "group_by_length"]
if "train_sampling_strategy" in _FIELDS:
    STRATEGIES += ["sequential", "batch_rebalance"]


def sampling(strategy: str) -> dict:
    """The training arguments that choose ``strategy`` on this transformers (5.0 spells
    length grouping ``group_by_length=True``; later 5.x ``train_sampling_strategy``)."""
    if "train_sampling_strategy" in _FIELDS:
        return {"train_sampling_strategy": strategy}
    return {"group_by_length": strategy == "group_by_length"}


class VariableLengths(torch.utils.data.Dataset):
    """Token sequences of 3 to 16 ids with binary labels: what length grouping sorts."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(7)
        lengths = torch.randint(3, 17, (EXAMPLES,), generator=g).tolist()
        self.rows = [torch.randint(1, 128, (n,), generator=g) for n in lengths]
        self.labels = torch.randint(0, 2, (EXAMPLES,), generator=g).tolist()

    def __len__(self) -> int:
        return EXAMPLES

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.rows[i], "labels": self.labels[i]}


def pad(features: list[dict]) -> dict:
    width = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, f in enumerate(features):
        ids[row, : len(f["input_ids"])] = f["input_ids"]
        mask[row, : len(f["input_ids"])] = 1
    labels = torch.tensor([f["labels"] for f in features])
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class RecordingTrainer(AmpTrainer):
    """AmpTrainer that keeps every micro-batch it trained on (its input ids)."""

    def training_step(self, model, inputs, *args, **kwargs):
        self.batches.append(inputs["input_ids"].tolist())
        return super().training_step(model, inputs, *args, **kwargs)


def run(output_dir, strategy: str, resume: str | None = None) -> RecordingTrainer:
    reset_accelerate_state()
    args = tiny_training_args(
        output_dir,
        num_train_epochs=EPOCHS,
        max_steps=-1,
        per_device_train_batch_size=BATCH,
        save_strategy="steps",
        save_steps=SAVE_STEPS,
        learning_rate=1e-3,
        **sampling(strategy),
    )
    trainer = RecordingTrainer(
        model=make_tiny_bert(seed=0), args=args, train_dataset=VariableLengths(), data_collator=pad
    )
    trainer.batches = []
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def params(trainer) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in trainer.model.parameters()])


@pytest.fixture(scope="module", params=STRATEGIES)
def full(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"full-{request.param}")
    return request.param, out, run(out, request.param)


@pytest.mark.parametrize("checkpoint", [SAVE_STEPS, 2 * SAVE_STEPS])
def test_a_mid_epoch_resume_reads_the_same_batches_and_ends_bit_identical(
    full, checkpoint, tmp_path
):
    strategy, out, uninterrupted = full
    assert len(uninterrupted.batches) == EPOCHS * EXAMPLES // BATCH
    resumed = run(tmp_path, strategy, resume=str(out / f"checkpoint-{checkpoint}"))
    assert resumed.batches == uninterrupted.batches[checkpoint:]
    assert torch.equal(params(resumed), params(uninterrupted))
    assert resumed.loss_scaler.state_dict() == uninterrupted.loss_scaler.state_dict()


@pytest.mark.parametrize("full", ["group_by_length"], indirect=True)
def test_length_grouping_still_groups_and_draws_another_order_each_epoch(full):
    _, _, uninterrupted = full
    sampler = uninterrupted._get_train_sampler()
    assert isinstance(sampler, EpochSeededLengthGroupedSampler)
    per_epoch = EXAMPLES // BATCH
    first, second = uninterrupted.batches[:per_epoch], uninterrupted.batches[per_epoch:]
    assert first != second  # a new order each epoch, as upstream
    # Upstream's grouping: the longest example of the epoch comes in its first batch.
    lengths = [[sum(1 for t in row if t) for row in batch] for batch in first]
    assert max(lengths[0]) == max(max(b) for b in lengths)
