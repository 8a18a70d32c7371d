"""The IMDB loader, the article's split, the token cache and the samplers' basic contracts."""

from __future__ import annotations

import hashlib
import os
import tarfile

import numpy as np
import pytest
from conftest import tar_folder, write_imdb

from fastpt.inputs import data, imdb, token_cache
from fastpt.inputs.models import load_tokenizer
from fastpt.errors import DataError


# From shared/data/README.md: the article's split, fingerprinted.
ARTICLE_SPLIT = {
    "train": (35000, 17548, ["train/pos/11122_10.txt", "train/pos/7811_7.txt", "train/pos/7382_8.txt"],
              "f1dc0bb04ab74e0d"),
    "validation": (5000, 2458, ["train/pos/4304_9.txt", "train/pos/3800_7.txt", "train/pos/3077_10.txt"],
                   "e8b9e7c62c0aeda4"),
    "test": (10000, 4994, ["train/pos/11974_10.txt", "test/pos/6936_9.txt", "test/pos/6236_7.txt"], "a4937188a6b37789"),
}


def real_data_source():
    root = os.environ.get("FASTPT_DATA_DIR")
    if not root:
        return None
    try:
        return imdb.find_source(root)
    except DataError:
        return None


@pytest.mark.realdata
@pytest.mark.skipif(real_data_source() is None, reason="FASTPT_DATA_DIR does not point at the real IMDB data")
def test_real_data_reproduces_the_article_split_exactly():
    reviews = imdb.read_reviews(real_data_source())
    assert len(reviews.keys) == 50000 and reviews.labels.sum() == 25000
    for name, idx in imdb.split_indices(len(reviews.keys)).items():
        rows, positives, first_three, digest = ARTICLE_SPLIT[name]
        keys = [reviews.keys[i] for i in idx]
        assert len(keys) == rows
        assert int(reviews.labels[idx].sum()) == positives
        assert keys[:3] == first_three
        assert hashlib.sha256("\n".join(keys).encode()).hexdigest().startswith(digest)


def test_split_sizes_disjoint_deterministic_and_balanced():
    for n in (50000, 160, 1001):
        a, b = imdb.split_indices(n), imdb.split_indices(n)
        sizes = [len(a[s]) for s in ("train", "validation", "test")]
        assert sum(sizes) == n
        assert sizes[0] == round(0.7 * n) and sizes[1] == round(0.1 * n)
        assert all(np.array_equal(a[s], b[s]) for s in a)
        assert len(np.unique(np.concatenate(list(a.values())))) == n
    assert [len(v) for v in imdb.split_indices(50000).values()] == [35000, 5000, 10000]


def test_reviews_read_in_article_order_from_tarball_and_folder(imdb_dir, tmp_path):
    from_tar = imdb.read_reviews(imdb.find_source(str(imdb_dir)))
    folder = write_imdb(tmp_path)  # same seed: the same made-up reviews
    from_folder = imdb.read_reviews(imdb.find_source(str(tmp_path)))
    assert from_tar.keys == from_folder.keys and from_tar.texts == from_folder.texts
    assert np.array_equal(from_tar.labels, from_folder.labels)
    # test/pos, test/neg, train/pos, train/neg, each in string-sorted file order
    prefixes = [k.rsplit("/", 1)[0] for k in from_tar.keys]
    assert prefixes == sorted(prefixes, key=imdb.FOLDERS.index)
    names = [k.rsplit("/", 1)[1] for k in from_tar.keys if k.startswith("test/pos/")]
    assert names == sorted(names) and names[1].startswith("10_")  # a string sort: 0_, 10_, 11_, ..., 1_
    assert from_tar.labels.sum() == len(from_tar.keys) // 2
    assert imdb.find_source(str(folder)) == folder  # the aclImdb/ folder itself is accepted too


def test_labelled_tarball_name_is_found(tmp_path):
    tar_folder(write_imdb(tmp_path / "src", per_folder=3), tmp_path / "aclImdb_v1_labelled.tar.gz")
    assert imdb.find_source(str(tmp_path)).name == "aclImdb_v1_labelled.tar.gz"


def test_loader_errors_are_clear(tmp_path):
    with pytest.raises(DataError, match="no IMDB data in"):
        imdb.find_source(str(tmp_path))
    corrupt = tmp_path / "aclImdb_v1.tar.gz"
    corrupt.write_bytes(b"\x1f\x8b\x08\x00 definitely not a tarball")
    with pytest.raises(DataError, match="cannot read"):
        imdb.read_reviews(corrupt)
    wrong = tmp_path / "wrong.tar.gz"
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x.txt").write_text("hello")
    with tarfile.open(wrong, "w:gz") as tar:
        tar.add(tmp_path / "other", arcname="other")
    with pytest.raises(DataError, match="has no aclImdb/test/pos"):
        imdb.read_reviews(wrong)


def test_offline_download_fails_with_advice(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FASTPT_DATA_DIR", raising=False)
    monkeypatch.setattr(imdb, "URL", "http://127.0.0.1:9/aclImdb_v1.tar.gz")  # nothing listens there
    with pytest.raises(DataError, match="--data-dir"):
        imdb.find_source(None)
    assert not list((tmp_path / "data").glob("*.part"))


def test_token_cache_is_reused_and_serves_every_max_length(imdb_dir, tmp_path):
    tokenizer = load_tokenizer("tiny")
    splits, path = token_cache.prepare_splits(str(imdb_dir), str(tmp_path), tokenizer, 32)
    again, path_again = token_cache.prepare_splits(str(imdb_dir), str(tmp_path), tokenizer, 32)
    assert path == path_again
    shorter, other = token_cache.prepare_splits(str(imdb_dir), str(tmp_path), tokenizer, 16)
    assert other == path and shorter["train"].lengths.max() <= 16  # one cache, cut on load
    assert [len(splits[s]) for s in token_cache.SPLITS] == [112, 16, 32]
    assert splits["train"].lengths.max() <= 32
    assert np.array_equal(splits["train"].ids, again["train"].ids)
    # the cached order is the article's split order
    reviews = imdb.read_reviews(imdb.find_source(str(imdb_dir)))
    keys = token_cache.split_keys(path)
    for name, idx in imdb.split_indices(len(reviews.keys)).items():
        assert keys[name] == [reviews.keys[i] for i in idx]
    # token ids are the tokenizer's, with <br /> turned into spaces
    first = reviews.keys.index(keys["train"][0])
    expected = tokenizer(reviews.texts[first].replace("<br />", " "), truncation=True, max_length=32)["input_ids"]
    assert splits["train"][0][0].tolist() == expected


def test_head_takes_the_first_examples(imdb_dir, cache_dir):
    splits, _ = token_cache.prepare_splits(str(imdb_dir), str(cache_dir), load_tokenizer("tiny"), 64)
    head = splits["train"].head(10)
    assert len(head) == 10
    for i in range(10):
        assert np.array_equal(head[i][0], splits["train"][i][0]) and head[i][1] == splits["train"][i][1]


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("n", [16, 17, 31])
def test_evaluation_shards_count_every_example_once(n, world_size):
    lengths = np.random.RandomState(n).randint(5, 50, size=n)
    ds = data.TokenizedSplit(np.zeros(lengths.sum(), np.int32), np.concatenate([[0], np.cumsum(lengths)]),
                             np.zeros(n, np.int64))
    for sort in (False, True):
        samplers = [data.EvalBatchSampler(ds, 4, rank, world_size, sort_by_length=sort) for rank in range(world_size)]
        assert len({len(s) for s in samplers}) == 1  # equal batch counts: sharded forwards never hang
        weighted = [i for s in samplers for batch in s for i, w in batch if w > 0]
        assert sorted(weighted) == list(range(n))


def test_collator_pads_to_max_length_or_longest():
    items = [(np.array([101, 5, 102]), 1, 1.0), (np.array([101, 5, 6, 7, 102]), 0, 1.0)]
    fixed = data.Collator(0, "max_length", 16)(items)
    dynamic = data.Collator(0, "longest", 16)(items)
    assert fixed["input_ids"].shape == (2, 16) and dynamic["input_ids"].shape == (2, 5)
    assert dynamic["attention_mask"].sum().item() == 8
    assert dynamic["input_ids"][0].tolist() == [101, 5, 102, 0, 0]
    assert dynamic["labels"].tolist() == [1, 0]
