"""What the training tests share: a tiny run's arguments, tiny in-memory datasets, callbacks.

A tiny run's arguments (:func:`tiny_training_args`), tiny in-memory datasets, a callback that
injects a real overflow on chosen optimizer steps, a callback that records what Trainer's own
callbacks see, Accelerate's process-wide state reset between runs, and the one switch that puts
a *stock* Trainer onto its real CUDA-style fp16 path on a CPU so its defects can be shown here.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import torch
from transformers import Trainer, TrainerCallback

#: A tiny CPU training run: real fp16, 4 optimizer steps of batch 4, every step logged, nothing
#: saved, reported or drawn as a progress bar.
TINY_RUN = dict(
    use_cpu=True,
    precision="fp16",
    max_steps=4,
    per_device_train_batch_size=4,
    learning_rate=1e-3,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    disable_tqdm=True,
)


def tiny_training_args(output_dir, cls=None, **overrides):
    """``cls`` (default :class:`amp_trainer.AmpTrainingArguments`) for a :data:`TINY_RUN` writing
    to ``output_dir``; ``overrides`` win.

    ``precision="fp16"`` is left out when the run names its precision with the stock flags
    (``fp16=True``, as a drop-in user writes it) and for classes without that field (a stock
    ``TrainingArguments``).
    """
    if cls is None:
        from amp_trainer import AmpTrainingArguments

        cls = AmpTrainingArguments
    kwargs = {"output_dir": str(output_dir), **TINY_RUN}
    has_precision = "precision" in {f.name for f in dataclasses.fields(cls)}
    if not has_precision or "fp16" in overrides or "bf16" in overrides:
        del kwargs["precision"]
    kwargs.update(overrides)
    return cls(**kwargs)


def reset_accelerate_state() -> None:
    """Forget Accelerate's process-wide singletons (no-op until a test imported accelerate)."""
    if "accelerate.state" in sys.modules:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(True)
        GradientState._reset_state()


class ToyClassification(torch.utils.data.Dataset):
    """Random token sequences with binary labels: enough for BERT to produce real gradients."""

    def __init__(self, n: int = 32, seq_len: int = 8, vocab_size: int = 128, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.input_ids = torch.randint(0, vocab_size, (n, seq_len), generator=g)
        self.labels = torch.randint(0, 2, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.input_ids[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": self.labels[i]}


class ToyLanguageModeling(ToyClassification):
    """Random token sequences for a causal LM (labels are the inputs, as in run_clm)."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.input_ids[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


class ToySeq2Seq(torch.utils.data.Dataset):
    """Random source (10 ids) and target (6 ids) sequences for a 128-id seq2seq model."""

    def __init__(self, n: int = 32, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.inputs = torch.randint(1, 128, (n, 10), generator=g)
        self.labels = torch.randint(1, 128, (n, 6), generator=g)

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.inputs[i], "labels": self.labels[i]}


class InjectOverflow(TrainerCallback):
    """Make the gradient of ``param`` inf during the chosen (1-based) optimizer step attempts.

    A tensor hook on the parameter replaces its gradient in backward, i.e. *before* the scaler's
    unscale/inf check, exactly where a real FP16 overflow would appear. ``on_step_begin`` runs
    before the first micro-batch of each attempt, so it arms the hook for the whole window.
    Attempts, not steps: a skipped update is not a step (``global_step`` stays), so "step 3"
    would overflow again on every retry.
    """

    def __init__(self, param: torch.Tensor, steps: set[int]) -> None:
        self.steps = set(steps)
        self.armed = False
        param.register_hook(self._hook)

    def _hook(self, grad: torch.Tensor) -> torch.Tensor:
        return torch.full_like(grad, float("inf")) if self.armed else grad

    def on_step_begin(self, args, state, control, **kwargs):
        self.armed = getattr(state, "optimizer_step_attempts", state.global_step) + 1 in self.steps


class RecordSkipFlags(TrainerCallback):
    """What a user callback sees in ``on_optimizer_step``: the optimizer's own skip flag."""

    def __init__(self) -> None:
        self.flags: list[bool] = []

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self.flags.append(bool(optimizer.step_was_skipped))


def force_stock_native_fp16(trainer: Trainer, **grad_scaler_kwargs: Any) -> None:
    """Put a stock Trainer on the fp16 path Accelerate takes on CUDA, but on this CPU.

    ``Accelerator.__init__`` (accelerate 1.10 to 1.16) sets exactly two attributes for fp16 on CUDA:
    ``native_amp = True`` and ``scaler = torch.amp.GradScaler(...)``; on a CPU it sets neither
    (defect 3). Setting them after ``Trainer.__init__`` and before ``train()`` (which calls
    ``prepare``) is the least invasive way to run the unmodified stock code path: ``prepare``
    then wraps forward in ``torch.autocast("cpu", float16)`` and the optimizer in
    ``AcceleratedOptimizer(scaler=GradScaler("cpu"))``, as it would on a GPU.
    """
    trainer.accelerator.native_amp = True
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu", **grad_scaler_kwargs)


def train_logs(trainer: Trainer) -> list[dict[str, Any]]:
    """The per-step training entries of ``state.log_history`` (not the final summary)."""
    return [entry for entry in trainer.state.log_history if "loss" in entry]
