"""Continuing a run on another number of processes (resize.py), and tokens balanced across ranks (--pack).

End to end, on two gloo processes (tests/dist/resize_runs.py, the tiny model without dropout):
DDP, FSDP and ZeRO-2 are stopped mid-epoch (SIGTERM after step STOP, last.pt saved), then continued
on 1 and on 4 processes. Each continuation must train on exactly the reviews of the epoch that the
stopped run had not reached, one global batch per step as the uninterrupted 2-process run, and
follow its losses step by step to its test accuracy: the global batch is kept, so only the split
of each batch over processes differs.

Unit tests: the training order is the same on any number of processes; a position maps to the
same remainder (also where the global batch cannot be kept); per-rank state is merged without
losing a sum; the token-balanced split keeps each global batch and evens out the ranks.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from fastpt.inputs import data
from fastpt.config import TrainConfig
from fastpt.cluster import resize
from fastpt.files.checkpoint import load
from fastpt.errors import CheckpointError
from train import main as train_main
from test_distributed import results, step_losses  # the same readers of a run folder


ROOT = Path(__file__).resolve().parent.parent
DRIVER = ROOT / "tests" / "dist" / "resize_runs.py"
STRATEGIES = {"ddp": ["--ddp"], "fsdp": ["--fsdp"], "zero2": ["--deepspeed", "--zero-stage", "2"]}
BATCH, STOP = 4, 5  # 2 processes x 4 = global batch 8: 14 steps in the tiny set's 112 reviews
TRAIN, STEPS = 112, 112 // 8


# --------------------------------------------------------------------------- unit tests: the order

def made_up_split(n: int, seed: int = 0) -> data.TokenizedSplit:
    lengths = np.random.default_rng(seed).integers(5, 512, size=n)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return data.TokenizedSplit(np.zeros(offsets[-1], dtype=np.int32), offsets, np.zeros(n, dtype=np.int64))


def global_batches(split, batch_size, world_size, epoch=3, start_batch=0, offset=0, **kw) -> list[list[int]]:
    """Per step, the reviews of all ranks together, as each rank's sampler gives them."""
    per_rank = []
    for rank in range(world_size):
        sampler = data.TrainBatchSampler(split, batch_size, rank, world_size, seed=7, **kw)
        sampler.set_epoch(epoch, start_batch, offset)
        per_rank.append(list(sampler))
        assert len(per_rank[-1]) == len(sampler)
    assert len({len(batches) for batches in per_rank}) == 1  # every rank runs the same number of steps
    return [sum(step, []) for step in zip(*per_rank)]


@pytest.mark.parametrize("balance", [False, True])
def test_the_order_is_the_same_on_any_number_of_processes(balance):
    split = made_up_split(100)
    two = global_batches(split, 6, 2, balance_tokens=balance)
    assert len(two) == 100 // 12
    for batch_size, world_size in ((12, 1), (3, 4), (2, 6)):
        other = global_batches(split, batch_size, world_size, balance_tokens=balance)
        assert [sorted(b) for b in other] == [sorted(b) for b in two]
    seen = [i for b in two for i in b]
    assert len(seen) == len(set(seen)) == 96  # each review once; the last 4 (no full global batch) dropped


def test_the_unchanged_order_is_distributed_samplers():
    """Where the set divides, the shares are exactly DistributedSampler's (the runs before this change)."""
    from torch.utils.data import DistributedSampler

    split = made_up_split(112)
    for rank in range(2):
        reference = DistributedSampler(split, num_replicas=2, rank=rank, shuffle=True, seed=7)
        reference.set_epoch(3)
        indices = list(reference)
        sampler = data.TrainBatchSampler(split, 4, rank, 2, seed=7)
        sampler.set_epoch(3)
        assert list(sampler) == [indices[i:i + 4] for i in range(0, len(indices), 4)]


@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_a_resumed_epoch_continues_with_exactly_the_rest(world_size):
    """2 processes x 4 stopped after 5 steps; continued on world_size processes via resize.adapt."""
    split = made_up_split(113)
    before = global_batches(split, 4, 2)[:5]
    state = fake_state(world_size=2, batch_size=4, batch_in_epoch=5)
    cfg = TrainConfig(batch_size=4, strategy="ddp")
    cfg, note = resize.adapt(cfg, state, world_size)
    progress = state["progress"]
    after = global_batches(split, cfg.batch_size, world_size, start_batch=progress["batch_in_epoch"],
                           offset=progress["epoch_offset"])
    whole = global_batches(split, 4, 2)
    trained = [i for b in before + after for i in b]
    assert len(trained) == len(set(trained))  # nothing twice
    if 8 % world_size == 0:
        assert cfg.batch_size * world_size == 8 and "keeps the global batch of 8" in note
        assert [sorted(b) for b in after] == [sorted(b) for b in whole[5:]]  # the same steps as without a stop
    else:  # 3 processes: batch 3, global 9; the rest of the same order, cut in 9s
        assert cfg.batch_size == 3 and "changes to 9" in note
        rest = epoch_order(split)[40:]
        assert [sorted(b) for b in after] == [sorted(rest[i:i + 9]) for i in range(0, len(rest) - 8, 9)]
        assert len(rest) - 9 * len(after) < 9  # only what makes no full global batch is left out


def epoch_order(split, seed: int = 7, epoch: int = 3) -> list[int]:
    return torch.randperm(len(split), generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def fake_state(world_size: int, batch_size: int, batch_in_epoch: int) -> dict:
    per_rank = [{"rng": {"rank": r}, "epoch_sums": torch.tensor([2.0 * (r + 1), 3.0, 4.0], dtype=torch.float64),
                 "window": (torch.tensor(0.5 * (r + 1), dtype=torch.float64), 3)} for r in range(world_size)]
    return {"world_size": world_size, "config": {"batch_size": batch_size},
            "progress": {"epoch": 3, "batch_in_epoch": batch_in_epoch, "global_step": 40}, "per_rank": per_rank}


def test_per_rank_state_is_merged_without_losing_a_sum():
    state = fake_state(world_size=2, batch_size=4, batch_in_epoch=5)
    resize.adapt(TrainConfig(batch_size=4, strategy="fsdp"), state, 4)
    ranks = state["per_rank"]
    assert len(ranks) == 4 and state["world_size"] == 4
    assert torch.equal(sum(r["epoch_sums"] for r in ranks), torch.tensor([6.0, 6.0, 8.0], dtype=torch.float64))
    # logged loss = sum(window) / (count x ranks): 1.5 / (3 x 2) before, the same on 4 ranks
    assert float(sum(r["window"][0] for r in ranks)) / (3 * 4) == pytest.approx(1.5 / (3 * 2))
    assert [r["rng"] for r in ranks[:2]] == [{"rank": 0}, {"rank": 1}]
    new = ranks[2]["rng"]
    assert torch.equal(new["torch"], resize.derived_rng_state(TrainConfig().seed, 2, 40)["torch"])  # deterministic
    assert not torch.equal(new["torch"], ranks[3]["rng"]["torch"])


def test_zero3_and_same_size_resumes():
    state = fake_state(world_size=2, batch_size=4, batch_in_epoch=5)
    with pytest.raises(CheckpointError, match="resume it with 2"):
        resize.adapt(TrainConfig(batch_size=4, strategy="deepspeed", zero_stage=3), state, 1)
    cfg, note = resize.adapt(TrainConfig(batch_size=4, strategy="ddp"), fake_state(2, 8, 5), 2)
    assert note is None and cfg.batch_size == 8  # same size: the saved batch
    assert resize.accepts_batch_size(4, 8, 4, 2, 1) and resize.accepts_batch_size(16, 8, 4, 2, 1)
    assert not resize.accepts_batch_size(5, 8, 4, 2, 1)


# --------------------------------------------------------------------------- unit tests: balanced packing

def test_balanced_split_keeps_the_global_batch_and_evens_out_tokens():
    split = made_up_split(4000, seed=1)
    for world_size in (2, 4):
        plain = data.TrainBatchSampler(split, 12, 0, world_size, seed=7)
        balanced = data.TrainBatchSampler(split, 12, 0, world_size, seed=7, balance_tokens=True)
        for global_batch in plain.global_batches()[:20]:
            shares = balanced.shares(global_batch)
            assert [len(s) for s in shares] == [12] * world_size
            assert Counter(i for s in shares for i in s) == Counter(global_batch)
        before, after = data.rank_token_imbalance(plain), data.rank_token_imbalance(balanced)
        assert after < 1.01 < 1.05 < before, (world_size, before, after)


# --------------------------------------------------------------------------- end to end

def common_args(imdb_dir, cache_dir, out: Path, flags: list[str]) -> list[str]:
    return ["--model", "tiny", "--data-dir", str(imdb_dir), "--cache-dir", str(cache_dir), "--max-length", "32",
            "--batch-size", str(BATCH), "--lr", "1e-3", "--epochs", "1", "--val-size", "8", "--test-size", "16",
            "--log-every", "1", "--no-progress", "--out", str(out), *flags]


def torchrun(nproc: int, runs: list[list[str]], timeout: int) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    argv = [a for args in runs for a in ("--", *args)]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone",
           str(DRIVER), *argv]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stderr


@pytest.fixture(scope="module")
def resized(imdb_dir, cache_dir, tmp_path_factory):
    """{(strategy, kind): run folder} for kind in full (2 processes), stopped (2), on1 and on4 (continued)."""
    root = tmp_path_factory.mktemp("resize")
    outs = {(s, kind): root / f"{s}-{kind}" for s in STRATEGIES for kind in ("full", "stopped", "on1", "on4")}
    runs = []
    for s, flags in STRATEGIES.items():
        runs.append(common_args(imdb_dir, cache_dir, outs[s, "full"], flags))
        runs.append(["--stop-at", str(STOP), *common_args(imdb_dir, cache_dir, outs[s, "stopped"], flags)])
    torchrun(2, runs, timeout=300)
    for s in STRATEGIES:
        for kind in ("on1", "on4"):
            shutil.copytree(outs[s, "stopped"], outs[s, kind])
            for f in outs[s, kind].glob("batches-rank*.jsonl"):
                f.unlink()
    notes = {}
    for nproc in (1, 4):
        resumes = [common_args(imdb_dir, cache_dir, outs[s, f"on{nproc}"], [*flags, "--resume", "auto"])
                   for s, flags in STRATEGIES.items()]
        notes[nproc] = torchrun(nproc, resumes, timeout=300)
    return outs, notes


def steps_trained(out: Path) -> list[list[int]]:
    """Per step of the epoch, the reviews all ranks trained on (from the driver's record)."""
    ranks = []
    for path in sorted(out.glob("batches-rank*.jsonl")):
        ranks.append([json.loads(line) for line in path.read_text().splitlines()])
    steps = {}
    for rank in ranks:
        for record in rank:
            steps.setdefault(record["step_batch"], []).extend(record["indices"])
    return [sorted(steps[k]) for k in sorted(steps)]


@pytest.mark.slow  # three torchrun launches (2, 1 and 4 processes), 12 tiny runs: minutes on 2 busy cores
@pytest.mark.timeout(900)
@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("nproc", [1, 4])
def test_a_stopped_run_continues_on_another_number_of_processes(resized, strategy, nproc):
    outs, notes = resized
    full, stopped, cont = outs[strategy, "full"], outs[strategy, "stopped"], outs[strategy, f"on{nproc}"]
    assert load(stopped / "checkpoints" / "last.pt")["progress"]["global_step"] == STOP
    assert f"--batch-size {BATCH} -> {8 // nproc} per process keeps the global batch of 8" in notes[nproc]
    # The data: the stopped run's steps, then exactly the rest of the epoch, step for step as without a stop.
    whole, first, rest = steps_trained(full), steps_trained(stopped)[:STOP], steps_trained(cont)
    assert len(whole) == STEPS and len(rest) == STEPS - STOP
    assert first + rest == whole
    assert sorted(i for step in first + rest for i in step) == sorted(i for step in whole for i in step)
    assert len({i for step in whole for i in step}) == TRAIN
    # The training: the same losses as the uninterrupted run (the same reviews per step), the same test.
    torch.testing.assert_close(torch.tensor(step_losses(cont)), torch.tensor(step_losses(full)), rtol=1e-4, atol=1e-5)
    got, want = results(cont), results(full)
    assert (got["world_size"], got["global_steps"]) == (nproc, STEPS)
    assert got["test_acc"] == pytest.approx(want["test_acc"], abs=1 / 16)
    assert got["test_loss"] == pytest.approx(want["test_loss"], rel=1e-3)
    assert json.loads((cont / "config.json").read_text())["batch_size"] == 8 // nproc


@pytest.mark.slow  # it reads a last.pt of the resize launches above
def test_a_different_batch_size_on_resume_is_still_refused(resized, imdb_dir, cache_dir, capsys):
    outs, _ = resized
    args = common_args(imdb_dir, cache_dir, outs["ddp", "on1"], ["--ddp", "--epochs", "2", "--resume", "auto"])
    assert train_main([*args, "--batch-size", "5"]) == 2
    assert "--batch-size was 4, now 5" in capsys.readouterr().err  # the stopped run's last.pt (2 x 4)
