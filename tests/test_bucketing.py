"""--bucket: length-grouped batches with dynamic padding.

Each batch of an epoch holds similar lengths and is padded only to its own longest; every
example is used exactly once per epoch, on exactly one rank; the order is fixed by (seed,
epoch) and changes between epochs. On the real IMDB data grouping reaches >= 97% real tokens.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from fastpt.inputs import data, token_cache
from fastpt.speedups.bucketing import group_by_length, padding_efficiency


def make_split(n: int, seed: int = 0) -> data.TokenizedSplit:
    """n made-up examples of lengths 5-300 (IMDB-like spread), token id = example index + 1."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(5, 300, size=n)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    ids = np.concatenate([np.full(length, i + 1, dtype=np.int32) for i, length in enumerate(lengths)])
    return data.TokenizedSplit(ids, offsets, rng.integers(0, 2, size=n))


def epoch_batches(split, batch_size=8, rank=0, world_size=1, seed=123, epoch=0, multiplier=4):
    sampler = data.TrainBatchSampler(split, batch_size, rank, world_size, seed, bucket=True,
                                     bucket_multiplier=multiplier)
    sampler.set_epoch(epoch)
    return list(sampler)


def test_group_by_length_keeps_every_index_once_and_sorts_within_mega_batches():
    lengths = np.random.default_rng(1).integers(1, 500, size=203)
    indices = np.random.default_rng(2).permutation(203).tolist()
    batches = group_by_length(indices, lengths, batch_size=4, multiplier=5, generator=torch.Generator().manual_seed(0))
    assert Counter(i for b in batches for i in b) == Counter(indices)
    assert sum(len(b) < 4 for b in batches) == 1  # only the tail of the last mega-batch is short
    for start in range(0, 200, 20):  # each mega-batch is cut into batches of neighbouring lengths
        mega = set(indices[start:start + 20])
        mine = [b for b in batches if set(b) <= mega]
        assert sum(map(len, mine)) == len(mega)
        spans = sorted((min(lengths[b]), max(lengths[b])) for b in map(np.array, mine))
        assert all(hi <= next_lo for (_, hi), (next_lo, _) in zip(spans, spans[1:]))


def test_every_example_exactly_once_per_epoch_deterministic_and_reshuffled():
    split = make_split(96)  # a multiple of the batch size: no batch dropped
    first = epoch_batches(split, epoch=0)
    assert sorted(i for b in first for i in b) == list(range(96))
    assert all(len(b) == 8 for b in first)
    assert first == epoch_batches(split, epoch=0)  # same seed and epoch: same batches
    assert first != epoch_batches(split, epoch=1)  # next epoch: new mega-batches and order
    assert first != epoch_batches(split, epoch=0, seed=7)
    assert sorted(i for b in epoch_batches(split, epoch=1) for i in b) == list(range(96))


def test_drops_at_most_one_incomplete_batch_and_len_matches():
    split = make_split(101)
    sampler = data.TrainBatchSampler(split, 8, 0, 1, 123, bucket=True, bucket_multiplier=4)
    sampler.set_epoch(0)
    batches = list(sampler)
    seen = [i for b in batches for i in b]
    assert len(batches) == len(sampler) == 101 // 8
    assert len(seen) == len(set(seen)) == 96


def test_bucketing_on_top_of_the_distributed_shards():
    split = make_split(128)
    ranks = [epoch_batches(split, rank=r, world_size=2, epoch=3) for r in range(2)]
    seen = [[i for b in batches for i in b] for batches in ranks]
    assert len(ranks[0]) == len(ranks[1])  # equal step counts: no rank waits in a collective
    assert not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == list(range(128))
    # Ranks share each global batch: the steps are one process's with the global batch (16), whatever the split.
    single = epoch_batches(split, batch_size=16, epoch=3)
    assert [sorted(a + b) for a, b in zip(*ranks)] == [sorted(b) for b in single]


def test_resumed_epoch_continues_with_the_same_batches():
    split = make_split(96)
    sampler = data.TrainBatchSampler(split, 8, 0, 1, 123, bucket=True, bucket_multiplier=4)
    sampler.set_epoch(2)
    full = list(sampler)
    sampler.set_epoch(2, start_batch=5)
    assert list(sampler) == full[5:] and len(sampler) == len(full) - 5


def test_batches_are_padded_only_to_their_own_longest():
    split = make_split(96)
    collate = data.Collator(pad_id=0, pad_to="longest", max_length=512)
    loader = data.make_loader(split, data.TrainBatchSampler(split, 8, 0, 1, 123, bucket=True, bucket_multiplier=4),
                              collate, num_workers=0, pin_memory=False, seed=123)
    for batch_indices, batch in zip(epoch_batches(split), loader):
        lengths = split.lengths[batch_indices]
        assert batch["input_ids"].shape == (8, lengths.max())
        assert batch["attention_mask"].sum(dim=1).tolist() == lengths.tolist()
        for row, i in enumerate(batch_indices):  # each row holds its own example, then padding
            assert (batch["input_ids"][row, :lengths[row]] == i + 1).all()
            assert (batch["input_ids"][row, lengths[row]:] == 0).all()


def test_grouping_raises_padding_efficiency_over_random_batches():
    split = make_split(2000)
    plain = data.TrainBatchSampler(split, 12, 0, 1, 123)
    plain.set_epoch(0)
    random_eff = padding_efficiency(split.lengths, list(plain))
    bucket_eff = padding_efficiency(split.lengths, epoch_batches(split, batch_size=12, multiplier=50))
    assert padding_efficiency(split.lengths, [[0, 1]], pad_to=600) == (split.lengths[0] + split.lengths[1]) / 1200
    assert random_eff < 0.7 < 0.97 < bucket_eff


def real_data_dir() -> Path | None:
    for candidate in (os.environ.get("FASTPT_DATA_DIR"), Path(__file__).resolve().parents[2] / "shared" / "data"):
        if candidate and Path(candidate).is_dir() and any(Path(candidate).glob("aclImdb*")):
            return Path(candidate)
    return None


@pytest.mark.slow  # tokenises all 50,000 reviews once in a new cache (about a minute)
@pytest.mark.realdata
@pytest.mark.skipif(real_data_dir() is None, reason="real IMDB data not found (set FASTPT_DATA_DIR)")
def test_real_imdb_padding_efficiency():
    """The issue's numbers on the real training split, uncased BERT vocabulary, 512 tokens."""
    from fastpt.inputs.models import load_tokenizer

    splits, _ = token_cache.prepare_splits(str(real_data_dir()), os.environ.get("FASTPT_CACHE_DIR"),
                                           load_tokenizer("distilbert-base-uncased"), 512)
    train = splits["train"]
    plain = data.TrainBatchSampler(train, 12, 0, 1, 123)
    bucketed = data.TrainBatchSampler(train, 12, 0, 1, 123, bucket=True)
    plain.set_epoch(0)
    bucketed.set_epoch(0)
    assert 0.49 < padding_efficiency(train.lengths, list(plain), pad_to=512) < 0.56
    assert 0.51 < padding_efficiency(train.lengths, list(plain)) < 0.58
    assert padding_efficiency(train.lengths, list(bucketed)) >= 0.97
