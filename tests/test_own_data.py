"""Your own data (--data): files, splits, labels, metrics, sentence pairs, export, bad input."""

from __future__ import annotations

import csv
import importlib.util
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from fastpt.inputs import own_data
from fastpt.inputs.data import Collator, pair_token_types
from fastpt.inputs.models import load_model, load_tokenizer
from fastpt.config import TrainConfig
from fastpt.loop.evaluation import f1_by_class, macro_f1, per_class
from fastpt.files import checkpoint
from train import main


WORDS = {"good": "lovely bright sweet calm".split(), "bad": "broken rotten loud grim".split(),
         "meh": "usual plain grey round".split()}
FILLER = "the a box lamp chair spoon table cup".split()


def rows(n: int, seed: int = 0, labels=("bad", "good", "meh")) -> list[tuple[str, str]]:
    """Short made-up sentences whose words give their label away."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        label = labels[i % len(labels)]
        words = [rng.choice(FILLER) for _ in range(rng.randint(3, 8))] + [rng.choice(WORDS[label])] * 2
        rng.shuffle(words)
        out.append((" ".join(words), label))
    return out


def write_csv(path, data, header=("text", "label"), delimiter=","):
    with open(path, "w", newline="") as f:
        w = csv.writer(f, delimiter=delimiter)
        w.writerow(header)
        w.writerows(data)
    return path


@pytest.fixture
def own_args(own_args):
    """conftest.py's flags, with two epochs: the runs here compare what training learned."""
    return lambda data, *extra, out=None: own_args(data, "--epochs", "2", *extra, out=out)


def test_csv_run_metrics_checkpoint_and_export_match_a_pipeline(own_args, tmp_path):
    from transformers import pipeline

    order = ("meh", "good", "bad")  # first seen in this order: the ids must still follow the sorted one
    train = write_csv(tmp_path / "train.csv", rows(90, labels=order))
    test_rows = rows(30, seed=1, labels=order)
    test = write_csv(tmp_path / "test.csv", test_rows)
    out, export = tmp_path / "run", tmp_path / "export"
    assert main(own_args(train, "--test-data", str(test), "--epochs", "3", "--export-dir", str(export))) == 0
    results = json.loads((out / "results.json").read_text())
    config = json.loads((out / "config.json").read_text())
    names = ["bad", "good", "meh"]  # sorted
    assert config["label_names"] == names and results["label_names"] == names
    assert config["test_fraction"] is None and config["val_fraction"] == 0.1
    assert results["test_examples"] == 30 and results["val_examples"] == 9 and results["train_examples"] == 81
    assert all("val_macro_f1" in h for h in results["history"])
    confusion = np.array(results["test_confusion"])
    assert confusion.sum() == 30 and confusion.sum(1).tolist() == [10, 10, 10]
    assert results["test_acc"] == pytest.approx(np.trace(confusion) / 30)
    assert {k: v["support"] for k, v in results["test_per_class"].items()} == dict.fromkeys(names, 10)
    best = checkpoint.load(out / "checkpoints" / "best.pt")
    assert best["config"]["label_names"] == names

    # fastpt's own predictions: best.pt in a plain model, padded batches as the run makes them
    model = load_model("tiny", True, label_names=names)
    model.load_state_dict(best["model"])
    model.eval()
    tokenizer = load_tokenizer("tiny")
    texts = [t for t, _ in test_rows]
    items = [(np.array(tokenizer(t, truncation=True, max_length=24)["input_ids"], dtype=np.int32), 0, 1.0)
             for t in texts]
    batch = Collator(0, "longest", 24)(items)
    with torch.no_grad():
        ours = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.argmax(-1)
    ours = [names[i] for i in ours.tolist()]
    assert len(set(ours)) > 1, "a model predicting one class would make this comparison weak"

    classify = pipeline("text-classification", model=str(export), device="cpu")
    theirs = [p["label"] for p in classify(texts)]
    assert theirs == ours
    # A text longer than --max-length: the export cuts it where training did (truncation=True, as docs/own-data.md says)
    assert json.loads((export / "tokenizer_config.json").read_text())["model_max_length"] == 24
    long_texts = [t + " " + " ".join(FILLER * 4) for t in texts[:8]]
    assert all(len(tokenizer(t)["input_ids"]) > 24 for t in long_texts)
    cut_ids = [np.array(tokenizer(t, truncation=True, max_length=24)["input_ids"], dtype=np.int32) for t in long_texts]
    cut = Collator(0, "longest", 24)([(ids, 0, 1.0) for ids in cut_ids])
    with torch.no_grad():
        expected = model(input_ids=cut["input_ids"], attention_mask=cut["attention_mask"]).logits.softmax(-1)
    scores = classify(long_texts, truncation=True, top_k=None)
    got = torch.tensor([[next(s["score"] for s in row if s["label"] == name) for name in names] for row in scores])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    truth = [label for _, label in test_rows]
    recomputed = [[sum(t == a and p == b for t, p in zip(truth, theirs)) for b in names] for a in names]
    assert recomputed == results["test_confusion"]
    assert results["test_macro_f1"] == pytest.approx(_macro_f1(truth, theirs))


EXPORT_ALONE = """
import sys, types, torch
from fastpt.cli import outputs
from fastpt.inputs.models import load_model, load_tokenizer
model = load_model("tiny", True, label_names=["a", "b"])
assert "deepspeed" not in sys.modules
ns = types.SimpleNamespace
outputs.export(sys.argv[1], ns(is_main=True, device=torch.device("cpu")),
               ns(model_state_dict=model.state_dict, cfg=ns(max_length=20)),
               ns(model_config=model.config, label_names=["a", "b"], data_label_names=None,
                  tokenizer=load_tokenizer("tiny")), ns(print=print))
print("deepspeed imported" if "deepspeed" in sys.modules else "deepspeed not imported")
"""


@pytest.mark.slow  # 6 s: a fresh process (torch, transformers, DeepSpeed imported anew)
def test_export_alone_says_nothing_of_deepspeed(tmp_path):
    """In a fresh process (DeepSpeed not yet imported), where save_pretrained's accelerate imports DeepSpeed:
    no accelerator warning; and the tokenizer's model_max_length is the length trained on."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-c", EXPORT_ALONE, str(tmp_path / "export")], cwd=root, text=True,
                          capture_output=True, timeout=120, env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "accelerator" not in proc.stdout + proc.stderr and "WARNING" not in proc.stderr, proc.stderr
    if importlib.util.find_spec("deepspeed"):
        assert "deepspeed imported" in proc.stdout  # the path the warning came from was taken
    assert json.loads((tmp_path / "export" / "tokenizer_config.json").read_text())["model_max_length"] == 20


def _macro_f1(truth, predicted):
    """scikit-learn's f1_score(average='macro'), written out: the mean F1 over labels seen or predicted."""
    f1 = []
    for label in sorted(set(truth) | set(predicted)):
        tp = sum(t == p == label for t, p in zip(truth, predicted))
        fp = sum(p == label != t for t, p in zip(truth, predicted))
        fn = sum(t == label != p for t, p in zip(truth, predicted))
        f1.append(2 * tp / (2 * tp + fp + fn))
    return sum(f1) / len(f1)


def test_macro_f1_leaves_out_labels_never_seen_nor_predicted():
    assert macro_f1([[2, 0, 0], [1, 1, 0], [0, 0, 0]]) == pytest.approx(_macro_f1([0, 0, 1, 1], [0, 0, 0, 1]))


def test_carved_split_is_stratified_seeded_and_complete():
    labels = ["a"] * 50 + ["b"] * 30 + ["c"] * 20
    split = own_data.stratified_split(labels, {"validation": 0.1, "test": 0.2}, seed=0)
    assert sorted(np.concatenate(list(split.values())).tolist()) == list(range(100))
    counts = {name: {c: sum(labels[i] == c for i in idx) for c in "abc"} for name, idx in split.items()}
    assert counts["validation"] == {"a": 5, "b": 3, "c": 2} and counts["test"] == {"a": 10, "b": 6, "c": 4}
    again = own_data.stratified_split(labels, {"validation": 0.1, "test": 0.2}, seed=0)
    other = own_data.stratified_split(labels, {"validation": 0.1, "test": 0.2}, seed=1)
    assert all(np.array_equal(split[k], again[k]) for k in split)
    assert not np.array_equal(np.sort(split["test"]), np.sort(other["test"]))


def _cfg(data, **kw):
    return TrainConfig(model="tiny", data=str(data), max_length=24, **kw)


def test_every_file_format_gives_the_same_splits(tmp_path, cache_dir):
    """CSV (integer labels as text), TSV, JSON Lines and Parquet: the same tokens, labels and label names."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = [(t, {"bad": 0, "good": 1, "meh": 2}[label]) for t, label in rows(60)]
    write_csv(tmp_path / "d.csv", data)
    write_csv(tmp_path / "d.tsv", data, delimiter="\t")
    with open(tmp_path / "d.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t, "label": y}) + "\n" for t, y in data)
    pq.write_table(pa.table({"text": [t for t, _ in data], "label": [y for _, y in data]}), tmp_path / "d.parquet")
    tokenizer = load_tokenizer("tiny")
    loaded = []
    for name in ("d.csv", "d.tsv", "d.jsonl", "d.parquet"):
        cfg = _cfg(tmp_path / name, cache_dir=str(cache_dir))
        splits, _, names, origin = own_data.prepare_own_splits(cfg, tokenizer)
        assert names == ["0", "1", "2"] and origin["test"]["fraction"] == 0.2
        loaded.append(splits)
    for splits in loaded[1:]:
        for k in ("train", "validation", "test"):
            assert np.array_equal(splits[k].ids, loaded[0][k].ids)
            assert np.array_equal(splits[k].labels, loaded[0][k].labels)
    assert len(loaded[0]["train"]) == 42 and sorted(np.bincount(loaded[0]["test"].labels)) == [4, 4, 4]


def test_save_to_disk_folder_with_its_splits_and_class_names(tmp_path, cache_dir):
    import datasets

    features = datasets.Features({"sentence": datasets.Value("string"),
                                  "y": datasets.ClassLabel(names=["zeta", "alpha"])})  # ids kept, not sorted

    def split(n, seed):
        data = rows(n, seed, labels=("bad", "good"))
        return datasets.Dataset.from_dict({"sentence": [t for t, _ in data],
                                           "y": [int(label == "good") for _, label in data]}, features=features)

    datasets.DatasetDict({"train": split(40, 0), "validation": split(10, 1), "test": split(12, 2)}).save_to_disk(
        str(tmp_path / "ds"))
    cfg = _cfg(tmp_path / "ds", text_column="sentence", label_column="y", cache_dir=str(cache_dir))
    splits, _, names, origin = own_data.prepare_own_splits(cfg, load_tokenizer("tiny"))
    assert names == ["zeta", "alpha"]
    assert [len(splits[k]) for k in ("train", "validation", "test")] == [40, 10, 12]
    assert splits["test"].labels.tolist() == [i % 2 for i in range(12)]
    assert origin["validation"].endswith("[validation]")


def test_rebuilt_token_type_ids_equal_the_tokenizers():
    tokenizer = load_tokenizer("minilm")
    pairs = [("a short one", "and its partner"), ("word " * 40, "tail " * 30), ("x", "y " * 50)]
    enc = tokenizer([a for a, _ in pairs], [b for _, b in pairs], truncation=True, max_length=32,
                    padding=True, return_tensors="pt")
    assert enc["token_type_ids"].any()
    assert torch.equal(pair_token_types(enc["input_ids"], enc["attention_mask"], tokenizer.sep_token_id),
                       enc["token_type_ids"])


@pytest.fixture
def tiny_bert(tmp_path):
    """A 2-layer BERT with segment embeddings (type_vocab_size 2) and the offline BERT vocabulary."""
    from transformers import BertConfig, BertForSequenceClassification

    folder = tmp_path / "tiny-bert"
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64)
    BertForSequenceClassification(config).save_pretrained(folder)
    load_tokenizer("tiny").save_pretrained(folder)
    return folder


def pair_file(tmp_path, n=90):
    data = rows(n)
    return write_csv(tmp_path / "pairs.csv", [(t, "first " + t.split()[0], y) for t, y in data],
                     header=("premise", "hypothesis", "label"))


def test_sentence_pairs_train_on_bert_with_token_types_and_pack_is_refused(own_args, tmp_path, tiny_bert, capsys):
    pairs = pair_file(tmp_path)
    flags = ["--model", str(tiny_bert), "--text-column", "premise", "--text-pair-column", "hypothesis",
             "--epochs", "1"]
    seen = []
    original = Collator.__call__

    def spy(self, items):
        batch = original(self, items)
        seen.append("token_type_ids" in batch and bool(batch["token_type_ids"].any()))
        return batch

    Collator.__call__ = spy
    try:
        assert main(own_args(pairs, *flags)) == 0
    finally:
        Collator.__call__ = original
    assert seen and all(seen)
    from fastpt.inputs import device_data
    built = []
    original_types = device_data.pair_token_types

    def spy_device(*args):
        built.append(original_types(*args))
        return built[-1]

    device_data.pair_token_types = spy_device
    try:
        assert main(own_args(pairs, *flags, "--data-on-device", out=tmp_path / "on-device")) == 0
    finally:
        device_data.pair_token_types = original_types
    assert built and all(t.any() for t in built)
    capsys.readouterr()
    out = tmp_path / "packed"
    assert main(own_args(pairs, *flags, "--pack", out=out)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--pack cannot carry the token_type_ids" in err[0] and not out.exists()


def test_sentence_pairs_pack_on_distilbert(own_args, tmp_path):
    """DistilBERT has no segment embeddings: a pair is one token stream, which packing carries."""
    pairs = pair_file(tmp_path)
    assert main(own_args(pairs, "--text-column", "premise", "--text-pair-column", "hypothesis", "--pack",
                         "--epochs", "1")) == 0


def test_monitor_macro_f1_picks_the_best_epoch_and_tensorboard_shows_each_class(own_args, tmp_path, capsys):
    """--monitor-metric val_macro_f1 picks best.pt; TensorBoard has per-class validation F1 / precision / recall
    per epoch, equal to the confusion logged as text that epoch (counted again here from its table), macro-F1
    charted and in HPARAMS; the console's test line gives each class's F1 (three classes, uneven)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2

    train = write_csv(tmp_path / "train.csv", rows(60) + rows(30, seed=5, labels=("good",)))
    out = tmp_path / "run"
    args = own_args(train, "--monitor-metric", "val_macro_f1", "--epochs", "3", out=out)
    assert main([a for a in args if a != "--no-tensorboard"]) == 0
    console = capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    f1 = [h["val_macro_f1"] for h in results["history"]]
    assert results["best_epoch"] == f1.index(max(f1)) + 1 and results["best_monitor"] == max(f1)
    names = results["label_names"]
    acc = EventAccumulator(str(out / "tb"), size_guidance={"tensors": 0, "scalars": 0}).Reload()
    texts = acc.Tensors("val_confusion/text_summary")
    assert len(texts) == 3
    for epoch, (text, row) in enumerate(zip(texts, results["history"]), 1):
        assert text.step == row["step"]
        table = text.tensor_proto.string_val[0].decode().strip("`\n").splitlines()
        assert table[0] == f"epoch {epoch}, step {row['step']}" and table[1].split()[-3:] == names
        confusion = [[int(v) for v in line.split()[1:]] for line in table[2:]]
        assert [line.split()[0] for line in table[2:]] == names and sum(map(sum, confusion)) == 9
        truth = [t for t, r in enumerate(confusion) for p, n in enumerate(r) for _ in range(n)]
        predicted = [p for t, r in enumerate(confusion) for p, n in enumerate(r) for _ in range(n)]
        assert row["val_macro_f1"] == pytest.approx(_macro_f1(truth, predicted))
        for label, name in enumerate(names):
            tp = sum(t == p == label for t, p in zip(truth, predicted))
            n_true, n_predicted = truth.count(label), predicted.count(label)
            expect = {"f1": 2 * tp / (n_true + n_predicted) if n_true + n_predicted else 0.0,
                      "precision": tp / n_predicted if n_predicted else 0.0, "recall": tp / n_true}
            for metric, value in expect.items():
                event = acc.Scalars(f"val_{metric}/{name}")[epoch - 1]
                assert event.step == row["step"] and event.value == pytest.approx(value, abs=1e-6), (metric, name)
    layout = layout_pb2.Layout.FromString(acc.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
    charts = {chart.title: list(chart.multiline.tag) for category in layout.category for chart in category.chart}
    assert charts["macro-F1"] == ["epoch/val_macro_f1"] and charts["f1"] == ["val_f1/.*"]
    hparams = EventAccumulator(str(next((out / "tb" / "hparams").iterdir()).parent)).Reload()
    assert hparams.Scalars("hparam/best_val_macro_f1")[0].value == pytest.approx(results["best_val_macro_f1"])
    by_class = ", ".join(f"{n} {c['f1']:.3f}" for n, c in results["test_per_class"].items())
    assert f"macro-F1 {results['test_macro_f1']:.4f} (F1 by class: {by_class}) on " in console, console


def test_f1_by_class_is_left_out_for_two_even_classes():
    even = per_class([[40, 10], [5, 45]], ["neg", "pos"])
    assert f1_by_class(even) == ""
    assert f1_by_class(per_class([[40, 10], [5, 25]], ["neg", "pos"])) == "F1 by class: neg 0.842, pos 0.769"


# ---------------------------------------------------------------------------- bad input

def _bad(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


BAD = {
    "missing column": (lambda p: write_csv(p / "a.csv", rows(30), header=("sentence", "label")), [],
                       "has no column 'text' (--text-column); its columns: 'sentence', 'label'; "
                       "say which with --text-column sentence"),
    "empty file": (lambda p: _bad(p, "a.csv", ""), [], "is empty"),
    "header only": (lambda p: _bad(p, "a.csv", "text,label\n"), [], "has no rows"),
    "one class": (lambda p: write_csv(p / "a.csv", rows(30, labels=("good",))), [], "one class only"),
    "unseen label": (lambda p: write_csv(p / "a.csv", rows(30, labels=("good", "bad"))),
                     ["--test-data", "{t}"], "has label 'meh' that the training set lacks"),
    "empty texts": (lambda p: write_csv(p / "a.csv", rows(28) + [("", "good"), ("  ", "bad")]), [],
                    "2 empty or non-string values in column 'text' (line"),
    "null text": (lambda p: _bad(p, "a.jsonl", '{"text": "fine", "label": 1}\n{"text": null, "label": 0}\n'), [],
                  "a.jsonl: 1 empty or non-string value in column 'text' (line 2)"),
    "malformed row": (lambda p: _bad(p, "a.csv", "text,label\nfine,1\nbad,0,extra\n"), [],
                      "a.csv: line 3: malformed row: 3 fields, the header has 2"),
    "bad json": (lambda p: _bad(p, "a.jsonl", '{"text": "x", "label": 1}\n{"text": \n'), [],
                 "a.jsonl: line 2: not valid JSON"),
    "fractions": (lambda p: write_csv(p / "a.csv", rows(30)), ["--val-fraction", "0.5", "--test-fraction", "0.5"],
                  "leaves no training data"),
    "empty split": (lambda p: write_csv(p / "a.csv", rows(6)), ["--val-fraction", "0.01"],
                    "the validation split is empty"),
    "missing file": (lambda p: p / "nope.csv", [], "nope.csv: no such file"),
    "hub offline": (lambda p: "someone/some-dataset", [], "offline"),
    "data-dir": (lambda p: write_csv(p / "a.csv", rows(30)), ["--data-dir", "x"], "--data-dir is IMDB's folder"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_line_exit_2_and_writes_nothing(case, own_args, tmp_path, capsys):
    make, extra, message = BAD[case]
    src = tmp_path / "src"
    src.mkdir()
    data = make(src)
    test = write_csv(src / "t.csv", rows(9, seed=3))
    out = tmp_path / "run"
    status = main(own_args(data, *[e.format(t=test) for e in extra], out=out))
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and message in err[0], err
    assert not out.exists()


def test_columns_named_per_file_sst2_style(own_args, tmp_path, capsys):
    """SST-2's layout: `sentence` in train, `content` in dev and test; one flag lists both names."""
    train = write_csv(tmp_path / "train.tsv", rows(60), header=("sentence", "label"), delimiter="\t")
    dev_rows, test_rows = rows(12, seed=1), rows(9, seed=2)
    dev = write_csv(tmp_path / "dev.tsv", dev_rows, header=("content", "label"), delimiter="\t")
    test = tmp_path / "test.tsv"
    test.write_text("label\tcontent\n" + "".join(f"{y}\t{t}\n" for t, y in test_rows))  # columns in another order
    files = ["--val-data", str(dev), "--test-data", str(test)]
    out = tmp_path / "run"
    assert main(own_args(train, "--text-column", "sentence", *files, out=out)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{dev} has no column 'sentence'" in err[0], err
    assert "'content', 'label'" in err[0] and "--text-column sentence,content" in err[0], err  # and how to fix it
    assert not out.exists()

    cfg = _cfg(train, text_column="sentence,content", val_data=str(dev), test_data=str(test))
    splits, _, _ = own_data.gather_splits(cfg)
    assert [t.use["text"] for t in splits.values()] == ["sentence", "content", "content"]
    assert splits["validation"].columns["content"] == [t for t, _ in dev_rows]
    assert splits["test"].columns["label"] == [y for _, y in test_rows]
    assert len(splits["train"]) == 60
    # A run on them: predictions.csv gives each test row its own file's text and label.
    assert main(own_args(train, "--text-column", "sentence,content", *files, out=out)) == 0
    capsys.readouterr()
    with open(out / "predictions.csv", newline="") as f:
        predicted = list(csv.DictReader(f))
    assert [(p["row"], p["text"], p["label"]) for p in predicted] == [
        (str(i), " ".join(t.split())[:80], str(y)) for i, (t, y) in enumerate(test_rows)]
    shutil.rmtree(out)

    both = write_csv(tmp_path / "both.tsv", [(t, t, y) for t, y in dev_rows], header=("sentence", "content", "label"),
                     delimiter="\t")
    assert main(own_args(train, "--text-column", "sentence,content", "--val-data", str(both), out=out)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has both 'sentence' and 'content', which --text-column sentence,content" in err[0]
    assert not out.exists()
    with pytest.raises(ValueError, match="must name different columns"):
        _cfg(train, text_column="sentence,label")


def test_without_data_the_own_data_flags_are_refused(tiny_args, capsys):
    assert main(tiny_args("--label-column", "y")) == 2
    assert "--label-column needs --data" in capsys.readouterr().err


def test_ddp_confusion_counts_each_test_row_once(tmp_path, cache_dir):
    """Two gloo ranks, 31 test rows (unequal shares): the all-reduced confusion equals one process's on best.pt,
    and predictions.csv (gathered from both ranks) holds each row once and counts to it."""
    import os
    import subprocess
    import sys

    from fastpt.inputs import data
    from fastpt.loop.evaluation import evaluate
    from fastpt.cluster.distributed import DistInfo
    from fastpt.strategies.base import Strategy

    train = write_csv(tmp_path / "train.csv", rows(120))
    test = write_csv(tmp_path / "test.csv", rows(31, seed=5))
    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", "train.py",
           "--ddp", "--model", "tiny", "--data", str(train), "--test-data", str(test), "--cache-dir", str(cache_dir),
           "--max-length", "24", "--batch-size", "4", "--epochs", "2", "--lr", "2e-3", "--no-progress",
           "--no-tensorboard", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=Path(__file__).resolve().parent.parent, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["world_size"] == 2 and results["test_examples"] == 31

    names = results["label_names"]
    cfg = TrainConfig(model="tiny", data=str(train), test_data=str(test), cache_dir=str(cache_dir), max_length=24,
                      device="cpu")
    splits, *_ = own_data.prepare_own_splits(cfg, load_tokenizer("tiny"))
    strategy = Strategy(cfg, DistInfo(0, 0, 1, torch.device("cpu")))
    strategy.setup(load_model("tiny", True, label_names=names))
    strategy.load_model_state_dict(checkpoint.load(out / "checkpoints" / "best.pt")["model"])
    loader = data.make_loader(splits["test"], data.EvalBatchSampler(splits["test"], 8, 0, 1),
                              Collator(0, "longest", 24), 0, False, 0)
    single = evaluate(strategy, loader, num_labels=len(names))
    assert single["confusion"] == results["test_confusion"]
    assert single["macro_f1"] == pytest.approx(results["test_macro_f1"])
    # predictions.csv, gathered from both ranks: each test row once, in the file's order, counting to the confusion
    with open(out / "predictions.csv", newline="") as f:
        predicted = list(csv.DictReader(f))
    assert [int(p["row"]) for p in predicted] == list(range(31))
    assert [[sum(p["label"] == a and p["predicted"] == b for p in predicted) for b in names] for a in names] \
        == results["test_confusion"]


def test_resume_with_own_data_continues_and_a_changed_column_is_refused(own_args, tmp_path, capsys):
    train = write_csv(tmp_path / "train.csv", rows(90))
    out = tmp_path / "run"
    assert main(own_args(train, "--epochs", "1", "--save-every", "1000", out=out)) == 0
    assert main(own_args(train, "--epochs", "2", "--resume", "auto", out=out)) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["epochs_run"] == 2 and results["label_names"] == ["bad", "good", "meh"]
    capsys.readouterr()
    assert main(own_args(train, "--epochs", "3", "--resume", "auto", "--split-seed", "1", out=out)) == 2
    assert "--split-seed was 0, now 1" in capsys.readouterr().err


@pytest.fixture
def encoder_folder(tmp_path):
    """A tiny random encoder of any architecture in a local folder, with the offline BERT vocabulary."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    def make(kind, **kw):
        folder = tmp_path / kind
        config = AutoConfig.for_model(kind, vocab_size=30522, hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, intermediate_size=64, **kw)
        AutoModelForSequenceClassification.from_config(config).save_pretrained(folder)
        load_tokenizer("tiny").save_pretrained(folder)
        return folder
    return make


def test_any_encoder_trains_roberta_packs_and_others_are_refused_pack(own_args, tmp_path, encoder_folder, capsys):
    train = write_csv(tmp_path / "train.csv", rows(60))
    # RoBERTa numbers positions from its padding index + 1: 24 tokens need 24 + pad + 1 positions
    roberta = encoder_folder("roberta", pad_token_id=0, max_position_embeddings=26)
    for flags in ([], ["--pack"]):
        assert main(own_args(train, "--model", str(roberta), "--epochs", "1", *flags,
                             out=tmp_path / f"run-roberta{len(flags)}")) == 0
    electra = encoder_folder("electra", embedding_size=32)
    assert main(own_args(train, "--model", str(electra), "--epochs", "1", out=tmp_path / "run-electra")) == 0
    capsys.readouterr()
    assert main(own_args(train, "--model", str(electra), "--pack", out=tmp_path / "run-electra-pack")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --pack") and "not electra" in err[0], err
    assert not (tmp_path / "run-electra-pack").exists()
