"""DynamicLossScaler over torch's whole range, and torch's own grad-scaling scenarios.

The scenarios in the second half are torch's ``test/test_cuda.py`` grad-scaling tests
(``_run_scaling_case`` and friends) rewritten against our public API on CPU: a control model
trained without scaling (skipping the same iteration by hand) must end where the scaled one does.
"""

from __future__ import annotations

import io
import math
import pickle
from itertools import chain

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

from amp_trainer.scaler import DynamicLossScaler, LossScaleError

F32_MAX = float(torch.finfo(torch.float32).max)


def _param_step(scaler, param: torch.Tensor, opt, poison: bool) -> None:
    """One iteration on a single 4-element parameter: cheap enough for runs of hundreds of steps."""
    opt.zero_grad(set_to_none=True)
    scaler.scale((param * 1e-30).sum()).backward()
    if poison:
        param.grad[0] = math.inf
    scaler.step(opt)
    scaler.update()


def _pair(**knobs):
    params = [torch.zeros(4, requires_grad=True) for _ in range(2)]
    opts = [torch.optim.SGD([p], lr=0.0) for p in params]
    return params, opts


# --------------------------------------------------------------------------------------------
# torch's range: every positive finite init_scale / new_scale, no cap by default
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("init_scale", [1e38, 2.0**32, 2.0**16, 3.3, 1e-4])
def test_every_init_scale_torch_accepts_is_accepted_and_stored_as_torch_stores_it(init_scale):
    ours = DynamicLossScaler("cpu", init_scale=init_scale)
    theirs = torch.amp.GradScaler("cpu", init_scale=init_scale)
    ours.scale(torch.ones(()))
    theirs.scale(torch.ones(()))
    assert ours.get_scale() == theirs.get_scale()


def test_before_the_first_scale_call_get_scale_is_already_float32_where_torchs_is_not():
    """The README row: torch reports the unrounded init_scale until its scale tensor exists."""
    ours = DynamicLossScaler("cpu", init_scale=3.3)
    theirs = torch.amp.GradScaler("cpu", init_scale=3.3)
    assert theirs.get_scale() == 3.3 and ours.get_scale() == torch.tensor(3.3).item()
    theirs.scale(torch.ones(()))
    assert theirs.get_scale() == ours.get_scale()


def test_growth_from_1e38_stops_below_inf_as_in_torch():
    """torch's test_grad_scale_will_not_overflow: growth_factor 16 from 1e38 must not reach inf."""
    results = []
    for scaler in (
        DynamicLossScaler("cpu", growth_interval=1, growth_factor=2.0**4, init_scale=1e38),
        torch.amp.GradScaler("cpu", growth_interval=1, growth_factor=2.0**4, init_scale=1e38),
    ):
        torch.manual_seed(0)
        model = nn.Linear(5, 1)
        optimizer = torch.optim.Adam(model.parameters())
        x, y = torch.randn(1, 5), 1e-30 * torch.randn(1, 1)
        for _ in range(3):
            optimizer.zero_grad()
            loss = ((model(x) - y) ** 2).mean()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            assert math.isfinite(scaler.get_scale())
        results.append(scaler.get_scale())
    assert results[0] == results[1]


def test_default_scale_keeps_growing_past_2_to_the_24_like_torch_and_never_into_inf():
    ours = DynamicLossScaler("cpu", growth_interval=1)
    theirs = torch.amp.GradScaler("cpu", growth_interval=1)
    params, opts = _pair()
    for step in range(120):  # 2**16 * 2**112 = 2**128 would be inf: growth must stop at 2**127
        _param_step(ours, params[0], opts[0], poison=False)
        _param_step(theirs, params[1], opts[1], poison=False)
        assert ours.get_scale() == theirs.get_scale(), f"step {step}"
    assert ours.get_scale() == 2.0**127


@settings(max_examples=60, deadline=None)
@given(new_scale=st.floats(min_value=1.5e-45, max_value=F32_MAX))
def test_update_new_scale_accepts_every_value_torch_accepts_with_default_bounds(new_scale):
    ours = DynamicLossScaler("cpu")
    theirs = torch.amp.GradScaler("cpu")
    theirs.scale(torch.ones(()))
    ours.update(new_scale)
    theirs.update(new_scale)
    assert ours.get_scale() == theirs.get_scale()


def test_init_scale_below_one_starts_there_and_the_default_floor_follows_it():
    scaler = DynamicLossScaler("cpu", init_scale=1e-4, growth_interval=1)
    params, opts = _pair()
    _param_step(scaler, params[0], opts[0], poison=False)
    assert scaler.get_scale() == torch.tensor(2e-4).item()
    _param_step(scaler, params[0], opts[0], poison=True)
    with pytest.raises(LossScaleError, match=r"minimum loss scale 0\.0001"):
        _param_step(scaler, params[0], opts[0], poison=True)


def test_explicit_bounds_still_cap_growth_and_refuse_a_new_scale_outside_them():
    scaler = DynamicLossScaler("cpu", init_scale=4.0, growth_interval=1, max_scale=8.0)
    params, opts = _pair()
    for _ in range(3):
        _param_step(scaler, params[0], opts[0], poison=False)
    assert scaler.get_scale() == 8.0
    with pytest.raises(ValueError, match=r"new_scale must lie in \[min_scale, max_scale\]"):
        scaler.update(16.0)


@settings(max_examples=40, deadline=None)
@given(
    overflows=st.lists(st.booleans(), min_size=1, max_size=300),
    init_scale=st.sampled_from([2.0**16, 2.0**32, 1e38, 3.3e38, 12345.678]),
    growth_interval=st.integers(1, 3),
)
@example(overflows=[True] * 15, init_scale=12345.678, growth_interval=1)  # 1.5 -> floor
def test_default_scaler_equals_torch_for_any_run_until_it_refuses_to_go_below_one(
    overflows, init_scale, growth_interval
):
    """The whole trajectory with default bounds; the one difference is the documented floor."""
    ours = DynamicLossScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    theirs = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    params, opts = _pair()
    for step, overflow in enumerate(overflows):
        _param_step(theirs, params[1], opts[1], poison=overflow)
        if overflow and ours.get_scale() <= 1.0:
            with pytest.raises(LossScaleError):
                _param_step(ours, params[0], opts[0], poison=overflow)
            assert theirs.get_scale() < 1.0
            return
        _param_step(ours, params[0], opts[0], poison=overflow)
        if theirs.get_scale() < 1.0 <= ours.get_scale():
            # A backoff that takes torch below 1 (from a scale that is no power of two, e.g.
            # 1.5 -> 0.75) stops at the floor here: the documented difference, a step early;
            # the trajectories part, and the next overflow at the floor raises.
            assert ours.get_scale() == 1.0 and ours.step_was_skipped, f"step {step}"
            if True in overflows[step + 1 :]:
                with pytest.raises(LossScaleError):
                    for later in overflows[step + 1 :]:
                        _param_step(ours, params[0], opts[0], poison=later)
            return
        assert ours.get_scale() == theirs.get_scale(), f"step {step}"
        assert ours.step_was_skipped is overflow


# --------------------------------------------------------------------------------------------
# every state the scaler writes loads back into a scaler built with the same arguments
# --------------------------------------------------------------------------------------------
def _roundtrip(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize(
    "knobs, pattern",
    [
        ({"init_scale": 1e-4, "min_scale": 1e-4}, "."),
        ({"init_scale": 4.0, "min_scale": 0.7, "on_min_scale": "clamp"}, "xxxxx"),
        ({"init_scale": 2.0**34, "max_scale": 3e10, "growth_interval": 1}, "...."),
    ],
)
def test_state_at_a_float32_rounded_bound_loads_into_the_same_scaler(knobs, pattern):
    scaler = DynamicLossScaler("cpu", **knobs)
    params, opts = _pair()
    for mark in pattern:
        _param_step(scaler, params[0], opts[0], poison=mark == "x")
    clone = DynamicLossScaler("cpu", **knobs)
    clone.load_state_dict(_roundtrip(scaler.state_dict()))
    assert clone.state_dict() == scaler.state_dict()


_bound = st.floats(min_value=1e-30, max_value=1e30, allow_nan=False, allow_infinity=False)


@settings(max_examples=60, deadline=None)
@given(
    low=_bound,
    span=st.floats(min_value=1.0, max_value=1e6),
    where=st.floats(min_value=0.0, max_value=1.0),
    pattern=st.text(alphabet=".x", min_size=1, max_size=30),
)
def test_every_state_written_loads_back_into_a_scaler_built_with_the_same_arguments(
    low, span, where, pattern
):
    high = low * span
    knobs = dict(
        init_scale=min(max(low + (high - low) * where, low), high),
        min_scale=low,
        max_scale=high,
        growth_interval=1,
        on_min_scale="clamp",
    )
    scaler = DynamicLossScaler("cpu", **knobs)
    params, opts = _pair()
    for mark in pattern:
        _param_step(scaler, params[0], opts[0], poison=mark == "x")
        DynamicLossScaler("cpu", **knobs).load_state_dict(_roundtrip(scaler.state_dict()))


# --------------------------------------------------------------------------------------------
# pickling mid-iteration is refused, as torch does
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [DynamicLossScaler, torch.amp.GradScaler])
def test_pickling_after_unscale_and_before_update_is_refused(make):
    scaler = make("cpu", init_scale=8.0)
    params, opts = _pair()
    scaler.scale(params[0].sum()).backward()
    scaler.unscale_(opts[0])
    with pytest.raises((RuntimeError, AssertionError), match="pickled"):
        pickle.dumps(scaler)
    scaler.step(opts[0])
    scaler.update()
    assert pickle.loads(pickle.dumps(scaler)).get_scale() == 8.0


# --------------------------------------------------------------------------------------------
# a backward that bypassed scale()
# --------------------------------------------------------------------------------------------
def test_step_after_a_plain_backward_is_refused_instead_of_a_65536x_too_small_update():
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler("cpu")
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.ones(3, 4)).sum().backward()
    with pytest.raises(RuntimeError, match=r"scale\(\) was not called.*65536x too small"):
        scaler.step(opt)
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_a_plain_backward_after_scaled_steps_is_refused_too():
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler("cpu")
    for _ in range(2):
        opt.zero_grad()
        scaler.scale(model(torch.ones(3, 4)).sum()).backward()
        scaler.step(opt)
        scaler.update()
    opt.zero_grad()
    model(torch.ones(3, 4)).sum().backward()
    with pytest.raises(RuntimeError, match=r"scale\(\) was not called"):
        scaler.unscale_(opt)


def test_two_optimizers_stepped_after_one_update_each_are_not_mistaken_for_unscaled():
    """Accelerate calls update() after every optimizer's step: both losses scaled up front."""
    a, b = nn.Linear(4, 1), nn.Linear(4, 1)
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    scaler = DynamicLossScaler("cpu")
    for _ in range(3):
        scaler.scale(a(torch.ones(2, 4)).sum()).backward()
        scaler.scale(b(torch.ones(2, 4)).sum()).backward()
        for opt in (opt_a, opt_b):
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    assert scaler.stats.steps == 6 and scaler.stats.skipped == 0


@pytest.mark.parametrize("b_overflows", [False, True])
def test_an_optimizer_unscaled_before_anothers_update_is_unscaled_once_and_counted_once(
    b_overflows,
):
    """Accelerate's order: unscale (clip) both, then step+update A, then step+update B."""
    torch.manual_seed(0)
    a, b = nn.Linear(3, 1), nn.Linear(3, 1)
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    scaler = DynamicLossScaler("cpu", init_scale=8.0)
    x = torch.ones(2, 3)
    scaler.scale(a(x).sum() + b(x).sum()).backward()
    if b_overflows:
        b.weight.grad[0, 0] = math.inf
    scaler.unscale_(opt_a)
    scaler.unscale_(opt_b)
    true_grads = [p.grad.clone() for p in b.parameters()]
    b_before = [p.detach().clone() for p in b.parameters()]
    for opt in (opt_a, opt_b):
        scaler.step(opt)
        scaler.update()
    if not b_overflows:
        assert all(torch.equal(p.grad, g) for p, g in zip(b.parameters(), true_grads))
        assert true_grads[1].item() == 2.0  # d(sum)/d(bias) over two rows: divided by 8 once
    assert scaler.get_scale() == (4.0 if b_overflows else 8.0)  # one backoff at most
    assert scaler.stats.steps == 1 and scaler.stats.skipped == int(b_overflows)
    b_unchanged = all(torch.equal(p, q) for p, q in zip(b.parameters(), b_before))
    assert b_unchanged is b_overflows


# --------------------------------------------------------------------------------------------
# torch's own scenarios (test/test_cuda.py), on CPU, against our public API
# --------------------------------------------------------------------------------------------
def _models_and_optimizers(optimizer_ctor=torch.optim.SGD, optimizer_kwargs=None):
    control = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    scaling = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    with torch.no_grad():
        for c, s in zip(control.parameters(), scaling.parameters()):
            s.copy_(c)
    kwargs = {"lr": 1.0, **(optimizer_kwargs or {})}
    return (
        control,
        scaling,
        optimizer_ctor(control.parameters(), **kwargs),
        optimizer_ctor(scaling.parameters(), **kwargs),
    )


def _scaling_case(optimizer_ctor=torch.optim.SGD, optimizer_kwargs=None):
    torch.manual_seed(0)
    data = [(torch.randn(8, 8), torch.randn(8, 8)) for _ in range(4)]
    return (*_models_and_optimizers(optimizer_ctor, optimizer_kwargs), data, nn.MSELoss(), 2)


def _run_scaling_case(run, unskipped, skipped, atol=1e-7, **case_kwargs):
    for enabled in (True, False):
        control, scaling, opt_control, opt_scaling, data, loss_fn, skip_iter = _scaling_case(
            **case_kwargs
        )
        scaler = DynamicLossScaler("cpu", init_scale=128.0, growth_interval=1, enabled=enabled)
        run(data, control, opt_control, scaler, loss_fn, skip_iter, False)
        scaler = run(data, scaling, opt_scaling, scaler, loss_fn, skip_iter, True) or scaler
        if enabled:
            assert scaler.get_scale() == 128.0 * 2.0**unskipped * 0.5**skipped
        else:
            assert scaler.get_scale() == 1.0
        for c, s in zip(control.parameters(), scaling.parameters()):
            torch.testing.assert_close(c.grad, s.grad, atol=atol, rtol=1e-5)
            for key, value in opt_control.state[c].items():
                torch.testing.assert_close(value, opt_scaling.state[s][key], atol=atol, rtol=1e-5)
            torch.testing.assert_close(c, s, atol=atol, rtol=1e-5)


def _plain_or_scaled_step(scaler, model, optimizer, loss, i, skip_iter, try_scaling_api):
    if try_scaling_api:
        scaler.scale(loss).backward()
        if i == skip_iter and scaler.is_enabled():
            model[1].weight.grad.fill_(math.inf)
        scaler.step(optimizer)
        scaler.update()
    else:
        loss.backward()
        if not scaler.is_enabled() or i != skip_iter:
            optimizer.step()


@pytest.mark.parametrize("pickle_every_step", [False, True])
@pytest.mark.parametrize(
    "ctor, kwargs",
    [
        (torch.optim.SGD, {}),
        (torch.optim.SGD, {"foreach": True}),
        (torch.optim.Adam, {}),
        (torch.optim.AdamW, {"fused": True}),
    ],
)
def test_torch_scenario_scaled_training_matches_unscaled_control(ctor, kwargs, pickle_every_step):
    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        for i, (x, target) in enumerate(data):
            optimizer.zero_grad()
            loss = loss_fn(model(x), target)
            _plain_or_scaled_step(scaler, model, optimizer, loss, i, skip_iter, try_scaling_api)
            if try_scaling_api and pickle_every_step:
                scaler = pickle.loads(pickle.dumps(scaler))
        return scaler

    _run_scaling_case(
        run, unskipped=3, skipped=1, atol=1e-5, optimizer_ctor=ctor, optimizer_kwargs=kwargs
    )


def test_torch_scenario_clipping_scaled_grads_with_a_scaled_threshold():
    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        max_norm = 0.2
        for i, (x, target) in enumerate(data):
            optimizer.zero_grad()
            loss = loss_fn(model(x), target)
            if try_scaling_api:
                scaler.scale(loss).backward()
                nn.utils.clip_grad_norm_(model.parameters(), max_norm * scaler.get_scale())
                if i == skip_iter and scaler.is_enabled():
                    model[1].weight.grad.fill_(math.inf)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                if not scaler.is_enabled() or i != skip_iter:
                    optimizer.step()

    _run_scaling_case(run, unskipped=3, skipped=1, atol=1e-5)


def test_torch_scenario_clipping_after_a_separate_unscale():
    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        max_norm = 0.2
        for i, (x, target) in enumerate(data):
            optimizer.zero_grad()
            loss = loss_fn(model(x), target)
            if try_scaling_api:
                scaler.scale(loss).backward()
                if i == skip_iter and scaler.is_enabled():
                    model[1].weight.grad.fill_(math.inf)
                scaler.unscale_(optimizer)
                nn.utils.clip_grad_norm_(model.parameters(), max_norm, error_if_nonfinite=False)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                if not scaler.is_enabled() or i != skip_iter:
                    optimizer.step()

    _run_scaling_case(run, unskipped=3, skipped=1)


def test_torch_scenario_gradient_penalty_through_autograd_grad():
    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        for i, (x, target) in enumerate(data):
            optimizer.zero_grad()
            loss = loss_fn(model(x), target)
            if try_scaling_api:
                grads = torch.autograd.grad(
                    scaler.scale(loss), model.parameters(), create_graph=True
                )
                grads = [g * (1.0 / scaler.get_scale()) for g in grads]
            else:
                grads = torch.autograd.grad(loss, model.parameters(), create_graph=True)
            loss = loss + torch.stack([g.pow(2).sum() for g in grads]).sum().sqrt()
            _plain_or_scaled_step(scaler, model, optimizer, loss, i, skip_iter, try_scaling_api)

    _run_scaling_case(run, unskipped=3, skipped=1)


def test_torch_scenario_gradient_accumulation():
    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        for i, (x, target) in enumerate(data):
            loss = loss_fn(model(x), target) / 2
            (scaler.scale(loss) if try_scaling_api else loss).backward()
            if (i + 1) % 2 == 0:
                if try_scaling_api:
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    optimizer.step()
                optimizer.zero_grad()

    _run_scaling_case(run, unskipped=2, skipped=0)


@pytest.mark.parametrize("enabled", [True, False])
def test_torch_scenario_two_models_two_losses_two_optimizers(enabled):
    control0, scaling0, opt_control0, opt_scaling0, data, loss_fn, skip_iter = _scaling_case()
    control1, scaling1, opt_control1, opt_scaling1 = _models_and_optimizers()
    scaler = DynamicLossScaler("cpu", init_scale=128.0, growth_interval=1, enabled=enabled)

    def run(model0, model1, optimizer0, optimizer1, try_scaling_api):
        for i, (x, target) in enumerate(data):
            optimizer0.zero_grad()
            optimizer1.zero_grad()
            out0, out1 = model0(x), model1(x)
            loss0 = loss_fn(0.3 * out0 + 0.7 * out1, target)
            loss1 = loss_fn(0.6 * out0 - 0.4 * out1, target)
            if try_scaling_api:
                scaler.scale(loss0).backward(retain_graph=True)
                scaler.scale(loss1).backward()
                if i == skip_iter and scaler.is_enabled():
                    model1[1].weight.grad.fill_(math.inf)
                scaler.unscale_(optimizer0)  # torch's extra stress: one separate unscale
                scaler.step(optimizer0)
                scaler.step(optimizer1)
                scaler.update()
            else:
                loss0.backward(retain_graph=True)
                loss1.backward()
                optimizer0.step()  # its own gradients are finite: it steps, as in torch
                if not scaler.is_enabled() or i != skip_iter:
                    optimizer1.step()

    run(control0, control1, opt_control0, opt_control1, False)
    run(scaling0, scaling1, opt_scaling0, opt_scaling1, True)
    assert scaler.get_scale() == (128.0 * 2.0**3 * 0.5 if enabled else 1.0)
    for c, s in zip(
        chain(control0.parameters(), control1.parameters()),
        chain(scaling0.parameters(), scaling1.parameters()),
    ):
        torch.testing.assert_close(c, s, rtol=1e-5, atol=1e-7)


def test_torch_scenario_grads_broken_between_unscale_and_step_reach_the_parameters():
    """torch: the verdict is taken at unscale_(); what the user does after it is theirs."""
    model, _, optimizer, _, data, loss_fn, _ = _scaling_case(torch.optim.Adam)
    scaler = DynamicLossScaler("cpu", init_scale=128.0)
    for x, target in data:
        optimizer.zero_grad()
        scaler.scale(loss_fn(model(x), target)).backward()
        scaler.unscale_(optimizer)
        for j, param in enumerate(model.parameters()):
            param.grad.copy_(torch.full_like(param.grad, math.inf if j % 2 else math.nan))
        scaler.step(optimizer)
        scaler.update()
    assert all(p.isnan().any() or p.isinf().any() for p in model.parameters())


def test_torch_scenario_fp16_autocast_training_matches_fp32_control():
    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        for i, (x, target) in enumerate(data):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16, enabled=try_scaling_api):
                loss = loss_fn(model(x), target)
            _plain_or_scaled_step(scaler, model, optimizer, loss, i, skip_iter, try_scaling_api)

    _run_scaling_case(run, unskipped=3, skipped=1, atol=1e-2)


def test_torch_scenario_update_scale_grows_every_interval_and_backs_off():
    """torch's test_grad_scaling_update_scale, through update() instead of the private kernel."""
    scaler = DynamicLossScaler(
        "cpu", init_scale=4.0, growth_factor=2.0, backoff_factor=0.25, growth_interval=2
    )
    params, opts = _pair()
    _param_step(scaler, params[0], opts[0], poison=False)
    assert scaler.get_scale() == 4.0 and scaler.state_dict()["_growth_tracker"] == 1
    _param_step(scaler, params[0], opts[0], poison=False)
    assert scaler.get_scale() == 8.0 and scaler.state_dict()["_growth_tracker"] == 0
    _param_step(scaler, params[0], opts[0], poison=True)
    assert scaler.get_scale() == 2.0 and scaler.state_dict()["_growth_tracker"] == 0


@pytest.mark.parametrize("initialised", [False, True])
def test_torch_scenario_load_state_dict_overwrites_every_knob(initialised):
    """torch's test_grad_scaling_state_dict, with and without the scale tensor created first."""
    s0 = DynamicLossScaler(
        "cpu", init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2
    )
    s1 = DynamicLossScaler(
        "cpu", init_scale=6.0, growth_factor=7.0, backoff_factor=0.8, growth_interval=1
    )
    if initialised:
        s1.scale(torch.full((1,), 4.0))
    s1.load_state_dict(s0.state_dict())
    assert s1.get_scale() == 3.0
    assert s1.get_growth_factor() == 4.0
    assert s1.get_backoff_factor() == 0.5
    assert s1.get_growth_interval() == 2
    assert s1.state_dict()["_growth_tracker"] == 0
    assert s1.scale(torch.ones(())).item() == 3.0


def _sparse_embedding_step(
    scaler, init_rows: torch.Tensor, indices: list[int], poison=None, weight: float = 1.0
):
    emb = nn.Embedding(init_rows.shape[0], init_rows.shape[1], sparse=True)
    with torch.no_grad():
        emb.weight.copy_(init_rows)
    opt = torch.optim.SGD(emb.parameters(), lr=1.0)
    scaler.scale(emb(torch.tensor(indices)).sum() * weight).backward()
    assert emb.weight.grad.is_sparse and not emb.weight.grad.is_coalesced()
    if poison is not None:
        emb.weight.grad._values()[0, 0] = poison
    scaler.step(opt)
    scaler.update()
    return emb.weight.detach()


@pytest.mark.parametrize("poison", [None, math.inf, math.nan])
def test_torch_scenario_sparse_gradients_are_unscaled_and_checked(poison):
    """torch's test_grad_scaling_unscale_sparse, on a real sparse Embedding gradient."""
    rows = torch.zeros(3, 2)
    scaler = DynamicLossScaler("cpu", init_scale=4.0)
    weight = _sparse_embedding_step(scaler, rows, [0, 2, 0], poison)
    assert scaler.step_was_skipped is (poison is not None)
    if poison is None:  # true gradient: row 0 seen twice, row 2 once; lr 1
        assert torch.equal(weight, torch.tensor([[-2.0, -2.0], [0.0, 0.0], [-1.0, -1.0]]))
    else:
        assert torch.equal(weight, rows)


def test_sparse_duplicates_whose_sum_overflows_are_skipped_where_torch_steps_into_inf():
    """The README's "sparse duplicates" row: torch checks FP32 sparse values before summing them.

    Each occurrence's gradient is a finite 2e38; the gradient they stand for (their sum) is inf.
    """
    rows = torch.zeros(2, 1)
    theirs = torch.amp.GradScaler("cpu", init_scale=1.0)
    assert torch.isinf(_sparse_embedding_step(theirs, rows, [0, 0], weight=2e38)).any()
    ours = DynamicLossScaler("cpu", init_scale=1.0, min_scale=0.25)
    assert torch.equal(_sparse_embedding_step(ours, rows, [0, 0], weight=2e38), rows)
    assert ours.step_was_skipped and ours.get_scale() == 0.5


def test_a_sparse_gradient_is_checked_as_the_dense_gradient_it_stands_for():
    """Scaled duplicates summing past float32 are an overflow of the scaled gradient: back off."""
    rows = torch.zeros(2, 1)
    ours = DynamicLossScaler("cpu", init_scale=2e38)
    assert torch.equal(_sparse_embedding_step(ours, rows, [0, 0]), rows)
    assert ours.step_was_skipped and ours.get_scale() == pytest.approx(1e38)
    dense = DynamicLossScaler("cpu", init_scale=2e38)
    param = torch.zeros(1, requires_grad=True)
    dense.scale((param * 2.0).sum()).backward()  # the same gradient, 2 x 2e38, held densely
    dense.step(torch.optim.SGD([param], lr=1.0))
    dense.update()
    assert dense.step_was_skipped and dense.get_scale() == ours.get_scale()
