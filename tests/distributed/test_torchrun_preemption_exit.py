"""What an orchestrator sees when it terminates a torchrun launch of preempted ranks.

Each rank of workers/preempted_ranks.py ends on SIGTERM as a recipe rank with
``--enable_jit_checkpoint`` does (one line, exit 143, through the recipes' entry point). SIGTERM
goes to the launched process only, as Kubernetes sends it to the container's main process.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.distributed import WORKERS, end_process_group
from tests.helpers.repo import REPO_ROOT, subprocess_env

pytestmark = pytest.mark.slow

ENTRYPOINT = REPO_ROOT / "scripts" / "preemptible.sh"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def _terminated(command: list[str], out_dir: Path) -> subprocess.CompletedProcess:
    """Start ``command``, SIGTERM it once both ranks wait, and return how it ended."""
    proc = subprocess.Popen(
        command,
        env=subprocess_env(),
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not all((out_dir / f"rank{r}.pid").exists() for r in (0, 1)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        end_process_group(proc)
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def test_torchrun_exits_1_on_sigterm_though_each_rank_exits_143(tmp_path):
    done = _terminated([*TORCHRUN, str(WORKERS / "preempted_ranks.py"), str(tmp_path)], tmp_path)
    assert done.returncode == 1, done.stderr[-3000:]
    assert done.stderr.count("preempted_rank: stopped by SIGTERM") == 2
    assert "SignalException" in done.stderr  # torch's own traceback, not ours


def test_the_preemption_entrypoint_ends_a_terminated_torchrun_with_143(tmp_path):
    worker = [str(WORKERS / "preempted_ranks.py"), str(tmp_path)]
    done = _terminated(["bash", str(ENTRYPOINT), *TORCHRUN, *worker], tmp_path)
    assert done.returncode == 143, done.stderr[-3000:]
    assert done.stderr.count("preempted_rank: stopped by SIGTERM") == 2  # both ranks saved


def test_the_preemption_entrypoint_passes_a_normal_exit_status_through(tmp_path):
    code = "import sys; sys.exit(3)"
    done = subprocess.run(["bash", str(ENTRYPOINT), sys.executable, "-c", code], timeout=60)
    assert done.returncode == 3
