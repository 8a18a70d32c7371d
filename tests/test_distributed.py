"""DDP, FSDP and DeepSpeed ZeRO-1/2/3 on two gloo processes, against references.

One torchrun launch (tests/dist/run_many.py) trains every strategy in turn on the tiny model
without dropout, so the runs differ only in how the work is split over the two processes:
- DDP with batch B must follow one process with batch 2B, step by step, to the same weights;
- FSDP and ZeRO must follow DDP's losses, and their best.pt must load into a plain model and
  give, in one process, exactly the test accuracy the two ranks reported;
- sharded runs must hold about half of DDP's bytes per rank where they shard;
- every run stops early at the same step on both ranks (min-delta 1.0 makes epoch 2 stall);
- every run uses AdamW with transformers' decay groups and 4 warmup steps (the optimiser groups and
  the schedule through DDP, FSDP2's sharded parameters and DeepSpeed's engine);
- validation (15) and test (31) sizes are odd, so ranks get unequal shares;
- with `--pack`, DDP, FSDP and ZeRO-2 follow one packed process with batch 2B, which itself
  follows the padded one (no dropout: packed attention's missing dropout changes nothing).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fastpt.inputs import data, token_cache
from fastpt.inputs.models import load_model, load_tokenizer
from fastpt.config import TrainConfig
from fastpt.loop.evaluation import evaluate
from fastpt.files.checkpoint import load, load_model_weights
from fastpt.cluster.distributed import DistInfo
from fastpt.strategies.base import Strategy
from train import main as train_main


ROOT = Path(__file__).resolve().parent.parent
RUN_MANY = ROOT / "tests" / "dist" / "run_many.py"
STRATEGIES = {"ddp": ["--ddp"], "fsdp": ["--fsdp"], "zero1": ["--deepspeed", "--zero-stage", "1"],
              "zero2": ["--deepspeed", "--zero-stage", "2"], "zero3": ["--deepspeed", "--zero-stage", "3"]}
RESUMED = ("fsdp", "zero3")  # resume through gathered full state (FSDP) and engine checkpoints (ZeRO)
PACKED = {f"{name}_pack": [*STRATEGIES[name], "--pack"] for name in ("ddp", "fsdp", "zero2")}
MAX_LENGTH, BATCH, TEST_SIZE = 32, 4, 31
STEPS_PER_EPOCH = 112 // (2 * BATCH)  # 112 training reviews in the tiny data set

pytestmark = pytest.mark.timeout(600)  # the first test also waits for the shared torchrun launch


def common_args(imdb_dir, cache_dir, batch: int) -> list[str]:
    return ["--model", "tiny", "--data-dir", str(imdb_dir), "--cache-dir", str(cache_dir),
            "--max-length", str(MAX_LENGTH), "--batch-size", str(batch), "--lr", "1e-3",
            "--epochs", "3", "--early-stopping-patience", "1", "--min-delta", "1.0",
            "--val-size", "15", "--test-size", str(TEST_SIZE), "--log-every", "1",
            "--save-every", "1000",  # last.pt at each epoch's end: the final weights
            # Trainer's AdamW groups and a warmup on every strategy (a constant rate after it: the runs
            # resumed with more epochs follow the same rates; test_optimization.py checks the decays)
            "--optimizer", "adamw", "--weight-decay", "0.01", "--warmup-steps", "4",
            "--no-progress"]


def torchrun(script_args: list[str], timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", *script_args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


@pytest.fixture(scope="module")
def runs(imdb_dir, cache_dir, tmp_path_factory):
    """{name: out dir} for every strategy on 2 ranks plus 'single' (1 process, batch 2B); {name: per-rank reports}."""
    root = tmp_path_factory.mktemp("dist")
    outs = {name: root / name for name in STRATEGIES}
    argv = ["--no-dropout"]
    for name, flags in {**STRATEGIES, **PACKED}.items():
        outs[name] = root / name
        argv += ["--", *common_args(imdb_dir, cache_dir, BATCH), "--out", str(outs[name]), *flags]
    for name in RESUMED:  # one epoch, then continue from checkpoints/last.pt in a fresh run
        outs[f"{name}_resumed"] = out = root / f"{name}_resumed"
        argv += ["--", *common_args(imdb_dir, cache_dir, BATCH), "--out", str(out), *STRATEGIES[name], "--epochs", "1"]
        argv += ["--", *common_args(imdb_dir, cache_dir, BATCH), "--out", str(out), *STRATEGIES[name],
                 "--resume", "auto"]
    torchrun([str(RUN_MANY), *argv], timeout=420)
    reports = {name: [json.loads((outs[name] / f"rank{r}_result.json").read_text()) for r in range(2)]
               for name in STRATEGIES}

    # The reference: one process, twice the batch, same model without dropout.
    outs["single"], outs["single_pack"] = root / "single", root / "single_pack"
    with pytest.MonkeyPatch.context() as mp:
        from fastpt.inputs import models
        sys.path.insert(0, str(RUN_MANY.parent))
        import run_many
        mp.setattr(models, "tiny_config", run_many.no_dropout_tiny_config)
        assert train_main(common_args(imdb_dir, cache_dir, 2 * BATCH) + ["--out", str(outs["single"])]) == 0
        pack_args = common_args(imdb_dir, cache_dir, 2 * BATCH) + ["--out", str(outs["single_pack"]), "--pack"]
        assert train_main(pack_args) == 0
    return outs, reports


def step_losses(out: Path) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(out / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    return [e.value for e in events.Scalars("train/loss")]


def results(out: Path) -> dict:
    return json.loads((out / "results.json").read_text())


def plain_evaluation(best_pt: Path, imdb_dir, cache_dir) -> dict:
    """best.pt in a plain model, evaluated in this process on the same test reviews."""
    model = load_model("tiny", random_init=True)
    model.load_state_dict(load_model_weights(best_pt), strict=True)
    strategy = Strategy(TrainConfig(), DistInfo(0, 0, 1, torch.device("cpu")))
    strategy.setup(model)
    tokenizer = load_tokenizer("tiny")
    splits, _ = token_cache.prepare_splits(str(imdb_dir), str(cache_dir), tokenizer, MAX_LENGTH)
    test = splits["test"].head(TEST_SIZE)
    loader = data.make_loader(test, data.EvalBatchSampler(test, 5, 0, 1),
                              data.Collator(tokenizer.pad_token_id or 0, "max_length", MAX_LENGTH), 0, False, 0)
    return evaluate(strategy, loader)


def test_ddp_matches_one_process_with_twice_the_batch(runs):
    outs, _ = runs
    single, ddp = step_losses(outs["single"]), step_losses(outs["ddp"])
    assert len(ddp) == len(single) == 2 * STEPS_PER_EPOCH
    assert max(single) - min(single) > 1e-3  # the model learns: the curves have something to match
    torch.testing.assert_close(torch.tensor(ddp), torch.tensor(single), rtol=1e-4, atol=1e-5)
    final_single = load(outs["single"] / "checkpoints" / "last.pt")["training"]["model"]
    final_ddp = load(outs["ddp"] / "checkpoints" / "last.pt")["training"]["model"]
    assert final_ddp.keys() == final_single.keys()
    for name in final_single:
        torch.testing.assert_close(final_ddp[name], final_single[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("name", ["fsdp", "zero1", "zero2", "zero3"])
def test_sharded_strategy_matches_ddp_and_best_pt_loads_into_plain_model(runs, name, imdb_dir, cache_dir):
    outs, _ = runs
    torch.testing.assert_close(torch.tensor(step_losses(outs[name])), torch.tensor(step_losses(outs["ddp"])),
                               rtol=1e-4, atol=1e-5)
    reported = results(outs[name])
    assert reported["tested_on"] == "best" and reported["test_examples"] == TEST_SIZE
    plain = plain_evaluation(outs[name] / "checkpoints" / "best.pt", imdb_dir, cache_dir)
    assert plain["n"] == TEST_SIZE
    assert plain["acc"] == reported["test_acc"]  # exactly: same weights, every review counted once
    assert plain["loss"] == pytest.approx(reported["test_loss"], rel=1e-5)


def test_packed_single_process_follows_the_padded_one(runs):
    outs, _ = runs
    packed_losses, padded_losses = step_losses(outs["single_pack"]), step_losses(outs["single"])
    torch.testing.assert_close(torch.tensor(packed_losses), torch.tensor(padded_losses), rtol=1e-4, atol=1e-5)
    packed, padded = results(outs["single_pack"]), results(outs["single"])
    assert packed["padding_efficiency"] == 1.0 > padded["padding_efficiency"]
    assert packed["test_acc"] == padded["test_acc"]


@pytest.mark.parametrize("name", sorted(PACKED))
def test_packed_strategy_matches_one_packed_process_and_best_pt_loads_padded(runs, name, imdb_dir, cache_dir):
    outs, _ = runs
    torch.testing.assert_close(torch.tensor(step_losses(outs[name])), torch.tensor(step_losses(outs["single_pack"])),
                               rtol=1e-4, atol=1e-5)
    reported = results(outs[name])
    plain = plain_evaluation(outs[name] / "checkpoints" / "best.pt", imdb_dir, cache_dir)  # padded, plain model
    assert (plain["acc"], plain["n"]) == (reported["test_acc"], TEST_SIZE)
    assert plain["loss"] == pytest.approx(reported["test_loss"], rel=1e-4)


@pytest.mark.parametrize("name", RESUMED)
def test_resumed_sharded_run_continues_the_uninterrupted_one(runs, name):
    outs, _ = runs
    resumed = outs[f"{name}_resumed"]
    torch.testing.assert_close(torch.tensor(step_losses(resumed)), torch.tensor(step_losses(outs[name])),
                               rtol=1e-4, atol=1e-5)
    assert results(resumed)["test_acc"] == results(outs[name])["test_acc"]


def test_evaluation_over_two_ranks_counts_odd_splits_once(runs, imdb_dir, cache_dir):
    outs, _ = runs
    two_ranks = results(outs["ddp"])
    assert two_ranks["test_examples"] == TEST_SIZE
    plain = plain_evaluation(outs["ddp"] / "checkpoints" / "best.pt", imdb_dir, cache_dir)
    assert (plain["acc"], plain["n"]) == (two_ranks["test_acc"], two_ranks["test_examples"])
    assert plain["loss"] == pytest.approx(two_ranks["test_loss"], rel=1e-5)


@pytest.mark.parametrize("n,world,sort", [(31, 2, False), (31, 2, True), (15, 2, False), (10, 3, True)])
def test_eval_sampler_gives_every_example_to_one_rank(n, world, sort):
    lengths = (np.arange(n) * 7) % 5 + 1  # varied, so sorting by length reorders
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    dataset = data.TokenizedSplit(np.zeros(offsets[-1], dtype=np.int32), offsets, np.zeros(n, dtype=np.int64))
    counted, batches = [], []
    for rank in range(world):
        sampler = data.EvalBatchSampler(dataset, 4, rank, world, sort_by_length=sort)
        batches.append(len(sampler))
        counted += [i for batch in sampler for i, weight in batch if weight > 0]
    assert sorted(counted) == list(range(n))
    assert len(set(batches)) == 1  # equal batch counts: sharded models run collectives in forward


def test_memory_per_rank_is_about_half_where_sharded(runs):
    outs, _ = runs
    memory = {name: results(outs[name])["memory_per_rank"] for name in STRATEGIES}
    for name, per_rank in memory.items():
        assert len(per_rank) == 2, name
    ddp = memory["ddp"][0]
    sharded = {"fsdp": ("param_bytes", "grad_bytes", "optimizer_bytes"),
               "zero1": ("optimizer_bytes",),
               "zero2": ("grad_bytes", "optimizer_bytes"),
               "zero3": ("param_bytes", "grad_bytes", "optimizer_bytes")}
    for name, keys in sharded.items():
        for rank in range(2):
            for key in ("param_bytes", "grad_bytes", "optimizer_bytes"):
                ratio = memory[name][rank][key] / ddp[key]
                expected = 0.5 if key in keys else 1.0
                assert ratio == pytest.approx(expected, abs=0.02), (name, rank, key, ratio)
    print({name: per_rank[0] for name, per_rank in memory.items()})


def test_every_rank_stops_early_at_the_same_step(runs):
    _, reports = runs
    for mine in reports.values():
        assert [r["rank"] for r in mine] == [0, 1]
        assert all(r["stopped_early"] and r["epochs_run"] == 2 for r in mine), mine
        assert {r["global_steps"] for r in mine} == {2 * STEPS_PER_EPOCH}, mine


@pytest.mark.slow  # 90 s on a 2-core AVX2 CPU (bfloat16 emulated): compile and DDP are each in the default set
@pytest.mark.timeout(420)
def test_torchrun_train_py_ddp_bf16_compiled(imdb_dir, cache_dir, tmp_path):
    out = tmp_path / "cli"
    torchrun(["train.py", "--ddp", "--amp", "--amp-dtype", "bfloat16", "--compile", "--model", "tiny",
              "--data-dir", str(imdb_dir), "--cache-dir", str(cache_dir), "--max-length", str(MAX_LENGTH),
              "--batch-size", "8", "--epochs", "1", "--max-steps", "3", "--val-size", "8", "--test-size", "9",
              "--no-progress", "--out", str(out)], timeout=400)
    reported = results(out)
    assert (reported["strategy"], reported["world_size"], reported["global_steps"]) == ("ddp", 2, 3)
    assert reported["test_examples"] == 9
    assert (out / "checkpoints" / "best.pt").is_file()


def test_fastpt_runs_without_deepspeed(monkeypatch, tiny_args, capsys):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # as if not installed
    assert train_main(tiny_args("--deepspeed")) == 2
    assert "needs the deepspeed package" in capsys.readouterr().err
    from fastpt.strategies import build_strategy
    strategy = build_strategy(TrainConfig(strategy="ddp"), DistInfo(0, 0, 1, torch.device("cpu")))
    assert strategy.name == "ddp"
