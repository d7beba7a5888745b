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

from amp_trainer.export.formats import FILE_NAMES
from amp_trainer.export.guard import reinstate_fp32_islands
from amp_trainer.export.staging import check_digests

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

    A local folder without tokenizer files gives ``None``. A folder *with* tokenizer files must
    give a working tokenizer, else this raises: transformers 5 builds an *empty* tokenizer from a
    ``tokenizer_config.json`` whose vocabulary file is gone (a BertTokenizer with only the 5
    special tokens, mapping every word to ``[UNK]``) rather than failing, and a tokenizer the user
    saved but that cannot be read is something to fix, not an absence: read as "no tokenizer",
    the export would run parity on random ids, write no tokenizer and say PASSED.

    Raises:
        ValueError: one line naming the folder's tokenizer files and what is wrong with them.
    """
    from transformers import AutoTokenizer

    local = Path(path_or_id)
    present = [name for name in _TOKENIZER_FILES if (local / name).is_file()]
    if local.is_dir() and not present:
        logger.info("No tokenizer files in %s; parity uses random token ids.", local)
        return None
    if local.is_dir():
        _check_tokenizer_files(local)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path_or_id)
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:
        if not local.is_dir():
            logger.info("No tokenizer at %s (%s); parity uses random token ids.", path_or_id, err)
            return None
        raise ValueError(
            f"the tokenizer saved in {local} ({', '.join(present)}) does not load: "
            f"{type(err).__name__}: {_first_line(err)}. {_RESTORE_TOKENIZER}"
        ) from None
    if local.is_dir():
        _check_vocabulary(local, tokenizer, present)
    return tokenizer


# What every refusal of a saved tokenizer ends with: the two ways forward.
_RESTORE_TOKENIZER = (
    "Restore the tokenizer files from the training run (every checkpoint has them), or remove "
    "them all to export with random-id parity"
)


def _check_vocabulary(folder: Path, tokenizer: Any, present: list[str]) -> None:
    """Refuse a loaded tokenizer whose vocabulary is nothing but its special tokens.

    That is what transformers builds from a ``tokenizer_config.json`` alone: every word of every
    sample text becomes the unknown token, and parity on such inputs measures one embedding row.
    """
    special = set(getattr(tokenizer, "all_special_ids", None) or ())
    size = len(tokenizer)
    if size > len(special):
        return
    raise ValueError(
        f"the tokenizer saved in {folder} ({', '.join(present)}) loads with no vocabulary: "
        f"{size} ids, all special tokens, so every word is unknown (its vocabulary file, "
        f"tokenizer.json or vocab.txt, is missing). {_RESTORE_TOKENIZER}"
    )


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

    A truncated or emptied file is named here in one line; transformers would otherwise fail
    deep inside the tokenizers library (``KeyError: 'added_tokens'`` for a ``tokenizer.json``
    of ``{}``) or build an empty tokenizer.
    """
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        file = folder / name
        if not file.is_file():
            continue
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as err:
            raise ValueError(
                f"{file} is unreadable ({_first_line(err)}): truncated or not JSON. "
                f"{_RESTORE_TOKENIZER}."
            ) from None
        if name == "tokenizer.json" and not (isinstance(data, dict) and "model" in data):
            raise ValueError(
                f"{file} is not a tokenizers file: it has no 'model' section (its vocabulary). "
                f"{_RESTORE_TOKENIZER}."
            )


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def load_fp16_export(
    path: str | os.PathLike[str], model_class: Any | None = None, *, verify: bool = True
) -> nn.Module:
    """Reload an :func:`export_fp16` folder exactly as it was measured.

    ``from_pretrained(path, dtype=torch.float16)`` casts every tensor to FP16; this then restores
    the modules the export kept in FP32 (their FP32 weights are in the safetensors file) and
    makes them FP32 islands again (:func:`~amp_trainer.islands.keep_in_fp32`), so outputs
    match the parity report.

    With ``verify`` (the default), every file the export wrote is first checked against the
    SHA-256 its ``report.json`` recorded (the other formats' files aside, which this does not
    read): a weight that changed on disk since (a flipped bit, a half-finished copy) would
    load without complaint and compute something the parity report never measured.

    Raises:
        ValueError: one line naming a file that is missing or does not match its digest.
    """
    from safetensors import safe_open

    path = Path(path)
    if verify:
        check_digests(path, skip=tuple(FILE_NAMES.values()))
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
