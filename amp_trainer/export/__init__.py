"""FP16 inference export with a parity report: safetensors, optionally torch.export, ONNX and
TorchScript.

An FP16 export is only worth shipping if it computes what the FP32 model computes. So
:func:`export_fp16` does not just call ``model.half()``:

1. normalisation layers stay FP32 (:func:`amp_trainer.islands.keep_norms_in_fp32`): their
   mean/variance reductions are where FP16 loses the most;
2. an *overflow guard* runs the FP16 model on sample inputs with forward hooks and finds the first
   module whose FP16 output leaves the FP16 range (``|x| > 65504`` becomes ``inf``) or goes NaN
   while its inputs were finite. That module is kept in FP32 (an "FP32 island": inputs upcast, the
   module run in FP32, outputs cast back to FP16). If the island's own output still does not fit
   FP16, the island grows to the enclosing module (a residual block ending in a LayerNorm usually
   brings values back into range). Bounded; every guarded module is named in the report;
3. the FP16 model (and every extra format) is compared with the FP32 model on the same inputs
   (built from what the model declares: token ids, pixels, speech features, decoder inputs for
   an encoder-decoder; see :mod:`~amp_trainer.export.sample_inputs`): max/mean absolute and
   relative error of the logits, top-1 agreement, non-finite count;
4. nothing is written unless the parity thresholds pass (or ``force=True``): everything goes to a
   temporary folder next to the target, renamed into place at the end.

Reload an export with :func:`load_fp16_export`. A plain
``AutoModel*.from_pretrained(out, dtype=torch.float16)`` also works, but transformers 5 casts every
floating tensor to the requested dtype (its ``_keep_in_fp32_modules`` is a class attribute, never
read from the config), so the FP32 norms and guarded modules come back FP16 and without their
hooks: outputs then differ slightly from the report, and an overflow the guard fixed comes back.

Example::

    report = export_fp16("runs/bert-sst2", "runs/bert-sst2-fp16", formats=("safetensors", "onnx"))
    print(report.to_markdown())
    model = load_fp16_export("runs/bert-sst2-fp16")

This package holds :func:`export_fp16` (the flow above, top to bottom) and :class:`ExportReport`;
each step lives in its own module:

- :mod:`~amp_trainer.export.loading`: the source model with its head, its tokenizer and
  processor, and :func:`load_fp16_export`;
- :mod:`~amp_trainer.export.sample_inputs`: the sample batch both the guard and parity run on,
  from the model's declared inputs (or the caller's ``sample_inputs=``);
- :mod:`~amp_trainer.export.guard`: steps 1 and 2, what the FP16 copy keeps in FP32;
- :mod:`~amp_trainer.export.parity`: step 3, :class:`ParityResult` and the comparison;
- :mod:`~amp_trainer.export.formats`: the torch.export (``.pt2``), ONNX and TorchScript writers,
  each read back for parity;
- :mod:`~amp_trainer.export.staging`: step 4, sizes, free space and the staging-folder
  transaction (write next to the target, rename into place, clean up after a killed export).

The names in ``__all__`` are the API; the modules' other names serve this package only.
"""

from __future__ import annotations

import copy
import dataclasses
import errno
import json
import logging
import math
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from amp_trainer.atomic_files import is_disk_full, write_text_atomic
from amp_trainer.export import staging
from amp_trainer.export.formats import (
    DEPRECATED_FORMATS,
    FILE_NAMES,
    FORMATS,
    CaptureError,
    check_export_extra,
    export_onnx,
    export_pt2,
    export_torchscript,
)
from amp_trainer.export.guard import fp32_weight_share, guard_overflows, keep_known_fp32
from amp_trainer.export.loading import (
    CONFIG_KEY,
    load_fp16_export,
    load_model,
    load_processor,
    load_source,
    load_tokenizer,
)
from amp_trainer.export.parity import (
    ParityResult,
    compare,
    drop_autocast_wrapper,
    output_only,
    pick_output,
    thin_evidence,
)
from amp_trainer.export.sample_inputs import (
    DEFAULT_SAMPLE_TEXTS,
    SampleInputsError,
    as_model_dtype,
    cannot_feed,
    check_sample_inputs,
    describe_sample,
    forward_kwargs,
    main_input_name,
    make_sample_batch,
    output_mask,
)
from amp_trainer.numerics import FP16_MAX
from amp_trainer.precision import without_autocast_wrapper

__all__ = [
    "DEFAULT_SAMPLE_TEXTS",
    "FORMATS",
    "FP16_MAX",
    "ExportReport",
    "ParityResult",
    "SampleInputsError",
    "export_fp16",
    "load_fp16_export",
    "load_model",
    "load_tokenizer",
    "make_sample_batch",
]

logger = logging.getLogger(__name__)


@dataclass
class ExportReport:
    """Everything :func:`export_fp16` did and measured; ``report.json`` is :meth:`to_dict`."""

    source: str
    output_dir: str
    passed: bool
    written: bool
    forced: bool
    fp32_modules: list[str]
    overflow_guarded_modules: list[str]
    parity: dict[str, ParityResult]
    thresholds: dict[str, float | None]
    source_bytes: int
    source_bytes_measured: bool
    export_bytes: int
    files: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: Modules kept FP32 beyond norms and the guard: the model's own islands (from training)
    #: and modules that share a parameter with an island.
    fp32_islands: list[str] = field(default_factory=list)
    #: The keyword inputs every exported format takes, in order (the sample batch's names), and
    #: the name of the one output tensor they return (``logits`` or ``last_hidden_state``).
    inputs: list[str] = field(default_factory=list)
    output: str = ""
    #: ``{file name: hex SHA-256}`` of every file written but ``report.json``;
    #: :func:`load_fp16_export` checks them before it loads anything.
    sha256: dict[str, str] = field(default_factory=dict)
    #: What parity ran on ("built-in English sentences", "your sample texts", ...) and how many
    #: rows (sentences, images, clips) the batch had.
    sample: str = ""
    sample_rows: int = 0
    #: Why the verdict rests on thin evidence, one sentence each: a stand-in for the user's
    #: data, or too few compared positions for the top-1 threshold. Empty when neither holds.
    thin_evidence: list[str] = field(default_factory=list)

    @property
    def size_ratio(self) -> float | None:
        """Exported weights size over the FP32 source's (about 0.5 for a clean FP16 export)."""
        if not self.source_bytes or not self.export_bytes:
            return None
        return self.export_bytes / self.source_bytes

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["parity"] = {name: result.to_dict() for name, result in self.parity.items()}
        data["size_ratio"] = self.size_ratio
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n"

    def to_markdown(self) -> str:
        """A human-readable summary: verdict, sizes, kept-FP32 modules and the parity table."""
        verdict = (
            "PASSED"
            if self.passed
            else ("FAILED (written anyway: force)" if self.forced else "FAILED")
        )
        if self.thin_evidence:
            verdict += " (on thin evidence: see below)"
        lines = [f"## FP16 export: {verdict}", "", f"- source: `{self.source}`"]
        where = self.output_dir if self.written else f"{self.output_dir} (nothing written)"
        lines.append(f"- output: `{where}`")
        size = staging.human_bytes(self.source_bytes) + (
            "" if self.source_bytes_measured else " (est.)"
        )
        lines.append(
            f"- weights: {staging.human_bytes(self.export_bytes)} FP16 vs {size} FP32"
            + (f" ({self.size_ratio:.2f}x)" if self.size_ratio else "")
        )
        if self.inputs:
            names = ", ".join(f"`{n}`" for n in self.inputs)
            lines.append(f"- inputs: {names}; output: `{self.output}`")
        if self.parity:
            positions = min(result.positions for result in self.parity.values())
            lines.append(
                f"- evidence: {positions} positions compared, from {self.sample_rows} rows of "
                f"{self.sample}"
            )
        lines.append(f"- norm layers kept FP32: {len(self.fp32_modules)}")
        guarded = ", ".join(f"`{n}`" for n in self.overflow_guarded_modules) or "none"
        lines.append(f"- kept FP32 by the overflow guard: {guarded}")
        if self.fp32_islands:
            kept = ", ".join(f"`{n}`" for n in self.fp32_islands)
            lines.append(f"- kept FP32 as the model's own islands or tied to an island: {kept}")
        limits = ", ".join(f"{k}={v}" for k, v in self.thresholds.items() if v is not None)
        lines += [f"- thresholds: {limits}", ""]
        lines.append(
            "| format | positions | max abs err | mean abs err | max rel err | top-1 agree "
            "| non-finite | ok |"
        )
        lines.append("|---|---|---|---|---|---|---|---|")
        for result in self.parity.values():
            top1 = "n/a" if result.top1_agreement is None else f"{result.top1_agreement:.4f}"
            lines.append(
                f"| {result.format} | {result.positions} | {result.max_abs_error:.3g} "
                f"| {result.mean_abs_error:.3g} | {result.max_rel_error:.3g} | {top1} "
                f"| {result.nonfinite} | {'yes' if result.passed else 'NO'} |"
            )
        if self.failures:
            lines += ["", "Why it failed:"] + [f"- {reason}" for reason in self.failures]
        if self.thin_evidence:
            lines += ["", "Thin evidence:"] + [f"- {reason}" for reason in self.thin_evidence]
        if self.notes:
            lines += ["", "Notes:"] + [f"- {note}" for note in self.notes]
        return "\n".join(lines) + "\n"


def _rows(inputs: Mapping[str, torch.Tensor]) -> int:
    """The sample batch's size (its first tensor's first dimension)."""
    first = next(iter(inputs.values()))
    return int(first.shape[0]) if first.dim() else 1


def _check_threshold(name: str, value: float | None, low: float, high: float) -> None:
    if value is None:
        return
    if (
        not isinstance(value, (int, float))
        or isinstance(value, bool)
        or not (low <= float(value) <= high)
    ):
        raise ValueError(f"{name} must be a number in [{low}, {high}], got {value!r}")


def export_fp16(
    model_or_path: nn.Module | str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    *,
    tokenizer: Any | None = None,
    sample_texts: Sequence[str] | None = None,
    sample_inputs: Mapping[str, torch.Tensor] | None = None,
    processor: Any | None = None,
    keep_norms_fp32: bool = True,
    overflow_guard: bool = True,
    max_abs_error: float | None = None,
    max_rel_error: float | None = 2e-2,
    min_top1_agreement: float | None = 0.98,
    formats: Sequence[str] = ("safetensors",),
    force: bool = False,
    overwrite: bool = False,
    max_guard_iterations: int = 16,
    seed: int = 0,
) -> ExportReport:
    """Export ``model_or_path`` to FP16 in ``output_dir`` and report its parity with FP32.

    Args:
        model_or_path: a transformers model (not modified: the export works on a copy) or a
            folder / hub id that :func:`load_model` can load.
        output_dir: the folder to create (``save_pretrained`` layout, plus ``report.json``,
            ``report.md`` and ``model.pt2`` / ``model.onnx`` / ``model.torchscript.pt`` when
            asked for).
        tokenizer: saved alongside and used to encode the sample texts; loaded from
            ``model_or_path`` when that is a folder and this is ``None``.
        sample_texts: parity inputs of a text model; default: built-in sentences with a
            tokenizer, random valid token ids without one.
        sample_inputs: the keyword arguments of one forward call (name -> tensor), used as the
            sample batch instead of one made from what the model declares
            (:func:`make_sample_batch`): for a model that takes other inputs. Floating tensors
            are given FP32; the FP16 model and the exported formats get them in FP16.
        processor: an image processor, feature extractor or processor: makes the sample pixels
            or speech features and is saved alongside; loaded from ``model_or_path`` when that
            is a folder holding one and the model does not take text.
        keep_norms_fp32: keep normalisation layers FP32 (parameters and arithmetic).
        overflow_guard: keep modules whose FP16 output overflows in FP32 automatically.
        max_abs_error: largest allowed absolute error of the logits; ``None`` = not checked (the
            default: the scale of logits varies by model, see ``max_rel_error``).
        max_rel_error: largest allowed normwise relative error (``max|d| / max|ref|``), in [0, 1].
        min_top1_agreement: smallest allowed argmax agreement over real positions, in [0, 1].
        formats: any of ``"safetensors"`` (always written), ``"pt2"`` (a ``torch.export``
            ExportedProgram, ``torch.export.load``), ``"onnx"`` (needs the ``export`` extra;
            checked in onnxruntime's CPU provider), ``"torchscript"`` (deprecated by PyTorch).
        force: write the export even when parity fails (the report still says FAILED).
        overwrite: replace an existing ``output_dir`` (only once the new export is complete).
        max_guard_iterations: forward passes the overflow guard may spend.
        seed: for the random sample ids.

    Returns:
        The :class:`ExportReport`. ``report.passed`` is the parity verdict; ``report.written``
        whether ``output_dir`` now holds the export. When parity fails and ``force`` is false,
        nothing is written, not even a partial folder.

    Raises:
        SampleInputsError: a ``ValueError`` in one line, before anything is written: no sample
            batch can be made for the model, or its FP32 forward fails on the one made; it
            names ``sample_inputs=``.
    """
    formats = tuple(dict.fromkeys(["safetensors", *formats]))
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise ValueError(f"unknown export format(s) {unknown}; valid formats are {list(FORMATS)}")
    _check_threshold("max_abs_error", max_abs_error, 0.0, math.inf)
    _check_threshold("max_rel_error", max_rel_error, 0.0, 1.0)
    _check_threshold("min_top1_agreement", min_top1_agreement, 0.0, 1.0)
    if not isinstance(max_guard_iterations, int) or max_guard_iterations < 1:
        raise ValueError(f"max_guard_iterations must be an int >= 1, got {max_guard_iterations!r}")
    if sample_inputs is not None and sample_texts:
        raise ValueError("give sample_texts or sample_inputs, not both")
    check_export_extra(formats)
    target = Path(output_dir).resolve()
    local_source = None
    if not isinstance(model_or_path, nn.Module) and Path(model_or_path).exists():
        local_source = Path(model_or_path).resolve()
    stale_notes = staging.clean_stale_staging(target)  # may restore a previous export: check after
    staging.check_output_dir(target, local_source, overwrite)

    # Source model and its FP32 reference.
    if isinstance(model_or_path, nn.Module):
        source_model = model_or_path
        source = type(model_or_path).__name__
        source_bytes, measured = staging.fp32_bytes(model_or_path), False
    else:
        source = str(model_or_path)
        source_model = load_source(model_or_path)
        if tokenizer is None:
            tokenizer = load_tokenizer(model_or_path)
        if processor is None and main_input_name(source_model) != "input_ids":
            processor = load_processor(model_or_path)
        local = Path(model_or_path)
        if local.is_dir() and staging.weights_bytes(local):
            source_bytes, measured = staging.weights_bytes(local), True
        else:
            source_bytes, measured = staging.fp32_bytes(source_model), False
    reference_model = source_model
    if any(p.is_floating_point() and p.dtype != torch.float32 for p in source_model.parameters()):
        reference_model = copy.deepcopy(source_model).float()
    thresholds = {
        "max_abs_error": max_abs_error,
        "max_rel_error": max_rel_error,
        "min_top1_agreement": min_top1_agreement,
    }
    device = next(source_model.parameters()).device
    if sample_inputs is not None:
        inputs = check_sample_inputs(source_model, sample_inputs)
    else:
        inputs = make_sample_batch(source_model, tokenizer, sample_texts, seed, processor)
    sample, users_data = describe_sample(
        source_model, tokenizer, sample_texts, sample_inputs, processor
    )
    inputs = {
        name: tensor.to(device) for name, tensor in as_model_dtype(inputs, torch.float32).items()
    }
    extra = forward_kwargs(source_model)
    was_training = reference_model.training
    reference_model.eval()
    try:
        # A real FP32 forward: not under the caller's autocast, nor through Accelerate's autocast
        # forward wrapper (which a trained model keeps).
        with (
            torch.no_grad(),
            torch.autocast(device.type, enabled=False),
            without_autocast_wrapper(reference_model),
        ):
            output = reference_model(**inputs, **extra)
    except (TypeError, ValueError, RuntimeError, AttributeError, IndexError, KeyError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise cannot_feed(
            source_model,
            f"its FP32 forward failed on the sample inputs ({', '.join(inputs)}): {reason}",
        ) from err
    finally:
        reference_model.train(was_training)
    output_name, reference = pick_output(output)
    reference = reference.detach().float()
    # The FP16 model and every exported format take floating inputs (pixels, features) in FP16.
    fp16_inputs = as_model_dtype(inputs, torch.float16)

    # The FP16 model: a copy, norms and the model's own islands FP32, overflowing modules FP32.
    fp16 = copy.deepcopy(source_model).eval().half()
    drop_autocast_wrapper(fp16)  # measured as it runs once loaded: its own forward
    norms, own = keep_known_fp32(fp16, source_model, keep_norms_fp32)
    guarded: list[str] = []
    tied: list[str] = []
    failures: list[str] = []
    if overflow_guard:
        guarded, tied, failures = guard_overflows(
            fp16, source_model, {**fp16_inputs, **extra}, max_guard_iterations, kept=own
        )
    islands = sorted({*own, *tied})
    with torch.no_grad():
        _, candidate = pick_output(fp16(**fp16_inputs, **extra))
    mask = output_mask(inputs, reference)
    reference = reference.cpu()
    candidate = candidate.cpu()
    parity = {"pytorch": compare("pytorch", output_name, reference, candidate, mask, thresholds)}
    notes: list[str] = list(stale_notes)
    fp32_share = fp32_weight_share(fp16)
    if guarded and fp32_share > 0.5:
        notes.append(
            f"{fp32_share:.0%} of the weights stay FP32 to avoid FP16 overflow (islands: "
            f"{', '.join(guarded + islands)}): little is saved over the FP32 model"
        )
    if guarded or islands:
        notes.append(
            "modules kept FP32 by the overflow guard come back FP16 (and overflow again) with a "
            "plain from_pretrained(dtype=torch.float16); reload with "
            "amp_trainer.export.load_fp16_export"
        )
    notes += [DEPRECATED_FORMATS[f] for f in formats if f in DEPRECATED_FORMATS]

    # Write everything into a staging folder next to the target; rename at the end. Its name
    # carries our PID so that the next export can tell a dead run's leftovers from a live one.
    target.parent.mkdir(parents=True, exist_ok=True)
    # FP16 weights (about half of FP32) once per format, plus the old export until replaced.
    staging.check_free_space(target.parent, staging.fp32_bytes(fp16) // 2 * len(formats))
    staging_dir = staging.new_staging_folder(target)
    report = ExportReport(
        source=source,
        output_dir=str(target),
        passed=False,
        written=False,
        forced=False,
        fp32_modules=list(norms),
        overflow_guarded_modules=guarded,
        fp32_islands=islands,
        parity=parity,
        thresholds=thresholds,
        source_bytes=source_bytes,
        source_bytes_measured=measured,
        export_bytes=0,
        failures=failures,
        notes=notes,
        inputs=list(inputs),
        output=output_name,
        sample=sample,
        sample_rows=_rows(inputs),
    )
    try:
        fp16.config.update(
            {
                CONFIG_KEY: {
                    "fp32_modules": list(norms),
                    "overflow_guarded_modules": guarded,
                    "fp32_islands": islands,
                    "reload_with": "amp_trainer.export.load_fp16_export",
                }
            }
        )
        fp16.save_pretrained(staging_dir)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging_dir)
        if processor is not None:
            processor.save_pretrained(staging_dir)
        report.export_bytes = staging.weights_bytes(staging_dir)
        wrapper = output_only(fp16, output_name, list(fp16_inputs)).eval()
        writers = {"pt2": export_pt2, "onnx": export_onnx, "torchscript": export_torchscript}
        for fmt in (f for f in FORMATS if f in writers and f in formats):
            try:
                outputs = writers[fmt](wrapper, fp16_inputs, staging_dir / FILE_NAMES[fmt])
            except CaptureError as err:  # the tracer's limit, not ours: a reported failure
                logger.warning("%s", err)
                failures.append(str(err))
                (staging_dir / FILE_NAMES[fmt]).unlink(missing_ok=True)
                continue
            parity[fmt] = compare(fmt, output_name, reference, outputs, mask, thresholds)
        for result in parity.values():
            failures.extend(result.failures)
        report.thin_evidence = thin_evidence(list(parity.values()), thresholds, sample, users_data)
        report.passed = not failures
        report.forced = not report.passed and force
        if report.passed or force:
            report.written = True
            report.files = sorted(
                [p.name for p in staging_dir.iterdir()] + ["report.json", "report.md"]
            )
            write_text_atomic(staging_dir / "report.md", report.to_markdown())
            # Every file's digest but report.json's own: load_fp16_export checks them.
            report.sha256 = staging.digests(staging_dir, skip=("report.json",))
            write_text_atomic(staging_dir / "report.json", report.to_json())
            staging.install(staging_dir, target)
            logger.info("FP16 export written to %s", target)
        else:
            logger.warning("FP16 export failed parity; nothing written: %s", "; ".join(failures))
    except Exception as err:
        if is_disk_full(err, staging_dir):
            raise OSError(
                errno.ENOSPC,
                f"no space left on device writing the FP16 export to {target}; nothing was "
                "written (the partial staging folder was removed)",
            ) from err
        raise
    finally:
        if staging_dir.exists():
            shutil.rmtree(staging_dir, ignore_errors=True)
    return report
