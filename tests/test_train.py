"""End to end: train.py on the tiny model leaves every output, and its numbers are consistent."""

from __future__ import annotations

import json

import pytest
import torch

from fastpt.inputs import data, token_cache
from fastpt.inputs.models import load_model, load_tokenizer
from fastpt.config import TrainConfig
from fastpt.loop.evaluation import evaluate
from fastpt.files import checkpoint
from fastpt.cluster.distributed import DistInfo
from fastpt.strategies.base import Strategy
from train import main


RESULT_KEYS = {"test_acc", "test_loss", "best_val_acc", "best_epoch", "epochs_run", "stopped_early",
               "train_time_s", "samples_per_s", "tokens_per_s", "padding_efficiency", "peak_memory_bytes",
               "cpu_allocator", "memory_per_rank", "history"}


def tb_tags(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(folder)).Reload()
    return set(acc.Tags()["scalars"]), acc


def test_end_to_end_run_writes_every_output(tiny_args, tmp_path):
    out = tmp_path / "run"
    assert main(tiny_args("--epochs", "3", "--lr", "1e-3", out=out)) == 0
    results = json.loads((out / "results.json").read_text())
    config = json.loads((out / "config.json").read_text())
    assert RESULT_KEYS <= results.keys()
    assert config["model"] == "tiny" and config["epochs"] == 3
    assert results["epochs_run"] == 3 and not results["stopped_early"]
    assert results["test_examples"] == 32 and results["tested_on"] == "best"
    assert 0.0 <= results["test_acc"] <= 1.0 and results["samples_per_s"] > 0
    # MFU on the CPU too, against the measured matmul peak (monitoring/peak.py) that results.json names
    assert 0 < results["mfu"] < 1 and results["peak_probe"]["dtype"] == "float32"
    assert results["peak_flops_per_s"] == max(s["flops_per_s"] for s in results["peak_probe"]["shapes"])
    # the best epoch is the first one with the highest validation accuracy
    val = [h["val_acc"] for h in results["history"]]
    assert results["best_epoch"] == val.index(max(val)) + 1 and results["best_val_acc"] == max(val)

    tags, acc = tb_tags(out / "tb")
    assert {"train/loss", "train/samples_per_s", "train/mfu", "train/lr", "epoch/val_acc", "epoch/val_loss",
            "epoch/train_loss", "epoch/train_acc", "test/test_acc"} <= tags
    assert len(acc.Scalars("epoch/val_acc")) == 3
    assert any((out / "tb" / "hparams").iterdir())


def test_best_checkpoint_reloads_into_a_plain_model_and_reproduces_the_test_score(tiny_args, imdb_dir, cache_dir,
                                                                                  tmp_path):
    out = tmp_path / "run"
    assert main(tiny_args("--epochs", "2", "--lr", "1e-3", out=out)) == 0
    results = json.loads((out / "results.json").read_text())
    best = checkpoint.load(out / "checkpoints" / "best.pt")
    assert best["epoch"] == results["best_epoch"] and best["value"] == results["best_monitor"]
    assert not any(k.startswith(("_orig_mod.", "module.")) for k in best["model"])

    cfg = TrainConfig(model="tiny", max_length=64, batch_size=8, device="cpu")
    strategy = Strategy(cfg, DistInfo(0, 0, 1, torch.device("cpu")))
    strategy.setup(load_model("tiny", random_init=True))
    strategy.load_model_state_dict(best["model"])
    splits, _ = token_cache.prepare_splits(str(imdb_dir), str(cache_dir), load_tokenizer("tiny"), 64)
    loader = data.make_loader(splits["test"], data.EvalBatchSampler(splits["test"], 8, 0, 1),
                              data.Collator(0, "max_length", 64), 0, False, 0)
    test = evaluate(strategy, loader)
    assert test["n"] == results["test_examples"]
    assert test["acc"] == results["test_acc"]
    assert test["loss"] == pytest.approx(results["test_loss"], rel=1e-6)


def test_test_on_last_and_early_stopping(tiny_args, tmp_path):
    # With a vanishing learning rate validation accuracy cannot improve after the first check,
    # so patience 1 stops after the second epoch of five.
    out = tmp_path / "run"
    assert main(tiny_args("--epochs", "5", "--lr", "1e-12", "--early-stopping-patience", "1",
                          "--test-on", "last", out=out)) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["stopped_early"] and results["epochs_run"] == 2
    assert results["tested_on"] == "last" and results["best_epoch"] == 1
    assert "no improvement in 1" in results["stop_reason"]


def test_evaluation_builds_no_autograd_graph_and_restores_train_mode(imdb_dir, cache_dir):
    cfg = TrainConfig(model="tiny", max_length=64, batch_size=8, device="cpu")
    strategy = Strategy(cfg, DistInfo(0, 0, 1, torch.device("cpu")))
    strategy.setup(load_model("tiny", random_init=True))
    strategy.train(True)
    seen = []
    strategy.module.register_forward_hook(
        lambda module, args, output: seen.append((torch.is_grad_enabled(), output.logits.requires_grad,
                                                  module.training)))
    splits, _ = token_cache.prepare_splits(str(imdb_dir), str(cache_dir), load_tokenizer("tiny"), 64)
    loader = data.make_loader(splits["validation"], data.EvalBatchSampler(splits["validation"], 8, 0, 1),
                              data.Collator(0, "longest", 64), 0, False, 0)
    result = evaluate(strategy, loader)
    assert result["n"] == 16 and len(seen) == 2
    assert all(state == (False, False, False) for state in seen)
    assert strategy.module.training
