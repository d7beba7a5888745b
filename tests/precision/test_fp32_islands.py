"""keep_in_fp32: FP32 islands compute in FP32 whatever autocast or .half() say (one mechanism)."""

from __future__ import annotations

import copy
import io
import re

import pytest
import torch
from torch import nn

from amp_trainer import keep_in_fp32
from amp_trainer.islands import (
    apply_fp32_policy,
    declared_fp32_modules,
    is_fp32_island,
    keep_norms_in_fp32,
)
from tests.helpers.tiny_models import make_tiny_gpt2, tiny_t5


class Recorder(nn.Module):
    """A Linear that records the dtype it computes on and whether autocast was on."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.seen: list[tuple[torch.dtype, torch.dtype, bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((x.dtype, self.linear.weight.dtype, torch.is_autocast_enabled("cpu")))
        return self.linear(x)


def model_with_recorder() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), Recorder(), nn.Linear(8, 2))


def test_an_island_computes_in_fp32_under_autocast_and_hands_fp32_on():
    model = model_with_recorder()
    assert keep_in_fp32(model, ["1"]) == ["1"]
    with torch.autocast("cpu", dtype=torch.float16):
        hidden = model[0](torch.randn(3, 8))
        out = model[1](hidden)
        assert torch.is_autocast_enabled("cpu")  # restored after the island
    assert hidden.dtype == torch.float16
    assert model[1].seen == [(torch.float32, torch.float32, False)]
    assert out.dtype == torch.float32  # a value that overflowed FP16 must not be cast back


def test_an_island_output_above_65504_stays_finite_under_autocast_where_plain_fp16_is_inf():
    plain = nn.Linear(4, 4)
    with torch.no_grad():
        plain.weight.fill_(3e4)
    island = copy.deepcopy(plain)
    keep_in_fp32(island, re.compile(""))
    x = torch.ones(2, 4)
    expected = plain(x)  # FP32, no autocast
    with torch.autocast("cpu", dtype=torch.float16):
        assert torch.isinf(plain(x)).all()
        assert torch.equal(island(x), expected)


def test_an_island_in_a_halved_model_has_fp32_weights_and_hands_back_fp16():
    model = model_with_recorder()
    keep_in_fp32(model, "1")
    model.half()
    out = model(torch.randn(3, 8).half())
    assert model[1].seen == [(torch.float32, torch.float32, False)]
    assert model[1].linear.weight.dtype == torch.float32
    assert model[0].weight.dtype == torch.float16
    assert out.dtype == torch.float16  # the FP16 layer after it got FP16


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("wte", ["transformer.wte"]),
        ("transformer.h.0.mlp.c_proj", ["transformer.h.0.mlp.c_proj"]),
        ("mlp.c_proj", ["transformer.h.0.mlp.c_proj", "transformer.h.1.mlp.c_proj"]),
        ("transformer.h.*.attn", ["transformer.h.0.attn", "transformer.h.1.attn"]),
        (re.compile(r"transformer\.h\.1\.mlp\.c_fc"), ["transformer.h.1.mlp.c_fc"]),
    ],
)
def test_names_suffixes_globs_and_regexes_select_modules(spec, expected):
    model = make_tiny_gpt2()
    names = keep_in_fp32(model, [spec])
    assert [n for n in names if n != "lm_head"] == expected
    assert all(is_fp32_island(model.get_submodule(n)) for n in names)


def test_a_name_that_matches_nothing_is_an_error_naming_it_and_showing_real_names():
    with pytest.raises(ValueError, match=r"matches 'no_such'.*'transformer'"):
        keep_in_fp32(make_tiny_gpt2(), ["wte", "no_such"])


def test_a_module_sharing_a_parameter_with_an_island_joins_it():
    model = make_tiny_gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight
    names = keep_in_fp32(model, "wte")
    assert names == ["transformer.wte", "lm_head"]
    model.half()
    ids = torch.randint(0, 128, (2, 8))
    logits = model(input_ids=ids).logits  # no FP16-input x FP32-weight matmul
    assert model.transformer.wte.weight.dtype == torch.float32
    assert logits.dtype == torch.float16 and torch.isfinite(logits).all()


def test_keep_in_fp32_is_idempotent_and_state_dict_keys_are_unchanged():
    model = make_tiny_gpt2()
    keys = list(model.state_dict())
    first = keep_in_fp32(model, "mlp")
    island = model.transformer.h[0].mlp.forward
    assert keep_in_fp32(model, "mlp") == first
    assert model.transformer.h[0].mlp.forward is island
    assert list(model.state_dict()) == keys


def test_state_dict_after_half_holds_fp32_island_weights():
    model = make_tiny_gpt2()
    keep_in_fp32(model, "transformer.h.0.mlp")
    model.half()
    state = model.state_dict()
    assert state["transformer.h.0.mlp.c_fc.weight"].dtype == torch.float32
    assert state["transformer.h.1.mlp.c_fc.weight"].dtype == torch.float16


def test_islands_survive_pickle_and_deepcopy_and_are_recognised():
    model = make_tiny_gpt2()
    names = keep_in_fp32(model, "mlp")
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for clone in (torch.load(buffer, weights_only=False), copy.deepcopy(model)):
        assert all(is_fp32_island(clone.get_submodule(n)) for n in names)
        assert keep_in_fp32(clone, "mlp") == names
        clone.half()
        with torch.no_grad():
            clone(input_ids=torch.randint(0, 128, (2, 8)))
        assert clone.transformer.h[1].mlp.c_proj.weight.dtype == torch.float32


def test_a_compiled_model_runs_its_island_in_fp32_and_matches_eager():
    model = model_with_recorder()
    keep_in_fp32(model, "1")
    x = torch.randn(3, 8)
    with torch.autocast("cpu", dtype=torch.float16):
        expected = model(x)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with torch.autocast("cpu", dtype=torch.float16):
        out = compiled(x)
    assert model[1].seen == [(torch.float32, torch.float32, False)] * 2
    assert torch.equal(out, expected)


def test_gradients_flow_through_an_island_in_fp32():
    model = model_with_recorder()
    keep_in_fp32(model, "1")
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(3, 8)).float().sum()
    loss.backward()
    grad = model[1].linear.weight.grad
    assert grad is not None and grad.dtype == torch.float32 and torch.isfinite(grad).all()


def test_a_norm_made_an_island_for_an_overflow_hands_back_fp32_under_autocast():
    model = nn.Sequential(nn.LayerNorm(8))
    keep_norms_in_fp32(model)
    x = torch.randn(2, 8).half()
    with torch.autocast("cpu", dtype=torch.float16):
        assert model(x).dtype == torch.float16  # the norm policy: the input's dtype
        keep_in_fp32(model, "0")
        assert model(x).dtype == torch.float32  # an overflow fix outranks it


def test_transformers_declared_fp32_modules_follow_from_pretrained_rules():
    model = tiny_t5()
    assert declared_fp32_modules(model, "fp16") == ["wo"]
    assert declared_fp32_modules(model, "bf16") == []  # not strict: fp16 only
    names = apply_fp32_policy(model, "fp16")
    assert names == [n for n, _ in model.named_modules() if n.endswith(".wo")]
    assert apply_fp32_policy(model, "fp32") == []


def test_a_tied_module_fed_only_ids_hands_back_the_dtype_of_the_halved_model():
    """Tied modules share one parameter, cast to FP32 once: the module cast second must still
    learn that the model around it is FP16 (GPT-2's wte made an island through lm_head, T5's
    decoder embedding through a guarded encoder), or it hands FP32 to the FP16 layers after it."""
    model = make_tiny_gpt2().half()
    keep_in_fp32(model, "lm_head")  # wte shares lm_head's weight: an island too
    wte = model.transformer.wte
    assert is_fp32_island(wte) and wte.weight.dtype == torch.float32
    with torch.no_grad():
        assert wte(torch.tensor([[1, 2, 3]])).dtype == torch.float16
        assert model(input_ids=torch.tensor([[1, 2, 3]])).logits.dtype == torch.float16
