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

from amp_trainer.mismatch.callback import PrecisionMismatchCallback
from amp_trainer.mismatch.meter import (
    FIGURES,
    MismatchReport,
    MismatchStats,
    format_mismatch_table,
    measure_precision_mismatch,
)

__all__ = [
    "FIGURES",
    "MismatchReport",
    "MismatchStats",
    "PrecisionMismatchCallback",
    "format_mismatch_table",
    "measure_precision_mismatch",
]
