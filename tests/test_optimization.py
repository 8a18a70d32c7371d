"""--optimizer adamw / --weight-decay, --lr-schedule with warmup, --class-weights and --label-names,
each against what it imitates: transformers' Trainer (decay groups) and schedules, torch's weighted
cross-entropy, scikit-learn's "balanced" rule; a resumed run equals the uninterrupted one bitwise.
(The distributed strategies run AdamW with warmup in tests/test_distributed.py's shared launch.)
"""

from __future__ import annotations

import copy
import csv
import importlib
import json
import math
import os
import random
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_reliability import assert_same_run, checkpoint_step, fault_rng, flags
from transformers import (AutoModelForSequenceClassification, BertConfig, DistilBertConfig, Trainer,
                          get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup,
                          get_linear_schedule_with_warmup)

from fastpt.cli.shell import EXIT_BAD_INPUT
from fastpt.inputs.data import Collator
from fastpt.loop.evaluation import make_eval_sums
from fastpt.loop.step import class_weights, make_forward_loss
from fastpt.files import checkpoint
from fastpt.config import TrainConfig
from fastpt.cluster.distributed import DistInfo
from fastpt.errors import EXIT_STOPPED
from fastpt.speedups.packing import PackedClassifier, PackedCollator
from fastpt.strategies import optimizer as optim
from fastpt.strategies.base import Strategy
from train import main


HF_SCHEDULES = {"constant": lambda opt, warmup, total: get_constant_schedule_with_warmup(opt, warmup),
                "linear": get_linear_schedule_with_warmup, "cosine": get_cosine_schedule_with_warmup}
CPU = DistInfo(0, 0, 1, torch.device("cpu"))
MAX_LENGTH = 64


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one thread, global switches put back


def tiny_model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "distilbert":
        config = DistilBertConfig(vocab_size=100, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                                  max_position_embeddings=MAX_LENGTH, dropout=0.0, attention_dropout=0.0,
                                  seq_classif_dropout=0.0)
    else:
        config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=64, max_position_embeddings=MAX_LENGTH, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0)
    return AutoModelForSequenceClassification.from_config(config, attn_implementation="sdpa")


def hf_rates(kind: str, lr: float, warmup: int, total: int, skipped=()) -> list[float]:
    """The learning rate of each of `total` steps under transformers' schedule: read before the step, the
    schedule stepped after it unless the step was skipped (Trainer's `optimizer_step_was_skipped`)."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    schedule = HF_SCHEDULES[kind](opt, warmup, total)
    rates = []
    for step in range(total):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        if step not in skipped:
            schedule.step()
    return rates


# ---------------------------------------------------------------------------- AdamW

@pytest.mark.parametrize("kind", ["distilbert", "bert"])
def test_decay_groups_are_transformers_trainers(kind):
    model = tiny_model(kind)
    expected = set(Trainer.get_decay_parameter_names(None, model))  # uses nothing of the Trainer but the model
    names = {name for name, _ in model.named_parameters()}
    assert optim.decay_parameter_names(model) == expected
    assert {n for n in names - expected if "norm" in n.lower()} and {n for n in names - expected if "bias" in n}
    # packed: the same parameters under the same names (PackedClassifier registers the model's children)
    assert optim.decay_parameter_names(PackedClassifier(copy.deepcopy(model), "loop")) == expected

    adamw = optim.build_optimizer(model, TrainConfig(optimizer="adamw", weight_decay=0.05), fused=False)
    by_id = {id(p): n for n, p in model.named_parameters()}
    assert type(adamw) is torch.optim.AdamW and [g["weight_decay"] for g in adamw.param_groups] == [0.05, 0.0]
    assert {by_id[id(p)] for p in adamw.param_groups[0]["params"]} == expected
    assert {by_id[id(p)] for p in adamw.param_groups[1]["params"]} == names - expected
    adam = optim.build_optimizer(model, TrainConfig(), fused=False)  # the article's: one group, no decay
    assert type(adam) is torch.optim.Adam and len(adam.param_groups) == 1 and adam.param_groups[0]["weight_decay"] == 0


# ---------------------------------------------------------------------------- the schedule

@pytest.mark.parametrize("kind", ["constant", "linear", "cosine"])
def test_schedule_factors_are_transformers_exactly(kind):
    for total in (1, 7, 20):
        for warmup in (0, 1, 3, total):
            opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
            schedule = HF_SCHEDULES[kind](opt, warmup, total)
            for step in range(total + 2):  # and past the end
                assert optim.lr_factor(kind, step, warmup, total) == opt.param_groups[0]["lr"], (total, warmup, step)
                opt.step()
                schedule.step()


def test_total_and_warmup_steps():
    cfg = TrainConfig(epochs=3, grad_accum=2, warmup_ratio=0.1)
    assert optim.total_steps(cfg, batches_per_epoch=5) == 9  # 2 + 2 + 1 steps an epoch: the short window counts
    assert optim.warmup_steps(cfg, 9) == 1  # ceil(0.9), TrainingArguments.get_warmup_steps
    assert optim.total_steps(TrainConfig(epochs=3, max_steps=4), 5) == 4
    assert optim.total_steps(TrainConfig(epochs=1, max_steps=40), 5) == 5
    assert not optim.has_schedule(TrainConfig()) and optim.has_schedule(TrainConfig(warmup_steps=1))


def run_rates(monkeypatch) -> list[list[float]]:
    """The learning rate of every param group at each optimiser step of the runs that follow."""
    rates, original = [], Strategy.optimizer_step

    def step(self):
        rates.append([group["lr"] for group in self.optimizer.param_groups])
        return original(self)

    monkeypatch.setattr(Strategy, "optimizer_step", step)
    return rates


def tb_scalars(out: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(out / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


# (schedule, flags, warmup, total): 40 reviews in batches of 8 = 5 batches an epoch, 2 epochs
RUNS = {
    "constant": ("constant", ["--warmup-steps", "3"], 3, 10),
    "linear": ("linear", ["--warmup-ratio", "0.25", "--grad-accum", "2", "--optimizer", "adamw",
                          "--weight-decay", "0.01"], math.ceil(0.25 * 6), 6),  # ceil(5 / 2) = 3 steps an epoch
    "cosine": ("cosine", ["--warmup-steps", "2", "--grad-accum", "2", "--max-steps", "5"], 2, 5),
    "warmup_past_the_end": ("linear", ["--warmup-steps", "12"], 12, 10),
}


@pytest.mark.parametrize("run", RUNS)
def test_every_steps_learning_rate_is_transformers(run, tiny_args, tmp_path, monkeypatch, capfd):
    kind, extra, warmup, total = RUNS[run]
    rates = run_rates(monkeypatch)
    out = tmp_path / "run"
    assert main(tiny_args("--train-size", "40", "--val-size", "8", "--test-size", "8", "--max-length", "32",
                          "--lr", "1e-3", "--log-every", "1", "--lr-schedule", kind, *extra, out=out)) == 0
    expected = hf_rates(kind, 1e-3, warmup, total)
    assert [group[0] for group in rates] == expected
    assert all(len(set(group)) == 1 for group in rates)  # decay and no-decay groups share the rate
    assert len(rates[0]) == (2 if "adamw" in extra else 1)
    logged = tb_scalars(out, "train/lr")  # the rate each step trained with, at every step (--log-every 1)
    assert [s for s, _ in logged] == list(range(1, total + 1))
    assert [v for _, v in logged] == pytest.approx(expected, rel=1e-6)
    note = f"note: the warmup takes {warmup} optimiser steps and the run makes {total}: the learning rate never"
    assert (note in capfd.readouterr().err) == (warmup >= total)


def test_a_float16_step_the_scaler_skipped_does_not_move_the_schedule():
    """Trainer's rule: the schedule steps with the optimiser steps taken, not with skipped ones."""
    strategy = Strategy(TrainConfig(model="tiny", amp=True, lr_schedule="linear", warmup_steps=2), CPU)
    strategy.setup(torch.nn.Linear(2, 1), training_steps=6)
    bad, rates = (True, False, True, False, False, False), []
    for nan in bad:
        rates.append(strategy.optimizer.param_groups[0]["lr"])
        with strategy.precision.autocast():
            loss = strategy.model(torch.ones(1, 2)).sum() * (float("nan") if nan else 1.0)
        strategy.backward(loss)
        strategy.optimizer_step()
        assert bool(strategy.step_was_skipped()) == nan
    assert rates == hf_rates("linear", TrainConfig().lr, 2, 6, skipped={i for i, nan in enumerate(bad) if nan})
    lr = TrainConfig().lr
    assert rates == [0.0, 0.0, 0.5 * lr, 0.5 * lr, lr, 0.75 * lr]  # without the rule: 0, .5, 1, .75, .5, .25


RESUMED = ("--optimizer", "adamw", "--weight-decay", "0.01", "--lr-schedule", "linear", "--warmup-ratio", "0.2",
           "--class-weights", "balanced", "--lr", "1e-3")


def stop_at_step(monkeypatch, strategy_class, k: int) -> None:
    """SIGINT (Ctrl-C) in the k-th optimiser step of this process: the run saves last.pt there and stops (status 3)."""
    original, calls = strategy_class.optimizer_step, []

    def step(self):
        calls.append(1)
        if len(calls) == k:
            os.kill(os.getpid(), signal.SIGINT)
        return original(self)

    monkeypatch.setattr(strategy_class, "optimizer_step", step)


@pytest.mark.parametrize("strategy", [[], pytest.param(["--fsdp"], marks=pytest.mark.slow)], ids=["single", "fsdp"])
def test_a_stopped_run_with_schedule_adamw_and_class_weights_resumes_bitwise(strategy, imdb_dir, cache_dir, tmp_path,
                                                                             monkeypatch):
    """(--fsdp: as a one-rank job, its own checkpoint code: full state dicts gathered and scattered.)"""
    reference, out = tmp_path / "reference", tmp_path / "run"
    assert main(flags(imdb_dir, cache_dir, reference, *RESUMED, *strategy)) == 0
    stop = fault_rng().randint(1, 11)  # of 12 steps (6 an epoch)
    with monkeypatch.context() as patch:
        stop_at_step(patch, Strategy, stop)
        assert main(flags(imdb_dir, cache_dir, out, *RESUMED, *strategy)) == EXIT_STOPPED
    assert checkpoint_step(out) == stop
    assert main(flags(imdb_dir, cache_dir, out, *RESUMED, *strategy, "--resume", "auto")) == 0
    assert_same_run(reference, out)  # weights, AdamW's moments, the schedule's position, losses, curves
    last = checkpoint.load(out / "checkpoints" / "last.pt")["training"]
    assert last["lr_scheduler"]["last_epoch"] == 12 and last["optimizer"]["param_groups"][0]["lr"] == 0.0

    config = json.loads((out / "config.json").read_text())
    weights = config["class_weight_values"]
    assert config["class_weights"] == "balanced" and len(weights) == 2 and min(weights) > 0
    # A resume that changes any of these settings is refused, naming it; nothing is touched.
    before = (out / "checkpoints" / "last.pt").stat().st_mtime_ns
    changed = [a if a != "linear" else "cosine" for a in RESUMED]
    assert main(flags(imdb_dir, cache_dir, out, *changed, *strategy, "--resume", "auto")) == EXIT_BAD_INPUT
    assert (out / "checkpoints" / "last.pt").stat().st_mtime_ns == before and checkpoint_step(out) == 12


@pytest.mark.slow  # 3 DeepSpeed runs in this process: 49 s on 2 shared CPU cores (load 3), 83 s at load 8
def test_deepspeed_steps_and_resumes_the_schedule_bitwise(imdb_dir, cache_dir, tmp_path, monkeypatch):
    """The engine steps fastpt's schedule (after each step without overflow) and keeps it in its checkpoint."""
    pytest.importorskip("deepspeed")
    from fastpt.strategies.deepspeed import DeepSpeedStrategy

    monkeypatch.setattr(importlib.import_module("deepspeed.comm.torch"), "build_shm_op", lambda: None)
    ds = ("--deepspeed", "--zero-stage", "2", "--optimizer", "adamw", "--weight-decay", "0.01",
          "--lr-schedule", "cosine", "--warmup-steps", "3", "--lr", "1e-3")
    reference, out, rates = tmp_path / "reference", tmp_path / "run", []
    original = DeepSpeedStrategy.optimizer_step

    def recorded(self):
        original(self)
        rates.append(self.step_lr)

    monkeypatch.setattr(DeepSpeedStrategy, "optimizer_step", recorded)
    assert main(flags(imdb_dir, cache_dir, reference, *ds)) == 0
    assert rates == hf_rates("cosine", 1e-3, 3, 12)
    stop = fault_rng().randint(1, 11)
    with monkeypatch.context() as patch:
        stop_at_step(patch, DeepSpeedStrategy, stop)
        assert main(flags(imdb_dir, cache_dir, out, *ds)) == EXIT_STOPPED
    assert main(flags(imdb_dir, cache_dir, out, *ds, "--resume", "auto")) == 0
    assert rates[12:] == hf_rates("cosine", 1e-3, 3, 12)  # the stopped run's steps, then the resumed one's
    assert_same_run(reference, out)


def test_a_deepspeed_json_with_its_own_optimizer_or_scheduler_refuses_ours(tmp_path):
    from fastpt.strategies.deepspeed_config import deepspeed_config

    def config(section: str, **flags) -> dict:
        path = tmp_path / f"{section}.json"
        path.write_text(json.dumps({section: {"type": "AdamW" if section == "optimizer" else "WarmupLR"}}))
        return deepspeed_config(TrainConfig(strategy="deepspeed", deepspeed_config=str(path), **flags), 1)

    assert "optimizer" in config("optimizer") and "scheduler" in config("scheduler")  # theirs, when ours is default
    with pytest.raises(ValueError, match="names its own optimizer; drop --optimizer / --weight-decay"):
        config("optimizer", optimizer="adamw")
    with pytest.raises(ValueError, match="names its own scheduler; drop --lr-schedule"):
        config("scheduler", warmup_ratio=0.1)


def test_checkpoints_from_before_these_settings_resume_as_the_articles_run(tmp_path):
    from fastpt.cli.run_folder import check_resume_compatible
    from fastpt.errors import CheckpointError

    later = ("optimizer", "weight_decay", "lr_schedule", "warmup_ratio", "warmup_steps", "class_weights")
    old = {k: v for k, v in TrainConfig().to_dict().items() if k not in later}
    state = {"config": old, "world_size": 1, "progress": {}, "training": {}, "per_rank": [{}]}
    check_resume_compatible(TrainConfig(), state, 1, tmp_path / "last.pt")  # the defaults are what it ran
    with pytest.raises(CheckpointError, match="--lr-schedule was 'constant', now 'linear'"):
        check_resume_compatible(TrainConfig(lr_schedule="linear"), state, 1, tmp_path / "last.pt")


# ---------------------------------------------------------------------------- class weights

class Eager:
    """What train.py's step functions ask of a strategy: no autocast, and compile_step (none, or a cheap full graph)."""

    def __init__(self, compile_step=lambda fn: fn):
        from fastpt.speedups.amp import MixedPrecision
        self.compile_step = compile_step
        self.precision = MixedPrecision(False, "bfloat16", torch.device("cpu"))


def weighted_batch():
    rng = np.random.default_rng(0)
    items = [(rng.integers(1, 100, size=n).astype(np.int32), label, 1.0)
             for n, label in zip([9, 30, 2, MAX_LENGTH, 17, 5], [0, 1, 1, 0, 1, 1])]
    return items, torch.tensor([0.3, 2.5])


def test_weighted_loss_is_torchs_on_padded_and_packed_batches():
    model = tiny_model("distilbert").eval()
    packed_model = PackedClassifier(copy.deepcopy(model), "loop").eval()
    items, weights = weighted_batch()
    padded, packed = Collator(0, "longest", MAX_LENGTH)(items), PackedCollator(0)(items)
    logits = model(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"]).logits
    expected = F.cross_entropy(logits, padded["labels"], weight=weights)
    assert not torch.allclose(F.cross_entropy(logits, padded["labels"]), expected)  # the weights change it

    forward_loss = make_forward_loss(Eager().precision, MAX_LENGTH, class_weights=weights)
    torch.testing.assert_close(forward_loss(model, padded)[0], expected)
    torch.testing.assert_close(forward_loss(packed_model, packed)[0], expected, rtol=1e-5, atol=1e-6)
    # evaluation: the same weighted mean, from sums that add up over batches and ranks
    with torch.no_grad():
        sums, _, _ = make_eval_sums(Eager().precision, MAX_LENGTH, class_weights=weights)(model, padded)
    torch.testing.assert_close((sums[0] / sums[3]).float(), expected.detach())
    assert sums[2] == len(items)


class BagOfWords(torch.nn.Module):
    """A stand-in classifier that torch.compile traces in a second (the loss, not the model, is under test)."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(100, 8), torch.nn.Linear(8, 2)

    def forward(self, input_ids, attention_mask):
        from transformers.modeling_outputs import SequenceClassifierOutput
        mask = attention_mask.unsqueeze(-1).float()
        return SequenceClassifierOutput(logits=self.head((self.embed(input_ids) * mask).sum(1) / mask.sum(1)))


def test_the_weighted_step_and_evaluation_compile_as_one_graph():
    """--compile compiles forward_loss and eval_sums whole (fullgraph=True), the weights inside the graph: Dynamo
    traces them here without a break (its eager backend: Inductor's code generation is not what is tested)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, (items, weights) = BagOfWords(), weighted_batch()
    batch = Collator(0, "longest", MAX_LENGTH)(items)
    full_graph = Eager(lambda fn: torch.compile(fn, backend="eager", fullgraph=True))
    expected = F.cross_entropy(model(batch["input_ids"], batch["attention_mask"]).logits, batch["labels"],
                               weight=weights)
    forward_loss = full_graph.compile_step(make_forward_loss(full_graph.precision, MAX_LENGTH, class_weights=weights))
    torch.testing.assert_close(forward_loss(model, batch)[0], expected)
    eval_sums = full_graph.compile_step(make_eval_sums(full_graph.precision, MAX_LENGTH, class_weights=weights))
    with torch.no_grad():
        sums, _, _ = eval_sums(model, batch)
    torch.testing.assert_close((sums[0] / sums[3]).float(), expected.detach())


def test_balanced_weights_follow_scikit_learns_rule():
    labels = np.array([0, 0, 0, 1, 2, 2])
    # compute_class_weight("balanced"): n_samples / (n_classes * np.bincount(y)) = 6 / (3 x [3, 1, 2])
    assert class_weights("balanced", labels, ["a", "b", "c"]) == pytest.approx([2 / 3, 2.0, 1.0], rel=1e-15)
    assert class_weights([1.0, 2.0, 3.0], labels, ["a", "b", "c"]) == [1.0, 2.0, 3.0]
    assert class_weights(None, labels, ["a", "b", "c"]) is None
    with pytest.raises(ValueError, match="'c'"):
        class_weights("balanced", np.array([0, 1, 1]), ["a", "b", "c"])  # no example of c: an infinite weight


@pytest.mark.parametrize("weights,says", [("1,x", "'x' is not a number"), ("1,-2", "positive number, got -2"),
                                          ("1,nan", "positive number"), ("2,3,1", "gives 3 weight(s), the data has 2"),
                                          ("1,", "'' is not a number")])
def test_a_bad_class_weight_list_is_one_line_and_exit_2(weights, says, tiny_args, tmp_path, capfd):
    out = tmp_path / "run"
    assert main(tiny_args("--class-weights", weights, out=out)) == EXIT_BAD_INPUT
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --class-weights") and says in err[0], err
    assert not out.exists()


# ---------------------------------------------------------------------------- label names

def integer_csv(path: Path, n: int, seed: int) -> Path:
    rng = random.Random(seed)
    words = {0: "broken rotten loud grim".split(), 1: "lovely bright sweet calm".split()}
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(("text", "label"))
        for i in range(n):
            w.writerow((" ".join(["the", "a", "box"] + [rng.choice(words[i % 2])] * 2), i % 2))
    return path


def test_label_names_name_integer_labels_in_results_and_export(own_args, tmp_path):
    data, out, export = integer_csv(tmp_path / "ints.csv", 40, 0), tmp_path / "run", tmp_path / "export"
    assert main(own_args(data, "--label-names", "neg, pos", "--export-dir", str(export))) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["label_names"] == ["neg", "pos"] and set(results["test_per_class"]) == {"neg", "pos"}
    assert json.loads((out / "config.json").read_text())["label_names"] == ["neg", "pos"]
    exported = json.loads((export / "config.json").read_text())
    assert exported["id2label"] == {"0": "neg", "1": "pos"} and exported["label2id"] == {"neg": 0, "pos": 1}


@pytest.mark.parametrize("names,says", [("a,b,c", "gives 3 name(s), the data has 2 labels (0, 1)"),
                                        ("a,a", "one distinct, non-empty name"), ("a,", "one distinct")])
def test_bad_label_names_are_one_line_and_exit_2(names, says, own_args, tmp_path, capfd):
    data, out = integer_csv(tmp_path / "ints.csv", 40, 0), tmp_path / "run"
    assert main(own_args(data, "--label-names", names)) == EXIT_BAD_INPUT
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --label-names") and says in err[0], err
    assert not out.exists()


def test_label_names_are_refused_for_labels_that_have_names(own_args, tiny_args, tmp_path, capfd):
    words = tmp_path / "words.csv"
    words.write_text("text,label\n" + "".join(f"a b c {i},{'yes' if i % 2 else 'no'}\n" for i in range(40)))
    assert main(own_args(words, "--label-names", "neg,pos")) == EXIT_BAD_INPUT
    assert "the labels in --data are names already (no, yes)" in capfd.readouterr().err
    assert main(tiny_args("--label-names", "neg,pos")) == EXIT_BAD_INPUT  # IMDB: neg, pos already
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --label-names") and "neg, pos" in err[0], err
