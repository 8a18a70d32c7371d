"""What the peer references share with fastpt: the inputs, the timing window, the results file (imported by
the three peers; nothing to run).

The peers (`lightning_ref.py`, `accelerate_ref.py`, `bare_loop.py`) must differ from fastpt
in the training framework only. So everything that is not the training loop comes from
fastpt itself: the tokeniser and model (`fastpt.inputs.models`), the cached 35k/5k/10k split and its
`head(n)` subsets, the `Collator` (same padding), the rank-aware batch samplers (same
batches on every rank, same evaluation shards), seed 123 and Adam at 5e-5.

Timing follows fastpt's `train_time_s` and `samples_per_s` exactly (loop/bookkeeping.py):
- `train_time_s` sums, over epochs, the wall time from the start of the training epoch to
  the end of its validation; setup, checkpoint writing and the test are outside it;
- `samples_per_s` counts training samples after the first WARMUP_STEPS optimiser steps,
  over training time only (validation excluded), with `fastpt.monitoring.metrics.Throughput`,
  multiplied by the number of processes (ranks run in lockstep).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from fastpt.inputs import data, token_cache  # noqa: E402
from fastpt.inputs.models import count_parameters, load_model, load_tokenizer  # noqa: E402
from fastpt.loop.build import WARMUP_STEPS, seed_everything  # noqa: E402
from fastpt.monitoring import metrics  # noqa: E402


PRECISIONS = ("32", "bf16", "16")  # fp32, bfloat16 autocast, float16 autocast + GradScaler


def build_parser(prog: str) -> argparse.ArgumentParser:
    """The subset of train.py's flags a peer needs, with the same names and defaults."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--model", default="distilbert-base-uncased")
    p.add_argument("--random-init", action="store_true")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--train-size", type=int, default=None)
    p.add_argument("--val-size", type=int, default=None)
    p.add_argument("--test-size", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=12, help="per process")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--seed", type=int, default=123)
    p.add_argument("--precision", default="32", choices=PRECISIONS)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--out", required=True, help="run folder: results.json is written here")
    return p


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the process count, from torchrun's (or accelerate launch's) environment."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def use_cuda(args) -> bool:
    return torch.cuda.is_available() if args.device == "auto" else args.device == "cuda"


def load_splits(args, tokenizer, rank: int) -> dict:
    """fastpt's cached split, cut to the same subsets as train.py's --train/val/test-size.

    Every rank asks for it: the first builds the cache under its lock file, the others wait
    on that lock and read the finished cache (the frameworks create their process groups later).
    """
    splits, _ = token_cache.prepare_splits(args.data_dir, args.cache_dir, tokenizer, args.max_length)
    return {"train": splits["train"].head(args.train_size),
            "validation": splits["validation"].head(args.val_size),
            "test": splits["test"].head(args.test_size)}


def build_inputs(args, rank: int, world_size: int):
    """(model, loaders, train_sampler) as fastpt's loop/build.py:build_loaders makes them (pad to max_length)."""
    seed_everything(args.seed)  # identical initial weights on every rank, as in fastpt
    tokenizer = load_tokenizer(args.model)
    # Train mode, as fastpt's loop sets it: from_pretrained returns a model in eval mode, and since 2.2
    # Lightning's fit loop keeps each module's mode instead of calling .train() as the articles' Lightning
    # did (2.0): without this the Lightning side trained a pretrained model with every dropout off.
    model = load_model(args.model, args.random_init).train()
    splits = load_splits(args, tokenizer, rank)
    torch.manual_seed(args.seed + rank)  # fastpt's dropout seed, per rank, set after the model is built
    collate = data.Collator(tokenizer.pad_token_id or 0, "max_length", args.max_length)
    train_sampler = data.TrainBatchSampler(splits["train"], args.batch_size, rank, world_size, args.seed)
    if len(train_sampler) == 0:
        raise ValueError("the training subset makes no full batch")
    on_cuda = use_cuda(args)
    workers = data.default_num_workers(on_cuda, world_size)
    loaders = {"train": data.make_loader(splits["train"], train_sampler, collate, workers, on_cuda, args.seed)}
    for name in ("validation", "test"):
        sampler = data.EvalBatchSampler(splits[name], args.batch_size, rank, world_size)
        loaders[name] = data.make_loader(splits[name], sampler, collate, workers, on_cuda, args.seed)
    return model, loaders, train_sampler


def make_meter(model, device: torch.device, precision: str | None = None) -> metrics.Throughput:
    """fastpt's throughput meter: same warm-up, same window; with `precision` (one of PRECISIONS)
    also MFU, with fastpt's formula and peak for that precision."""
    _, n_matmul = count_parameters(model)
    layers, hidden = metrics.model_shape(model)
    info = None
    if precision is not None:
        peak = metrics.device_peak_flops(device, amp=precision != "32", tf32=False)
        if peak is None:  # a CPU: the same measured matmul peak fastpt's own runs use (cached per machine)
            from fastpt.monitoring.peak import measured_peak
            dtype = {"32": torch.float32, "bf16": torch.bfloat16, "16": torch.float16}[precision]
            info = measured_peak(device, dtype, hidden, token_cache.cache_root(None),
                                 int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
            peak = info["flops_per_s"]
    else:
        peak = None
    return metrics.Throughput(device, WARMUP_STEPS,
                              lambda lengths: metrics.review_flops(lengths, n_matmul, layers, hidden), peak,
                              peak_info=info)


def record_batch(meter: metrics.Throughput, batch: dict) -> None:
    """One training batch into the meter, as fastpt's loop records it (the collator's host-side counts)."""
    meter.record(batch["lengths"], batch["num_tokens"], 0.0)


def to_device(batch: dict, device) -> dict:
    """The batch's tensors on the device; the collator's host-side counts stay as they are."""
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}


def weighted_sums(logits: torch.Tensor, batch: dict) -> torch.Tensor:
    """[loss sum, correct, examples] of one evaluation batch; weight-0 rows are rank padding."""
    weight = batch["weight"].double()
    losses = torch.nn.functional.cross_entropy(logits.float(), batch["labels"], reduction="none").double()
    correct = (logits.argmax(dim=-1) == batch["labels"]).double()
    return torch.stack([(losses * weight).sum(), (correct * weight).sum(), weight.sum()])


def sums_to_metrics(sums: torch.Tensor) -> dict:
    loss_sum, correct, n = sums.tolist()
    return {"loss": loss_sum / max(n, 1), "acc": correct / max(n, 1), "n": int(round(n))}


def write_results(out: Path, framework: str, args, *, test: dict, history: list, train_time_s: float,
                  meter: metrics.Throughput, world_size: int, global_steps: int, device: torch.device,
                  extra: dict | None = None) -> dict:
    """results.json with fastpt's field names, so one reader handles all frameworks."""
    results = {
        "framework": framework,
        "test_acc": test["acc"], "test_loss": test["loss"], "test_examples": test["n"], "tested_on": "best",
        "best_val_acc": max((h["val_acc"] for h in history), default=None),
        "epochs_run": len(history), "global_steps": global_steps,
        "train_time_s": train_time_s,
        **metrics.rate_results(meter, world_size),  # fastpt's own speed block, the same names and rules
        "peak_memory_bytes": metrics.peak_memory_bytes(device),
        "world_size": world_size, "device": str(device), "precision": args.precision,
        "history": history, "torch": torch.__version__, "config": vars(args),
        **(extra or {}),
    }
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(results, indent=2, default=str))
    os.replace(tmp, out / "results.json")
    return results


__all__ = ["ROOT", "WARMUP_STEPS", "PRECISIONS", "build_parser", "rank_and_world", "use_cuda", "build_inputs",
           "make_meter", "record_batch", "to_device", "weighted_sums", "sums_to_metrics", "write_results"]
