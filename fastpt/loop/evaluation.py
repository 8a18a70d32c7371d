"""Evaluation without autograd, split across ranks, summed with one all-reduce.

`torch.no_grad()` stops autograd from recording the graph and keeping activations for a
backward pass that never comes: less memory and less work per batch (the second article's
"no_grad evaluation"). `model.eval()` turns dropout off; the model goes back to train mode
after. (`inference_mode` would skip a little more bookkeeping, but tensors it creates can
never enter autograd later, which compiled and FSDP-sharded modules trip over.)

Without gradients there are no activations to keep, so evaluation batches can be much larger
than training batches (`--eval-batch-size`, default 128): fewer, fuller kernel launches. Every
evaluation batch has the same size (the last one is filled with weight-0 reviews), so a
compiled evaluation compiles once.

Each rank evaluates its own shard (see data.EvalBatchSampler); the loss sum, the correct
count and the example count are all-reduced once at the end, so every rank holds the same
metrics over the whole split, each example counted once. Both ways of evening out ranks lose
that: a DistributedSampler repeats examples where the split does not divide by the number of
ranks, and a loader with `drop_last=True` drops the last incomplete batch. The article's DDP
runs scored 9,984 of 10,000 test reviews for the second reason: 10,000 / 4 ranks divides, so the
sampler repeated nothing, but their test loader kept `drop_last=True`, so each rank ran 208 full
batches of 12 (208 x 12 x 4 = 9,984). Weights of 0 on the padding avoid both duplicates and
drops here.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from fastpt.loop.step import classify
from fastpt.machinery.distributed import all_reduce_sum


def make_eval_sums(strategy, max_length: int):
    """eval_sums(model, batch) -> [weighted loss sum, weighted correct, weight]: compiled like the step."""

    def eval_sums(model: torch.nn.Module, batch: dict) -> torch.Tensor:
        with strategy.autocast():
            logits = classify(model, batch, max_length)
        weight = batch["weight"].double()
        losses = F.cross_entropy(logits.float(), batch["labels"], reduction="none").double()
        correct = (logits.argmax(dim=-1) == batch["labels"]).double()
        return torch.stack([(losses * weight).sum(), (correct * weight).sum(), weight.sum()])

    return strategy.compile_step(eval_sums)


@torch.no_grad()
def evaluate(strategy, loader, eval_sums=None, bar=None, compile_clock=None) -> dict:
    """{'loss', 'acc', 'n'} over the whole split, identical on every rank."""
    eval_sums = eval_sums or make_eval_sums(strategy, strategy.cfg.max_length)
    was_training = strategy.model.training
    strategy.train(False)
    sums = torch.zeros(3, dtype=torch.float64, device=strategy.device)  # loss sum, correct, examples
    for batch in loader:
        start = time.perf_counter()
        sums += eval_sums(strategy.model, strategy.to_device(batch))
        if compile_clock is not None:
            compile_clock.tick(since=start)
        if bar is not None:
            bar.update(1)
    all_reduce_sum(sums)
    strategy.train(was_training)
    loss_sum, correct, n = sums.tolist()
    return {"loss": loss_sum / max(n, 1), "acc": correct / max(n, 1), "n": int(round(n))}
