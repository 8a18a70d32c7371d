"""What a new user meets first: installing, --help, an offline machine, the notes a run prints,
the config.json it leaves and what TensorBoard shows."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from fastpt.cli.shell import EXIT_BAD_INPUT
from train import main


ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------- --help

def _help_entries(text: str) -> dict[str, str]:
    """{'--flag': its help text on one line} from argparse's output."""
    entries, current = {}, None
    for line in text.splitlines():
        match = re.match(r"  (-\S+)", line)
        if match:
            current = match.group(1).rstrip(",")
            entries[current] = line
        elif current and line.startswith("    "):
            entries[current] += " " + line.strip()
        else:
            current = None
    return {flag: " ".join(entry.split()) for flag, entry in entries.items()}


def imported(importtime: str) -> set[str]:
    """The modules `python -X importtime` reports, from its stderr."""
    return {line.split("|")[-1].strip() for line in importtime.splitlines() if line.startswith("import time:")}


@pytest.mark.parametrize("command", [["train.py"], ["-m", "fastpt"]], ids=["train.py", "python -m fastpt"])
def test_help_answers_without_torch_and_shows_every_default_once(command):
    """--help answers at once because it imports neither torch nor transformers (their import is what
    takes seconds), whatever the machine's speed."""
    proc = subprocess.run([sys.executable, "-X", "importtime", *command, "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    modules = imported(proc.stderr)
    assert "argparse" in modules and not modules & {"torch", "transformers", "numpy"}, sorted(modules)
    entries = _help_entries(proc.stdout)
    for flag, default in (("--max-length", "512"), ("--lr", "5e-05"), ("--epochs", "3"), ("--amp-dtype", "float16"),
                          ("--zero-stage", "2"), ("--monitor-metric", "val_acc"), ("--log-every", "50"),
                          ("--batch-size", "12")):
        assert entries[flag].count("(default") == 1 and f"(default: {default})" in entries[flag], entries[flag]
    for flag, entry in entries.items():
        assert entry.count("(default") <= 1, entry
        assert "(default: None)" not in entry and "(default: True)" not in entry, entry
    assert "default" not in entries["--no-progress"]


def test_parsing_imports_neither_torch_nor_transformers():
    code = ("import sys; from train import main; assert main(['--lr', '-1']) == 2; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "[]", proc.stdout + proc.stderr


# ---------------------------------------------------------------------------- installing

def requirement_lines(name: str) -> list[str]:
    lines = (ROOT / name).read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def test_requirements_match_pyproject():
    """requirements.txt is the runtime; the extras are optional for a user, installed for the tests."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert requirement_lines("requirements.txt") == project["dependencies"]
    extras = project["optional-dependencies"]
    assert requirement_lines("requirements-peers.txt") == extras["peers"]
    dev = requirement_lines("requirements-dev.txt")
    assert set(extras["deepspeed"]) <= set(dev) and "-r requirements-peers.txt" in dev
    runtime = " ".join(project["dependencies"])
    assert "deepspeed" not in runtime and "accelerate" not in runtime and "lightning" not in runtime


def test_the_installed_packages_are_every_folder():
    """pyproject.toml lists fastpt's folders by hand (train.py is mapped into fastpt.start): none left out."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {"fastpt"} | {f"fastpt.{p.name}" for p in (ROOT / "fastpt").iterdir() if (p / "__init__.py").exists()}
    assert set(setuptools["packages"]) == folders | {"fastpt.start"}
    assert setuptools["package-dir"] == {"fastpt.start": "."}
    assert [p.name for p in ROOT.glob("*.py")] == ["train.py"], "every top-level .py file goes into fastpt/start"


def test_fresh_install_has_both_entry_points(tmp_path):
    """pip install into an empty venv (offline: no dependencies, the build backend from the test env);
    fastpt-predict is installed beside them."""
    source = tmp_path / "src"
    source.mkdir()
    for name in ("fastpt", "train.py", "pyproject.toml", "README.md"):
        (shutil.copytree if (ROOT / name).is_dir() else shutil.copy)(ROOT / name, source / name)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = next(p for p in sys.path if p.endswith("site-packages"))  # setuptools for the build
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                              "--no-deps", "--no-build-isolation", "--no-index", str(source)],
                             env={**os.environ, "PYTHONPATH": site}, capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stdout + install.stderr
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for command in ([str(venv / "bin" / "fastpt-train"), "--help"],
                    [str(venv / "bin" / "python"), "-m", "fastpt", "--help"]):
        proc = subprocess.run(command, cwd=tmp_path, env=clean, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0 and "--deepspeed" in proc.stdout, proc.stderr
    proc = subprocess.run([str(venv / "bin" / "fastpt-predict"), "--help"], cwd=tmp_path, env=clean,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "--checkpoint" in proc.stdout, proc.stderr
    where = subprocess.run([str(venv / "bin" / "python"), "-c",
                            "import importlib.util, fastpt, fastpt.start.train as t; "
                            "print(fastpt.__file__, t.__file__, importlib.util.find_spec('train'))"],
                           cwd=tmp_path, env=clean, capture_output=True, text=True, timeout=60)
    package, entry, top_level_train = where.stdout.split()
    assert package.startswith(str(venv)) and entry.startswith(str(venv)), where.stdout + where.stderr  # installed
    assert top_level_train == "None", "pip install . must not put a module named train into site-packages"


# ---------------------------------------------------------------------------- offline

@pytest.fixture
def no_network(monkeypatch):
    """A machine with no route to the Hub, and nobody has set HF_HUB_OFFLINE."""
    import socket

    from huggingface_hub import constants

    from fastpt.inputs import models

    attempts = []  # the timeout of each connection tried

    def unreachable(*args, **kwargs):
        attempts.append(kwargs.get("timeout", args[1] if len(args) > 1 else None))
        raise OSError("Network is unreachable")

    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(socket, "create_connection", unreachable)
    monkeypatch.setattr(socket.socket, "connect", unreachable)
    forget = getattr(getattr(models, "hub_offline", None), "cache_clear", lambda: None)
    forget()  # an earlier test may have found the Hub (un)reachable
    yield attempts
    forget()


@pytest.mark.parametrize("model", ["no-such-user/no-such-model", "distilbert-base-uncased"])
def test_offline_fails_at_once_with_one_actionable_line(model, no_network, tiny_args, tmp_path, capfd):
    capfd.readouterr()
    status = main(tiny_args("--model", model))
    captured = capfd.readouterr()
    if model == "distilbert-base-uncased" and status == 0:
        pytest.skip("distilbert-base-uncased is in the local Hugging Face cache")
    assert status == EXIT_BAD_INPUT
    lines = (captured.out + captured.err).strip().splitlines()
    assert len(lines) == 1, lines
    assert "offline" in lines[0] and "--random-init" in lines[0] and "--model minilm" in lines[0], lines[0]
    # At once: one connection tried, with a short timeout, then offline mode (no retries, no waits)
    assert len(no_network) == 1 and no_network[0] is not None and no_network[0] <= 2, no_network
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------- what a run says and saves

def test_notes_and_resolved_config(imdb_dir, cache_dir, tmp_path, monkeypatch, capfd):
    """Sizes larger than the split, --resume auto with nothing to resume, emulated bfloat16: one line each;
    config.json holds the values the run used, with absolute paths."""
    import torch

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")  # no native bfloat16
    monkeypatch.chdir(imdb_dir.parent)
    out = tmp_path / "new-run"
    capfd.readouterr()
    assert main(["--model", "tiny", "--data-dir", imdb_dir.name, "--cache-dir", str(cache_dir), "--max-length", "32",
                 "--batch-size", "16", "--epochs", "1", "--train-size", "1000", "--test-size", "500",
                 "--amp", "--amp-dtype", "bfloat16", "--no-progress", "--no-tensorboard",
                 "--resume", "auto", "--out", os.path.relpath(out)]) == 0
    notes = [line for line in capfd.readouterr().err.splitlines() if line.startswith("note:")]
    assert notes == [
        f"note: no checkpoint in {os.path.relpath(out)} to resume; starting a new run",
        f"note: the data in {imdb_dir} holds 160 reviews (50% positive), not IMDB's 50,000: they are split "
        "70/10/20 in proportion, not into the article's 35,000/5,000/10,000",
        "note: --train-size 1000 is more than the train split has; using all 112",
        "note: --test-size 500 is more than the test split has; using all 32",
        "note: this CPU has no native bfloat16 (no AVX512-BF16 or AMX): --amp-dtype bfloat16 is emulated here "
        "and slower than float32",
    ]
    saved = json.loads((out / "config.json").read_text())
    assert saved["out"] == str(out) and saved["data_dir"] == str(imdb_dir) and saved["cache_dir"] == str(cache_dir)
    assert (saved["num_workers"], saved["pin_memory"], saved["fused_adam"]) == (0, False, False)


def test_library_messages_stay_quiet_unless_verbose(tiny_args, capfd):
    """MiniLM's load report (coloured, from transformers) shows only with --verbose."""
    from fastpt.cli import shell

    shell.quiet_libraries(verbose=False)
    capfd.readouterr()
    from fastpt.inputs.models import load_model
    load_model("minilm", False)
    captured = capfd.readouterr()
    assert "LOAD REPORT" not in captured.out + captured.err and "\x1b[" not in captured.out + captured.err


def test_tensorboard_layout_and_applicable_hparams(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2

    from fastpt.config import TrainConfig
    from fastpt.monitoring.tracking import Tracker, applicable_hparams

    plain = applicable_hparams(TrainConfig().to_dict())
    for unused in ("amp_dtype", "compile_mode", "zero_stage", "bucket_multiplier", "fsdp_reshard_after_forward",
                   "min_delta", "deepspeed_config"):
        assert unused not in plain, unused
    assert applicable_hparams(TrainConfig(amp=True, amp_dtype="bfloat16").to_dict())["amp_dtype"] == "bfloat16"
    assert applicable_hparams(TrainConfig(strategy="deepspeed", zero_stage=3).to_dict())["zero_stage"] == 3

    tracker = Tracker(tmp_path, progress=False, tensorboard=True)
    tracker.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    stored = events.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0]
    layout = layout_pb2.Layout.FromString(stored)
    charts = {chart.title: list(chart.multiline.tag) for category in layout.category for chart in category.chart}
    assert charts == {"loss": ["train/loss", "epoch/train_loss", "epoch/val_loss"],
                      "accuracy": ["epoch/train_acc", "epoch/val_acc"], "macro-F1": ["epoch/val_macro_f1"],
                      "f1": ["val_f1/.*"], "precision": ["val_precision/.*"], "recall": ["val_recall/.*"]}


@pytest.mark.parametrize("capability,avx512_bf16,amx,native", [
    ("AVX2", True, True, False),  # torch's kernels are the AVX2 ones: bfloat16 is emulated whatever the flags
    ("AVX512", False, False, False),
    ("AVX512", True, False, True),
    ("AMX", False, True, True),
], ids=["avx2", "avx512-no-bf16", "avx512-bf16", "amx"])
def test_native_bfloat16_is_decided_by_the_cpu_capability(monkeypatch, capability, avx512_bf16, amx, native):
    """Either answer on any machine: the capability is forced, not read from the CPU the suite runs on."""
    import torch

    from fastpt.cli.preflight import cpu_has_native_bfloat16

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    assert cpu_has_native_bfloat16() is native
