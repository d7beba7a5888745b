"""Which precision a recipe runs when ``accelerate launch`` chose one too.

Three places can name a recipe's precision: ``--precision`` (or ``--fp16``/``--bf16``) on the
recipe's command line, the recipe's config file (``precision: fp16`` in the offline YAML), and
the launcher (``accelerate launch --mixed_precision bf16``, or ``mixed_precision: bf16`` in an
``accelerate config`` file), which exports ``ACCELERATE_MIXED_PRECISION`` to the script. Were
the config file's value simply the flag's default, it would win without a word, and
``accelerate launch --mixed_precision bf16 recipes/finetune_bert.py`` would train in fp16. The
rule:

1. a precision flag on the recipe's command line wins; where it differs from the launcher's
   choice, one line says so;
2. else the launcher's fp16/bf16 wins over the config file's value, with one line naming both;
3. else the config file's value, else ``precision="auto"`` (which follows the launcher too).

The launcher's ``no`` is not a choice here: ``accelerate launch`` exports ``no`` as well when
neither its flags nor a config file chose anything, and the script cannot tell the two apart
(accelerate 1.10 to 1.16 alike). ``--precision fp32`` is how to ask for fp32. The launcher's
``fp8`` is refused unless a precision flag is given: the recipes train in fp16, bf16 or fp32.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any

from amp_trainer.entry_point import UsageError

__all__ = ["LAUNCHER_ENV", "LauncherPrecision", "one_process_notice", "processes_asked"]

#: What ``accelerate launch`` exports to the script: its ``--mixed_precision`` or config value.
LAUNCHER_ENV = "ACCELERATE_MIXED_PRECISION"

_FLAGS = ("precision", "fp16", "bf16")  # the fields that say a precision
_NOT_GIVEN = object()
_HELP = ("-h", "--help", "--help-all")  # the recipe prints its own help for these


def _config_precision(values: dict[str, Any]) -> str | None:
    """The precision a config file's values choose (``None``: they leave it to ``auto``)."""
    precision = values.get("precision")
    if precision not in (None, "auto"):
        return str(precision)
    for flag in ("fp16", "bf16"):
        if values.get(flag) is True:
            return flag
    return None


class LauncherPrecision:
    """The precision rule of one recipe run (see the module docstring).

    ``parser`` and ``argv`` are the recipe's :class:`~transformers.HfArgumentParser` and its
    command line; the launcher's choice is read from the environment when this is built.
    :meth:`settle_config` is the ``reconcile`` hook of
    :func:`~amp_trainer.recipes.config.parse_args_with_config`; :meth:`check` runs on the
    parsed arguments; :attr:`note` is the one line to log, if any.
    """

    def __init__(self, parser: Any, argv: Sequence[str]) -> None:
        self.parser = parser
        self.argv = list(argv)
        launcher = os.environ.get(LAUNCHER_ENV, "").strip().lower()
        self.launcher: str | None = launcher if launcher not in ("", "no") else None
        self.note: str | None = None
        self._given: list[str] | None = None

    def given_flags(self, argv: Sequence[str] | None = None) -> list[str]:
        """The flags on the command line that choose a precision, found by argparse itself:
        ``--precision`` other than ``auto`` (which defers to the rest), ``--fp16``/``--bf16``
        set true.

        A plain scan of ``argv`` would miss ``--prec bf16`` (argparse accepts any unambiguous
        prefix) and ``--precision=bf16``; parsing into a namespace that already holds a marker for
        each flag leaves the marker exactly where the command line did not set it.
        """
        if self._given is None:
            marked = argparse.Namespace(**dict.fromkeys(_FLAGS, _NOT_GIVEN))
            if argv is None:  # the full command line: --config FILE is not the parser's flag
                pre = argparse.ArgumentParser(add_help=False)
                pre.add_argument("--config")
                argv = pre.parse_known_args(self.argv)[1]
            args = [a for a in argv if a not in _HELP]
            parsed, _ = self.parser.parse_known_args(args, namespace=marked)
            given = {name: getattr(parsed, name) for name in _FLAGS}
            self._given = [
                name
                for name, value in given.items()
                if value is not _NOT_GIVEN and value not in ("auto", False)
            ]
        return self._given

    def settle_config(
        self, values: dict[str, Any], config: str | os.PathLike[str], argv: Sequence[str]
    ) -> dict[str, Any]:
        """The config file's ``values``, with the launcher's fp16/bf16 in place of the file's
        precision when the command line names none (rule 2)."""
        chosen = _config_precision(values)
        if (
            self.launcher not in ("fp16", "bf16")
            or chosen in (None, self.launcher)
            or self.given_flags(argv)
        ):
            return values
        values = dict(values)
        values["precision"] = self.launcher
        for flag in ("fp16", "bf16"):
            if flag in values:
                values[flag] = False
        self.note = (
            f"training in {self.launcher}, accelerate launch's mixed_precision: it overrides "
            f"precision {chosen} of the config file {str(config)!r} (--precision {chosen} "
            f"trains in {chosen})"
        )
        return values

    def check(self, precision: str) -> None:
        """After parsing: note a command-line precision that overrides the launcher's (rule 1);
        refuse the launcher's fp8 when no flag overrides it. ``precision`` is the resolved one."""
        if self.launcher is None or precision == self.launcher:
            return
        given = self.given_flags()
        if given:
            flag = "--precision" if "precision" in given else f"--{given[0]}"
            self.note = (
                f"training in {precision}, {flag} on the command line: it overrides accelerate "
                f"launch's mixed_precision={self.launcher}"
            )
        elif self.launcher not in ("fp16", "bf16"):
            raise UsageError(
                f"accelerate launch's mixed_precision={self.launcher} ({LAUNCHER_ENV}) is not a "
                "precision the recipes train in: launch with --mixed_precision fp16, bf16 or "
                "no, or pass --precision fp16|bf16|fp32"
            )


def processes_asked(launcher_argv: Sequence[str]) -> int | None:
    """The ``--num_processes`` an ``accelerate launch`` command line asked for (``None``: it
    is no such command line, or it did not say)."""
    argv = list(launcher_argv)
    if "launch" not in argv[:3] or not any("accelerate" in part for part in argv[:2]):
        return None
    for index, part in enumerate(argv):
        value = None
        if part == "--num_processes" and index + 1 < len(argv):
            value = argv[index + 1]
        elif part.startswith("--num_processes="):
            value = part.split("=", 1)[1]
        if value is not None:
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _parent_argv() -> list[str]:
    """The command line of the process that started this one (Linux ``/proc``; else none)."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as handle:
            return [part.decode(errors="replace") for part in handle.read().split(b"\0") if part]
    except OSError:
        return []


def one_process_notice(world_size: int, script: str) -> str | None:
    """The line for ``accelerate launch --num_processes 2 --cpu``, which starts ONE process on
    a CPU (accelerate 1.10 to 1.16: ``--cpu`` runs the single-process launcher and drops
    ``--num_processes``), so the run trains with ``world_size=1`` without a word. ``None`` when
    the run has the processes it asked for, or was not started by ``accelerate launch``."""
    asked = processes_asked(_parent_argv())
    if asked is None or asked <= 1 or world_size >= asked:
        return None
    return (
        f"accelerate launch asked for --num_processes {asked} but started {world_size} process "
        "(on a CPU, --cpu runs one process); for several CPU processes use the config that "
        "does: accelerate launch --config_file configs/accelerate/cpu_2proc.yaml " + script
    )
