"""Precision policy: resolving a precision, autocast, norms kept in FP32, FP32 master weights."""

from __future__ import annotations

import copy
import io
import sys
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from amp_trainer import precision
from amp_trainer.islands import is_norm_module, keep_norms_in_fp32
from amp_trainer.precision import (
    CpuFp16Warning,
    autocast_for,
    cast_trainable_params_to_fp32,
    check_trainable_params_fp32,
    resolve_precision,
)
from tests.helpers.tiny_models import make_tiny_gpt2


# --------------------------------------------------------------------------------------------
# resolve_precision
# --------------------------------------------------------------------------------------------
def test_unknown_precision_is_an_error_listing_the_valid_values():
    with pytest.raises(ValueError, match=r"'fp8'.*'auto', 'fp16', 'bf16', 'fp32'"):
        resolve_precision("fp8", "cpu")


@pytest.mark.parametrize("spelling", ["fp32", "float32", "no", "FP32"])
def test_fp32_and_its_aliases_resolve_to_fp32(spelling):
    assert resolve_precision(spelling, "cpu") == "fp32"


def test_fp16_on_cpu_is_honoured_with_exactly_one_warning_per_process(monkeypatch):
    monkeypatch.setattr(precision, "_warned_cpu_fp16", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert resolve_precision("fp16", "cpu") == "fp16"
        assert resolve_precision("half", torch.device("cpu")) == "fp16"
    cpu_warnings = [w for w in caught if issubclass(w.category, CpuFp16Warning)]
    assert len(cpu_warnings) == 1
    assert "slow" in str(cpu_warnings[0].message)


def test_cpu_fp16_warning_points_at_the_caller_not_at_amp_trainer(monkeypatch):
    monkeypatch.setattr(precision, "_warned_cpu_fp16", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resolve_precision("fp16", "cpu")
    assert [w.filename for w in caught if issubclass(w.category, CpuFp16Warning)] == [__file__]


def test_cpu_fp16_warning_from_training_arguments_points_at_the_callers_line(monkeypatch, tmp_path):
    # AmpTrainingArguments resolves its precision in __post_init__, called from the __init__
    # that @dataclass generates (a "<string>" frame): the warning named "<string>:131" before.
    from amp_trainer import AmpTrainingArguments

    monkeypatch.setattr(precision, "_warned_cpu_fp16", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = sys._getframe().f_lineno + 1
        AmpTrainingArguments(output_dir=str(tmp_path), precision="fp16", use_cpu=True)
    located = [(w.filename, w.lineno) for w in caught if issubclass(w.category, CpuFp16Warning)]
    assert located == [(__file__, line)]


def test_auto_on_cpu_is_bf16_exactly_when_the_cpu_has_native_bf16():
    expected = "bf16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "fp32"
    assert resolve_precision("auto", "cpu") == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_requesting_cuda_without_a_gpu_names_device_and_request():
    with pytest.raises(ValueError, match=r"'fp16'.*'cuda'"):
        resolve_precision("fp16", "cuda")


def test_half_precision_on_a_device_without_autocast_is_an_error():
    with pytest.raises(ValueError, match=r"'bf16'.*'meta'.*no autocast"):
        resolve_precision("bf16", "meta")


# --------------------------------------------------------------------------------------------
# autocast_for
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "dtype"), [("fp16", torch.float16), ("bf16", torch.bfloat16), ("fp32", torch.float32)]
)
def test_autocast_for_runs_matmuls_in_the_requested_dtype(name, dtype):
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with autocast_for(name, "cpu"):
        assert (a @ b).dtype == dtype


def test_autocast_for_refuses_an_unresolved_precision():
    with pytest.raises(ValueError, match="resolve_precision"):
        autocast_for("auto", "cpu")


# --------------------------------------------------------------------------------------------
# is_norm_module
# --------------------------------------------------------------------------------------------
class T5StyleLayerNorm(nn.Module):
    """A library-defined norm that does not subclass torch's (recognised by name)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.seen: list[tuple[torch.dtype, bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((x.dtype, torch.is_autocast_enabled("cpu")))
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * x * torch.rsqrt(variance + 1e-6)


class AdaptiveLayerNorm(nn.Module):
    """Named like a norm but holds a Linear: not a norm itself."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x) * self.proj(x)


class ExplodingRMSNorm(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")


@pytest.mark.parametrize(
    "module",
    [
        nn.LayerNorm(4),
        nn.RMSNorm(4),
        nn.GroupNorm(2, 4),
        nn.BatchNorm1d(4),
        nn.BatchNorm2d(4),
        nn.InstanceNorm1d(4),
        T5StyleLayerNorm(4),
    ],
    ids=lambda m: type(m).__name__,
)
def test_normalisation_layers_are_recognised(module):
    assert is_norm_module(module)


def test_transformers_own_norm_classes_are_recognised():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    assert is_norm_module(LlamaRMSNorm(8))
    assert is_norm_module(T5LayerNorm(8))


@pytest.mark.parametrize(
    "module", [nn.Linear(4, 4), AdaptiveLayerNorm(4), nn.Dropout()], ids=lambda m: type(m).__name__
)
def test_layers_that_merely_contain_or_resemble_a_norm_are_not_norms(module):
    assert not is_norm_module(module)


# --------------------------------------------------------------------------------------------
# keep_norms_in_fp32
# --------------------------------------------------------------------------------------------
def _norm_param_dtypes(model: nn.Module) -> set[torch.dtype]:
    return {
        p.dtype for m in model.modules() if is_norm_module(m) for p in m.parameters(recurse=False)
    }


def test_keep_norms_returns_the_names_of_every_norm_layer_of_tiny_bert(tiny_bert):
    touched = keep_norms_in_fp32(tiny_bert)
    expected = [n for n, m in tiny_bert.named_modules() if isinstance(m, nn.LayerNorm)]
    assert touched == expected
    assert len(touched) == 5  # embeddings + 2 per layer


def hook_counts(model: nn.Module) -> list[int]:
    return [len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()]


def test_keep_norms_is_idempotent_and_stacks_no_hooks(tiny_gpt2):
    first = keep_norms_in_fp32(tiny_gpt2)
    counts = hook_counts(tiny_gpt2)
    assert first
    assert keep_norms_in_fp32(tiny_gpt2) == first
    assert hook_counts(tiny_gpt2) == counts


def test_norm_inside_a_norm_named_wrapper_is_handled_once():
    class WrappedLayerNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.LayerNorm(4)

        def forward(self, x):
            return self.inner(x)

    model = nn.Sequential(WrappedLayerNorm())
    assert keep_norms_in_fp32(model) == ["0"]
    assert len(model[0].inner._forward_pre_hooks) == 0


def test_norm_params_are_fp32_when_half_was_called_before():
    model = make_tiny_gpt2().half()
    keep_norms_in_fp32(model)
    assert _norm_param_dtypes(model) == {torch.float32}
    assert model.transformer.wte.weight.dtype == torch.float16


def test_keep_norms_on_a_halved_copy_of_a_handled_model_restores_fp32_at_once(tiny_bert):
    names = keep_norms_in_fp32(tiny_bert)
    fp16 = copy.deepcopy(tiny_bert).half()
    assert keep_norms_in_fp32(fp16) == names
    assert _norm_param_dtypes(fp16) == {torch.float32}


def test_norm_params_return_to_fp32_when_half_is_called_after():
    model = make_tiny_gpt2()
    keep_norms_in_fp32(model)
    model.half()
    ids = torch.randint(0, 128, (2, 8))
    logits = model(input_ids=ids).logits
    assert _norm_param_dtypes(model) == {torch.float32}
    assert logits.dtype == torch.float16
    assert torch.isfinite(logits).all()


def test_state_dict_after_half_holds_fp32_norms_and_unchanged_keys(tiny_bert):
    keys_before = list(tiny_bert.state_dict())
    keep_norms_in_fp32(tiny_bert)
    tiny_bert.half()
    state = tiny_bert.state_dict()
    assert list(state) == keys_before
    assert state["bert.embeddings.LayerNorm.weight"].dtype == torch.float32
    assert state["bert.embeddings.word_embeddings.weight"].dtype == torch.float16


def test_norm_computes_in_fp32_with_autocast_disabled_and_returns_the_input_dtype():
    norm = T5StyleLayerNorm(8)
    keep_norms_in_fp32(norm)
    x = torch.randn(3, 8).half()
    with torch.autocast("cpu", dtype=torch.float16):
        out = norm(x)
        assert torch.is_autocast_enabled("cpu")  # restored after the norm
    assert norm.seen == [(torch.float32, False)]
    assert out.dtype == torch.float16


@settings(max_examples=30, deadline=None)
@given(
    width=st.integers(min_value=2, max_value=64),
    magnitude=st.floats(min_value=1e-3, max_value=200.0),
    seed=st.integers(min_value=0, max_value=2**16),
)
def test_fp16_layernorm_output_equals_the_fp32_computation_rounded_once(width, magnitude, seed):
    torch.manual_seed(seed)
    norm = nn.LayerNorm(width)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.5, 0.5)
    keep_norms_in_fp32(norm)
    norm.half()  # rounds the weights to fp16 values: the one precision loss .half() may cause
    reference_norm = copy.deepcopy(norm)
    reference_norm._forward_pre_hooks.clear()
    reference_norm._forward_hooks.clear()
    reference_norm.float()
    x = (torch.randn(4, width) * magnitude).half()
    with torch.autocast("cpu", dtype=torch.float16):
        out = norm(x)
    expected = reference_norm(x.float()).half()
    assert out.dtype == torch.float16
    assert torch.equal(out, expected)


def test_autocast_is_restored_when_a_norm_forward_raises():
    model = nn.Sequential(ExplodingRMSNorm())
    assert keep_norms_in_fp32(model) == ["0"]
    with torch.autocast("cpu", dtype=torch.float16):
        with pytest.raises(RuntimeError, match="boom"):
            model(torch.randn(2, 4))
        assert torch.is_autocast_enabled("cpu")


def test_compiled_model_runs_its_norm_in_fp32_under_fp16_autocast_and_matches_eager():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), T5StyleLayerNorm(8), nn.Linear(8, 2))
    keep_norms_in_fp32(model)
    x = torch.randn(3, 8)
    with torch.autocast("cpu", dtype=torch.float16):
        expected = model(x)
    # aot_eager: dynamo + AOTAutograd without inductor's C++ build; fullgraph: no graph break.
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with torch.autocast("cpu", dtype=torch.float16):
        out = compiled(x)
        assert torch.is_autocast_enabled("cpu")
    assert model[1].seen == [(torch.float32, False)] * 2  # eager call, then the traced one
    assert out.dtype == torch.float16
    assert torch.equal(out, expected)


def test_batchnorm_in_a_half_model_keeps_fp32_running_stats_and_updates_them():
    model = nn.Sequential(nn.Conv1d(3, 4, 1), nn.BatchNorm1d(4))
    keep_norms_in_fp32(model)
    model.half().train()
    x = torch.randn(8, 3, 5).half() + 3.0
    out = model(x)
    bn = model[1]
    assert out.dtype == torch.float16
    assert bn.running_mean.dtype == torch.float32
    assert bn.running_mean.abs().sum() > 0
    assert bn.num_batches_tracked.item() == 1


def test_model_with_fp32_norms_survives_pickle_and_deepcopy(tiny_bert):
    names = keep_norms_in_fp32(tiny_bert)
    counts = hook_counts(tiny_bert)
    tiny_bert.eval()
    buffer = io.BytesIO()
    torch.save(tiny_bert, buffer)
    buffer.seek(0)
    restored = torch.load(buffer, weights_only=False)
    copied = copy.deepcopy(tiny_bert)
    ids = torch.randint(0, 128, (2, 8))
    for clone in (restored, copied):
        assert hook_counts(clone) == counts  # the hooks came along
        assert keep_norms_in_fp32(clone) == names
        assert hook_counts(clone) == counts  # and were recognised as ours
        clone.half()
        with torch.no_grad():
            assert clone(input_ids=ids).logits.dtype == torch.float16
        assert _norm_param_dtypes(clone) == {torch.float32}


def test_save_pretrained_round_trips_a_model_with_fp32_norms(tiny_bert, tmp_path):
    from transformers import BertForSequenceClassification

    keep_norms_in_fp32(tiny_bert)
    tiny_bert.save_pretrained(tmp_path)
    reloaded = BertForSequenceClassification.from_pretrained(tmp_path)
    for (name, a), (_, b) in zip(tiny_bert.state_dict().items(), reloaded.state_dict().items()):
        assert torch.equal(a, b), name


def test_tiny_gpt2_trains_one_fp16_autocast_step_with_fp32_norms(tiny_gpt2):
    keep_norms_in_fp32(tiny_gpt2)
    ids = torch.randint(0, 128, (2, 8))
    with autocast_for("fp16", "cpu"):
        loss = tiny_gpt2(input_ids=ids, labels=ids).loss
    loss.backward()
    ln_grad = tiny_gpt2.transformer.ln_f.weight.grad
    assert ln_grad is not None and ln_grad.dtype == torch.float32
    assert torch.isfinite(ln_grad).all()


# --------------------------------------------------------------------------------------------
# FP32 master weights
# --------------------------------------------------------------------------------------------
def test_fp32_trainable_params_pass_the_check(tiny_bert):
    check_trainable_params_fp32(tiny_bert)


def test_frozen_half_params_pass_the_check(tiny_bert):
    for p in tiny_bert.bert.parameters():
        p.requires_grad_(False)
    tiny_bert.bert.half()
    check_trainable_params_fp32(tiny_bert)


def test_half_trainable_params_fail_the_check_with_names_count_and_fix(tiny_bert):
    tiny_bert.half()
    count = sum(1 for _ in tiny_bert.parameters())
    with pytest.raises(ValueError) as info:
        check_trainable_params_fp32(tiny_bert)
    message = str(info.value)
    assert f"{count} trainable parameter(s)" in message
    assert "bert.embeddings.word_embeddings.weight (float16)" in message
    assert f"and {count - 8} more" in message
    assert "cast_trainable_params_to_fp32" in message


def test_cast_trainable_params_to_fp32_fixes_a_half_adapter_and_keeps_param_identity():
    base = nn.Linear(4, 4).half().requires_grad_(False)
    adapter = nn.Linear(4, 4).half()
    model = nn.ModuleDict({"base": base, "adapter": adapter})
    optimizer = torch.optim.SGD(model.adapter.parameters(), lr=0.1)
    cast = cast_trainable_params_to_fp32(model)
    assert cast == ["adapter.weight", "adapter.bias"]
    assert base.weight.dtype == torch.float16
    assert optimizer.param_groups[0]["params"][0] is adapter.weight
    assert adapter.weight.dtype == torch.float32
    check_trainable_params_fp32(model)


def test_cast_trainable_params_sends_frozen_params_to_frozen_dtype_except_fp32_norms():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    keep_norms_in_fp32(model)
    model[0].requires_grad_(False)
    model[1].requires_grad_(False)
    cast = cast_trainable_params_to_fp32(model, frozen_dtype=torch.float16)
    assert cast == ["0.weight", "0.bias"]
    assert model[0].weight.dtype == torch.float16
    assert model[1].weight.dtype == torch.float32
    assert model[2].weight.dtype == torch.float32


def test_cast_trainable_params_rejects_a_non_floating_frozen_dtype(tiny_bert):
    with pytest.raises(ValueError, match=r"torch\.int8"):
        cast_trainable_params_to_fp32(tiny_bert, frozen_dtype=torch.int8)
