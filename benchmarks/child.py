"""A benchmark's child processes: the environment they run in, and their wall time and load.

Topics that time a whole program (a recipe, a Trainer run, another topic) run it as a child
process of this checkout: :func:`repo_env` puts the checkout first on ``PYTHONPATH`` so the child
imports the code being measured, not an installed copy, and :func:`timed_run` records the wall
time with the 1-minute load average before and after, so a slow run on a busy machine says so.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.machine import REPO


def repo_env(**overrides: str) -> dict[str, str]:
    """This process's environment with ``overrides`` and the checkout first on ``PYTHONPATH``."""
    env = dict(os.environ, **overrides)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def load_average() -> list[float]:
    """The 1-, 5- and 15-minute load averages, to two decimals."""
    return [round(v, 2) for v in os.getloadavg()]


def timed_run(
    cmd: Sequence[str], cwd: Path, env: dict[str, str]
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """Run ``cmd`` to completion (output captured as text) and return it with ``wall_s`` (its
    wall time, unrounded), ``load_before`` and ``load_after``."""
    load_before = load_average()
    started = time.perf_counter()
    proc = subprocess.run(list(cmd), cwd=cwd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    return proc, {"wall_s": wall, "load_before": load_before, "load_after": load_average()}
