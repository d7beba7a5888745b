"""The Python examples in README.md and docs/ run as printed (the docs cannot drift from the code).

Every ```python block of README.md and docs/**/*.md runs in a fresh subprocess, in an empty
folder. A block that cannot run here (it needs a GPU or the network) carries an HTML comment on
the line right before its fence, ``<!-- no-test: the reason -->``, and is reported as skipped with
that reason. A block that is a multi-process script says how it is launched there instead,
``<!-- run: torchrun --nproc_per_node 2 -->``, and runs so: two gloo ranks on the CPU. Relative
links in the same files must point at files inside the repository.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.helpers.distributed import run_two_gloo_ranks
from tests.helpers.repo import REPO_ROOT, subprocess_env

DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").rglob("*.md"))]
# Pages whose links are checked too (they hold no Python examples): the benchmarks' index and
# each benchmark's README, which link to their result files.
BENCHMARKS = [
    REPO_ROOT / "benchmarks" / "README.md",
    *sorted(REPO_ROOT.glob("benchmarks/*/README.md")),
]
LINKED = [*DOCS, *BENCHMARKS]

_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_NO_TEST = re.compile(r"<!--\s*no-test:\s*(.*?)\s*-->\s*$")
_TORCHRUN = "<!-- run: torchrun --nproc_per_node 2 -->"
# [text](target) with a relative target: no scheme, not an in-page anchor.
_LINK = re.compile(r"\]\((?![a-z][a-z0-9+.-]*:|#)([^)\s]+)\)")


def _blocks(text: str, label: str) -> list[tuple[str, str, str | None, bool]]:
    """(id, code, skip reason, torchrun) for each python block of ``text``; id is
    ``label:line``, torchrun whether the block is launched as two ranks."""
    found = []
    for match in _BLOCK.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = _NO_TEST.search(before)
        found.append(
            (
                f"{label}:{line}",
                match.group(1),
                skip.group(1) if skip else None,
                before.strip() == _TORCHRUN,
            )
        )
    return found


BLOCKS = [b for p in DOCS for b in _blocks(p.read_text(), str(p.relative_to(REPO_ROOT)))]


def test_readme_has_python_examples():
    assert any(name.startswith("README.md:") for name, *_ in BLOCKS), (
        "README.md lost its Python examples"
    )


def test_a_no_test_mark_right_before_a_block_skips_only_that_block_with_its_reason():
    text = (
        "Text.\n\n```python\nprint(1)\n```\n\n<!-- no-test: needs a GPU -->\n"
        "```python\nimport torch\n```\n\n<!-- no-test: not this one -->\nProse.\n\n"
        "```python\nprint(3)\n```\n"
    )
    assert _blocks(text, "page.md") == [
        ("page.md:3", "print(1)\n", None, False),
        ("page.md:8", "import torch\n", "needs a GPU", False),
        ("page.md:15", "print(3)\n", None, False),
    ]


def test_a_torchrun_mark_right_before_a_block_launches_only_that_block_as_two_ranks():
    text = (
        "<!-- run: torchrun --nproc_per_node 2 -->\n```python\nprint(1)\n```\n\n"
        "<!-- run: torchrun --nproc_per_node 2 -->\nProse.\n\n```python\nprint(2)\n```\n"
    )
    assert _blocks(text, "page.md") == [
        ("page.md:2", "print(1)\n", None, True),
        ("page.md:9", "print(2)\n", None, False),
    ]


def test_the_fsdp2_guide_runs_its_by_hand_examples_as_two_ranks():
    """The scaling-out guide's FSDP2 scripts are whole programs, run under torchrun, not
    fragments skipped for want of a launcher."""
    fsdp2 = [
        (skip, torchrun)
        for name, code, skip, torchrun in BLOCKS
        if name.startswith("docs/guides/scaling-out.md:") and "fully_shard" in code
    ]
    assert fsdp2 == [(None, True), (None, True)]


def test_every_docs_page_is_reachable_from_the_readme_or_another_page():
    linked = set()
    for path in LINKED:
        for target in _LINK.findall(path.read_text()):
            linked.add((path.parent / target.split("#")[0]).resolve())
    orphans = [str(p.relative_to(REPO_ROOT)) for p in LINKED[1:] if p.resolve() not in linked]
    assert not orphans, f"pages no README/docs link leads to: {orphans}"


@pytest.mark.parametrize("path", LINKED, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_relative_links_point_at_files_inside_the_repository(path):
    broken = []
    for target in _LINK.findall(path.read_text()):
        resolved = (path.parent / target.split("#")[0]).resolve()
        if not resolved.is_relative_to(REPO_ROOT) or not resolved.exists():
            broken.append(target)
    assert not broken, f"{path.relative_to(REPO_ROOT)} links to {broken}"


@pytest.mark.parametrize("name, code, skip, torchrun", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_python_example_runs(name, code, skip, torchrun, tmp_path):
    if skip is not None:
        pytest.skip(f"{name}: {skip}")
    if re.search(r"^from trl import", code, re.M):
        # TRL is an optional test extra; the lowest-versions CI environment cannot install it.
        pytest.importorskip("trl", reason="the TRL example needs the test extra (.[test])")
    script = tmp_path / "example.py"
    script.write_text(code)
    if torchrun:  # two gloo ranks, as `torchrun --nproc_per_node 2 example.py` on a CPU
        run_two_gloo_ranks(script, tmp_path, timeout=240)
        return
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, f"{name}\n{done.stderr[-3000:]}"


def test_every_test_the_docs_cite_exists():
    """The docs name tests as evidence (the torch-vs-ours table, upstream hooks): keep them real."""
    sources = {p.name: p.read_text() for p in (REPO_ROOT / "tests").rglob("test_*.py")}
    upstream = {"test_cuda.py"}  # torch's own test file, whose scenarios ours re-run
    defined = {n for text in sources.values() for n in re.findall(r"def (test_\w+)", text)}
    missing = []
    for path in LINKED:
        for token in re.findall(r"`([^`]*test_[^`]*)`", path.read_text()):
            for cited in re.findall(r"(tests/[\w/]+\.py)", token):  # a path: the file is there
                if not (REPO_ROOT / cited).is_file():
                    missing.append(f"{path.name}: {cited}")
            for file in re.findall(r"(test_\w+\.py)", token):
                if file not in sources and file not in upstream:
                    missing.append(f"{path.name}: {file}")
            for name in re.findall(r"(?:^|::|\b)(test_\w+)(?![\w.*])", token):
                if name not in defined and f"{name}.py" not in sources:
                    missing.append(f"{path.name}: {name}")
    assert not missing, f"tests cited in the docs that do not exist: {missing}"
