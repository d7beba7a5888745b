"""FP32 islands: modules that compute in FP32 whatever autocast or ``.half()`` say.

One mechanism for every "this module computes in FP32" in amp-trainer: :func:`keep_norms_in_fp32`
(norm layers: their mean/variance reductions are where FP16 loses the most), the user's
``fp32_modules``, transformers' ``_keep_in_fp32_modules`` (:func:`apply_fp32_policy` gathers them),
the trainer's forward-overflow fallback (:mod:`amp_trainer.forward_overflow`) and the FP16
exporter's overflow guard. An island keeps FP32 parameters *and* arithmetic: its ``forward`` runs
with autocast off on FP32 inputs and hands its output back in the dtype the surrounding code
expects.

Islands are recorded in ``model.config`` (:data:`ISLANDS_CONFIG_KEY`) so a saved model, every
Trainer checkpoint and an FP16 export carry them.

The mechanism (the FP32 forward wrapper, making islands) is :mod:`amp_trainer.islands.engine`;
which islands a run needs and recording them is :mod:`amp_trainer.islands.records`.

Example::

    keep_norms_in_fp32(model)
    keep_in_fp32(model, ["lm_head"])          # names, dotted suffixes, globs or regexes
"""

from amp_trainer.islands.engine import (
    is_fp32_island,
    is_norm_module,
    keep_in_fp32,
    keep_norms_in_fp32,
    remove_fp32_island,
)
from amp_trainer.islands.records import (
    ISLANDS_CONFIG_KEY,
    apply_fp32_policy,
    declared_fp32_modules,
    fp32_islands,
    record_fp32_islands,
    recorded_fp32_islands,
    restore_fp32_islands,
)

__all__ = [
    "ISLANDS_CONFIG_KEY",
    "apply_fp32_policy",
    "declared_fp32_modules",
    "fp32_islands",
    "is_fp32_island",
    "is_norm_module",
    "keep_in_fp32",
    "keep_norms_in_fp32",
    "record_fp32_islands",
    "recorded_fp32_islands",
    "remove_fp32_island",
    "restore_fp32_islands",
]
