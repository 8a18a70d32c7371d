"""Predictions: a run's predictions.csv against its results.json, and fastpt-predict against transformers' pipeline."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fastpt.cli.predict import main as predict
from test_own_data import rows, write_csv
from train import main as train


def read_predictions(path: Path) -> list[dict]:
    if path.suffix == ".csv":
        with open(path, newline="") as f:
            return list(csv.DictReader(f))
    return [json.loads(line) for line in path.read_text().splitlines()]


def counted_confusion(predictions: list[dict], names: list) -> list[list[int]]:
    """confusion[true][predicted] counted from the file's label and predicted columns."""
    return [[sum(p["label"] == a and p["predicted"] == b for p in predictions) for b in names] for a in names]


def probabilities(predictions: list[dict], names: list) -> np.ndarray:
    return np.array([[float(p[f"prob_{name}"]) for name in names] for p in predictions])


@pytest.fixture(scope="module")
def trained(tmp_path_factory, cache_dir):
    """One tiny run on made-up 3-class data (31 test rows from their own file), with an export."""
    root = tmp_path_factory.mktemp("predict")
    test_rows = rows(31, seed=5)
    train_csv, test_csv = write_csv(root / "train.csv", rows(120)), write_csv(root / "test.csv", test_rows)
    run, export = root / "run", root / "export"
    flags = ["--model", "tiny", "--data", str(train_csv), "--test-data", str(test_csv), "--cache-dir", str(cache_dir),
             "--max-length", "24", "--batch-size", "8", "--epochs", "3", "--lr", "3e-3", "--no-progress",
             "--no-tensorboard"]
    assert train([*flags, "--out", str(run), "--export-dir", str(export)]) == 0
    return {"root": root, "run": run, "export": export, "test_csv": test_csv, "test_rows": test_rows,
            "flags": flags, "results": json.loads((run / "results.json").read_text())}


def test_predictions_csv_counts_to_the_results_confusion(trained):
    results, names = trained["results"], trained["results"]["label_names"]
    predictions = read_predictions(trained["run"] / "predictions.csv")
    assert list(predictions[0]) == ["row", "text", "label", "predicted", *[f"prob_{n}" for n in names]]
    assert [int(p["row"]) for p in predictions] == list(range(31))  # the test file's rows, in its order
    assert [(p["text"], p["label"]) for p in predictions] == trained["test_rows"]
    assert counted_confusion(predictions, names) == results["test_confusion"]
    assert len({p["predicted"] for p in predictions}) > 1, "a model predicting one class makes the counts weak"
    probs = probabilities(predictions, names)
    assert np.allclose(probs.sum(1), 1, atol=1e-5)
    assert [names[i] for i in probs.argmax(1)] == [p["predicted"] for p in predictions]


def test_carved_imdb_test_split_names_each_review_by_its_file(tiny_args, imdb_dir, tmp_path):
    """IMDB: each test review once, by its file in aclImdb/ (no text: the tarball is not read again);
    the counts are results.json's."""
    import tarfile

    out = tmp_path / "run"
    assert train(tiny_args("--epochs", "1", "--no-tensorboard", out=out)) == 0
    results = json.loads((out / "results.json").read_text())
    predictions = read_predictions(out / "predictions.csv")
    assert len(predictions) == results["test_examples"] == 32
    assert counted_confusion(predictions, ["neg", "pos"]) == results["test_confusion"]
    assert list(predictions[0])[:3] == ["review", "label", "predicted"]
    assert len({p["review"] for p in predictions}) == 32
    with tarfile.open(imdb_dir / "aclImdb_v1.tar.gz") as tar:
        files = set(tar.getnames())
    for p in predictions:
        assert f"aclImdb/{p['review']}" in files and p["label"] == p["review"].split("/")[1]


def test_predict_matches_the_pipeline_from_the_export_and_the_run_folder(trained, capsys):
    from transformers import pipeline

    names, root = trained["results"]["label_names"], trained["root"]
    outputs = {}
    for source, out in (("export", root / "from-export.csv"), ("run", root / "from-run.jsonl")):
        assert predict(["--model", str(trained[source]), "--data", str(trained["test_csv"]), "--out", str(out)]) == 0
        outputs[source] = read_predictions(out)
    printed = capsys.readouterr().out
    assert printed.count("| batch 16 |") == 2  # --batch-size's default on a CPU
    accuracy = np.trace(trained["results"]["test_confusion"]) / 31
    assert printed.count(f"evaluation: accuracy {accuracy:.4f}") == 2  # the run's own test accuracy, both times

    texts = [text for text, _ in trained["test_rows"]]
    classify = pipeline("text-classification", model=str(trained["export"]), device="cpu", top_k=None)
    theirs = [{s["label"]: s["score"] for s in scores} for scores in classify(texts)]
    for source, predictions in outputs.items():
        assert [p["predicted"] for p in predictions] == [max(t, key=t.get) for t in theirs], source
        assert np.allclose(probabilities(predictions, names), [[t[n] for n in names] for t in theirs], atol=1e-5)
        assert [p["label"] for p in predictions] == [label for _, label in trained["test_rows"]]
    as_text = {source: [{k: str(v) for k, v in p.items()} for p in predictions]
               for source, predictions in outputs.items()}
    assert as_text["export"] == as_text["run"]  # the same file, CSV and JSON Lines
    run_file = read_predictions(trained["run"] / "predictions.csv")
    assert [p["predicted"] for p in run_file] == [p["predicted"] for p in outputs["run"]]


def test_last_pt_of_a_finished_run_exists_only_with_save_every(trained, tmp_path, capsys):
    """A finished run writes last.pt only where --save-every asked for it (then also after each epoch, so it
    holds the final weights); without it, `--checkpoint last` and `--resume auto` find none and say so."""
    from fastpt.files import checkpoint

    plain = trained["run"]  # no --save-every, shorter than --save-every-minutes: best.pt only
    assert (plain / "checkpoints" / "best.pt").is_file() and not (plain / "checkpoints" / "last.pt").exists()
    capsys.readouterr()
    out = tmp_path / "from-last.csv"
    assert predict(["--model", str(plain), "--data", str(trained["test_csv"]), "--out", str(out),
                    "--checkpoint", "last"]) == 2
    assert "without checkpoints/last.pt" in capsys.readouterr().err and not out.exists()
    before = sorted(p.name for p in plain.rglob("*"))
    assert train([*trained["flags"], "--out", str(plain), "--resume", "auto", "--epochs", "4"]) == 2
    assert "holds a finished run" in capsys.readouterr().err  # nothing to continue from
    assert sorted(p.name for p in plain.rglob("*")) == before

    # --save-every larger than the run and --test-on last: last.pt is the end of the last epoch, whose
    # weights the run tested, so predicting from it gives the run's own predictions.csv.
    run = tmp_path / "saved"
    assert train([*trained["flags"], "--epochs", "2", "--out", str(run), "--save-every", "1000",
                  "--test-on", "last"]) == 0
    results = json.loads((run / "results.json").read_text())
    assert checkpoint.load(run / "checkpoints" / "last.pt")["progress"]["global_step"] == results["global_steps"]
    assert predict(["--model", str(run), "--data", str(trained["test_csv"]), "--out", str(out),
                    "--checkpoint", "last"]) == 0
    names = results["label_names"]
    assert np.allclose(probabilities(read_predictions(out), names),
                       probabilities(read_predictions(run / "predictions.csv"), names), atol=1e-5)
    capsys.readouterr()
    assert train([*trained["flags"], "--epochs", "2", "--out", str(run), "--save-every", "1000", "--test-on", "last",
                  "--resume", "auto"]) == 0  # finished, and last.pt says there is nothing left to train
    said = capsys.readouterr()
    assert "is finished" in said.out + said.err, said


def test_unlabelled_texts_are_predicted_without_a_label_column(trained, capsys):
    data = trained["root"] / "new.jsonl"
    data.write_text("".join(json.dumps({"review": text, "id": i}) + "\n" for i, (text, _) in enumerate(rows(5))))
    out = trained["root"] / "new-predictions.jsonl"
    assert predict(["--model", str(trained["export"]), "--data", str(data), "--out", str(out),
                    "--text-column", "review", "--amp", "bfloat16"]) == 0
    predictions = read_predictions(out)
    assert [list(p)[:3] for p in predictions] == [["row", "text", "predicted"]] * 5
    assert "evaluation" not in capsys.readouterr().out


def test_bfloat16_predictions_run_a_bfloat16_model_and_agree_with_float32(trained, monkeypatch):
    """--amp bfloat16: the model's weights cast to bfloat16 once (no autocast around a float32 model,
    loop/inference.py), padded and packed; the labels are float32's wherever float32's top two
    probabilities are not within bfloat16's rounding, the probabilities within 0.02."""
    from fastpt.loop import inference

    names, root, seen = trained["results"]["label_names"], trained["root"], []
    real = inference.predict

    def watched(model, *args, **kwargs):
        seen.append({p.dtype for p in model.parameters()})
        return real(model, *args, **kwargs)

    monkeypatch.setattr(inference, "predict", watched)
    found = {}
    for how, flags in (("float32", []), ("bf16", ["--amp", "bfloat16"]),
                       ("bf16-packed", ["--amp", "bfloat16", "--pack"])):
        out = root / f"amp-{how}.csv"
        assert predict(["--model", str(trained["export"]), "--data", str(trained["test_csv"]), "--out", str(out),
                        "--overwrite", *flags]) == 0
        found[how] = read_predictions(out)
    import torch
    assert seen == [{torch.float32}, {torch.bfloat16}, {torch.bfloat16}]
    reference = probabilities(found["float32"], names)
    top_two = np.sort(reference, axis=1)[:, -2:]
    clear = top_two[:, 1] - top_two[:, 0] > 0.02
    assert clear.sum() >= 20, "too few clear predictions to compare labels"
    for how in ("bf16", "bf16-packed"):
        assert np.abs(probabilities(found[how], names) - reference).max() < 0.02
        assert [p["predicted"] for p, c in zip(found[how], clear) if c] == \
            [p["predicted"] for p, c in zip(found["float32"], clear) if c]


def test_prepacked_bfloat16_linears_predict_exactly_what_plain_ones_do(trained, capsys):
    """speedups/prepacked.py: where oneDNN computes bfloat16 on this CPU, every nn.Linear of a
    bfloat16 model (the packing wrapper's head too) becomes a PrepackedLinear and the probabilities stay
    the same bit for bit, padded and packed; float32 models keep theirs; fastpt-predict says how many."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from fastpt.loop import inference
    from fastpt.speedups import prepacked
    from fastpt.speedups.packed_attention import packed_attention_kernel
    from fastpt.speedups.packing import PackedClassifier

    tokenizer = AutoTokenizer.from_pretrained(str(trained["export"]))
    split = inference.tokenize(tokenizer, [text for text, _ in trained["test_rows"]], None, 24)
    pad, cpu = tokenizer.pad_token_id, torch.device("cpu")

    def model(dtype, packed: bool):
        plain = AutoModelForSequenceClassification.from_pretrained(str(trained["export"]), attn_implementation="sdpa")
        wrapped = PackedClassifier(plain, packed_attention_kernel("cpu", False, True)) if packed else plain
        return wrapped.to(cpu, dtype)

    def linears(m, kind) -> int:
        return sum(type(module) is kind for module in m.modules())

    float32 = model(torch.float32, False)
    assert prepacked.prepack_linears(float32) == 0 and linears(float32, prepacked.PrepackedLinear) == 0
    supported = prepacked.prepacking_pays(cpu, torch.bfloat16)
    for packed in (False, True):
        loader = (inference.packed_prediction_loader(split, 40, pad, 24) if packed
                  else inference.prediction_loader(split, 4, pad, 24))
        reference, fast = model(torch.bfloat16, packed), model(torch.bfloat16, packed)
        count = linears(fast, torch.nn.Linear)
        assert count >= 8 and prepacked.prepack_linears(fast) == (count if supported else 0)
        assert linears(fast, torch.nn.Linear) == (0 if supported else count)
        expected, got = (inference.predict(m, loader, cpu, 24) for m in (reference, fast))
        assert np.array_equal(expected["probabilities"], got["probabilities"]), packed
        assert np.array_equal(expected["predicted"], got["predicted"])
    assert predict(["--model", str(trained["export"]), "--data", str(trained["test_csv"]), "--out",
                    str(trained["root"] / "prepacked.csv"), "--overwrite", "--amp", "bfloat16"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("predicted 31 texts"))
    assert ("linear weights prepacked)" in line) == supported, line
    if not supported:
        pytest.skip("oneDNN has no bfloat16 kernels on this CPU: nothing prepacked, nothing to compare")


def test_packed_predictions_equal_the_padded_ones(trained, capsys):
    """--pack: the same labels and probabilities as padded batches, from an export (streams of at most 40
    tokens: several texts each, several streams) and from a run folder (the default budget); padded, both
    folders give the same file (test_predict_matches_the_pipeline_from_the_export_and_the_run_folder)."""
    names, root = trained["results"]["label_names"], trained["root"]
    files = {}
    for how, source, flags in (("padded", "export", []), ("packed-export", "export", ["--pack", "--pack-tokens", "40"]),
                               ("packed-run", "run", ["--pack"])):
        files[how] = root / f"{how}.csv"
        assert predict(["--model", str(trained[source]), "--data", str(trained["test_csv"]), "--out", str(files[how]),
                        "--batch-size", "4", "--overwrite", *flags]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("predicted 31 texts")]
    assert "| batch 4 |" in lines[0] and "| pack 40 tokens (loop attention) |" in lines[1]
    assert re.search(r"\| pack \d+ tokens \(loop attention\) \|", lines[2]) and "| pack 40 " not in lines[2]
    padded = read_predictions(files["padded"])
    assert len({p["predicted"] for p in padded}) > 1, "one predicted class would make the comparison weak"
    for how in ("packed-export", "packed-run"):
        packed = read_predictions(files[how])
        assert [p["row"] for p in packed] == [str(i) for i in range(31)]
        assert [p["predicted"] for p in packed] == [p["predicted"] for p in padded], how
        assert np.allclose(probabilities(packed, names), probabilities(padded, names), atol=1e-5), how


def test_packed_batches_give_each_text_to_one_rank_in_streams_within_the_budget():
    from fastpt.inputs.data import TokenizedSplit
    from fastpt.loop.inference import packed_batches, token_budget

    lengths = [5, 17, 3, 9, 9, 30, 2, 11, 4]
    split = TokenizedSplit.from_token_lists([[1] * n for n in lengths])
    assert token_budget(split, 2) == round(2 * np.mean(lengths))
    shares = [packed_batches(split, 20, rank, 2) for rank in (0, 1)]
    seen = sorted(i for share in shares for batch in share for i, weight in batch if weight == 1.0)
    assert seen == list(range(len(lengths)))  # every text once, over both ranks
    for share in shares:
        for batch in share:
            assert len(batch) == 1 or sum(lengths[i] for i, _ in batch) <= 20
        order = [lengths[i] for batch in share for i, _ in batch]
        assert order == sorted(order, reverse=True)  # longest first
    assert shares[0][0] == [(5, 1.0)]  # 30 tokens: a stream of its own
    assert packed_batches(split, 20, 9, 10) == [[(6, 0.0)]]  # no text for rank 9: the shortest, weight 0


def test_pack_is_refused_where_training_refuses_it(trained, tmp_path, capsys):
    """An ELECTRA export: packing has no head for it (packing.PACKED_MODELS), one line and nothing written."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from fastpt.inputs.models import load_tokenizer

    folder = tmp_path / "electra"
    config = AutoConfig.for_model("electra", vocab_size=30522, hidden_size=32, embedding_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=64,
                                  id2label=dict(enumerate(trained["results"]["label_names"])))
    AutoModelForSequenceClassification.from_config(config).save_pretrained(folder)
    load_tokenizer("tiny").save_pretrained(folder)
    out = tmp_path / "o.csv"
    assert predict(["--model", str(folder), "--data", str(trained["test_csv"]), "--out", str(out), "--pack"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --pack") and "not electra" in err[0], err
    assert not out.exists()
    assert predict(["--model", str(folder), "--data", str(trained["test_csv"]), "--out", str(out)]) == 0


def bad_cases(t):
    """(flags, the message's part) for bad input; `t` is the trained fixture."""
    return {
        "missing file": (["--data", str(t["root"] / "nope.csv")], "no such file"),
        "unknown column": (["--text-column", "body"], "has no column 'body'"),
        "unknown label column": (["--label-column", "gold"], "has no column 'gold'"),
        "neither folder": (["--model", str(t["root"])], "is neither an export folder"),
        "existing output": (["--out", str(t["root"] / "taken.csv")], "exists; pass --overwrite"),
        "output type": (["--out", str(t["root"] / "p.txt")], "unknown output type .txt"),
        "run without checkpoint": (["--model", str(t["root"] / "empty-run"), "--checkpoint", "last"],
                                   "without checkpoints/last.pt"),
        "pack tokens without pack": (["--pack-tokens", "100"], "--pack-tokens needs --pack"),
        "zero batch size": (["--batch-size", "0"], "--batch-size must be at least 1"),
    }


@pytest.mark.parametrize("case", ["missing file", "unknown column", "unknown label column", "neither folder",
                                  "existing output", "output type", "run without checkpoint",
                                  "pack tokens without pack", "zero batch size"])
def test_bad_input_is_one_line_and_writes_nothing(trained, capsys, case):
    (trained["root"] / "taken.csv").write_text("kept\n")
    (trained["root"] / "empty-run" / "checkpoints").mkdir(parents=True, exist_ok=True)
    extra, message = bad_cases(trained)[case]
    args = {"--model": str(trained["run"]), "--data": str(trained["test_csv"]), "--out": str(trained["root"] / "o.csv")}
    for flag, value in zip(extra[::2], extra[1::2]):
        args[flag] = value
    assert predict([item for pair in args.items() for item in pair]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert not (trained["root"] / "o.csv").exists() and (trained["root"] / "taken.csv").read_text() == "kept\n"


@pytest.mark.slow  # a fresh process per setting: about a minute
def test_bench_predict_times_what_fastpt_predict_runs_and_the_share_of_the_peak(imdb_dir, tmp_path):
    """scripts/bench_predict.py on the tiny model: each fastpt row names the precision attention ran in
    (fastpt-predict's own measured choice under --amp, float32 without), each row the share of the
    measured matmul peak its texts/s reach, and the best against best."""
    table = tmp_path / "predict.md"
    done = subprocess.run([sys.executable, "scripts/bench_predict.py", "--model", "tiny", "--data-dir", str(imdb_dir),
                           "--n", "8", "--max-length", "32", "--pipeline-batch-sizes", "1",
                           "--fastpt-batch-sizes", "4", "--table", str(table)],
                          cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.strip("| ").split(" | ") for line in table.read_text().splitlines()
            if line.startswith(("| pipeline", "| fastpt-predict"))]
    replaced = {"padded, bf16 autocast", "padded, bf16, weights not prepacked"}  # designs --amp replaced
    assert {"float32", "padded", "pack"} <= {row[1] for row in rows} and len(rows) in (3, 8)  # 8: bf16 native
    assert (len(rows) == 8) == (replaced <= {row[1] for row in rows})
    for side, setting, batch, attention, rate, share, ratio in rows:
        expected = {"float32"} if "bf16" not in setting else {"bfloat16", "float32"}
        assert attention in expected, (setting, attention)
        assert float(rate) > 0 and float(share.rstrip("%")) > 0 and ratio.endswith("x")
    assert "of peak: the texts' forward FLOPs on their real tokens" in table.read_text()
    best = re.search(r"Best against best: fastpt-predict \((.+), batch (\d+)\) ([\d.]+) texts/s, pipeline",
                     table.read_text())
    ours = [row for row in rows if row[0] == "fastpt-predict" and row[1] not in replaced]  # what it runs
    assert best and float(best[3]) == max(float(row[4]) for row in ours) and best[1] not in replaced


def test_bench_predict_prepack_pairs_alternate_in_one_process(imdb_dir):
    """scripts/bench_predict.py --prepack-pairs: N pairs' ratios, prepacked over not, and their median, where
    oneDNN has bfloat16 kernels; elsewhere one line saying nothing is prepacked."""
    from fastpt.speedups.prepacked import prepacking_pays

    done = subprocess.run([sys.executable, "scripts/bench_predict.py", "--model", "tiny", "--data-dir", str(imdb_dir),
                           "--n", "8", "--max-length", "32", "--fastpt-batch-sizes", "4", "--prepack-pairs", "3"],
                          cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    import torch
    if not prepacking_pays(torch.device("cpu"), torch.bfloat16):
        assert done.returncode == 1 and "nothing is prepacked" in done.stderr
        return
    assert done.returncode == 0, done.stderr[-2000:]
    found = re.search(r"batch 4: prepacked / not prepacked texts/s, 3 alternating pairs: ([\d., ]+) "
                      r"\(median ([\d.]+)\)", done.stdout)
    ratios = [float(r) for r in found[1].split(", ")]
    assert len(ratios) == 3 and all(r > 0 for r in ratios) and float(found[2]) == sorted(ratios)[1]


@pytest.mark.parametrize("tunables", [None, pytest.param("glibc.malloc.tcache_count=7", marks=pytest.mark.slow)])
def test_predictions_on_a_cpu_keep_freed_memory_unless_malloc_is_the_users(trained, tmp_path, tunables):
    """As training does (speedups/backends.py): a fresh process, as fastpt-predict always is; a user's own
    glibc malloc settings stand."""
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES" and not k.startswith("MALLOC_")}
    env.update({"GLIBC_TUNABLES": tunables} if tunables else {})
    done = subprocess.run([sys.executable, "-m", "fastpt.cli.predict", "--model", str(trained["export"]), "--data",
                           str(trained["test_csv"]), "--out", str(tmp_path / "p.csv")], capture_output=True, text=True,
                          env=env, timeout=300, cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("predicted "))
    kept = "malloc: glibc malloc, freed memory kept (no mmap, no trim)" in line
    assert kept == (tunables is None) and ("malloc: unchanged" in line) == (tunables is not None), line
