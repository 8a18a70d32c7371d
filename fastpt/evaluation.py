"""Evaluation without autograd, split across ranks, summed with one all-reduce.

`torch.no_grad()` stops autograd from recording the graph and keeping activations for a
backward pass that never comes: less memory and less work per batch (the second article's
"no_grad evaluation"). `model.eval()` turns dropout off; the model goes back to train mode
after. (`inference_mode` would skip a little more bookkeeping, but tensors it creates can
never enter autograd later, which compiled and FSDP-sharded modules trip over.)

Each rank evaluates its own shard (see data.EvalBatchSampler); the loss sum, the correct
count and the example count are all-reduced once at the end, so every rank holds the same
metrics over the whole split, each example counted once. Lightning's `trainer.validate` /
`trainer.test` under DDP use a DistributedSampler that repeats examples to even out ranks
(the article's DDP runs scored 9,984 of 10,000 test reviews); weights of 0 on the padding
avoid both duplicates and drops here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastpt.distributed import all_reduce_sum


def forward_logits(strategy, batch: dict) -> torch.Tensor:
    with strategy.autocast():
        return strategy.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


@torch.no_grad()
def evaluate(strategy, loader, device: torch.device, non_blocking: bool = False, bar=None) -> dict:
    """{'loss', 'acc', 'n'} over the whole split, identical on every rank."""
    was_training = strategy.model.training
    strategy.train(False)
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, examples
    for batch in loader:
        batch = {k: v.to(device, non_blocking=non_blocking) for k, v in batch.items()}
        logits = forward_logits(strategy, batch)
        weight = batch["weight"].double()
        losses = F.cross_entropy(logits.float(), batch["labels"], reduction="none").double()
        correct = (logits.argmax(dim=-1) == batch["labels"]).double()
        sums += torch.stack([(losses * weight).sum(), (correct * weight).sum(), weight.sum()])
        if bar is not None:
            bar.update(1)
    all_reduce_sum(sums)
    strategy.train(was_training)
    loss_sum, correct, n = sums.tolist()
    return {"loss": loss_sum / max(n, 1), "acc": correct / max(n, 1), "n": int(round(n))}
