"""Your own data: any text-classification table, read, checked, split, tokenised once and cached.

    python train.py --data reviews.csv --text-column text --label-column label

Sources (`--data`: a file, a saved `datasets` folder, a Hub dataset) and reading them: tables.py;
its columns and labels: columns.py.

A split the source does not have is carved from the training set: `--val-fraction` (0.1) and
`--test-fraction` (0.2) of each label's rows, drawn with `--split-seed` (stratified, so every
split keeps the label proportions). config.json records the fractions, the seed and where each
split came from (`data_splits`), so the same command gets the same split.

Bad input stops before anything is written, with one line: a missing or repeated column (the
line lists those there are), an empty file or split, one class only or more than 1,000
(columns.MAX_LABELS), a validation or test label the training set lacks, empty or non-string texts
or texts with a lone surrogate, missing labels (how many and where), a malformed CSV row (file and
the line it starts on), a --label-names or --class-weights list of another length than the labels
(before tokenising: no cache entry is left).

The tokenised splits are Arrow files (`datasets.save_to_disk`) under a key made of the files'
content, the columns, the split settings and the tokenizer, built at 512 tokens and cut to a
shorter --max-length on load, exactly like IMDB's (token_cache.py); sentence pairs are
tokenised at --max-length itself (truncation shortens the longer text first, which cutting
later could not reproduce). They load as the same `TokenizedSplit`s, so every technique works
unchanged. For sentence pairs on models whose tokenizer makes token_type_ids (BERT), the
padded batches carry them, rebuilt from the [SEP] tokens (data.Collator).
"""

import hashlib
import json
import math
import os
import stat
from pathlib import Path

import numpy as np

from fastpt.inputs import token_cache
from fastpt.inputs.columns import check_label_flags, check_texts, label_ids, read_labels, resolve_columns
from fastpt.inputs.tables import file_kind, read_file, read_source
from fastpt.files import shared_cache, trust
from fastpt.errors import DataError


# 2: the file types in the key, the digest, the paths the cache was built from;
# 3: TSV without quotes, labels by read_label, the reading's notes kept
CACHE_VERSION = 3
META = "fastpt_data.json"  # label names and where each split came from, inside the cache folder


# ---------------------------------------------------------------------------- splits

def stratified_split(labels: list, fractions: dict, seed: int) -> dict:
    """{split: row indices}: each label's rows shuffled with `seed`, the first round(n x fraction) to each split.

    Every split keeps the label proportions (to rounding); the rest is train. Each split's rows
    are then shuffled, so --train-size N takes a sample of every label, not the file's first rows.
    """
    rng = np.random.RandomState(seed)
    out = {name: [] for name in ("train", *fractions)}
    by_label: dict = {}
    for i, label in enumerate(labels):
        by_label.setdefault(label, []).append(i)
    for label in sorted(by_label, key=str):
        rows = rng.permutation(by_label[label])
        takes = [int(math.floor(len(rows) * fraction + 0.5)) for fraction in fractions.values()]
        for name, part in zip([*fractions, "train"], np.split(rows, np.cumsum(takes))):  # the rest is train
            out[name] += part.tolist()
    return {name: np.asarray(idx, dtype=np.int64)[rng.permutation(len(idx))] for name, idx in out.items()}


def gather_splits(cfg) -> tuple[dict, dict, list]:
    """{split: Table} for train/validation/test, where each came from (config.json's data_splits), and
    the reading's notes (one line each: rows spanning lines, labels stripped)."""
    splits = read_source(cfg.data, cfg.label_column)
    origin = {name: table.where for name, table in splits.items()}
    for name, path, flag in (("validation", cfg.val_data, "--val-data"), ("test", cfg.test_data, "--test-data")):
        if path is not None:
            if name in splits:
                raise DataError(f"--data {cfg.data} has a {name} split already; drop {flag}")
            splits[name] = read_file(Path(path))
            origin[name] = str(path)
    for name, table in splits.items():  # whole files first: errors name their lines
        resolve_columns(table, cfg, training=name == "train", files=tuple(splits.values()))
        check_texts(table, table.use["text"])
        if cfg.text_pair_column:
            check_texts(table, table.use["pair"])
        read_labels(table, table.use["label"])
    notes = [line for table in splits.values() for line in table.notes]
    fractions = {name: fraction for name, fraction in (("validation", cfg.val_fraction), ("test", cfg.test_fraction))
                 if name not in splits}
    if fractions:
        train = splits["train"]
        for name, rows in stratified_split(train.columns[train.use["label"]], fractions, cfg.split_seed).items():
            splits[name] = train.select(rows, f"{train.where} ({name} split)")
        origin |= {name: {"from": train.where, "fraction": fraction, "seed": cfg.split_seed, "stratified": True}
                   for name, fraction in fractions.items()}
        origin["train"] = {"from": train.where, "rest_after": list(fractions)}
    for name, flag in (("train", None), ("validation", "--val-fraction"), ("test", "--test-fraction")):
        if len(splits[name]) == 0:
            advice = f"; give more rows or a larger {flag}" if name in fractions else ""
            raise DataError(f"the {name} split is empty ({splits[name].where}){advice}")
    return splits, origin, notes


# ---------------------------------------------------------------------------- the cache

def _content_fingerprint(source: str) -> str:
    """The data's identity: every byte of the file(s), or a Hub dataset's name."""
    h = hashlib.sha256()
    path = Path(source)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path] if path.exists() else []
    if not files:
        h.update(f"hub:{source}".encode())
    for p in files:
        h.update(f"{p.relative_to(path) if path.is_dir() else ''}:{p.stat().st_size}:".encode())
        with open(p, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()


def cache_key(cfg, tokenizer) -> str:
    sources = (cfg.data, cfg.val_data, cfg.test_data)
    for source, flag in zip(sources, ("--data", "--val-data", "--test-data")):
        check_source_kind(source, flag)  # before the fingerprint reads it: a FIFO would block, /dev/zero never end
    parts = {
        "version": CACHE_VERSION,
        "data": [_content_fingerprint(s) if s else None for s in sources],
        # Checked before the lookup, and keyed: a .tsv copy of a .csv reads differently, a .txt one not at all.
        "kinds": [file_kind(Path(s)) if s and Path(s).is_file() else None for s in sources],
        "columns": [cfg.text_column, cfg.text_pair_column, cfg.label_column],
        "split": [cfg.val_fraction, cfg.test_fraction, cfg.split_seed],
        "tokenizer": token_cache._tokenizer_fingerprint(tokenizer),
        "max_length": built_length(cfg),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


def check_source_kind(source, flag: str) -> None:
    """DataError unless a local source is a regular file or a folder (after its symbolic links)."""
    try:
        mode = os.stat(source).st_mode if source else None
    except OSError:
        return  # not a local path (a Hub name), or missing: read_source says which
    if mode is not None and not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise DataError(f"{flag} {source} is {trust.kind(mode)}, not a file or folder: fastpt reads data only from "
                        f"regular files (a FIFO would wait for a writer, a device never end)")


def built_length(cfg) -> int:
    """Single texts: 512, cut on load. Pairs: --max-length (longest-first truncation cannot be redone later)."""
    return cfg.max_length if cfg.text_pair_column else token_cache.CACHE_MAX_LENGTH


def build_cache(cfg, tokenizer, target: Path) -> None:
    """Read, check, split and tokenise; publish the splits and fastpt_data.json under target atomically."""
    import datasets

    splits, origin, notes = gather_splits(cfg)
    ids, names = label_ids(splits)
    check_label_flags(cfg, names)  # --label-names, --class-weights: their counts, before the long part
    if not cfg.progress:  # --no-progress: no tokenising or saving bars either
        datasets.disable_progress_bars()
    roles = ("text", "pair") if cfg.text_pair_column else ("text",)
    columns = {}
    for name in token_cache.SPLITS:
        table = splits[name]
        columns[name] = {"label": ids[name].tolist(), **{role: table.columns[table.use[role]] for role in roles}}
    length = built_length(cfg)
    meta = {"label_names": names, "splits": origin, "notes": notes,
            "built_from": [cfg.data, cfg.val_data, cfg.test_data]}
    token_cache.save_tokenized(
        columns, lambda batch: tokenizer(batch["text"], batch.get("pair"), truncation=True, max_length=length),
        ["input_ids", "label"], target, {META: json.dumps(meta, indent=2)})


def reading_notes(cache_path: Path) -> list:
    """What reading the data changed or noticed, one line each, kept with its cache (said on every run)."""
    return trust.read_json(Path(cache_path) / META).get("notes", [])


def prepare_own_splits(cfg, tokenizer, builds: bool = True, gather=lambda obj: [obj], builder: int = 0):
    """(splits, cache path, label names, where the splits came from): token_cache.prepare_splits for --data."""
    def locate():
        path = token_cache.cache_root(cfg.cache_dir) / f"data-{cache_key(cfg, tokenizer)}"
        return path, lambda: build_cache(cfg, tokenizer, path)

    path = token_cache.built_once(locate, builds, gather, builder)
    keep_last = token_cache.ends_with_special_token(tokenizer) and not cfg.text_pair_column
    with shared_cache.reported(path):
        splits = token_cache.load_cache(path, cfg.max_length, keep_last)  # verified against its digest
        meta = trust.read_json(path / META)
    origin = as_given(meta["splits"], meta["built_from"], [cfg.data, cfg.val_data, cfg.test_data])
    return splits, path, meta["label_names"], origin


def as_given(origin, built_from: list, given: list):
    """data_splits naming this run's files: the cache may have been built from a byte-identical copy elsewhere."""
    if isinstance(origin, dict):
        return {key: as_given(value, built_from, given) for key, value in origin.items()}
    for old, new in zip(built_from, given):
        if old and isinstance(origin, str) and (origin == old or origin.startswith(old + " [")):
            return new + origin[len(old):]  # a file, or a save_to_disk folder's split ("<folder> [valid]")
    return origin
