"""A digest of every file in a checkpoint, written when it is saved and compared before a resume.

Damaged bytes in a checkpoint reach the loaders unnamed: a truncated FSDP shard
(``__K_0.distcp``) is torch's ``PytorchStreamReader failed reading zip archive`` on every rank,
and flipped bytes in a shard, in ``model.safetensors`` or in ``optimizer.pt`` load without a word,
so the resumed run trains on other weights and fails later, if ever, far from the cause. So every
checkpoint :class:`~amp_trainer.checkpointing.saving.CheckpointSaver` writes ends with
:data:`DIGEST_FILE`: the size and SHA-256 of each of its files (every rank's, every sub-folder's),
written atomically by the main process once every rank wrote its part, before the in-progress
marker is removed. A resume compares each listed file with it before anything reads one
(:func:`why_damaged`); a file that differs is named with what was expected and what was found.

SHA-256 because it is the fastest of hashlib's digests where the CPU has SHA instructions
(SHA-NI on x86, ARMv8's); without them BLAKE2b would be faster. Files are hashed on a few
threads (hashlib releases the GIL); ``python -m benchmarks run checkpoint`` measures the cost.

What the digests guard: bytes changed or lost after the save (a disk, a copy, a transfer, a
partial sync). Not a deliberate change: whoever can rewrite a file can rewrite the list too.
Files added to the folder after the save are not listed and not checked. A listed file that is
gone is left to the checks that say what its absence costs (a rank's shard or RNG state:
:mod:`~amp_trainer.checkpointing.completeness`; the optimizer, scheduler or scaler state: the
resume's warning), so that deleting ``scaler.pt`` starts the loss scaler afresh, said in a
warning. A checkpoint without the list (saved by an older version, or with
``checkpoint_digests=False``) resumes unchecked.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from amp_trainer.atomic_files import sha256_of, write_json_atomic
from amp_trainer.checkpointing.layout import INCOMPLETE_MARKER

__all__ = [
    "ALGORITHM",
    "DIGEST_FILE",
    "file_digest",
    "has_digests",
    "why_damaged",
    "write_digests",
]

#: The list of a checkpoint's files, their sizes and digests; written last.
DIGEST_FILE = "checkpoint-digests.json"
ALGORITHM = "sha256"
_FORMAT = 1
# Files never listed: the list itself and the marker that is removed after it.
_UNLISTED = {DIGEST_FILE, INCOMPLETE_MARKER}


def file_digest(path: Path) -> str:
    """The hex SHA-256 of the file at ``path``."""
    return sha256_of(path)


def _workers(count: int) -> int:
    return max(1, min(count, 8, os.cpu_count() or 1))


def _listed_files(folder: Path) -> list[Path]:
    """Every file under ``folder`` except :data:`_UNLISTED` and temporary files being written."""
    return sorted(
        path
        for path in folder.rglob("*")
        if path.is_file()
        and path.name not in _UNLISTED
        and not (path.name.startswith(".") and path.name.endswith(".tmp"))
    )


def write_digests(folder: str | os.PathLike[str]) -> Path:
    """Write :data:`DIGEST_FILE` in ``folder``: the size and digest of every file under it."""
    folder = Path(folder)
    files = _listed_files(folder)
    with ThreadPoolExecutor(_workers(len(files))) as pool:
        digests = list(pool.map(file_digest, files))
    entries = {
        path.relative_to(folder).as_posix(): {"size": path.stat().st_size, ALGORITHM: digest}
        for path, digest in zip(files, digests, strict=True)
    }
    return write_json_atomic(
        folder / DIGEST_FILE, {"format": _FORMAT, "algorithm": ALGORITHM, "files": entries}
    )


def _read_list(folder: Path) -> dict[str, dict[str, Any]] | str:
    """The listed files (name: entry), or why the list itself is damaged."""
    try:
        data = json.loads((folder / DIGEST_FILE).read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        return f"{DIGEST_FILE} is not text (truncated or overwritten?)"
    except ValueError as err:
        return f"{DIGEST_FILE} is not JSON (truncated?): {err}"
    if not isinstance(data, dict) or data.get("algorithm") != ALGORITHM:
        return f"{DIGEST_FILE} is not a list of {ALGORITHM} digests"
    files = data.get("files")
    if not isinstance(files, dict) or not all(
        isinstance(e, dict) and isinstance(e.get("size"), int) and isinstance(e.get(ALGORITHM), str)
        for e in files.values()
    ):
        return f"{DIGEST_FILE} does not list files with their size and {ALGORITHM}"
    return files


def _mismatch(folder: Path, name: str, entry: dict[str, Any]) -> str | None:
    """What is wrong with listed file ``name`` (``None``: it matches its entry)."""
    path = folder / name
    size, digest = entry["size"], entry[ALGORITHM]
    if ".." in Path(name).parts or Path(name).is_absolute():
        return f"{folder / DIGEST_FILE} lists {name}, outside its folder"
    if not path.is_file():
        return None  # a missing file is named by the checks that know what it costs
    found = path.stat().st_size
    if found != size:
        kind = "truncated" if found < size else "longer than saved"
        return f"{path}: expected {size} bytes, found {found} ({kind})"
    actual = file_digest(path)
    if actual != digest:
        return (
            f"{path}: expected {ALGORITHM} {digest[:16]}..., found {actual[:16]}... (same size, "
            f"{size} bytes: its bytes changed)"
        )
    return None


def has_digests(folder: str | os.PathLike[str]) -> bool:
    """Whether ``folder`` holds :data:`DIGEST_FILE`."""
    return (Path(folder) / DIGEST_FILE).is_file()


def why_damaged(folder: str | os.PathLike[str]) -> str | None:
    """How ``folder``'s files differ from its :data:`DIGEST_FILE` (the first file that does,
    with what was expected and found), ``None`` when all match or there is no list."""
    folder = Path(folder)
    if not has_digests(folder):
        return None
    files = _read_list(folder)
    if isinstance(files, str):
        return f"{folder / DIGEST_FILE}: {files}"
    names = sorted(files)
    with ThreadPoolExecutor(_workers(len(names))) as pool:
        problems = pool.map(lambda name: _mismatch(folder, name, files[name]), names)
        return next((problem for problem in problems if problem is not None), None)
