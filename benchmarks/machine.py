"""The one description of the machine a benchmark ran on, for every topic of ``benchmarks/``.

A timing means little without the CPU (and its FP16/BF16 instructions), the cores the process may
use, the load from other processes, the library versions and the code's commit. Every topic
records :func:`describe_machine` in its JSON and :func:`format_machine` in its Markdown header,
so that every result file names CPU model, flags, cores, load and commit in the same words.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

#: The CPU flags that decide how fast FP32, FP16 and BF16 run on a CPU, in this order.
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile", "f16c", "fma")
REPO = Path(__file__).resolve().parent.parent


def _cpuinfo_field(name: str) -> str | None:
    """The first ``name : value`` line of ``/proc/cpuinfo`` (None where there is none)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, sep, value = line.partition(":")
            if sep and key.strip().lower() == name:
                return value.strip()
    return None


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; ``platform.processor()`` elsewhere)."""
    return _cpuinfo_field("model name") or platform.processor() or platform.machine() or "unknown"


def cpu_flags() -> list[str] | None:
    """Which of :data:`CPU_FLAGS` the CPU has (None where ``/proc/cpuinfo`` cannot tell)."""
    flags = _cpuinfo_field("flags") or _cpuinfo_field("features")  # x86, Arm
    if flags is None:
        return None
    present = set(flags.split())
    return [flag for flag in CPU_FLAGS if flag in present]


def git_commit(repo: Path = REPO) -> dict[str, Any] | None:
    """``{"commit": short hash, "dirty": tracked files changed}``; None outside a git checkout."""

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", *args], cwd=repo, capture_output=True, text=True, timeout=30, check=True
        )
        return done.stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": dirty}


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def describe_machine() -> dict[str, Any]:
    """What a timing or a result depends on: CPU, cores, load, library versions, commit, GPU."""
    import torch

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    load = [round(v, 2) for v in os.getloadavg()] if hasattr(os, "getloadavg") else None
    return {
        "cpu": cpu_model(),
        "cpu_flags": cpu_flags(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "native_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "load_average": load,
        "git": git_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "accelerate": _version("accelerate"),
        "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def format_machine(d: dict[str, Any]) -> str:
    """:func:`describe_machine`'s dict as one line for a report header."""
    flags = d.get("cpu_flags")
    if flags is None:
        flag_text = "flags unknown"
    else:
        flag_text = ", ".join(flags) or "none of " + " ".join(CPU_FLAGS)
    load = d.get("load_average")
    git = d.get("git")
    if git is None:
        commit = "not a git checkout"
    else:
        commit = git["commit"] + (" (dirty)" if git["dirty"] else "")
    versions = [
        f"Python {d['python']}",
        f"torch {d['torch']} ({d['torch_threads']} thread(s) in the describing process)",
    ]
    versions += [f"{name} {d[name]}" for name in ("transformers", "accelerate") if d.get(name)]
    parts = [
        f"CPU {d['cpu']} ({flag_text}), torch capability {d['cpu_capability']}, "
        f"native BF16: {d['native_bf16']}",
        f"{d['cores']} logical cores, {d['usable_cores']} usable",
        "load average " + (" ".join(f"{v:.2f}" for v in load) if load else "n/a"),
        f"GPU: {d.get('gpu') or 'none'}",
        ", ".join(versions),
        f"commit {commit}",
    ]
    return "; ".join(parts)
