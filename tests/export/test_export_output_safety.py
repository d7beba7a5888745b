"""FP16 export never loses data: output-path checks, staging leftovers, disk full, permissions.

Faults are injected for real: a small tmpfs (when the tests run as root, which can mount one),
``OSError(ENOSPC)`` raised by the real write call, ``kill -9`` of an exporting subprocess.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from amp_trainer.cli import main
from amp_trainer.export import export_fp16
from tests.helpers.disks import tiny_disk
from tests.helpers.repo import subprocess_env
from tests.helpers.tiny_models import make_tiny_bert, make_tiny_gpt2


@pytest.fixture
def source(tmp_path) -> Path:
    """A run folder: saved FP32 model plus the things a run leaves (metrics, a checkpoint)."""
    folder = tmp_path / "runs" / "bert"
    make_tiny_bert().save_pretrained(folder)
    (folder / "metrics.json").write_text('{"eval": {"accuracy": 0.9}}')
    (folder / "checkpoint-24").mkdir()
    (folder / "checkpoint-24" / "trainer_state.json").write_text("{}")
    return folder


def error_line(capsys) -> str:
    """The one error line on stderr (progress bars of the test's own saves aside)."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "amp-trainer export: error:" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


@pytest.fixture
def small_disk(tmp_path):
    """A 256 KiB file system: fits the tiny GPT-2's FP16 safetensors, not much more."""
    unmount = tiny_disk(tmp_path / "disk", "256k")
    yield tmp_path / "disk"
    unmount()


# ---- output path: never the source, never a folder that is not an earlier export -------------
def test_exporting_a_folder_onto_itself_is_refused_and_leaves_it_untouched(source):
    before = snapshot(source)
    with pytest.raises(ValueError, match="is the source model folder"):
        export_fp16(source, source, overwrite=True)
    assert snapshot(source) == before


def test_exporting_into_the_parent_of_the_source_is_refused_and_siblings_survive(source):
    sibling = source.parent / "gpt2"
    sibling.mkdir()
    (sibling / "metrics.json").write_text("{}")
    with pytest.raises(ValueError, match="contains the source model folder"):
        export_fp16(source, source.parent, overwrite=True)
    assert (sibling / "metrics.json").exists() and (source / "model.safetensors").exists()


def test_exporting_into_a_folder_inside_the_source_is_refused(source):
    with pytest.raises(ValueError, match="lies inside the source model folder"):
        export_fp16(source, source / "fp16")
    assert not (source / "fp16").exists()


def test_cli_export_onto_its_own_model_folder_is_a_one_line_usage_error(source, capsys):
    before = snapshot(source)
    argv = ["export", "--model", str(source), "--output", str(source), "--overwrite"]
    assert main(argv) == 2
    assert "is the source model folder" in error_line(capsys)
    assert snapshot(source) == before


def test_cli_export_onto_its_own_model_folder_does_not_suggest_overwrite(source, capsys):
    assert main(["export", "--model", str(source), "--output", str(source)]) == 2
    line = error_line(capsys)
    assert "is the source model folder" in line and "--overwrite" not in line


def test_overwrite_refuses_a_folder_that_is_not_an_earlier_export(source, tmp_path):
    before = snapshot(source)
    with pytest.raises(FileExistsError, match="not an earlier FP16 export"):
        export_fp16(make_tiny_gpt2(), source, overwrite=True)
    assert snapshot(source) == before


def test_overwrite_refuses_an_earlier_export_that_holds_files_it_did_not_write(tmp_path):
    out = tmp_path / "fp16"
    export_fp16(make_tiny_gpt2(), out)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"did not write \(notes.txt\)"):
        export_fp16(make_tiny_gpt2(), out, overwrite=True)
    assert (out / "notes.txt").read_text() == "mine"


def test_overwrite_replaces_an_earlier_export(tmp_path):
    out = tmp_path / "fp16"
    export_fp16(make_tiny_gpt2(seed=0), out)
    first = (out / "model.safetensors").read_bytes()
    report = export_fp16(make_tiny_gpt2(seed=1), out, overwrite=True)
    assert report.written and (out / "model.safetensors").read_bytes() != first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fp16"]  # nothing hidden left over


def test_export_folder_gets_the_permissions_of_any_new_folder(tmp_path):
    old = os.umask(0o022)
    try:
        export_fp16(make_tiny_gpt2(), tmp_path / "fp16")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "fp16").stat().st_mode) == 0o755


# ---- killed exports ---------------------------------------------------------------------------
_KILLED_EXPORT = """
import os, signal
from tests.helpers.tiny_models import make_tiny_gpt2
import amp_trainer.export as export

real_replace = os.replace  # the staging transaction (amp_trainer.export.staging) renames with it
out = {out!r}

def replace_then_die(src, dst):
    if {mode!r} == "before_install" and str(dst) == out:
        os.kill(os.getpid(), signal.SIGKILL)  # kill -9, staging complete, not yet in place
    real_replace(src, dst)
    if {mode!r} == "mid_replace" and str(src) == out:
        os.kill(os.getpid(), signal.SIGKILL)  # kill -9, old export moved aside, new not in place

os.replace = replace_then_die
export.export_fp16(make_tiny_gpt2(seed=1), out, overwrite=True)
"""


def run_killed_export(out: Path, mode: str) -> None:
    """Run an export in a subprocess that SIGKILLs itself at the rename ``mode`` names."""
    script = _KILLED_EXPORT.format(out=str(out), mode=mode)
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]


@pytest.mark.slow  # a subprocess: start-up dominates
def test_a_killed_exports_staging_folder_is_removed_by_the_next_export_which_says_so(
    tmp_path, caplog
):
    out = tmp_path / "fp16"
    run_killed_export(out, "before_install")
    leftovers = [p.name for p in tmp_path.iterdir()]
    assert len(leftovers) == 1 and leftovers[0].startswith(".fp16.tmp-")

    report = export_fp16(make_tiny_gpt2(), out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fp16"]
    assert any("left behind by an interrupted export" in note for note in report.notes)
    assert "interrupted export" in caplog.text


@pytest.mark.slow  # a subprocess: start-up dominates
def test_an_export_killed_between_its_two_renames_gets_the_previous_export_back(tmp_path):
    out = tmp_path / "fp16"
    export_fp16(make_tiny_gpt2(seed=0), out)
    first = (out / "model.safetensors").read_bytes()
    run_killed_export(out, "mid_replace")
    assert not out.exists()

    with pytest.raises(FileExistsError):  # the restored export is not replaced silently
        export_fp16(make_tiny_gpt2(seed=2), out)
    assert (out / "model.safetensors").read_bytes() == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fp16"]


# ---- disk full --------------------------------------------------------------------------------
def test_disk_full_while_writing_weights_is_one_oserror_and_leaves_nothing(tmp_path, monkeypatch):
    import transformers.modeling_utils

    def full_disk(state_dict, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 100)  # the part that fitted
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full_disk)
    with pytest.raises(OSError, match="no space left on device writing the FP16 export") as info:
        export_fp16(make_tiny_gpt2(), tmp_path / "fp16")
    assert info.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []


def test_too_little_free_space_is_refused_before_anything_is_written(tmp_path):
    unmount = tiny_disk(tmp_path / "disk", "16k")
    try:
        with pytest.raises(OSError, match="needs about") as info:
            export_fp16(make_tiny_gpt2(vocab_size=2000), tmp_path / "disk" / "fp16")
        assert info.value.errno == errno.ENOSPC
        assert list((tmp_path / "disk").iterdir()) == []
    finally:
        unmount()


_FULL_DISK_EXPORT = """
from tests.helpers.tiny_models import make_tiny_gpt2
import amp_trainer.export as export
import amp_trainer.export.staging as staging

staging.check_free_space = lambda folder, needed: None  # let the write itself hit the full disk
export.export_fp16(make_tiny_gpt2(vocab_size=1500), {out!r}, formats={formats!r})
"""


@pytest.mark.slow  # a subprocess: start-up dominates
@pytest.mark.parametrize("formats", [("torchscript",), ("onnx",)])
def test_disk_full_during_an_extra_format_raises_instead_of_aborting(small_disk, formats):
    script = _FULL_DISK_EXPORT.format(out=str(small_disk / "fp16"), formats=formats)
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 1, result.stderr[-3000:]  # not 134 (abort in C++)
    assert "OSError: [Errno 28] no space left on device writing the FP16 export" in result.stderr
    assert list(small_disk.iterdir()) == []


def test_cli_disk_full_is_a_one_line_runtime_error_with_exit_1(tmp_path, small_disk, capsys):
    model = tmp_path / "model"
    make_tiny_gpt2(vocab_size=5000).save_pretrained(model)  # ~370 KiB of FP16 weights
    assert main(["export", "--model", str(model), "--output", str(small_disk / "fp16")]) == 1
    assert "no space left on device" in error_line(capsys)
    assert list(small_disk.iterdir()) == []


def test_cli_export_of_a_truncated_safetensors_file_is_a_one_line_error(tmp_path, capsys):
    model = tmp_path / "model"
    make_tiny_gpt2().save_pretrained(model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert main(["export", "--model", str(model), "--output", str(tmp_path / "fp16")]) == 2
    assert "cannot load a model from" in error_line(capsys)
    assert not (tmp_path / "fp16").exists()


def test_report_lists_every_file_it_wrote_so_overwrite_can_recognise_it(tmp_path):
    out = tmp_path / "fp16"
    export_fp16(make_tiny_gpt2(), out, formats=("torchscript",))
    files = json.loads((out / "report.json").read_text())["files"]
    assert sorted(files) == sorted(p.name for p in out.iterdir())


def test_cli_debug_prints_the_traceback_of_an_error(tmp_path, capsys):
    model = tmp_path / "model"
    make_tiny_gpt2().save_pretrained(model)
    (model / "model.safetensors").write_bytes(b"garbage")
    argv = ["--debug", "export", "--model", str(model), "--output", str(tmp_path / "fp16")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "cannot load a model from" in err


# ---- names only the exporter makes ------------------------------------------------------------
@pytest.mark.parametrize("name", [".fp16.old-backup", ".fp16.tmp-mine", ".fp16.old-123-notours"])
def test_overwrite_leaves_a_users_own_hidden_folder_beside_the_target_alone(tmp_path, name):
    out = tmp_path / "fp16"
    export_fp16(make_tiny_gpt2(seed=0), out)
    mine = tmp_path / name
    mine.mkdir()
    (mine / "model.safetensors").write_bytes(b"my own backup")
    report = export_fp16(make_tiny_gpt2(seed=1), out, overwrite=True)
    assert report.written and (mine / "model.safetensors").read_bytes() == b"my own backup"
    assert not any("interrupted export" in note for note in report.notes)


def test_a_folder_named_like_a_moved_aside_export_but_holding_other_files_is_not_restored(
    tmp_path,
):
    look_alike = tmp_path / f".fp16.old-{2**22 + 7}-0123abcd"  # no such PID: a dead writer
    look_alike.mkdir()
    (look_alike / "notes.txt").write_text("mine")
    export_fp16(make_tiny_gpt2(), tmp_path / "fp16")
    assert (look_alike / "notes.txt").read_text() == "mine"


# ---- digests: report.json records every file's sha256, load_fp16_export checks them -----------
def test_report_records_the_sha256_of_every_file_it_wrote_but_itself(tmp_path):
    import hashlib

    out = tmp_path / "fp16"
    export_fp16(make_tiny_gpt2(), out, formats=("pt2",))
    recorded = json.loads((out / "report.json").read_text())["sha256"]
    on_disk = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in out.iterdir()}
    del on_disk["report.json"]
    assert recorded == on_disk and "model.safetensors" in recorded and "model.pt2" in recorded


def test_load_fp16_export_refuses_a_weights_file_with_one_flipped_bit_naming_it(tmp_path):
    from amp_trainer.export import load_fp16_export

    out = tmp_path / "fp16"
    export_fp16(make_tiny_gpt2(), out)
    weights = out / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit of one weight: a valid file, a different model
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="does not match the sha256") as info:
        load_fp16_export(out)
    assert str(info.value).startswith(f"{weights} does not match") and "\n" not in str(info.value)
    model = load_fp16_export(out, verify=False)  # the way to load it as it is, said in the line
    assert model is not None


def test_load_fp16_export_refuses_a_missing_file_the_export_wrote(tmp_path):
    from amp_trainer.export import load_fp16_export

    out = tmp_path / "fp16"
    export_fp16(make_tiny_gpt2(), out)
    (out / "generation_config.json").unlink()
    with pytest.raises(ValueError, match=r"generation_config.json is missing"):
        load_fp16_export(out)


def test_load_fp16_export_of_an_untouched_export_checks_and_loads(tmp_path, caplog):
    from amp_trainer.export import load_fp16_export

    out = tmp_path / "fp16"
    export_fp16(make_tiny_gpt2(), out, formats=("torchscript",))
    (out / "model.torchscript.pt").write_bytes(b"not read by load_fp16_export")
    model = load_fp16_export(out)
    assert next(model.parameters()).dtype == torch.float16


def _changed_weights(out: Path) -> None:
    """One bit of one weight flipped in ``out``'s model.safetensors: a valid, different model."""
    weights = out / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))


def _drop_report(out: Path) -> None:
    (out / "report.json").unlink()


def _drop_sha256_block(out: Path) -> None:
    report = json.loads((out / "report.json").read_text())
    del report["sha256"]
    (out / "report.json").write_text(json.dumps(report))


def _drop_the_models_entry(out: Path) -> None:
    report = json.loads((out / "report.json").read_text())
    del report["sha256"]["model.safetensors"]
    (out / "report.json").write_text(json.dumps(report))


@pytest.mark.parametrize(
    "unguard, expected",
    [
        (_drop_report, "report.json is missing: config.json, generation_config.json, "
         "model.safetensors not checked against the digests the export recorded"),
        (_drop_sha256_block, "report.json records no sha256 digests: config.json, "
         "generation_config.json, model.safetensors not checked"),
        (_drop_the_models_entry, "report.json records no sha256 for model.safetensors: it is "
         "not checked"),
    ],
    ids=["report-deleted", "sha256-block-removed", "entry-removed"],
)  # fmt: skip
def test_a_changed_weights_file_with_nothing_to_check_it_against_is_one_warning_naming_it(
    tmp_path, caplog, unguard, expected
):
    from amp_trainer.export import load_fp16_export

    out = tmp_path / "fp16"
    export_fp16(make_tiny_gpt2(), out)
    _changed_weights(out)
    unguard(out)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="amp_trainer.export"):
        load_fp16_export(out)  # loads: there is nothing to refuse it with
    said = [r for r in caplog.records if r.name.startswith("amp_trainer.export")]
    warnings = [r.getMessage() for r in said if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and expected in warnings[0]
    assert warnings[0].startswith(str(out / "report.json"))


def test_a_rewritten_digest_is_not_caught_and_a_kept_report_digest_pins_the_export(tmp_path):
    # What the digests guard is accidental damage. Whoever changes the weights and rewrites their
    # digest in report.json too is not caught by load_fp16_export; comparing report.json with the
    # digest of it kept when the export was trusted is (docs/guides/export.md).
    import hashlib

    from amp_trainer.export import load_fp16_export

    out = tmp_path / "fp16"
    export_fp16(make_tiny_gpt2(), out)
    trusted = hashlib.sha256((out / "report.json").read_bytes()).hexdigest()
    _changed_weights(out)
    report = json.loads((out / "report.json").read_text())
    report["sha256"]["model.safetensors"] = hashlib.sha256(
        (out / "model.safetensors").read_bytes()
    ).hexdigest()
    (out / "report.json").write_text(json.dumps(report))
    load_fp16_export(out)  # the folder is consistent with itself: it loads
    assert hashlib.sha256((out / "report.json").read_bytes()).hexdigest() != trusted


# ---- --report PATH: the guards --output has ---------------------------------------------------
def test_cli_report_into_the_source_model_folder_is_refused_and_config_json_survives(
    source, tmp_path, capsys
):
    before = snapshot(source)
    argv = ["export", "--model", str(source), "--output", str(tmp_path / "fp16")]
    assert main([*argv, "--report", str(source / "config.json"), "--overwrite"]) == 2
    line = error_line(capsys)
    assert f"--report {source / 'config.json'}" in line and "inside the source model" in line
    assert snapshot(source) == before and not (tmp_path / "fp16").exists()


def test_cli_report_inside_the_output_folder_is_refused(source, tmp_path, capsys):
    out = tmp_path / "fp16"
    argv = ["export", "--model", str(source), "--output", str(out)]
    assert main([*argv, "--report", str(out / "extra.json")]) == 2
    assert "inside the output folder" in error_line(capsys)
    assert not out.exists()


def test_cli_report_over_a_users_file_is_refused_even_with_overwrite(source, tmp_path, capsys):
    mine = tmp_path / "notes.json"
    mine.write_text('{"mine": true}')
    argv = ["export", "--model", str(source), "--output", str(tmp_path / "fp16")]
    assert main([*argv, "--report", str(mine)]) == 2
    assert "already exists; pass --overwrite" in error_line(capsys)
    assert main([*argv, "--report", str(mine), "--overwrite"]) == 2
    assert "is not a report an earlier export wrote" in error_line(capsys)
    assert mine.read_text() == '{"mine": true}' and not (tmp_path / "fp16").exists()


def test_cli_report_replaces_an_earlier_report_with_overwrite(source, tmp_path, capsys):
    report = tmp_path / "fp16-report.json"
    argv = ["export", "--model", str(source), "--output", str(tmp_path / "fp16")]
    assert main([*argv, "--report", str(report)]) == 0
    first = json.loads(report.read_text())
    assert main([*argv, "--report", str(report), "--overwrite", "--texts", "a b c"]) == 2
    capsys.readouterr()  # texts without a tokenizer: refused, the report untouched
    assert json.loads(report.read_text()) == first
    assert main([*argv, "--report", str(report), "--overwrite", "--min-top1-agreement", "0.9"]) == 0
    assert json.loads(report.read_text())["thresholds"]["min_top1_agreement"] == 0.9
