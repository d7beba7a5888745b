"""The sample batch the overflow guard and the parity check run on, and the forward's keywords.

The batch is built from what the model declares, not assumed to be token ids:

- ``model.main_input_name`` says what the model eats: ``input_ids`` (text: the tokenizer on the
  sample texts, else random ids below ``vocab_size``), ``pixel_values`` (images: the saved image
  processor on random images, else ``[batch, num_channels, image_size, image_size]`` from the
  config), ``input_features`` (speech features: the saved feature extractor on random audio,
  else Whisper's ``[batch, num_mel_bins, frames]``, the frame count its encoder checks) or
  ``input_values`` (raw audio: the feature extractor, else enough samples for the convolutional
  front end);
- an encoder-decoder also gets ``decoder_input_ids``: the config's ``decoder_start_token_id``
  followed by the input ids shifted right (text) or random ids (speech, images), the teacher-forced
  batch its logits are computed from.

A model none of that can feed is refused before anything runs or is written, with one line that
names what to pass instead: ``sample_inputs=`` (the keyword arguments of one forward call).

Part of :mod:`amp_trainer.export`, which re-exports the names users need.
"""

from __future__ import annotations

import inspect
import keyword
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

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
#: The main inputs a sample batch can be made for (``model.main_input_name``).
MAIN_INPUTS = ("input_ids", "pixel_values", "input_features", "input_values")
_RANDOM_BATCH, _RANDOM_LENGTH = 8, 16
_AUDIO_FRAMES = 16  # feature frames a raw-audio sample is long enough for
#: How the refusals end: what to pass instead. A front end with its own way to give inputs (the
#: CLI's ``--sample-inputs FILE``) replaces this suffix with its own.
PASS_SAMPLE_INPUTS = (
    "pass sample_inputs={name: tensor, ...}, the keyword arguments of one forward call"
)


class SampleInputsError(ValueError):
    """The export cannot make (or use) sample inputs for this model: one line naming what to
    pass. A ``ValueError``, raised before anything is written."""


def cannot_feed(model: nn.Module, why: str) -> SampleInputsError:
    """The one-line refusal for ``model``: why, and what to pass instead."""
    return SampleInputsError(
        f"cannot make sample inputs for {type(model).__name__}: {why}; {PASS_SAMPLE_INPUTS}"
    )


def main_input_name(model: nn.Module) -> str:
    """What the model's forward takes first (transformers' ``main_input_name``)."""
    return str(getattr(model, "main_input_name", None) or "input_ids")


def _config_value(config: Any, *names: str) -> Any:
    """The first of ``names`` set on ``config`` or on its text/decoder sub-config."""
    for holder in (config, getattr(config, "text_config", None), getattr(config, "decoder", None)):
        if holder is None:
            continue
        for name in names:
            value = getattr(holder, name, None)
            if value is not None:
                return value
    return None


def _forward_parameters(model: nn.Module) -> tuple[set[str], bool]:
    """The forward's named parameters, and whether it takes ``**kwargs`` too."""
    params = inspect.signature(model.forward).parameters
    named = {n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    return named, any(p.kind == p.VAR_KEYWORD for p in params.values())


def make_sample_batch(
    model: nn.Module,
    tokenizer: Any | None = None,
    texts: Sequence[str] | None = None,
    seed: int = 0,
    processor: Any | None = None,
) -> dict[str, torch.Tensor]:
    """One batch of the inputs ``model`` declares (see the module docstring), FP32 / int64.

    Text: padding is done here, not by the tokenizer, so a tokenizer without a pad token (GPT-2)
    works; padded positions get id 0 and mask 0 and are excluded from parity.

    Raises:
        SampleInputsError: the model takes an input this cannot make, or its config lacks what
            the shape needs (one line, naming ``sample_inputs=``).
    """
    main = main_input_name(model)
    if texts and main != "input_ids":
        raise SampleInputsError(
            f"sample texts were given, but {type(model).__name__} takes {main}, not text; "
            f"{PASS_SAMPLE_INPUTS}"
        )
    generator = torch.Generator().manual_seed(seed)
    if main == "input_ids":
        batch = _text_batch(model, tokenizer, texts, generator)
    elif main == "pixel_values":
        batch = _image_batch(model, processor, generator)
    elif main == "input_features":
        batch = _speech_features_batch(model, processor, generator)
    elif main == "input_values":
        batch = _raw_audio_batch(model, processor, generator)
    else:
        raise cannot_feed(model, f"its main input {main!r} is none of {list(MAIN_INPUTS)}")
    named, _ = _forward_parameters(model)
    if getattr(model.config, "is_encoder_decoder", False) and "decoder_input_ids" in named:
        batch["decoder_input_ids"] = _decoder_ids(model, batch, generator)
    return batch


def _text_batch(
    model: nn.Module,
    tokenizer: Any | None,
    texts: Sequence[str] | None,
    generator: torch.Generator,
) -> dict[str, torch.Tensor]:
    config = model.config
    max_len = min(128, _config_value(config, "max_position_embeddings", "n_positions") or 128)
    if tokenizer is None:
        if texts:
            raise SampleInputsError(
                "sample texts were given but there is no tokenizer to encode them; pass "
                "tokenizer= as well, or sample_inputs= instead"
            )
        vocab = _config_value(config, "vocab_size")
        if not vocab:
            raise cannot_feed(model, "it takes input_ids, but its config has no vocab_size")
        length = min(_RANDOM_LENGTH, max_len)
        ids = torch.randint(0, int(vocab), (_RANDOM_BATCH, length), generator=generator)
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


def _part(processor: Any, attribute: str) -> Any:
    """The image processor / feature extractor inside a multi-part ``ProcessorMixin``, or the
    processor itself (their ``__call__`` signatures differ; the parts' are the stable ones)."""
    return getattr(processor, attribute, None) or processor


def _pair(value: Any) -> tuple[int, int] | None:
    if isinstance(value, int):
        return value, value
    if isinstance(value, Sequence) and len(value) == 2 and all(isinstance(v, int) for v in value):
        return int(value[0]), int(value[1])
    return None


def _image_batch(
    model: nn.Module, processor: Any | None, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    config = model.config
    size = _pair(_config_value(config, "image_size"))
    channels = _config_value(config, "num_channels") or 3
    if processor is not None:
        import numpy as np

        height, width = size or (64, 64)
        pixels = torch.randint(0, 256, (_RANDOM_BATCH, height, width, 3), generator=generator)
        images = [np.asarray(image, dtype=np.uint8) for image in pixels]
        out = _part(processor, "image_processor")(images, return_tensors="pt")
        return {"pixel_values": out["pixel_values"].float()}
    if size is None:
        raise cannot_feed(
            model,
            "it takes pixel_values, but its config has no image_size and no image "
            "processor was saved with it (processor=)",
        )
    shape = (_RANDOM_BATCH, int(channels), *size)
    return {"pixel_values": torch.randn(shape, generator=generator)}


def _sampling_rate(extractor: Any) -> int:
    return int(getattr(extractor, "sampling_rate", None) or 16000)


def _speech_features_batch(
    model: nn.Module, processor: Any | None, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    if processor is not None:
        extractor = _part(processor, "feature_extractor")
        rate = _sampling_rate(extractor)
        samples = int(getattr(extractor, "n_samples", None) or rate)
        audio = torch.randn((_RANDOM_BATCH, samples), generator=generator) * 0.1
        out = extractor(list(audio.numpy()), sampling_rate=rate, return_tensors="pt")
        return {"input_features": out["input_features"].float()}
    config = model.config
    mels = _config_value(config, "num_mel_bins")
    positions = _config_value(config, "max_source_positions")
    if not mels or not positions:
        raise cannot_feed(
            model,
            "it takes input_features, but its config has no num_mel_bins and "
            "max_source_positions and no feature extractor was saved with it (processor=)",
        )
    # Whisper's encoder refuses any other length: max_source_positions times its two
    # convolutions' strides.
    encoder = model.get_encoder() if hasattr(model, "get_encoder") else model
    strides = [
        int(conv.stride[0])
        for conv in (getattr(encoder, "conv1", None), getattr(encoder, "conv2", None))
        if isinstance(conv, nn.Conv1d)
    ]
    frames = int(positions) * math.prod(strides or [1])
    # Log-mel features as Whisper's extractor makes them: roughly within [-1, 1.5].
    features = torch.randn((_RANDOM_BATCH, int(mels), frames), generator=generator) * 0.5
    return {"input_features": features}


def _raw_audio_batch(
    model: nn.Module, processor: Any | None, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    config = model.config
    kernels = _config_value(config, "conv_kernel")
    strides = _config_value(config, "conv_stride")
    if kernels and strides and len(kernels) == len(strides):
        # The receptive field of the convolutional front end, plus _AUDIO_FRAMES - 1 hops.
        field = 1
        for kernel, stride in zip(reversed(kernels), reversed(strides), strict=True):
            field = (field - 1) * int(stride) + int(kernel)
        hop = math.prod(int(s) for s in strides)
        samples = field + hop * (_AUDIO_FRAMES - 1)
    elif processor is not None:
        samples = _sampling_rate(_part(processor, "feature_extractor"))
    else:
        raise cannot_feed(
            model,
            "it takes input_values, but its config has no conv_kernel/conv_stride and "
            "no feature extractor was saved with it (processor=)",
        )
    audio = torch.randn((_RANDOM_BATCH, samples), generator=generator) * 0.1
    if processor is not None:
        extractor = _part(processor, "feature_extractor")
        out = extractor(
            list(audio.numpy()), sampling_rate=_sampling_rate(extractor), return_tensors="pt"
        )
        return {"input_values": out["input_values"].float()}
    return {"input_values": audio}


def _decoder_ids(
    model: nn.Module, batch: Mapping[str, torch.Tensor], generator: torch.Generator
) -> torch.Tensor:
    """Teacher-forced decoder inputs: the start token, then the input ids shifted right (text)
    or random ids below the vocabulary size (speech, images)."""
    config = model.config
    start = _config_value(config, "decoder_start_token_id")
    if start is None:
        start = getattr(getattr(model, "generation_config", None), "decoder_start_token_id", None)
    if not isinstance(start, int):
        raise cannot_feed(
            model,
            "it is an encoder-decoder, and neither its config nor its generation config "
            "sets decoder_start_token_id (the first decoder_input_ids token)",
        )
    if "input_ids" in batch:
        ids = batch["input_ids"]
    else:
        vocab = _config_value(config, "vocab_size")
        if not vocab:
            raise cannot_feed(model, "its decoder's config has no vocab_size")
        limit = _config_value(config, "max_target_positions") or _RANDOM_LENGTH
        length = min(_RANDOM_LENGTH, int(limit))
        rows = len(next(iter(batch.values())))
        ids = torch.randint(0, int(vocab), (rows, length), generator=generator)
    decoder = torch.full_like(ids, start)
    decoder[:, 1:] = ids[:, :-1]
    return decoder


def describe_sample(
    model: nn.Module,
    tokenizer: Any | None,
    texts: Sequence[str] | None,
    sample_inputs: Mapping[str, torch.Tensor] | None,
    processor: Any | None,
) -> tuple[str, bool]:
    """What the sample batch :func:`make_sample_batch` (or the caller) made is, in words, and
    whether it is the user's own data (their texts or tensors) rather than a stand-in for it."""
    if sample_inputs is not None:
        return "your sample_inputs", True
    main = main_input_name(model)
    if main == "input_ids":
        if tokenizer is None:
            return "random token ids (no tokenizer)", False
        if texts:
            return "your sample texts", True
        return "built-in English sentences", False
    if main == "pixel_values":
        through = " through the saved image processor" if processor is not None else ""
        return f"random images{through}", False
    return "random audio", False


def check_sample_inputs(model: nn.Module, sample_inputs: Any) -> dict[str, torch.Tensor]:
    """The user's ``sample_inputs=``, checked: a mapping of the forward's keyword names to
    tensors (the exported formats take them under these names, in this order)."""
    if not isinstance(sample_inputs, Mapping) or not sample_inputs:
        raise SampleInputsError(
            "sample_inputs must be a non-empty dict of forward keyword names to tensors, got "
            f"{type(sample_inputs).__name__}"
        )
    named, var_keyword = _forward_parameters(model)
    for name, value in sample_inputs.items():
        if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
            raise SampleInputsError(f"sample_inputs key {name!r} is not a Python identifier")
        if not isinstance(value, torch.Tensor):
            raise SampleInputsError(
                f"sample_inputs[{name!r}] must be a torch.Tensor, got {type(value).__name__}"
            )
        if name not in named and not var_keyword:
            raise SampleInputsError(
                f"sample_inputs key {name!r} is not an argument of "
                f"{type(model).__name__}.forward; valid: {sorted(named)}"
            )
    return dict(sample_inputs)


def output_mask(inputs: Mapping[str, torch.Tensor], reference: torch.Tensor) -> torch.Tensor:
    """Which output positions parity counts: for ``[batch, sequence, ...]`` outputs the mask of
    the same shape (the decoder's, else the encoder's), else every position; ``[batch]`` rows
    for the rest (all of them)."""
    if reference.dim() < 3:
        return torch.ones(reference.shape[:1], dtype=torch.long)
    for key in ("decoder_attention_mask", "attention_mask"):
        mask = inputs.get(key)
        if isinstance(mask, torch.Tensor) and tuple(mask.shape) == tuple(reference.shape[:2]):
            return mask.cpu()
    return torch.ones(reference.shape[:2], dtype=torch.long)


def as_model_dtype(
    inputs: Mapping[str, torch.Tensor], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """``inputs`` with floating tensors (pixels, speech features) in ``dtype``: an FP16 model
    and its exported formats take FP16 features; ids and masks stay integers."""
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}


def forward_kwargs(model: nn.Module) -> dict[str, Any]:
    """The keywords every forward of the export adds: a ModelOutput, no KV cache."""
    params = inspect.signature(model.forward).parameters
    extra: dict[str, Any] = {"return_dict": True}
    if "use_cache" in params or "kwargs" in params:
        extra["use_cache"] = False
    return extra
