"""Reading your own table (--data): every row, every column by its own name, one label rule for every format."""

from __future__ import annotations

import json
import math

import pytest

from fastpt.cli.args import build_parser
from fastpt.inputs import own_data, tables
from fastpt.config import TrainConfig
from test_own_data import rows, write_csv
from train import main


def _gather(path, **kw):
    """own_data's reading and checks (no tokenizer): (splits, notes)."""
    splits, _, notes = own_data.gather_splits(TrainConfig(model="tiny", data=str(path), **kw))
    return splits, notes


def _lines(data, open_quote_at=None):
    """CSV/TSV body lines "text<sep>label" whose text at index open_quote_at starts with a quote it never closes."""
    return [('"' if i == open_quote_at else "") + t for i, (t, _) in enumerate(data)]


def refused(own_args, tmp_path, capsys, data, *extra) -> str:
    """The one error line of a run that must stop with status 2 and write nothing."""
    out = tmp_path / "refused"
    capsys.readouterr()
    status = main(own_args(data, *extra, out=out))
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and err[0].startswith("error: "), (status, err)
    assert not out.exists()
    return err[0]


# ---------------------------------------------------------------------------- quotes and lines

def test_tsv_keeps_every_row_and_its_quotes(tmp_path):
    """An unclosed leading quote merged the rows after it into one text; '"6" cable' lost its quotes."""
    data = rows(60)
    texts = _lines(data, open_quote_at=5)
    texts[8] = '"6" cable ' + texts[8]
    path = tmp_path / "a.tsv"
    path.write_text("text\tlabel\n" + "".join(f"{t}\t{y}\n" for t, (_, y) in zip(texts, data)))
    table = tables.read_file(path)
    assert table.columns["text"] == texts and table.lines == list(range(2, 62))
    assert table.notes == []


def test_csv_rows_spanning_lines_are_counted_in_a_note(tmp_path):
    data = rows(60)
    texts = _lines(data, open_quote_at=5)
    texts[15] = 'they said "hi" ' + texts[15]  # the quote opened at row 5 closes here: rows 5..15 are one
    path = tmp_path / "a.csv"
    path.write_text("text,label\n" + "".join(f"{t},{y}\n" for t, (_, y) in zip(texts, data)))
    _, notes = _gather(path)
    assert notes == [f"{path}: 50 rows read from 60 lines: 1 row spans several lines inside quotes, "
                     f"the first lines 7-17"]


def test_csv_unclosed_quote_is_named_where_it_opens(own_args, tmp_path, capsys):
    data = rows(60)
    path = tmp_path / "a.csv"
    path.write_text("text,label\n" + "".join(f"{t},{y}\n" for t, (_, y) in zip(_lines(data, 5), data)))
    line = refused(own_args, tmp_path, capsys, path)
    assert f"{path}: line 7: malformed row: 1 field, the header has 2; a quote opened on line 7 runs to " \
           f"line 61" in line


def test_a_csv_text_longer_than_csv_s_default_limit_reads(tmp_path):
    long = "word " * 40_000  # 200 KB: csv's default field limit is 128 KiB
    path = write_csv(tmp_path / "a.csv", [(long, "good")] + rows(20))
    assert tables.read_file(path).columns["text"][0] == long


# ---------------------------------------------------------------------------- column names

@pytest.mark.parametrize("header, expected", [
    (("text", "label", "text"), "more than one column is named 'text' (columns 1, 3)"),
    (("text", "text", "label"), "more than one column is named 'text' (columns 1, 2)"),
])
def test_a_repeated_column_name_is_refused(header, expected, own_args, tmp_path, capsys):
    row = {"text": lambda t, y: t, "label": lambda t, y: y}
    path = write_csv(tmp_path / "a.csv", [[row[h](t, y) for h in header] for t, y in rows(30)], header=header)
    assert expected in refused(own_args, tmp_path, capsys, path)


def test_a_repeated_json_key_is_refused(own_args, tmp_path, capsys):
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "fine", "label": 1}\n{"text": "a", "label": 0, "text": "b"}\n')
    assert f"{path}: line 2: the key 'text' appears more than once" in refused(own_args, tmp_path, capsys, path)


def test_unnamed_columns_stay_apart_and_are_named_by_position(own_args, tmp_path, capsys):
    data = rows(30)
    path = write_csv(tmp_path / "a.csv", [(y, t, f"x{i}", "", f"z{i}") for i, (t, y) in enumerate(data)],
                     header=("label", "masseges", "", "", ""))
    line = refused(own_args, tmp_path, capsys, path)
    assert line.endswith("its columns: 'label', 'masseges', (unnamed column 3), (unnamed column 4), "
                         "(unnamed column 5); say which with --text-column NAME"), line
    table = tables.read_file(path)
    assert table.columns["(unnamed column 3)"] == [f"x{i}" for i in range(30)]
    assert table.columns["(unnamed column 5)"] == [f"z{i}" for i in range(30)]


def test_column_names_are_quoted_and_escaped(own_args, tmp_path, capsys):
    path = write_csv(tmp_path / "a.csv", [(t, t, y) for t, y in rows(30)],
                     header=("\x1b[31mtext\x1b[0m", " text ", "label"))
    line = refused(own_args, tmp_path, capsys, path)
    assert "\x1b" not in line, line
    assert line.endswith(r"its columns: '\x1b[31mtext\x1b[0m', ' text ', 'label'; say which with --text-column NAME")


# ---------------------------------------------------------------------------- labels: one rule, every format

def write_as(tmp_path, kind: str, labels: list, name="a"):
    """The same rows, their labels given as they are, in a CSV, a JSON Lines or a Parquet file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [t for t, _ in rows(len(labels))]
    path = tmp_path / f"{name}.{kind}"
    if kind == "csv":
        text = lambda y: "" if y is None or (isinstance(y, float) and math.isnan(y)) else str(y)  # noqa: E731
        write_csv(path, [(t, text(y)) for t, y in zip(texts, labels)])
    elif kind == "jsonl":
        path.write_text("".join(json.dumps({"text": t, "label": y}) + "\n" for t, y in zip(texts, labels)))
    else:
        pq.write_table(pa.table({"text": texts, "label": labels}), path)
    return path


FORMATS = ("csv", "jsonl", "parquet")


@pytest.mark.parametrize("kind", FORMATS)
def test_spaces_around_string_labels_are_stripped_with_a_note(kind, tmp_path):
    labels = ["neg", "neg ", " pos", "pos"] * 8
    splits, notes = _gather(write_as(tmp_path, kind, labels))
    assert sorted(set(label for t in splits.values() for label in t.columns["label"])) == ["neg", "pos"]
    place = "row 2" if kind == "parquet" else "line 3" if kind == "csv" else "line 2"
    assert notes == [f"{tmp_path / f'a.{kind}'}: 16 labels in column 'label' had spaces around them, stripped "
                     f"('neg ' is 'neg', {place})"]


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("missing", [None, float("nan"), "NaN", " "])
def test_a_missing_label_is_refused_in_every_format(kind, missing, tmp_path):
    labels = [0, 1] * 10 if isinstance(missing, float) else ["neg", "pos"] * 10  # Parquet: one type a column
    labels[7] = missing
    with pytest.raises(own_data.DataError, match=r"1 row without a label in column 'label' \((line|row) \d+\): "
                                                 r"empty, null or NaN"):
        _gather(write_as(tmp_path, kind, labels))


@pytest.mark.parametrize("kind", ("csv", "jsonl"))
def test_numbers_and_strings_mix_in_no_format(kind, tmp_path):
    labels = [0, 1] * 10
    labels[7] = "one"
    with pytest.raises(own_data.DataError, match="label 'one' mixes with 0"):
        _gather(write_as(tmp_path, kind, labels))


@pytest.mark.parametrize("kind", FORMATS)
def test_whole_numbers_are_integers_and_fractions_are_refused_in_every_format(kind, tmp_path):
    splits, _ = _gather(write_as(tmp_path, kind, [0.0, 1.0, 2.0] * 10))
    assert sorted(set(splits["train"].columns["label"])) == [0, 1, 2]
    assert all(type(y) is int for y in splits["train"].columns["label"])
    with pytest.raises(own_data.DataError, match="label '?0.5'? in column 'label'; labels are classes"):
        _gather(write_as(tmp_path, kind, [0.5, 1.5] * 10, name="b"))


def test_a_string_that_reads_as_a_number_is_that_number(tmp_path):
    """JSON's "1" and 1 are one label, as a CSV's 1 always was."""
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps({"text": t, "label": [0, "1"][i % 2]}) + "\n"
                            for i, (t, _) in enumerate(rows(20))))
    splits, _ = _gather(path)
    assert sorted(set(splits["train"].columns["label"])) == [0, 1]


def test_an_unlabelled_classlabel_split_is_said_so(own_args, tmp_path, capsys):
    import datasets

    features = datasets.Features({"text": datasets.Value("string"),
                                  "label": datasets.ClassLabel(names=["neg", "pos"])})
    train = rows(40, labels=("bad", "good"))
    datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"text": [t for t, _ in train],
                                             "label": [int(y == "good") for _, y in train]}, features=features),
        "test": datasets.Dataset.from_dict({"text": [t for t, _ in rows(12, 1)], "label": [-1] * 12},
                                           features=features),
    }).save_to_disk(str(tmp_path / "ds"))
    line = refused(own_args, tmp_path, capsys, tmp_path / "ds")
    assert f"{tmp_path / 'ds'} [test] is unlabelled: 12 of 12 labels are -1" in line, line
    assert "save the folder without that split" in line


# ---------------------------------------------------------------------------- flags and words

@pytest.mark.parametrize("flags", [["--seed", "-1"], ["--split-seed", "-5"], ["--seed", str(2**32)]])
def test_a_seed_numpy_cannot_take_is_refused_by_its_flag(flags, own_args, tmp_path, capsys):
    line = refused(own_args, tmp_path, capsys, tmp_path / "not-read.csv", *flags)
    assert line.startswith(f"error: {flags[0]} ") and f"got {flags[1]}" in line, line


def test_help_speaks_of_texts_not_reviews():
    assert "review" not in build_parser().format_help().lower()


def test_a_run_on_own_data_says_examples_and_its_reading_notes(own_args, tmp_path, capsys):
    data = rows(60)
    texts = [t if i % 10 else f'"{t}\nsecond line"' for i, (t, _) in enumerate(data)]  # quoted texts with a break
    path = tmp_path / "a.csv"
    path.write_text("text,label\n" + "".join(f"{t},{y} \n" for t, (_, y) in zip(texts, data)))
    assert main(own_args(path)) == 0
    captured = capsys.readouterr()
    err = captured.err.splitlines()
    assert f"note: {path}: 60 rows read from 66 lines: 6 rows span several lines inside quotes, the first lines " \
           f"2-3" in err, err
    assert f"note: {path}: 60 labels in column 'label' had spaces around them, stripped ('bad ' is 'bad', " \
           f"line 2)" in err, err
    assert any(line.startswith("note: each epoch trains on") and "training examples" in line for line in err), err
    test_line = [line for line in captured.out.splitlines() if line.startswith("test (")]
    assert len(test_line) == 1 and " on 12 examples | " in test_line[0], test_line
    assert json.loads((tmp_path / "run" / "results.json").read_text())["label_names"] == ["bad", "good", "meh"]
    assert main(own_args(path, out=tmp_path / "again")) == 0  # the cache found: the notes again
    assert f"note: {path}: 60 rows read from 66 lines" in capsys.readouterr().err
