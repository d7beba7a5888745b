"""The checkout under test, and the environment of a subprocess that runs it as a user would."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for tests that run the project as a user would (a subprocess).

    PYTHONPATH points at this checkout so the child imports the code under test, not whatever
    copy of amp_trainer happens to be installed.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env
