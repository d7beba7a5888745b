"""pyproject.toml's dependency ranges are the ones CI proves.

.ci/run runs the suite twice: on the newest releases, and on the lowest ones pyproject.toml
declares (pinned in .ci/lowest-constraints.txt). These tests keep the two files in step, so a
lower bound cannot move without the lowest-versions environment moving with it.
"""

from __future__ import annotations

import importlib.metadata

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.helpers.repo import REPO_ROOT

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

PROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
REQUIREMENTS = {canonicalize_name(r.name): r for r in map(Requirement, PROJECT["dependencies"])}
CONSTRAINTS_FILE = REPO_ROOT / ".ci" / "lowest-constraints.txt"


def _lowest_pins() -> dict[str, Version]:
    pins = {}
    for line in CONSTRAINTS_FILE.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = Version(version)
    return pins


def _lower_bound(requirement: Requirement) -> Version | None:
    bounds = [Version(s.version) for s in requirement.specifier if s.operator == ">="]
    return max(bounds) if bounds else None


def test_lowest_constraints_pin_exactly_the_lower_bounds_of_pyproject():
    pins = _lowest_pins()
    declared = {name: _lower_bound(req) for name, req in REQUIREMENTS.items() if name != "torch"}

    assert pins == declared


def test_every_dependency_has_a_lower_bound():
    assert all(_lower_bound(req) is not None for req in REQUIREMENTS.values())


def test_the_environment_running_the_suite_satisfies_the_declared_ranges():
    installed = {name: importlib.metadata.version(req.name) for name, req in REQUIREMENTS.items()}
    outside = {
        name: version
        for name, version in installed.items()
        if not REQUIREMENTS[name].specifier.contains(version, prereleases=True)
    }

    assert outside == {}
