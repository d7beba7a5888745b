"""AmpAccelerator next to stock Accelerate: checkpoints both ways, several optimizers, names.

"Stock" is ``accelerate.Accelerator`` itself. Its fp16 on a CPU runs without a scaler; where a
test needs stock fp16 *with* torch's ``GradScaler`` (what Accelerate builds on a GPU), the
scaler is put in place exactly as Accelerate's own constructor does there.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import ProjectConfiguration
from torch import nn

from amp_trainer import precision
from amp_trainer.accelerate_hooks import AmpAccelerator
from tests.helpers.training import reset_accelerate_state


@pytest.fixture(autouse=True)
def quiet_cpu_fp16_warning(monkeypatch):
    monkeypatch.setattr(precision, "_warned_cpu_fp16", True)


# A gradient of 1 times 65536 is already inf in FP16: these tests overflow only by hand.
SMALL_SCALE = {"init_scale": 1024.0}


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _prepared(accelerator: Accelerator, seed: int = 0):
    model = _net(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=10)
    return accelerator.prepare(model, optimizer, scheduler)


def _train(accelerator, model, optimizer, scheduler, steps: int = 3, poison_at: int = -1) -> None:
    for step in range(steps):
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(step))
        with accelerator.autocast():
            loss = model(x).float().pow(2).mean()
        accelerator.backward(loss)
        if step == poison_at:
            model[2].weight.grad[0, 0] = math.inf
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


def _stock_fp16_with_torch_scaler(**scaler_kwargs) -> Accelerator:
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    # What Accelerator.__init__ does for fp16 on a GPU (on a CPU it leaves both unset).
    accelerator.native_amp = True
    accelerator.scaler = torch.amp.GradScaler("cpu", **scaler_kwargs)
    return accelerator


def _same_params(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


# --------------------------------------------------------------------------------------------
# stock checkpoints -> AmpAccelerator
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_amp_accelerator_resumes_a_stock_checkpoint_written_without_scaler_pt(
    mixed_precision, tmp_path
):
    stock = Accelerator(mixed_precision=mixed_precision, cpu=True)
    trained = _prepared(stock)
    _train(stock, *trained)
    stock.save_state(tmp_path)
    assert not (tmp_path / "scaler.pt").exists()
    reset_accelerate_state()

    ours = AmpAccelerator(mixed_precision=mixed_precision, cpu=True)
    resumed = _prepared(ours, seed=1)
    ours.load_state(tmp_path)
    assert _same_params(trained[0], resumed[0])
    assert resumed[2].get_last_lr() == trained[2].get_last_lr()


def test_amp_accelerator_fp16_resumes_a_stock_checkpoint_holding_torchs_scaler_pt(tmp_path):
    stock = _stock_fp16_with_torch_scaler(init_scale=1024.0, growth_interval=5)
    trained = _prepared(stock)
    _train(stock, *trained, steps=4, poison_at=1)
    stock.save_state(tmp_path)
    torch_state = stock.scaler.state_dict()
    reset_accelerate_state()

    ours = AmpAccelerator(mixed_precision="fp16", cpu=True)
    resumed = _prepared(ours, seed=1)
    ours.load_state(tmp_path)
    assert ours.loss_scaler.get_scale() == torch_state["scale"] == 512.0
    assert ours.loss_scaler.state_dict()["_growth_tracker"] == torch_state["_growth_tracker"]
    assert ours.loss_scaler.get_growth_interval() == 5
    assert _same_params(trained[0], resumed[0])


def test_amp_accelerator_fp16_resuming_a_checkpoint_without_scaler_state_warns_once(
    tmp_path, caplog
):
    stock = Accelerator(mixed_precision="no", cpu=True)
    _train(stock, *_prepared(stock))
    stock.save_state(tmp_path)
    reset_accelerate_state()

    ours = AmpAccelerator(mixed_precision="fp16", cpu=True)
    _prepared(ours, seed=1)
    with caplog.at_level(logging.WARNING, logger="amp_trainer"):
        ours.load_state(tmp_path)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "fresh loss scaler at scale 65536" in warnings[0].getMessage()
    assert ours.loss_scaler.get_scale() == 65536.0 and ours.loss_scaler.stats.steps == 0


def test_an_empty_scaler_pt_from_an_earlier_bf16_run_counts_as_no_scaler_state(tmp_path, caplog):
    stock = Accelerator(mixed_precision="no", cpu=True)
    _train(stock, *_prepared(stock))
    stock.save_state(tmp_path)
    torch.save({}, tmp_path / "scaler.pt")  # what AmpAccelerator wrote in bf16/fp32 before
    reset_accelerate_state()

    ours = AmpAccelerator(mixed_precision="fp16", cpu=True)
    _prepared(ours, seed=1)
    with caplog.at_level(logging.WARNING, logger="amp_trainer"):
        ours.load_state(tmp_path)
    assert "fresh loss scaler" in caplog.text and ours.loss_scaler.get_scale() == 65536.0


def test_automatic_checkpoint_naming_finds_the_latest_stock_checkpoint_without_scaler_pt(tmp_path):
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
    stock = Accelerator(mixed_precision="no", cpu=True, project_config=config)
    trained = _prepared(stock)
    for _ in range(2):
        _train(stock, *trained, steps=1)
        stock.save_state()
    reset_accelerate_state()

    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
    ours = AmpAccelerator(mixed_precision="fp16", cpu=True, project_config=config)
    resumed = _prepared(ours, seed=1)
    ours.load_state()
    assert _same_params(trained[0], resumed[0])


def test_an_fp16_checkpoint_resumed_in_bf16_drops_the_scaler_state_and_says_so(tmp_path, caplog):
    ours = AmpAccelerator(mixed_precision="fp16", cpu=True)
    _train(ours, *_prepared(ours))
    ours.save_state(tmp_path)
    reset_accelerate_state()

    bf16 = AmpAccelerator(mixed_precision="bf16", cpu=True)
    _prepared(bf16, seed=1)
    with caplog.at_level(logging.WARNING, logger="amp_trainer"):
        bf16.load_state(tmp_path)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "dropped" in warnings[0] and "bf16" in warnings[0]


# --------------------------------------------------------------------------------------------
# AmpAccelerator checkpoints -> stock Accelerate and torch's GradScaler
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_amp_accelerator_writes_no_empty_scaler_pt_and_stock_accelerate_resumes_it(
    mixed_precision, tmp_path
):
    ours = AmpAccelerator(mixed_precision=mixed_precision, cpu=True)
    trained = _prepared(ours)
    _train(ours, *trained)
    ours.save_state(tmp_path)
    assert not (tmp_path / "scaler.pt").exists()
    reset_accelerate_state()

    stock = Accelerator(mixed_precision=mixed_precision, cpu=True)
    resumed = _prepared(stock, seed=1)
    stock.load_state(tmp_path)
    assert _same_params(trained[0], resumed[0])


def test_amp_accelerator_fp16_checkpoint_loads_in_stock_accelerate_with_torchs_grad_scaler(
    tmp_path,
):
    ours = AmpAccelerator(mixed_precision="fp16", cpu=True, loss_scaler={"init_scale": 2.0**40})
    trained = _prepared(ours)
    _train(ours, *trained, steps=4, poison_at=2)
    ours.save_state(tmp_path)
    reset_accelerate_state()

    written = ours.loss_scaler.state_dict()
    assert written["scale"] < 2.0**40  # (the poisoned step, and FP16 itself at 2**40, backed off)

    plain = torch.amp.GradScaler("cpu")
    plain.load_state_dict(torch.load(tmp_path / "scaler.pt", weights_only=True))
    assert plain.get_scale() == written["scale"]

    stock = _stock_fp16_with_torch_scaler()
    resumed = _prepared(stock, seed=1)
    stock.load_state(tmp_path)
    assert stock.scaler.get_scale() == written["scale"]
    assert stock.scaler.state_dict()["_growth_tracker"] == written["_growth_tracker"]
    assert _same_params(trained[0], resumed[0])


# --------------------------------------------------------------------------------------------
# several optimizers: a GAN loop, ours vs stock Accelerate with torch's scaler
# --------------------------------------------------------------------------------------------
def _gan_run(accelerator: Accelerator, make_opt=None, max_norm: float = 1e-3, poison_at: int = 2):
    make_opt = make_opt or (lambda params: torch.optim.SGD(params, lr=0.5))
    torch.manual_seed(0)
    gen, disc = nn.Linear(3, 4), nn.Linear(4, 1)
    g_opt, d_opt = make_opt(gen.parameters()), make_opt(disc.parameters())
    gen, disc, g_opt, d_opt = accelerator.prepare(gen, disc, g_opt, d_opt)
    trace = []
    for it in range(4):
        g = torch.Generator().manual_seed(it)
        real, z = torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)
        d_opt.zero_grad()
        d_loss = disc(gen(z).detach()).float().mean() - disc(real).float().mean()
        accelerator.backward(d_loss)
        accelerator.clip_grad_norm_(disc.parameters(), max_norm)
        d_opt.step()
        g_opt.zero_grad()
        g_before = [p.detach().clone() for p in gen.parameters()]
        accelerator.backward(-disc(gen(z)).float().mean())  # also adds to D's gradients
        if it == poison_at:
            disc.weight.grad[0, 0] = math.inf  # D overflows in G's backward; G's grads are fine
        g_norm = accelerator.clip_grad_norm_(gen.parameters(), max_norm)
        g_opt.step()
        moved = torch.cat([(p - b).flatten() for p, b in zip(gen.parameters(), g_before)])
        trace.append(
            (
                float(g_norm),
                float(moved.detach().norm()),
                accelerator.scaler.get_scale(),
                [p.detach().clone() for p in (*gen.parameters(), *disc.parameters())],
            )
        )
    return trace


@pytest.mark.parametrize(
    "make_opt",
    [None, lambda params: torch.optim.AdamW(params, lr=1e-2, fused=True)],
    ids=["sgd", "adamw_fused"],
)
def test_gan_loop_clips_and_steps_the_clean_generator_while_the_discriminator_overflows(
    make_opt,
):
    stock = _gan_run(_stock_fp16_with_torch_scaler(init_scale=1024.0), make_opt)
    reset_accelerate_state()
    ours = _gan_run(
        AmpAccelerator(mixed_precision="fp16", cpu=True, loss_scaler={"init_scale": 1024.0}),
        make_opt,
    )
    g_norm, g_moved, _, _ = ours[2]
    assert math.isfinite(g_norm) and g_moved > 0  # G clipped (a finite norm) and stepped
    if make_opt is None:  # SGD: the step is lr x the clipped gradient, at most lr x max_norm
        assert g_moved <= 0.5 * 1e-3 * (1 + 1e-5)
    for it, (theirs, mine) in enumerate(zip(stock, ours)):
        assert mine[0] == pytest.approx(theirs[0]), it
        assert mine[2] == theirs[2], it  # backed off once, on the same iteration
        for p, q in zip(mine[3], theirs[3]):
            assert torch.equal(p, q), it
    assert [t[2] for t in ours] == [1024.0, 1024.0, 512.0, 512.0]


def test_clip_grad_norm_finds_the_optimizer_from_the_parameters_it_is_given():
    accelerator = AmpAccelerator(mixed_precision="fp16", cpu=True, loss_scaler=SMALL_SCALE)
    a, b = nn.Linear(2, 1), nn.Linear(2, 1)
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    a, b, opt_a, opt_b = accelerator.prepare(a, b, opt_a, opt_b)
    accelerator.backward(a(torch.ones(1, 2)).sum() + b(torch.ones(1, 2)).sum())
    b.weight.grad[0, 0] = math.nan
    assert math.isfinite(accelerator.clip_grad_norm_(a.parameters(), 1.0).item())
    assert accelerator.clip_grad_norm_(b.parameters(), 1.0).item() == math.inf
    opt_a.step()
    opt_b.step()
    assert not opt_a.step_was_skipped and opt_b.step_was_skipped
    assert accelerator.loss_scaler.get_scale() == 512.0  # backed off once, not once per step


def test_two_optimizers_clipped_then_stepped_one_at_a_time_are_unscaled_once():
    """Accelerate calls update() after each optimizer's step; the second must not unscale again."""
    torch.manual_seed(0)
    a, b = nn.Linear(2, 1), nn.Linear(2, 1)
    reference = [p.detach().clone() for p in b.parameters()]
    x = torch.ones(1, 2)
    b(x).sum().backward()
    expected = [r - 0.1 * q.grad for r, q in zip(reference, b.parameters())]
    b.zero_grad()
    accelerator = AmpAccelerator(mixed_precision="fp16", cpu=True, loss_scaler=SMALL_SCALE)
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    a, b, opt_a, opt_b = accelerator.prepare(a, b, opt_a, opt_b)
    accelerator.backward(a(x).sum() + b(x).sum())
    accelerator.clip_grad_norm_(a.parameters(), 100.0)
    accelerator.clip_grad_norm_(b.parameters(), 100.0)
    opt_a.step()
    opt_b.step()
    for got, want in zip(b.parameters(), expected):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    assert (
        accelerator.loss_scaler.stats.steps == 1 and accelerator.loss_scaler.get_scale() == 1024.0
    )


# --------------------------------------------------------------------------------------------
# names in a plain loop
# --------------------------------------------------------------------------------------------
def test_prepare_watches_the_model_so_a_plain_loop_names_overflowing_parameters():
    accelerator = AmpAccelerator(mixed_precision="fp16", cpu=True, loss_scaler=SMALL_SCALE)
    model, optimizer = accelerator.prepare(_net(), None)
    optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    accelerator.backward(model(torch.ones(2, 4)).float().sum())
    model[2].weight.grad[0, 0] = math.inf
    optimizer.step()
    assert accelerator.loss_scaler.stats.last_overflow_params == ("2.weight",)


def test_a_second_prepared_model_is_named_with_accelerates_model_1_prefix():
    accelerator = AmpAccelerator(mixed_precision="fp16", cpu=True, loss_scaler=SMALL_SCALE)
    first, second = accelerator.prepare(_net(), nn.Linear(2, 2))
    optimizer = accelerator.prepare(torch.optim.SGD(second.parameters(), lr=0.1))
    accelerator.backward(second(torch.ones(1, 2)).sum() + first(torch.ones(1, 4)).sum())
    second.bias.grad[0] = math.nan
    optimizer.step()
    assert accelerator.loss_scaler.stats.last_overflow_params == ("model_1.bias",)


# --------------------------------------------------------------------------------------------
# a state reset under a live accelerator: Accelerate's own message, as stock gives it
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [Accelerator, AmpAccelerator], ids=["stock", "amp"])
def test_prepare_after_a_state_reset_says_what_accelerate_says(cls):
    # Accelerate's own test_script.py::test_reinstantiated_state (run by its test_cpu), as is.
    reset_accelerate_state()
    accelerator = cls(cpu=True)
    AcceleratorState._reset_state()  # what the user did: the accelerator's state is gone
    with pytest.raises(AttributeError) as caught:
        accelerator.prepare(nn.Linear(1, 1))
    assert "`AcceleratorState` object has no attribute" in str(caught.value.args[0])
    assert "This happens if `AcceleratorState._reset_state()`" in str(caught.value.args[0])
    reset_accelerate_state()


# --------------------------------------------------------------------------------------------
# load_state: a damaged or unsafe file is one line naming it, and runs nothing
# --------------------------------------------------------------------------------------------
class _WritesMarker:
    def __init__(self, marker) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('ran')",))


@pytest.mark.parametrize(
    ("name", "damage"),
    [
        ("optimizer.bin", "truncated"),
        ("scheduler.bin", "pickled-object"),
        ("random_states_0.pkl", "pickled-object"),
        ("scaler.pt", "garbage"),
    ],
)
def test_amp_accelerator_load_state_names_a_damaged_file_and_runs_nothing(tmp_path, name, damage):
    saved = AmpAccelerator(mixed_precision="fp16", cpu=True, loss_scaler=SMALL_SCALE)
    _train(saved, *_prepared(saved))
    saved.save_state(tmp_path / "ckpt")
    reset_accelerate_state()
    path = tmp_path / "ckpt" / name
    marker = tmp_path / "payload-ran"
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif damage == "pickled-object":
        torch.save({"state": _WritesMarker(marker)}, path)
    else:
        path.write_bytes(b"\x00garbage" * 20)
    resumed = AmpAccelerator(mixed_precision="fp16", cpu=True, loss_scaler=SMALL_SCALE)
    _prepared(resumed)
    with pytest.raises(ValueError) as caught:
        resumed.load_state(tmp_path / "ckpt")
    message = str(caught.value)
    assert message.startswith(f"{path} is unreadable (") and "\n" not in message
    assert "weights_only" not in message and "arbitrary code" not in message
    assert not marker.exists()
