"""``objective_clip_rate``: the share of tokens a PPO/GRPO clipped objective really clips.

The rule (ratio above ``1 + eps_high`` with a positive advantage, below ``1 - eps`` with a
negative one) is checked against a plain per-token computation on ratios and advantages that
hypothesis draws, then through :func:`measure_precision_mismatch` on a real tiny GPT-2 whose
FP16 rounding moves the ratios, against a direct autocast computation with crafted advantages.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import GPT2Config, GPT2LMHeadModel

from amp_trainer import measure_precision_mismatch
from amp_trainer.mismatch.objective_clip import objective_clipped, token_advantages

EPSILONS = st.floats(min_value=1e-4, max_value=0.9)


def _clipped_by_hand(ratio: float, advantage: float, low: float, high: float) -> bool:
    return (ratio > 1 + high and advantage > 0) or (ratio < 1 - low and advantage < 0)


@settings(max_examples=200, deadline=None)
@given(
    pairs=st.lists(
        st.tuples(
            st.floats(min_value=0.05, max_value=4.0),
            st.sampled_from([-1.5, -0.25, 0.0, 0.25, 1.5]),
        ),
        min_size=1,
        max_size=40,
    ),
    low=EPSILONS,
    high=EPSILONS,
)
def test_the_rule_clips_by_the_sign_of_the_advantage_with_each_sides_epsilon(pairs, low, high):
    # Ratios within rounding of a bound are moved off it: there the float comparison of the
    # ratio and of its log may disagree, which is not what is tested.
    ratios = [
        r if min(abs(r - (1 + high)), abs(r - (1 - low))) > 1e-9 else r + 1e-6 for r, _ in pairs
    ]
    advantages = [a for _, a in pairs]
    log_ratio = torch.tensor([math.log(r) for r in ratios], dtype=torch.float64)
    got = objective_clipped(log_ratio, torch.tensor(advantages, dtype=torch.float64), low, high)

    expected = [_clipped_by_hand(r, a, low, high) for r, a in zip(ratios, advantages)]
    assert got.tolist() == expected


def test_a_token_past_the_bound_its_advantage_does_not_push_towards_is_not_clipped():
    ratio = torch.tensor([1.5, 1.5, 0.5, 0.5, 1.5]).log().double()
    advantage = torch.tensor([1.0, -1.0, -1.0, 1.0, 0.0]).double()
    assert objective_clipped(ratio, advantage, 0.2, 0.28).tolist() == [
        True,  # above 1 + 0.28, pushed up: clipped
        False,  # above, pushed down: the unclipped term is the smaller, gradient kept
        True,
        False,
        False,  # no advantage, no clip
    ]
    # Clip-higher: 1.25 is past 1 + 0.2 but not past 1 + 0.28.
    assert not bool(objective_clipped(torch.tensor([1.25]).log(), torch.ones(1), 0.2, 0.28))


def test_per_token_advantages_are_aligned_to_the_last_positions():
    per_token = torch.tensor([[1.0, -2.0], [3.0, 4.0]])
    aligned = token_advantages(per_token, 5)  # 4 scored positions; the last 2 have advantages
    assert aligned.shape == (2, 4)
    assert torch.isnan(aligned[:, :2]).all()
    assert aligned[:, 2:].tolist() == per_token.double().tolist()
    assert token_advantages(torch.tensor([1.0, -1.0]), 3).tolist() == [[1, 1], [-1, -1]]


@pytest.fixture(scope="module")
def gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=512, n_embd=128, n_layer=4, n_head=4, n_positions=64, bos_token_id=0
    )
    return GPT2LMHeadModel(config).eval()


def test_measure_precision_mismatch_counts_the_objective_share_a_direct_computation_gives(gpt2):
    ids = torch.randint(0, 512, (8, 32), generator=torch.Generator().manual_seed(1))
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 0.0, 1.0])
    low, high = 1e-4, 3e-4  # small enough for FP16 rounding to cross them
    stats = measure_precision_mismatch(
        gpt2,
        ids,
        precisions=("fp16", "bf16"),
        clip_epsilon=low,
        clip_epsilon_high=high,
        advantages=advantages,
    )
    targets = ids[:, 1:].unsqueeze(-1)
    with torch.no_grad():
        ref = gpt2(ids).logits[:, :-1].double().log_softmax(-1).gather(-1, targets).squeeze(-1)
        for precision, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
            with torch.autocast("cpu", dtype=dtype):
                logits = gpt2(ids).logits
            logp = logits[:, :-1].double().log_softmax(-1).gather(-1, targets).squeeze(-1)
            ratio = (logp - ref).exp()
            rows = advantages.unsqueeze(1).expand_as(ratio)
            clipped = ((ratio > 1 + high) & (rows > 0)) | ((ratio < 1 - low) & (rows < 0))
            symmetric = ((ratio > 1 + low) | (ratio < 1 - low)).double().mean()
            got = stats[precision]
            assert got.objective_tokens == ratio.numel() == 8 * 31
            assert got.objective_clip_rate == pytest.approx(
                float(clipped.double().mean()), abs=1 / ratio.numel()
            )
            assert 0 < got.objective_clip_rate < got.clip_rate
            assert got.clip_rate == pytest.approx(float(symmetric), abs=1 / ratio.numel())
    without = measure_precision_mismatch(gpt2, ids, precisions=("fp16",))
    assert math.isnan(without["fp16"].objective_clip_rate) and without["fp16"].objective_tokens == 0
    assert "mismatch/fp16/objective_clip_rate" not in without["fp16"].log_items()
    assert "objective clip rate (eps=0.0001/0.0003)" in str(stats)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(advantages=torch.ones(3)), r"advantages of shape \(3,\) .* give floats of shape"),
        (dict(advantages=torch.ones(2, 8)), r"\(2, T\) with 1 <= T < 8"),
        (dict(advantages=torch.ones(2, dtype=torch.long)), r"\(int64\) do not fit"),
        (dict(advantages=[1.0, 2.0]), "advantages must be a torch.Tensor or None, got list"),
        (dict(clip_epsilon_high=0.0), r"clip_epsilon_high=0\.0 is outside \(0, inf\)"),
    ],
)
def test_bad_advantages_or_epsilon_name_the_value_and_what_is_valid(gpt2, kwargs, message):
    ids = torch.randint(0, 512, (2, 8), generator=torch.Generator().manual_seed(2))
    with pytest.raises((ValueError, TypeError), match=message):
        measure_precision_mismatch(gpt2, ids, precisions=("fp16",), **kwargs)
