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

Each rank evaluates its own shard (see data.EvalBatchSampler); the loss sum, the correct count,
the example count, the loss's weight (--class-weights) and the confusion counts (labels x
predictions, for macro-F1 and the per-class counts) are one float64 vector on the device,
all-reduced once at the end, so every rank holds the same metrics over the whole split, each
example counted once. Both ways of evening out ranks lose that: a DistributedSampler repeats
examples where the split does not divide by the number of ranks, and a loader with
`drop_last=True` drops the last incomplete batch. The article's DDP runs scored 9,984 of 10,000
test reviews for the second reason: 10,000 / 4 ranks divides, so the sampler repeated nothing,
but their test loader kept `drop_last=True`, so each rank ran 208 full batches of 12
(208 x 12 x 4 = 9,984). Weights of 0 on the padding avoid both duplicates and drops here.

With `per_example` (the test split, for predictions.csv) each rank also keeps its examples'
probabilities and predicted ids (the argmax the confusion counts, so the file and the counts
agree exactly), and one all-gather puts them on every rank in the split's order, each example
once: the weight-0 filler is dropped and the sampler's (index, weight) pairs say whose is whose.
"""

import time

import numpy as np
import torch
import torch.nn.functional as F

from fastpt.loop.step import classify
from fastpt.cluster.distributed import all_gather_object, all_reduce_sum


def make_eval_sums(precision, max_length: int, class_weights: torch.Tensor | None = None):
    """eval_sums(model, batch) -> (sums, logits, predicted), compiled as the step is: sums = [weighted loss sum,
    weighted correct, weight, loss weight, confusion (K x K, flat)]; confusion[true * K + predicted] counts each
    example by its weight. The logits and predicted ids are for `per_example` (predictions.csv).

    The loss is the training loss: with `class_weights` each example's loss counts w[label] times, and the
    split's loss is their sum over the sum of w[label] (the "loss weight"; without class weights, the examples).
    """

    def eval_sums(model: torch.nn.Module, batch: dict) -> torch.Tensor:
        with precision.autocast():
            logits = classify(model, batch, max_length)
        weight, labels = batch["weight"].double(), batch["labels"]
        losses = F.cross_entropy(logits.float(), labels, weight=class_weights, reduction="none").double()
        loss_weight = weight if class_weights is None else weight * class_weights[labels].double()
        predicted = logits.argmax(dim=-1)
        correct = (predicted == labels).double()
        k = logits.shape[-1]
        confusion = torch.zeros(k * k, dtype=torch.float64, device=logits.device).index_add_(
            0, labels * k + predicted, weight)
        totals = torch.stack([(losses * weight).sum(), (correct * weight).sum(), weight.sum(), loss_weight.sum()])
        return torch.cat([totals, confusion]), logits, predicted

    return eval_sums


@torch.no_grad()
def evaluate(strategy, loader, eval_sums=None, bar=None, compile_clock=None, num_labels: int = 2,
             per_example: bool = False) -> dict:
    """{'loss', 'acc', 'macro_f1', 'confusion', 'n'} over the whole split, identical on every rank; and its
    'time_s' (host time, ending with the read of the sums: synchronised) and 'compile_s' (the part of it
    spent in calls that compiled a graph, by the compile clock). The bar, if any, is closed. With
    `per_example`, 'per_example' too: `gather_per_example`'s probabilities and predicted ids, in the split's order."""
    eval_sums = eval_sums or strategy.compile_step(make_eval_sums(strategy.precision, strategy.cfg.max_length))
    began, compiled_before = time.perf_counter(), compile_clock.seconds if compile_clock is not None else 0.0
    was_training = strategy.model.training
    strategy.train(False)
    # loss sum, correct, examples, loss weight, then the confusion counts
    sums = torch.zeros(4 + num_labels ** 2, dtype=torch.float64, device=strategy.device)
    kept = []  # per_example: each batch's (probabilities, predicted), on the device until the end
    for batch in loader:
        start = time.perf_counter()
        batch_sums, logits, predicted = eval_sums(strategy.model, strategy.to_device(batch))
        sums += batch_sums
        if per_example:  # copies: a CUDA-graph replay overwrites its outputs
            kept.append((torch.softmax(logits.detach().float(), dim=-1), predicted.clone()))
        if compile_clock is not None:
            compile_clock.tick(since=start)
        if bar is not None:
            bar.update(1)
    all_reduce_sum(sums)
    outputs = gather_per_example(loader.batch_sampler, kept) if per_example else None
    strategy.train(was_training)
    loss_sum, correct, n, loss_weight, *counts = sums.tolist()
    time_s = time.perf_counter() - began
    if bar is not None:
        bar.close()
    confusion = np.rint(counts).astype(int).reshape(num_labels, num_labels).tolist()
    return {"loss": loss_sum / (loss_weight or 1), "acc": correct / max(n, 1), "macro_f1": macro_f1(confusion),
            "confusion": confusion, "n": int(round(n)), "time_s": time_s,
            "compile_s": compile_clock.seconds - compiled_before if compile_clock is not None else 0.0,
            **({"per_example": outputs} if per_example else {})}


def gather_per_example(batch_sampler, kept: list) -> dict:
    """{'probabilities' [n, K] float32, 'predicted' [n] int64}: row i is the split's example i, on every rank.

    `kept` holds this rank's batches in the sampler's order; the sampler's (index, weight) pairs name
    the examples, and weight 0 marks the filler that evens out ranks, dropped here. One all-gather."""
    items = [item for batch in batch_sampler for item in batch]
    index = np.array([i for i, _ in items], dtype=np.int64)
    real = np.array([w > 0 for _, w in items], dtype=bool)
    probabilities = torch.cat([p for p, _ in kept]).cpu().numpy() if kept else np.zeros((0, 0), np.float32)
    predicted = torch.cat([p for _, p in kept]).cpu().numpy() if kept else np.zeros(0, np.int64)
    ranks = all_gather_object((index[real], probabilities[real], predicted[real]))
    index = np.concatenate([r[0] for r in ranks])
    order = np.argsort(index, kind="stable")
    if not np.array_equal(index[order], np.arange(len(index))):  # every example exactly once
        raise RuntimeError(f"the ranks' evaluation shards do not cover the split once: {len(index)} examples, "
                           f"{len(np.unique(index))} distinct")
    return {"probabilities": np.concatenate([r[1] for r in ranks])[order],
            "predicted": np.concatenate([r[2] for r in ranks])[order]}


def per_class(confusion: list, names: list) -> dict:
    """{label name: support, predicted, correct, precision, recall, f1} from confusion[true][predicted]."""
    out = {}
    for i, name in enumerate(names):
        support, predicted, correct = sum(confusion[i]), sum(row[i] for row in confusion), confusion[i][i]
        out[name] = {"support": support, "predicted": predicted, "correct": correct,
                     "precision": correct / predicted if predicted else 0.0,
                     "recall": correct / support if support else 0.0,
                     "f1": 2 * correct / (support + predicted) if support + predicted else 0.0}
    return out


# Two classes whose smaller one holds at least this share of a split: accuracy and macro-F1 say it all.
BALANCED_SHARE = 0.4


def f1_by_class(classes: dict, most: int = 10) -> str:
    """Each class's F1 for a console line, "" for a balanced binary split (IMDB's): where classes are
    several or uneven, one class can fail behind a good macro-F1. At most `most` classes (results.json has all)."""
    supports = [c["support"] for c in classes.values()]
    if len(classes) == 2 and min(supports) >= BALANCED_SHARE * max(1, sum(supports)):
        return ""
    shown = ", ".join(f"{name} {c['f1']:.3f}" for name, c in list(classes.items())[:most])
    return f"F1 by class: {shown}{', ...' if len(classes) > most else ''}"


def confusion_text(confusion: list, names: list) -> str:
    """confusion[true][predicted] as a fixed-width table: a row per true label, a column per prediction."""
    width = max(len("true \\ predicted"), *(len(n) for n in names))
    cells = [max(len(n), *(len(str(row[j])) for row in confusion)) for j, n in enumerate(names)]
    lines = ["true \\ predicted".ljust(width) + "".join(f"  {n:>{w}}" for n, w in zip(names, cells))]
    lines += [name.ljust(width) + "".join(f"  {v:>{w}}" for v, w in zip(row, cells))
              for name, row in zip(names, confusion)]
    return "\n".join(lines)


def macro_f1(confusion: list) -> float:
    """The mean F1 over the labels that occur in the split or in the predictions (scikit-learn's
    f1_score(average="macro") with its default labels): a label never seen nor predicted is left out."""
    f1 = [2 * confusion[i][i] / (sum(confusion[i]) + sum(row[i] for row in confusion))
          for i in range(len(confusion)) if sum(confusion[i]) + sum(row[i] for row in confusion)]
    return sum(f1) / len(f1) if f1 else 0.0
