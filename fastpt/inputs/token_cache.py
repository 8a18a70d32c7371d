"""The token cache: IMDB read, split and tokenised once, then loaded in a second.

The article's split is tokenised at `CACHE_MAX_LENGTH` (512) and saved as Arrow files with
`datasets`, under a key made of the data's content and the tokenizer's vocabulary, so any
run with the same data and tokenizer finds it, and a shorter `--max-length` is cut from it on
load (`truncate`: equal to tokenising at that length, tested). Building is atomic (a temporary
folder renamed into place) and takes turns on a lock file, so concurrent runs build it once.
Under torchrun each node's first process builds or finds its own copy (`prepare_splits`):
nodes need not share a disk.

A cache folder may be shared (one FASTPT_CACHE_DIR for a team), so it is not trusted blindly:
its build records a digest of every file, every load checks it, and a folder closed to this user
or a full disk is one line (files/shared_cache.py: the lock, the atomic publish, the checks).
"""

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np

from fastpt.inputs import imdb
from fastpt.inputs.data import TokenizedSplit
from fastpt.files import shared_cache
from fastpt.errors import DataError, DiskFull


CACHE_VERSION = 3  # 3: every cache folder carries its digest


CACHE_MAX_LENGTH = 512  # the longest --max-length: one cache serves every shorter one


SPLITS = ("train", "validation", "test")


def _source_fingerprint(source: Path) -> str:
    """Identity of the data by content, not path: the same tarball or folder anywhere shares one cache.

    A tarball: its size and the SHA-256 of its first 4 MiB (gzip headers and the first thousands
    of reviews; a different or truncated file differs there or in size). A folder: every review's
    name and size.
    """
    h = hashlib.sha256()
    if source.is_file():
        h.update(f"file:{source.stat().st_size}:".encode())
        with open(source, "rb") as f:
            h.update(f.read(4 << 20))
    else:
        for folder in imdb.FOLDERS:
            d = source / folder
            for name in sorted(os.listdir(d)) if d.is_dir() else []:
                h.update(f"{folder}/{name}:{(d / name).stat().st_size}\n".encode())
    return h.hexdigest()


def _tokenizer_fingerprint(tokenizer) -> str:
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()))
    lower = getattr(tokenizer, "do_lower_case", "")
    return hashlib.sha256(f"{type(tokenizer).__name__}:{lower}:{vocab}".encode()).hexdigest()


def cache_key(source: Path, tokenizer) -> str:
    """One cache per (data, tokenizer): built at CACHE_MAX_LENGTH, cut to any shorter --max-length on load."""
    parts = {
        "version": CACHE_VERSION,
        "source": _source_fingerprint(source),
        "tokenizer": _tokenizer_fingerprint(tokenizer),
        "max_length": CACHE_MAX_LENGTH,
        "split": imdb.SPLIT_FRACTIONS,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


def cache_root(cache_dir: str | None) -> Path:
    """--cache-dir, else the default: where the token cache (and the Inductor cache) live."""
    return Path(cache_dir or os.environ.get("FASTPT_CACHE_DIR") or Path.home() / ".cache" / "fastpt")


def build_cache(source: Path, tokenizer, target: Path) -> None:
    """Read, split and tokenise all reviews at CACHE_MAX_LENGTH; publish the splits under target atomically.

    The splits are written to a temporary folder and renamed into place, so a reader never sees
    a half-written cache. If another process published the same cache first (same key, same
    content), its copy is kept and this one dropped.
    """
    reviews = imdb.read_reviews(source)
    texts = [t.replace("<br />", " ") for t in reviews.texts]
    columns = {name: {"key": [reviews.keys[i] for i in idx], "text": [texts[i] for i in idx],
                      "label": reviews.labels[idx].tolist()} for name, idx in imdb.split_indices(len(texts)).items()}
    save_tokenized(columns, lambda batch: tokenizer(batch["text"], truncation=True, max_length=CACHE_MAX_LENGTH),
                   ["key", "input_ids", "label"], target)


def save_tokenized(columns: dict, tokenize, keep: list, target: Path, files: dict | None = None) -> None:
    """{split: {column: values}} tokenised in batches (`tokenize`: a batch -> the tokenizer's output), the
    `keep` columns saved with `datasets` and any `files` ({name: text}) beside them, published at target."""
    import datasets

    tmp = shared_cache.new_temporary(target)
    try:
        tokenized = {name: datasets.Dataset.from_dict(split).map(
            tokenize, batched=True, batch_size=1000, desc=f"tokenising {name}", load_from_cache_file=False,
            keep_in_memory=True).select_columns(keep) for name, split in columns.items()}
        datasets.DatasetDict(tokenized).save_to_disk(str(tmp))
        for name, text in (files or {}).items():
            (tmp / name).write_text(text)
        shared_cache.publish(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_cache(path: Path, max_length: int, keep_last: bool = True) -> dict[str, TokenizedSplit]:
    """The cached splits, each sequence cut to max_length tokens.

    With keep_last (tokenizers that end a sequence with a special token, BERT's [SEP]) a cut
    sequence keeps its first max_length - 1 tokens and then its last: exactly what tokenising
    with truncation at max_length gives.
    """
    import datasets

    shared_cache.verify(path)
    loaded = datasets.load_from_disk(str(path))
    out = {}
    for name in SPLITS:
        column = loaded[name].data.column("input_ids").combine_chunks()
        offsets = column.offsets.to_numpy().astype(np.int64)
        ids, offsets = truncate(column.values.to_numpy().astype(np.int32), offsets - offsets[0], max_length, keep_last)
        out[name] = TokenizedSplit(ids, offsets, np.asarray(loaded[name]["label"], dtype=np.int64))
    return out


def truncate(ids: np.ndarray, offsets: np.ndarray, max_length: int, keep_last: bool) -> tuple[np.ndarray, np.ndarray]:
    """Flat token ids + offsets with every sequence cut to max_length (see load_cache)."""
    lengths = np.diff(offsets)
    if lengths.size == 0 or lengths.max() <= max_length:
        return ids, offsets
    kept = np.minimum(lengths, max_length)
    new_offsets = np.concatenate([[0], np.cumsum(kept)])
    # Position in the old array of every kept token: its sequence's old start + its place in it.
    source = np.arange(new_offsets[-1]) - np.repeat(new_offsets[:-1] - offsets[:-1], kept)
    if keep_last:
        cut = lengths > max_length
        source[new_offsets[1:][cut] - 1] = offsets[1:][cut] - 1
    return ids[source], new_offsets


def ends_with_special_token(tokenizer) -> bool:
    """Whether the tokenizer closes every sequence with a special token ([SEP], </s>)."""
    ids = tokenizer("a")["input_ids"]
    return bool(ids) and ids[-1] in set(tokenizer.all_special_ids)


def split_keys(path: Path) -> dict[str, list[str]]:
    """The review names in each cached split, in order (for fingerprint checks)."""
    import datasets

    loaded = datasets.load_from_disk(str(path))
    return {name: loaded[name]["key"] for name in SPLITS}


def prepare_splits(data_dir: str | None, cache_dir: str | None, tokenizer, max_length: int,
                   builds: bool = True, gather=lambda obj: [obj],
                   builder: int = 0) -> tuple[dict[str, TokenizedSplit], Path]:
    """Tokenised train/validation/test splits, cut to max_length.

    The processes that `builds` (under torchrun each node's LOCAL_RANK 0) find the data and build
    the cache, or find it built, in their own --cache-dir: nodes need not share a disk. `gather`
    (an all-gather over ranks) then hands every rank the outcomes: each reads the cache of its
    node's builder (global rank `builder`), and an error anywhere, or nodes whose data differ,
    stops every rank with the same one-line message instead of leaving them waiting on one that
    has stopped. Separate runs building the same cache at once (also nodes sharing --cache-dir)
    take turns on a lock file: one tokenises, the others wait for it and then read its finished cache.
    """
    def locate():
        source = imdb.find_source(data_dir)
        path = cache_root(cache_dir) / f"imdb-{cache_key(source, tokenizer)}"
        return path, lambda: build_cache(source, tokenizer, path)

    path = built_once(locate, builds, gather, builder)
    with shared_cache.reported(path):
        return load_cache(path, max_length, ends_with_special_token(tokenizer)), path


def built_once(locate, builds: bool, gather, builder: int) -> Path:
    """The cache folder every rank reads: `locate()` gives (path, build), and a process that `builds`
    builds it there unless it is complete; the outcomes are gathered and agreed on (see prepare_splits)."""
    outcome = None
    if builds:
        try:
            path, build = locate()
            with shared_cache.reported(path):
                if not shared_cache.is_complete(path):
                    shared_cache.build_once(path, build)
            outcome = ("ok", str(path))
        except (DataError, DiskFull) as e:
            outcome = shared_cache.failure(e)
    return shared_cache.agree(gather(outcome), builder)
