"""The token cache as a shared folder: changed caches refused, folders that follow the umask, one line for a
cache another user's permissions close or a full disk, checks before the cache lookup, nothing left behind
on bad input, and the Inductor cache where fastpt says it is."""

from __future__ import annotations

import errno
import json
import os
import pwd
import shutil
import stat
import urllib.request
from pathlib import Path

import datasets
import numpy as np
import pytest
from conftest import flip_labels

from fastpt.inputs import token_cache
from fastpt.inputs.models import load_tokenizer
from fastpt.files import shared_cache
from train import main


def short_run(imdb_dir, cache, out, *extra):
    return ["--model", "tiny", "--data-dir", str(imdb_dir), "--cache-dir", str(cache), "--max-length", "32",
            "--batch-size", "8", "--epochs", "1", "--max-steps", "2", "--no-progress", "--no-tensorboard",
            "--out", str(out), *extra]


def own_run(data, cache, out, *extra):
    return ["--model", "tiny", "--data", str(data), "--cache-dir", str(cache), "--max-length", "24",
            "--batch-size", "8", "--epochs", "1", "--max-steps", "2", "--no-progress", "--no-tensorboard",
            "--out", str(out), *extra]


def write_table(path: Path, n: int = 60) -> Path:
    words = {"good": "lovely bright sweet", "bad": "broken rotten grim"}
    lines = ["text,label"] + [f"the lamp {words[label].split()[i % 3]} cup,{label}"
                              for i, label in enumerate(["good", "bad"] * (n // 2))]
    path.write_text("\n".join(lines) + "\n")
    return path


def run(args, capsys) -> tuple[int, list[str]]:
    """main's exit status and what it wrote on stderr (alone: what came before is dropped)."""
    capsys.readouterr()
    status = main(args)
    return status, capsys.readouterr().err.strip().splitlines()


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


# ---------------------------------------------------------------------------- a changed cache is refused

def test_an_imdb_cache_whose_labels_were_rewritten_is_refused_not_trained_on(imdb_dir, tmp_path, capsys):
    cache, out = tmp_path / "cache", tmp_path / "run"
    splits, path = token_cache.prepare_splits(str(imdb_dir), str(cache), load_tokenizer("tiny"), 32)
    flip_labels(path)
    poisoned = np.asarray(datasets.load_from_disk(str(path))["train"]["label"])
    assert np.array_equal(poisoned, 1 - splits["train"].labels)  # the poison took: a run would train on it

    status, err = run(short_run(imdb_dir, cache, out), capsys)
    assert status == 2
    assert len(err) == 1 and f"refused the token cache {path}" in err[0] and f"rm -r {path}" in err[0], err
    assert "nothing was trained on it" in err[0]
    assert not out.exists()  # no run folder, no results from the poisoned labels

    shutil.rmtree(path)  # what the line says to do: the next run rebuilds the cache and trains
    assert main(short_run(imdb_dir, cache, out)) == 0


@pytest.mark.parametrize("change", ["label names", "digest"])
def test_own_data_whose_metadata_was_changed_is_refused(change, tmp_path, capsys):
    from fastpt.inputs import own_data

    cache, data = tmp_path / "cache", write_table(tmp_path / "table.csv")
    assert main(own_run(data, cache, tmp_path / "first")) == 0
    (path,) = [p for p in cache.iterdir() if p.is_dir() and p.name.startswith("data-")]
    if change == "label names":  # "bad" is now called "good" and the other way round
        meta = json.loads((path / own_data.META).read_text())
        meta["label_names"] = meta["label_names"][::-1]
        (path / own_data.META).write_text(json.dumps(meta, indent=2))
    else:
        digest = json.loads((path / shared_cache.DIGEST).read_text())
        name = next(iter(digest["sha256"]))
        digest["sha256"][name] = "0" * 64
        (path / shared_cache.DIGEST).write_text(json.dumps(digest))

    status, err = run(own_run(data, cache, tmp_path / "second"), capsys)
    assert status == 2
    assert len(err) == 1 and f"refused the token cache {path}" in err[0], err
    assert not (tmp_path / "second").exists()


# ---------------------------------------------------------------------------- permissions

@pytest.mark.parametrize("umask", [0o022, 0o002], ids=["022", "002"])
@pytest.mark.parametrize("trusted", [False, True], ids=["own", "trusted"])
def test_cache_folders_follow_the_umask_less_others_write_unless_trusted(umask, trusted, imdb_dir, tmp_path,
                                                                         monkeypatch):
    if trusted:  # a team's cache folder: what the umask gives, group write included
        monkeypatch.setenv("FASTPT_TRUST_DIRS", str(tmp_path / "cache"))
    previous = os.umask(umask)
    try:
        _, path = token_cache.prepare_splits(str(imdb_dir), str(tmp_path / "cache"), load_tokenizer("tiny"), 32)
    finally:
        os.umask(previous)
    kept_out = 0 if trusted else 0o022
    folders = [path, *(p for p in path.rglob("*") if p.is_dir())]
    files = [p for p in path.rglob("*") if p.is_file()]
    assert {stat.S_IMODE(p.stat().st_mode) for p in folders} == {0o777 & ~umask & ~kept_out}
    assert {stat.S_IMODE(p.stat().st_mode) for p in files} == {0o666 & ~umask & ~kept_out}


def test_a_cache_the_user_may_not_read_is_one_line_naming_it_and_its_owner(imdb_dir, tmp_path, monkeypatch, capsys):
    cache, out = tmp_path / "cache", tmp_path / "run"
    _, path = token_cache.prepare_splits(str(imdb_dir), str(cache), load_tokenizer("tiny"), 32)

    def closed(name, *args, **kwargs):  # another user's 0700 cache (the tests may run as root, who reads anything)
        raise PermissionError(errno.EACCES, "Permission denied", str(Path(name) / "dataset_dict.json"))

    monkeypatch.setattr(datasets, "load_from_disk", closed)
    status, err = run(short_run(imdb_dir, cache, out), capsys)
    assert status == 2
    assert len(err) == 1 and f"no permission to use the token cache {path} (yours, drwx" in err[0], err
    assert f"chmod -R u+rwX {path}" in err[0] and "--cache-dir" in err[0]

    builder = path.stat().st_uid  # seen by another user, the line names the cache's owner
    owner = pwd.getpwuid(builder).pw_name
    monkeypatch.setattr(os, "getuid", lambda: builder + 1)
    status, err = run(short_run(imdb_dir, cache, out), capsys)
    assert status == 2 and f"({owner}'s, drwx" in err[0] and f"ask {owner} to open it to you" in err[0], err
    assert not out.exists()


# ---------------------------------------------------------------------------- a full disk

def test_a_full_disk_while_building_the_cache_is_one_line_status_1_and_leaves_nothing(
        imdb_dir, tmp_path, monkeypatch, capsys):
    cache, out = tmp_path / "cache", tmp_path / "run"

    def fills_the_disk(self, folder, *args, **kwargs):
        (Path(folder) / "train").mkdir()
        (Path(folder) / "train" / "data-00000-of-00001.arrow").write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(datasets.DatasetDict, "save_to_disk", fills_the_disk)
    status, err = run(short_run(imdb_dir, cache, out), capsys)
    assert status == 1
    assert len(err) == 1 and err[0].startswith(f"error: no space left in {cache} for the token cache imdb-"), err
    assert "bytes free" in err[0]
    assert leftovers(cache) == [] and not out.exists()  # no temporary folder, no lock file, no run folder


# ---------------------------------------------------------------------------- checks before the cache lookup

def test_a_cache_hit_still_checks_the_file_and_records_the_file_given(tmp_path, capsys):
    cache, data = tmp_path / "cache", write_table(tmp_path / "table.csv")
    assert main(own_run(data, cache, tmp_path / "first")) == 0

    as_text = tmp_path / "table.txt"
    shutil.copyfile(data, as_text)
    status, err = run(own_run(as_text, cache, tmp_path / "second"), capsys)  # same bytes: a cache hit before
    assert status == 2 and len(err) == 1 and "unknown file type .txt" in err[0], err

    copy = tmp_path / "elsewhere" / "copy.csv"
    copy.parent.mkdir()
    shutil.copyfile(data, copy)
    before = leftovers(cache)
    assert main(own_run(copy, cache, tmp_path / "third")) == 0
    assert leftovers(cache) == before  # a cache hit: not built again
    splits = json.loads((tmp_path / "third" / "config.json").read_text())["data_splits"]
    assert {split["from"] for split in splits.values()} == {str(copy)}


# ---------------------------------------------------------------------------- nothing left behind

def test_bad_data_leaves_no_lock_file_and_no_cache_folder(tmp_path, capsys):
    cache, data = tmp_path / "cache", tmp_path / "table.csv"
    data.write_text("text,stars\nnice lamp,5\n")
    status, err = run(own_run(data, cache, tmp_path / "run"), capsys)
    assert status == 2 and "has no column 'label'" in err[0], err
    assert not cache.exists()

    cache.mkdir()  # a cache folder there before: it stays, and holds nothing of the failed build
    assert main(own_run(data, cache, tmp_path / "run")) == 2
    assert leftovers(cache) == []


def test_a_successful_build_leaves_no_lock_file(imdb_dir, tmp_path):
    _, path = token_cache.prepare_splits(str(imdb_dir), str(tmp_path / "cache"), load_tokenizer("tiny"), 32)
    assert leftovers(tmp_path / "cache") == [path.name]


def test_a_failed_download_leaves_no_data_folder(tmp_path, monkeypatch, capsys):
    def offline(*args, **kwargs):
        raise OSError("no network")

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FASTPT_DATA_DIR", raising=False)
    monkeypatch.setattr(urllib.request, "urlopen", offline)
    args = short_run("x", tmp_path / "cache", tmp_path / "run")
    del args[2:4]  # no --data-dir: the tarball is downloaded into ./data
    status, err = run(args, capsys)
    assert status == 2 and len(err) == 1 and "could not download" in err[0], err
    assert leftovers(tmp_path) == []  # no ./data, no cache folder, no run folder


# ---------------------------------------------------------------------------- the Inductor cache

def test_the_inductor_cache_is_the_one_fastpt_names_even_after_dynamo_chose_its_default(tmp_path, monkeypatch):
    from types import SimpleNamespace

    import torch
    import torch._dynamo  # noqa: F401 - its import writes torch's default into TORCHINDUCTOR_CACHE_DIR
    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir

    from fastpt.speedups import backends

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert cache_dir() == os.path.abspath(default_cache_dir())  # as after `import torch._dynamo` in a fresh process
    cfg = SimpleNamespace(compile=True, deterministic=False, tf32=False)
    backends.configure(cfg, torch.device("cpu"), tmp_path)
    assert cache_dir() == str(tmp_path / f"inductor-{os.getuid()}")  # each user's own, in a shared cache too
    backends.restore(cfg)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == os.path.abspath(default_cache_dir())

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))  # the user's own choice is kept
    backends.configure(cfg, torch.device("cpu"), tmp_path)
    assert cache_dir() == str(tmp_path / "mine")
    backends.restore(cfg)


def test_a_compile_run_compiles_with_torchs_cache_in_the_folder_fastpt_names(imdb_dir, tmp_path, monkeypatch):
    """The run's real order (torch._dynamo imported by the --compile check, long before the backends are set);
    torch.compile itself is replaced by a probe that asks torch where its cache is (a cold Inductor compile of
    even the tiny model takes minutes on a small CPU; that it then writes there is torch's business)."""
    import torch
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    cache_dir()  # what `import torch._dynamo` does in a fresh process: torch's default written into the variable
    seen = []

    def probe(target, **options):
        seen.append(cache_dir())
        return target

    monkeypatch.setattr(torch, "compile", probe)
    assert main(short_run(imdb_dir, tmp_path / "cache", tmp_path / "run", "--compile")) == 0
    assert seen and set(seen) == {str(tmp_path / "cache" / f"inductor-{os.getuid()}")}
