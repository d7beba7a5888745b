"""The extra formats: TorchScript and ONNX writers, each read back for its own parity row.

Part of :mod:`amp_trainer.export`, which re-exports :data:`FORMATS`.
"""

from __future__ import annotations

import importlib.util
import io
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from amp_trainer.export.parity import OutputOnly

#: Formats :func:`~amp_trainer.export.export_fp16` can write. safetensors is always written (it is
#: what ``from_pretrained`` reloads); the others are extras.
FORMATS = ("safetensors", "torchscript", "onnx")


def export_torchscript(
    wrapper: OutputOnly, inputs: Mapping[str, torch.Tensor], path: Path
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


def export_onnx(
    wrapper: OutputOnly, inputs: Mapping[str, torch.Tensor], path: Path
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


def check_export_extra(formats: Iterable[str]) -> None:
    if "onnx" in formats:
        missing = [
            m for m in ("onnx", "onnxruntime", "onnxscript") if not importlib.util.find_spec(m)
        ]
        if missing:
            raise ImportError(
                f"ONNX export needs {', '.join(missing)}: pip install 'amp-trainer[export]'"
            )
