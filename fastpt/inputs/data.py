"""Batches and the DataLoaders that feed the training loop (the splits come tokenised from token_cache.py).

Tokenisation never happens inside the training loop: the token cache holds every review's ids,
and a batch is only gathered and padded (`Collator`) or laid end to end (`packing.PackedCollator`).

Fast loading, as the second article recommends (it replaces Lightning's DataLoader defaults):
- `num_workers` worker processes build batches in parallel with the model's step;
- `pin_memory` puts batches in page-locked memory so the host-to-GPU copy can be
  asynchronous (`non_blocking=True` in the loop);
- `persistent_workers` keeps workers alive between epochs; `prefetch_factor` keeps batches
  queued ahead of the model.

Sampling is rank-aware: training cuts one permutation per epoch into global batches and gives
every process its share of each (the same order on any number of processes); evaluation gives
every example to exactly one rank and pads ranks to equal batch counts with examples of
weight 0, so sums over ranks count each example exactly once.
"""

import math
import os

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from fastpt.speedups.bucketing import group_by_length


class TokenizedSplit(Dataset):
    """Token ids of one split as a flat int32 array plus offsets: cheap to share with workers."""

    def __init__(self, ids: np.ndarray, offsets: np.ndarray, labels: np.ndarray):
        self.ids, self.offsets, self.labels = ids, offsets, labels
        self.lengths = np.diff(offsets)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, key):
        # Evaluation samplers yield (index, weight): weight 0 marks padding to equal rank shards.
        index, weight = key if isinstance(key, tuple) else (key, 1.0)
        tokens = self.ids[self.offsets[index]:self.offsets[index + 1]]
        return tokens, int(self.labels[index]), weight

    @classmethod
    def from_token_lists(cls, input_ids: list, labels=None) -> "TokenizedSplit":
        """A split from a tokenizer's `input_ids` lists (fastpt-predict's texts); labels 0 where there are none."""
        lengths = np.array([len(ids) for ids in input_ids], dtype=np.int64)
        flat = np.fromiter((t for ids in input_ids for t in ids), dtype=np.int32, count=int(lengths.sum()))
        labels = np.zeros(len(input_ids), np.int64) if labels is None else np.asarray(labels, dtype=np.int64)
        return cls(flat, np.concatenate([[0], np.cumsum(lengths)]), labels)

    def head(self, n: int | None) -> "TokenizedSplit":
        """The first n examples (all when n is None)."""
        if n is None or n >= len(self):
            return self
        return TokenizedSplit(self.ids[:self.offsets[n]], self.offsets[:n + 1], self.labels[:n])


class Collator:
    """Pads a batch to `max_length` (the article) or to its own longest sequence.

    Besides the tensors, a batch carries `lengths` (each review's tokens) and `num_tokens` (the
    tokens the model computes, padding included) as Python ints, so the throughput meter counts
    without reading a tensor.
    """

    def __init__(self, pad_id: int, pad_to: str, max_length: int, sep_id: int | None = None):
        self.pad_id, self.pad_to, self.max_length = pad_id, pad_to, max_length
        self.sep_id = sep_id  # sentence pairs on BERT-style models: token_type_ids from the [SEP] tokens

    def __call__(self, items):
        lengths = [len(t) for t, _, _ in items]
        width = self.max_length if self.pad_to == "max_length" else max(lengths)
        input_ids = torch.full((len(items), width), self.pad_id, dtype=torch.long)
        for row, (tokens, _, _) in enumerate(items):
            input_ids[row, :len(tokens)] = torch.from_numpy(tokens.astype(np.int64))
        attention_mask = (torch.arange(width) < torch.tensor(lengths)[:, None]).long()
        batch = {"input_ids": input_ids, "attention_mask": attention_mask,
                 "labels": torch.tensor([label for _, label, _ in items], dtype=torch.long),
                 "weight": torch.tensor([weight for _, _, weight in items], dtype=torch.float32),
                 "lengths": lengths, "num_tokens": len(items) * width}
        if self.sep_id is not None:
            batch["token_type_ids"] = pair_token_types(input_ids, attention_mask, self.sep_id)
        return batch


def pair_token_types(input_ids: torch.Tensor, attention_mask: torch.Tensor, sep_id: int) -> torch.Tensor:
    """BERT's segment ids of `[CLS] a [SEP] b [SEP]`: 0 up to the first [SEP] included, 1 after, 0 on padding.

    The cache keeps only input_ids; this rebuilds what the tokenizer's token_type_ids were
    (own_data.py checks that it does, for the tokenizer in use)."""
    sep = (input_ids == sep_id).long()
    return (((sep.cumsum(-1) - sep) > 0).long() * attention_mask).long()


def make_collator(cfg, pad_id: int, sep_id: int | None = None):
    """Padded batches (Collator), or padding-free packed ones with --pack (packing.PackedCollator)."""
    if cfg.pack:
        from fastpt.speedups.packing import PackedCollator
        return PackedCollator(pad_id, cfg.pack_multiple, cfg.max_length)
    return Collator(pad_id, cfg.pad_to, cfg.max_length, sep_id)


# --------------------------------------------------------------------------- samplers

class TrainBatchSampler(Sampler):
    """Batches of one rank's share of each global batch, for one epoch at a time.

    The epoch's order is the same for any number of processes: a permutation of the training
    set by (seed, epoch) (DistributedSampler's), cut into global batches of world_size x
    batch_size reviews; rank r takes places r, r + world_size, ... of each (DistributedSampler's
    interleaving, so a run on N processes with batch B trains on what one process with batch N x B
    does). The last incomplete global batch is dropped, as the article's DataLoader does. With
    `bucket`, global batches are grouped by length (see bucketing.py); with `balance_tokens`
    (--pack on several processes) each global batch is shared out so that every rank gets about
    the same number of tokens (see `balance_tokens`).

    Because a position in the epoch is a number of global batches, it means the same reviews on
    any number of processes: `start_batch` skips the global batches already trained on, so a
    resumed epoch continues exactly where it stopped, also on another number of processes (resize.py).
    `offset` skips that many reviews of the order before cutting it: where a resumed run cannot keep
    the global batch, it continues with the reviews the earlier run had not reached.
    """

    def __init__(self, dataset: TokenizedSplit, batch_size: int, rank: int, world_size: int,
                 seed: int, bucket: bool = False, bucket_multiplier: int = 50, balance_tokens: bool = False):
        self.lengths, self.n = dataset.lengths, len(dataset)
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.seed, self.bucket, self.multiplier, self.balance = seed, bucket, bucket_multiplier, balance_tokens
        self.epoch, self.start_batch, self.offset = 0, 0, 0

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.world_size

    def set_epoch(self, epoch: int, start_batch: int = 0, offset: int = 0) -> None:
        if offset and self.bucket:
            raise ValueError("bucketed batches can only be skipped whole")
        self.epoch, self.start_batch, self.offset = epoch, start_batch, offset

    def global_batches(self) -> list[list[int]]:
        """The epoch's full global batches, from `offset` on (`start_batch` is not applied here)."""
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.n, generator=g).tolist()[self.offset:]  # DistributedSampler's permutation
        size = self.global_batch_size
        if self.bucket:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            batches = group_by_length(order, self.lengths, size, self.multiplier, g)
        else:
            batches = [order[i:i + size] for i in range(0, len(order), size)]
        return [b for b in batches if len(b) == size]

    def shares(self, global_batch: list[int]) -> list[list[int]]:
        """One list of batch_size reviews per rank."""
        if self.balance and self.world_size > 1:
            return balance_tokens(global_batch, self.lengths, self.world_size)
        return [global_batch[r::self.world_size] for r in range(self.world_size)]

    def __iter__(self):
        return iter([self.shares(b)[self.rank] for b in self.global_batches()[self.start_batch:]])

    def __len__(self) -> int:
        return (self.n - self.offset) // self.global_batch_size - self.start_batch


def balance_tokens(global_batch: list[int], lengths, world_size: int) -> list[list[int]]:
    """Share a global batch out so that every rank gets batch_size reviews and about the same tokens.

    Why: with --pack a rank computes exactly its reviews' tokens, and a DDP step waits for the
    rank with the most. Shared out by place, the fullest of 2 ranks holds on average 1.085x the
    mean tokens, up to 1.42x, at 512 tokens and batch 12 (balanced: 1.004x; scripts/results/pack-balance.md).
    Longest first, each review goes to the rank
    with the fewest tokens that still has room (greedy "longest processing time" with equal
    counts); the global batch, and so the step's gradient, is unchanged. Ties go to the lower rank,
    so every rank computes the same shares without talking. Each rank keeps its reviews in
    their order in the global batch.
    """
    per_rank = len(global_batch) // world_size
    tokens, shares = [0] * world_size, [[] for _ in range(world_size)]
    for place in sorted(range(len(global_batch)), key=lambda p: -int(lengths[global_batch[p]])):
        rank = min((r for r in range(world_size) if len(shares[r]) < per_rank), key=lambda r: tokens[r])
        shares[rank].append(place)
        tokens[rank] += int(lengths[global_batch[place]])
    return [[global_batch[p] for p in sorted(places)] for places in shares]


def computed_tokens(cfg):
    """tokens(lengths of a rank's batch) -> the tokens the model computes for it, padding included."""
    if cfg.pack:
        return sum
    if cfg.pad_to == "longest":
        return lambda lengths: len(lengths) * max(lengths)
    return lambda lengths: len(lengths) * cfg.max_length


def rank_token_imbalance(sampler: TrainBatchSampler, tokens=sum) -> float:
    """Mean over the epoch's steps of max / mean tokens per rank: 1.0 is perfect balance.

    Every step waits for the rank with the most tokens, so this is the step time lost to
    imbalance where time follows tokens. Computed from the epoch's order, which every rank knows.
    """
    ratios = []
    for global_batch in sampler.global_batches():
        counts = [tokens([int(sampler.lengths[i]) for i in share]) for share in sampler.shares(global_batch)]
        ratios.append(max(counts) / max(np.mean(counts), 1e-9))
    return float(np.mean(ratios)) if ratios else 1.0


class EvalBatchSampler(Sampler):
    """Every example on exactly one rank; weight-0 repeats fill the last batch and even out ranks.

    Equal counts matter: sharded models (FSDP, ZeRO-3) run collectives inside forward, so all
    ranks must run the same number of batches; full last batches give evaluation one batch shape,
    which a compiled (or CUDA-graph) evaluation then never recompiles. The filler is the split's
    shortest review, the cheapest to compute. With `sort_by_length` batches are grouped by length
    (order does not change the metrics), which cuts padding in evaluation too.
    """

    def __init__(self, dataset: TokenizedSplit, batch_size: int, rank: int, world_size: int,
                 sort_by_length: bool = False):
        n = len(dataset)
        order = np.argsort(-dataset.lengths, kind="stable") if sort_by_length else np.arange(n)
        mine = order[rank::world_size].tolist()
        per_rank = math.ceil(n / world_size)
        batch_size = max(1, min(batch_size, per_rank))  # a small split: one batch, no filler
        per_rank = math.ceil(per_rank / batch_size) * batch_size  # whole batches on every rank
        filler = int(np.argmin(dataset.lengths)) if n else 0
        items = [(i, 1.0) for i in mine] + [(filler, 0.0)] * (per_rank - len(mine))  # padding, counted with weight 0
        self.batches_ = [items[i:i + batch_size] for i in range(0, len(items), batch_size)]

    def __iter__(self):
        return iter(self.batches_)

    def __len__(self) -> int:
        return len(self.batches_)


# --------------------------------------------------------------------------- loaders

def default_num_workers(on_cuda: bool, local_world_size: int) -> int:
    """Workers per process: on a GPU, all spare cores (up to 8); on the CPU, none.

    On the CPU the model's step already uses every core, and batches of cached token ids take
    microseconds to build, so worker processes would only compete with the step.
    """
    if not on_cuda:
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(8, cores // max(1, local_world_size) - 1))


def loader_settings(cfg, on_cuda: bool, local_world_size: int) -> tuple[int, bool]:
    """(workers, pin_memory): the flags, else the defaults; none of either with --data-on-device,
    where batches are gathered on the device."""
    if cfg.data_on_device:
        return 0, False
    workers = cfg.num_workers if cfg.num_workers is not None else default_num_workers(on_cuda, local_world_size)
    return workers, cfg.pin_memory if cfg.pin_memory is not None else on_cuda


def make_loader(dataset: TokenizedSplit, batch_sampler: Sampler, collate: Collator, num_workers: int,
                pin_memory: bool, seed: int) -> DataLoader:
    # Each worker is seeded by torch itself (its torch, random and numpy RNGs), from the loader's generator.
    kwargs = dict(persistent_workers=True, prefetch_factor=4) if num_workers > 0 else {}
    # A generator of its own even without workers: iter(loader) draws a seed from it, and
    # drawing from the global RNG instead would shift the dropout masks of a resumed epoch.
    return DataLoader(dataset, batch_sampler=batch_sampler, collate_fn=collate, num_workers=num_workers,
                      pin_memory=pin_memory, generator=torch.Generator().manual_seed(seed), **kwargs)
