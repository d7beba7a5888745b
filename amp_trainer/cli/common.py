"""What the ``amp-trainer`` subcommands share: the one-line-error parser, argument types, and the
checks and readers of the options several subcommands take (``--model``, ``--sample-inputs``,
``--data``, ``--json``/``--report``).

Every refusal here is a :class:`~amp_trainer.entry_point.UsageError`: one line naming the option
and the bad value, exit 2.
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from amp_trainer.atomic_files import write_json_atomic
from amp_trainer.entry_point import EXIT_USAGE, UsageError
from amp_trainer.offline_model import OFFLINE_MINILM, resolve_model_path

__all__ = [
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_LR",
    "RECIPE_MODEL_NAMES",
    "SAMPLE_INPUTS_HELP",
    "TINY_MODEL_NAMES",
    "Parser",
    "check_forward_names",
    "check_model_arg",
    "check_sample_inputs",
    "load_sample_inputs",
    "load_texts",
    "number",
    "positive_int",
    "sample_inputs_usage",
    "write_json_output",
]

DEFAULT_LR, DEFAULT_BATCH_SIZE = 5e-5, 8
# Names the recipes' model_name_or_path accepts that are no saved model (or a headless one):
# the doctor builds them as the recipe does.
# Spelled here so that parsing imports no recipe code; tests/cli/test_cli.py checks that they are
# the names amp_trainer.recipes.models builds (its TINY_MODEL_CONFIGS).
TINY_MODEL_NAMES = ("tiny-bert", "tiny-gpt2")
RECIPE_MODEL_NAMES = (*TINY_MODEL_NAMES, OFFLINE_MINILM)
# "bert-base-uncased", "org/model": what the hub accepts; "./x", "/a/b/c", "a/b/c" are paths.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")

SAMPLE_INPUTS_HELP = (
    "the model's inputs for one forward call, by forward keyword name: a .safetensors file "
    "of named tensors, or a .pt/.pth file of a {name: tensor} dict (read with weights_only=True)"
)
# What the CLI says instead of the library's "pass sample_inputs=...".
_PASS_SAMPLE_INPUTS_FILE = (
    "pass --sample-inputs FILE, a .safetensors (or .pt) file of the forward's inputs by name"
)
_SAMPLE_INPUTS_SUFFIXES = (".safetensors", ".pt", ".pth")


class Parser(argparse.ArgumentParser):
    """argparse, but an error is one line on stderr (argparse prints the usage block too)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# --------------------------------------------------------------------------------------------
# argument types
# --------------------------------------------------------------------------------------------
def number(low: float, high: float, *, low_open: bool = False) -> Callable[[str], float]:
    """An argparse type for a float in ``[low, high]`` (``(low, high]`` with ``low_open``): a bad
    value is refused while parsing, with the range in the one-line error."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        too_low = value <= low if low_open else value < low
        if too_low or value > high or value != value:
            bracket = "(" if low_open else "["
            raise argparse.ArgumentTypeError(f"{text} is outside {bracket}{low:g}, {high:g}]")
        return value

    return parse


def positive_int(text: str) -> int:
    """An argparse type for a count (steps, batch size): an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def check_model_arg(name: str) -> str:
    """The folder or hub id ``--model`` names (:data:`OFFLINE_MINILM` resolved to its folder).

    An existing path must be a model folder; otherwise it must look like a hub id. The
    recipes' from-scratch names (``tiny-bert``) are no saved model: refused here, the doctor
    handles them before calling this.
    """
    if name in TINY_MODEL_NAMES:
        raise UsageError(
            f"--model {name}: a recipe's untrained from-scratch model; train it with its "
            "recipe and pass the recipe's output_dir"
        )
    if name == OFFLINE_MINILM:
        return resolve_model_path(name)  # UsageError (one line) without the offline extra
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise UsageError(f"--model {name}: not a directory")
        if not (path / "config.json").is_file():
            raise UsageError(f"--model {name}: no config.json in that folder (not a model folder)")
    elif not _HUB_ID.fullmatch(name):
        raise UsageError(f"--model {name}: no such directory")
    return name


def load_sample_inputs(path: str) -> dict[str, Any]:
    """The tensors of ``--sample-inputs FILE``: a ``.safetensors`` file (the field's format for
    named tensors, no code run on load) or a ``.pt``/``.pth`` dict read with
    ``weights_only=True`` (plain tensors only: a pickle cannot run code). Names are checked
    against the model's forward once it is loaded (:func:`check_sample_inputs`)."""
    import torch

    file = Path(path)
    if not file.is_file():
        raise UsageError(f"--sample-inputs {path}: no such file")
    suffix = file.suffix.lower()
    if suffix not in _SAMPLE_INPUTS_SUFFIXES:
        raise UsageError(
            f"--sample-inputs {path}: unknown format {suffix or '(no suffix)'!r}; valid: "
            f"{', '.join(_SAMPLE_INPUTS_SUFFIXES)}"
        )
    if suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            tensors: Any = load_file(file)
        except Exception as err:  # SafetensorError (garbled header) is no ValueError/OSError
            raise UsageError(
                f"--sample-inputs {path}: not a readable safetensors file ({_first_line(err)})"
            ) from None
    else:
        try:
            tensors = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as err:  # UnpicklingError, RuntimeError (not a zip), EOFError
            from amp_trainer.checkpointing.file_checks import load_error_reason

            # torch's own message advises loading with weights_only=False: never passed on.
            raise UsageError(
                f"--sample-inputs {path}: not a torch.save file of plain tensors "
                f"({load_error_reason(err)})"
            ) from None
        if not isinstance(tensors, dict) or not tensors:
            raise UsageError(
                f"--sample-inputs {path}: holds a {type(tensors).__name__}, not a non-empty "
                "{name: tensor} dict"
            )
        bad = [name for name, value in tensors.items() if not isinstance(value, torch.Tensor)]
        if bad:
            raise UsageError(
                f"--sample-inputs {path}: {bad[0]!r} is a {type(tensors[bad[0]]).__name__}, "
                "not a tensor"
            )
    if not tensors:
        raise UsageError(f"--sample-inputs {path}: the file holds no tensors")
    return dict(tensors)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def check_sample_inputs(model: Any, inputs: dict[str, Any], path: str) -> dict[str, Any]:
    """``inputs`` checked against ``model``'s forward (names it accepts), or one line naming
    the bad name, the file and what is valid."""
    from amp_trainer.export.sample_inputs import SampleInputsError, check_sample_inputs

    try:
        checked = check_sample_inputs(model, inputs)
    except SampleInputsError as err:
        raise sample_inputs_usage(err, f"--sample-inputs {path}") from None
    check_forward_names(model.forward, type(model).__name__, checked, path)
    return checked


def check_forward_names(forward: Any, owner: str, inputs: dict[str, Any], path: str) -> None:
    """Refuse a name ``forward`` has no parameter for. Stricter than the library's check:
    transformers 5 forwards take ``**kwargs`` and drop names they do not know, so a misnamed
    tensor in a file would silently be no input at all."""
    parameters = inspect.signature(forward).parameters
    named = sorted(
        n
        for n, p in parameters.items()
        if n != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    )
    unknown = [name for name in inputs if name not in named]
    if unknown:
        raise UsageError(
            f"--sample-inputs {path}: {unknown[0]!r} is not an argument of {owner}.forward; "
            f"valid: {named}"
        )


def sample_inputs_usage(err: Exception, where: str) -> UsageError:
    """The library's refusal to make (or use) inputs, worded for the command line: ``where``
    is the option at fault (``--model DIR``, ``--sample-inputs FILE``)."""
    from amp_trainer.export.sample_inputs import PASS_SAMPLE_INPUTS

    message = str(err).replace(PASS_SAMPLE_INPUTS, _PASS_SAMPLE_INPUTS_FILE)
    return UsageError(f"{where}: {message}")


def write_json_output(path: str, data: Any) -> None:
    """``data`` as JSON at ``path`` (``--json``, ``--report``), written atomically; a missing
    parent folder is the user's to fix (one line), not a traceback."""
    target = Path(path)
    if not target.parent.is_dir():
        raise UsageError(f"{path}: directory {target.parent} does not exist")
    write_json_atomic(target, data)


def load_texts(path: str, limit: int) -> tuple[list[str], list[Any] | None]:
    """The first ``limit`` texts of ``--data FILE`` (one a line, or JSON lines with ``text``),
    and their ``label`` fields when every line has one."""
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"--data {path}: no such file")
    lines = [line for line in file.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not lines:
        raise UsageError(f"--data {path}: the file has no non-empty lines")
    if file.suffix != ".jsonl":
        return lines[:limit], None
    texts, labels = [], []
    for line_number, line in enumerate(lines[:limit], 1):
        try:
            record = json.loads(line)
            texts.append(str(record["text"]))
        except (json.JSONDecodeError, KeyError, TypeError):
            raise UsageError(
                f"--data {path}:{line_number}: expected a JSON object with a 'text' field"
            ) from None
        labels.append(record.get("label"))
    return texts, labels if all(label is not None for label in labels) else None
