"""What a recipe run prints, captured as a user's log file captures it (a pipe, not a terminal).

Three real recipe runs serve the tests here (each test names what it checks):

* the BERT recipe on a local model folder (a BERT masked-LM checkpoint, so the classifier head is
  new and transformers prints its load report) and the user's own CSV, fp16 on the CPU, with
  ``--disable_tqdm true`` and ``--dataloader_pin_memory true`` (the GPU configs' setting);
* the GPT-2 recipe from scratch (its BPE tokenizer trained in a fresh cache), fp16 on the CPU,
  with the same two flags;
* the BERT recipe on a CSV whose text and label columns both have other names.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.repo import REPO_ROOT, subprocess_env
from tests.helpers.tiny_models import save_tiny_bert_mlm

pytestmark = pytest.mark.slow  # recipe subprocesses: start-up dominates

FAST = ["--max_steps", "1", "--max_eval_samples", "8", "--save_strategy", "no"]
QUIET = ["--disable_tqdm", "true", "--dataloader_pin_memory", "true", "--precision", "fp16"]


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def run_recipe(name: str, args: list[str], scratch: Path) -> Run:
    """The recipe as a user runs it, stdout and stderr to pipes; caches private to ``scratch``
    (a from-scratch tokenizer is trained, a CSV is parsed, not read from an earlier run)."""
    env = subprocess_env(
        AMP_TRAINER_CACHE=str(scratch / "amp-cache"), HF_DATASETS_CACHE=str(scratch / "ds-cache")
    )
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "recipes" / f"{name}.py"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=scratch,
    )
    return Run(result.returncode, result.stdout, result.stderr)


def write_csv(path: Path, header: str, rows: list[str]) -> str:
    path.write_text("\n".join([header, *rows]) + "\n", encoding="utf-8")
    return str(path)


def sentences(n: int) -> list[str]:
    from amp_trainer.recipes.data import offline_classification_dataset

    return [s.replace(",", " ") for s in offline_classification_dataset()["train"]["sentence"][:n]]


@pytest.fixture(scope="module")
def bert_run(tmp_path_factory) -> Run:
    """BERT from a masked-LM checkpoint (new classifier head) on the user's CSV."""
    scratch = tmp_path_factory.mktemp("bert")
    texts = sentences(48)
    model_dir = scratch / "bert-mlm"
    save_tiny_bert_mlm(model_dir, texts, model_max_length=128)
    train = write_csv(
        scratch / "reviews.csv", "text,label", [f"{t},{'ab'[i % 2]}" for i, t in enumerate(texts)]
    )
    args = ["--model_name_or_path", str(model_dir), "--train_file", train]
    run = run_recipe(
        "finetune_bert", [*args, "--output_dir", str(scratch / "out"), *FAST, *QUIET], scratch
    )
    assert run.returncode == 0, run.output[-4000:]
    return run


@pytest.fixture(scope="module")
def gpt2_run(tmp_path_factory) -> Run:
    scratch = tmp_path_factory.mktemp("gpt2")
    args = ["--output_dir", str(scratch / "out"), "--max_train_samples", "8", *FAST, *QUIET]
    run = run_recipe("finetune_gpt2", args, scratch)
    assert run.returncode == 0, run.output[-4000:]
    return run


@pytest.fixture(scope="module")
def wrong_columns_run(tmp_path_factory) -> Run:
    scratch = tmp_path_factory.mktemp("columns")
    train = write_csv(scratch / "mine.csv", "review,target", ["a fine film,1", "a dull one,0"] * 4)
    args = ["--train_file", train, "--output_dir", str(scratch / "out"), *FAST]
    return run_recipe("finetune_bert", args, scratch)


# ---- (a) the CPU FP16 notice names no "<string>" ---------------------------------------------


def test_cpu_fp16_notice_is_one_log_line_without_a_string_location(bert_run, gpt2_run):
    for run, recipe in ((bert_run, "finetune_bert"), (gpt2_run, "finetune_gpt2")):
        assert "<string>:" not in run.stderr and "CpuFp16Warning" not in run.stderr
        notices = [line for line in run.stderr.splitlines() if "fp16 on CPU runs" in line]
        assert len(notices) == 1 and f" WARNING {recipe}: fp16 on CPU" in notices[0], notices


# ---- (b) --disable_tqdm true: no progress bar at all -----------------------------------------


def test_disable_tqdm_leaves_no_progress_bar_of_any_library(bert_run, gpt2_run):
    for run in (bert_run, gpt2_run):
        for bar in (
            "Writing model shards",  # save_pretrained: final save and FP16 export
            "Loading weights",  # from_pretrained of the local checkpoint
            "Generating train split",  # datasets reading the CSV
            "Tokenizing",  # datasets.map
            "Chunking",
            "it/s]",
        ):
            assert bar not in run.output, bar
        assert "\r" not in run.output


# ---- (c) noise the recipe itself causes -------------------------------------------------------


def test_pin_memory_on_a_cpu_is_not_warned_about(bert_run, gpt2_run):
    # --dataloader_pin_memory true (the GPU configs') on a CPU: torch warned per DataLoader.
    for run in (bert_run, gpt2_run):
        assert "pin_memory" not in run.output


def test_gpt2_loss_is_not_reported_as_an_unrecognized_loss_type(gpt2_run):
    # GPT2LMHeadModel's class name names no loss: "`loss_type=None` was set in the config".
    assert "loss_type" not in gpt2_run.output


def test_tokenizer_training_writes_no_blank_lines_into_a_pipe(gpt2_run):
    # The tokenizers trainer (tiny-gpt2's BPE, fresh cache) wrote three empty lines on stdout.
    assert "\n\n\n" not in gpt2_run.stdout and not gpt2_run.stdout.startswith("\n")


# ---- (d) no colour codes in a log file --------------------------------------------------------


def test_output_to_a_pipe_holds_no_colour_codes(bert_run, gpt2_run):
    # The load report of the new classifier head is still there (it is information), in plain
    # text: transformers wrapped its title ("... LOAD REPORT") in bold escapes whatever the
    # stream was.
    assert "classifier.weight" in bert_run.stderr
    for run in (bert_run, gpt2_run):
        assert "\x1b[" not in run.output


# ---- (e) every missing column in one run, before any model -------------------------------------


def test_both_missing_columns_are_named_in_one_error(wrong_columns_run):
    run = wrong_columns_run
    assert run.returncode == 2
    (line,) = [entry for entry in run.stderr.splitlines() if "error:" in entry]
    assert "no text column" in line and "column 'label'" in line
    assert "['review', 'target']" in line
    assert "model:" not in run.stderr  # stopped before the model was built


# ---- (f) messages name the flag a user types ----------------------------------------------------


def test_column_errors_name_the_real_flags(wrong_columns_run):
    (line,) = [entry for entry in wrong_columns_run.stderr.splitlines() if "error:" in entry]
    assert "--text_column" in line and "--label_column" in line
    assert "pass text_column" not in line


def test_cpu_fp16_notices_keeps_only_that_notice_and_shows_other_warnings(monkeypatch):
    # In-process: what RecipeRun.parse wraps the flag parsing in.
    import warnings

    from amp_trainer import precision
    from amp_trainer.recipes.output import cpu_fp16_notices

    monkeypatch.setattr(precision, "_warned_cpu_fp16", False)
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with cpu_fp16_notices() as notices:
            precision.resolve_precision("fp16", "cpu")
            warnings.warn("something else", FutureWarning, stacklevel=1)
    assert len(notices) == 1 and notices[0].startswith("fp16 on CPU runs for real")
    assert [(w.category, str(w.message)) for w in shown] == [(FutureWarning, "something else")]
