"""What a hostile user and a new user broke: crafted model folders, odd texts, many labels, renamed labels,
tiny class weights, a results.json cut short, a closed terminal, counts checked late, the set-up, the messages.

Each bad input is one line `error: ...` and status 2 with nothing written; each wrong result is compared
with what it should have been.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastpt.cli.predict import main as predict
from test_own_data import rows, write_csv
from train import main as train


ROOT = Path(__file__).resolve().parent.parent


class _RunsCode:
    """Unpickling this creates a file: proof that code from a model folder ran."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _one_error(capsys_or_capfd) -> str:
    err = capsys_or_capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """A tiny DistilBERT export (3 labels) with its tokenizer, and a labelled CSV it can read."""
    from transformers import AutoModelForSequenceClassification

    from fastpt.inputs.models import label_config, load_tokenizer, tiny_config

    root = tmp_path_factory.mktemp("faults")
    config = tiny_config()
    for key, value in label_config(["bad", "good", "meh"]).items():
        setattr(config, key, value)
    torch.manual_seed(0)
    folder = root / "export"
    AutoModelForSequenceClassification.from_config(config).save_pretrained(folder)
    load_tokenizer("tiny").save_pretrained(folder)
    return {"root": root, "folder": folder, "csv": write_csv(root / "texts.csv", rows(60, seed=4))}


def _copy_export(export, tmp_path, name="model") -> Path:
    folder = tmp_path / name
    shutil.copytree(export["folder"], folder)
    return folder


def _predict(folder, data, out, *extra):
    return predict(["--model", str(folder), "--data", str(data), "--out", str(out), *extra])


def _train_on(folder, data, tmp_path, cache_dir, *extra):
    return train(["--model", str(folder), "--data", str(data), "--cache-dir", str(cache_dir), "--max-length", "24",
                  "--batch-size", "4", "--epochs", "1", "--no-progress", "--no-tensorboard", "--out",
                  str(tmp_path / "run"), *extra])


# ---------------------------------------------------------------------------- crafted model folders

def test_a_crafted_bin_beside_a_safetensors_of_another_name_is_refused_in_one_line(export, tmp_path, capsys,
                                                                                   cache_dir):
    """transformers loads pytorch_model.bin unless model.safetensors (or its index) is there: an
    `other.safetensors` beside it changes nothing, so the .bin is what fastpt checks (and refuses)."""
    folder = _copy_export(export, tmp_path)
    (folder / "model.safetensors").rename(folder / "other.safetensors")
    marker = tmp_path / "pickle-ran"
    torch.save({"weight": _RunsCode(marker)}, folder / "pytorch_model.bin")
    out = tmp_path / "p.csv"
    assert _predict(folder, export["csv"], out) == 2
    assert "pytorch_model.bin holds objects other than tensors" in _one_error(capsys)
    assert _train_on(folder, export["csv"], tmp_path, cache_dir) == 2
    assert "pytorch_model.bin holds objects other than tensors" in _one_error(capsys)
    assert not marker.exists() and not out.exists() and not (tmp_path / "run").exists()


def test_a_bin_that_transformers_never_reads_is_left_alone(export, tmp_path, capsys):
    """model.safetensors is what transformers loads: a pytorch_model.bin beside it is never unpickled."""
    folder = _copy_export(export, tmp_path)
    marker = tmp_path / "pickle-ran"
    torch.save({"weight": _RunsCode(marker)}, folder / "pytorch_model.bin")
    assert _predict(folder, export["csv"], tmp_path / "p.csv") == 0
    assert not marker.exists()


def _with_config(folder: Path, **changes) -> Path:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return folder


@pytest.mark.parametrize("vocab_size", [10 ** 9, 40000], ids=["1e9", "40000"])
def test_a_config_larger_than_its_weights_is_refused_before_allocating(vocab_size, export, tmp_path, capsys,
                                                                       cache_dir):
    """config.json's vocab_size against the word embeddings the weights hold (safetensors headers give the
    shapes without loading): 1e9 would allocate 256 GB, 40000 fails inside transformers."""
    folder = _with_config(_copy_export(export, tmp_path), vocab_size=vocab_size)
    out = tmp_path / "p.csv"
    assert _predict(folder, export["csv"], out) == 2
    line = _one_error(capsys)
    assert "config.json" in line and str(vocab_size) in line, line
    assert _train_on(folder, export["csv"], tmp_path, cache_dir) == 2
    line = _one_error(capsys)
    assert "config.json" in line and str(vocab_size) in line, line
    assert not out.exists() and not (tmp_path / "run").exists()


def test_a_random_init_config_larger_than_memory_is_refused(export, tmp_path, capsys, cache_dir):
    """--random-init reads no weights: the config's own size against this machine's memory."""
    folder = _with_config(_copy_export(export, tmp_path), vocab_size=10 ** 12)
    assert _train_on(folder, export["csv"], tmp_path, cache_dir, "--random-init") == 2
    line = _one_error(capsys)
    assert "config.json" in line and "memory" in line, line
    assert not (tmp_path / "run").exists()


def test_a_layer_count_the_weights_lack_is_refused(export, tmp_path, capsys):
    folder = _with_config(_copy_export(export, tmp_path), n_layers=5)
    assert _predict(folder, export["csv"], tmp_path / "p.csv") == 2
    line = _one_error(capsys)
    assert "config.json" in line and "layer" in line, line


# ---------------------------------------------------------------------------- predict's own bad input

def test_predict_out_naming_a_folder_is_one_line_even_with_overwrite(export, tmp_path, capsys):
    out = tmp_path / "taken.csv"
    (out / "inside").mkdir(parents=True)
    assert _predict(export["folder"], export["csv"], out, "--overwrite") == 2
    assert "is a folder" in _one_error(capsys)
    assert (out / "inside").is_dir()


def test_a_lone_surrogate_is_refused_in_one_line_by_predict_and_train(export, tmp_path, capsys, cache_dir):
    """Valid JSON ("\\ud800"), no valid text: both commands name the row."""
    data = tmp_path / "texts.jsonl"
    lines = [json.dumps({"text": text, "label": label}) for text, label in rows(60)]
    lines[3] = '{"text": "broken \\ud800 text", "label": "good"}'
    data.write_text("\n".join(lines) + "\n")
    out = tmp_path / "p.csv"
    assert _predict(export["folder"], data, out) == 2
    predict_line = _one_error(capsys)
    assert "line 4" in predict_line and "surrogate" in predict_line, predict_line
    assert _train_on(export["folder"], data, tmp_path, cache_dir) == 2
    train_line = _one_error(capsys)
    assert "line 4" in train_line and "surrogate" in train_line, train_line
    assert not out.exists() and not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------- labels and weights checked early

def _integer_csv(path: Path, n: int, classes: int = 2) -> Path:
    words = ["broken rotten", "lovely bright", "plain grey"]
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(("text", "label"))
        for i in range(n):
            writer.writerow((f"the box {words[i % classes]} cup", i % classes))
    return path


@pytest.fixture
def never_tokenised(monkeypatch):
    """Bad input that the header and the label column show stops before any text is tokenised."""
    import datasets

    def refuse(*args, **kwargs):
        raise AssertionError("tokenised before refusing")

    monkeypatch.setattr(datasets.Dataset, "map", refuse)


def _own_run(data, tmp_path, *extra):
    return train(["--model", "tiny", "--data", str(data), "--cache-dir", str(tmp_path / "cache"), "--max-length",
                  "16", "--batch-size", "8", "--epochs", "1", "--max-steps", "1", "--no-progress",
                  "--no-tensorboard", "--out", str(tmp_path / "run"), *extra])


@pytest.mark.parametrize("flags,says", [
    (["--label-names", "neg,pos,other"], "--label-names gives 3 name(s), the data has 2 labels (0, 1)"),
    (["--class-weights", "1,2,3"], "--class-weights gives 3 weight(s), the data has 2 classes"),
], ids=["label names", "class weights"])
def test_a_wrong_count_is_refused_before_tokenising_and_leaves_no_cache(flags, says, tmp_path, capfd,
                                                                        never_tokenised):
    data = _integer_csv(tmp_path / "ints.csv", 40)
    capfd.readouterr()
    assert _own_run(data, tmp_path, *flags) == 2
    assert says in _one_error(capfd)
    cache = tmp_path / "cache"
    assert not cache.exists() or not any(cache.rglob("*")), sorted(cache.rglob("*"))
    assert not (tmp_path / "run").exists()


def test_imdb_class_weights_are_counted_before_the_data_is_read(tiny_args, tmp_path, capfd, never_tokenised):
    capfd.readouterr()
    assert train(tiny_args("--class-weights", "1,2,3", "--cache-dir", str(tmp_path / "cache"))) == 2
    assert "--class-weights gives 3 weight(s), the data has 2 classes" in _one_error(capfd)
    assert not (tmp_path / "cache").exists()


def test_thousands_of_labels_are_refused_before_tokenising(tmp_path, capfd, never_tokenised):
    """10,000 labels made evaluation's confusion matrix exhaust the memory; more than MAX_LABELS is refused."""
    from fastpt.inputs.columns import MAX_LABELS

    data = tmp_path / "many.csv"
    labels = MAX_LABELS + 1
    data.write_text("text,label\n" + "".join(f"text number {i},id{i % labels}\n" for i in range(10 * labels)))
    capfd.readouterr()
    assert _own_run(data, tmp_path) == 2
    assert f"has {labels:,} distinct labels; a run takes at most {MAX_LABELS:,}" in _one_error(capfd)
    assert not (tmp_path / "run").exists() and not any((tmp_path / "cache").rglob("data-*"))


@pytest.mark.parametrize("weights,says", [("1e-320,1,1", "1e-320 is 0 or subnormal in float32"),
                                          ("1e-40,1,1", "1e-40 is 0 or subnormal in float32"),
                                          ("1,1e39,1", "1e39 is inf in float32")])
def test_class_weights_are_checked_as_the_float32_loss_sees_them(weights, says, tmp_path, capfd, never_tokenised):
    data = _integer_csv(tmp_path / "ints.csv", 60, classes=3)
    capfd.readouterr()
    assert _own_run(data, tmp_path, "--class-weights", weights) == 2
    line = _one_error(capfd)
    assert line.startswith("error: --class-weights") and says in line, line
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------- --label-names end to end

def _read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_label_names_keep_predictions_csv_whole_and_predict_reads_integer_labels(tmp_path, cache_dir, capsys):
    """SST-2's way: integer labels named with --label-names. predictions.csv keeps its row and text columns
    with no note, and fastpt-predict scores the same integer-labelled file on the run folder and on the export,
    mapping 0 and 1 to the names as training did."""
    train_csv = _integer_csv(tmp_path / "train.csv", 60)
    test_rows = [(f"the box {'lovely bright' if i % 3 else 'broken rotten'} lamp {i}", int(i % 3 > 0))
                 for i in range(14)]
    test_csv = write_csv(tmp_path / "dev.csv", test_rows, header=("sentence", "label"))
    run, export = tmp_path / "run", tmp_path / "export"
    assert train(["--model", "tiny", "--data", str(train_csv), "--test-data", str(test_csv), "--text-column",
                  "text,sentence", "--label-names", "negative,positive", "--cache-dir", str(cache_dir),
                  "--max-length", "16", "--batch-size", "8", "--epochs", "2", "--lr", "3e-3", "--no-progress",
                  "--no-tensorboard", "--out", str(run), "--export-dir", str(export)]) == 0
    captured = capsys.readouterr()
    assert "note: predictions.csv" not in captured.out + captured.err
    written = _read_csv(run / "predictions.csv")
    names = ["negative", "positive"]
    assert list(written[0]) == ["row", "text", "label", "predicted", *[f"prob_{n}" for n in names]]
    assert [(int(p["row"]), p["text"], p["label"]) for p in written] == [
        (i, text, names[label]) for i, (text, label) in enumerate(test_rows)]
    for source in (run, export):
        out = tmp_path / f"from-{source.name}.csv"
        assert predict(["--model", str(source), "--data", str(test_csv), "--out", str(out),
                        "--text-column", "sentence"]) == 0, capsys.readouterr().err
        assert "evaluation: accuracy" in capsys.readouterr().out
        predicted = _read_csv(out)
        assert [p["label"] for p in predicted] == [p["label"] for p in written]
        assert [p["predicted"] for p in predicted] == [p["predicted"] for p in written]


# ---------------------------------------------------------------------------- SIGHUP

@pytest.fixture
def hangup_handler():
    """SIGHUP handled by a stand-in while the test runs (a run that failed to take it over must not kill the
    test process), and put back after."""
    before = signal.getsignal(signal.SIGHUP)
    received = []
    signal.signal(signal.SIGHUP, lambda signum, frame: received.append(signum))
    yield received
    signal.signal(signal.SIGHUP, before)


def _hangup_at(monkeypatch, owner, name, after=True):
    original = getattr(owner, name)

    def wrapped(*args, **kwargs):
        if not after:
            os.kill(os.getpid(), signal.SIGHUP)
        result = original(*args, **kwargs)
        if after:
            os.kill(os.getpid(), signal.SIGHUP)
        return result

    monkeypatch.setattr(owner, name, wrapped)


def _said(capfd) -> list[str]:
    captured = capfd.readouterr()
    text = captured.out + captured.err
    assert "Traceback" not in text, text[-3000:]
    return [line for line in text.splitlines() if line.startswith(("stopped", "error"))]


def test_sighup_during_training_saves_last_pt_and_exits_3(tiny_args, tmp_path, monkeypatch, capfd, hangup_handler):
    from fastpt.loop import step

    _hangup_at(monkeypatch, step, "train_step")
    out = tmp_path / "run"
    capfd.readouterr()
    assert train(tiny_args(out=out)) == 3
    lines = _said(capfd)
    assert len(lines) == 1 and lines[0].startswith("stopped: SIGHUP at step 1") and "--resume auto" in lines[0], lines
    assert (out / "checkpoints" / "last.pt").is_file() and not (out / ".lock").exists()
    assert not [p for p in out.rglob("*.tmp")]
    assert hangup_handler == []  # the run's own handler took it, and put the stand-in back after
    assert signal.getsignal(signal.SIGHUP) is not signal.SIG_DFL


def test_sighup_before_training_leaves_nothing(tiny_args, tmp_path, monkeypatch, capfd, hangup_handler):
    import datasets

    _hangup_at(monkeypatch, datasets.Dataset, "map", after=False)
    out = tmp_path / "runs" / "new"
    capfd.readouterr()
    assert train(tiny_args("--cache-dir", str(tmp_path / "fresh-cache"), out=out)) == 128 + signal.SIGHUP
    assert _said(capfd) == ["stopped: SIGHUP before training started; nothing was kept"]
    assert not (tmp_path / "runs").exists()


def test_a_run_started_under_nohup_keeps_running(tiny_args, tmp_path, monkeypatch, capfd):
    from fastpt.loop import step

    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # what nohup does before it starts the command
    try:
        _hangup_at(monkeypatch, step, "train_step")
        out = tmp_path / "run"
        assert train(tiny_args("--epochs", "1", out=out)) == 0
        assert (out / "results.json").is_file()
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before)


def test_sighup_as_the_requeue_signal_is_held_until_the_first_step(tiny_args, tmp_path, monkeypatch, capfd,
                                                                   hangup_handler):
    """--requeue-signal HUP: a warning, never an interruption; without SLURM the run stops at its first step."""
    import datasets

    _hangup_at(monkeypatch, datasets.Dataset, "map", after=False)
    out = tmp_path / "run"
    capfd.readouterr()
    assert train(tiny_args("--requeue-signal", "HUP", "--cache-dir", str(tmp_path / "fresh-cache"), out=out)) == 3
    lines = _said(capfd)
    assert len(lines) == 1 and lines[0].startswith("stopped: SIGHUP at step 1"), lines
    assert (out / "checkpoints" / "last.pt").is_file()


@pytest.mark.slow
def test_a_closed_terminal_stops_the_run_gracefully(imdb_dir, cache_dir, tmp_path):
    """The real thing: the run's controlling terminal hangs up mid-training (a pseudo-terminal whose other
    end closes, as when ssh drops). last.pt is written, the lock is gone, status 3."""
    import fcntl
    import pty
    import select
    import termios

    master, slave = pty.openpty()
    out = tmp_path / "run"
    command = [sys.executable, str(ROOT / "train.py"), "--model", "tiny", "--data-dir", str(imdb_dir), "--cache-dir",
               str(cache_dir), "--max-length", "32", "--batch-size", "8", "--epochs", "30", "--log-every", "1",
               "--no-progress", "--no-tensorboard", "--out", str(out)]
    child = subprocess.Popen(command, stdin=slave, stdout=slave, stderr=slave, cwd=ROOT, start_new_session=True,
                             preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),
                             env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    os.close(slave)
    seen = b""
    try:
        while b"step 3" not in seen:  # training has started: the terminal goes away now
            ready, _, _ = select.select([master], [], [], 120)
            assert ready, seen.decode(errors="replace")[-2000:]
            try:
                seen += os.read(master, 4096)
            except OSError:
                break
    finally:
        os.close(master)
    assert child.wait(timeout=120) == 3, seen.decode(errors="replace")[-2000:]
    assert (out / "checkpoints" / "last.pt").is_file() and not (out / ".lock").exists()
    assert not [p for p in out.rglob("*.tmp")] and not (out / "results.json").exists()


# ---------------------------------------------------------------------------- a results.json cut short

def _files(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("last_pt", [True, False], ids=["with last.pt", "without last.pt"])
def test_a_results_json_cut_short_is_said_and_nothing_is_removed(last_pt, tiny_args, tmp_path, capfd):
    out = tmp_path / "run"
    assert train(tiny_args("--epochs", "1", "--no-tensorboard", *(["--save-every", "7"] if last_pt else []),
                           out=out)) == 0
    results = out / "results.json"
    results.write_bytes(results.read_bytes()[: results.stat().st_size // 2])
    before = _files(out)
    capfd.readouterr()
    assert train(tiny_args("--epochs", "1", "--no-tensorboard", "--resume", "auto",
                           *(["--save-every", "7"] if last_pt else []), out=out)) == 2
    line = _one_error(capfd)
    assert "results.json" in line and "--overwrite" in line, line
    assert _files(out) == before


# ---------------------------------------------------------------------------- what a new user read

@pytest.fixture
def sst2_files(tmp_path):
    """SST-2's layout: `sentence` in train.tsv, `content` in dev.tsv."""
    train_tsv = write_csv(tmp_path / "train.tsv", rows(60), header=("sentence", "label"), delimiter="\t")
    dev_tsv = write_csv(tmp_path / "dev.tsv", rows(12, seed=1), header=("content", "label"), delimiter="\t")
    return train_tsv, dev_tsv


def _sst2_run(train_tsv, dev_tsv, tmp_path, *extra):
    return train(["--model", "tiny", "--data", str(train_tsv), "--val-data", str(dev_tsv), "--cache-dir",
                  str(tmp_path / "cache"), "--max-length", "16", "--epochs", "1", "--no-progress", "--no-tensorboard",
                  "--out", str(tmp_path / "run"), *extra])


def test_the_first_missing_column_error_gives_the_per_file_form(sst2_files, tmp_path, capfd):
    capfd.readouterr()
    assert _sst2_run(*sst2_files, tmp_path) == 2
    line = _one_error(capfd)
    assert line.endswith("; say which, one name per file (each uses the one it has): --text-column sentence,content")
    assert f"{sst2_files[0]} has no column 'text' (--text-column)" in line, line


def test_a_misspelt_column_is_not_suggested_again(sst2_files, tmp_path, capfd):
    capfd.readouterr()
    assert _sst2_run(*sst2_files, tmp_path, "--text-column", "sentence,contnet") == 2
    line = _one_error(capfd)
    advice = line.split("; ")[-1]
    assert advice == "where files name it differently, list the names: --text-column sentence,content", line


def test_predict_on_an_export_shows_no_loading_bar_without_verbose(export, tmp_path, capfd):
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()  # as in a fresh process: an earlier test may have turned it off
    try:
        capfd.readouterr()
        assert _predict(export["folder"], export["csv"], tmp_path / "quiet.csv") == 0
        assert "Loading weights" not in capfd.readouterr().err
    finally:
        (hf_logging.enable_progress_bar if was_enabled else hf_logging.disable_progress_bar)()


# ---------------------------------------------------------------------------- the set-up

def test_the_setup_installs_both_commands_editable(tmp_path):
    """scripts/setup.sh (what the README's two commands run first) gives the venv fastpt-train and
    fastpt-predict, running the checkout's code as it changes. Offline and without torch: the runtime's
    stamp says it is installed already, the build backend comes from the test environment."""
    source = tmp_path / "src"
    (source / "scripts").mkdir(parents=True)
    for name in ("fastpt", "train.py", "pyproject.toml", "README.md", "requirements.txt", "scripts/setup.sh"):
        (shutil.copytree if (ROOT / name).is_dir() else shutil.copy)(ROOT / name, source / name)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items() if k not in ("FASTPT_TORCH", "PYTHONPATH")}
    runtime = subprocess.run(["bash", "-c", 'cat requirements.txt; echo "torch==2.13.0"'], cwd=source,
                             capture_output=True, text=True, check=True).stdout.rstrip("\n")
    (venv / ".fastpt-installed").write_text(runtime)  # setup.sh's stamp: torch and requirements.txt are in
    site = next(p for p in sys.path if p.endswith("site-packages"))
    setup = subprocess.run(["bash", "scripts/setup.sh"], cwd=source, capture_output=True, text=True, timeout=300,
                           env={**env, "FASTPT_VENV": str(venv), "PIP_NO_INDEX": "1", "PIP_NO_BUILD_ISOLATION": "0",
                                "PYTHONPATH": site})
    assert setup.returncode == 0, setup.stdout + setup.stderr

    def help_of(command: str) -> str:
        proc = subprocess.run([str(venv / "bin" / command), "--help"], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    assert "--deepspeed" in help_of("fastpt-train") and "--checkpoint" in help_of("fastpt-predict")
    predict_py = source / "fastpt" / "cli" / "predict.py"
    predict_py.write_text(predict_py.read_text().replace("Predict labels for new texts", "Label new texts"))
    assert "Label new texts" in help_of("fastpt-predict")  # the checkout's code, as changed
