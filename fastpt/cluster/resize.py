"""Continuing a run on another number of processes (a node lost, or one added).

What it does: `--resume` reads last.pt, written by N processes, into a run on M. The global
batch (per-process batch x processes) is kept where M divides it: 2 processes with --batch-size
12 continue as 1 process with 24, or 4 with 6, and --grad-accum is unchanged, so every optimiser
step averages the same reviews as before. Where M does not divide it, the per-process batch that
comes closest is used and one line says what changed. The data position is a count of reviews
into the epoch's order, which is the same on any number of processes (data.TrainBatchSampler),
so the resumed epoch trains on exactly the reviews the earlier run had not reached.

The state that last.pt keeps per rank is mapped onto the new ranks:
- the epoch's metric sums are added up and given to rank 0 (the epoch's loss and accuracy are
  sums over ranks, so they come out exact);
- the loss window since the last log line likewise, scaled so the next logged mean is exact;
- RNG states (dropout masks): rank r keeps old rank r's; a new rank gets one derived from
  (seed, rank, step). Dropout masks therefore differ from any uninterrupted run: a resized run is
  not bitwise equal to one, only statistically the same training.

The model and optimiser state: DDP's and FSDP's last.pt hold them whole (FSDP gathers them), so
any world size loads them. DeepSpeed ZeRO-1/2 checkpoints hold one shard per process; a run on
another number of processes converts them to DeepSpeed's universal checkpoint first
(strategies/deepspeed.py). ZeRO-3 is not offered: it is untested here.

Why: a lost node should not mean starting over; the survivors continue the run. What it costs:
a per-process batch that grows when processes are lost (memory), and the dropout masks above.
Lightning has no flag for this.
"""

import dataclasses

import torch

from fastpt.errors import CheckpointError
from fastpt.files import checkpoint


def resizable(cfg) -> bool:
    """Strategies whose checkpoint loads on any number of processes."""
    return cfg.strategy in ("single", "ddp", "fsdp") or (cfg.strategy == "deepspeed" and cfg.zero_stage in (1, 2))


def batch_size_flag(state: dict) -> int:
    """The --batch-size the run was started with (a resized run keeps its own per-process batch)."""
    return state.get("batch_size_flag") or state["config"]["batch_size"]


def accepts_batch_size(batch_size: int, saved_batch: int, flag: int | None, saved_world: int, world: int) -> bool:
    """--batch-size on a resume: the saved run's, the one it was started with, or one that keeps the global batch."""
    return batch_size in (saved_batch, flag) or batch_size * world == saved_batch * saved_world


def adapt(cfg, state: dict, world_size: int) -> tuple:
    """Fit the checkpointed run to world_size processes: the per-process batch, the data position, per-rank state.

    Returns (the config with that batch, a new value; the line that says what changed, None if nothing
    did). The resume state is changed in place.
    """
    saved_world, saved_batch = state["world_size"], state["config"]["batch_size"]
    state["batch_size_flag"] = batch_size_flag(state)
    if saved_world == world_size:
        # the flag it was started with may differ after an earlier resize
        return dataclasses.replace(cfg, batch_size=saved_batch), None
    if not resizable(cfg):
        raise CheckpointError(f"cannot continue a --zero-stage {cfg.zero_stage} run on {world_size} process(es): "
                              f"it was written by {saved_world}; resume it with {saved_world}")
    global_batch = saved_batch * saved_world
    batch = max(1, round(global_batch / world_size))  # global_batch // world_size where it divides
    new_global = batch * world_size
    progress = state["progress"]
    position = progress.get("examples_in_epoch", progress["batch_in_epoch"] * global_batch)
    if new_global != global_batch and cfg.bucket and position % new_global:
        raise CheckpointError(f"cannot continue a --bucket run mid-epoch on {world_size} process(es): its global "
                              f"batch of {global_batch} does not divide by {world_size}; resume it on a number of "
                              f"processes that divides {global_batch}")
    cfg = dataclasses.replace(cfg, batch_size=batch)
    state["progress"] = {**progress, "batch_in_epoch": position // new_global, "epoch_offset": position % new_global}
    state["per_rank"] = remap_per_rank(state["per_rank"], world_size, cfg.seed, progress["global_step"])
    state["world_size"] = world_size
    accum = f" x --grad-accum {cfg.grad_accum}" if cfg.grad_accum > 1 else ""
    if new_global == global_batch:
        return cfg, (f"note: continuing on {world_size} process(es) instead of {saved_world}: --batch-size "
                     f"{saved_batch} -> {batch} per process keeps the global batch of {global_batch}{accum}")
    return cfg, (f"note: continuing on {world_size} process(es) instead of {saved_world}: the global batch of "
                 f"{global_batch} does not divide by {world_size}, so it changes to {new_global}{accum} "
                 f"(--batch-size {saved_batch} -> {batch} per process); the epoch continues where it stopped")


def remap_per_rank(per_rank: list[dict], world_size: int, seed: int, step: int) -> list[dict]:
    """last.pt's per-rank states for world_size ranks (see the module docstring)."""
    old_world = len(per_rank)
    sums = [r["epoch_sums"] for r in per_rank if r.get("epoch_sums") is not None]
    epoch_sums = torch.stack(sums).sum(0) if sums else None
    windows = [r["window"] for r in per_rank if r.get("window") is not None]
    # A logged loss is sum(window) / (count x ranks): keep that mean when the number of ranks changes.
    window_loss = sum(w[0] for w in windows) * world_size / old_world if windows else None
    out = []
    for rank in range(world_size):
        mine = dict(per_rank[min(rank, old_world - 1)])
        mine["rng"] = per_rank[rank]["rng"] if rank < old_world else derived_rng_state(seed, rank, step)
        if epoch_sums is not None:
            mine["epoch_sums"] = epoch_sums.clone() if rank == 0 else torch.zeros_like(epoch_sums)
        if window_loss is not None:
            mine["window"] = (window_loss.clone() if rank == 0 else torch.zeros_like(window_loss), windows[0][1])
        out.append(mine)
    return out


def derived_rng_state(seed: int, rank: int, step: int) -> dict:
    """An RNG state (checkpoint.rng_state's layout) for a rank that did not exist: fixed by (seed, rank, step)."""
    return checkpoint.rng_state(seed=(seed * 1_000_003 + rank * 10_007 + step) % 2**32)
