"""A checkpoint's files checked before anything loads them: one line naming a damaged file,
and no code run from a file that holds any.

Resuming reads a checkpoint's files through stock loaders that report damage without naming the
file (``Expecting ',' delimiter``, ``KeyError: 'step'``, ``PytorchStreamReader failed reading zip
archive``) or with torch's advice to retry with ``weights_only=False``, which would run whatever
code the file holds. And under FSDP, ``torch.distributed.checkpoint`` reads each sharded folder's
``.metadata`` with plain ``pickle.load`` and its non-tensor entries with
``torch.load(weights_only=False)``: a checkpoint from elsewhere could run code on every rank.

:func:`check_resume_files` reads every file a resume will read, the way it will be read but
without running anything, before it is read for real; a damaged or unsafe file is a
``ValueError`` naming the file, what is wrong and what to do. What passes:

* JSON files (``trainer_state.json``, ``amp_trainer_state.json``) that parse and have the shape
  their reader needs;
* torch files (``optimizer.pt``, ``scheduler.pt``, ``rng_state*.pth``, Accelerate's
  ``*.bin``/``random_states_*.pkl``; ``scaler.pt`` is named by its own reader) that
  ``torch.load(weights_only=True)`` reads, with numpy's RNG state allowed as transformers and
  Accelerate allow it (no tensor data is read: the file is memory-mapped);
* sharded folders (``pytorch_model_fsdp_0/``, ``optimizer_0/``) whose ``.metadata`` unpickles with
  only ``torch.distributed.checkpoint``'s metadata classes, ``torch.Size``, dtypes, layouts and
  paths, whose storage files lie inside the folder, and whose non-tensor entries
  ``torch.load(weights_only=True)`` reads.

Before all of that, every file is compared with the checkpoint's digest list
(:mod:`~amp_trainer.checkpointing.digests`), which also covers what the checks above do not
read: the model's weights (safetensors, or tensor data, which hold no code). Not checked either
way: Accelerate's ``custom_checkpoint_*.pkl`` (the user's own registered objects, which
Accelerate loads with ``weights_only=False`` by design).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import pickle
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from amp_trainer.atomic_files import is_disk_full
from amp_trainer.checkpointing.completeness import last_complete_checkpoint
from amp_trainer.checkpointing.digests import DIGEST_FILE, has_digests, why_damaged
from amp_trainer.checkpointing.layout import AMP_STATE_FILE, TRAINER_STATE_FILE, checkpoint_step

__all__ = ["check_dcp_folder", "check_resume_files", "check_torch_file", "load_error_reason"]

logger = logging.getLogger(__name__)

# Stock Trainer's and Accelerate's torch files in a checkpoint folder (weights_only readers).
_TORCH_FILE_PATTERNS = (
    "optimizer.pt",
    "scheduler.pt",
    "rng_state*.pth",
    "optimizer*.bin",
    "scheduler*.bin",
    "sampler*.bin",
    "dl_state_dict*.bin",
    "pytorch_model*.bin",
    "random_states_*.pkl",
)
_DCP = "torch.distributed.checkpoint"
# What a torch.distributed.checkpoint .metadata pickle names (torch 2.4 to 2.13): its dataclasses,
# the enum of a tensor's memory format, torch.Size and the path it was saved to.
_METADATA_CLASSES = {
    f"{_DCP}.metadata": {
        "Metadata",
        "MetadataIndex",
        "ChunkStorageMetadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "TensorProperties",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    f"{_DCP}.filesystem": {"_StorageInfo"},
    f"{_DCP}.planner": {"LoadItemType", "WriteItemType"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},  # a layout from its name ("torch.strided")
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice"},
}


class _RefusedGlobal(pickle.UnpicklingError):
    """A global the metadata unpickler refuses (as opposed to bytes that end too soon)."""


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP ``.metadata`` file, refusing any global outside :data:`_METADATA_CLASSES`
    (and torch's dtypes and memory formats, looked up by name) before it is called."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.memory_format):
            return getattr(torch, name)
        raise _RefusedGlobal(f"it names {module}.{name}")


def load_error_reason(err: BaseException) -> str:
    """What a failed ``torch.load(weights_only=True)`` or ``load_state_dict`` says about the
    file, in a few words (never torch's advice to load it with ``weights_only=False``)."""
    text = " ".join(str(err).split())
    if isinstance(err, pickle.UnpicklingError) or "weights_only" in text:
        return (
            "it holds objects other than plain numbers and tensors; refused unread: loading it "
            "could run code"
        )
    if isinstance(err, EOFError) or "zip archive" in text or "central directory" in text:
        return "truncated or not a torch file"
    return f"{type(err).__name__}: {text.split('. ')[0]}" if text else type(err).__name__


def _unreadable(path: Path, reason: str) -> ValueError:
    return ValueError(f"{path} is unreadable ({reason}). Resume from another checkpoint.")


@contextlib.contextmanager
def _numpy_rng_allowed() -> Iterator[None]:
    """numpy's RNG state (in ``rng_state*.pth`` and ``random_states_*.pkl``) allowed, as
    transformers' and Accelerate's own readers allow it (Accelerate's list: numpy arrays and
    dtypes, and ``codecs.encode`` for the RNG state's bytes)."""
    import numpy as np
    from accelerate.utils.other import TORCH_SAFE_GLOBALS

    with torch.serialization.safe_globals([*TORCH_SAFE_GLOBALS, type(np.dtype(np.uint32))]):
        yield


def check_torch_file(path: Path) -> None:
    """Raise one ``ValueError`` naming ``path`` unless ``torch.load(weights_only=True)`` reads it.

    Memory-mapped, so a large ``optimizer.pt`` costs its pickle, not its tensors; a file torch
    cannot map (the pre-1.6 format) is read whole.
    """
    try:
        with _numpy_rng_allowed():
            try:
                torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as err:
                if "mmap" not in str(err):
                    raise
                torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch.load raises many types
        if is_disk_full(err):
            raise
        # torch.save writes a zip archive (since torch 1.6); bytes that are none fail in the
        # unpickler with whatever the bytes happen to spell (an IndexError, "invalid load key").
        reason = (
            load_error_reason(err)
            if zipfile.is_zipfile(path)
            else "not a torch.save file: truncated, overwritten or another format"
        )
        raise _unreadable(path, reason) from err


def _check_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise _unreadable(path, "not text: truncated or overwritten?") from err
    except ValueError as err:
        raise _unreadable(path, f"not JSON: {err}") from err


def _check_trainer_state(path: Path) -> None:
    from transformers.trainer_callback import TrainerState

    data = _check_json(path)
    if not isinstance(data, dict):
        raise _unreadable(path, f"a JSON {type(data).__name__}, not a trainer state object")
    if not isinstance(data.get("global_step"), int):
        raise _unreadable(path, "no integer global_step: not a trainer state")
    try:
        TrainerState.load_from_json(str(path))  # as resuming reads it
    except (TypeError, KeyError, AttributeError) as err:
        raise _unreadable(path, f"not a trainer state ({err})") from err


def _check_amp_state(path: Path) -> None:
    """The shape :class:`~amp_trainer.checkpointing.resume.ResumeAudit` reads."""
    data = _check_json(path)
    if not isinstance(data, dict):
        raise _unreadable(path, f"a JSON {type(data).__name__}, not an object")
    if not isinstance(data.get("loss_scaler", {}), dict):
        raise _unreadable(path, "loss_scaler is not an object")
    history = data.get("scale_history", [])
    if not isinstance(history, list):
        raise _unreadable(path, "scale_history is not a list")
    for index, entry in enumerate(history):
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("step"), int)
            and isinstance(entry.get("skipped"), bool)
            and isinstance(entry.get("scale"), (int, float))
        ):
            raise _unreadable(
                path,
                f"scale_history[{index}] is not an entry with an integer step, a boolean "
                "skipped and a numeric scale",
            )


def _storage_files(folder: Path, metadata: Any) -> Iterator[tuple[str, Path, Any]]:
    """(fqn, file, storage info) of each non-tensor entry in a DCP folder."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    byte_items = {
        fqn
        for fqn, item in (getattr(metadata, "state_dict_metadata", None) or {}).items()
        if isinstance(item, BytesStorageMetadata)
    }
    root = folder.resolve()
    sizes: dict[Path, int | None] = {}
    for index, info in (getattr(metadata, "storage_data", None) or {}).items():
        target = (folder / str(info.relative_path)).resolve()
        if not target.is_relative_to(root):
            raise _unreadable(
                folder / ".metadata", f"it points at {info.relative_path}, outside its folder"
            )
        if target not in sizes:
            sizes[target] = target.stat().st_size if target.is_file() else None
        end = int(info.offset) + int(info.length)
        if sizes[target] is None or end > sizes[target]:
            found = "no file" if sizes[target] is None else f"{sizes[target]} bytes"
            raise ValueError(
                f"{target} is truncated: its .metadata places entry {index.fqn} at bytes "
                f"{info.offset}..{end}, found {found}. The checkpoint holding it is "
                "damaged: resume from another one."
            )
        if index.fqn in byte_items:
            yield index.fqn, target, info


def check_dcp_folder(folder: Path) -> None:
    """Raise one ``ValueError`` naming the file unless the ``torch.distributed.checkpoint``
    folder can be read without running code (see the module docstring).

    Why: DCP's ``FileSystemReader.read_metadata`` is a plain ``pickle.load``, and its planner
    reads non-tensor entries with ``torch.load(weights_only=False)``; both run on every rank.
    """
    for meta in sorted(folder.glob("*.metadata")):
        try:
            with open(meta, "rb") as handle:
                metadata = _MetadataUnpickler(handle).load()
        except _RefusedGlobal as err:
            raise _unreadable(
                meta,
                f"not torch.distributed.checkpoint metadata: {err} (refused unread: "
                "loading it could run code)",
            ) from err
        except Exception as err:  # truncated pickles raise EOFError, ValueError, ...
            if is_disk_full(err):
                raise
            raise _unreadable(
                meta, f"truncated or damaged metadata: {type(err).__name__}: {err}"
            ) from err
        for fqn, target, info in _storage_files(folder, metadata):  # and the shards' sizes
            if getattr(info, "transform_descriptors", None):
                raise _unreadable(
                    target,
                    f"entry {fqn} is stored transformed ({', '.join(info.transform_descriptors)}), "
                    "which this check cannot read without running it",
                )
            try:
                with open(target, "rb") as handle:
                    handle.seek(info.offset)
                    raw = handle.read(info.length)
                torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
            except Exception as err:
                if is_disk_full(err):
                    raise
                raise _unreadable(target, f"entry {fqn}: {load_error_reason(err)}") from err


def check_resume_files(
    checkpoint: str | Path, *, digests: bool = True, digests_checked: bool = False
) -> None:
    """Check every file resuming ``checkpoint`` reads (see the module docstring); raise one
    ``ValueError`` naming the first damaged or unsafe one.

    First, with ``digests``, every file against the checkpoint's
    :data:`~amp_trainer.checkpointing.digests.DIGEST_FILE` (``digests_checked``: already
    compared by the caller), so that damaged bytes are named as damage before any reader sees
    them; a checkpoint without the list is said in one INFO line and gets the checks below.
    """
    folder = Path(checkpoint)
    if not folder.is_dir():
        return  # the loaders say so themselves
    if digests:
        _check_digests(folder, already=digests_checked)
    if (folder / TRAINER_STATE_FILE).is_file():
        _check_trainer_state(folder / TRAINER_STATE_FILE)
    if (folder / AMP_STATE_FILE).is_file():
        _check_amp_state(folder / AMP_STATE_FILE)
    for pattern in _TORCH_FILE_PATTERNS:
        for path in sorted(folder.glob(pattern)):
            if path.is_file():
                check_torch_file(path)
    for dcp_folder in sorted({meta.parent for meta in folder.glob("*/*.metadata")}):
        check_dcp_folder(dcp_folder)
    if any(folder.glob("*.metadata")):
        check_dcp_folder(folder)


def _check_digests(folder: Path, *, already: bool) -> None:
    """One ``ValueError`` naming the first file of ``folder`` that differs from its digest
    list, what was expected and found, and the last intact checkpoint before it (if any)."""
    if not has_digests(folder):
        logger.info(
            "%s has no %s (saved by an older version, or with checkpoint_digests=False): its "
            "files are not compared with digests",
            folder,
            DIGEST_FILE,
        )
        return
    reason = None if already else why_damaged(folder)
    if reason is None:
        return
    step = checkpoint_step(folder)
    older = (
        last_complete_checkpoint(folder.parent, warn=False, before=step)
        if step is not None
        else None
    )
    raise ValueError(
        f"{reason}. The checkpoint {folder} is damaged (its files differ from {DIGEST_FILE}, "
        "written when it was saved): "
        + (
            f"resume from {older}, the last intact checkpoint before it."
            if older
            else "resume from another checkpoint; no intact one is before it."
        )
        + f" If the file was changed on purpose, delete {DIGEST_FILE} to resume it unchecked."
    )


def check_best_model_checkpoint(
    named: str | None, output_dir: str | Path, source: str, *, digests: bool = True
) -> None:
    """Check the folder ``trainer_state.json`` names as ``best_model_checkpoint`` as the resumed
    folder is checked, before ``load_best_model_at_end`` reads it.

    Why: transformers' ``_load_best_model`` reads that folder at the end of training (under
    FSDP through DCP's plain ``pickle.load``), and a resumed checkpoint from elsewhere can name
    any folder. One in this run's ``output_dir`` gets every check :func:`check_resume_files`
    makes; one outside it is refused unread (a checkpoint's own run writes its best model
    inside its ``output_dir``). ``source`` names where the path was read, for the message;
    ``digests``: compare the files with their recorded digests first.
    """
    if not named:
        return
    folder = Path(named)
    root = Path(output_dir).resolve()
    resolved = folder.resolve()
    if resolved != root and root not in resolved.parents:
        raise ValueError(
            f"{source} names best_model_checkpoint={named!r}, which lies outside output_dir "
            f"{str(root)!r}: refused unread (load_best_model_at_end would load it, and under "
            "FSDP reading it can run code). Move the checkpoint folder into output_dir, or set "
            "best_model_checkpoint to null in that trainer_state.json."
        )
    check_resume_files(folder, digests=digests)
