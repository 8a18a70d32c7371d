"""Which column of a table is the text, the pair and the label, and the labels read by one rule.

Columns per file: a flag may list several names, `--text-column sentence,content`, and each file
uses the one it has (SST-2 as distributed calls its text `sentence` in train and `content` in
dev/test). A file with two of them is refused (which one is meant is for the user to say); a
name that itself holds a comma still matches as a whole.

Labels, one rule in every format (`read_label`): a whole number is an integer whatever holds it
(7, 7.0, "7"); any other text is a string without its surrounding spaces (a note says how many
had them); empty, null, NaN and "NaN" are no label and refused with their lines; a fraction, a
boolean or a mix of numbers and strings is refused. Ids follow the sorted order of the training
set's distinct labels (numbers numerically, strings alphabetically); integer labels 0..K-1 keep
their value. A `datasets` ClassLabel column keeps its own ids and names (its -1, "no label", is
refused as an unlabelled split). Integer labels are named by their values unless --label-names
names them (`named_labels`: one name per label, in id order). The names are written to
config.json and best.pt (`label_names`), results.json and, with --export-dir, the model's id2label.
"""

import math
import re

import numpy as np

from fastpt.inputs.tables import Table, accepted_names, show_column
from fastpt.errors import DataError

_SURROGATE = re.compile("[\ud800-\udfff]")
_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")  # a label that reads as a number is one


ROLES = (("text", "--text-column", "text_column"), ("pair", "--text-pair-column", "text_pair_column"),
         ("label", "--label-column", "label_column"))


def resolve_columns(table: Table, cfg, training: bool, files: tuple = ()) -> None:
    """table.use: each role's column in this file, the one of its flag's names the file has (exactly one).

    `files`: every file of the run, this one included, in split order: a missing column's message
    suggests a name for each of them at once."""
    for role, flag, attr in ROLES:
        value = getattr(cfg, attr)
        if value is None:
            continue
        found = [name for name in accepted_names(value, table.columns) if name in table.columns]
        if len(found) > 1:
            raise DataError(f"{table.where} has both {' and '.join(map(show_column, found))}, which {flag} {value} "
                            f"offers for one column: list one of them only, or rename the other in this file")
        if not found:
            raise DataError(missing_column(table, cfg, value, flag, attr, training, files))
        table.use[role] = found[0]
    if len(table) == 0:
        raise DataError(f"{table.where} has no rows")


def missing_column(table: Table, cfg, value: str, flag: str, attr: str, training: bool, files: tuple = ()) -> str:
    """The message for a file without a flag's column, and how to name it: per file, the flag's name that
    file has, else its one column no other flag claims (a guess), else NAME. A name no file has (a typo)
    is left out. With files that differ, the per-file form: `--text-column sentence,content`."""
    names = accepted_names(value, ())
    there = ", ".join(map(show_column, table.columns)) or "none"
    wanted = (f"no column {show_column(names[0])}" if len(names) == 1
              else f"none of the columns {', '.join(map(show_column, names))}")
    per_file = list(dict.fromkeys(_column_for(t, cfg, value, attr) for t in (files or (table,))))
    if training and len(per_file) == 1:
        advice = f"say which with {flag} {per_file[0]}"
    elif training:
        advice = f"say which, one name per file (each uses the one it has): {flag} {','.join(per_file)}"
    else:
        advice = f"where files name it differently, list the names: {flag} {','.join(per_file)}"
    return f"{table.where} has {wanted} ({flag}); its columns: {there}; {advice}"


def _column_for(table: Table, cfg, value: str, attr: str) -> str:
    """The column a flag's `value` would use in this file: one of its names, else a guess (see missing_column)."""
    found = [name for name in accepted_names(value, table.columns) if name in table.columns]
    if found:
        return found[0]
    claimed = {n for _, _, other in ROLES if other != attr and getattr(cfg, other) is not None
               for n in accepted_names(getattr(cfg, other), table.columns)}
    free = [c for c in table.columns if c not in claimed]
    return free[0] if len(free) == 1 and re.fullmatch(r"[\w.-]+", free[0]) else "NAME"  # one a shell keeps


def _places(table: Table, rows: list) -> str:
    return ", ".join(table.place(i) for i in rows[:5]) + (", ..." if len(rows) > 5 else "")


def check_texts(table: Table, column: str) -> None:
    """Every text a non-empty string of characters; else how many are not, and the first few places."""
    bad = [i for i, v in enumerate(table.columns[column]) if not isinstance(v, str) or not v.strip()]
    if bad:
        raise DataError(f"{table.where}: {len(bad)} empty or non-string value{'' if len(bad) == 1 else 's'} "
                        f"in column {show_column(column)} ({_places(table, bad)})")
    # JSON may escape half of a UTF-16 pair ("\ud800"): valid JSON, but no character, which no tokenizer takes
    broken = [i for i, v in enumerate(table.columns[column]) if _SURROGATE.search(v)]
    if broken:
        raise DataError(f"{table.where}: {len(broken)} text{'' if len(broken) == 1 else 's'} in column "
                        f"{show_column(column)} hold{'s' if len(broken) == 1 else ''} a lone surrogate "
                        f"(an escape such as \\ud800 that is half of a character) ({_places(table, broken)}); "
                        f"fix the escapes or leave those rows out")


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
    raws, labels = table.columns[column], []
    for i, raw in enumerate(raws):
        try:
            labels.append(read_label(raw))
        except ValueError:
            raise DataError(f"{table.where}: {table.place(i)}: label {raw!r} in column {show_column(column)}; "
                            f"labels are classes: whole numbers or strings") from None
    missing = [i for i, label in enumerate(labels) if label is None]
    if missing:
        raise DataError(f"{table.where}: {len(missing)} row{'' if len(missing) == 1 else 's'} without a label in "
                        f"column {show_column(column)} ({_places(table, missing)}): empty, null or NaN; "
                        f"label them or leave them out")
    mixed = next((i for i, v in enumerate(labels) if type(v) is not type(labels[0])), None)
    if mixed is not None:
        raise DataError(f"{table.where}: {table.place(mixed)}: label {labels[mixed]!r} mixes with "
                        f"{labels[0]!r} ({table.place(0)}); labels must be all whole numbers or all strings")
    stripped = [i for i, (label, raw) in enumerate(zip(labels, raws)) if isinstance(label, str) and label != raw]
    if stripped:
        i = stripped[0]
        table.notes.append(f"{table.where}: {len(stripped)} label{'' if len(stripped) == 1 else 's'} in column "
                           f"{show_column(column)} had spaces around them, stripped ({raws[i]!r} "
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


def label_ids(splits: dict) -> tuple[dict, list]:
    """({split: int64 ids}, names): ids in the sorted order of the training labels (see the module doc)."""
    train = splits["train"]
    values = {name: t.columns[t.use["label"]] for name, t in splits.items()}  # ints or strings, or ClassLabel ids
    if train.label_names is not None:  # a ClassLabel: its own ids and names
        names = [str(n) for n in train.label_names]
        check_classes(len(set(values["train"])), train)
        for name, t in splits.items():
            unseen = sorted(set(values[name]) - set(values["train"]))
            if unseen:
                raise DataError(f"{t.where} has label{'s' if len(unseen) > 1 else ''} "
                                f"{', '.join(names[i] for i in unseen[:5])} that the training set lacks")
        return {name: np.asarray(ids, dtype=np.int64) for name, ids in values.items()}, names
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
        raise DataError(f"--label-names names integer labels; the labels in --data are names already "
                        f"({', '.join(from_data[:5])}{', ...' if len(from_data) > 5 else ''}): drop --label-names")
    if len(given) != len(from_data):
        raise DataError(f"--label-names gives {len(given)} name(s), the data has {len(from_data)} labels "
                        f"({', '.join(from_data[:10])}{', ...' if len(from_data) > 10 else ''}): give one each")
    return list(given)


# The most labels a run takes. Evaluation counts a K x K confusion matrix on the device for every batch and
# results.json keeps it (K^2 numbers), and TensorBoard shows three charts per label: at 1,000 labels that is
# 8 MB a batch and about 1M numbers in the file; 10,000 labels make it 800 MB a batch and 100M numbers, which
# exhaust the host's memory in the first validation. A column with that many distinct values is rarely a
# class (an id, a score, a free-text field), and a classifier with a few examples per label learns little.
MAX_LABELS = 1000


def check_classes(n: int, train: Table) -> None:
    if n < 2:
        raise DataError(f"{train.where} has one class only: a classifier needs at least two labels")
    if n > MAX_LABELS:
        raise DataError(f"{train.where} has {n:,} distinct labels; a run takes at most {MAX_LABELS:,} (evaluation "
                        f"counts a labels x labels confusion matrix): is --label-column the class?")


def check_label_flags(cfg, names: list) -> None:
    """--label-names and a --class-weights list against the labels the data has, as DataError: checked
    when the labels are known and before tokenising, so that a wrong count leaves no token cache behind."""
    named_labels(names, cfg.label_names)
    weights = cfg.class_weights
    if isinstance(weights, list) and len(weights) != len(names):
        raise DataError(f"--class-weights gives {len(weights)} weight(s), the data has {len(names)} classes "
                        f"({', '.join(names[:10])}{', ...' if len(names) > 10 else ''}): give one each")
