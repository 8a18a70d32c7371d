"""The config is a value: resolved once, frozen, changed only as a new value; what the data decides travels on
Inputs, and the saved config still carries it. Run folders and exports written before the config was frozen
(by fastpt as of commit 6da43d4) still resume and predict."""

from __future__ import annotations

import csv
import dataclasses
import json

import pytest
import torch

from fastpt.cli.predict import main as predict
from fastpt.cluster import resize
from fastpt.config import TrainConfig
from fastpt.files import checkpoint
from train import main


def test_a_config_refuses_assignment_and_changes_only_as_a_new_checked_value():
    cfg = TrainConfig(bucket=True, requeue_signal="sigusr2")
    assert (cfg.pad_to, cfg.requeue_signal) == ("longest", "USR2")  # __post_init__ fills in, before it freezes
    with pytest.raises(dataclasses.FrozenInstanceError, match="dataclasses.replace"):
        cfg.batch_size = 24
    assert cfg.batch_size == 12
    changed = dataclasses.replace(cfg, batch_size=24)
    assert (changed.batch_size, cfg.batch_size, changed.pad_to) == (24, 12, "longest")
    with pytest.raises(ValueError, match="--batch-size must be positive"):  # a new value is checked again
        dataclasses.replace(cfg, batch_size=0)


def test_a_resize_returns_a_new_config():
    state = {"world_size": 2, "config": {"batch_size": 4}, "per_rank": [{"rng": {}}, {"rng": {}}],
             "progress": {"epoch": 0, "batch_in_epoch": 3, "global_step": 3}}
    cfg = TrainConfig(batch_size=4, strategy="ddp")
    resized, note = resize.adapt(cfg, state, 1)
    assert (resized.batch_size, cfg.batch_size) == (8, 4) and "keeps the global batch of 8" in note


# config.json of a run that fastpt wrote before the config was frozen (commit 6da43d4), for the flags below,
# with this test's paths filled in: cheap_dropout, pack_attention, label_names, data_splits and
# class_weight_values were all settings of TrainConfig then. last.pt and best.pt held the same, without
# world_size and data_key.
OLD_CONFIG = {
    "amp": False, "amp_dtype": "float16", "attn_implementation": "sdpa", "batch_size": 8, "bucket": False,
    "bucket_multiplier": 50, "cache_dir": "{cache_dir}", "cheap_dropout": False,
    "class_weight_values": [1.6, 0.7272727272727273], "class_weights": "balanced", "compile": False,
    "compile_mode": "default", "compile_scope": "layers", "data": None, "data_dir": "{data_dir}",
    "data_key": "{data_key}", "data_on_device": False, "data_splits": None, "deepspeed_config": None,
    "deterministic": False, "device": "auto", "dist_timeout": 600, "early_stopping_patience": None, "epochs": 1,
    "eval_batch_size": 128, "export_dir": "{export_dir}", "fsdp_reshard_after_forward": True, "fused_adam": False,
    "grad_accum": 1, "label_column": None, "label_names": ["neg", "pos"], "log_every": 2, "lr": 5e-05,
    "lr_schedule": "constant", "max_grad_norm": None, "max_length": 64, "max_steps": None, "min_delta": 0.0,
    "model": "tiny", "monitor": "val_acc", "num_workers": 0, "optimizer": "adam", "out": "{out}",
    "overwrite": False, "pack": False, "pack_attention": "auto", "pack_multiple": None, "pad_to": "max_length",
    "pin_memory": False, "progress": False, "random_init": False, "requeue_signal": "USR1", "resume": None,
    "save_every": 1, "save_every_minutes": 10.0, "seed": 123, "split_seed": 0, "strategy": "single",
    "tensorboard": True, "test_data": None, "test_fraction": None, "test_on": "best", "test_size": 8,
    "text_column": None, "text_pair_column": None, "tf32": False, "train_size": 16, "val_data": None,
    "val_fraction": None, "val_size": 8, "verbose": False, "warmup_ratio": None, "warmup_steps": None,
    "weight_decay": 0.0, "world_size": 1, "zero_stage": 2,
}
OLD_LAST_KEYS = ("batch_size_flag", "best", "config", "early_stopping", "history", "pack_attention", "per_rank",
                 "progress", "training", "world_size")
OLD_PROGRESS_KEYS = ("batch_in_epoch", "epoch", "examples_in_epoch", "first_step_s", "global_step", "train_time_s",
                     "val_compile_s", "val_time_s")
FLAGS = ("--train-size", "16", "--val-size", "8", "--test-size", "8", "--class-weights", "balanced",
         "--save-every", "1")


def written_before(out, export, imdb_dir, cache_dir) -> None:
    """The run folder as fastpt wrote it then: OLD_CONFIG in config.json, last.pt and best.pt, last.pt's layout."""
    data_key = json.loads((out / "config.json").read_text())["data_key"]
    paths = {"{out}": str(out.resolve()), "{export_dir}": str(export.resolve()), "{data_key}": data_key,
             "{data_dir}": str(imdb_dir.resolve()), "{cache_dir}": str(cache_dir.resolve())}
    config = {k: paths.get(v, v) if isinstance(v, str) else v for k, v in OLD_CONFIG.items()}
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    saved = {k: v for k, v in config.items() if k not in ("world_size", "data_key")}
    last = checkpoint.load(out / "checkpoints" / "last.pt")
    last = {**{k: last.get(k) for k in OLD_LAST_KEYS}, "config": saved}
    last["progress"] = {k: last["progress"][k] for k in OLD_PROGRESS_KEYS}
    torch.save(last, out / "checkpoints" / "last.pt")
    best = checkpoint.load(out / "checkpoints" / "best.pt")
    torch.save({**best, "config": saved}, out / "checkpoints" / "best.pt")


def test_a_run_folder_from_before_the_frozen_config_resumes_and_predicts(tiny_args, imdb_dir, cache_dir, tmp_path):
    out, export = tmp_path / "run", tmp_path / "export"
    assert main(tiny_args(*FLAGS, "--epochs", "1", "--export-dir", str(export), out=out)) == 0
    written_before(out, export, imdb_dir, cache_dir)
    assert main(tiny_args(*FLAGS, "--epochs", "2", "--resume", "auto", out=out)) == 0  # one epoch more
    results = json.loads((out / "results.json").read_text())
    assert results["epochs_run"] == 2 and results["label_names"] == ["neg", "pos"]
    config = json.loads((out / "config.json").read_text())  # written again by this code: the same names
    assert config["label_names"] == ["neg", "pos"] and config["class_weight_values"] == [1.6, 0.7272727272727273]
    texts = tmp_path / "texts.csv"
    with open(texts, "w", newline="") as f:
        csv.writer(f).writerows([("text", "label"), ("a wonderful film", "pos"), ("a dull and tedious plot", "neg")])
    for model in (out, export):  # best.pt's config names the labels; the export is a Hugging Face folder
        assert predict(["--model", str(model), "--data", str(texts), "--out", str(tmp_path / f"{model.name}.csv")]) == 0
        with open(tmp_path / f"{model.name}.csv", newline="") as f:
            assert {row["predicted"] for row in csv.DictReader(f)} <= {"neg", "pos"}
