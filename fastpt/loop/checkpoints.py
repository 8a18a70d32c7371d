"""The best and the last checkpoint: what a run saves while it trains, and what it loads back.

    checkpoints/best.pt   the weights of the best epoch so far (`save_best`), replaced only when the
                          monitored value strictly improves (early_stopping.BestTracker); the test
                          runs on them (`load_best`, --test-on best)
    checkpoints/last.pt   everything to continue exactly from a step (`save_last`): weights,
                          optimiser, scaler and schedule (the strategy's `training_state`), every
                          rank's RNG and running sums, the position, the record; `restore` reads it back

Why: the best checkpoint lets a run that trained past its best still test on the best weights;
the last one lets a stopped run (a signal, a time limit, a crash) continue bitwise where it was,
instead of starting over. What it costs: a write of the weights at every improvement, and of the
whole training state at every --save-every steps, --save-every-minutes and at each epoch's end.

Both are written atomically (a temporary file, then a rename: a crash never leaves half a file
where a whole one was) and read with `torch.load(weights_only=True)` (files/checkpoint.py). The
weights are the unwrapped model's (`strategy.model_state_dict()`: no `_orig_mod.` or `module.`
prefixes, gathered whole where FSDP or ZeRO shard them), so best.pt loads into a plain model.
Each file keeps the run's config as config.json has it (`build.saved_config`).

Lightning: `ModelCheckpoint(monitor, mode, save_top_k=1, save_last=True)` and
`Trainer.fit(ckpt_path="last")`, `Trainer.test(ckpt_path="best")`.
"""

from pathlib import Path

from fastpt.cluster import distributed
from fastpt.files import checkpoint
from fastpt.loop.bookkeeping import Bookkeeping
from fastpt.loop.record import RunRecord


def save_best(ckpt_dir: Path, config: dict, dist, strategy, epoch: int, step: int, value: float) -> None:
    """checkpoints/best.pt: the weights of the best epoch so far, with the config and the monitored value."""
    state = strategy.model_state_dict()  # a collective where the model is sharded
    if dist.is_main:
        checkpoint.save_atomic({"model": state, "config": config, "epoch": epoch, "step": step,
                                "monitor": config["monitor"], "value": value}, ckpt_dir / "best.pt")


def save_last(ckpt_dir: Path, config: dict, dist, strategy, bookkeeping: Bookkeeping, record: RunRecord,
              train_sampler) -> None:
    """checkpoints/last.pt: everything needed to continue exactly from this step.

    Per rank: the RNG states (dropout masks) and the running sums kept on the device, so a resumed
    run logs, averages and draws exactly what the uninterrupted run would have.
    """
    training = strategy.training_state(ckpt_dir)
    this_rank = checkpoint.to_bytes({"rng": checkpoint.rng_state(), **bookkeeping.sums.rank_state()})
    per_rank = [checkpoint.from_bytes(b) for b in distributed.all_gather_object(this_rank)]
    if dist.is_main:
        done = bookkeeping.position.batch_in_epoch  # the position in the epoch's order, on any number of processes
        examples_in_epoch = record.epoch_offset + done * train_sampler.global_batch_size if done else 0
        state = {
            "config": config,
            "world_size": dist.world_size,
            "training": training,
            "progress": {**bookkeeping.position.state(), **bookkeeping.clocks.state(), "val_time_s": record.val_time_s,
                         "val_compile_s": record.val_compile_s, "examples_in_epoch": examples_in_epoch},
            "batch_size_flag": record.batch_size_flag,
            # the attention's measured precision: a resumed run keeps it (speedups/attention_precision.py)
            "attention_precision": getattr(strategy.module, "attention_precision", None),
            "early_stopping": record.early_stopping.state_dict(),
            "best": record.best.state_dict(),
            "history": record.history,
            "per_rank": per_rank,
        }
        checkpoint.save_atomic(state, ckpt_dir / "last.pt")
    # Every rank leaves only once last.pt is on disk: after a stop, a launcher (torchrun, srun
    # --kill-on-bad-exit) kills the other workers as soon as one has exited.
    distributed.barrier()


def restore(state: dict, ckpt_dir: Path, dist, strategy, record: RunRecord) -> None:
    """Model, optimiser, scaler, RNG, early stopping and history from last.pt.

    The bookkeeping's parts read their own (position, sums, clocks) when they are built."""
    strategy.load_training_state(state["training"], ckpt_dir)
    if state["early_stopping"]:
        record.early_stopping.load_state_dict(state["early_stopping"])
    record.best.load_state_dict(state["best"])
    record.history = list(state["history"])
    record.val_time_s = state["progress"].get("val_time_s", 0.0)
    record.val_compile_s = state["progress"].get("val_compile_s", 0.0)
    checkpoint.set_rng_state(state["per_rank"][dist.rank]["rng"])


def load_best(ckpt_dir: Path, test_on: str, dist, strategy) -> str:
    """The weights to test: best.pt's (--test-on best, where one was saved), else the last ones. Which, in words."""
    if test_on != "best":
        return test_on
    best_path = ckpt_dir / "best.pt"
    # Rank 0 wrote best.pt and reads it; the weights reach the other ranks over the group,
    # so no rank needs to see rank 0's disk.
    weights = checkpoint.load_model_weights(best_path) if dist.is_main and best_path.exists() else None
    weights = distributed.broadcast_state(weights)
    if weights is None:
        return "last (no best checkpoint)"
    strategy.load_model_state_dict(weights)
    return "best"
