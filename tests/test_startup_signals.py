"""SIGTERM or SIGINT before training starts: one line, status 128 + signal, nothing left behind.

Before the loop installs its graceful stop (cluster/signals.py) there is no step to finish:
the command stops at once, removes what the new run wrote (config.json, tb/, its folders, the
lock) and says so; a resumed run's checkpoints stay as they were. Each test sends the real signal to
this process at one point of the start-up.
"""

from __future__ import annotations

import os
import signal

import pytest

from fastpt.cli import run_folder
import fastpt.strategies as strategies_module  # train.py builds the strategy from here
from train import main


def _send_at(monkeypatch, owner, name, signum, after=False):
    """Make owner.name send `signum` to this process (before or after doing its work)."""
    original = getattr(owner, name)

    def wrapped(*args, **kwargs):
        if not after:
            os.kill(os.getpid(), signum)
        result = original(*args, **kwargs)
        if after:
            os.kill(os.getpid(), signum)
        return result

    monkeypatch.setattr(owner, name, wrapped)


def _run(tiny_args, out, capfd, *extra):
    capfd.readouterr()
    try:
        status = main(tiny_args(*extra, out=out))
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped main: a traceback for the user")
    captured = capfd.readouterr()
    text = captured.out + captured.err
    assert "Traceback" not in text, text[-3000:]
    # what the command says, less the libraries' progress bars while a fresh cache is built
    return status, [line for line in text.splitlines() if line.startswith(("stopped", "error"))]


@pytest.mark.parametrize("signum", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)],
                         ids=["SIGTERM", "SIGINT"])  # SIGINT takes the same path (the default set: Ctrl-C's own test)
@pytest.mark.parametrize("where", ["tokenising", "after config.json", "building the strategy"])
def test_a_signal_before_training_leaves_no_run_folder(tiny_args, tmp_path, monkeypatch, capfd, where, signum):
    import datasets

    if where == "tokenising":
        _send_at(monkeypatch, datasets.Dataset, "map", signum)
        extra = ("--cache-dir", str(tmp_path / "fresh-cache"))  # a cache miss: the build runs
    elif where == "after config.json":
        _send_at(monkeypatch, run_folder, "start_out_dir", signum, after=True)
        extra = ()
    else:
        _send_at(monkeypatch, strategies_module, "build_strategy", signum)
        extra = ()
    out = tmp_path / "runs" / "new"
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    status, lines = _run(tiny_args, out, capfd, *extra)
    assert status == 128 + signum
    assert lines == [f"stopped: {signal.Signals(signum).name} before training started; nothing was kept"], lines
    assert not (tmp_path / "runs").exists()  # neither --out, nor the parent it created, nor the lock
    if where == "tokenising":
        cache = tmp_path / "fresh-cache"
        assert not cache.exists() or list(cache.iterdir()) == []  # no half-built cache, no lock file
    # the handlers are what they were before main (Python's own, conftest.py) once it returns
    assert handlers == (signal.default_int_handler, signal.SIG_DFL)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers


def _kept_files(out):
    """The run folder's files less tb/ (a new event file) and config.json (rewritten with the same settings)."""
    return {p.relative_to(out): p.read_bytes() for p in out.rglob("*")
            if p.is_file() and p.relative_to(out).parts[0] != "tb" and p.name != "config.json"}


def test_a_signal_before_a_resumed_run_trains_leaves_its_folder(tiny_args, tmp_path, monkeypatch, capfd):
    out = tmp_path / "run"
    assert main(tiny_args("--max-steps", "3", "--save-every", "3", "--epochs", "3", out=out)) == 0
    before = _kept_files(out)
    _send_at(monkeypatch, strategies_module, "build_strategy", signal.SIGTERM)
    status, lines = _run(tiny_args, out, capfd, "--epochs", "3", "--resume", "auto")
    assert status == 128 + signal.SIGTERM
    assert lines == [f"stopped: SIGTERM before training started; the checkpoints in {out} are as they were: "
                     "--resume auto continues it"], lines
    after = _kept_files(out)
    assert after == before  # results.json and the checkpoints, byte for byte
    monkeypatch.undo()
    assert main(tiny_args("--epochs", "3", "--resume", "auto", out=out)) == 0  # and it continues


def test_a_signal_after_training_started_is_the_graceful_stop(tiny_args, tmp_path, monkeypatch, capfd):
    """From the first step on, the loop's own handler: finish the step, write last.pt, status 3."""
    from fastpt.loop import step

    _send_at(monkeypatch, step, "train_step", signal.SIGTERM, after=True)
    out = tmp_path / "run"
    status, lines = _run(tiny_args, out, capfd)
    assert status == 3, lines
    assert (out / "checkpoints" / "last.pt").is_file() and (out / "config.json").is_file()
