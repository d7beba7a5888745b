"""``amp-trainer export``: FP16 export of a saved model and its parity report against FP32, over
:func:`amp_trainer.export.export_fp16`. Imports no recipe code."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from amp_trainer.cli.common import (
    SAMPLE_INPUTS_HELP,
    check_forward_names,
    check_model_arg,
    load_sample_inputs,
    number,
    sample_inputs_usage,
    write_json_output,
)
from amp_trainer.entry_point import EXIT_FAILED, EXIT_OK, UsageError
from amp_trainer.offline_model import OFFLINE_MINILM

__all__ = ["add_parser", "run"]


def add_parser(commands: Any) -> None:
    """Add ``export`` to the ``amp-trainer`` subcommands (``commands``: argparse's subparsers)."""
    export = commands.add_parser(
        "export",
        help="export a model to FP16 and check it against FP32 (parity report)",
        description=(
            "Cast to FP16 (norm layers kept FP32), keep modules whose FP16 activations overflow "
            "in FP32, compare with the FP32 model on sample inputs, and write the export only "
            "if parity passes (or --force)."
        ),
        epilog="example:\n  amp-trainer export --model runs/bert --output runs/bert-fp16 "
        "--format onnx\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    export.add_argument(
        "--model",
        required=True,
        help=f"model folder, hub id or {OFFLINE_MINILM!r} (FP32)",
    )
    export.add_argument("--output", required=True, help="folder to create")
    export_inputs = export.add_mutually_exclusive_group()
    export_inputs.add_argument("--texts", nargs="+", metavar="TEXT", help="parity sample texts")
    export_inputs.add_argument(
        "--sample-inputs", metavar="FILE", help=SAMPLE_INPUTS_HELP + " (the parity batch)"
    )
    export.add_argument(
        "--format",
        nargs="+",
        default=[],
        choices=["safetensors", "pt2", "onnx", "torchscript"],  # export.FORMATS, not imported
        dest="formats",
        help="extra formats (safetensors is always written): pt2 (torch.export), onnx (needs "
        "amp-trainer[export]), torchscript (deprecated by PyTorch: use pt2)",
    )
    export.add_argument("--max-abs-error", type=number(0.0, float("inf")), help="off unless given")
    export.add_argument(
        "--max-rel-error", type=number(0.0, 1.0), default=2e-2, help="default: %(default)s"
    )
    export.add_argument(
        "--min-top1-agreement", type=number(0.0, 1.0), default=0.98, help="default: %(default)s"
    )
    export.add_argument(
        "--no-keep-norms-fp32", action="store_true", help="cast normalisation layers too"
    )
    export.add_argument(
        "--no-overflow-guard", action="store_true", help="do not keep overflowing modules FP32"
    )
    export.add_argument("--force", action="store_true", help="write even if parity fails")
    export.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    export.add_argument("--report", metavar="PATH", help="also write report.json here")
    export.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Export ``args.model`` to FP16 (``amp-trainer export``); the exit code: 0 written and
    parity passed, 1 parity failed."""
    from amp_trainer.export import SampleInputsError

    model = check_model_arg(args.model)
    output = Path(args.output)
    source = Path(model).resolve() if Path(model).exists() else None
    target = output.resolve()
    # An output that is, holds or lies in the model folder: export_fp16 says so (--overwrite
    # would not help, so do not suggest it).
    related = source is not None and (
        target == source or target in source.parents or source in target.parents
    )
    if (
        not related
        and output.exists()
        and not args.overwrite
        and (not output.is_dir() or any(output.iterdir()))
    ):
        raise UsageError(f"--output {args.output} exists and is not empty (use --overwrite)")
    sample_inputs = None
    if args.sample_inputs:
        sample_inputs = load_sample_inputs(args.sample_inputs)
        _check_export_sample_inputs(model, sample_inputs, args.sample_inputs)
    try:
        report = _export(args, model, output, sample_inputs)
    except SampleInputsError as err:
        where = f"--sample-inputs {args.sample_inputs}" if args.sample_inputs else None
        raise sample_inputs_usage(err, where or f"--model {args.model}") from None
    print(report.to_markdown())
    if args.report:
        write_json_output(args.report, report.to_dict())
    if not report.passed:
        note = "written anyway (--force)" if report.written else "nothing was written"
        print(f"amp-trainer export: parity failed, {note}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def _export(args: argparse.Namespace, model: str, output: Path, sample_inputs: Any) -> Any:
    """:func:`~amp_trainer.export.export_fp16` with the command line's settings."""
    from amp_trainer.export import export_fp16

    return export_fp16(
        model,
        output,
        sample_texts=args.texts,
        sample_inputs=sample_inputs,
        keep_norms_fp32=not args.no_keep_norms_fp32,
        overflow_guard=not args.no_overflow_guard,
        max_abs_error=args.max_abs_error,
        max_rel_error=args.max_rel_error,
        min_top1_agreement=args.min_top1_agreement,
        formats=tuple(args.formats),
        force=args.force,
        overwrite=args.overwrite,
    )


def _check_export_sample_inputs(model: str, inputs: dict[str, Any], path: str) -> None:
    """:func:`check_forward_names` for a saved model, before export loads its weights: the
    forward of the class its config.json names (a hub id or an unknown class: export's own
    check is all there is)."""
    import transformers

    folder = Path(model)
    if not (folder / "config.json").is_file():
        return
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return  # export's loading names the broken file
    for name in config.get("architectures") or []:
        cls = getattr(transformers, str(name), None)
        if isinstance(cls, type) and hasattr(cls, "forward"):
            check_forward_names(cls.forward, cls.__name__, inputs, path)
            return
