"""FP16 inference export with a parity report: safetensors, optionally TorchScript and ONNX.

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
3. the FP16 model (and every extra format) is compared with the FP32 model on the same inputs:
   max/mean absolute and relative error of the logits, top-1 agreement, non-finite count;
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
"""

from __future__ import annotations

import copy
import dataclasses
import errno
import glob
import importlib.util
import io
import json
import logging
import math
import os
import re
import shutil
import uuid
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from amp_trainer.atomic_files import is_disk_full, write_text_atomic
from amp_trainer.islands import (
    fp32_islands,
    keep_in_fp32,
    keep_norms_in_fp32,
    recorded_fp32_islands,
    remove_fp32_island,
    restore_fp32_islands,
)
from amp_trainer.numerics import FP16_MAX, OverflowProbe

__all__ = [
    "DEFAULT_SAMPLE_TEXTS",
    "FORMATS",
    "FP16_MAX",
    "ExportReport",
    "ParityResult",
    "export_fp16",
    "load_fp16_export",
    "load_model",
    "load_tokenizer",
    "make_sample_batch",
]

logger = logging.getLogger(__name__)

#: Formats :func:`export_fp16` can write. safetensors is always written (it is what
#: ``from_pretrained`` reloads); the others are extras.
FORMATS = ("safetensors", "torchscript", "onnx")
#: Used for the parity check when a tokenizer is available but no texts were given.
DEFAULT_SAMPLE_TEXTS = (
    "The movie was a delight from start to finish.",
    "I would not recommend this restaurant to anyone.",
    "Mixed precision training keeps master weights in float32.",
    "The gradient scaler multiplies the loss before the backward pass.",
    "It rained all day, so we stayed inside and read.",
    "Stock prices fell sharply after the announcement.",
    "A quick brown fox jumps over the lazy dog.",
    "Half precision overflows above sixty-five thousand five hundred and four.",
)
# The key in config.json under which the export records what it kept in FP32.
CONFIG_KEY = "amp_trainer_export"
_OUTPUT_NAMES = ("logits", "last_hidden_state")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")
_RANDOM_BATCH, _RANDOM_LENGTH = 8, 16
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "vocab.json",
    "spiece.model",
    "tokenizer.model",
)


# --------------------------------------------------------------------------------------------
# reports
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ParityResult:
    """How one exported artifact's outputs compare with the FP32 model's on the sample inputs.

    Errors are taken over the real (non-padding) positions only. Relative errors are normwise
    (error divided by the reference's magnitude: ``max_rel_error = max_abs_error / max|ref|``,
    ``mean_rel_error = mean_abs_error / mean|ref|``), because elementwise relative error explodes
    on logits near zero and says nothing. ``top1_agreement`` is the fraction of positions whose
    argmax over the last dimension matches (``None`` for hidden states, where it means nothing).
    """

    format: str
    output: str
    positions: int
    max_abs_error: float
    mean_abs_error: float
    max_rel_error: float
    mean_rel_error: float
    top1_agreement: float | None
    nonfinite: int
    passed: bool
    failures: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["failures"] = list(self.failures)
        return data


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
        lines = [f"## FP16 export: {verdict}", "", f"- source: `{self.source}`"]
        where = self.output_dir if self.written else f"{self.output_dir} (nothing written)"
        lines.append(f"- output: `{where}`")
        size = _human_bytes(self.source_bytes) + ("" if self.source_bytes_measured else " (est.)")
        lines.append(
            f"- weights: {_human_bytes(self.export_bytes)} FP16 vs {size} FP32"
            + (f" ({self.size_ratio:.2f}x)" if self.size_ratio else "")
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
        if self.notes:
            lines += ["", "Notes:"] + [f"- {note}" for note in self.notes]
        return "\n".join(lines) + "\n"


def _human_bytes(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    return f"{value:.1f} GiB"  # pragma: no cover - unreachable


# --------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------
def load_model(
    path_or_id: str | os.PathLike[str], *, dtype: torch.dtype = torch.float32
) -> nn.Module:
    """Load a transformers model with the head its config names (``config.architectures[0]``).

    ``AutoModel`` would silently drop a classification or LM head, and the head's logits are what
    parity (and the NaN doctor's loss) needs. Falls back to ``AutoModel`` when the config names no
    architecture transformers knows.
    """
    import transformers

    config = transformers.AutoConfig.from_pretrained(path_or_id)
    cls: Any = transformers.AutoModel
    for arch in getattr(config, "architectures", None) or ():
        if hasattr(transformers, arch):
            cls = getattr(transformers, arch)
            break
    return cls.from_pretrained(path_or_id, dtype=dtype)


def load_tokenizer(path_or_id: str | os.PathLike[str]) -> Any | None:
    """The tokenizer saved with the model, or ``None`` if there is none (random ids are used).

    A local folder must hold tokenizer files: transformers 5 otherwise builds an *empty* tokenizer
    from the model type (a BertTokenizer with only the 5 special tokens, mapping every word to
    ``[UNK]``) rather than failing, and parity on all-``[UNK]`` inputs would measure nothing.
    """
    from transformers import AutoTokenizer

    local = Path(path_or_id)
    if local.is_dir() and not any((local / name).is_file() for name in _TOKENIZER_FILES):
        logger.info("No tokenizer files in %s; parity uses random token ids.", local)
        return None

    try:
        return AutoTokenizer.from_pretrained(path_or_id)
    except (OSError, ValueError, TypeError, KeyError) as err:
        logger.info("No tokenizer at %s (%s); parity uses random token ids.", path_or_id, err)
        return None


def load_fp16_export(path: str | os.PathLike[str], model_class: Any | None = None) -> nn.Module:
    """Reload an :func:`export_fp16` folder exactly as it was measured.

    ``from_pretrained(path, dtype=torch.float16)`` casts every tensor to FP16; this then restores
    the modules the export kept in FP32 (their FP32 weights are in the safetensors file) and
    makes them FP32 islands again (:func:`~amp_trainer.islands.keep_in_fp32`), so outputs
    match the parity report.
    """
    from safetensors import safe_open

    path = Path(path)
    if model_class is None:
        model = load_model(path, dtype=torch.float16)
    else:
        model = model_class.from_pretrained(path, dtype=torch.float16)
    info = getattr(model.config, CONFIG_KEY, None) or {}
    norms = list(info.get("fp32_modules", []))
    guarded = [
        *info.get("overflow_guarded_modules", []),
        *info.get("fp32_islands", []),  # the model's own islands and modules tied to islands
    ]
    kept = [*norms, *guarded]
    if kept:
        modules = dict(model.named_modules())
        for name in kept:
            if name not in modules:
                raise ValueError(
                    f"{path}: config lists {name!r} as kept in FP32, but the model has no such "
                    "module; was the folder written by a different model class?"
                )
            modules[name].float()
        # Taken after .float(): it replaced the tensors, and the FP32 values go into the new ones
        # (a weight above 65504 is inf in the FP16 copy from_pretrained made).
        state = model.state_dict()
        prefixes = tuple(name + "." for name in kept)
        with torch.no_grad():
            for file in sorted(path.glob("*.safetensors")):
                with safe_open(str(file), framework="pt") as handle:
                    for key in handle.keys():  # noqa: SIM118 - safe_open has keys(), not __iter__
                        if key.startswith(prefixes) and key in state:
                            state[key].copy_(handle.get_tensor(key).to(torch.float32))
        if norms:
            keep_norms_in_fp32(model)
        if guarded:
            keep_in_fp32(model, [_exactly(name) for name in guarded])
    return model.eval()


# --------------------------------------------------------------------------------------------
# FP32 islands and the overflow guard
# --------------------------------------------------------------------------------------------
def _exactly(name: str) -> re.Pattern[str]:
    """``name`` as a keep_in_fp32 pattern matching that one module (not every ``*.name``)."""
    return re.compile(re.escape(name))


def _restore_fp32_weights(model: nn.Module, source: nn.Module, names: Iterable[str]) -> None:
    """Give the islands ``names`` of the halved ``model`` the FP32 source's exact weights.

    ``.half()`` rounded them (or turned them into ``inf``: a weight above 65504 does not survive
    the cast); the island made them FP32 again but cannot undo the rounding. State-dict keys are
    unchanged by islands, so the source's keys address the same tensors.
    """
    modules = dict(model.named_modules())
    source_modules = dict(source.named_modules())
    with torch.no_grad():
        for name in names:
            if name not in source_modules:
                continue
            reference = source_modules[name].state_dict()
            for key, value in modules[name].state_dict().items():
                if key in reference and value.is_floating_point():
                    value.copy_(reference[key].to(torch.float32))


def _fp32_weight_share(model: nn.Module) -> float:
    """The fraction of the model's floating weights (shared ones counted once) kept FP32."""
    seen: set[int] = set()
    fp32 = total = 0
    for param in model.parameters():
        if id(param) in seen or not param.is_floating_point():
            continue
        seen.add(id(param))
        total += param.numel()
        fp32 += param.numel() if param.dtype == torch.float32 else 0
    return fp32 / total if total else 0.0


def _enclosing_called(name: str, called: set[str]) -> str:
    """The nearest ancestor of ``name`` that ran a forward (``""`` is the root)."""
    while name:
        name = name.rsplit(".", 1)[0] if "." in name else ""
        if name in called:
            return name
    return ""


def _guard_overflows(
    model: nn.Module,
    source: nn.Module,
    inputs: Mapping[str, torch.Tensor],
    max_iterations: int,
    kept: Iterable[str] = (),
) -> tuple[list[str], list[str], list[str]]:
    """Keep modules in FP32 until an FP16 forward on ``inputs`` is clean (bounded).

    Returns (guarded module names, modules kept FP32 because they share a parameter with a
    guarded one, failures). Each iteration runs one forward with probes: the first overflowing
    module becomes an island (:func:`~amp_trainer.islands.keep_in_fp32`); an island that itself
    overflows (its FP32 output does not fit FP16) is replaced by its nearest enclosing module that
    runs a forward (not a ModuleList), whose descendants' islands are dropped. ``kept`` are islands
    the model came with (they are widened the same way). Island weights come from ``source``
    (the FP32 model), not from the halved copy. Tied parameters: a module that shares one with an
    island becomes an island too (GPT-2's ``lm_head`` and ``transformer.wte``), so no module ever
    meets FP32 weights with FP16 inputs.
    """
    modules = dict(model.named_modules())
    islands: list[str] = []
    tied: list[str] = []
    for _ in range(max_iterations):
        with (
            OverflowProbe(model, limit=FP16_MAX, skip_under=[*kept, *islands, *tied]) as probe,
            torch.no_grad(),
        ):
            model(**inputs)
        culprit = probe.first
        if culprit is None:
            return sorted(islands), sorted(tied), []
        target = culprit
        if culprit in islands or culprit in tied or culprit in kept:
            target = _enclosing_called(culprit, probe.called)
        if target == "":
            return (
                sorted(islands),
                sorted(tied),
                [
                    f"module {culprit or '<root>'!r} overflows FP16 and no enclosing module below "
                    "the root brings its output back into the FP16 range; this model cannot be "
                    "exported to FP16 as is"
                ],
            )
        for name in [n for n in [*islands, *tied] if n.startswith(target + ".")]:
            remove_fp32_island(modules[name])
            (islands if name in islands else tied).remove(name)
        logger.info("Overflow guard: keeping %r in FP32 (first FP16 overflow: %r)", target, culprit)
        covered = keep_in_fp32(model, _exactly(target))
        _restore_fp32_weights(model, source, covered)
        islands.append(target)
        for name in covered:
            if name != target and name not in tied and name not in kept:
                logger.info("Overflow guard: keeping %r in FP32 too (tied to %r)", name, target)
                tied.append(name)
    return (
        sorted(islands),
        sorted(tied),
        [
            f"overflow guard gave up after {max_iterations} iterations; still overflowing: "
            f"{sorted(islands)}"
        ],
    )


# --------------------------------------------------------------------------------------------
# sample inputs and parity
# --------------------------------------------------------------------------------------------
def make_sample_batch(
    model: nn.Module,
    tokenizer: Any | None = None,
    texts: Sequence[str] | None = None,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """One padded batch: the texts (or built-in ones) through the tokenizer, else random ids.

    Padding is done here, not by the tokenizer, so a tokenizer without a pad token (GPT-2) works;
    padded positions get id 0 and mask 0 and are excluded from parity.
    """
    config = model.config
    max_len = min(
        128,
        getattr(config, "max_position_embeddings", None)
        or getattr(config, "n_positions", None)
        or 128,
    )
    if tokenizer is None:
        if texts:
            raise ValueError("sample texts were given but there is no tokenizer to encode them")
        generator = torch.Generator().manual_seed(seed)
        vocab = int(config.vocab_size)
        length = min(_RANDOM_LENGTH, max_len)
        ids = torch.randint(0, vocab, (_RANDOM_BATCH, length), generator=generator)
        mask = torch.ones_like(ids)
        for row in range(1, _RANDOM_BATCH, 2):  # every other row padded: masks are exercised
            mask[row, length - row // 2 - 1 :] = 0
        return {"input_ids": ids * mask, "attention_mask": mask}
    encoded = [
        tokenizer(text, truncation=True, max_length=max_len)
        for text in (texts or DEFAULT_SAMPLE_TEXTS)
    ]
    width = max(len(e["input_ids"]) for e in encoded)
    batch: dict[str, torch.Tensor] = {}
    keys = [k for k in ("input_ids", "token_type_ids") if k in encoded[0]]
    for key in keys:
        batch[key] = torch.tensor(
            [list(e[key]) + [0] * (width - len(e[key])) for e in encoded], dtype=torch.long
        )
    batch["attention_mask"] = torch.tensor(
        [[1] * len(e["input_ids"]) + [0] * (width - len(e["input_ids"])) for e in encoded],
        dtype=torch.long,
    )
    return batch


def _forward_kwargs(model: nn.Module) -> dict[str, Any]:
    import inspect

    params = inspect.signature(model.forward).parameters
    extra: dict[str, Any] = {"return_dict": True}
    if "use_cache" in params or "kwargs" in params:
        extra["use_cache"] = False
    return extra


def _pick_output(output: Any) -> tuple[str, torch.Tensor]:
    for name in _OUTPUT_NAMES:
        value = output.get(name) if isinstance(output, Mapping) else None
        if isinstance(value, torch.Tensor):
            return name, value
    raise ValueError(
        f"model output has none of {_OUTPUT_NAMES}; cannot compare FP16 and FP32 outputs "
        f"(got {type(output).__name__})"
    )


class _OutputOnly(nn.Module):
    """``model(**inputs)[output_name]`` as a module of plain tensors, for TorchScript and ONNX."""

    def __init__(self, model: nn.Module, output_name: str) -> None:
        super().__init__()
        self.model = model
        self.output_name = output_name
        self._extra = _forward_kwargs(model)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        kwargs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if token_type_ids is not None:
            kwargs["token_type_ids"] = token_type_ids
        return self.model(**kwargs, **self._extra)[self.output_name]


def _compare(
    fmt: str,
    output_name: str,
    reference: torch.Tensor,
    candidate: torch.Tensor,
    mask: torch.Tensor,
    thresholds: Mapping[str, float | None],
) -> ParityResult:
    if candidate.shape != reference.shape:
        raise RuntimeError(
            f"{fmt}: output shape {tuple(candidate.shape)} != FP32 {tuple(reference.shape)}"
        )
    # [batch, seq, ...] outputs are compared on real tokens; [batch, classes] on every row.
    keep = mask.bool() if reference.dim() >= 3 else torch.ones(len(reference), dtype=torch.bool)
    ref = reference.float()[keep]
    cand = candidate.float()[keep]
    finite = torch.isfinite(cand)
    nonfinite = int((~finite).sum())
    diff = (cand - ref).abs()
    diff = torch.where(finite, diff, torch.zeros_like(diff))
    max_abs = float(diff.max()) if diff.numel() else 0.0
    mean_abs = float(diff.mean()) if diff.numel() else 0.0
    ref_abs = ref.abs()
    max_rel = max_abs / max(float(ref_abs.max()), 1e-12) if ref.numel() else 0.0
    mean_rel = mean_abs / max(float(ref_abs.mean()), 1e-12) if ref.numel() else 0.0
    top1 = None
    if output_name == "logits":
        top1 = float((cand.argmax(-1) == ref.argmax(-1)).float().mean()) if ref.numel() else 1.0
    failures = []
    if nonfinite:
        failures.append(f"{fmt}: {nonfinite} non-finite output value(s)")
    limit = thresholds.get("max_abs_error")
    if limit is not None and max_abs > limit:
        failures.append(f"{fmt}: max abs error {max_abs:.4g} > max_abs_error={limit}")
    limit = thresholds.get("max_rel_error")
    if limit is not None and max_rel > limit:
        failures.append(f"{fmt}: max rel error {max_rel:.4g} > max_rel_error={limit}")
    limit = thresholds.get("min_top1_agreement")
    if limit is not None and top1 is not None and top1 < limit:
        failures.append(f"{fmt}: top-1 agreement {top1:.4f} < min_top1_agreement={limit}")
    return ParityResult(
        format=fmt,
        output=output_name,
        positions=int(ref.shape[0]) if ref.dim() else 1,
        max_abs_error=max_abs,
        mean_abs_error=mean_abs,
        max_rel_error=max_rel,
        mean_rel_error=mean_rel,
        top1_agreement=top1,
        nonfinite=nonfinite,
        passed=not failures,
        failures=tuple(failures),
    )


# --------------------------------------------------------------------------------------------
# extra formats
# --------------------------------------------------------------------------------------------
def _export_torchscript(
    wrapper: _OutputOnly, inputs: Mapping[str, torch.Tensor], path: Path
) -> torch.Tensor:
    with warnings.catch_warnings():
        # Tracing warns about every Python-level shape check in modeling code; the trace is
        # validated below against the FP32 reference instead.
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        # ...and tracing reads every attribute, deprecated transformers properties included.
        warnings.simplefilter("ignore", FutureWarning)
        traced = torch.jit.trace(wrapper, example_kwarg_inputs=dict(inputs), strict=False)
    # Serialise in memory, write from Python: torch's zip writer finishes the file in its C++
    # destructor, and a write error there (disk full) is an exception thrown from a destructor,
    # which aborts the whole process (rc 134) instead of raising.
    buffer = io.BytesIO()
    torch.jit.save(traced, buffer)
    with open(path, "wb") as handle:
        handle.write(buffer.getbuffer())
    del buffer
    reloaded = torch.jit.load(str(path))
    with torch.no_grad():
        return reloaded(**inputs).cpu()


def _export_onnx(
    wrapper: _OutputOnly, inputs: Mapping[str, torch.Tensor], path: Path
) -> torch.Tensor:
    import onnxruntime

    dims = {0: "batch", 1: "sequence"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            wrapper,
            (),
            str(path),
            kwargs=dict(inputs),
            dynamo=True,
            dynamic_shapes={name: dims for name in inputs},
            output_names=[wrapper.output_name],
            external_data=False,
            verbose=False,
        )
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {i.name: inputs[i.name].cpu().numpy() for i in session.get_inputs()}
    (result,) = session.run([wrapper.output_name], feeds)
    return torch.from_numpy(result)


def _check_export_extra(formats: Iterable[str]) -> None:
    if "onnx" in formats:
        missing = [
            m for m in ("onnx", "onnxruntime", "onnxscript") if not importlib.util.find_spec(m)
        ]
        if missing:
            raise ImportError(
                f"ONNX export needs {', '.join(missing)}: pip install 'amp-trainer[export]'"
            )


# --------------------------------------------------------------------------------------------
# sizes and atomic writes
# --------------------------------------------------------------------------------------------
def _weights_bytes(folder: Path) -> int:
    return sum(
        p.stat().st_size
        for p in folder.iterdir()
        if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES) and "tokenizer" not in p.name
    )


def _fp32_bytes(model: nn.Module) -> int:
    """Bytes the model's state would take as FP32 safetensors (shared storages counted once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for tensor in model.state_dict().values():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        itemsize = 4 if tensor.is_floating_point() else tensor.element_size()
        total += tensor.numel() * itemsize
    return total


# Hidden siblings of the output folder while an export runs: ``.NAME.tmp-PID-XXXXXXXX`` is the
# staging folder being written, ``.NAME.old-PID-XXXXXXXX`` the previous export moved aside for the
# instant between the two renames of _install. The PID says whether their writer is still alive.
_STAGING, _TRASH = "tmp", "old"


def _sibling(target: Path, kind: str) -> Path:
    return target.with_name(f".{target.name}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _writer_alive(folder: Path) -> bool:
    """Whether the process that named ``folder`` still runs (then it is not stale)."""
    parts = folder.name.rsplit("-", 2)
    if len(parts) != 3 or not parts[1].isdigit():
        return False  # an older export's mkdtemp name: no PID, left by a dead run
    pid = int(parts[1])
    if pid == os.getpid():
        return False  # our own leftovers from an earlier call in this process
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, someone else's
        return True
    return True


def _clean_stale_staging(target: Path) -> list[str]:
    """Remove what a killed export left next to ``target``; returns one note per folder.

    A staging folder of a dead export is deleted. A previous export that was moved aside when
    the export died (between the two renames of :func:`_install`) is put back if ``target`` is
    missing, else deleted.
    """
    notes: list[str] = []
    if not target.parent.is_dir():
        return notes
    name = glob.escape(f".{target.name}")
    for kind in (_TRASH, _STAGING):
        for folder in sorted(target.parent.glob(f"{name}.{kind}-*")):
            if not folder.is_dir() or _writer_alive(folder):
                continue
            if kind == _TRASH and not target.exists():
                os.replace(folder, target)
                note = f"restored the previous export {target} from {folder.name}, which an "
                note += "interrupted export had moved aside"
            else:
                shutil.rmtree(folder, ignore_errors=True)
                note = f"removed {folder}, left behind by an interrupted export"
            logger.warning("%s", note)
            notes.append(note)
    return notes


def _install(staging: Path, target: Path) -> None:
    """Move the finished staging folder to ``target``, replacing an existing one last."""
    if target.exists():
        trash = _sibling(target, _TRASH)
        os.replace(target, trash)
        os.replace(staging, target)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(staging, target)


def _check_output_dir(target: Path, source: Path | None, overwrite: bool) -> None:
    """Refuse an ``output_dir`` whose replacement would delete anything but an earlier export.

    The export replaces ``target`` as a whole, so ``target`` must not be the source folder,
    contain it (a parent folder: sibling runs with it) or lie inside it; and ``overwrite`` only
    replaces a folder every entry of which an earlier export wrote (its ``report.json`` lists
    them), never a run folder or anything a user put there.
    """
    if source is not None:
        if target == source:
            raise ValueError(
                f"output_dir {target} is the source model folder; the export would replace the "
                "FP32 model with its FP16 copy. Choose another output_dir."
            )
        if target in source.parents:
            raise ValueError(
                f"output_dir {target} contains the source model folder {source}; replacing it "
                "would delete the source and everything next to it. Choose another output_dir."
            )
        if source in target.parents:
            raise ValueError(
                f"output_dir {target} lies inside the source model folder {source}; write the "
                "export next to the model, not into it."
            )
    if not target.exists():
        return
    if not target.is_dir():
        raise FileExistsError(f"output_dir {target} exists and is not a folder")
    entries = sorted(entry.name for entry in target.iterdir())
    if not entries:
        return
    if not overwrite:
        raise FileExistsError(f"{target} already exists and is not empty; pass overwrite=True")
    written = _files_of_earlier_export(target)
    if written is None:
        raise FileExistsError(
            f"{target} is not an earlier FP16 export (no report.json written by export_fp16); "
            "overwrite replaces only such a folder. Remove it yourself or choose another "
            "output_dir."
        )
    foreign = [name for name in entries if name not in written]
    if foreign:
        shown = ", ".join(foreign[:5]) + (" ..." if len(foreign) > 5 else "")
        raise FileExistsError(
            f"{target} holds files an earlier export did not write ({shown}); overwrite "
            "replaces only what export_fp16 wrote. Move them away or choose another output_dir."
        )


def _files_of_earlier_export(folder: Path) -> set[str] | None:
    """The file names ``folder/report.json`` says an earlier :func:`export_fp16` wrote."""
    try:
        report = json.loads((folder / "report.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(report, dict) or not {"source", "parity", "files"} <= set(report):
        return None
    files = report["files"]
    if not isinstance(files, list) or not all(isinstance(name, str) for name in files):
        return None
    return set(files)


def _check_free_space(folder: Path, needed: int) -> None:
    """Refuse up front when ``folder``'s disk cannot take ``needed`` bytes."""
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return
    if free < needed:
        raise OSError(
            errno.ENOSPC,
            f"no space left on device for the FP16 export in {folder}: it needs about "
            f"{_human_bytes(needed)}, {_human_bytes(free)} free",
        )


def _load_source(path: str | os.PathLike[str]) -> nn.Module:
    """:func:`load_model`, with a model that cannot be loaded said in one line naming it."""
    from safetensors import SafetensorError

    try:
        return load_model(path, dtype=torch.float32)
    except (OSError, ValueError, RuntimeError, SafetensorError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"cannot load a model from {path}: {reason}") from err


def _check_threshold(name: str, value: float | None, low: float, high: float) -> None:
    if value is None:
        return
    if (
        not isinstance(value, (int, float))
        or isinstance(value, bool)
        or not (low <= float(value) <= high)
    ):
        raise ValueError(f"{name} must be a number in [{low}, {high}], got {value!r}")


# --------------------------------------------------------------------------------------------
# the export
# --------------------------------------------------------------------------------------------
def export_fp16(
    model_or_path: nn.Module | str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    *,
    tokenizer: Any | None = None,
    sample_texts: Sequence[str] | None = None,
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
            ``report.md`` and ``model.torchscript.pt`` / ``model.onnx`` when asked for).
        tokenizer: saved alongside and used to encode the sample texts; loaded from
            ``model_or_path`` when that is a folder and this is ``None``.
        sample_texts: parity inputs; default: built-in sentences with a tokenizer, random valid
            token ids without one.
        keep_norms_fp32: keep normalisation layers FP32 (parameters and arithmetic).
        overflow_guard: keep modules whose FP16 output overflows in FP32 automatically.
        max_abs_error: largest allowed absolute error of the logits; ``None`` = not checked (the
            default: the scale of logits varies by model, see ``max_rel_error``).
        max_rel_error: largest allowed normwise relative error (``max|d| / max|ref|``), in [0, 1].
        min_top1_agreement: smallest allowed argmax agreement over real positions, in [0, 1].
        formats: any of ``"safetensors"`` (always written), ``"torchscript"``, ``"onnx"`` (needs
            the ``export`` extra; checked in onnxruntime's CPU provider).
        force: write the export even when parity fails (the report still says FAILED).
        overwrite: replace an existing ``output_dir`` (only once the new export is complete).
        max_guard_iterations: forward passes the overflow guard may spend.
        seed: for the random sample ids.

    Returns:
        The :class:`ExportReport`. ``report.passed`` is the parity verdict; ``report.written``
        whether ``output_dir`` now holds the export. When parity fails and ``force`` is false,
        nothing is written, not even a partial folder.
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
    _check_export_extra(formats)
    target = Path(output_dir).resolve()
    local_source = None
    if not isinstance(model_or_path, nn.Module) and Path(model_or_path).exists():
        local_source = Path(model_or_path).resolve()
    stale_notes = _clean_stale_staging(target)  # may restore a previous export: check after
    _check_output_dir(target, local_source, overwrite)

    # Source model and its FP32 reference.
    if isinstance(model_or_path, nn.Module):
        source_model = model_or_path
        source = type(model_or_path).__name__
        source_bytes, measured = _fp32_bytes(model_or_path), False
    else:
        source = str(model_or_path)
        source_model = _load_source(model_or_path)
        if tokenizer is None:
            tokenizer = load_tokenizer(model_or_path)
        local = Path(model_or_path)
        if local.is_dir() and _weights_bytes(local):
            source_bytes, measured = _weights_bytes(local), True
        else:
            source_bytes, measured = _fp32_bytes(source_model), False
    reference_model = source_model
    if any(p.is_floating_point() and p.dtype != torch.float32 for p in source_model.parameters()):
        reference_model = copy.deepcopy(source_model).float()
    thresholds = {
        "max_abs_error": max_abs_error,
        "max_rel_error": max_rel_error,
        "min_top1_agreement": min_top1_agreement,
    }
    device = next(source_model.parameters()).device
    inputs = make_sample_batch(source_model, tokenizer, sample_texts, seed)
    inputs = {name: tensor.to(device) for name, tensor in inputs.items()}
    extra = _forward_kwargs(source_model)
    was_training = reference_model.training
    reference_model.eval()
    try:
        with torch.no_grad():
            output_name, reference = _pick_output(reference_model(**inputs, **extra))
    finally:
        reference_model.train(was_training)
    reference = reference.detach().float()

    # The FP16 model: a copy, norms FP32, overflowing modules FP32.
    fp16 = copy.deepcopy(source_model).eval().half()
    norms = keep_norms_in_fp32(fp16) if keep_norms_fp32 else []
    # Islands the model came with (trained with fp32_modules, _keep_in_fp32_modules or the
    # forward-overflow fallback) stay FP32, with the modules tied to them.
    # A model loaded from a folder has them in its config (AmpTrainer records them there).
    own = [*fp32_islands(fp16), *recorded_fp32_islands(getattr(fp16, "config", None))]
    own = restore_fp32_islands(fp16, own) if own else []
    _restore_fp32_weights(fp16, source_model, [*norms, *own])
    guarded: list[str] = []
    tied: list[str] = []
    failures: list[str] = []
    if overflow_guard:
        guarded, tied, failures = _guard_overflows(
            fp16, source_model, {**inputs, **extra}, max_guard_iterations, kept=own
        )
    islands = sorted({*own, *tied})
    with torch.no_grad():
        _, candidate = _pick_output(fp16(**inputs, **extra))
    mask = inputs["attention_mask"].cpu()
    reference = reference.cpu()
    candidate = candidate.cpu()
    parity = {"pytorch": _compare("pytorch", output_name, reference, candidate, mask, thresholds)}
    notes: list[str] = list(stale_notes)
    fp32_share = _fp32_weight_share(fp16)
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

    # Write everything into a staging folder next to the target; rename at the end. Its name
    # carries our PID so that the next export can tell a dead run's leftovers from a live one.
    target.parent.mkdir(parents=True, exist_ok=True)
    # FP16 weights (about half of FP32) once per format, plus the old export until replaced.
    _check_free_space(target.parent, _fp32_bytes(fp16) // 2 * len(formats))
    staging = _sibling(target, _STAGING)
    staging.mkdir()  # the umask's permissions: mkdtemp's drwx------ would become the output's
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
        fp16.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        report.export_bytes = _weights_bytes(staging)
        wrapper = _OutputOnly(fp16, output_name).eval()
        if "torchscript" in formats:
            outputs = _export_torchscript(wrapper, inputs, staging / "model.torchscript.pt")
            parity["torchscript"] = _compare(
                "torchscript", output_name, reference, outputs, mask, thresholds
            )
        if "onnx" in formats:
            outputs = _export_onnx(wrapper, inputs, staging / "model.onnx")
            parity["onnx"] = _compare("onnx", output_name, reference, outputs, mask, thresholds)
        for result in parity.values():
            failures.extend(result.failures)
        report.passed = not failures
        report.forced = not report.passed and force
        if report.passed or force:
            report.written = True
            report.files = sorted(
                [p.name for p in staging.iterdir()] + ["report.json", "report.md"]
            )
            write_text_atomic(staging / "report.json", report.to_json())
            write_text_atomic(staging / "report.md", report.to_markdown())
            _install(staging, target)
            logger.info("FP16 export written to %s", target)
        else:
            logger.warning("FP16 export failed parity; nothing written: %s", "; ".join(failures))
    except Exception as err:
        if is_disk_full(err, staging):
            raise OSError(
                errno.ENOSPC,
                f"no space left on device writing the FP16 export to {target}; nothing was "
                "written (the partial staging folder was removed)",
            ) from err
        raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return report
