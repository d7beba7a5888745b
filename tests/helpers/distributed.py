"""Two gloo ranks under torchrun, as the distributed tests start them, and what their workers
(``tests/distributed/workers/``) need to end cleanly."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.repo import REPO_ROOT, subprocess_env


def _accelerate_loads_fsdp2_optimizer_state_by_name() -> bool:
    """Whether Accelerate's ``load_fsdp_optimizer`` builds the DCP load target with
    ``get_optimizer_state_dict`` (parameter names as keys), as 1.13.0 and later do
    (huggingface/accelerate#3904). Before, it loads into a fresh ``optimizer.state_dict()`` (no
    state, integer keys), so no saved AdamW state is read and the resumed run steps from zero
    moments. A feature check on the function itself, not on a version number."""
    from accelerate.utils import fsdp_utils

    return "get_optimizer_state_dict" in inspect.getsource(fsdp_utils.load_fsdp_optimizer)


XFAIL_FSDP2_OPTIMIZER_NOT_RESUMED = pytest.mark.xfail(
    not _accelerate_loads_fsdp2_optimizer_state_by_name(),
    reason="this accelerate's load_state/load_fsdp_optimizer under FSDP2 restores no optimizer "
    "state (loads DCP into optimizer.state_dict(), not get_optimizer_state_dict; fixed by "
    "huggingface/accelerate#3904 in 1.13.0)",
    strict=True,
)

#: The scripts :func:`run_two_gloo_ranks` starts (each takes the folder it writes to).
WORKERS = REPO_ROOT / "tests" / "distributed" / "workers"


def run_two_gloo_ranks(
    worker: Path, out_dir: Path, *args: str, timeout: float = 300, check: bool = True
) -> subprocess.CompletedProcess:
    """Run ``worker out_dir *args`` as two gloo ranks under torchrun (``--standalone`` picks a
    free port), as a user's ``torchrun --nproc_per_node 2`` would; fail with both ranks' output
    (unless ``check`` is false: a run expected to fail, e.g. one whose rank is killed).

    The worker writes what the tests check into ``out_dir`` (``rank<N>.json`` and tensors).
    torchrun runs in a process group of its own, ended whole (:func:`end_process_group`) when it
    runs past ``timeout`` or fails: killing torchrun alone left its workers running, burning CPU
    for the rest of the suite."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(worker),
        str(out_dir),
        *args,
    ]
    proc = subprocess.Popen(
        command,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
        start_new_session=True,  # its own process group: torchrun and its workers
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        end_process_group(proc)
        stdout, stderr = proc.communicate()
        pytest.fail(
            f"torchrun {worker.name} did not finish in {timeout:g} s; its process group (torchrun "
            f"and both ranks) was ended\n{stdout[-2000:]}{stderr[-4000:]}",
            pytrace=False,
        )
    finally:
        end_process_group(proc)  # a rank left behind by a failed or finished run, if any
    if check:
        assert proc.returncode == 0, stdout[-2000:] + stderr[-4000:]
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def end_process_group(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """End every process in ``proc``'s process group (``proc`` started with
    ``start_new_session=True``): SIGTERM, up to ``grace`` seconds to exit, then SIGKILL.

    No-op when the group is gone. ``proc`` itself is reaped, so that it does not linger as a
    zombie member of the group."""
    import signal
    import time

    pgid = proc.pid  # a session leader's group id is its pid
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + (grace if sig == signal.SIGTERM else 10.0)
        while time.monotonic() < deadline:
            proc.poll()  # reap torchrun once it exits
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)


def leave_without_teardown() -> None:
    """End a torchrun worker after its results are written: a barrier, then ``os._exit(0)``.

    A Trainer worker's C++ background threads (gloo, checkpointing) still alive at interpreter
    exit sometimes abort a rank ("terminate called without an active exception", about one run
    in five under pytest) after all its work was written; the exit itself is not under test.
    """
    import torch.distributed as dist

    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
