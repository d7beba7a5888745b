"""FP32 islands never re-cast parameters a sharding engine swapped into the module.

FSDP2 with ``MixedPrecisionPolicy(param_dtype=float16)`` registers FP16 unsharded copies of the
parameters on each module for the forward (``module._parameters[name] = ...``) and reduces their
gradients afterwards; an island that re-cast those to FP32 in place broke the reduction
(``FSDP reduce-scatter expects uniform gradient dtype``). Here the swap is done by
hand, as the engine does it, so the mechanism is tested in one process; the two-rank FSDP2 test
is tests/distributed/test_fsdp2_scaleout.py.
"""

from __future__ import annotations

import torch
from torch import nn

from amp_trainer import keep_norms_in_fp32


def _swap_in_fp16_copies(module: nn.Module) -> dict[str, nn.Parameter]:
    """What FSDP2's unshard does: new FP16 parameter objects written into ``_parameters``."""
    copies = {}
    for name, param in list(module._parameters.items()):
        copy = nn.Parameter(param.detach().half(), requires_grad=param.requires_grad)
        module._parameters[name] = copy
        copies[name] = copy
    return copies


def test_engine_owned_fp16_params_compute_in_fp32_and_keep_their_dtype():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    keep_norms_in_fp32(model)
    norm = model[1]
    copies = _swap_in_fp16_copies(norm)
    seen = []
    original = torch.nn.functional.layer_norm

    def recording(input, shape, weight=None, bias=None, eps=1e-5):
        seen.append((input.dtype, weight.dtype, bias.dtype))
        return original(input, shape, weight, bias, eps)

    x = torch.randn(4, 8, dtype=torch.float16)
    torch.nn.functional.layer_norm = recording
    try:
        out = norm(x)
    finally:
        torch.nn.functional.layer_norm = original
    out.float().pow(2).sum().backward()

    assert seen == [(torch.float32, torch.float32, torch.float32)]  # the arithmetic is FP32
    assert out.dtype == torch.float16  # handed back in the input's dtype
    for name, copy in copies.items():
        assert norm._parameters[name] is copy  # the engine's objects are back in place ...
        assert copy.dtype == torch.float16  # ... with their storage dtype untouched
        assert copy.grad is not None and copy.grad.dtype == torch.float16  # uniform grad dtype


def test_fp32_result_matches_an_fp32_norm_on_the_same_values():
    torch.manual_seed(0)
    norm = nn.LayerNorm(8)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.5, 0.5)
    reference = nn.LayerNorm(8)
    reference.load_state_dict(norm.state_dict())
    keep_norms_in_fp32(norm)
    copies = _swap_in_fp16_copies(norm)
    with torch.no_grad():
        reference.weight.copy_(copies["weight"].float())
        reference.bias.copy_(copies["bias"].float())
    x = torch.randn(4, 8, dtype=torch.float16)

    out = norm(x)

    assert torch.equal(out, reference(x.float()).half())


def test_own_params_halved_by_half_are_still_recast_in_place():
    # .half() changes param.data, not the parameter objects: those are the island's own and go
    # back to FP32 storage (FP32 master weights), as before.
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    keep_norms_in_fp32(model)
    weight = model[1].weight
    model.half()
    model(torch.randn(2, 8, dtype=torch.float16))
    assert model[1].weight is weight and weight.dtype == torch.float32
    assert model[0].weight.dtype == torch.float16
