"""amp-trainer: FP16 mixed-precision training for Hugging Face tools, made correct and observable.

The public names are resolved lazily (PEP 562) so that ``import amp_trainer`` costs nothing and
pulls in neither transformers nor accelerate until a name that needs them is used: a plain
PyTorch loop that only wants :class:`DynamicLossScaler` never imports them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from amp_trainer.lazy_exports import lazy_attributes

# The one place the version is written: pyproject.toml reads it ([tool.setuptools.dynamic]).
__version__ = "0.1.0"

__all__ = [
    "AmpAccelerator",
    "AmpSeq2SeqTrainer",
    "AmpSeq2SeqTrainingArguments",
    "AmpTrainer",
    "AmpTrainerMixin",
    "AmpTrainingArguments",
    "BadBatchError",
    "Diagnosis",
    "DivergenceError",
    "DynamicLossScaler",
    "ExportReport",
    "ForwardOverflowGuard",
    "LossScaleError",
    "NonFiniteForwardError",
    "ParityResult",
    "PrecisionDriftError",
    "PrecisionGuard",
    "PrecisionMismatchCallback",
    "SampleInputsError",
    "ScalerStats",
    "StageResult",
    "Verdict",
    "deepspeed_fp16_config",
    "diagnose",
    "export_fp16",
    "install_scaler",
    "keep_in_fp32",
    "keep_norms_in_fp32",
    "load_fp16_export",
    "measure_precision_mismatch",
    "release_ddp_reducers",
]

_WHERE = {
    "DynamicLossScaler": "amp_trainer.scaler",
    "LossScaleError": "amp_trainer.scaler",
    "ScalerStats": "amp_trainer.scaler",
    "DivergenceError": "amp_trainer.forward_overflow",
    "ForwardOverflowGuard": "amp_trainer.forward_overflow",
    "NonFiniteForwardError": "amp_trainer.forward_overflow",
    "keep_norms_in_fp32": "amp_trainer.islands",
    "keep_in_fp32": "amp_trainer.islands",
    "AmpAccelerator": "amp_trainer.accelerate_hooks",
    "install_scaler": "amp_trainer.accelerate_hooks",
    "AmpSeq2SeqTrainer": "amp_trainer.trainer",
    "AmpSeq2SeqTrainingArguments": "amp_trainer.training_args",
    "AmpTrainer": "amp_trainer.trainer",
    "AmpTrainerMixin": "amp_trainer.trainer",
    "AmpTrainingArguments": "amp_trainer.training_args",
    "deepspeed_fp16_config": "amp_trainer.deepspeed",
    "export_fp16": "amp_trainer.export",
    "load_fp16_export": "amp_trainer.export",
    "SampleInputsError": "amp_trainer.export",
    "ExportReport": "amp_trainer.export",
    "ParityResult": "amp_trainer.export",
    "Diagnosis": "amp_trainer.doctor",
    "StageResult": "amp_trainer.doctor",
    "Verdict": "amp_trainer.doctor",
    "diagnose": "amp_trainer.doctor",
    "PrecisionMismatchCallback": "amp_trainer.mismatch",
    "measure_precision_mismatch": "amp_trainer.mismatch",
    "release_ddp_reducers": "amp_trainer.ddp_teardown",
    "PrecisionDriftError": "amp_trainer.precision_guard",
    "PrecisionGuard": "amp_trainer.precision_guard",
    "BadBatchError": "amp_trainer.skip_streak_replay",
}

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from amp_trainer.accelerate_hooks import AmpAccelerator, install_scaler
    from amp_trainer.ddp_teardown import release_ddp_reducers
    from amp_trainer.deepspeed import deepspeed_fp16_config
    from amp_trainer.doctor import Diagnosis, StageResult, Verdict, diagnose
    from amp_trainer.export import (
        ExportReport,
        ParityResult,
        SampleInputsError,
        export_fp16,
        load_fp16_export,
    )
    from amp_trainer.forward_overflow import (
        DivergenceError,
        ForwardOverflowGuard,
        NonFiniteForwardError,
    )
    from amp_trainer.islands import keep_in_fp32, keep_norms_in_fp32
    from amp_trainer.mismatch import PrecisionMismatchCallback, measure_precision_mismatch
    from amp_trainer.precision_guard import PrecisionDriftError, PrecisionGuard
    from amp_trainer.scaler import DynamicLossScaler, LossScaleError, ScalerStats
    from amp_trainer.skip_streak_replay import BadBatchError
    from amp_trainer.trainer import AmpSeq2SeqTrainer, AmpTrainer, AmpTrainerMixin
    from amp_trainer.training_args import AmpSeq2SeqTrainingArguments, AmpTrainingArguments


__getattr__, __dir__ = lazy_attributes(globals(), _WHERE)
