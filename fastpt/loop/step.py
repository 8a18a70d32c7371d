"""The training step and the epoch loop, as the textbook writes them.

    for batch in train_loader:                          # train_epoch
        micro_batches.append(batch)                     #   --grad-accum batches make one step
        sums = train_step(strategy, micro_batches, forward_loss)
        due = bookkeeping.after_step(sums, ...)         #   counters; what is due: a log line, last.pt, a stop
        if max_steps_reached(...): break                #   --max-steps

`train_step` is the whole computation of one optimiser step: move each micro-batch to the
device, forward under autocast, the loss, the scaled backward (gradients reduced across
processes only on the last micro-batch), then unscale, clip, step, update the scaler and zero
the gradients. `forward_loss` (forward, loss and the batch's metric sums) runs eagerly around
compiled transformer layers under `--compile` (the default scope), and is itself compiled whole on
one device under `--compile-scope whole` (train.py hands it to `strategy.compile_step`): either
way what a reader reads is what runs (speedups/compile.py).

Everything that is not the computation (the position, the epoch's metric sums, the log
window, the first non-finite loss, the clocks and the throughput meter, what is due, the bar)
lives in `bookkeeping.py`, one part per concern, which answers what is due and calls nothing
back; last.pt is train.py's, handed up by `train_epoch` (a generator) when due. The strategy
(`strategies/base.py`) holds what differs between one device, DDP, FSDP and DeepSpeed. Nothing
here reads a value back from the device: losses and correct counts stay on it as sums, read at
log steps.
"""

import numpy as np
import torch
import torch.nn.functional as F

from fastpt.speedups.packing import is_packed, packed_logits


def classify(model: torch.nn.Module, batch: dict, max_length: int) -> torch.Tensor:
    """Logits [reviews, labels]: a padded batch through the Hugging Face model, or a packed one."""
    if is_packed(batch):
        return packed_logits(model, batch, max_seqlen=max_length)
    extra = {"token_type_ids": batch["token_type_ids"]} if "token_type_ids" in batch else {}  # sentence pairs
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **extra).logits


def metric_sums(loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[loss x examples, correct, examples, loss] in float64, summed on the device."""
    n, loss = labels.shape[0], loss.detach().double()
    correct = (logits.argmax(dim=-1) == labels).sum().double()
    return torch.stack([loss * n, correct, torch.full_like(loss, n), loss])


def make_forward_loss(precision, max_length: int, class_weights: torch.Tensor | None = None):
    """forward_loss(model, batch) -> (loss, metric sums), under `precision`'s autocast (speedups/amp.py).

    With `class_weights` (--class-weights, one per class, on the device) the loss is the weighted
    mean, sum(w[y] x loss) / sum(w[y]) over the batch: `F.cross_entropy(weight=...)`, packed or padded.
    """

    def forward_loss(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        with precision.autocast():  # mixed precision: matmuls and attention in 16 bits (speedups/amp.py)
            logits = classify(model, batch, max_length)
        loss = F.cross_entropy(logits.float(), batch["labels"], weight=class_weights)
        return loss, metric_sums(loss, logits, batch["labels"])

    return forward_loss


def class_weights(setting, train_labels: np.ndarray, label_names: list) -> list | None:
    """--class-weights as the loss's weight of each class: 'balanced' is scikit-learn's
    n_samples / (n_classes x count) over the training split as used (--train-size); a list is checked."""
    if setting is None:
        return None
    k = len(label_names)
    if setting != "balanced":
        if len(setting) != k:
            raise ValueError(f"--class-weights gives {len(setting)} weight(s), the data has {k} classes "
                             f"({', '.join(label_names[:10])}{', ...' if k > 10 else ''}): give one each")
        return list(setting)
    counts = np.bincount(train_labels, minlength=k)
    if not counts.all():
        missing = label_names[int(np.argmin(counts))]
        raise ValueError(f"--class-weights balanced: the {len(train_labels)} training examples used hold no "
                         f"{missing!r}, so its weight would be infinite; use more (--train-size) or give the weights")
    return (len(train_labels) / (k * counts)).tolist()


def train_step(strategy, micro_batches: list[dict], forward_loss) -> torch.Tensor:
    """One optimiser step over `micro_batches` (gradient accumulation); returns their metric sums."""
    sums = 0
    for i, batch in enumerate(micro_batches):
        batch = strategy.to_device(batch)
        with strategy.grad_sync(enabled=i == len(micro_batches) - 1):  # DDP / FSDP: reduce on the last
            loss, batch_sums = forward_loss(strategy.model, batch)
            strategy.backward(loss / len(micro_batches))  # the mean over the micro-batches
        sums = sums + batch_sums
    strategy.optimizer_step()  # (unscale, clip) step, update the scaler, zero the gradients
    return sums


def max_steps_reached(global_step: int, max_steps: int | None) -> bool:
    return max_steps is not None and global_step >= max_steps


def train_epoch(strategy, train_loader, bookkeeping, forward_loss, grad_accum: int, max_steps: int | None):
    """One epoch (or the rest of one, after a resume): train_step around `for batch in loader`.

    A generator: it yields the `Due` of each step that makes last.pt due (--save-every,
    --save-every-minutes, or a stop after a signal), for train.py to write; the epoch's metrics
    are then `bookkeeping.end_epoch()`'s.
    """
    strategy.train()
    micro_batches, batches_left = [], len(train_loader)
    for batch in bookkeeping.timed_batches(train_loader):  # counts the batch and the time spent waiting for it
        micro_batches.append(batch)
        batches_left -= 1
        if len(micro_batches) < grad_accum and batches_left:  # --grad-accum batches, fewer at the epoch's end
            continue
        sums = train_step(strategy, micro_batches, forward_loss)
        last = not batches_left or max_steps_reached(bookkeeping.position.global_step + 1, max_steps)
        due = bookkeeping.after_step(sums, len(micro_batches), ends_epoch=last)  # counters, sums; what is due
        if due.log:
            bookkeeping.log()
        if due.save:
            yield due  # train.py writes last.pt (and stops, if due.stop)
        if last:
            break
        micro_batches = []
