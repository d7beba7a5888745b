"""The two-rank torchrun helper of the distributed tests
(``tests.helpers.distributed.run_two_gloo_ranks``): a run that hangs is reported as a timeout and
leaves no worker behind to burn CPU for the rest of the suite."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.helpers.distributed import WORKERS, run_two_gloo_ranks

pytestmark = pytest.mark.slow

WORKER = WORKERS / "sleep_forever.py"
TIMEOUT = 15  # torchrun and two python workers start in a few seconds even on a loaded CPU


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs. A zombie (exited, not yet reaped by its new parent after
    torchrun went) runs nothing and counts as ended."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_hung_run_is_reported_as_a_timeout_and_leaves_no_worker(tmp_path):
    with pytest.raises(pytest.fail.Exception, match=rf"did not finish in {TIMEOUT} s"):
        run_two_gloo_ranks(WORKER, tmp_path, timeout=TIMEOUT)
    pids = [int((tmp_path / f"rank{rank}.pid").read_text()) for rank in (0, 1)]
    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if _alive(pid)], f"workers {pids} outlived the test"
