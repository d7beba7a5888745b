"""ScalePolicy: the grow/back-off rule as plain numbers, checked against torch's own kernel."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from amp_trainer import DynamicLossScaler
from amp_trainer.scale_policy import Decision, ScalePolicy


@settings(max_examples=60, deadline=None)
@given(
    verdicts=st.lists(st.booleans(), min_size=1, max_size=80),
    interval=st.integers(1, 5),
    init_exp=st.integers(0, 24),
)
def test_default_policy_decides_as_torchs_amp_update_scale_kernel(verdicts, interval, init_exp):
    """torch._amp_update_scale_ is the whole rule of torch.amp.GradScaler.update()."""
    policy = ScalePolicy(2.0**init_exp, growth_interval=interval, min_scale=2.0**-30)
    scale = torch.full((), 2.0**init_exp)
    tracker = torch.zeros((), dtype=torch.int32)
    for overflow in verdicts:
        torch._amp_update_scale_(
            scale, tracker, torch.full((), float(overflow)), 2.0, 0.5, interval
        )
        policy.record(overflow)
        assert policy.scale == scale.item()
        assert policy.growth_tracker == tracker.item()


def test_hysteresis_skips_without_backing_off_until_the_nth_overflow():
    policy = ScalePolicy(1024.0, hysteresis=3)
    assert [policy.record(True) for _ in range(3)] == [
        Decision.TOLERATED,
        Decision.TOLERATED,
        Decision.BACKED_OFF,
    ]
    assert (policy.scale, policy.skipped, policy.backoffs) == (512.0, 3, 1)


def test_an_overflow_at_the_floor_is_reported_not_applied():
    policy = ScalePolicy(4.0, min_scale=2.0)
    assert policy.record(True) is Decision.BACKED_OFF
    assert policy.record(True) is Decision.AT_MIN
    assert policy.scale == 2.0 and policy.backoffs == 1 and policy.overflow_streak == 2


def test_growth_stops_at_max_scale_and_never_reaches_float32_inf():
    capped = ScalePolicy(8.0, growth_interval=1, max_scale=12.0)
    assert [capped.record(False) for _ in range(2)] == [Decision.GREW, Decision.HELD]
    assert capped.scale == 12.0
    top = ScalePolicy(2.0**127, growth_interval=1)
    assert top.record(False) is Decision.HELD and top.scale == 2.0**127


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"growth_factor": 1.0}, "growth_factor must be > 1.0, got 1.0"),
        ({"backoff_factor": 1.5}, "backoff_factor must be in the open interval (0, 1), got 1.5"),
        ({"growth_interval": 0}, "growth_interval must be an int >= 1, got 0"),
        ({"min_scale": 8.0, "max_scale": 4.0}, "min_scale must be <= max_scale"),
        ({"init_scale": 1e39}, "init_scale must be representable in float32"),
        ({"on_min_scale": "ignore"}, "on_min_scale must be one of"),
    ],
)
def test_a_bad_knob_is_refused_naming_it(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ScalePolicy(**kwargs)


def test_restoring_a_bad_state_leaves_the_policy_as_it_was():
    policy = ScalePolicy(1024.0, growth_interval=4)
    policy.record(False)
    before = policy.state_dict()
    with pytest.raises(ValueError, match="'_growth_tracker' must be < growth_interval"):
        policy.restored({**before, "_growth_tracker": 4})
    assert policy.state_dict() == before
    assert policy.restored(before).state_dict() == before


def test_the_scaler_refuses_a_state_of_a_newer_version_naming_it():
    scaler = DynamicLossScaler("cpu")
    state = {**scaler.state_dict(), "version": 99}
    with pytest.raises(ValueError, match="'version' 99 is newer than this amp-trainer reads"):
        scaler.load_state_dict(state)
    assert scaler.state_dict()["version"] != 99


def test_the_scaler_reads_its_numbers_from_its_policy():
    scaler = DynamicLossScaler("cpu", init_scale=256.0, growth_interval=1)
    scaler.policy.record(False)
    assert scaler.get_scale() == 512.0 and scaler.stats.growths == 1
