"""Write files so that a reader sees either the old file or the whole new one, never a torn one.

Every file the library leaves behind (cached tokenizers, metrics.json, reports, plots) goes
through here: the content is written to a temporary file in the target's own folder (same file
system, so the rename is atomic) and renamed over the target; on any failure the temporary file
is removed. ``accelerate launch`` ranks that build the same cache entry at once are safe too.
:func:`sha256_of` is how such a file is recognised later (export reports, checkpoint digests).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "atomic_path",
    "is_disk_full",
    "sha256_of",
    "write_json_atomic",
    "write_text_atomic",
]


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on success it is renamed to ``path``.

    For writers that want a file name rather than text (``figure.savefig(tmp)``).
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        # mkstemp makes the file private (0600); results are meant to be shared like any file.
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically; returns the path."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def write_json_atomic(
    path: str | os.PathLike[str], data: Any, *, default: Callable[[Any], Any] | None = None
) -> Path:
    """Write ``data`` as indented JSON atomically.

    Non-finite floats become ``null`` rather than the non-standard ``NaN``/``Infinity`` that
    :func:`json.dumps` emits by default and strict parsers reject.
    """
    text = json.dumps(_finite_or_none(data), indent=2, sort_keys=True, default=default)
    return write_text_atomic(path, text + "\n")


# How "disk full" reads when it did not arrive as OSError(ENOSPC): safetensors' Rust writer
# (``IoError(Os { code: 28, kind: StorageFull ...``); torch's zip writer has no words for it.
_DISK_FULL_TEXT = ("no space left on device", "storagefull", "os error 28", "code: 28")


def is_disk_full(err: BaseException, folder: str | os.PathLike[str] | None = None) -> bool:
    """Whether ``err`` (or what caused it) is a write that failed because the disk is full.

    Libraries report it in different words: ``OSError(ENOSPC)`` from Python, a ``SafetensorError``
    quoting the OS error, and torch's ``PytorchStreamWriter`` a bare "file write failed" (no
    errno). For that last one, ``folder``'s file system is asked whether it is (nearly) full.
    """
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(current).lower()
        if any(words in text for words in _DISK_FULL_TEXT):
            return True
        current = current.__cause__ or current.__context__
    if folder is not None and isinstance(err, (OSError, RuntimeError)):
        # torch's writer reports it as "file write failed", "basic_ios::clear: iostream error"
        # or "unexpected pos N vs M": no errno. Less than 1 MiB left means the failed write is
        # what filled the disk.
        with contextlib.suppress(OSError):
            return _free_bytes(folder) < 2**20
    return False


def _free_bytes(folder: str | os.PathLike[str]) -> int:
    path = Path(folder)
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def _finite_or_none(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(key): _finite_or_none(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_none(item) for item in value]
    return value


def sha256_of(file: str | os.PathLike[str]) -> str:
    """The hex SHA-256 of ``file``, read in 1 MiB blocks (weights files can be gigabytes)."""
    digest = hashlib.sha256()
    with open(file, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
