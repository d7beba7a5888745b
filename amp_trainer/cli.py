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
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from amp_trainer.atomic_files import write_json_atomic
from amp_trainer.entry_point import EXIT_FAILED, EXIT_OK, EXIT_USAGE, UsageError, run_entry_point
from amp_trainer.offline_model import OFFLINE_MINILM, resolve_model_path

__all__ = ["build_parser", "main"]

logger = logging.getLogger("amp_trainer.cli")

_DEFAULT_LR, _DEFAULT_BATCH_SIZE = 5e-5, 8
# Names the recipes' model_name_or_path accepts that are no saved model (or a headless one):
# the doctor builds them as the recipe does.
# Spelled here so that parsing imports no recipe code; tests/cli/test_cli.py checks that they are
# the names amp_trainer.recipes.models builds (its TINY_MODEL_CONFIGS).
TINY_MODEL_NAMES = ("tiny-bert", "tiny-gpt2")
_RECIPE_MODEL_NAMES = (*TINY_MODEL_NAMES, OFFLINE_MINILM)
# "bert-base-uncased", "org/model": what the hub accepts; "./x", "/a/b/c", "a/b/c" are paths.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")

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


_SAMPLE_INPUTS_HELP = (
    "the model's inputs for one forward call, by forward keyword name: a .safetensors file "
    "of named tensors, or a .pt/.pth file of a {name: tensor} dict (read with weights_only=True)"
)
# What the CLI says instead of the library's "pass sample_inputs=...".
_PASS_SAMPLE_INPUTS_FILE = (
    "pass --sample-inputs FILE, a .safetensors (or .pt) file of the forward's inputs by name"
)
_SAMPLE_INPUTS_SUFFIXES = (".safetensors", ".pt", ".pth")


class _Parser(argparse.ArgumentParser):
    """argparse, but an error is one line on stderr (argparse prints the usage block too)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# --------------------------------------------------------------------------------------------
# argument types
# --------------------------------------------------------------------------------------------
def _number(low: float, high: float, *, low_open: bool = False) -> Callable[[str], float]:
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


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


# --------------------------------------------------------------------------------------------
# parser
# --------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="amp-trainer",
        description="FP16 mixed-precision tools for Hugging Face models.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from amp_trainer import __version__

    parser.add_argument("--version", action="version", version=f"amp-trainer {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress (INFO)")
    parser.add_argument("--debug", action="store_true", help="print the traceback of an error")
    commands = parser.add_subparsers(dest="command", metavar="<command>", parser_class=_Parser)
    commands.required = True

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
        "--sample-inputs", metavar="FILE", help=_SAMPLE_INPUTS_HELP + " (the parity batch)"
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
    export.add_argument("--max-abs-error", type=_number(0.0, float("inf")), help="off unless given")
    export.add_argument(
        "--max-rel-error", type=_number(0.0, 1.0), default=2e-2, help="default: %(default)s"
    )
    export.add_argument(
        "--min-top1-agreement", type=_number(0.0, 1.0), default=0.98, help="default: %(default)s"
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
    export.set_defaults(handler=_run_export)

    doctor = commands.add_parser(
        "doctor",
        help="find out why FP16 training produces inf/NaN (four-step triage)",
        description=(
            "Runs a few steps of pure FP32, FP16 autocast without a scaler, full AMP with "
            "DynamicLossScaler, then lower learning rates, on copies of the model and one batch; "
            "names the first module that overflows and prints a verdict with a suggested fix. "
            "With --config, the model and batch are those of a recipe config (YAML), built by "
            "the same data functions the recipe uses, at the config's learning rate."
        ),
        epilog="examples:\n  amp-trainer doctor --model runs/bert --texts 'great' 'awful' "
        "--lr 1e-3\n  amp-trainer doctor --config configs/gpt2_offline.yaml --steps 2\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    target = doctor.add_mutually_exclusive_group(required=True)
    target.add_argument(
        "--model",
        help="model folder or hub id; or a recipe's model name "
        f"({', '.join(_RECIPE_MODEL_NAMES)}): built as its recipe builds it, on the recipe's "
        "built-in defaults (its flags' defaults, as with --config none)",
    )
    target.add_argument(
        "--config",
        metavar="YAML",
        help="a recipe config (configs/*.yaml): its model, first training batch and lr",
    )
    source = doctor.add_mutually_exclusive_group()
    source.add_argument("--texts", nargs="+", metavar="TEXT", help="the batch's texts")
    source.add_argument(
        "--data",
        metavar="FILE",
        help="one text per line (.txt) or JSON lines with 'text' and optional 'label' (.jsonl)",
    )
    source.add_argument(
        "--sample-inputs",
        metavar="FILE",
        help=_SAMPLE_INPUTS_HELP + " (the batch; labels made as without it unless it has them)",
    )
    doctor.add_argument(
        "--lr",
        type=_number(0.0, float("inf"), low_open=True),
        help=f"learning rate of the failing run (default: the config's, else {_DEFAULT_LR:g})",
    )
    doctor.add_argument("--steps", type=_positive_int, default=4, help="steps per stage")
    doctor.add_argument(
        "--loss-scale",
        type=_number(0.0, float("inf"), low_open=True),
        default=2.0**16,
        help="the loss scale the run trains at (its logged loss_scale): the AMP stage starts "
        "there and the gradient-underflow check measures there",
    )
    doctor.add_argument(
        "--batch-size",
        type=_positive_int,
        help=f"examples in the batch (default: the config's per_device_train_batch_size, "
        f"else {_DEFAULT_BATCH_SIZE})",
    )
    doctor.add_argument("--device", help="default: cuda if available, else cpu")
    doctor.add_argument("--json", metavar="PATH", help="also write the diagnosis as JSON")
    doctor.set_defaults(handler=_run_doctor)

    mismatch = commands.add_parser(
        "mismatch",
        help="how far FP16 and BF16 token log-probs are from FP32 (the RL precision mismatch)",
        description=(
            "Scores the texts' tokens with a causal LM in FP32 and under FP16/BF16 autocast and "
            "prints, per precision, the mean and max |log p - log p_fp32|, the KL of the "
            "next-token distributions and the share of tokens whose probability ratio leaves "
            "the PPO/GRPO clip range from rounding alone: the part of an RL run's rollout/train "
            "mismatch the precision decides. Exit 1 when a precision's logits are inf/NaN (the "
            "module that overflowed is named)."
        ),
        epilog="examples:\n  amp-trainer mismatch --model runs/gpt2 --texts 'The answer is' "
        "'Two plus two'\n  amp-trainer mismatch --model Qwen/Qwen2.5-0.5B --data prompts.txt "
        "--device cuda --json mismatch.json\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    mismatch.add_argument("--model", required=True, help="causal LM folder or hub id (FP32)")
    texts = mismatch.add_mutually_exclusive_group(required=True)
    texts.add_argument("--texts", nargs="+", metavar="TEXT", help="the texts to score")
    texts.add_argument(
        "--data", metavar="FILE", help="one text per line (.txt) or JSON lines with 'text'"
    )
    mismatch.add_argument(
        "--precisions",
        nargs="+",
        default=["fp16", "bf16"],
        choices=["fp16", "bf16", "fp32"],  # precision.PRECISIONS, not imported
        help="default: %(default)s (fp32: a second FP32 run, the noise floor)",
    )
    mismatch.add_argument(
        "--clip-epsilon",
        type=_number(0.0, 1.0, low_open=True),
        default=0.2,
        help="the clip range [1-eps, 1+eps] of the clip rate (default: %(default)s)",
    )
    mismatch.add_argument(
        "--temperature",
        type=_number(0.0, float("inf"), low_open=True),
        default=1.0,
        help="sampling temperature the log-probs are taken at (default: %(default)s)",
    )
    mismatch.add_argument(
        "--max-length", type=_positive_int, default=256, help="tokens per text (default: 256)"
    )
    mismatch.add_argument(
        "--max-texts", type=_positive_int, default=64, help="texts read (default: 64)"
    )
    mismatch.add_argument(
        "--batch-size", type=_positive_int, default=8, help="texts per forward (default: 8)"
    )
    mismatch.add_argument("--device", help="default: cuda if available, else cpu")
    mismatch.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    mismatch.set_defaults(handler=_run_mismatch)
    return parser


# --------------------------------------------------------------------------------------------
# shared helpers
# --------------------------------------------------------------------------------------------
def _check_model_arg(name: str) -> str:
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


def _load_sample_inputs(path: str) -> dict[str, Any]:
    """The tensors of ``--sample-inputs FILE``: a ``.safetensors`` file (the field's format for
    named tensors, no code run on load) or a ``.pt``/``.pth`` dict read with
    ``weights_only=True`` (plain tensors only: a pickle cannot run code). Names are checked
    against the model's forward once it is loaded (:func:`_check_sample_inputs`)."""
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
            raise UsageError(
                f"--sample-inputs {path}: not a torch.save file of plain tensors, which "
                f"weights_only=True can read ({_first_line(err)})"
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


def _check_sample_inputs(model: Any, inputs: dict[str, Any], path: str) -> dict[str, Any]:
    """``inputs`` checked against ``model``'s forward (names it accepts), or one line naming
    the bad name, the file and what is valid."""
    from amp_trainer.export.sample_inputs import SampleInputsError, check_sample_inputs

    try:
        checked = check_sample_inputs(model, inputs)
    except SampleInputsError as err:
        raise _sample_inputs_usage(err, f"--sample-inputs {path}") from None
    _check_forward_names(model.forward, type(model).__name__, checked, path)
    return checked


def _check_forward_names(forward: Any, owner: str, inputs: dict[str, Any], path: str) -> None:
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


def _check_export_sample_inputs(model: str, inputs: dict[str, Any], path: str) -> None:
    """:func:`_check_forward_names` for a saved model, before export loads its weights: the
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
            _check_forward_names(cls.forward, cls.__name__, inputs, path)
            return


def _sample_inputs_usage(err: Exception, where: str) -> UsageError:
    """The library's refusal to make (or use) inputs, worded for the command line: ``where``
    is the option at fault (``--model DIR``, ``--sample-inputs FILE``)."""
    from amp_trainer.export.sample_inputs import PASS_SAMPLE_INPUTS

    message = str(err).replace(PASS_SAMPLE_INPUTS, _PASS_SAMPLE_INPUTS_FILE)
    return UsageError(f"{where}: {message}")


def _write_json_atomic(path: str, data: Any) -> None:
    target = Path(path)
    if not target.parent.is_dir():
        raise UsageError(f"{path}: directory {target.parent} does not exist")
    write_json_atomic(target, data)


def _load_texts(path: str, limit: int) -> tuple[list[str], list[Any] | None]:
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"--data {path}: no such file")
    lines = [line for line in file.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not lines:
        raise UsageError(f"--data {path}: the file has no non-empty lines")
    if file.suffix != ".jsonl":
        return lines[:limit], None
    texts, labels = [], []
    for number, line in enumerate(lines[:limit], 1):
        try:
            record = json.loads(line)
            texts.append(str(record["text"]))
        except (json.JSONDecodeError, KeyError, TypeError):
            raise UsageError(
                f"--data {path}:{number}: expected a JSON object with a 'text' field"
            ) from None
        labels.append(record.get("label"))
    return texts, labels if all(label is not None for label in labels) else None


# --------------------------------------------------------------------------------------------
# export
# --------------------------------------------------------------------------------------------
def _run_export(args: argparse.Namespace) -> int:
    from amp_trainer.export import SampleInputsError

    model = _check_model_arg(args.model)
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
        sample_inputs = _load_sample_inputs(args.sample_inputs)
        _check_export_sample_inputs(model, sample_inputs, args.sample_inputs)
    try:
        report = _export(args, model, output, sample_inputs)
    except SampleInputsError as err:
        where = f"--sample-inputs {args.sample_inputs}" if args.sample_inputs else None
        raise _sample_inputs_usage(err, where or f"--model {args.model}") from None
    print(report.to_markdown())
    if args.report:
        _write_json_atomic(args.report, report.to_dict())
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


# --------------------------------------------------------------------------------------------
# doctor
# --------------------------------------------------------------------------------------------
_CLASSIFIER_SUFFIXES = (
    "ForSequenceClassification",
    "ForImageClassification",
    "ForAudioClassification",
)
_CTC_TARGET_LENGTH = 4  # CTC targets must fit the shortest output: 16 frames here


def _doctor_batch(
    model: Any,
    args: argparse.Namespace,
    path: str,
    texts: Sequence[str] | None,
    labels: Any,
    sample_inputs: dict | None,
) -> dict:
    """The model's inputs, made as :mod:`amp_trainer.export.sample_inputs` makes export's
    (token ids, pixels, speech features, raw audio; decoder inputs for an encoder-decoder) or
    read from ``--sample-inputs``, plus labels so the model returns a loss
    (:func:`_add_labels`)."""
    from amp_trainer.export.loading import load_processor, load_tokenizer
    from amp_trainer.export.sample_inputs import (
        SampleInputsError,
        main_input_name,
        make_sample_batch,
    )

    if sample_inputs is not None:
        import torch

        from amp_trainer.export.sample_inputs import as_model_dtype

        checked = _check_sample_inputs(model, sample_inputs, args.sample_inputs)
        # FP16 features saved from an FP16 pipeline: the FP32 stages need FP32, as in export.
        batch = as_model_dtype(checked, torch.float32)
        return _add_labels(model, batch, None, f"--sample-inputs {args.sample_inputs}")
    where = f"--model {args.model}"
    main = main_input_name(model)
    tokenizer = processor = None
    if main == "input_ids":
        tokenizer = load_tokenizer(path)
        if texts and tokenizer is None:
            raise UsageError(f"{where}: no tokenizer saved there to encode the texts")
    else:
        processor = load_processor(path)
    try:
        batch = make_sample_batch(model, tokenizer, texts, processor=processor)
    except SampleInputsError as err:
        raise _sample_inputs_usage(err, where) from None
    batch_size = args.batch_size or _DEFAULT_BATCH_SIZE
    batch = {name: tensor[:batch_size] for name, tensor in batch.items()}
    return _add_labels(model, batch, labels, where)


def _add_labels(model: Any, batch: dict, labels: Any, where: str) -> dict:
    """``batch`` plus ``labels`` (unless it has them) so the model returns a loss: class ids
    for a classifier (given, or cycling through the classes), float targets for a regressor,
    short random targets for CTC, the decoder's next tokens for an encoder-decoder, the inputs
    themselves (padding ignored) for language models.

    Why the doctor needs them: it diagnoses training steps, and transformers models compute
    their loss from ``labels``; a model that takes none (no task head) is refused here.
    """
    import torch

    if "labels" in batch:
        return batch
    name = type(model).__name__
    if "labels" not in inspect.signature(model.forward).parameters:
        raise UsageError(
            f"{where}: {name} takes no labels, so it has no loss to diagnose; save the model "
            "with its task head (e.g. ...ForSequenceClassification, ...ForCausalLM)"
        )
    rows = next(iter(batch.values())).shape[0]
    config = model.config
    if name.endswith(_CLASSIFIER_SUFFIXES):
        if config.num_labels == 1:
            batch["labels"] = torch.tensor(
                [float(v) for v in labels] if labels else [0.0] * rows, dtype=torch.float32
            )
            return batch
        values = (
            [int(v) for v in labels] if labels else [i % config.num_labels for i in range(rows)]
        )
        bad = [v for v in values if not 0 <= v < config.num_labels]
        if bad:
            raise UsageError(
                f"label {bad[0]} is outside [0, {config.num_labels - 1}] for this model"
            )
        batch["labels"] = torch.tensor(values, dtype=torch.long)
    elif name.endswith("ForCTC"):
        # Targets skip the blank (the pad id) and fit in the shortest output sequence.
        blank = getattr(config, "pad_token_id", None) or 0
        ids = torch.randint(0, config.vocab_size - 1, (rows, _CTC_TARGET_LENGTH))
        batch["labels"] = ids + (ids >= blank).long()
    elif "decoder_input_ids" in batch:
        decoder = batch["decoder_input_ids"]
        source = batch.get("input_ids")
        if source is not None and source.shape == decoder.shape:
            # Text: the decoder was fed the inputs shifted right, so its targets are the inputs.
            batch["labels"] = source.masked_fill(batch["attention_mask"] == 0, -100)
        else:  # the next decoder token; nothing follows the last one
            targets = torch.full_like(decoder, -100)
            targets[:, :-1] = decoder[:, 1:]
            batch["labels"] = targets
    elif "input_ids" in batch:
        mask = batch.get("attention_mask")
        ids = batch["input_ids"]
        batch["labels"] = ids if mask is None else ids.masked_fill(mask == 0, -100)
    else:
        raise UsageError(
            f"{where}: cannot make labels for {name} (no class, CTC, decoder or token-id "
            "head); put a 'labels' tensor in --sample-inputs FILE"
        )
    return batch


def _recipe_batch(args: argparse.Namespace) -> tuple[Any, dict, float]:
    """Model, batch and lr of a recipe config (``--config``; or ``--model tiny-bert``: the
    recipe's built-in defaults), built by
    :func:`amp_trainer.recipes.models.load_recipe_batch`."""
    from amp_trainer.recipes.models import load_recipe_batch

    if args.texts or args.data or args.sample_inputs:
        option = "--texts" if args.texts else "--data" if args.data else "--sample-inputs"
        what = f"--config {args.config}" if args.config else f"--model {args.model}"
        raise UsageError(f"{option} cannot be combined with {what}: the recipe's data is used")
    if not args.verbose:
        import datasets

        datasets.disable_progress_bars()  # one bar per tokenization pass otherwise
    if args.config:
        import yaml

        try:
            recipe = load_recipe_batch(args.config, args.batch_size)
        except yaml.YAMLError as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else "syntax error"
            raise UsageError(f"--config {args.config}: not valid YAML ({first})") from None
        where = f"config {args.config}"
    else:
        recipe = load_recipe_batch({"model_name_or_path": args.model}, args.batch_size)
        where = f"{args.model} with the recipe's defaults"
    lr = args.lr if args.lr is not None else recipe.learning_rate
    shape = "x".join(str(n) for n in recipe.batch["input_ids"].shape)
    print(
        f"recipe {where}: {recipe.task}, {type(recipe.model).__name__}, "
        f"batch {shape} (input_ids), lr {lr:g}"
    )
    return recipe.model, recipe.batch, lr


def _run_doctor(args: argparse.Namespace) -> int:
    from amp_trainer.doctor import Verdict, diagnose

    if args.config or args.model in _RECIPE_MODEL_NAMES:
        model, batch, lr = _recipe_batch(args)
    else:
        from amp_trainer.export import load_model

        path = _check_model_arg(args.model)
        batch_size = args.batch_size or _DEFAULT_BATCH_SIZE
        texts, labels = (args.texts, None)
        if args.data:
            texts, labels = _load_texts(args.data, batch_size)
        elif texts:
            texts = texts[:batch_size]
        # A bad file is refused before the model loads; its names are checked after.
        inputs = _load_sample_inputs(args.sample_inputs) if args.sample_inputs else None
        model = load_model(path)
        batch = _doctor_batch(model, args, path, texts, labels, inputs)
        lr = args.lr if args.lr is not None else _DEFAULT_LR
    diagnosis = diagnose(
        model, batch, lr=lr, steps=args.steps, device=args.device, loss_scale=args.loss_scale
    )
    print(diagnosis)
    if args.json:
        _write_json_atomic(args.json, diagnosis.to_dict())
    return EXIT_OK if diagnosis.verdict is Verdict.HEALTHY else EXIT_FAILED


# --------------------------------------------------------------------------------------------
# mismatch
# --------------------------------------------------------------------------------------------
def _run_mismatch(args: argparse.Namespace) -> int:
    import torch

    from amp_trainer.export import load_model, load_tokenizer
    from amp_trainer.mismatch import measure_precision_mismatch

    path = _check_model_arg(args.model)
    texts = (
        args.texts[: args.max_texts] if args.texts else _load_texts(args.data, args.max_texts)[0]
    )
    if args.json and not Path(args.json).parent.is_dir():  # before the model loads
        raise UsageError(f"--json {args.json}: directory {Path(args.json).parent} does not exist")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = str(torch.device(device))
    except (RuntimeError, TypeError):
        raise UsageError(f"--device {args.device}: not a device (e.g. cpu, cuda, cuda:1)") from None
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {args.device}: no CUDA device is available here; use cpu")
    tokenizer = load_tokenizer(path)
    if tokenizer is None:
        raise UsageError(f"--model {args.model}: no tokenizer saved there to encode the texts")
    if tokenizer.pad_token is None:  # a causal LM's tokenizer often has none; padding is masked
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
        if tokenizer.pad_token is None and len(texts) > 1:
            raise UsageError(
                f"--model {args.model}: its tokenizer has no pad, eos or unk token to pad the "
                "texts with; score one text at a time"
            )
    tokenizer.padding_side = "right"
    batch = tokenizer(
        list(texts),
        padding=True,
        truncation=True,
        max_length=args.max_length,
        return_tensors="pt",
    )
    model = load_model(path).to(device)
    results = measure_precision_mismatch(
        model,
        batch["input_ids"],
        batch["attention_mask"],
        precisions=tuple(args.precisions),
        clip_epsilon=args.clip_epsilon,
        temperature=args.temperature,
        batch_size=args.batch_size,
    )
    tokens = next(iter(results.values())).tokens
    print(
        f"{type(model).__name__} from {args.model}: {len(texts)} text(s), {tokens} token(s) "
        f"scored, on {device}, against FP32"
    )
    print(results)
    if args.json:
        _write_json_atomic(
            args.json,
            {
                "model": args.model,
                "device": device,
                "texts": len(texts),
                "clip_epsilon": args.clip_epsilon,
                "temperature": args.temperature,
                "precisions": results.to_dict(),
            },
        )
    return EXIT_FAILED if any(stats.nonfinite for stats in results.values()) else EXIT_OK


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


if __name__ == "__main__":
    sys.exit(main())
