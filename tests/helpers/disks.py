"""Real small file systems for the disk-full tests: a tmpfs of a given size (root only)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest


def tiny_disk(path: Path, size: str, skip_note: str = "") -> Callable[[], object]:
    """Mount a tmpfs of ``size`` (``"32k"``) at ``path`` and return the call that unmounts it.

    Only root can mount one: elsewhere the test is skipped, the reason ending in ``skip_note``
    (which test covers the case without a real disk, say)."""
    path.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    )
    if result.returncode != 0:
        reason = f"cannot mount a tmpfs here (needs root): {result.stderr.decode().strip()}"
        pytest.skip(reason + skip_note)
    return lambda: subprocess.run(["umount", "-l", str(path)], check=False)
