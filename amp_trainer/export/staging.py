"""What the export puts on disk: sizes, free space, and the filesystem transaction.

Step 4 of :mod:`amp_trainer.export`'s flow. Everything is written into a hidden staging folder
next to the output folder and renamed into place at the end, so a refused, failed or killed
export never leaves a partial folder; the next export cleans up after a killed one. An existing
output folder is replaced only when an earlier export wrote every file in it.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Collection
from pathlib import Path

from torch import nn

from amp_trainer.atomic_files import sha256_of

logger = logging.getLogger(__name__)

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")


def human_bytes(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    return f"{value:.1f} GiB"  # pragma: no cover - unreachable


def weights_bytes(folder: Path) -> int:
    return sum(
        p.stat().st_size
        for p in folder.iterdir()
        if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES) and "tokenizer" not in p.name
    )


def fp32_bytes(model: nn.Module) -> int:
    """Bytes the model's state would take as FP32 safetensors (shared storages counted once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for tensor in model.state_dict().values():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        itemsize = 4 if tensor.is_floating_point() else tensor.element_size()
        total += tensor.numel() * itemsize
    return total


# Hidden siblings of the output folder while an export runs: ``.NAME.tmp-PID-XXXXXXXX`` is the
# staging folder being written, ``.NAME.old-PID-XXXXXXXX`` the previous export moved aside for the
# instant between the two renames of install(). The PID says whether their writer is still alive.
# Only a name of exactly this shape (8 lowercase hex digits from uuid4) is ever taken for a
# leftover: a user's ``.NAME.old-backup/`` beside the output is theirs, not ours to delete.
_STAGING, _TRASH = "tmp", "old"


def _sibling(target: Path, kind: str) -> Path:
    return target.with_name(f".{target.name}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _leftover_name(target: Path) -> re.Pattern[str]:
    """The names :func:`_sibling` gives ``target``'s staging and moved-aside folders."""
    kinds = "|".join((_STAGING, _TRASH))
    return re.compile(rf"\.{re.escape(target.name)}\.(?P<kind>{kinds})-(?P<pid>\d+)-[0-9a-f]{{8}}")


def new_staging_folder(target: Path) -> Path:
    """Create the empty staging folder for an export to ``target`` (a hidden sibling of it)."""
    staging = _sibling(target, _STAGING)
    staging.mkdir()  # the umask's permissions: mkdtemp's drwx------ would become the output's
    return staging


def _writer_alive(pid: int) -> bool:
    """Whether the export process ``pid`` that named a leftover still runs (then it is not
    stale)."""
    if pid == os.getpid():
        return False  # our own leftovers from an earlier call in this process
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, someone else's
        return True
    return True


def clean_stale_staging(target: Path) -> list[str]:
    """Remove what a killed export left next to ``target``; returns one note per folder.

    A staging folder of a dead export is deleted. A previous export that was moved aside when
    the export died (between the two renames of :func:`install`) is put back if ``target`` is
    missing, else deleted. Only folders named as :func:`_sibling` names them are touched, and a
    moved-aside folder only when it is empty or an earlier export (its ``report.json`` lists
    every file in it).
    """
    notes: list[str] = []
    if not target.parent.is_dir():
        return notes
    pattern = _leftover_name(target)
    leftovers = []
    for folder in sorted(target.parent.iterdir()):
        match = pattern.fullmatch(folder.name)
        if match and folder.is_dir() and not _writer_alive(int(match["pid"])):
            leftovers.append((match["kind"], folder))
    # Moved-aside exports first: one may have to be put back before staging folders go.
    for kind, folder in sorted(leftovers, key=lambda item: item[0] != _TRASH):
        if kind == _TRASH and not _is_earlier_export_or_empty(folder):
            continue
        if kind == _TRASH and not target.exists():
            os.replace(folder, target)
            note = f"restored the previous export {target} from {folder.name}, which an "
            note += "interrupted export had moved aside"
        else:
            shutil.rmtree(folder, ignore_errors=True)
            note = f"removed {folder}, left behind by an interrupted export"
        logger.warning("%s", note)
        notes.append(note)
    return notes


def _is_earlier_export_or_empty(folder: Path) -> bool:
    entries = {entry.name for entry in folder.iterdir()}
    written = _files_of_earlier_export(folder)
    return not entries or (written is not None and entries <= written)


def install(staging: Path, target: Path) -> None:
    """Move the finished staging folder to ``target``, replacing an existing one last."""
    if target.exists():
        trash = _sibling(target, _TRASH)
        os.replace(target, trash)
        os.replace(staging, target)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(staging, target)


def check_output_dir(target: Path, source: Path | None, overwrite: bool) -> None:
    """Refuse an ``output_dir`` whose replacement would delete anything but an earlier export.

    The export replaces ``target`` as a whole, so ``target`` must not be the source folder,
    contain it (a parent folder: sibling runs with it) or lie inside it; and ``overwrite`` only
    replaces a folder every entry of which an earlier export wrote (its ``report.json`` lists
    them), never a run folder or anything a user put there.
    """
    if source is not None:
        if target == source:
            raise ValueError(
                f"output_dir {target} is the source model folder; the export would replace the "
                "FP32 model with its FP16 copy. Choose another output_dir."
            )
        if target in source.parents:
            raise ValueError(
                f"output_dir {target} contains the source model folder {source}; replacing it "
                "would delete the source and everything next to it. Choose another output_dir."
            )
        if source in target.parents:
            raise ValueError(
                f"output_dir {target} lies inside the source model folder {source}; write the "
                "export next to the model, not into it."
            )
    if not target.exists():
        return
    if not target.is_dir():
        raise FileExistsError(f"output_dir {target} exists and is not a folder")
    entries = sorted(entry.name for entry in target.iterdir())
    if not entries:
        return
    if not overwrite:
        raise FileExistsError(f"{target} already exists and is not empty; pass overwrite=True")
    written = _files_of_earlier_export(target)
    if written is None:
        raise FileExistsError(
            f"{target} is not an earlier FP16 export (no report.json written by export_fp16); "
            "overwrite replaces only such a folder. Remove it yourself or choose another "
            "output_dir."
        )
    foreign = [name for name in entries if name not in written]
    if foreign:
        shown = ", ".join(foreign[:5]) + (" ..." if len(foreign) > 5 else "")
        raise FileExistsError(
            f"{target} holds files an earlier export did not write ({shown}); overwrite "
            "replaces only what export_fp16 wrote. Move them away or choose another output_dir."
        )


def check_report_path(report: Path, source: Path | None, target: Path, overwrite: bool) -> None:
    """Refuse a separate report path (the CLI's ``--report``) that could destroy anything.

    The guards of the output folder, for one file: not in the source model folder (its
    ``config.json`` is one name away), not in the output folder (the export replaces it and
    writes its own ``report.json`` there), not a folder, and an existing file only with
    ``overwrite`` and only when it is an earlier export's report. Called before the export runs,
    so a refused path costs nothing.

    Raises:
        ValueError: one line saying why the path is refused and what would be valid.
    """
    report = report.resolve()
    if source is not None and (report == source or source in report.parents):
        raise ValueError(
            f"{report} lies inside the source model folder {source}; writing it could replace "
            "the model's own files. Write the report outside the model folder."
        )
    if report == target or target in report.parents:
        raise ValueError(
            f"{report} lies inside the output folder {target}, which the export replaces and "
            "where it writes report.json itself. Choose a path outside it."
        )
    if not report.parent.is_dir():
        raise ValueError(f"{report}: directory {report.parent} does not exist")
    if report.is_dir():
        raise ValueError(f"{report} is a folder; give a file path for the report")
    if not report.exists():
        return
    if not overwrite:
        raise ValueError(f"{report} already exists; pass --overwrite to replace an earlier report")
    if _files_of_earlier_export(report.parent, report.name) is None:
        raise ValueError(
            f"{report} exists and is not a report an earlier export wrote; --overwrite replaces "
            "only such a file. Choose another path."
        )


def _files_of_earlier_export(folder: Path, name: str = "report.json") -> set[str] | None:
    """The file names ``folder/name`` (a report.json) says an earlier :func:`export_fp16`
    wrote; ``None`` when it is not such a report."""
    try:
        report = json.loads((folder / name).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(report, dict) or not {"source", "parity", "files"} <= set(report):
        return None
    files = report["files"]
    if not isinstance(files, list) or not all(isinstance(name, str) for name in files):
        return None
    return set(files)


def check_free_space(folder: Path, needed: int) -> None:
    """Refuse up front when ``folder``'s disk cannot take ``needed`` bytes."""
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return
    if free < needed:
        raise OSError(
            errno.ENOSPC,
            f"no space left on device for the FP16 export in {folder}: it needs about "
            f"{human_bytes(needed)}, {human_bytes(free)} free",
        )


def digests(folder: Path, skip: Collection[str] = ()) -> dict[str, str]:
    """``{file name: sha256}`` of every file in ``folder`` but ``skip`` (``report.json``, which
    holds them)."""
    return {
        p.name: sha256_of(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name not in skip
    }


def _read_by_load(name: str) -> bool:
    """Whether ``load_fp16_export`` reads a file of this name (weights, their index, configs)."""
    return name.endswith((".safetensors", ".safetensors.index.json")) or name in (
        "config.json",
        "generation_config.json",
    )


def check_digests(folder: Path, skip: Collection[str] = ()) -> int:
    """Check every file ``folder/report.json`` records a SHA-256 for (but ``skip``) against it.

    What this guards: accidental damage since the export (a flipped bit, a half-finished copy, a
    file lost). Not a deliberate change: whoever rewrites a weights file can rewrite its digest in
    ``report.json`` too. A file the load reads that has nothing to be checked against (no
    ``report.json``, no ``sha256`` block, no entry for it) is one warning naming it.

    Returns the number of files checked.

    Raises:
        ValueError: one line naming the first file that is missing or whose bytes changed since
            the export wrote it, or a ``report.json`` that does not read.
    """
    report_file = folder / "report.json"
    read = sorted(p.name for p in folder.iterdir() if p.is_file() and _read_by_load(p.name))
    if not report_file.is_file():
        logger.warning(
            "%s is missing: %s not checked against the digests the export recorded (restore "
            "report.json from the export, or pass verify=False to say you load it as it is)",
            report_file,
            ", ".join(read) or "the folder's files are",
        )
        return 0
    try:
        report = json.loads(report_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ValueError(f"{report_file} is unreadable ({err}): truncated or not JSON") from None
    recorded = report.get("sha256") if isinstance(report, dict) else None
    if not isinstance(recorded, dict):
        logger.warning(
            "%s records no sha256 digests: %s not checked (an export writes them; restore its "
            "report.json)",
            report_file,
            ", ".join(read) or "the folder's files are",
        )
        return 0
    unrecorded = [name for name in read if name not in recorded and name not in skip]
    if unrecorded:
        logger.warning(
            "%s records no sha256 for %s: %s not checked (the export recorded every file it "
            "wrote; this one was added or its entry removed since)",
            report_file,
            ", ".join(unrecorded),
            "it is" if len(unrecorded) == 1 else "they are",
        )
    checked = 0
    for name, expected in sorted(recorded.items()):
        if name in skip:
            continue
        if not isinstance(name, str) or Path(name).name != name or not isinstance(expected, str):
            raise ValueError(f"{report_file}: {name!r} is not a file name of the export folder")
        file = folder / name
        if not file.is_file():
            raise ValueError(
                f"{file} is missing: the export wrote it (report.json records its sha256); "
                "restore the folder or export again"
            )
        if sha256_of(file) != expected:
            raise ValueError(
                f"{file} does not match the sha256 report.json recorded when the export wrote "
                "it: the file was damaged or changed since. Export again, or restore the folder "
                "(load_fp16_export(..., verify=False) loads it as it is)"
            )
        checked += 1
    return checked
