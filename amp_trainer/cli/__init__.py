"""The ``amp-trainer`` command line: ``export`` (FP16 export + parity report), ``doctor`` and
``mismatch`` (FP16/BF16 log-probs against FP32).

Each subcommand is a thin shell over a library function (:func:`amp_trainer.export.export_fp16`,
:func:`amp_trainer.doctor.diagnose`): argument checking, loading, printing, exit codes. A user's
mistake (a missing folder, a threshold out of range, a model that cannot be loaded) prints ONE
line on stderr and exits 2; a failed parity check, an unhealthy diagnosis or a runtime failure
(disk full) exits 1; success exits 0. Never a traceback unless ``--debug`` asks for it: errors
are mapped by :func:`amp_trainer.entry_point.run_entry_point`, the recipes' mapping too.

``export`` and ``doctor --model`` import nothing from :mod:`amp_trainer.recipes`: only
``doctor --config`` and ``doctor --model tiny-bert`` (a recipe's model, built as the recipe
builds it) load recipe code, inside the subcommand.

The package holds one module per subcommand (:mod:`~amp_trainer.cli.export`,
:mod:`~amp_trainer.cli.doctor`, :mod:`~amp_trainer.cli.mismatch`: its options and its run) and
:mod:`~amp_trainer.cli.common` for what they share; this module assembles the parser and runs it.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

from amp_trainer.cli import doctor, export, mismatch
from amp_trainer.cli.common import TINY_MODEL_NAMES as TINY_MODEL_NAMES  # tests/cli checks it
from amp_trainer.cli.common import Parser
from amp_trainer.entry_point import run_entry_point
from amp_trainer.offline_model import OFFLINE_MINILM as OFFLINE_MINILM

__all__ = ["build_parser", "main"]

logger = logging.getLogger("amp_trainer.cli")

_EPILOG = """\
examples:
  amp-trainer export --model runs/bert-sst2 --output runs/bert-sst2-fp16
  amp-trainer export --model runs/gpt2 --output out/gpt2-fp16 --format pt2 onnx \\
      --texts "Hello there" "FP16 has a range of 65504"
  amp-trainer doctor --model runs/bert-sst2 --texts "a great film" "a dull film" --lr 5e-5
  amp-trainer doctor --model runs/gpt2 --data samples.txt --steps 8 --json diagnosis.json
  amp-trainer doctor --config configs/bert_offline.yaml --steps 2

exit codes: 0 success / healthy, 1 parity failed / not healthy / runtime failure (disk full),
2 usage error. --debug prints the traceback of an error.
run 'amp-trainer <command> --help' for a command's options.
"""


def build_parser() -> argparse.ArgumentParser:
    """The whole ``amp-trainer`` parser: global flags, then each subcommand's module adds its own
    options and its handler (``args.handler``)."""
    parser = Parser(
        prog="amp-trainer",
        description="FP16 mixed-precision tools for Hugging Face models.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from amp_trainer import __version__

    parser.add_argument("--version", action="version", version=f"amp-trainer {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress (INFO)")
    parser.add_argument("--debug", action="store_true", help="print the traceback of an error")
    commands = parser.add_subparsers(dest="command", metavar="<command>", parser_class=Parser)
    commands.required = True
    for command in (export, doctor, mismatch):
        command.add_parser(commands)
    return parser


# --------------------------------------------------------------------------------------------
# entry point
# --------------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (``console_scripts`` passes it to ``sys.exit``)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as stop:  # --help, --version, usage errors: argparse already printed
        return int(stop.code or 0)
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("amp_trainer").setLevel(logging.DEBUG if args.verbose else logging.WARNING)
    if not args.verbose:
        # transformers draws a progress bar per load/save; a CLI's output is the report.
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    prog = f"amp-trainer {args.command}"
    # transformers raises ValueError/OSError for a hub id that cannot be resolved (offline, a
    # typo) and we raise ValueError for out-of-range settings: exit 2, the user's to fix; a full
    # disk is exit 1. The traceback: --debug (or a log file named on the line).
    return run_entry_point(lambda: args.handler(args), prog, debug=args.debug or None)
