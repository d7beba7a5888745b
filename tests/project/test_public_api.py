"""What users import: every public name at the top, no heavy imports until one is used."""

from __future__ import annotations

import ast
import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

import amp_trainer
from tests.helpers.repo import REPO_ROOT, subprocess_env


@pytest.mark.parametrize("name", amp_trainer.__all__)
def test_every_public_name_resolves_from_the_top_level(name):
    value = getattr(amp_trainer, name)
    assert getattr(value, "__name__", name) == name


def test_loss_scale_error_is_what_the_scaler_raises():
    from amp_trainer.scaler import LossScaleError

    assert amp_trainer.LossScaleError is LossScaleError
    assert issubclass(amp_trainer.LossScaleError, FloatingPointError)


def test_importing_the_scaler_does_not_pull_in_transformers_or_accelerate():
    code = (
        "import sys; from amp_trainer import DynamicLossScaler, LossScaleError; "
        "print(sorted(m for m in ('transformers', 'accelerate') if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_every_package_module_imports_first_without_cycles():
    """Each module imported first, with no amp_trainer module loaded yet: a cycle fails one."""
    package = Path(amp_trainer.__file__).parent
    modules = sorted(
        ".".join(("amp_trainer", *p.relative_to(package).with_suffix("").parts)).removesuffix(
            ".__init__"
        )
        for p in package.rglob("*.py")
        if p != package / "__init__.py"
    )
    # One interpreter (torch and transformers stay loaded: they are not under test), with every
    # amp_trainer module dropped before the next import.
    code = (
        "import importlib, sys\n"
        "for m in sys.argv[1:]:\n"
        "    for k in [k for k in sys.modules if k.startswith('amp_trainer')]:\n"
        "        del sys.modules[k]\n"
        "    try:\n"
        "        importlib.import_module(m)\n"
        "    except Exception as e:\n"
        "        print(m, type(e).__name__, e)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, *modules], env=subprocess_env(), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == "", done.stdout


def test_the_version_is_written_once_and_pyproject_reads_it():
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    assert "version" not in pyproject["project"]
    assert "version" in pyproject["project"]["dynamic"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "amp_trainer.__version__"
    }
    assert importlib.metadata.version("amp-trainer") == amp_trainer.__version__


def test_the_package_is_marked_typed():
    assert (Path(amp_trainer.__file__).parent / "py.typed").is_file()


def _package_import_graph() -> dict[str, set[str]]:
    """module -> the amp_trainer modules it imports anywhere (top level or inside a function)."""
    package = Path(amp_trainer.__file__).parent
    graph: dict[str, set[str]] = {}
    for path in package.rglob("*.py"):
        name = ".".join(("amp_trainer", *path.relative_to(package).with_suffix("").parts))
        name = name.removesuffix(".__init__")
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.ImportFrom)
                and node.level == 0
                and (node.module or "").split(".")[0] == "amp_trainer"
            ):
                targets.add(node.module)
        graph[name] = targets - {name}
    return graph


def test_no_import_cycles_between_package_modules_even_lazy_ones():
    graph = _package_import_graph()
    graph["amp_trainer"] = set()  # the lazy top-level only re-exports; its map is not an import
    state: dict[str, int] = {}

    def visit(module: str, path: list[str]) -> None:
        if state.get(module) == 2:
            return
        assert state.get(module) != 1, "import cycle: " + " -> ".join([*path, module])
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            visit(target, [*path, module])
        state[module] = 2

    for module in sorted(graph):
        visit(module, [])


def test_no_private_name_is_imported_across_package_modules():
    package = Path(amp_trainer.__file__).parent
    crossing = [
        f"{path.relative_to(package)}: from {node.module} import {alias.name}"
        for path in package.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("amp_trainer")
        for alias in node.names
        if alias.name.startswith("_") and alias.name != "__version__"
    ]
    assert crossing == []


def _top_level_imports(path: Path) -> set[str]:
    """The amp_trainer modules ``path`` imports at module level (not inside a function)."""
    found: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("amp_trainer"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("amp_trainer"))
    return found


def test_the_core_never_imports_the_recipes_package():
    """One-way rule: amp_trainer.recipes depends on the core, never the reverse; the CLI alone
    may load it, and only inside a subcommand (never when it is imported)."""
    graph = _package_import_graph()
    offenders = sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        if not module.startswith(("amp_trainer.recipes", "amp_trainer.cli"))
        for target in targets
        if target.startswith("amp_trainer.recipes")
    )
    assert offenders == []
    cli = Path(amp_trainer.__file__).parent / "cli"
    assert not {
        f"{path.name} imports {m}"
        for path in sorted(cli.glob("*.py"))
        for m in _top_level_imports(path)
        if m.startswith("amp_trainer.recipes")
    }


def test_the_recipes_package_exports_documented_names_only():
    import amp_trainer.recipes as recipes

    reference = (REPO_ROOT / "docs" / "reference" / "recipes.md").read_text()
    undocumented = [name for name in recipes.__all__ if f"`{name}`" not in reference]
    assert undocumented == []
    for name in recipes.__all__:
        value = getattr(recipes, name)
        if callable(value):
            assert (value.__doc__ or "").strip(), f"{name} has no docstring"


def test_the_recipe_scripts_import_only_public_names():
    """recipes/*.py are examples of the API: they import amp_trainer and amp_trainer.recipes
    names, nothing from the submodules."""
    import amp_trainer.recipes as recipes

    public = {"amp_trainer": set(amp_trainer.__all__), "amp_trainer.recipes": set(recipes.__all__)}
    wrong = []
    for script in sorted((REPO_ROOT / "recipes").glob("*.py")):
        for node in ast.walk(ast.parse(script.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("amp_trainer"):
                allowed = public.get(node.module, set())
                wrong += [
                    f"{script.name}: {node.module}.{a.name}"
                    for a in node.names
                    if a.name not in allowed
                ]
    assert wrong == []
