"""Recipe configuration: a YAML file of defaults, command-line flags on top.

``python recipes/finetune_bert.py --config configs/bert_sst2.yaml --learning_rate 3e-5`` reads the
file, then lets every flag override it. The YAML keys are the dataclass field names (the flags
without ``--``), exactly what :meth:`transformers.HfArgumentParser.parse_yaml_file` accepts; the
difference is that flags still work afterwards, which ``parse_yaml_file`` alone does not allow.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["load_yaml_config", "parse_args_with_config"]


def load_yaml_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a recipe YAML file: a flat mapping of argument names to values."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} does not exist")
    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    if not isinstance(data, dict):
        raise ValueError(
            f"config file {str(path)!r} must hold a mapping of argument names to values, "
            f"got {type(data).__name__}"
        )
    return data


def parse_args_with_config(
    parser: Any,
    argv: Sequence[str],
    default_config: str | os.PathLike[str] | None = None,
) -> tuple[Any, ...]:
    """Parse ``argv`` into ``parser``'s dataclasses, with ``--config FILE`` values as defaults.

    ``parser`` is a :class:`transformers.HfArgumentParser`. Without ``--config``,
    ``default_config`` is the starting point (a bare ``accelerate launch recipe.py`` runs the
    recipe's offline default, and ``recipe.py --max_steps 5`` a shortened one); ``--config none``
    starts from the dataclasses' own defaults. Each YAML value becomes the default of its flag
    (so argparse still converts strings and validates choices), and flags given on the command
    line win. Unknown YAML keys and unknown flags are errors that name them.
    """
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, rest = pre.parse_known_args(list(argv))
    config_path = default_config if known.config is None else known.config
    if str(config_path).lower() in ("", "none"):
        config_path = None
    if config_path is not None:
        values = load_yaml_config(config_path)
        dests = {action.dest for action in parser._actions}
        unknown = sorted(set(values) - dests)
        if unknown:
            raise ValueError(
                f"unknown key(s) {unknown} in config file {str(config_path)!r}; valid keys are "
                "the recipe's flags without the leading '--' (see --help)"
            )
        parser.set_defaults(**values)
        # A YAML value satisfies a required flag (argparse would still demand it on the CLI).
        for action in parser._actions:
            if action.dest in values:
                action.required = False
    return parser.parse_args_into_dataclasses(args=rest, look_for_args_file=False)
