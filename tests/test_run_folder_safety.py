"""The run folder and the export folder: what --resume, --overwrite and --export-dir may touch.

Every refusal is one line on stderr and status 2, and leaves the user's files as they were:
a resume on changed data, an export folder in or around the run folder, an --overwrite over a
symbolic link or over files fastpt did not write, a crafted config.json or last.pt.
"""

from __future__ import annotations

import csv
import fcntl
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from fastpt.cli import run_folder
from fastpt.cli.shell import EXIT_BAD_INPUT
from fastpt.files import checkpoint
from fastpt.cluster import distributed
from train import main


def flags(imdb_dir, cache_dir, out, *extra):
    return ["--model", "tiny", "--data-dir", str(imdb_dir), "--cache-dir", str(cache_dir), "--max-length", "32",
            "--batch-size", "8", "--train-size", "16", "--epochs", "2", "--no-progress", "--out", str(out), *extra]


@pytest.fixture(scope="module")
def stopped_run(imdb_dir, cache_dir, tmp_path_factory) -> Path:
    """A finished run that --resume auto with a larger --max-steps continues: last.pt at step 2, tb/, results."""
    out = tmp_path_factory.mktemp("stopped") / "run"
    assert main(flags(imdb_dir, cache_dir, out, "--max-steps", "2", "--save-every", "1")) == 0
    return out


def snapshot(folder: Path) -> dict:
    """Every path under folder (links not followed) with its bytes, or its link target."""
    return {str(p.relative_to(folder)): os.readlink(p) if p.is_symlink() else p.read_bytes() if p.is_file() else None
            for p in sorted(folder.rglob("*"))}


def refused(args, capfd) -> str:
    """Runs the command, expects status 2 and one line on stderr; returns the line."""
    capfd.readouterr()
    assert main(args) == EXIT_BAD_INPUT
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    print(err[0])  # shown with the test's report (pytest -rA)
    return err[0]


# ---------------------------------------------------------------------------- 1. resume on changed data

def write_table(path: Path, n: int, labels: tuple) -> Path:
    with open(path, "w", newline="") as f:
        table = csv.writer(f)
        table.writerow(["text", "label"])
        for i in range(n):
            label = labels[i % len(labels)]
            table.writerow([f"the lamp and the box {label} {label} number {i}", label])
    return path


@pytest.mark.parametrize("rows, labels", [(56, ("bad", "good")), (42, ("bad", "good", "meh"))],
                         ids=["more rows", "a new class"])
def test_resume_on_changed_data_at_the_same_path_is_refused(rows, labels, cache_dir, tmp_path, capfd):
    table, out = tmp_path / "table.csv", tmp_path / "run"
    args = ["--model", "tiny", "--data", str(write_table(table, 42, ("bad", "good"))), "--cache-dir", str(cache_dir),
            "--max-length", "24", "--batch-size", "8", "--epochs", "2", "--no-progress", "--no-tensorboard",
            "--save-every", "1", "--out", str(out)]
    assert main([*args, "--max-steps", "2"]) == 0
    before = snapshot(out)
    write_table(table, rows, labels)
    line = refused([*args, "--max-steps", "4", "--resume", "auto"], capfd)
    assert f"cannot continue the run in {out}: its data changed since it started" in line, line
    assert snapshot(out) == before  # config.json not rewritten, checkpoints untouched


def test_resume_on_other_imdb_data_in_the_same_folder_is_refused(cache_dir, tmp_path, capfd):
    from conftest import tar_folder, write_imdb

    data, out = tmp_path / "data", tmp_path / "run"
    data.mkdir()
    tar_folder(write_imdb(tmp_path / "first", seed=0), data / "aclImdb_v1.tar.gz")
    assert main(flags(data, cache_dir, out, "--max-steps", "2", "--save-every", "1", "--no-tensorboard")) == 0
    before = snapshot(out)
    tar_folder(write_imdb(tmp_path / "second", seed=1), data / "aclImdb_v1.tar.gz")  # other reviews, same place
    capfd.readouterr()
    assert main(flags(data, cache_dir, out, "--max-steps", "4", "--save-every", "1", "--no-tensorboard",
                      "--resume", "auto")) == EXIT_BAD_INPUT
    # (IMDB's first tokenisation of the new data draws its bars on stderr even with --no-progress)
    errors = [line for line in capfd.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "its data changed since it started (content key imdb-" in errors[0], errors
    assert snapshot(out) == before


# ---------------------------------------------------------------------------- 2. the export folder

@pytest.mark.parametrize("where, relation", [("run", "is"), ("run/model", "is inside"), ("", "contains"),
                                             ("link", "is")],
                         ids=["equal", "inside", "containing", "a link to it"])
def test_export_dir_in_or_around_the_run_folder_is_refused(where, relation, imdb_dir, cache_dir, tmp_path, capfd):
    out = tmp_path / "parent" / "run"
    (tmp_path / "link").symlink_to(out)
    export = tmp_path / "link" if where == "link" else out.parent / where
    line = refused(flags(imdb_dir, cache_dir, out, "--export-dir", str(export)), capfd)
    assert f"--export-dir {export} {relation} the run folder {out}" in line, line
    assert not out.parent.exists()  # refused before any folder was made


def test_export_overwrite_refuses_files_fastpt_did_not_write(imdb_dir, cache_dir, tmp_path, capfd):
    export = tmp_path / "model"
    export.mkdir()
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                 "model.safetensors.index.json", "pytorch_model.bin", "config.json"):
        (export / name).write_text(name)
    before = snapshot(export)
    line = refused(flags(imdb_dir, cache_dir, tmp_path / "run", "--export-dir", str(export), "--overwrite"), capfd)
    assert "config.json, model-00001-of-00002.safetensors, model-00002-of-00002.safetensors and 2 more" in line, line
    assert "not written by a fastpt export" in line
    assert snapshot(export) == before and not (tmp_path / "run").exists()


def test_export_overwrite_replaces_an_earlier_export_and_follows_the_umask(imdb_dir, cache_dir, tmp_path):
    export, umask = tmp_path / "model", os.umask(0o022)
    try:
        export.mkdir()
        # An earlier export that wrote a pytorch_model.bin this one does not write: it must not stay behind.
        for name in ("pytorch_model.bin", "config.json"):
            (export / name).write_text("old")
        (export / checkpoint.EXPORT_MANIFEST).write_text(json.dumps({"files": ["pytorch_model.bin", "config.json"]}))
        assert main(flags(imdb_dir, cache_dir, tmp_path / "run", "--max-steps", "1", "--no-tensorboard",
                          "--export-dir", str(export), "--overwrite")) == 0
    finally:
        os.umask(umask)
    files = sorted(p.name for p in export.iterdir())
    assert "pytorch_model.bin" not in files and "model.safetensors" in files
    listed = json.loads((export / checkpoint.EXPORT_MANIFEST).read_text())["files"]
    assert sorted(listed + [checkpoint.EXPORT_MANIFEST]) == files
    modes = {name: oct((export / name).stat().st_mode & 0o777) for name in files}
    assert set(modes.values()) == {"0o644"}, modes  # as any file under umask 022 (safetensors alone gave 0600)


# ---------------------------------------------------------------------------- 3, 4. --overwrite

def test_overwrite_refuses_a_symlink_and_keeps_the_run(stopped_run, imdb_dir, cache_dir, tmp_path, capfd):
    out, elsewhere = tmp_path / "run", tmp_path / "big-disk" / "checkpoints"
    shutil.copytree(stopped_run, out)
    elsewhere.parent.mkdir()
    (out / "checkpoints").rename(elsewhere)
    (out / "checkpoints").symlink_to(elsewhere)
    before, kept = snapshot(out), snapshot(elsewhere)
    line = refused(flags(imdb_dir, cache_dir, out, "--overwrite"), capfd)
    assert f"--out {out} holds a symbolic link fastpt did not make, checkpoints;" in line, line
    assert snapshot(out) == before and snapshot(elsewhere) == kept


@pytest.mark.parametrize("fastpt_run", [False, True], ids=["another tool's folder", "a fastpt run and a checkpoint"])
def test_overwrite_refuses_files_fastpt_did_not_write(fastpt_run, stopped_run, imdb_dir, cache_dir, tmp_path, capfd):
    out = tmp_path / "run"
    if fastpt_run:
        shutil.copytree(stopped_run, out)
        (out / "checkpoints" / "swa.ckpt").write_text("averaged weights kept by hand\n")
        foreign = "checkpoints/swa.ckpt"
    else:
        (out / "checkpoints").mkdir(parents=True)
        (out / "checkpoints" / "epoch=42.ckpt").write_text("weights")
        (out / "tb").mkdir()
        (out / "config.json").write_text(json.dumps({"lr": 0.1, "max_epochs": 50}))
        foreign = "checkpoints/epoch=42.ckpt"
    before = snapshot(out)
    line = refused(flags(imdb_dir, cache_dir, out, "--overwrite"), capfd)
    assert f"--out {out} holds {foreign}, not written by fastpt;" in line, line
    assert snapshot(out) == before


def test_overwrite_refuses_a_folder_that_is_not_a_fastpt_run(imdb_dir, cache_dir, tmp_path, capfd):
    out = tmp_path / "run"
    (out / "tb").mkdir(parents=True)
    (out / "config.json").write_text(json.dumps({"lr": 0.1}))
    before = snapshot(out)
    line = refused(flags(imdb_dir, cache_dir, out, "--overwrite"), capfd)
    assert f"--out {out} is not a fastpt run folder" in line, line
    assert snapshot(out) == before


def test_overwrite_replaces_a_run_from_before_the_marker(stopped_run, imdb_dir, cache_dir, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(stopped_run, out)
    (out / run_folder.MARKER).unlink()  # as fastpt wrote run folders before the marker
    (out / "train.log").write_text("a script's log of the run\n")  # beside the run's files: kept
    old_results = (out / "results.json").read_bytes()
    assert main(flags(imdb_dir, cache_dir, out, "--max-steps", "1", "--overwrite")) == 0
    assert (out / "train.log").read_text() == "a script's log of the run\n"
    assert json.loads((out / "results.json").read_text())["global_steps"] == 1 != json.loads(old_results)[
        "global_steps"]
    assert (out / run_folder.MARKER).is_file() and not (out / "checkpoints" / "last.pt").exists()


# ---------------------------------------------------------------------------- 5, 6. claiming the folder

def test_runs_started_in_the_same_second_get_folders_of_their_own(imdb_dir, cache_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(run_folder.time, "strftime", lambda fmt: "20260101-120000")  # the clock stands still
    taken = tmp_path / "runs" / "20260101-120000"
    taken.mkdir(parents=True)
    held = os.open(taken / ".lock", os.O_RDWR | os.O_CREAT)  # a run started this second holds it
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        args = flags(imdb_dir, cache_dir, "no-out", "--max-steps", "1", "--no-tensorboard")
        del args[args.index("--out"):args.index("--out") + 2]
        assert main(args) == 0
        assert main(args) == 0
    finally:
        os.close(held)
    assert (taken.parent / "20260101-120000-2" / "results.json").is_file()
    assert (taken.parent / "20260101-120000-3" / "results.json").is_file()
    assert sorted(p.name for p in taken.iterdir()) == [".lock"]


def test_the_folder_claimed_for_a_refused_run_is_left_as_it_was(tmp_path, monkeypatch):
    monkeypatch.setattr(run_folder.time, "strftime", lambda fmt: "20260101-120000")
    base, dist = tmp_path / "runs" / "20260101-120000", distributed.DistInfo(0, 0, 1, torch.device("cpu"))
    first, lock = run_folder.claim_out_dir(base, dist, new=True)
    second, other = run_folder.claim_out_dir(base, dist, new=True)
    assert (first, second) == (base, base.with_name(base.name + "-2"))
    other.release(keep=False)  # a refused run: its folder goes, the other run's stays
    lock.release(keep=False)
    assert not tmp_path.joinpath("runs").exists()


def test_temporaries_of_a_killed_save_are_removed_when_the_folder_is_claimed(stopped_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(stopped_run, out)
    stale = [out / "checkpoints" / ".last.pt.0a1b2c3d.tmp", out / "checkpoints" / ".best.pt.deadbeef.tmp",
             out / ".results.json.12345678.tmp"]
    others = [out / "checkpoints" / ".notes.0a1b2c3d.tmp", out / "checkpoints" / ".last.pt.tmp"]
    for path in stale + others:
        path.write_bytes(b"half")
    _, lock = run_folder.claim_out_dir(out, distributed.DistInfo(0, 0, 1, torch.device("cpu")))
    lock.release()
    assert [p.exists() for p in stale + others] == [False] * len(stale) + [True] * len(others)


# ---------------------------------------------------------------------------- 8. crafted files

def test_a_config_json_that_is_not_an_object_is_refused(imdb_dir, cache_dir, tmp_path, capfd):
    out = tmp_path / "run"
    (out / "tb").mkdir(parents=True)
    (out / "config.json").write_text("[1, 2, 3]\n")
    before = snapshot(out)
    line = refused(flags(imdb_dir, cache_dir, out, "--resume", "auto"), capfd)
    assert "without a readable config.json (a JSON object)" in line and "choose another folder" in line, line
    assert snapshot(out) == before


def test_a_last_pt_with_a_weight_of_the_wrong_shape_is_refused(stopped_run, imdb_dir, cache_dir, tmp_path, capfd):
    out = tmp_path / "run"
    shutil.copytree(stopped_run, out)
    state = checkpoint.load(out / "checkpoints" / "last.pt")
    weights = state["training"]["model"]
    name = next(k for k in weights if k.startswith("classifier") and k.endswith("weight"))
    weights[name] = torch.zeros(weights[name].shape[0] + 1, weights[name].shape[1])
    torch.save(state, out / "checkpoints" / "last.pt")
    before = snapshot(out)
    line = refused(flags(imdb_dir, cache_dir, out, "--max-steps", "3", "--resume", "auto"), capfd)
    assert f"its last.pt's {name} is [{weights[name].shape[0]}, " in line, line
    assert snapshot(out) == before
