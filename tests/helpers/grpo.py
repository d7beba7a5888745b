"""TRL's GRPO under :class:`~amp_trainer.AmpTrainerMixin`, as the GRPO tests build it: the
config and trainer classes a user composes, and a rule-based reward. Import it after
``pytest.importorskip("trl")``: it imports TRL."""

from __future__ import annotations

import dataclasses

from trl import GRPOConfig, GRPOTrainer

from amp_trainer import AmpTrainerMixin, AmpTrainingArguments
from tests.helpers.tiny_models import COLOURS


@dataclasses.dataclass
class AmpGRPOConfig(AmpTrainingArguments, GRPOConfig):
    pass


class AmpGRPOTrainer(AmpTrainerMixin, GRPOTrainer):
    pass


def says_a_colour(completions: list[str], **kwargs) -> list[float]:
    """Rule-based reward: one point per colour word, a little less for longer answers."""
    return [sum(c in text for c in COLOURS) - 0.01 * len(text) for text in completions]
