"""Reading a table of texts and labels from a file, a saved `datasets` folder or the Hub (--data).

Sources (`--data`):
- a file: `.csv`, `.tsv`, `.jsonl` / `.json` (JSON Lines: one object a line) or `.parquet`; one
  file is the training set, and `--val-data` / `--test-data` name the other splits' files;
- a folder written by `datasets`' `save_to_disk` (a Dataset, or a DatasetDict with `train` and
  maybe `validation` / `test` splits);
- a Hugging Face Hub dataset name (online only; offline it fails at once, like models do).

Reading: a CSV field in quotes may hold commas, doubled quotes and line breaks (a row that spans
lines is said in one note: a quote left open merges the rows after it the same way); a TSV is
read as it is, without quotes (a text may begin with one, and cannot hold a tab or line break).
Texts of any length. Columns keep apart: an empty header name becomes "(unnamed column N)", a
repeated one is refused. Names in messages are quoted and escaped, so spaces and control
characters show.
"""

import csv
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from fastpt.errors import DataError
from fastpt.files import trust

FILE_KINDS = {".csv": "csv", ".tsv": "tsv", ".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl",
              ".parquet": "parquet"}
SPLIT_NAMES = {"train": "train", "validation": "validation", "valid": "validation", "val": "validation",
               "dev": "validation", "test": "test"}
UNNAMED = re.compile(r"\(unnamed column \d+\)")  # the key of a column whose header is empty
FIELD_LIMIT = 2**31 - 1  # csv's default (128 KiB) refuses a long text as malformed; a C long holds this everywhere


@dataclass
class Table:
    """One split's columns as Python lists, and how to name a row in an error message."""
    columns: dict
    where: str  # the file (or "dataset split") it came from
    lines: list | None = None  # each row's line in the file (CSV, JSON Lines), for messages
    label_names: list | None = None  # a ClassLabel column's names
    notes: list = field(default_factory=list)  # what reading changed or noticed, one line each
    rows: list | None = None  # a carved split's rows in the table it came from (None: 0, 1, 2, ...)
    use: dict = field(default_factory=dict)  # role ("text", "pair", "label") -> this file's column (resolve_columns)

    def __len__(self) -> int:
        return len(next(iter(self.columns.values()))) if self.columns else 0

    def row_numbers(self) -> list:
        """Each row's place (from 0) among the data rows of the file or split it was read from."""
        return list(self.rows) if self.rows is not None else list(range(len(self)))

    def place(self, i: int) -> str:
        return f"line {self.lines[i]}" if self.lines else f"row {i + 1}"

    def select(self, idx, where: str) -> "Table":
        """The rows `idx` (a carved split, named `where`), each keeping its place in this table."""
        numbers = self.row_numbers()
        return Table({k: [v[i] for i in idx] for k, v in self.columns.items()}, where,
                     [self.lines[i] for i in idx] if self.lines else None, self.label_names,
                     rows=[numbers[i] for i in idx], use=self.use)


def file_kind(path: Path) -> str:
    kind = FILE_KINDS.get(path.suffix.lower())
    if kind is None:
        raise DataError(f"{path}: unknown file type {path.suffix or '(none)'}; use .csv, .tsv, .jsonl or .parquet")
    return kind


def read_file(path: Path) -> Table:
    """A .csv / .tsv / .jsonl / .parquet file as a Table; DataError with the file and line if malformed."""
    kind = file_kind(path)
    if not path.is_file():  # a FIFO would block the read, /dev/zero never end it
        raise DataError(f"{path} is {trust.kind(path.stat().st_mode)}, not a regular file" if path.exists()
                        else f"{path}: no such file")
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
            rows, lines, spans = [], [], []  # spans: (first, last line) of each row on several lines
            start = reader.line_num + 1
            for row in reader:
                end, first = reader.line_num, start
                start = end + 1
                if not row:  # a blank line
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
    # Legitimate for a quoted text with line breaks; a quote left open merges rows silently.
    notes = [f"{path}: {len(rows)} rows read from {len(rows) + sum(end - first for first, end in spans)} lines: "
             f"{len(spans)} row{'s span' if len(spans) > 1 else ' spans'} several lines inside quotes, the first "
             f"lines {spans[0][0]}-{spans[0][1]}"] if spans else []
    return Table({key: [row[j] for row in rows] for j, key in enumerate(keys)}, str(path), lines, notes=notes)


def _read_jsonl(path: Path) -> Table:
    def without_repeats(pairs: list) -> dict:  # a dict would keep only the last of two equal keys
        keys = [k for k, _ in pairs]
        repeated = next((k for k in keys if keys.count(k) > 1), None)
        if repeated is not None:
            raise DataError(f"{path}: line {number}: the key {show_column(repeated)} appears more than once "
                            f"in one object")
        return dict(pairs)

    records, lines = [], []
    with open(path, encoding="utf-8-sig") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line, object_pairs_hook=without_repeats)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: line {number}: not valid JSON ({e.msg}); expected one object a line") \
                    from None
            if not isinstance(record, dict):
                raise DataError(f"{path}: line {number}: expected a JSON object, got {type(record).__name__}")
            records.append(record)
            lines.append(number)
    names = list(dict.fromkeys(k for r in records for k in r))
    return Table({name: [r.get(name) for r in records] for name in names}, str(path), lines)


def accepted_names(value: str, columns) -> list:
    """The names a column flag accepts: the value itself if a column has it, else its comma-separated names."""
    return [value] if value in columns else [name.strip() for name in value.split(",")]


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
