"""What a run writes into its folder, and what a resume reads back: checkpoints/best.pt,
checkpoints/last.pt, results.json, predictions.csv and the --export-dir model folder.

Each function takes what it writes as arguments; train.py calls them in the run's order. The
run's own record (the epochs' history, validation times, the best and early-stopping trackers,
where the epoch's order stands) is one `loop/record.py:RunRecord`, kept in last.pt and read back
by `restore`. The folder itself (its lock, whether and what to resume) is run_folder.py's.
"""

from __future__ import annotations

from pathlib import Path

import torch

from fastpt.inputs import data, own_data, token_cache
from fastpt.loop.evaluation import f1_by_class, per_class
from fastpt.loop.record import RunRecord
from fastpt.files import checkpoint
from fastpt.cluster import distributed
from fastpt.monitoring import metrics
from fastpt.errors import DataError


def save_best(ckpt_dir: Path, cfg, dist, strategy, epoch: int, step: int, value: float) -> None:
    """checkpoints/best.pt: the weights of the best epoch so far, with the config and the monitored value."""
    state = strategy.model_state_dict()  # a collective where the model is sharded
    if dist.is_main:
        checkpoint.save_atomic({"model": state, "config": cfg.to_dict(), "epoch": epoch, "step": step,
                                "monitor": cfg.monitor, "value": value}, ckpt_dir / "best.pt")


def save_last(ckpt_dir: Path, cfg, dist, strategy, bookkeeping, record: RunRecord, train_sampler) -> None:
    """checkpoints/last.pt: everything needed to continue exactly from this step.

    Per rank: the RNG states (dropout masks) and the bookkeeping's running sums, so a resumed
    run logs, averages and draws exactly what the uninterrupted run would have.
    """
    training = strategy.training_state(ckpt_dir)
    this_rank = checkpoint.to_bytes({"rng": checkpoint.rng_state(), **bookkeeping.rank_state()})
    per_rank = [checkpoint.from_bytes(b) for b in distributed.all_gather_object(this_rank)]
    if dist.is_main:
        done = bookkeeping.batch_in_epoch  # the position in the epoch's order, on any number of processes
        examples_in_epoch = record.epoch_offset + done * train_sampler.global_batch_size if done else 0
        state = {
            "config": cfg.to_dict(),
            "world_size": dist.world_size,
            "training": training,
            "progress": {**bookkeeping.progress(), "val_time_s": record.val_time_s,
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

    The bookkeeping reads its own part (counters, sums) when it is built."""
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


def write_results(tracker, cfg, dist, strategy, bookkeeping, record: RunRecord, inputs, loaders, test: dict) -> dict:
    """results.json (and the console's last line, TensorBoard's test scalars and HPARAMS)."""
    compile_s = bookkeeping.compile_clock.seconds
    stopped_early = record.early_stopping.stopped
    history = record.history
    results = {
        "test_acc": test["acc"], "test_loss": test["loss"], "test_examples": test["n"], "tested_on": record.tested_on,
        "train_examples": len(inputs.splits["train"]),
        "train_examples_used": inputs.train_examples_used(cfg, dist.world_size),
        "val_examples": len(inputs.splits["validation"]),
        "best_val_acc": max((h["val_acc"] for h in history), default=None),
        "test_macro_f1": test["macro_f1"],
        # (a run resumed from a last.pt of an older fastpt has epochs without it)
        "best_val_macro_f1": max((h["val_macro_f1"] for h in history if "val_macro_f1" in h), default=None),
        "label_names": inputs.label_names,
        # per label: support (true), predicted, correct, precision, recall, F1; confusion[true][predicted]
        "test_per_class": per_class(test["confusion"], inputs.label_names),
        "test_confusion": test["confusion"],
        "best_monitor": record.best.best, "monitor": cfg.monitor, "best_epoch": record.best.best_epoch,
        "epochs_run": len(history), "global_steps": bookkeeping.global_step,
        "stopped_early": stopped_early,
        "stop_reason": record.early_stopping.reason if stopped_early else "",
        "train_time_s": bookkeeping.train_time_s,  # training + validation, compilation included (the article's)
        "compile_time_s": compile_s if cfg.compile else None,
        "train_time_no_compile_s": bookkeeping.train_time_s - compile_s,
        "val_time_s": record.val_time_s,  # every validation, compilation included
        "val_time_no_compile_s": record.val_time_s - record.val_compile_s,  # over epochs_run x val_examples reviews
        "first_step_s": bookkeeping.first_step_s,
        # torch's own count of the time spent compiling (compile_time_s also holds the compiling calls' work)
        "compile_torch_s": bookkeeping.compile_clock.torch_seconds if cfg.compile else None,
        "compiled_graphs": bookkeeping.compile_clock.graphs if cfg.compile else None,
        # Hits, misses and bypasses of the FX graph and AOTAutograd caches: did a warm cache serve this run?
        "compile_cache": bookkeeping.compile_clock.cache if cfg.compile else None,
        # Distinct token widths (packed: lengths) this process trained on.
        "batch_shapes": len(bookkeeping.token_shapes),
        # Mean over the last epoch's steps of max / mean tokens per rank: every step waits for the fullest rank.
        "rank_token_imbalance": data.rank_token_imbalance(loaders.train_sampler, data.computed_tokens(cfg)),
        **metrics.rate_results(bookkeeping.meter, dist.world_size, bookkeeping.resumed_at_step),
        # The packed attention kernel and how it was chosen (--pack-attention, or the device's rule).
        "pack_attention": getattr(strategy.module, "kernel_choice", None) if cfg.pack else None,
        # The attention's precision and how it was chosen (on a CPU under --amp: both measured times, seconds).
        "attention_precision": getattr(strategy.module, "attention_precision", None),
        "peak_memory_bytes": metrics.peak_memory_bytes(dist.device),
        "memory_per_rank": distributed.all_gather_object(strategy.memory_report()),  # list, by rank
        "strategy": strategy.name, "world_size": dist.world_size, "device": str(dist.device),
        "device_name": torch.cuda.get_device_name(dist.device) if dist.device.type == "cuda" else "cpu",
        "num_workers": loaders.num_workers, "pin_memory": loaders.pin_memory,
        "history": history,
        "torch": torch.__version__,
    }
    rate = results["samples_per_s"]
    by_class = f1_by_class(results["test_per_class"])  # "" where two classes are about even (IMDB)
    tracker.print(f"test ({record.tested_on}): loss {test['loss']:.4f} acc {test['acc']:.4f} "
                  f"macro-F1 {test['macro_f1']:.4f} " + (f"({by_class}) " if by_class else "") +
                  f"on {test['n']} {'examples' if cfg.data else 'reviews'} | "
                  f"train time {bookkeeping.train_time_s / 60:.2f} min"
                  + (f" | {rate:.1f} samples/s" if rate is not None else "")
                  + (f" | MFU {100 * results['mfu']:.1f}%" if results["mfu"] is not None else ""))
    tracker.scalars({"test_acc": test["acc"], "test_loss": test["loss"], "test_macro_f1": test["macro_f1"]},
                    bookkeeping.global_step, "test/")
    tracker.scalars({f"rank{r}/{k}": v for r, m in enumerate(results["memory_per_rank"]) for k, v in m.items()},
                    bookkeeping.global_step, "memory/")
    tracker.hparams(cfg.to_dict(), {k: results[k] for k in ("test_acc", "test_loss", "test_macro_f1", "best_val_acc",
                                                            "best_val_macro_f1", "train_time_s", "samples_per_s")
                                    if results[k] is not None})
    tracker.write_json("results.json", results)
    return results


def write_predictions(out_dir: Path, cfg, dist, inputs, test: dict, tracker) -> None:
    """predictions.csv: each test example once, in the test split's order (cli/predictions.py has the columns).

    Rank 0 writes it from evaluate's per-example outputs (every rank's, gathered), so its predicted
    column counts to results.json's test_confusion exactly. Where each example is: IMDB's review
    file names come from the token cache (no text: the tarball is not read again); --data's rows
    and texts are read again from the file, and if that no longer matches the split the run tested
    (the file was changed since), the rows say only their place in the split."""
    if not dist.is_main:
        return
    from fastpt.cli.predictions import preview, write_predictions as write

    per_example, names = test["per_example"], inputs.label_names
    gold = [names[i] for i in inputs.splits["test"].labels]
    try:
        leading = test_rows(cfg, inputs, gold)
    except DataError as e:
        leading = {"test_row": list(range(len(gold)))}
        tracker.print(f"note: predictions.csv names each example by its place in the test split only: {e}")
    if "text" in leading:
        leading["text"] = [preview(t) for t in leading["text"]]
    leading["label"] = gold
    write(out_dir / "predictions.csv", leading, names, per_example["predicted"], per_example["probabilities"])


def test_rows(cfg, inputs, gold: list) -> dict:
    """{'row' and 'text' (own data, read again) or 'review' (IMDB, its file)}: where each test example is;
    DataError unless what was read has the tested split's examples and labels."""
    n = len(gold)
    if cfg.data:
        table = own_data.gather_splits(cfg)[0]["test"]
        labels = table.columns[table.use["label"]][:n]  # this file's column of the names --label-column gives
        read = [str(table.label_names[v]) if table.label_names else str(v) for v in labels]
        where = {"row": table.row_numbers()[:n], "text": table.columns[table.use["text"]][:n]}
    else:
        keys = token_cache.split_keys(inputs.cache_path)["test"][:n]
        read = [inputs.label_names[int(key.split("/")[1] == "pos")] for key in keys]
        where = {"review": keys}
    if read != gold:
        raise DataError("the data read again differs from the tested split (changed since the run started?)")
    return where


def export(export_dir: str, dist, strategy, inputs, tracker) -> None:
    """--export-dir: the tested weights as a Hugging Face model folder (weights, config with the
    label names, tokenizer); `transformers.pipeline("text-classification", model=DIR)` loads it.

    The tokenizer's `model_max_length` is the --max-length trained on, so `pipeline(...,
    truncation=True)` cuts a long text where training did (not at the checkpoint's 512 or 128).
    """
    import os

    from transformers import AutoModelForSequenceClassification

    from fastpt.inputs.models import label_config

    state = strategy.model_state_dict()  # a collective where the model is sharded
    if not dist.is_main:
        return
    config = inputs.model_config
    labels = label_config(inputs.label_names)
    config.id2label, config.label2id = labels["id2label"], labels["label2id"]
    model = AutoModelForSequenceClassification.from_config(config)
    model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
    out = Path(export_dir)

    # save_pretrained unwraps the model through accelerate, which imports DeepSpeed wherever it is
    # installed; DeepSpeed then guesses its accelerator and warns when it settles for the CPU.
    # Named (the run's device, as --deepspeed names it), it has nothing to guess or say.
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if dist.device.type == "cuda" else "cpu")
    tokenizer = inputs.tokenizer

    def save(folder: Path) -> None:
        model.save_pretrained(folder)
        trained_on, tokenizer.model_max_length = tokenizer.model_max_length, strategy.cfg.max_length
        try:
            tokenizer.save_pretrained(folder)
        finally:
            tokenizer.model_max_length = trained_on

    checkpoint.write_export(out, save)  # over an earlier export: only the files its manifest lists go
    tracker.print(f"exported: {out} (transformers.pipeline('text-classification', model=..., truncation=True))")
