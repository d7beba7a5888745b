"""The extra formats: torch.export (``.pt2``), ONNX and TorchScript writers, each read back for
its own parity row.

Every format takes the sample batch's inputs by name (``input_ids``, ``attention_mask``,
``pixel_values``, ``input_features``, ``decoder_input_ids``, ...: :attr:`ExportReport.inputs
<amp_trainer.export.ExportReport>`) and returns one tensor, the output parity compared (``logits``,
else ``last_hidden_state``). Batch and sequence lengths stay dynamic wherever the model allows
(``torch.export.Dim.AUTO``: a size the model fixes, such as Whisper's frame count or an image
size, is kept static instead of failing the export).

TorchScript is deprecated by PyTorch (torch 2.14 warns on ``torch.jit.save``/``load``: "Please
switch to torch.export"); it stays while torch ships it, and nothing here touches ``torch.jit``
unless it is asked for.

Part of :mod:`amp_trainer.export`, which re-exports :data:`FORMATS`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import warnings
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.export import Dim

from amp_trainer.export.parity import OutputOnly
from amp_trainer.log_filters import dropping_messages

#: Formats :func:`~amp_trainer.export.export_fp16` can write. safetensors is always written (it is
#: what ``from_pretrained`` reloads); the others are extras.
FORMATS = ("safetensors", "pt2", "onnx", "torchscript")
#: The file each extra format writes into the export folder.
FILE_NAMES = {"pt2": "model.pt2", "onnx": "model.onnx", "torchscript": "model.torchscript.pt"}
#: Formats kept for compatibility only (the report notes it when one is written).
DEPRECATED_FORMATS = {"torchscript": "TorchScript is deprecated by PyTorch; prefer 'pt2'"}


class CaptureError(RuntimeError):
    """A format's tracer could not capture the model (one line: the format, the model, the
    tracer's reason and the model code it stopped at). The export records it as that format's
    failure instead of raising: the other formats' parity is still measured and reported."""


# torch's ONNX exporter warns, on every export, that it skips four torchvision operators when
# torchvision is not installed; no transformers model uses them.
_ONNX_REGISTRY_LOGGER = "torch.onnx._internal.exporter._registration"
_NO_TORCHVISION = "torchvision is not installed. Skipping torchvision::"
# TorchScript's tracer reads every attribute of every submodule, including transformers'
# ``loss_function`` property of a base model that has no head and so no loss (BertModel inside a
# classifier): it warns that the causal-LM loss is the default, for a loss nothing computes.
_TRANSFORMERS_MODELING_LOGGER = "transformers.modeling_utils"
_DEFAULT_LOSS = "`loss_type=None` was set in the config but it is unrecognized."

_WHERE = re.compile(r'File "([^"]+)", line (\d+)')
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@contextlib.contextmanager
def capture_errors(fmt: str, wrapper: OutputOnly) -> Iterator[None]:
    """Turn a tracer's failure (torch.export's data-dependent branches, unsupported ops: many
    lines of advice) into one :class:`CaptureError` line. Only the capture step is wrapped, so
    a write error (a full disk) still raises as itself."""
    try:
        yield
    except RuntimeError as err:
        # The ONNX exporter wraps torch.export's error (or the decomposition's ValueError): the
        # innermost one says why.
        chain: list[BaseException] = [err]
        while chain[-1].__cause__ is not None and len(chain) < 8:
            chain.append(chain[-1].__cause__)
        texts = [_ANSI.sub("", str(e)).strip() for e in reversed(chain)]
        reason = texts[0].splitlines()[0] if texts[0] else type(chain[-1]).__name__
        if "data-dependent" in reason:
            reason = f"the model's code branches on tensor values there ({reason})"
        # The model line it stopped at: the innermost frame torch names after "raised this
        # error" (torch.export) or "Original traceback:" (the ONNX decomposition).
        where = None
        for text in texts:
            for marker in ("raised this error", "Original traceback:"):
                if marker in text:
                    frames = _WHERE.findall(text.split(marker, 1)[1])
                    where = where or (frames[-1] if frames else None)
        at = f" at {Path(where[0]).name}:{where[1]}" if where else ""
        model = type(wrapper.model).__name__
        raise CaptureError(f"{fmt}: cannot capture {model}{at}: {reason}") from err


def dynamic_shapes(inputs: Mapping[str, torch.Tensor]) -> dict[str, dict[int, Any]]:
    """Every dimension of every input marked ``Dim.AUTO``: dynamic where the model lets it be
    (batch, sequence), static where it fixes it (channels, image size, mel bins, frames)."""
    return {name: dict.fromkeys(range(tensor.dim()), Dim.AUTO) for name, tensor in inputs.items()}


def export_pt2(wrapper: OutputOnly, inputs: Mapping[str, torch.Tensor], path: Path) -> torch.Tensor:
    """``torch.export`` the wrapper (non-strict: transformers' Python is traced, not rewritten),
    save the ExportedProgram to ``path`` and run the program read back from it."""
    with warnings.catch_warnings(), capture_errors("pt2", wrapper):
        # Tracing reads every attribute, deprecated transformers properties included.
        warnings.simplefilter("ignore", FutureWarning)
        program = torch.export.export(
            wrapper,
            (),
            kwargs=dict(inputs),
            dynamic_shapes=dynamic_shapes(inputs),
            strict=False,
        )
    # In memory first, as for TorchScript: a failed final write raises here instead of in a
    # destructor.
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    with open(path, "wb") as handle:
        handle.write(buffer.getbuffer())
    del buffer
    reloaded = torch.export.load(str(path)).module()
    with torch.no_grad():
        return reloaded(**inputs).cpu()


def export_torchscript(
    wrapper: OutputOnly, inputs: Mapping[str, torch.Tensor], path: Path
) -> torch.Tensor:
    """Trace the wrapper with keyword inputs, save it to ``path`` and run the file read back.

    Deprecated by PyTorch (see the module docstring); only called when asked for.
    """
    with warnings.catch_warnings():
        # Tracing warns about every Python-level shape check in modeling code; the trace is
        # validated below against the FP32 reference instead.
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        # ...and tracing reads every attribute, deprecated transformers properties included.
        warnings.simplefilter("ignore", FutureWarning)
        with (
            capture_errors("torchscript", wrapper),
            dropping_messages(_TRANSFORMERS_MODELING_LOGGER, _DEFAULT_LOSS),
        ):
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


def export_onnx(
    wrapper: OutputOnly, inputs: Mapping[str, torch.Tensor], path: Path
) -> torch.Tensor:
    import onnxruntime

    with (
        warnings.catch_warnings(),
        capture_errors("onnx", wrapper),
        dropping_messages(_ONNX_REGISTRY_LOGGER, _NO_TORCHVISION),
    ):
        warnings.simplefilter("ignore")
        torch.onnx.export(
            wrapper,
            (),
            str(path),
            kwargs=dict(inputs),
            dynamo=True,
            dynamic_shapes=dynamic_shapes(inputs),
            output_names=[wrapper.output_name],
            external_data=False,
            verbose=False,
        )
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {i.name: inputs[i.name].cpu().numpy() for i in session.get_inputs()}
    (result,) = session.run([wrapper.output_name], feeds)
    return torch.from_numpy(result)


def check_export_extra(formats: Iterable[str]) -> None:
    if "onnx" in formats:
        missing = [
            m for m in ("onnx", "onnxruntime", "onnxscript") if not importlib.util.find_spec(m)
        ]
        if missing:
            raise ImportError(
                f"ONNX export needs {', '.join(missing)}: pip install 'amp-trainer[export]'"
            )
