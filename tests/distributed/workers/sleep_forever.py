"""A torchrun worker that never finishes: it writes ``rank<N>.pid`` into the folder given, then
sleeps (tests/distributed/test_gloo_ranks_harness.py checks that a timeout ends it)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

out_dir = Path(sys.argv[1])
(out_dir / f"rank{os.environ['RANK']}.pid").write_text(str(os.getpid()))
while True:
    time.sleep(60)
