"""The training step and the epoch loop, as the textbook writes them.

    for batch in train_loader:                          # train_epoch
        micro_batches.append(batch)                     #   --grad-accum batches make one step
        sums = train_step(strategy, micro_batches, forward_loss)
        book.after_step(sums, len(micro_batches))       #   counters, logs, checkpoints, signals

`train_step` is the whole computation of one optimiser step: move each micro-batch to the
device, forward under autocast, the loss, the scaled backward (gradients reduced across
processes only on the last micro-batch), then unscale, clip, step, update the scaler and zero
the gradients. `forward_loss` (forward, loss and the batch's metric sums) is the function
`torch.compile` compiles whole on one device, so what a reader reads is what runs.

Everything that is not the computation (step counters, the epoch's metric sums, the log
window, the first non-finite loss, the throughput meter, signals, checkpoints, resume) lives in
`bookkeeping.Bookkeeping`; the strategy (`strategies/base.py`) holds what differs between one
device, DDP, FSDP and DeepSpeed. Nothing here reads a value back from the device: losses and
correct counts stay on it as sums, read at log steps.
"""

from __future__ import annotations

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
    n = labels.shape[0]
    correct = (logits.argmax(dim=-1) == labels).sum().double()
    loss = loss.detach().double()
    return torch.stack([loss * n, correct, torch.full_like(loss, n), loss])


def make_forward_loss(strategy, max_length: int):
    """forward_loss(model, batch) -> (loss, metric sums): compiled whole where the strategy does."""

    def forward_loss(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        with strategy.autocast():  # mixed precision: matmuls and attention in 16 bits (speedups/amp.py)
            logits = classify(model, batch, max_length)
        loss = F.cross_entropy(logits.float(), batch["labels"])
        return loss, metric_sums(loss, logits, batch["labels"])

    return strategy.compile_step(forward_loss)


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


def train_epoch(strategy, train_loader, book, forward_loss) -> dict:
    """One epoch (or the rest of one, after a resume): train_step around `for batch in loader`."""
    strategy.train()
    micro_batches = []
    for batch in book.timed(train_loader):  # counts the batch and the time spent waiting for it
        micro_batches.append(batch)
        if not book.ends_step(len(micro_batches)):  # --grad-accum batches, fewer at the epoch's end
            continue
        sums = train_step(strategy, micro_batches, forward_loss)
        if book.after_step(sums, len(micro_batches)):  # True once --max-steps is reached
            break
        micro_batches = []
    return book.end_epoch()
