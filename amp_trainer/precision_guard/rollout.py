"""The rollout side's precision in RL: the dtype completions are sampled in, against the trainer's.

RL fine-tuning (GRPO, RLOO) divides the trained policy's probability of each sampled token by the
probability the rollout side gave it. When the two sides compute in different precisions the
ratio is off by rounding alone, on every token, and the clipped objective clips tokens for no
reason: the training/inference mismatch that FP16 RL exists to remove. The usual cause is not a
choice but a default nobody sees:

* TRL (1.16) builds its colocated vLLM engine as ``LLM(model=model.name_or_path, ...)`` with no
  ``dtype``: vLLM's ``"auto"`` reads the checkpoint's ``config.json`` and runs a float32
  checkpoint in bf16 on Ampere and newer GPUs and on CPUs (fp16 before Ampere), a bf16
  checkpoint in bf16, an fp16 one in fp16: bf16 rollouts under an fp16 trainer, without a word;
* a vLLM server (``trl vllm-serve``) runs the ``--dtype`` it was started with (``"auto"``: the
  same rule), which the trainer learns only from the server's own report.

:func:`rollout_precision` finds the rollout side's precision from what the trainer was given
(:func:`vllm_auto_precision` is vLLM's own ``"auto"`` rule, so the answer exists before the
engine is started, which takes minutes and a GPU), or from the engine or server once it runs.
:func:`check_rollout_precision` compares it with the trainer's and refuses a mismatch with
:class:`RolloutPrecisionError` unless ``rollout_precision_mismatch="allow"`` says it is intended;
then one warning says so, and a :class:`~amp_trainer.mismatch.PrecisionMismatchCallback` measures
the rollout precision's log-probability gap to FP32 (``mismatch/<rollout precision>/...``).

Without vLLM, TRL samples with transformers' ``generate`` on the policy itself, inside the
trainer's autocast: the very forward training runs, so there is nothing to mismatch. Continuous
batching casts the policy to the dtype of ``args.fp16``/``args.bf16`` first, which
:class:`~amp_trainer.AmpTrainingArguments` keeps equal to ``precision``.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "ROLLOUT_MISMATCH_MODES",
    "RolloutPrecision",
    "RolloutPrecisionError",
    "check_rollout_mismatch_mode",
    "check_rollout_precision",
    "check_trainer_rollout",
    "rollout_precision",
    "vllm_auto_precision",
]

logger = logging.getLogger("amp_trainer.precision_guard")

#: What a rollout precision other than the trainer's does: ``"raise"``
#: :class:`RolloutPrecisionError` before the first step, ``"allow"`` one warning (the
#: mismatch is intended) and train.
ROLLOUT_MISMATCH_MODES = ("raise", "allow")

_NAMES = {
    "float16": "fp16",
    "half": "fp16",
    "fp16": "fp16",
    "bfloat16": "bf16",
    "bf16": "bf16",
    "float32": "fp32",
    "float": "fp32",
    "fp32": "fp32",
}
_TORCH_NAMES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}
# vLLM refuses fp16 for these model types (numerical instability), so "auto" never picks it.
_NO_FP16_IN_VLLM = ("gemma2", "gemma3", "gemma3_text", "plamo2", "glm4")


class RolloutPrecisionError(ValueError):
    """The rollouts are sampled in another precision than the trainer trains in."""


@dataclass(frozen=True)
class RolloutPrecision:
    """The rollout side's precision (``"fp16"``, ``"bf16"`` or ``"fp32"``), where that answer
    came from (``source``, a phrase for messages) and, for a mismatch, how to make it the
    trainer's (``fix``)."""

    precision: str
    source: str
    fix: str = ""


def check_rollout_mismatch_mode(mode: Any) -> str:
    """``mode`` if it is in :data:`ROLLOUT_MISMATCH_MODES`, else a ``ValueError`` naming them."""
    if mode not in ROLLOUT_MISMATCH_MODES:
        raise ValueError(
            f"rollout_precision_mismatch must be one of {ROLLOUT_MISMATCH_MODES}, got {mode!r}"
        )
    return mode


def _precision_name(dtype: Any) -> str | None:
    """``"fp16"``/``"bf16"``/``"fp32"`` for a torch dtype or a dtype string (``"torch.bfloat16"``,
    ``"half"``, ``"auto"`` gives ``None``)."""
    if dtype is None:
        return None
    text = str(dtype).lower().removeprefix("torch.")
    return _NAMES.get(text)


def vllm_auto_precision(
    config_dtype: Any,
    model_type: str | None = None,
    device_capability: tuple[int, int] | None = None,
) -> str:
    """The precision vLLM's ``dtype="auto"`` runs a checkpoint in (vLLM's ``_resolve_auto_dtype``).

    vLLM takes the checkpoint's dtype, except that a float32 checkpoint (or one that names none)
    is "downcast" to the device's preferred dtype: the first the platform supports, bf16 on CUDA
    compute capability 8.0 and above and on CPUs, fp16 before Ampere. A dtype the device lacks
    (bf16 before Ampere) becomes the preferred one too.

    Args:
        config_dtype: the checkpoint config's ``dtype`` (``torch_dtype``), a torch dtype or string.
        model_type: the config's ``model_type``; some (Gemma 2/3, GLM-4) refuse fp16 in vLLM.
        device_capability: the CUDA compute capability vLLM runs on; ``None``: a CPU.
    """
    supported = ["bf16", "fp16", "fp32"]
    if device_capability is not None and tuple(device_capability) < (8, 0):
        supported = ["fp16", "fp32"]
    if model_type in _NO_FP16_IN_VLLM:
        supported = [p for p in supported if p != "fp16"]
    preferred = supported[0]
    precision = _precision_name(config_dtype) or "fp32"
    if precision == "fp32":
        precision = preferred
    return precision if precision in supported else preferred


def _local_device_capability() -> tuple[int, int] | None:
    """The compute capability a colocated engine would run on here (``None``: no CUDA)."""
    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability())  # type: ignore[return-value]


def _checkpoint_config(model: Any) -> tuple[dict[str, Any], str]:
    """The config vLLM loads the policy from (``model.name_or_path``) and where it was read.

    vLLM reads the checkpoint on disk, not the model in memory (a policy loaded with
    ``dtype=torch.float32`` from a bf16 checkpoint is still bf16 to vLLM). Only local files are
    read, never downloaded; where there are none, the in-memory config stands in for them.
    """
    name = str(getattr(model, "name_or_path", "") or "")
    if name:
        path = os.path.join(name, "config.json")
        try:
            if os.path.isfile(path):
                with open(path, encoding="utf-8") as handle:
                    return json.load(handle), f"{path}"
            from transformers import PretrainedConfig

            found, _ = PretrainedConfig.get_config_dict(name, local_files_only=True)
            return found, f"the config.json of {name!r}"
        except (OSError, ValueError):
            pass
    config = getattr(model, "config", None)
    return (config.to_dict() if config is not None else {}), "the policy's in-memory config"


def _config_dtype(config: dict[str, Any]) -> Any:
    for holder in (config, config.get("text_config") or {}):
        for key in ("dtype", "torch_dtype"):
            if holder.get(key) is not None:
                return holder[key]
    return None


def _vllm_precision(args: Any, model: Any, engine: Any, capability: Any) -> RolloutPrecision | None:
    """vLLM's precision: the running engine's or server's where they exist, else the one
    TRL's ``LLM(...)`` call (no ``dtype``) will get from vLLM's ``"auto"``."""
    mode = getattr(args, "vllm_mode", "colocate")
    if mode == "server":
        client = getattr(engine, "vllm_client", None)
        if client is None:
            return None  # known only once connected: train() asks the server
        try:
            server = client.get_server_info().get("model_config", {})
        except Exception as err:  # TRL raises a bare Exception for a failed request
            logger.info("Could not read the vLLM server's dtype (%s): not checked", err)
            return None
        precision = _precision_name(server.get("dtype"))
        if precision is None:
            return None
        return RolloutPrecision(
            precision,
            f"the vLLM server's dtype ({server.get('dtype')}), as it reports it",
            "restart the server with --dtype {torch_name} (trl vllm-serve --dtype {torch_name})",
        )
    llm = getattr(engine, "llm", None)
    running = getattr(
        getattr(getattr(llm, "llm_engine", None), "model_config", None), "dtype", None
    )
    if _precision_name(running) is not None:
        return RolloutPrecision(
            _precision_name(running),  # type: ignore[arg-type]
            f"the colocated vLLM engine's dtype ({running})",
            _COLOCATE_FIX,
        )
    checkpoint, where = _checkpoint_config(model)
    dtype = _config_dtype(checkpoint)
    if capability == "local":
        capability = _local_device_capability()
    precision = vllm_auto_precision(dtype, checkpoint.get("model_type"), capability)
    device = (
        "a CPU" if capability is None else f"compute capability {capability[0]}.{capability[1]}"
    )
    return RolloutPrecision(
        precision,
        f"TRL builds its colocated vLLM engine with no dtype, and vLLM's 'auto' runs the "
        f"checkpoint's dtype {dtype or 'float32 (none given)'} ({where}) in {precision} on "
        f"{device}",
        _COLOCATE_FIX,
    )


_COLOCATE_FIX = (
    "give vLLM a checkpoint whose config.json says {torch_name} (set model.config.dtype = "
    "torch.{torch_name}, save_pretrained, and load the policy from that folder)"
)


def rollout_precision(
    args: Any,
    model: Any,
    trainer_precision: str,
    *,
    engine: Any = None,
    custom_rollout: bool = False,
    device_capability: tuple[int, int] | str | None = "local",
) -> RolloutPrecision | None:
    """The precision a GRPO-like trainer's rollouts are sampled in; ``None`` where it has no
    rollout side (its arguments have no ``use_vllm``) or it cannot be known yet (a vLLM server not
    connected; a user's ``rollout_func`` without vLLM).

    Args:
        args: the trainer's arguments (a TRL ``GRPOConfig``/``RLOOConfig``).
        model: the policy trained; vLLM loads ``model.name_or_path``.
        trainer_precision: the trainer's precision (``"fp16"``, ``"bf16"``, ``"fp32"``).
        engine: TRL's ``VLLMGeneration`` once built (``trainer.vllm_generation``): its running
            engine's (or server's) dtype is the answer then.
        custom_rollout: the trainer samples with a user's ``rollout_func`` (GRPOTrainer's
            argument): without vLLM its precision is the function's own, not known here.
        device_capability: the CUDA compute capability a colocated engine runs on (``None``: a
            CPU); ``"local"``: this process's GPU, or none.
    """
    if not hasattr(args, "use_vllm"):
        return None
    if args.use_vllm:
        return _vllm_precision(args, model, engine, device_capability)
    if custom_rollout:
        return None
    if getattr(args, "use_transformers_continuous_batching", False):
        cast = "bf16" if args.bf16 else "fp16" if args.fp16 else None
        if cast is not None:
            return RolloutPrecision(
                cast,
                f"TRL's continuous batching casts the policy to {cast} (args.{cast}) to generate",
                "set the trainer's fp16/bf16 flags to {precision}",
            )
    return RolloutPrecision(
        trainer_precision,
        "transformers' generate on the policy itself, under the trainer's autocast (the "
        "training forward's precision)",
    )


def check_rollout_precision(
    trainer: Any, mode: str, said: set[tuple[str, str]] | None = None, **kwargs: Any
) -> RolloutPrecision | None:
    """Compare the rollout precision of ``trainer`` with ``trainer.precision``; in ``mode``
    ``"raise"`` refuse a mismatch with :class:`RolloutPrecisionError`, in ``"allow"`` warn once
    per cause not yet in ``said`` (the caller's memory, so that a check before the engine starts
    and one after do not warn twice). Returns the rollout precision (``None``: no rollout side,
    or not known yet). ``kwargs`` go to :func:`rollout_precision`."""
    check_rollout_mismatch_mode(mode)
    args, precision = trainer.args, trainer.precision
    found = rollout_precision(
        args,
        trainer.model,
        precision,
        engine=getattr(trainer, "vllm_generation", None),
        custom_rollout=getattr(trainer, "rollout_func", None) is not None,
        **kwargs,
    )
    if found is None or found.precision == precision:
        return found
    fix = (
        found.fix.format(torch_name=_TORCH_NAMES[precision], precision=precision)
        or f"make the rollouts {precision}"
    )
    if mode == "raise":
        raise RolloutPrecisionError(
            f"The rollouts are sampled in {found.precision} ({found.source}) but the trainer "
            f"trains in {precision}, so every token's importance ratio is off by the precision "
            f"alone: {fix}, train with precision={found.precision!r}, or set "
            "rollout_precision_mismatch='allow' if the mismatch is intended."
        )
    said = set() if said is None else said
    if (found.precision, found.source) not in said:
        said.add((found.precision, found.source))
        logger.warning(
            "Rollouts in %s (%s) while the trainer trains in %s: allowed "
            "(rollout_precision_mismatch='allow'). A PrecisionMismatchCallback measures what it "
            "costs, as mismatch/%s/... in the logs.",
            found.precision,
            found.source,
            precision,
            found.precision if found.precision != "fp32" else precision,
        )
    return found


def check_trainer_rollout(trainer: Any, *, before_engine: bool = False) -> RolloutPrecision | None:
    """:func:`check_rollout_precision` for a trainer, in its ``rollout_precision_mismatch`` mode
    (``"raise"`` for arguments without one), then its callbacks that measure the mismatch
    (:meth:`~amp_trainer.mismatch.PrecisionMismatchCallback.measure_rollout`) told the rollout
    precision where it differs. A warning already given to the trainer is not given again.

    :class:`~amp_trainer.AmpTrainerMixin` calls it (its ``rollout_precision`` is the answer) at the
    start of ``train()`` and, with ``before_engine=True``, inside ``Trainer.__init__``, which runs
    before TRL's ``GRPOTrainer.__init__`` starts vLLM (minutes and a GPU): then only a vLLM
    rollout side is checked, from the checkpoint; the others wait for ``train()``."""
    if before_engine and not getattr(trainer.args, "use_vllm", False):
        return None
    mode = getattr(trainer.args, "rollout_precision_mismatch", "raise")
    said = trainer.__dict__.setdefault("_rollout_mismatch_said", set())
    found = check_rollout_precision(trainer, mode, said)
    handler = getattr(trainer, "callback_handler", None)  # none yet inside Trainer.__init__
    if found is None or handler is None:
        return found
    other = found.precision if found.precision != trainer.precision else None
    for callback in handler.callbacks:
        measure = getattr(callback, "measure_rollout", None)  # PrecisionMismatchCallback's
        if callable(measure):
            measure(other)
    return found
