"""Recipe configuration: a YAML file of defaults, command-line flags on top.

``python recipes/finetune_bert.py --config configs/bert_sst2.yaml --learning_rate 3e-5`` reads the
file, then lets every flag override it. The YAML keys are the dataclass field names (the flags
without ``--``), exactly what :meth:`transformers.HfArgumentParser.parse_yaml_file` accepts; the
difference is that flags still work afterwards, which ``parse_yaml_file`` alone does not allow.

:func:`run_entry_point` (from :mod:`amp_trainer.entry_point`, re-exported here) is how a recipe
ends: every exception becomes ONE line on stderr and an exit code.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from amp_trainer.entry_point import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_TERMINATED,
    EXIT_USAGE,
    UsageError,
    run_entry_point,
)
from amp_trainer.recipes.arguments import RunArguments, load_yaml_config, split_config_flag
from amp_trainer.recipes.help import short_help

__all__ = [
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_TERMINATED",
    "EXIT_USAGE",
    "RunArguments",
    "UsageError",
    "check_output_dir",
    "given_on_command_line",
    "load_yaml_config",
    "parse_args_with_config",
    "run_entry_point",
]

logger = logging.getLogger(__name__)


def check_output_dir(
    output_dir: str | os.PathLike[str],
    *,
    reuse: bool,
    resuming: bool,
    resume_from: str | os.PathLike[str] | None = None,
    model: str | os.PathLike[str] | None = None,
) -> None:
    """Refuse an ``output_dir`` that is a file, the model folder, or holds a previous run,
    before any work.

    A second run into a finished run's folder would overwrite its model, metrics.json and
    export, and stock ``save_total_limit`` rotation would delete its checkpoints. Resuming needs
    no flag only when the checkpoint is one of ``output_dir``'s own (``resume_from``, the
    ``--resume_from_checkpoint`` value; ``resuming`` without it means so): a checkpoint of
    another folder resumed into a folder holding a run would write over that run. ``model``
    (``--model_name_or_path``): the final save would replace the source model with the
    fine-tuned one, so an ``output_dir`` that is that folder is refused, as the exporter does.
    """
    path = Path(output_dir)
    if path.exists() and not path.is_dir():
        raise UsageError(f"--output_dir {str(path)!r} exists and is not a folder")
    if model is not None:
        source = Path(os.path.expanduser(str(model)))
        if source.is_dir() and path.is_dir() and source.resolve() == path.resolve():
            raise UsageError(
                f"--output_dir {str(path)!r} is the model folder being fine-tuned "
                f"(--model_name_or_path {str(model)!r}): saving would replace the source model "
                "with the fine-tuned one. Choose another --output_dir."
            )
    own_checkpoint = resuming
    if resume_from is not None:
        checkpoint = Path(resume_from)
        if not checkpoint.is_dir():
            raise UsageError(
                f"--resume_from_checkpoint {str(resume_from)!r} is not a folder: pass a "
                "checkpoint-N folder written by a previous run"
            )
        own_checkpoint = path.is_dir() and checkpoint.resolve().parent == path.resolve()
    if reuse or own_checkpoint or not path.is_dir():
        return
    previous = sorted(
        entry.name
        for entry in path.iterdir()
        if entry.name == "metrics.json" or entry.name.startswith("checkpoint-")
    )
    if not previous:
        return
    shown = ", ".join(previous[:3]) + (" ..." if len(previous) > 3 else "")
    if resume_from is not None:
        raise UsageError(
            f"--output_dir {str(path)!r} holds another run ({shown}); resuming "
            f"{str(resume_from)!r} (a checkpoint of another folder) there would overwrite it. "
            f"Resume into the checkpoint's own folder (--output_dir "
            f"{str(Path(resume_from).parent)!r}), choose another --output_dir, or pass "
            "--reuse_output_dir true to keep both there"
        )
    raise UsageError(
        f"--output_dir {str(path)!r} holds a previous run ({shown}); pass "
        "--resume_from_checkpoint to continue it, --reuse_output_dir true to start a new run "
        "there (its checkpoints are kept), or choose another --output_dir"
    )


def _raise_usage_error(message: str) -> NoReturn:
    raise UsageError(message)


def parse_args_with_config(
    parser: Any,
    argv: Sequence[str],
    default_config: str | os.PathLike[str] | None = None,
    *,
    reconcile: Callable[[dict[str, Any], str | os.PathLike[str], list[str]], dict[str, Any]]
    | None = None,
) -> tuple[Any, ...]:
    """Parse ``argv`` into ``parser``'s dataclasses, with ``--config FILE`` values as defaults.

    ``parser`` is a :class:`transformers.HfArgumentParser`. Without ``--config``,
    ``default_config`` is the starting point (a bare ``accelerate launch recipe.py`` runs the
    recipe's offline default, and ``recipe.py --max_steps 5`` a shortened one); ``--config none``
    starts from the dataclasses' own defaults. Each YAML value becomes the default of its flag
    (so argparse still converts strings and validates choices), and flags given on the command
    line win. Unknown YAML keys and unknown flags are errors that name them. ``reconcile(values,
    config_path, flags)``, if given, sees the file's typed values and the command-line flags
    before the values become defaults, and returns the values to use: the recipes let
    ``accelerate launch``'s precision beat the file's there
    (:class:`~amp_trainer.recipes.launcher.LauncherPrecision`).
    """
    argv = list(argv)
    full_help = "--help-all" in argv
    if full_help:
        argv = ["--help"]  # argparse's help of every flag, TrainingArguments' ~600 lines too
        _describe_negated_flags(parser)
    # argparse prints a usage block and exits on a bad flag; an exception is reported in one line.
    parser.error = _raise_usage_error
    config_path, rest = split_config_flag(argv, default_config, _raise_usage_error)
    typed: dict[str, Any] = {}
    if config_path is not None:
        values = load_yaml_config(config_path)
        dests = {action.dest for action in parser._actions}
        values = _spell_for_installed_transformers(values, dests, config_path)
        unknown = sorted(set(values) - dests)
        if unknown:
            raise UsageError(
                f"unknown key(s) {unknown} in config file {str(config_path)!r}"
                f"{_suggestions(unknown, dests)}; valid keys are the recipe's flags without the "
                "leading '--' (see --help)"
            )
        typed = _typed_values(parser, values, config_path)
        # A YAML value satisfies a required flag (argparse would still demand it on the CLI).
        for action in parser._actions:
            if action.dest in values:
                action.required = False
        if reconcile is not None:
            typed = reconcile(typed, config_path, rest)
        parser.set_defaults(**typed)
    if not full_help and (
        "-h" in rest or "--help" in rest
    ):  # after the config: its values are the defaults shown
        recipe_classes = [
            kind
            for kind in parser.dataclass_types
            if not any(base.__name__ == "TrainingArguments" for base in kind.__mro__)
            and kind is not RunArguments
        ]
        print(
            short_help(
                parser.prog,
                recipe_classes,
                config_path,
                defaults=typed,
                default_config=default_config,
            )
        )
        raise SystemExit(EXIT_OK)
    _refuse_unknown_flags(parser, rest)
    return parser.parse_args_into_dataclasses(args=rest, look_for_args_file=False)


def check_report_to(report_to: Any) -> None:
    """Refuse a ``--report_to`` name transformers has no integration for, before data and model
    load (transformers itself refuses it only when the Trainer is built)."""
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    known = {*INTEGRATION_TO_CALLBACK, "all", "none"}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise UsageError(
            f"--report_to {' '.join(unknown)}: no such integration"
            f"{_suggestions(unknown, known)}; transformers knows "
            f"{', '.join(sorted(INTEGRATION_TO_CALLBACK))}, or all / none"
        )


def _refuse_unknown_flags(parser: Any, argv: Sequence[str]) -> None:
    """One line for flags the recipe does not have, with the flag meant where one is close
    (transformers' own message, "Some specified arguments are not used by the
    HfArgumentParser", names the typo but not the fix)."""
    _, extra = parser.parse_known_args(list(argv))
    flags = [arg.split("=", 1)[0] for arg in extra if arg.startswith("--")]
    if not flags and not extra:
        return
    if not flags:
        raise UsageError(f"unexpected argument(s) {extra}: every value follows its --flag")
    names = {o.lstrip("-") for a in parser._actions for o in a.option_strings if o.startswith("--")}
    unknown = [flag.lstrip("-") for flag in flags]
    raise UsageError(
        f"unknown flag(s) {flags}{_suggestions(unknown, names, prefix='--')} (see --help)"
    )


def _suggestions(unknown: Sequence[str], known: Iterable[str], prefix: str = "") -> str:
    """``" (did you mean --learning_rate?)"``: the closest known name of each unknown one."""
    known = sorted(known)
    meant = []
    for name in unknown:
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
        if close:
            meant.append(f"{prefix}{close[0]}")
    return f" (did you mean {', '.join(meant)}?)" if meant else ""


def _describe_negated_flags(parser: Any) -> None:
    """Say what ``--no_X`` does. ``HfArgumentParser`` gives a bool field that defaults to True a
    ``--no_X`` spelling with the field's own help: ``--no_keep_norms_fp32`` read "Keep
    normalisation layers in fp32", the opposite of what it does."""
    for action in parser._actions:
        if isinstance(action, argparse._StoreFalseAction) and any(
            option.startswith("--no_") for option in action.option_strings
        ):
            action.help = (
                f"The same as --{action.dest} false: turns off what --{action.dest} does "
                "(on by default)."
            )
            action.default = argparse.SUPPRESS  # no "(default: False)": it is not the field's


def given_on_command_line(argv: Sequence[str], names: Iterable[str]) -> set[str]:
    """Which of ``names`` (flags without ``--``) ``argv`` sets, read as the recipe's parser reads
    it: ``--name value``, ``--name=value``, the hyphenated spelling, an unambiguous prefix.

    Why: a value from the ``--config`` file and the same value typed as a flag parse alike, and
    some choices depend on which it was (the GPT-2 recipe keeps its config file's prompt only
    while it reads the config file's own data). Call it after the full parse, which has already
    refused a bad or ambiguous flag.
    """
    parser = argparse.ArgumentParser(add_help=False)
    parser.error = _raise_usage_error
    for name in names:
        options = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
        parser.add_argument(*options, dest=name, default=argparse.SUPPRESS)
    known, _ = parser.parse_known_args(list(argv))
    return set(vars(known))


def _spell_for_installed_transformers(
    values: dict[str, Any], dests: set[str], source: Any
) -> dict[str, Any]:
    """Translate TrainingArguments keys that transformers renamed, in whichever direction applies.

    transformers 5.0 has ``group_by_length: true``; later 5.x releases replaced it with
    ``train_sampling_strategy: group_by_length``. The shipped configs use the new spelling, and
    ``pyproject.toml`` admits both releases, so a config must run on either.
    """
    values = dict(values)
    new, old = "train_sampling_strategy", "group_by_length"
    if new in values and new not in dests and old in dests:
        strategy = values.pop(new)
        if strategy not in ("random", "group_by_length"):
            raise UsageError(
                f"train_sampling_strategy: {strategy!r} in config file {str(source)!r} needs "
                "a newer transformers; this one knows only 'random' and 'group_by_length' "
                "(as group_by_length: true)"
            )
        values[old] = strategy == "group_by_length"
    elif old in values and old not in dests and new in dests:
        values[new] = "group_by_length" if values.pop(old) else "random"
    return values


def _typed_values(parser: Any, values: dict[str, Any], source: Any) -> dict[str, Any]:
    """YAML values converted by their flag's ``type``, as the same text on the command line is.

    argparse converts only *string* defaults; ``max_steps: 2.7`` would reach the dataclass as a
    float and fail far from the file (or not at all). Each value goes through its flag's type
    (``int("2.7")`` fails) and choices, and a failure names the key, the value and the file.
    """
    actions = {action.dest: action for action in parser._actions}
    typed: dict[str, Any] = {}
    for key, value in values.items():
        action = actions[key]
        convert = action.type
        if value is None or convert is None or isinstance(value, dict):
            typed[key] = value
            continue
        if isinstance(value, list) and action.nargs in (None, "?"):
            typed[key] = value  # a list-valued field without nargs (report_to): as given
            continue
        items = value if isinstance(value, list) else [value]
        try:
            # bool/int/float YAML scalars print as the text a flag would hold ("True", "5").
            converted = [convert(item if isinstance(item, str) else str(item)) for item in items]
        except (TypeError, ValueError, argparse.ArgumentTypeError) as err:
            kind = getattr(convert, "__name__", "the flag's type")
            raise UsageError(
                f"{key}: {value!r} in config file {str(source)!r} is not a valid {kind} ({err})"
            ) from None
        if action.choices is not None:
            bad = [item for item in converted if item not in action.choices]
            if bad:
                raise UsageError(
                    f"{key}: {bad[0]!r} in config file {str(source)!r} is not one of "
                    f"{list(action.choices)}"
                )
        typed[key] = converted if isinstance(value, list) else converted[0]
    return typed
