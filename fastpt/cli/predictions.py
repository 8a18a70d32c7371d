"""The predictions file: one row per example, in the input's order; a run's predictions.csv and fastpt-predict's output.

Columns, left to right:
- where the example is: `row`, its place among the data rows of the file (or split) it came from,
  counted from 0 (pandas: `read_csv(file).iloc[row]`; a test split carved from --data counts in
  that file), or for IMDB `review`, its file in aclImdb/ (test/pos/1234_8.txt);
- `text`: its first 80 characters, white space collapsed to single spaces (a preview, not the text;
  not for IMDB, whose review files are named instead);
- `label`: the gold label's name, where the data has labels;
- `predicted`: the predicted label's name (the argmax of the logits);
- `prob_<name>`: each label's probability, the softmax of the logits (7 significant digits).

CSV for a `.csv` file, else JSON Lines (`.jsonl`, `.json`, `.ndjson`: one object a line). The
file is written whole or not at all (a temporary file renamed into place).
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path


PREVIEW_CHARS = 80
FORMATS = {".csv": "csv", ".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl"}


def output_format(path: Path) -> str:
    """'csv' or 'jsonl' by the file's extension; ValueError for any other."""
    kind = FORMATS.get(Path(path).suffix.lower())
    if kind is None:
        raise ValueError(f"{path}: unknown output type {Path(path).suffix or '(none)'}; use .csv or .jsonl")
    return kind


def preview(text) -> str:
    """The first PREVIEW_CHARS characters of a text, its line breaks and runs of spaces made single spaces."""
    return " ".join(str(text).split())[:PREVIEW_CHARS]


def write_predictions(path: Path, leading: dict, label_names: list, predicted, probabilities) -> None:
    """Write the file: the `leading` columns ({name: values}: where, text, label), then predicted and prob_*.

    `predicted` holds label ids, `probabilities` an [examples, labels] array; all in the same order."""
    from fastpt.files.checkpoint import write_atomic  # torch: not for the command line's checks

    names = [*leading, "predicted", *(f"prob_{name}" for name in label_names)]
    rows = ([*(values[i] for values in leading.values()), label_names[int(p)],
             *(float(f"{q:.7g}") for q in probabilities[i])] for i, p in enumerate(predicted))
    text = io.StringIO(newline="")
    if output_format(path) == "csv":
        csv.writer(text, lineterminator="\n").writerows([names, *rows])
    else:
        text.writelines(json.dumps(dict(zip(names, row)), ensure_ascii=False) + "\n" for row in rows)
    write_atomic(Path(path), lambda f: f.write(text.getvalue().encode()))
