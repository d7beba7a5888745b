"""The README's Python examples run as printed (so the README cannot drift from the code)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from conftest import REPO_ROOT, subprocess_env

BLOCKS = re.findall(r"```python\n(.*?)```", (REPO_ROOT / "README.md").read_text(), re.S)


def test_readme_has_python_examples():
    assert BLOCKS, "README.md lost its Python examples"


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_example_runs(index, tmp_path):
    if re.search(r"^from trl import", BLOCKS[index], re.M):
        # TRL is an optional test extra; the lowest-versions CI environment cannot install it.
        pytest.importorskip("trl", reason="the TRL example needs the test extra (.[test])")
    script = tmp_path / f"readme_example_{index}.py"
    script.write_text(BLOCKS[index])
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
