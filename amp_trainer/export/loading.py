"""Loading: the FP32 source model, its tokenizer, and an export reloaded as it was measured.

Part of :mod:`amp_trainer.export`, which re-exports the names users need.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from amp_trainer.export.guard import reinstate_fp32_islands

logger = logging.getLogger(__name__)

# The key in config.json under which the export records what it kept in FP32.
CONFIG_KEY = "amp_trainer_export"
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "vocab.json",
    "spiece.model",
    "tokenizer.model",
)


def load_model(
    path_or_id: str | os.PathLike[str], *, dtype: torch.dtype = torch.float32
) -> nn.Module:
    """Load a transformers model with the head its config names (``config.architectures[0]``).

    ``AutoModel`` would silently drop a classification or LM head, and the head's logits are what
    parity (and the NaN doctor's loss) needs. Falls back to ``AutoModel`` when the config names no
    architecture transformers knows.
    """
    import transformers

    config = transformers.AutoConfig.from_pretrained(path_or_id)
    cls: Any = transformers.AutoModel
    for arch in getattr(config, "architectures", None) or ():
        if hasattr(transformers, arch):
            cls = getattr(transformers, arch)
            break
    return cls.from_pretrained(path_or_id, dtype=dtype)


def load_tokenizer(path_or_id: str | os.PathLike[str]) -> Any | None:
    """The tokenizer saved with the model, or ``None`` if there is none (random ids are used).

    A local folder must hold tokenizer files: transformers 5 otherwise builds an *empty* tokenizer
    from the model type (a BertTokenizer with only the 5 special tokens, mapping every word to
    ``[UNK]``) rather than failing, and parity on all-``[UNK]`` inputs would measure nothing.
    """
    from transformers import AutoTokenizer

    local = Path(path_or_id)
    if local.is_dir() and not any((local / name).is_file() for name in _TOKENIZER_FILES):
        logger.info("No tokenizer files in %s; parity uses random token ids.", local)
        return None
    if local.is_dir():
        _check_tokenizer_files(local)

    try:
        return AutoTokenizer.from_pretrained(path_or_id)
    except (OSError, ValueError, TypeError, KeyError) as err:
        logger.info("No tokenizer at %s (%s); parity uses random token ids.", path_or_id, err)
        return None


_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


def load_processor(path_or_id: str | os.PathLike[str]) -> Any | None:
    """The image processor / feature extractor / processor saved with the model, else ``None``.

    Only a folder holding a processor config is read (a text model's folder would give back
    its tokenizer); a hub id is tried and ``None`` when it has none. The sample batch then
    comes from the config's shapes instead.
    """
    from transformers import AutoProcessor

    local = Path(path_or_id)
    if local.exists() and not any((local / name).is_file() for name in _PROCESSOR_FILES):
        return None
    try:
        return AutoProcessor.from_pretrained(path_or_id)
    except (OSError, ValueError, TypeError, KeyError) as err:
        logger.info("No processor at %s (%s); sample inputs follow the config.", path_or_id, err)
        return None


def _check_tokenizer_files(folder: Path) -> None:
    """Refuse a model folder whose tokenizer JSON files do not parse, naming the file.

    Why: a truncated ``tokenizer.json`` made :func:`load_tokenizer` return ``None`` (it read as
    "no tokenizer"), so the export ran parity on random ids, wrote no tokenizer and said PASSED.
    A tokenizer the user saved and that cannot be read is an error to fix, not an absence.
    """
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        file = folder / name
        if not file.is_file():
            continue
        try:
            json.loads(file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as err:
            raise ValueError(
                f"{file} is unreadable ({_first_line(err)}): truncated or not JSON. Restore it "
                "from the training run (it is in every checkpoint), or remove the tokenizer files "
                "to export with random-id parity."
            ) from None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def load_fp16_export(path: str | os.PathLike[str], model_class: Any | None = None) -> nn.Module:
    """Reload an :func:`export_fp16` folder exactly as it was measured.

    ``from_pretrained(path, dtype=torch.float16)`` casts every tensor to FP16; this then restores
    the modules the export kept in FP32 (their FP32 weights are in the safetensors file) and
    makes them FP32 islands again (:func:`~amp_trainer.islands.keep_in_fp32`), so outputs
    match the parity report.
    """
    from safetensors import safe_open

    path = Path(path)
    if model_class is None:
        model = load_model(path, dtype=torch.float16)
    else:
        model = model_class.from_pretrained(path, dtype=torch.float16)
    # Everything FP16 first, as the export measured it: from_pretrained keeps a class's
    # _keep_in_fp32_modules FP32, which the export halved unless it kept them (listed below).
    model.half()
    info = getattr(model.config, CONFIG_KEY, None) or {}
    norms = list(info.get("fp32_modules", []))
    guarded = [
        *info.get("overflow_guarded_modules", []),
        *info.get("fp32_islands", []),  # the model's own islands and modules tied to islands
    ]
    kept = [*norms, *guarded]
    if kept:
        modules = dict(model.named_modules())
        for name in kept:
            if name not in modules:
                raise ValueError(
                    f"{path}: config lists {name!r} as kept in FP32, but the model has no such "
                    "module; was the folder written by a different model class?"
                )
            # FP16 first, whatever from_pretrained left FP32: an island learns the dtype of
            # the model around it from the cast it undoes, and hands that dtype to the layers
            # after it when it is fed only integer ids (a guarded backbone before an FP16 head).
            # Cast to FP32 beforehand, it would learn nothing and hand FP32 to the FP16 head.
            modules[name].to(torch.float16)
        reinstate_fp32_islands(model, norms, guarded)
        # The FP32 values from the file, into the islands' FP32 tensors (a weight above 65504
        # is inf in the FP16 copy from_pretrained made). Taken after the islands replaced them.
        state = model.state_dict()
        prefixes = tuple(name + "." for name in kept)
        with torch.no_grad():
            for file in sorted(path.glob("*.safetensors")):
                with safe_open(str(file), framework="pt") as handle:
                    for key in handle.keys():  # noqa: SIM118 - safe_open has keys(), not __iter__
                        if key.startswith(prefixes) and key in state:
                            state[key].copy_(handle.get_tensor(key).to(torch.float32))
    return model.eval()


def load_source(path: str | os.PathLike[str]) -> nn.Module:
    """:func:`load_model`, with a model that cannot be loaded said in one line naming it."""
    from safetensors import SafetensorError

    try:
        return load_model(path, dtype=torch.float32)
    except (OSError, ValueError, RuntimeError, SafetensorError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"cannot load a model from {path}: {reason}") from err
