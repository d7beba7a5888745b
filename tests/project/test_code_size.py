"""The package stays readable in one sitting per unit: no module of amp_trainer/ over 700 lines,
no class over 500 (torch's whole ``grad_scaler.py`` is 714; ``transformers/trainer.py`` at 4,800
lines is what a unit that keeps growing becomes). A unit that outgrows a limit is split along
its ideas, not trimmed."""

from __future__ import annotations

import ast
from pathlib import Path

import amp_trainer

PACKAGE = Path(amp_trainer.__file__).parent
MAX_MODULE_LINES = 700
MAX_CLASS_LINES = 500


def module_sizes(package: Path) -> dict[str, int]:
    """Lines of each module under ``package``, by path relative to its parent."""
    return {
        str(path.relative_to(package.parent)): len(path.read_text().splitlines())
        for path in sorted(package.rglob("*.py"))
    }


def class_sizes(package: Path) -> dict[str, int]:
    """Lines of each class under ``package`` (its decorators to its last line, nested classes
    included), as ``path:line Name``."""
    sizes = {}
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                where = f"{path.relative_to(package.parent)}:{node.lineno} {node.name}"
                sizes[where] = node.end_lineno - first + 1
    return sizes


def over(sizes: dict[str, int], limit: int) -> list[str]:
    return [f"{name} has {lines} lines" for name, lines in sizes.items() if lines > limit]


def test_no_module_is_over_700_lines():
    too_long = over(module_sizes(PACKAGE), MAX_MODULE_LINES)
    assert not too_long, f"modules over {MAX_MODULE_LINES} lines (split them): {too_long}"


def test_no_class_is_over_500_lines():
    too_long = over(class_sizes(PACKAGE), MAX_CLASS_LINES)
    assert not too_long, f"classes over {MAX_CLASS_LINES} lines (split them): {too_long}"


def test_the_size_check_names_an_oversized_module_and_class(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(600))
    (package / "big.py").write_text(f"class Big:\n{body}\n" + "y = 1\n" * 200)
    (package / "small.py").write_text("class Small:\n    pass\n")
    assert over(module_sizes(package), MAX_MODULE_LINES) == ["pkg/big.py has 801 lines"]
    assert over(class_sizes(package), MAX_CLASS_LINES) == ["pkg/big.py:1 Big has 601 lines"]
