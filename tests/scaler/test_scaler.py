"""DynamicLossScaler: real tensors, real optimizers, real injected inf/NaN (no mocks of torch)."""

from __future__ import annotations

import copy
import io
import logging
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from amp_trainer.scaler import DynamicLossScaler, LossScaleError


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 3))


def _batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)


def _backward(model: nn.Module, scaler, seed: int = 1, poison: float | None = None) -> torch.Tensor:
    x, y = _batch(seed)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    if poison is not None:
        model[0].weight.grad[0, 0] = poison
    return loss


def _record_host_syncs(monkeypatch) -> list[str]:
    """The list each device-to-host read (``item``, ``tolist``, ``bool``, ``float``, ``cpu``) of
    any tensor appends its name to, until ``monkeypatch.undo()``: how many times a step waits for
    the device."""
    syncs: list[str] = []
    for method in ("item", "tolist", "__bool__", "__float__", "cpu"):
        original = getattr(torch.Tensor, method)

        def spy(self, *args, _original=original, _name=method, **kwargs):
            syncs.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, method, spy)
    return syncs


def _optimizer(kind: str, params) -> torch.optim.Optimizer:
    factories = {
        "sgd_momentum": lambda: torch.optim.SGD(params, lr=0.1, momentum=0.9),
        "adamw_forloop": lambda: torch.optim.AdamW(params, lr=1e-2, foreach=False),
        "adamw_foreach": lambda: torch.optim.AdamW(params, lr=1e-2, foreach=True),
        "adamw_fused": lambda: torch.optim.AdamW(params, lr=1e-2, fused=True),
    }
    return factories[kind]()


def _clone_state(optimizer: torch.optim.Optimizer) -> dict:
    return copy.deepcopy(optimizer.state_dict())


def _assert_same_state(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for key in a["state"]:
        for name, value in a["state"][key].items():
            other = b["state"][key][name]
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, other), f"optimizer state {key}.{name} changed"
            else:
                assert value == other


# --------------------------------------------------------------------------------------------
# 1. exact agreement with torch.amp.GradScaler
# --------------------------------------------------------------------------------------------
@settings(max_examples=30, deadline=None)
@given(
    overflows=st.lists(st.booleans(), min_size=1, max_size=40),
    growth_interval=st.integers(1, 4),
    growth_factor=st.sampled_from([2.0, 1.5, 3.0, 1.0001, 4.7]),
    backoff_factor=st.sampled_from([0.5, 0.25, 0.3, 0.9999, 0.71]),
    init_scale=st.sampled_from([2.0**16, 1.0, 3.3, 12345.678, 2.0**32, 1e38]),
    poison=st.sampled_from([math.inf, -math.inf, math.nan]),
)
def test_scale_and_skips_match_torch_grad_scaler(
    overflows, growth_interval, growth_factor, backoff_factor, init_scale, poison
):
    knobs = dict(
        init_scale=init_scale,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
    )
    ours = DynamicLossScaler("cpu", **knobs, min_scale=1e-30)  # no cap (the default), as torch
    theirs = torch.amp.GradScaler("cpu", **knobs)
    # (Before its first use torch reports the unrounded init_scale; from then on, float32.)
    models = [_model(), _model()]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    for step, overflow in enumerate(overflows):
        stepped = []
        for model, opt, scaler in zip(models, opts, (ours, theirs)):
            opt.zero_grad()
            _backward(model, scaler, seed=step, poison=poison if overflow else None)
            before = [p.detach().clone() for p in model.parameters()]
            scaler.step(opt)
            scaler.update()
            stepped.append(any(not torch.equal(b, p) for b, p in zip(before, model.parameters())))
        # (A large scale can also overflow the FP16 backward by itself: then both skip.)
        assert stepped[0] is stepped[1] and not (overflow and stepped[0])
        assert ours.get_scale() == theirs.get_scale(), f"step {step}"
        assert ours.step_was_skipped is not stepped[0]
        for a, b in zip(models[0].parameters(), models[1].parameters()):
            assert torch.equal(a, b)


# --------------------------------------------------------------------------------------------
# 2. one fused pass per (device, dtype) group, one device-to-host sync per step
# --------------------------------------------------------------------------------------------
def test_unscale_runs_one_fused_kernel_per_dtype_group_and_syncs_once(monkeypatch):
    model = _model()
    model[2].to(torch.bfloat16)  # a second dtype group
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler("cpu")
    x, y = _batch()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.cross_entropy(model(x).float(), y)
    scaler.scale(loss).backward()

    kernel = torch._amp_foreach_non_finite_check_and_unscale_
    launches: list[int] = []

    def counting_kernel(grads, found_inf, inv_scale):
        launches.append(len(grads))
        return kernel(grads, found_inf, inv_scale)

    syncs = _record_host_syncs(monkeypatch)
    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", counting_kernel)

    scaler.step(opt)
    scaler.update()
    monkeypatch.undo()
    assert sorted(launches) == [2, 4]  # bf16: weight+bias of the last layer; fp32: the other four
    assert syncs == ["item"]


def test_clean_steps_pay_nothing_for_overflow_attribution(monkeypatch):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler("cpu").watch(model)
    _backward(model, scaler)
    calls = []
    original = torch.isfinite
    monkeypatch.setattr(torch, "isfinite", lambda t: calls.append(1) or original(t))
    scaler.step(opt)
    scaler.update()
    assert calls == []
    assert scaler.stats.last_overflow_params == ()


# --------------------------------------------------------------------------------------------
# 3. a skip is a complete skip, for every optimizer kind
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["sgd_momentum", "adamw_forloop", "adamw_foreach", "adamw_fused"])
@pytest.mark.parametrize("poison", [math.inf, math.nan])
def test_skip_leaves_params_and_optimizer_state_bit_identical(kind, poison):
    model = _model()
    opt = _optimizer(kind, model.parameters())
    scaler = DynamicLossScaler("cpu")
    # One clean step first so the optimizer has moments and step counters to protect.
    _backward(model, scaler)
    scaler.step(opt)
    scaler.update()
    assert not scaler.step_was_skipped
    opt.zero_grad()

    params_before = [p.detach().clone() for p in model.parameters()]
    state_before = _clone_state(opt)
    _backward(model, scaler, seed=2, poison=poison)
    assert scaler.step(opt) is None
    scaler.update()

    assert scaler.step_was_skipped
    for before, after in zip(params_before, model.parameters()):
        assert torch.equal(before, after)
    _assert_same_state(state_before, _clone_state(opt))
    assert scaler.get_scale() == 2.0**15


def test_torch_scaler_calls_fused_step_on_overflow_but_ours_does_not():
    """Why wrappers that watch optimizer.step() (Accelerate) miss torch's fused-optimizer skips."""
    calls = {"torch": 0, "ours": 0}
    for who, scaler in (("torch", torch.amp.GradScaler("cpu")), ("ours", DynamicLossScaler("cpu"))):
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        original = opt.step

        def counted(*args, _who=who, _original=original, **kwargs):
            calls[_who] += 1
            return _original(*args, **kwargs)

        opt.step = counted
        _backward(model, scaler, poison=math.inf)
        scaler.step(opt)
        scaler.update()
    assert calls == {"torch": 1, "ours": 0}


# --------------------------------------------------------------------------------------------
# 4. hysteresis, bounds, on_min_scale
# --------------------------------------------------------------------------------------------
def _run(scaler: DynamicLossScaler, pattern: str, model=None, opt=None) -> list[float]:
    """Drive the scaler through a pattern of clean ('.') and overflow ('x') steps."""
    model = model or _model()
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.01)
    scales = []
    for i, c in enumerate(pattern):
        opt.zero_grad()
        _backward(model, scaler, seed=i, poison=math.inf if c == "x" else None)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


def test_hysteresis_tolerates_n_minus_one_overflows_then_backs_off():
    scaler = DynamicLossScaler("cpu", init_scale=64.0, growth_interval=100, hysteresis=3)
    assert _run(scaler, "xxx") == [64.0, 64.0, 32.0]
    # The tolerance is spent: without a growth (Megatron) every further overflow backs off,
    # even after clean steps.
    assert _run(scaler, "..x") == [32.0, 32.0, 16.0]
    assert scaler.stats.skipped == 4 and scaler.stats.backoffs == 2


def test_hysteresis_refills_when_the_scale_grows():
    scaler = DynamicLossScaler("cpu", init_scale=64.0, growth_interval=2, hysteresis=2)
    assert _run(scaler, "xx..xx") == [64.0, 32.0, 32.0, 64.0, 64.0, 32.0]


def test_consecutive_hysteresis_refills_on_every_clean_step():
    kw = dict(init_scale=64.0, growth_interval=100, hysteresis=2)
    megatron = DynamicLossScaler("cpu", **kw)
    deepspeed = DynamicLossScaler("cpu", **kw, consecutive_hysteresis=True)
    assert _run(megatron, "x.x.x") == [64.0, 64.0, 32.0, 32.0, 16.0]
    assert _run(deepspeed, "x.x.x") == [64.0] * 5
    # (its last overflow plus the next one make two in a row)
    assert _run(deepspeed, "x") == [32.0]


def test_growth_stops_at_max_scale_and_backoff_at_min_scale():
    scaler = DynamicLossScaler(
        "cpu",
        init_scale=4.0,
        growth_interval=1,
        min_scale=2.0,
        max_scale=24.0,
        on_min_scale="clamp",
    )
    assert _run(scaler, "....") == [8.0, 16.0, 24.0, 24.0]
    assert _run(scaler, "xxxxx") == [12.0, 6.0, 3.0, 2.0, 2.0]


def test_on_min_scale_raise_names_the_overflowing_parameters_and_next_step():
    model = _model()
    scaler = DynamicLossScaler("cpu", init_scale=2.0, min_scale=1.0).watch(model)
    _run(scaler, "x", model=model)
    assert scaler.get_scale() == 1.0
    with pytest.raises(LossScaleError) as err:
        _run(scaler, "x", model=model)
    message = str(err.value)
    assert "0.weight" in message and "minimum loss scale 1" in message
    assert "FP32" in message and "doctor" in message
    assert isinstance(err.value, FloatingPointError)


def test_on_min_scale_raise_names_parameters_even_when_not_watched():
    scaler = DynamicLossScaler("cpu", init_scale=1.0, min_scale=1.0)
    with pytest.raises(LossScaleError, match=r"param_groups\[0\]\['params'\]\[0\] \(shape 8x6\)"):
        _run(scaler, "x")


def test_on_min_scale_warn_logs_once_per_streak_and_keeps_skipping(caplog):
    scaler = DynamicLossScaler("cpu", init_scale=1.0, min_scale=1.0, on_min_scale="warn")
    with caplog.at_level(logging.WARNING, logger="amp_trainer.scaler"):
        _run(scaler, "xxx.xx")
    warnings = [r for r in caplog.records if "minimum loss scale" in r.getMessage()]
    assert len(warnings) == 2  # one per overflow streak
    assert scaler.stats.skipped == 5 and scaler.get_scale() == 1.0


def test_on_min_scale_clamp_is_silent(caplog):
    scaler = DynamicLossScaler("cpu", init_scale=1.0, min_scale=1.0, on_min_scale="clamp")
    with caplog.at_level(logging.DEBUG, logger="amp_trainer.scaler"):
        _run(scaler, "xxx")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert scaler.stats.overflow_streak == 3


# --------------------------------------------------------------------------------------------
# 5. attribution and telemetry
# --------------------------------------------------------------------------------------------
def test_watch_names_exactly_the_parameters_with_non_finite_grads():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler("cpu").watch(model)
    _backward(model, scaler)
    model[2].bias.grad[1] = math.nan
    model[1].weight.grad[0] = -math.inf
    scaler.step(opt)
    scaler.update()
    assert scaler.stats.last_overflow_params == ("1.weight", "2.bias")


def test_stats_count_steps_skips_growths_backoffs_and_streak():
    scaler = DynamicLossScaler("cpu", init_scale=8.0, growth_interval=2)
    _run(scaler, "..xx.")
    stats = scaler.stats
    assert (stats.steps, stats.skipped, stats.growths, stats.backoffs) == (5, 2, 1, 2)
    assert stats.overflow_streak == 0 and stats.scale == 4.0


# --------------------------------------------------------------------------------------------
# 7. unscale once, clip true gradients, several optimizers
# --------------------------------------------------------------------------------------------
def test_second_unscale_in_a_step_raises():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler("cpu")
    _backward(model, scaler)
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)


def test_step_after_unscale_applies_true_gradients_once():
    reference, model = _model(), _model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _batch()
    nn.functional.cross_entropy(reference(x), y).backward()
    ref_opt.step()

    scaler = DynamicLossScaler("cpu", init_scale=1024.0)
    scaler.scale(nn.functional.cross_entropy(model(x), y)).backward()
    scaler.unscale_(opt)
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, r.grad)
    scaler.step(opt)
    scaler.update()
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, r)


def test_clip_grad_norm_unscales_then_clips_and_returns_true_norm():
    reference, model = _model(), _model()
    x, y = _batch()
    nn.functional.cross_entropy(reference(x), y).backward()
    true_norm = nn.utils.clip_grad_norm_(reference.parameters(), 0.01)

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler("cpu", init_scale=4096.0)
    scaler.scale(nn.functional.cross_entropy(model(x), y)).backward()
    norm = scaler.clip_grad_norm_(opt, 0.01)
    torch.testing.assert_close(norm, true_norm)
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, r.grad)
    clipped = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    torch.testing.assert_close(clipped, torch.tensor(0.01), rtol=1e-3, atol=0)
    # clip_grad_norm_ already unscaled: step must not unscale a second time (or raise).
    scaler.step(opt)
    scaler.update()


def test_clip_grad_norm_on_overflow_returns_inf_and_step_skips():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler("cpu")
    _backward(model, scaler, poison=math.nan)
    assert math.isinf(scaler.clip_grad_norm_(opt, 1.0).item())
    scaler.step(opt)
    scaler.update()
    assert scaler.step_was_skipped


def test_two_optimizers_each_skip_on_their_own_grads_and_share_one_scale():
    model = _model()
    opt_a = torch.optim.SGD(model[0].parameters(), lr=0.1)
    opt_b = torch.optim.AdamW([*model[1].parameters(), *model[2].parameters()], lr=0.01)
    scaler = DynamicLossScaler("cpu", init_scale=256.0)
    _backward(model, scaler, poison=math.inf)  # poisons model[0] only: opt_a's params
    b_before = [p.detach().clone() for p in model[2].parameters()]
    a_before = [p.detach().clone() for p in model[0].parameters()]
    scaler.step(opt_a)
    scaler.step(opt_b)
    scaler.update()
    assert all(torch.equal(b, p) for b, p in zip(a_before, model[0].parameters()))
    assert not all(torch.equal(b, p) for b, p in zip(b_before, model[2].parameters()))
    assert scaler.step_was_skipped and scaler.get_scale() == 128.0


def test_update_without_step_raises_and_step_twice_raises():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler("cpu")
    with pytest.raises(RuntimeError, match="no inf checks"):
        scaler.update()
    _backward(model, scaler)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.step(opt)


def test_step_with_closure_is_refused_while_scaling():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="closure"):
        DynamicLossScaler("cpu").step(opt, closure=lambda: 0.0)


# --------------------------------------------------------------------------------------------
# 8. checkpointable state
# --------------------------------------------------------------------------------------------
def _roundtrip(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@settings(max_examples=25, deadline=None)
@given(pattern=st.text(alphabet=".x", min_size=2, max_size=24), cut=st.integers(1, 23))
def test_state_dict_round_trip_mid_run_gives_identical_future(pattern, cut):
    cut = min(cut, len(pattern) - 1)
    kw = dict(init_scale=16.0, growth_interval=2, hysteresis=2, min_scale=0.5, on_min_scale="clamp")
    straight = DynamicLossScaler("cpu", **kw)
    full = _run(straight, pattern)

    first = DynamicLossScaler("cpu", **kw)
    head = _run(first, pattern[:cut])
    resumed = DynamicLossScaler("cpu")  # default knobs: the state dict must carry the config
    resumed.load_state_dict(_roundtrip(first.state_dict()))
    tail = _run(resumed, pattern[cut:])
    assert head + tail == full
    assert resumed.stats == straight.stats


def test_loads_torch_grad_scaler_state_dict():
    theirs = torch.amp.GradScaler("cpu", init_scale=512.0, growth_interval=7)
    model = _model()
    _run_torch = torch.optim.SGD(model.parameters(), lr=0.1)
    _backward(model, theirs)
    theirs.step(_run_torch)
    theirs.update()
    ours = DynamicLossScaler("cpu")
    ours.load_state_dict(_roundtrip(theirs.state_dict()))
    assert ours.get_scale() == 512.0
    assert ours.get_growth_interval() == 7
    assert ours.state_dict()["_growth_tracker"] == 1


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"growth_interval": 10}, "lacks"),
        ({"scale": -1.0, "_growth_tracker": 0}, "scale"),
        ({"scale": 8.0, "_growth_tracker": -3}, "_growth_tracker"),
        ({"scale": 8.0, "_growth_tracker": 0, "backoff_factor": 2.0}, "backoff_factor"),
        ({"scale": 8.0, "_growth_tracker": 0, "on_min_scale": "explode"}, "on_min_scale"),
        ({"scale": 8.0, "_growth_tracker": 5, "growth_interval": 5}, "_growth_tracker"),
        ({"scale": 8.0, "_growth_tracker": 0, "steps": 1.5}, "steps"),
        ({"scale": 8.0, "_growth_tracker": 0, "last_overflow_params": "w"}, "last_overflow"),
    ],
)
def test_malformed_state_dict_raises_and_leaves_scaler_unchanged(bad, match):
    scaler = DynamicLossScaler("cpu", init_scale=64.0, growth_interval=3)
    _run(scaler, ".x.")
    before = scaler.state_dict()
    with pytest.raises((ValueError, KeyError, TypeError), match=match):
        scaler.load_state_dict(bad)
    assert scaler.state_dict() == before


# --------------------------------------------------------------------------------------------
# 9. disabled is an exact pass-through
# --------------------------------------------------------------------------------------------
def test_disabled_scaler_is_an_exact_pass_through():
    model, reference = _model(), _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    scaler = DynamicLossScaler("cpu", enabled=False)
    x, y = _batch()
    loss = nn.functional.cross_entropy(model(x), y)
    assert scaler.scale(loss) is loss
    loss.backward()
    nn.functional.cross_entropy(reference(x), y).backward()
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    ref_opt.step()
    for p, r in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, r)
    assert scaler.state_dict() == {} and scaler.get_scale() == 1.0
    assert scaler._device_cache == {}


# --------------------------------------------------------------------------------------------
# 10. bad input
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, names",
    [
        ({"init_scale": 0.0}, ["init_scale", "0.0"]),
        ({"init_scale": math.inf}, ["init_scale", "inf"]),
        ({"init_scale": math.nan}, ["init_scale", "nan"]),
        ({"growth_factor": 1.0}, ["growth_factor", "1.0", "> 1.0"]),
        ({"backoff_factor": 1.0}, ["backoff_factor", "1.0", "(0, 1)"]),
        ({"backoff_factor": 0.0}, ["backoff_factor", "0.0"]),
        ({"growth_interval": 0}, ["growth_interval", "0", ">= 1"]),
        ({"hysteresis": 0}, ["hysteresis", "0", ">= 1"]),
        ({"min_scale": 8.0, "max_scale": 4.0, "init_scale": 4.0}, ["min_scale", "max_scale"]),
        ({"init_scale": 2.0**30, "max_scale": 2.0**24}, ["init_scale", "max_scale"]),
        ({"init_scale": 1e39}, ["init_scale", "float32", "1e+39"]),
        ({"on_min_scale": "ignore"}, ["on_min_scale", "'ignore'", "raise"]),
    ],
)
def test_bad_constructor_argument_names_argument_value_and_valid_range(kwargs, names):
    with pytest.raises(ValueError) as err:
        DynamicLossScaler("cpu", **kwargs)
    for name in names:
        assert name in str(err.value)


def test_non_numeric_arguments_are_type_errors():
    with pytest.raises(TypeError, match="growth_interval"):
        DynamicLossScaler("cpu", growth_interval=2.5)
    with pytest.raises(TypeError, match="init_scale"):
        DynamicLossScaler("cpu", init_scale="65536")


def test_fp16_gradients_are_refused_with_parameter_names():
    model = _model().half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler("cpu").watch(model)
    x, y = _batch()
    loss = nn.functional.cross_entropy(model(x.half()).float(), y)
    scaler.scale(loss).backward()
    with pytest.raises(ValueError) as err:
        scaler.step(opt)
    message = str(err.value)
    assert "Attempting to unscale FP16 gradients" in message
    assert "0.weight" in message and "FP32 master weights" in message


def test_update_with_new_scale_sets_it_within_bounds():
    scaler = DynamicLossScaler("cpu", min_scale=1.0, max_scale=2.0**20)
    scaler.update(1024.0)
    assert scaler.get_scale() == 1024.0
    scaler.update(torch.tensor([8.0]))
    assert scaler.get_scale() == 8.0
    with pytest.raises(ValueError, match="new_scale"):
        scaler.update(0.25)
    with pytest.raises(ValueError, match="new_scale"):
        scaler.update(2.0**21)


def test_scale_handles_nested_sequences_and_promotes_half_losses():
    scaler = DynamicLossScaler("cpu")
    half_loss = torch.tensor(2.0, dtype=torch.float16)
    scaled = scaler.scale([half_loss, (torch.tensor(1.0),)])
    assert scaled[0].dtype == torch.float32 and scaled[0].item() == 131072.0
    assert isinstance(scaled[1], tuple) and scaled[1][0].item() == 65536.0
    with pytest.raises(ValueError, match="Tensor"):
        scaler.scale(3.0)


def test_scaler_pickles_and_deep_copies():
    import pickle

    scaler = DynamicLossScaler("cpu", init_scale=32.0, hysteresis=2)
    _run(scaler, "x.")
    clone = pickle.loads(pickle.dumps(scaler))
    assert clone.state_dict() == scaler.state_dict()
    assert copy.deepcopy(scaler).state_dict() == scaler.state_dict()


def test_accelerate_fsdp2_load_path_can_initialise_the_scaler_after_loading():
    """Accelerate 1.10-1.15's FSDP2 load_state calls this torch-private method after loading."""
    scaler = DynamicLossScaler("cpu")
    scaler.load_state_dict({"scale": 256.0, "_growth_tracker": 3})
    scaler._lazy_init_scale_growth_tracker(scaler._device)
    assert scaler._device == "cpu" and scaler.get_scale() == 256.0
    assert scaler.scale(torch.tensor(1.0)).item() == 256.0


def test_overflow_attribution_reads_back_once_per_device_not_once_per_tensor(monkeypatch):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler("cpu").watch(model)
    _backward(model, scaler, poison=math.inf)
    syncs = _record_host_syncs(monkeypatch)
    scaler.step(opt)
    scaler.update()
    monkeypatch.undo()
    assert syncs == ["item", "tolist"]  # the skip decision, then the names (six tensors)
    assert scaler.stats.last_overflow_params == ("0.weight",)
