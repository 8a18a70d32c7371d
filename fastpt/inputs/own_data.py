"""Your own data: any text-classification table, read, checked, split, tokenised once and cached.

    python train.py --data reviews.csv --text-column text --label-column label

Sources (`--data`):
- a file: `.csv`, `.tsv`, `.jsonl` / `.json` (JSON Lines: one object a line) or `.parquet`; one
  file is the training set, and `--val-data` / `--test-data` name the other splits' files;
- a folder written by `datasets`' `save_to_disk` (a Dataset, or a DatasetDict with `train` and
  maybe `validation` / `test` splits);
- a Hugging Face Hub dataset name (online only; offline it fails at once, like models do).

A split the source does not have is carved from the training set: `--val-fraction` (0.1) and
`--test-fraction` (0.2) of each label's rows, drawn with `--split-seed` (stratified, so every
split keeps the label proportions). config.json records the fractions, the seed and where each
split came from (`data_splits`), so the same command gets the same split.

Reading: a CSV field in quotes may hold commas, doubled quotes and line breaks (a row that spans
lines is said in one note: a quote left open merges the rows after it the same way); a TSV is
read as it is, without quotes (a text may begin with one, and cannot hold a tab or line break).
Texts of any length. Columns keep apart: an empty header name becomes "(unnamed column N)", a
repeated one is refused. Names in messages are quoted and escaped, so spaces and control
characters show.

Labels, one rule in every format (`read_label`): a whole number is an integer whatever holds it
(7, 7.0, "7"); any other text is a string without its surrounding spaces (a note says how many
had them); empty, null, NaN and "NaN" are no label and refused with their lines; a fraction, a
boolean or a mix of numbers and strings is refused. Ids follow the sorted order of the training
set's distinct labels (numbers numerically, strings alphabetically); integer labels 0..K-1 keep
their value. A `datasets` ClassLabel column keeps its own ids and names (its -1, "no label", is
refused as an unlabelled split). Integer labels are named by their values unless --label-names
names them (`named_labels`: one name per label, in id order). The names are written to
config.json and best.pt (`label_names`), results.json and, with --export-dir, the model's id2label.

Columns per file: a flag may list several names, `--text-column sentence,content`, and each file
uses the one it has (SST-2 as distributed calls its text `sentence` in train and `content` in
dev/test). A file with two of them is refused (which one is meant is for the user to say); a
name that itself holds a comma still matches as a whole.

Bad input stops before anything is written, with one line: a missing or repeated column (the
line lists those there are), an empty file or split, one class only, a validation or test label
the training set lacks, empty or non-string texts, missing labels (how many and where), a
malformed CSV row (file and the line it starts on).

The tokenised splits are Arrow files (`datasets.save_to_disk`) under a key made of the files'
content, the columns, the split settings and the tokenizer, built at 512 tokens and cut to a
shorter --max-length on load, exactly like IMDB's (token_cache.py); sentence pairs are
tokenised at --max-length itself (truncation shortens the longer text first, which cutting
later could not reproduce). They load as the same `TokenizedSplit`s, so every technique works
unchanged. For sentence pairs on models whose tokenizer makes token_type_ids (BERT), the
padded batches carry them, rebuilt from the [SEP] tokens (data.Collator).
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from fastpt.inputs import token_cache
from fastpt.machinery import shared_cache
from fastpt.machinery.errors import DataError, DiskFull


# 2: the file types in the key, the digest, the paths the cache was built from;
# 3: TSV without quotes, labels by read_label, the reading's notes kept
CACHE_VERSION = 3
FILE_KINDS = {".csv": "csv", ".tsv": "tsv", ".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl",
              ".parquet": "parquet"}
SPLIT_NAMES = {"train": "train", "validation": "validation", "valid": "validation", "val": "validation",
               "dev": "validation", "test": "test"}
META = "fastpt_data.json"  # label names and where each split came from, inside the cache folder
UNNAMED = re.compile(r"\(unnamed column \d+\)")  # the key of a column whose header is empty
_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")  # a label that reads as a number is one
FIELD_LIMIT = 2**31 - 1  # csv's default (128 KiB) refuses a long text as malformed; a C long holds this everywhere


@dataclass
class Table:
    """One split's columns as Python lists, and how to name a row in an error message."""
    columns: dict
    where: str  # the file (or "dataset split") it came from
    lines: Optional[list] = None  # each row's line in the file (CSV, JSON Lines), for messages
    label_names: Optional[list] = None  # a ClassLabel column's names
    notes: list = field(default_factory=list)  # what reading changed or noticed, one line each
    rows: Optional[list] = None  # a carved split's rows in the table it came from (None: 0, 1, 2, ...)
    use: dict = field(default_factory=dict)  # role ("text", "pair", "label") -> this file's column (resolve_columns)

    def __len__(self) -> int:
        return len(next(iter(self.columns.values()))) if self.columns else 0

    def row_numbers(self) -> list:
        """Each row's place (from 0) among the data rows of the file or split it was read from."""
        return list(self.rows) if self.rows is not None else list(range(len(self)))

    def place(self, i: int) -> str:
        return f"line {self.lines[i]}" if self.lines else f"row {i + 1}"

    def select(self, idx) -> "Table":
        idx = list(idx)
        numbers = self.row_numbers()
        return Table({k: [v[i] for i in idx] for k, v in self.columns.items()}, self.where,
                     [self.lines[i] for i in idx] if self.lines else None, self.label_names,
                     rows=[numbers[i] for i in idx], use=self.use)


# ---------------------------------------------------------------------------- reading

def file_kind(path: Path) -> str:
    kind = FILE_KINDS.get(path.suffix.lower())
    if kind is None:
        raise DataError(f"{path}: unknown file type {path.suffix or '(none)'}; use .csv, .tsv, .jsonl or .parquet")
    return kind


def read_file(path: Path) -> Table:
    """A .csv / .tsv / .jsonl / .parquet file as a Table; DataError with the file and line if malformed."""
    kind = file_kind(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    try:
        if kind in ("csv", "tsv"):
            return _read_csv(path, kind)
        if kind == "jsonl":
            return _read_jsonl(path)
        import pyarrow.parquet as pq
        table = pq.read_table(path)
        keys = column_keys(table.column_names, str(path))
        return Table({key: table.column(j).to_pylist() for j, key in enumerate(keys)}, str(path))
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except DataError:
        raise
    except Exception as e:  # pyarrow's errors for a broken Parquet file, OSError
        raise DataError(f"cannot read {path}: {e.__class__.__name__}: {str(e).splitlines()[0] if str(e) else ''}") \
            from None


def column_keys(names: list, where: str) -> list:
    """Each column's key in a Table: an empty name becomes "(unnamed column N)"; a repeated name is refused.

    Two columns never share a key (a dict would keep only the last); which of two "text" columns
    holds the text is for the user to say, so they are refused by name.
    """
    keys = [name if name else f"(unnamed column {j})" for j, name in enumerate(names, 1)]
    repeated = {name: [j for j, n in enumerate(names, 1) if n == name] for name in names if name}
    repeated = {name: places for name, places in repeated.items() if len(places) > 1}
    if repeated:
        named = "; ".join(f"{show_column(n)} (columns {', '.join(map(str, places))})" for n, places in repeated.items())
        raise DataError(f"{where}: more than one column is named {named}: give each column its own name")
    return keys


def show_column(name: str) -> str:
    """A column's name in a message: quoted, so spaces show, and control characters escaped (repr)."""
    return name if UNNAMED.fullmatch(name) else repr(name)


def _read_csv(path: Path, kind: str) -> Table:
    """The csv module, not pandas: it names the exact line of a malformed row and never guesses types.

    A TSV is read as it is, without quotes (tab-separated values have none): a text may start with
    a quote and keep it. A CSV field in quotes may span lines; each row is named by the line it
    starts on, and a row that spans lines is said in one note (a quote left open merges rows).
    """
    csv.field_size_limit(FIELD_LIMIT)
    quoting = csv.QUOTE_NONE if kind == "tsv" else csv.QUOTE_MINIMAL
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f, delimiter="\t" if kind == "tsv" else ",", quoting=quoting)
        start = 1
        try:
            header = next(reader, None)
            if not header:
                raise DataError(f"{path} is empty: expected a header line naming the columns")
            keys = column_keys(header, str(path))
            rows, lines, spans, blank = [], [], [], 0
            start = reader.line_num + 1
            for row in reader:
                end, first = reader.line_num, start
                start = end + 1
                if not row:
                    blank += 1
                    continue
                if end > first:
                    spans.append((first, end))
                if len(row) != len(header):
                    opened = (f"; a quote opened on line {first} runs to line {end}: is it closed?"
                              if end > first else " (a text with the delimiter needs quotes)")
                    raise DataError(f"{path}: line {first}: malformed row: {len(row)} field"
                                    f"{'' if len(row) == 1 else 's'}, the header has {len(header)}{opened}")
                rows.append(row)
                lines.append(first)
        except csv.Error as e:
            raise DataError(f"{path}: line {start}: malformed {kind.upper()}: {e}") from None
    notes = []
    if spans:  # legitimate for a quoted text with line breaks; a quote left open merges rows silently
        physical = reader.line_num - 1 - blank
        notes.append(f"{path}: {len(rows)} rows read from {physical} lines: {len(spans)} row"
                     f"{'s span' if len(spans) > 1 else ' spans'} several lines inside quotes, the first lines "
                     f"{spans[0][0]}-{spans[0][1]}")
    return Table({key: [row[j] for row in rows] for j, key in enumerate(keys)}, str(path), lines, notes=notes)


class _RepeatedKey(ValueError):
    pass


def _object_without_repeats(pairs: list) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) < len(keys):
        raise _RepeatedKey(next(k for k in keys if keys.count(k) > 1))
    return dict(pairs)


def _read_jsonl(path: Path) -> Table:
    records, lines = [], []
    with open(path, encoding="utf-8-sig") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line, object_pairs_hook=_object_without_repeats)
            except _RepeatedKey as e:
                raise DataError(f"{path}: line {number}: the key {show_column(e.args[0])} appears more than once "
                                f"in one object") from None
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: line {number}: not valid JSON ({e.msg}); expected one object a line") \
                    from None
            if not isinstance(record, dict):
                raise DataError(f"{path}: line {number}: expected a JSON object, got {type(record).__name__}")
            records.append(record)
            lines.append(number)
    names = list(dict.fromkeys(k for r in records for k in r))
    return Table({name: [r.get(name) for r in records] for name in names}, str(path), lines)


def _from_datasets(ds, where: str, label_column: str) -> Table:
    from datasets import ClassLabel

    names = [name for name in accepted_names(label_column, ds.features) if name in ds.features]
    feature = ds.features.get(names[0]) if names else None
    names = list(feature.names) if isinstance(feature, ClassLabel) else None
    return Table(ds.to_dict(), where, None, names)


def read_source(data: str, label_column: str) -> dict:
    """{split name: Table} from --data: a file (its training set), a save_to_disk folder or a Hub dataset."""
    path = Path(data)
    if path.is_file():
        return {"train": read_file(path)}
    import datasets

    if path.is_dir():
        try:
            loaded = datasets.load_from_disk(str(path))
        except (FileNotFoundError, ValueError) as e:
            raise DataError(f"--data {data}: not a folder written by datasets' save_to_disk ({e})") from None
    else:
        from fastpt.inputs.models import hub_offline
        if path.suffix.lower() in FILE_KINDS or data.startswith((".", "/", "~")) or data.count("/") > 1:
            raise DataError(f"--data {data}: no such file or folder")
        if hub_offline():
            raise DataError(f"--data {data}: no such file or folder, and offline (no connection to the "
                            f"Hugging Face Hub) to fetch it as a Hub dataset")
        try:
            loaded = datasets.load_dataset(data)
        except Exception as e:  # the Hub's errors vary by cause
            raise DataError(f"--data {data}: cannot load it from the Hugging Face Hub: {e}") from None
    if isinstance(loaded, datasets.Dataset):
        return {"train": _from_datasets(loaded, data, label_column)}
    splits = {}
    for name, ds in loaded.items():
        if SPLIT_NAMES.get(name) and SPLIT_NAMES[name] not in splits:
            splits[SPLIT_NAMES[name]] = _from_datasets(ds, f"{data} [{name}]", label_column)
    if "train" not in splits:
        raise DataError(f"--data {data} has no train split; its splits: {', '.join(loaded)}")
    return splits


# ---------------------------------------------------------------------------- checks

ROLES = (("text", "--text-column", "text_column"), ("pair", "--text-pair-column", "text_pair_column"),
         ("label", "--label-column", "label_column"))


def accepted_names(value: str, columns) -> list:
    """The names a column flag accepts: the value itself if a column has it, else its comma-separated names."""
    return [value] if value in columns else [name.strip() for name in value.split(",")]


def resolve_columns(table: Table, cfg, training: bool) -> None:
    """table.use: each role's column in this file, the one of its flag's names the file has (exactly one)."""
    for role, flag, attr in ROLES:
        value = getattr(cfg, attr)
        if value is None:
            continue
        found = [name for name in accepted_names(value, table.columns) if name in table.columns]
        if len(found) > 1:
            raise DataError(f"{table.where} has both {' and '.join(map(show_column, found))}, which {flag} {value} "
                            f"offers for one column: list one of them only, or rename the other in this file")
        if not found:
            raise DataError(missing_column(table, cfg, value, flag, attr, training))
        table.use[role] = found[0]
    if len(table) == 0:
        raise DataError(f"{table.where} has no rows")


def missing_column(table: Table, cfg, value: str, flag: str, attr: str, training: bool) -> str:
    """The message for a file without a flag's column, and how to name it (a guess where one column is free).

    The training file's own name replaces the flag's; another file's is added to the list.
    """
    names = accepted_names(value, ())
    there = ", ".join(map(show_column, table.columns)) or "none"
    wanted = (f"no column {show_column(names[0])}" if len(names) == 1
              else f"none of the columns {', '.join(map(show_column, names))}")
    claimed = {n for _, _, other in ROLES if other != attr and getattr(cfg, other) is not None
               for n in accepted_names(getattr(cfg, other), table.columns)}
    free = [c for c in table.columns if c not in claimed]
    guess = free[0] if len(free) == 1 and re.fullmatch(r"[\w.-]+", free[0]) else "NAME"  # one a shell keeps
    advice = (f"say which with {flag} {guess}" if training
              else f"where files name it differently, list the names: {flag} {value},{guess}")
    return f"{table.where} has {wanted} ({flag}); its columns: {there}; {advice}"


def _places(table: Table, rows: list) -> str:
    return ", ".join(table.place(i) for i in rows[:5]) + (", ..." if len(rows) > 5 else "")


def check_texts(table: Table, column: str) -> None:
    """Every text a non-empty string; else how many are not, and the first few places."""
    bad = [i for i, v in enumerate(table.columns[column]) if not isinstance(v, str) or not v.strip()]
    if bad:
        raise DataError(f"{table.where}: {len(bad)} empty or non-string value{'' if len(bad) == 1 else 's'} "
                        f"in column {show_column(column)} ({_places(table, bad)})")


def read_label(value):
    """One label by the rule every format shares; None for no label (empty, null, NaN or the text "NaN").

    A whole number is an int whatever holds it (7, 7.0, "7", " 7 "); any other text is a string
    without its surrounding spaces. ValueError for what is no class: a fraction, true/false, a list.
    """
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip()
        if not text or text.lower() == "nan":
            return None
        if not _NUMBER.fullmatch(text):
            return text
        value = int(text) if text.lstrip("+-").isdigit() else float(text)
    if isinstance(value, float):
        if math.isnan(value):
            return None
        if not value.is_integer():
            raise ValueError(value)
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(value)
    return value


def read_labels(table: Table, column: str) -> None:
    """The label column by `read_label`, in place; DataError naming the rows; a note when spaces were stripped."""
    if table.label_names is not None:
        return check_class_ids(table, column)
    labels, missing, stripped = [], [], []
    for i, raw in enumerate(table.columns[column]):
        try:
            label = read_label(raw)
        except ValueError:
            raise DataError(f"{table.where}: {table.place(i)}: label {raw!r} in column {show_column(column)}; "
                            f"labels are classes: whole numbers or strings") from None
        if label is None:
            missing.append(i)
        elif isinstance(label, str) and label != raw:
            stripped.append(i)
        labels.append(label)
    if missing:
        raise DataError(f"{table.where}: {len(missing)} row{'' if len(missing) == 1 else 's'} without a label in "
                        f"column {show_column(column)} ({_places(table, missing)}): empty, null or NaN; "
                        f"label them or leave them out")
    mixed = next((i for i, v in enumerate(labels) if type(v) is not type(labels[0])), None)
    if mixed is not None:
        raise DataError(f"{table.where}: {table.place(mixed)}: label {labels[mixed]!r} mixes with "
                        f"{labels[0]!r} ({table.place(0)}); labels must be all whole numbers or all strings")
    if stripped:
        i = stripped[0]
        table.notes.append(f"{table.where}: {len(stripped)} label{'' if len(stripped) == 1 else 's'} in column "
                           f"{show_column(column)} had spaces around them, stripped ({table.columns[column][i]!r} "
                           f"is {labels[i]!r}, {table.place(i)})")
    table.columns[column] = labels


def check_class_ids(table: Table, column: str) -> None:
    """A ClassLabel column: every id one of its names; -1 is `datasets`' "no label" (GLUE's test splits)."""
    ids, names = table.columns[column], table.label_names
    unlabelled = [i for i, v in enumerate(ids) if v == -1]
    if unlabelled:
        raise DataError(f"{table.where} is unlabelled: {len(unlabelled)} of {len(ids)} labels are -1 (no label, "
                        f"as in GLUE's test splits); save the folder without that split (the split is then carved "
                        f"from the training set) or use a labelled one")
    bad = next((i for i, v in enumerate(ids) if not isinstance(v, int) or not 0 <= v < len(names)), None)
    if bad is not None:
        raise DataError(f"{table.where}: {table.place(bad)}: label {ids[bad]!r} is not one of the "
                        f"{len(names)} ids of its ClassLabel")


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
        rows = np.asarray(by_label[label])[rng.permutation(len(by_label[label]))]
        start = 0
        for name, fraction in fractions.items():
            take = int(math.floor(len(rows) * fraction + 0.5))
            out[name] += rows[start:start + take].tolist()
            start += take
        out["train"] += rows[start:].tolist()
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
        resolve_columns(table, cfg, training=name == "train")
        check_texts(table, table.use["text"])
        if cfg.text_pair_column:
            check_texts(table, table.use["pair"])
        read_labels(table, table.use["label"])
    notes = [line for table in splits.values() for line in table.notes]
    fractions = {}
    for name, fraction in (("validation", cfg.val_fraction), ("test", cfg.test_fraction)):
        if name not in splits:
            fractions[name] = fraction
    if fractions:
        train = splits["train"]
        idx = stratified_split(train.columns[train.use["label"]], fractions, cfg.split_seed)
        for name, rows in idx.items():
            splits[name] = train.select(rows)
            if name != "train":
                splits[name].where = f"{train.where} ({name} split)"
        splits["train"].where = f"{train.where} (train split)" if fractions else train.where
        for name, fraction in fractions.items():
            origin[name] = {"from": train.where, "fraction": fraction, "seed": cfg.split_seed, "stratified": True}
        origin["train"] = {"from": train.where, "rest_after": list(fractions)}
    for name, flag in (("train", None), ("validation", "--val-fraction"), ("test", "--test-fraction")):
        if len(splits[name]) == 0:
            advice = f"; give more rows or a larger {flag}" if name in fractions else ""
            raise DataError(f"the {name} split is empty ({splits[name].where}){advice}")
    return splits, origin, notes


def label_ids(splits: dict) -> tuple[dict, list]:
    """({split: int64 ids}, names): ids in the sorted order of the training labels (see the module doc)."""
    train = splits["train"]
    if train.label_names is not None:  # a ClassLabel: its own ids and names
        names = [str(n) for n in train.label_names]
        ids = {name: np.asarray(t.columns[t.use["label"]], dtype=np.int64) for name, t in splits.items()}
        seen = set(ids["train"].tolist())
        check_classes(len(seen), train)
        for name, t in splits.items():
            unseen = sorted(set(ids[name].tolist()) - seen)
            if unseen:
                raise DataError(f"{t.where} has label{'s' if len(unseen) > 1 else ''} "
                                f"{', '.join(names[i] for i in unseen[:5])} that the training set lacks")
        return ids, names
    values = {name: t.columns[t.use["label"]] for name, t in splits.items()}  # read_labels' ints or strings
    classes = sorted(set(values["train"]))
    check_classes(len(classes), train)
    index = {c: i for i, c in enumerate(classes)}
    for name, t in splits.items():
        kinds = {type(v) for v in values[name]} | {type(classes[0])}
        if len(kinds) > 1:
            raise DataError(f"{t.where} has {'integer' if int in kinds and type(classes[0]) is str else 'string'} "
                            f"labels, the training set {type(classes[0]).__name__} ones")
        unseen = sorted(set(values[name]) - set(classes))
        if unseen:
            raise DataError(f"{t.where} has label{'s' if len(unseen) > 1 else ''} "
                            f"{', '.join(map(repr, unseen[:5]))}{', ...' if len(unseen) > 5 else ''} "
                            f"that the training set lacks (it has {', '.join(map(repr, classes[:10]))})")
    ids = {name: np.asarray([index[v] for v in values[name]], dtype=np.int64) for name in splits}
    return ids, [str(c) for c in classes]


def named_labels(from_data: list, given: list | None) -> list:
    """--label-names for integer labels (whose names are their values), one per label in id order; else the data's."""
    if given is None:
        return from_data
    if not all(re.fullmatch(r"[-+]?\d+", name) for name in from_data):
        raise ValueError(f"--label-names names integer labels; the labels in --data are names already "
                         f"({', '.join(from_data[:5])}{', ...' if len(from_data) > 5 else ''}): drop --label-names")
    if len(given) != len(from_data):
        raise ValueError(f"--label-names gives {len(given)} name(s), the data has {len(from_data)} labels "
                         f"({', '.join(from_data[:10])}{', ...' if len(from_data) > 10 else ''}): give one each")
    return list(given)


def check_classes(n: int, train: Table) -> None:
    if n < 2:
        raise DataError(f"{train.where} has one class only: a classifier needs at least two labels")


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
    parts = {
        "version": CACHE_VERSION,
        "data": [_content_fingerprint(s) if s else None for s in (cfg.data, cfg.val_data, cfg.test_data)],
        # Checked before the lookup, and keyed: a .tsv copy of a .csv reads differently, a .txt one not at all.
        "kinds": [file_kind(Path(s)) if s and Path(s).is_file() else None
                  for s in (cfg.data, cfg.val_data, cfg.test_data)],
        "columns": [cfg.text_column, cfg.text_pair_column, cfg.label_column],
        "split": [cfg.val_fraction, cfg.test_fraction, cfg.split_seed],
        "tokenizer": token_cache._tokenizer_fingerprint(tokenizer),
        "max_length": built_length(cfg),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


def built_length(cfg) -> int:
    """Single texts: 512, cut on load. Pairs: --max-length (longest-first truncation cannot be redone later)."""
    return cfg.max_length if cfg.text_pair_column else token_cache.CACHE_MAX_LENGTH


def build_cache(cfg, tokenizer, target: Path) -> None:
    """Read, check, split and tokenise; publish the splits and fastpt_data.json under target atomically."""
    import datasets

    splits, origin, notes = gather_splits(cfg)
    ids, names = label_ids(splits)
    length = built_length(cfg)
    if not cfg.progress:  # --no-progress: no tokenising or saving bars either
        datasets.disable_progress_bars()
    tmp = shared_cache.new_temporary(target)
    try:
        tokenized = {}
        for name in ("train", "validation", "test"):
            table = splits[name]
            columns = {"text": table.columns[table.use["text"]], "label": ids[name].tolist()}
            if cfg.text_pair_column:
                columns["pair"] = table.columns[table.use["pair"]]

            def tokenize(batch):
                return tokenizer(batch["text"], batch.get("pair"), truncation=True, max_length=length)

            tokenized[name] = datasets.Dataset.from_dict(columns).map(
                tokenize, batched=True, batch_size=1000, desc=f"tokenising {name}",
                load_from_cache_file=False, keep_in_memory=True).select_columns(["input_ids", "label"])
        datasets.DatasetDict(tokenized).save_to_disk(str(tmp))
        meta = {"label_names": names, "splits": origin, "notes": notes,
                "built_from": [cfg.data, cfg.val_data, cfg.test_data]}
        (tmp / META).write_text(json.dumps(meta, indent=2))
        shared_cache.publish(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def reading_notes(cache_path: Path) -> list:
    """What reading the data changed or noticed, one line each, kept with its cache (said on every run)."""
    return json.loads((Path(cache_path) / META).read_text()).get("notes", [])


def prepare_own_splits(cfg, tokenizer, builds: bool = True, gather=lambda obj: [obj], builder: int = 0):
    """(splits, cache path, label names, where the splits came from): token_cache.prepare_splits for --data."""
    outcome = None
    if builds:
        try:
            root = token_cache.cache_root(cfg.cache_dir)
            path = root / f"data-{cache_key(cfg, tokenizer)}"
            with shared_cache.reported(path):
                if not shared_cache.is_complete(path):
                    shared_cache.build_once(path, lambda: build_cache(cfg, tokenizer, path))
            outcome = ("ok", str(path))
        except (DataError, DiskFull) as e:
            outcome = shared_cache.failure(e)
    path = shared_cache.agree(gather(outcome), builder)
    keep_last = token_cache.ends_with_special_token(tokenizer) and not cfg.text_pair_column
    with shared_cache.reported(path):
        splits = token_cache.load_cache(path, cfg.max_length, keep_last)  # verified against its digest
        meta = json.loads((path / META).read_text())
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
