"""A torchrun worker that stops as a preempted recipe rank does: SIGTERM ends it with the
recipes' one line (``RunPreempted``) and exit 143, through the recipes' own entry point.

It writes ``rank<N>.pid`` into the folder given once its handler is in place, then waits.
tests/distributed/test_torchrun_preemption_exit.py terminates torchrun and checks what the
orchestrator sees.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from amp_trainer.entry_point import run_entry_point
from amp_trainer.recipes.resume import RunPreempted


def _preempted(signum, frame):
    raise RunPreempted("stopped by SIGTERM (--enable_jit_checkpoint); checkpoint-1 saved")


def main() -> None:
    signal.signal(signal.SIGTERM, _preempted)
    (Path(sys.argv[1]) / f"rank{os.environ['RANK']}.pid").write_text(str(os.getpid()))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(run_entry_point(main, "preempted_rank"))
