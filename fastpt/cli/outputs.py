"""What a run writes into its folder once it has tested: results.json, predictions.csv and the
--export-dir model folder.

Each function takes what it writes as arguments; train.py calls them in the run's order. The
checkpoints (best.pt, last.pt) are a lesson of their own, on the learner's side:
`loop/checkpoints.py`. The folder itself (its lock, whether and what to resume) is run_folder.py's.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from fastpt.cli.predictions import preview, write_predictions as write_file
from fastpt.inputs import data, own_data, token_cache
from fastpt.inputs.models import label_config
from fastpt.loop.build import saved_config
from fastpt.loop.evaluation import f1_by_class, per_class
from fastpt.loop.record import RunRecord
from fastpt.files import checkpoint
from fastpt.cluster import distributed
from fastpt.monitoring import metrics
from fastpt.speedups import backends
from fastpt.errors import DataError


def write_results(tracker, cfg, dist, strategy, bookkeeping, record: RunRecord, inputs, loaders, test: dict) -> dict:
    """results.json (and the console's last line, TensorBoard's test scalars and HPARAMS)."""
    clocks, step, history = bookkeeping.clocks, bookkeeping.position.global_step, record.history
    compile_s = clocks.compile_clock.seconds
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
        "epochs_run": len(history), "global_steps": step,
        "stopped_early": record.early_stopping.stopped,
        "stop_reason": record.early_stopping.reason if record.early_stopping.stopped else "",
        "train_time_s": clocks.train_time_s,  # training + validation, compilation included (the article's)
        "compile_time_s": compile_s if cfg.compile else None,
        "train_time_no_compile_s": clocks.train_time_s - compile_s,
        "val_time_s": record.val_time_s,  # every validation, compilation included
        "val_time_no_compile_s": record.val_time_s - record.val_compile_s,  # over epochs_run x val_examples reviews
        "first_step_s": clocks.first_step_s,
        # torch's own count of the time spent compiling (compile_time_s also holds the compiling calls' work)
        "compile_torch_s": clocks.compile_clock.torch_seconds if cfg.compile else None,
        "compiled_graphs": clocks.compile_clock.graphs if cfg.compile else None,
        # Hits, misses and bypasses of the FX graph and AOTAutograd caches: did a warm cache serve this run?
        "compile_cache": clocks.compile_clock.cache if cfg.compile else None,
        # Distinct token widths (packed: lengths) this process trained on.
        "batch_shapes": len(clocks.token_shapes),
        # Mean over the last epoch's steps of max / mean tokens per rank: every step waits for the fullest rank.
        "rank_token_imbalance": data.rank_token_imbalance(loaders.train_sampler, data.computed_tokens(cfg)),
        **metrics.rate_results(clocks.meter, dist.world_size, bookkeeping.position.resumed_at_step),
        # The packed attention kernel and how it was chosen (--pack-attention, or the device's rule).
        "pack_attention": getattr(strategy.module, "kernel_choice", None) if cfg.pack else None,
        # The attention's precision and how it was chosen (on a CPU under --amp: both measured times, seconds).
        "attention_precision": getattr(strategy.module, "attention_precision", None),
        # On a CPU: whether malloc keeps freed memory for the next step (speedups/backends.py).
        "cpu_allocator": backends.cpu_allocator(),
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
                  f"train time {clocks.train_time_s / 60:.2f} min"
                  + (f" | {rate:.1f} samples/s" if rate is not None else "")
                  + (f" | MFU {100 * results['mfu']:.1f}%" if results["mfu"] is not None else ""))
    tracker.scalars({"test_acc": test["acc"], "test_loss": test["loss"], "test_macro_f1": test["macro_f1"]},
                    step, "test/")
    tracker.scalars({f"rank{r}/{k}": v for r, m in enumerate(results["memory_per_rank"]) for k, v in m.items()},
                    step, "memory/")
    tracker.hparams(saved_config(cfg, inputs), {k: results[k] for k in (
        "test_acc", "test_loss", "test_macro_f1", "best_val_acc", "best_val_macro_f1", "train_time_s", "samples_per_s")
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
    per_example, names = test["per_example"], inputs.label_names
    gold = [names[i] for i in inputs.splits["test"].labels]
    try:
        leading = test_rows(cfg, inputs, gold)
    except DataError as e:
        leading = {"test_row": list(range(len(gold)))}
        tracker.print(f"note: predictions.csv names each example by its place in the test split only: {e}")
    leading["label"] = gold
    write_file(out_dir / "predictions.csv", leading, names, per_example["predicted"], per_example["probabilities"])


def test_rows(cfg, inputs, gold: list) -> dict:
    """{'row' and 'text' (own data, read again) or 'review' (IMDB, its file)}: where each test example is;
    DataError unless what was read has the tested split's examples and labels."""
    n = len(gold)
    if cfg.data:
        table = own_data.gather_splits(cfg)[0]["test"]
        labels = table.columns[table.use["label"]][:n]  # this file's column of the names --label-column gives
        named = dict(zip(inputs.data_label_names or inputs.label_names, inputs.label_names))  # --label-names
        read = [named.get(label, label) for label in
                (str(table.label_names[v]) if table.label_names else str(v) for v in labels)]
        where = {"row": table.row_numbers()[:n], "text": [preview(t) for t in table.columns[table.use["text"]][:n]]}
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
    from transformers import AutoModelForSequenceClassification

    state = strategy.model_state_dict()  # a collective where the model is sharded
    if not dist.is_main:
        return
    config = inputs.model_config
    config.update(label_config(inputs.label_names))  # num_labels, id2label, label2id
    if inputs.data_label_names:  # fastpt-predict reads a file labelled like the training data with them
        config.fastpt_data_label_names = inputs.data_label_names
    model = AutoModelForSequenceClassification.from_config(config)
    model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})

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

    checkpoint.write_export(Path(export_dir), save)  # over an earlier export: only the files its manifest lists go
    tracker.print(f"exported: {export_dir} (transformers.pipeline('text-classification', model=..., truncation=True))")
