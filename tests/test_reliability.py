"""Reliability: a killed, crashed or stopped run resumes to exactly the uninterrupted result.

Every resume test compares against a reference: the same flags run without interruption, in
deterministic fp32 (or fp16 AMP) on the CPU with one thread, so equality is bitwise: weights,
optimiser and GradScaler state, history, test metrics and TensorBoard curves.
The faults are injected by tests/faults/inject.py at a step chosen at random (printed, and
fixed with FASTPT_FAULT_SEED=N to replay a failure).
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import fastpt_frames, wait_all

from fastpt.cli.shell import EXIT_BAD_INPUT
from fastpt.files import checkpoint
from fastpt.errors import EXIT_STOPPED
from train import main


ROOT = Path(__file__).resolve().parent.parent
INJECT = ROOT / "tests" / "faults" / "inject.py"
TIMING_KEYS = {"train_time_s", "first_step_s", "samples_per_s", "tokens_per_s", "padded_tokens_per_s",
               "data_wait_share", "mfu", "peak_memory_bytes", "padding_efficiency", "val_time_s",
               "train_time_no_compile_s", "compile_time_s", "compile_torch_s", "val_time_no_compile_s",
               # what this process measured and saw: a resumed process saw only the steps after the resume
               "samples_per_s_note", "batch_shapes",
               # the measured matmul peak (MFU's denominator): measured once, then read from the cache
               "peak_flops_per_s", "peak_source", "peak_probe"}
STEPS_PER_EPOCH = 6  # 48 training examples, batch 8
EPOCHS = 2

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_thread")]  # one thread, as the subprocesses


def fault_rng() -> random.Random:
    seed = int(os.environ.get("FASTPT_FAULT_SEED", random.SystemRandom().randrange(1 << 30)))  # runs reseed `random`
    print(f"FASTPT_FAULT_SEED={seed}")
    return random.Random(seed)


def flags(imdb_dir, cache_dir, out: Path, *extra: str) -> list[str]:
    return ["--model", "tiny", "--data-dir", str(imdb_dir), "--cache-dir", str(cache_dir),
            "--max-length", "32", "--batch-size", "8", "--train-size", "48", "--epochs", str(EPOCHS),
            "--log-every", "2", "--save-every", "3", "--deterministic", "--no-progress", "--out", str(out), *extra]


def env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "PYTHONPATH": str(ROOT)}


def inject(fault: list[str], args: list[str], torchrun: int = 0) -> subprocess.CompletedProcess:
    launcher = ([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={torchrun}", "--standalone"]
                if torchrun else [sys.executable])
    return subprocess.run([*launcher, str(INJECT), *fault, "--", *args], env=env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=240)


# ---------------------------------------------------------------------------- comparing runs

def assert_equal_tree(a, b, where: str = "") -> None:
    """Bitwise equality of nested checkpoints (tensors compared exactly, NaN-safe)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(_bytes(a), _bytes(b)), f"tensors differ at {where}"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"keys differ at {where}: {a.keys() ^ b.keys()}"
        for k in a:
            assert_equal_tree(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_equal_tree(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)  # bitwise, and NaN equals NaN


def results(run: Path) -> dict:
    import json
    data = json.loads((run / "results.json").read_text())
    data["history"] = [{k: v for k, v in row.items() if k not in TIMING_KEYS} for row in data["history"]]
    return {k: v for k, v in data.items() if k not in TIMING_KEYS}


def tensorboard_curves(run: Path) -> dict:
    """Every training and epoch scalar as [(step, value)], as TensorBoard shows it after purging."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    keep = [t for t in acc.Tags()["scalars"]
            if t in ("train/loss", "test/test_acc", "test/test_loss")
            or (t.startswith("epoch/") and t.split("/")[1] not in TIMING_KEYS)]
    # Sorted by step, as TensorBoard plots them: two event files written within the same second
    # are read in pid order, which says nothing about the run. Duplicated steps still show.
    return {t: sorted((e.step, e.value) for e in acc.Scalars(t)) for t in keep}


def assert_same_run(reference: Path, resumed: Path) -> None:
    assert results(resumed) == results(reference)
    assert_equal_tree(checkpoint.load(reference / "checkpoints" / "best.pt")["model"],
                      checkpoint.load(resumed / "checkpoints" / "best.pt")["model"], "best.pt")
    ref_last = checkpoint.load(reference / "checkpoints" / "last.pt")
    res_last = checkpoint.load(resumed / "checkpoints" / "last.pt")
    assert_equal_tree(ref_last["training"], res_last["training"], "last.pt/training")  # weights, Adam, scaler
    assert_equal_tree(ref_last["per_rank"], res_last["per_rank"], "last.pt/per_rank")  # RNG states
    ref_curves, res_curves = tensorboard_curves(reference), tensorboard_curves(resumed)
    assert res_curves == ref_curves
    for tag, points in res_curves.items():
        steps = [s for s, _ in points]
        assert len(steps) == len(set(steps)), f"duplicate steps in {tag}: {steps}"


def checkpoint_step(run: Path) -> int:
    return checkpoint.load(run / "checkpoints" / "last.pt")["progress"]["global_step"]


@pytest.fixture(scope="module")
def reference(imdb_dir, cache_dir, tmp_path_factory) -> Path:
    """The uninterrupted single-process run every single-process fault is compared with."""
    out = tmp_path_factory.mktemp("reference") / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(flags(imdb_dir, cache_dir, out)) == 0
    finally:
        torch.set_num_threads(threads)
    return out


# ---------------------------------------------------------------------------- resume equivalence

def test_sigkill_at_random_step_resumes_bitwise(reference, imdb_dir, cache_dir, tmp_path):
    out = tmp_path / "run"
    total = STEPS_PER_EPOCH * EPOCHS
    kill_step = fault_rng().randint(2, total)
    died = inject(["kill-at-step", str(kill_step)], flags(imdb_dir, cache_dir, out))
    assert died.returncode == -signal.SIGKILL, died.stderr[-2000:]
    assert not (out / "results.json").exists()
    saved = (kill_step - 1) // 3 * 3  # the last multiple of --save-every completed before the kill
    if saved:
        assert checkpoint_step(out) == saved  # nothing more than the steps since it was lost
    assert main(flags(imdb_dir, cache_dir, out, "--resume", "auto")) == 0
    assert_same_run(reference, out)


def test_sigkill_resumes_bitwise_from_a_save_by_time(reference, imdb_dir, cache_dir, tmp_path):
    """last.pt by the clock only (--save-every 1000 saves at epochs' ends, never by steps here): an interval
    shorter than any step saves after each one, so the kill loses one step; the resume equals the reference."""
    out = tmp_path / "run"
    kill_step = fault_rng().randint(2, STEPS_PER_EPOCH * EPOCHS)
    by_time = ("--save-every", "1000", "--save-every-minutes", "1e-9")
    died = inject(["kill-at-step", str(kill_step)], flags(imdb_dir, cache_dir, out, *by_time))
    assert died.returncode == -signal.SIGKILL, died.stderr[-2000:]
    assert checkpoint_step(out) == kill_step - 1
    assert main(flags(imdb_dir, cache_dir, out, "--resume", "auto", *by_time)) == 0
    assert_same_run(reference, out)


def _poll_on_two_ranks(rank: int, init: str, answers) -> None:
    """One gloo rank: rank 0's clock decides a save by time, the stop check's collective carries it."""
    import time
    from types import SimpleNamespace

    import torch.distributed as dist

    from fastpt.loop.bookkeeping import DueCheck
    from fastpt.cluster.distributed import DistInfo
    from fastpt.cluster.signals import GracefulStop

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    stopper = GracefulStop(timeout_s=60).install()
    seen = []
    for minutes_ago, signalled in ((2, False), (0, False), (2, True), (0, True)):
        # every rank's clock says the interval (1 minute) has passed, or none has; only rank 0's counts
        clock = SimpleNamespace(save_every_minutes=1, dist=DistInfo(rank, rank, 2, None),
                                last_save=time.monotonic() - minutes_ago * 60)
        stopper.signum = signal.SIGTERM if signalled and rank == 1 else None  # a signal on rank 1 only
        seen.append((DueCheck.save_by_time_due(clock), *stopper.poll(DueCheck.save_by_time_due(clock))))
    stopper.uninstall()
    dist.destroy_process_group()
    answers.put((rank, seen))


def test_a_save_by_time_is_rank_0s_and_every_rank_agrees(tmp_path):
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    answers = context.Queue()
    mp.spawn(_poll_on_two_ranks, args=(f"file://{tmp_path / 'store'}", answers), nprocs=2)
    seen = dict(answers.get(timeout=60) for _ in range(2))
    # (this rank's own verdict, stop, save) per poll: rank 1's clock never decides, yet it saves with rank 0
    assert seen[0] == [(True, False, True), (False, False, False), (True, True, True), (False, True, False)]
    assert seen[1] == [(False, False, True), (False, False, False), (False, True, True), (False, True, False)]


def test_resume_auto_before_first_checkpoint_starts_again(reference, imdb_dir, cache_dir, tmp_path, monkeypatch):
    from fastpt.strategies.base import Strategy

    out, original = tmp_path / "run", Strategy.optimizer_step

    def crash(self):
        raise RuntimeError("simulated crash before the first checkpoint")

    monkeypatch.setattr(Strategy, "optimizer_step", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        main(flags(imdb_dir, cache_dir, out))
    assert (out / "config.json").exists() and not (out / "checkpoints" / "last.pt").exists()
    monkeypatch.setattr(Strategy, "optimizer_step", original)
    assert main(flags(imdb_dir, cache_dir, out, "--resume", "auto")) == 0  # this run's folder: start again
    assert_same_run(reference, out)


def test_crash_while_writing_checkpoint_keeps_previous(reference, imdb_dir, cache_dir, tmp_path):
    out = tmp_path / "run"
    died = inject(["die-in-save", "3"], flags(imdb_dir, cache_dir, out))  # saves at steps 3, 6, then 9
    assert died.returncode == 137, died.stderr[-2000:]
    leftovers = list((out / "checkpoints").glob(".last.pt.*.tmp"))
    assert leftovers, "the simulated crash should leave its half-written temporary file"
    assert checkpoint_step(out) == 6  # the previous last.pt, whole and loadable
    with pytest.raises(checkpoint.CheckpointError):
        checkpoint.load(leftovers[0])  # the half-written file really is broken
    assert main(flags(imdb_dir, cache_dir, out, "--resume", "auto")) == 0
    assert_same_run(reference, out)


def test_sigterm_saves_checkpoint_and_exits_3(reference, imdb_dir, cache_dir, tmp_path):
    out = tmp_path / "run"
    stop_step = fault_rng().randint(1, STEPS_PER_EPOCH * EPOCHS - 1)
    stopped = inject(["signal-at-step", str(stop_step), "TERM"], flags(imdb_dir, cache_dir, out))
    assert stopped.returncode == EXIT_STOPPED, stopped.stderr[-2000:]
    last_line = stopped.stderr.strip().splitlines()[-1]
    assert last_line.startswith("stopped: SIGTERM at step") and "--resume auto" in last_line
    assert checkpoint_step(out) == stop_step  # the step in flight was finished and kept
    assert main(flags(imdb_dir, cache_dir, out, "--resume", "auto")) == 0
    assert_same_run(reference, out)


def test_second_signal_stops_at_once(imdb_dir, cache_dir, tmp_path, monkeypatch):
    """In process, with os._exit caught: the handler must exit at once, inside the step."""
    import fastpt.cluster.signals
    from fastpt.strategies.base import Strategy

    class Exited(BaseException):
        pass

    def exit_now(status):
        raise Exited(status)

    out, original, calls = tmp_path / "run", Strategy.optimizer_step, []

    def step(self):
        calls.append(1)
        if len(calls) == 5:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self)

    monkeypatch.setattr(fastpt.cluster.signals.os, "_exit", exit_now)
    monkeypatch.setattr(fastpt.cluster.signals, "REPEAT_S", 0.0)  # not the first one delivered twice
    monkeypatch.setattr(Strategy, "optimizer_step", step)
    handler_before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Exited) as exited:
        main(flags(imdb_dir, cache_dir, out))
    assert exited.value.args == (128 + signal.SIGTERM,)
    assert signal.getsignal(signal.SIGTERM) == handler_before  # the run put the old handler back
    assert checkpoint_step(out) == 3  # no checkpoint for the abandoned step 5; step 3's is intact


@pytest.mark.parametrize("second, repeat_s, exits", [
    ("TERM", None, None),   # the same signal at once: delivered twice (srun torchrun, Ctrl-C under torchrun)
    ("TERM", 0.0, 143),     # the same signal later: a second request, stop now
    ("INT", None, 130),     # another signal: a second request
    ("USR1", 0.0, None),    # the warning signal only warns, however late it comes again
])
def test_a_second_signal_stops_at_once_unless_it_is_the_first_again(second, repeat_s, exits, monkeypatch):
    import fastpt.cluster.signals as signals

    class Exited(BaseException):
        pass

    def exit_now(status):
        raise Exited(status)

    monkeypatch.setattr(signals.os, "_exit", exit_now)
    if repeat_s is not None:
        monkeypatch.setattr(signals, "REPEAT_S", repeat_s)
    first = signal.SIGUSR1 if second == "USR1" else signal.SIGTERM
    stopper = signals.GracefulStop(warning_signal=signal.SIGUSR1).install()
    try:
        os.kill(os.getpid(), first)
        assert stopper.poll() == (True, False) and stopper.stop_signal == first
        if exits is None:
            os.kill(os.getpid(), signal.Signals[f"SIG{second}"])
            assert stopper.stop_signal == first  # still the one graceful stop
        else:
            with pytest.raises(Exited) as exited:
                os.kill(os.getpid(), signal.Signals[f"SIG{second}"])
            assert exited.value.args == (exits,)
    finally:
        stopper.uninstall()


def test_sigint_in_process_stops_after_the_step(reference, imdb_dir, cache_dir, tmp_path, monkeypatch, capfd):
    from fastpt.strategies.base import Strategy

    out = tmp_path / "run"
    original, calls = Strategy.optimizer_step, []

    def step(self):
        calls.append(1)
        if len(calls) == 8:
            os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C would
        return original(self)

    monkeypatch.setattr(Strategy, "optimizer_step", step)
    assert main(flags(imdb_dir, cache_dir, out)) == EXIT_STOPPED
    assert capfd.readouterr().err.strip().splitlines()[-1].startswith("stopped: SIGINT at step 8")
    assert checkpoint_step(out) == 8
    progress = checkpoint.load(out / "checkpoints" / "last.pt")["progress"]
    epoch_1_time = checkpoint.load(out / "checkpoints" / "last.pt")["history"][0]["train_time_s"]
    assert progress["train_time_s"] > epoch_1_time  # the 2 steps of epoch 2 are counted too
    monkeypatch.setattr(Strategy, "optimizer_step", original)
    assert main(flags(imdb_dir, cache_dir, out, "--resume", "auto")) == 0
    assert_same_run(reference, out)


def test_fp16_amp_resume_keeps_grad_scaler(imdb_dir, cache_dir, tmp_path):
    amp = ("--amp", "--amp-dtype", "float16", "--save-every", "2")
    reference_out, out = tmp_path / "reference", tmp_path / "run"
    assert main(flags(imdb_dir, cache_dir, reference_out, *amp)) == 0
    scaler = checkpoint.load(reference_out / "checkpoints" / "last.pt")["training"]["scaler"]
    assert scaler and scaler["_growth_tracker"] > 0  # the scaler state is really saved and moving
    kill_step = fault_rng().randint(3, STEPS_PER_EPOCH * EPOCHS)
    died = inject(["kill-at-step", str(kill_step)], flags(imdb_dir, cache_dir, out, *amp))
    assert died.returncode == -signal.SIGKILL, died.stderr[-2000:]
    assert main(flags(imdb_dir, cache_dir, out, *amp, "--resume", "auto")) == 0
    assert_same_run(reference_out, out)


@pytest.mark.slow  # 27 s; the default set keeps one process's SIGKILL resume and the elastic restart under torchrun
def test_ddp_sigkill_resumes_bitwise(imdb_dir, cache_dir, tmp_path):
    ddp = ("--ddp", "--save-every", "2")  # 2 ranks x 24 examples: 3 steps per epoch
    reference_out, out = tmp_path / "reference", tmp_path / "run"
    kill_step = fault_rng().randint(3, 3 * EPOCHS)
    died = inject(["kill-at-step", str(kill_step)], flags(imdb_dir, cache_dir, out, *ddp), torchrun=2)
    assert died.returncode != 0 and not (out / "results.json").exists()
    assert len(checkpoint.load(out / "checkpoints" / "last.pt")["per_rank"]) == 2  # both ranks' RNG and sums
    # The resumed run, then the uninterrupted reference, in one torchrun launch.
    both = inject(["two-runs"], [*flags(imdb_dir, cache_dir, out, *ddp, "--resume", "auto"), "--",
                                 *flags(imdb_dir, cache_dir, reference_out, *ddp)], torchrun=2)
    assert both.returncode == 0, both.stderr[-3000:]
    assert_same_run(reference_out, out)


# ---------------------------------------------------------------------------- safe loading, NaN

def test_malicious_checkpoint_is_refused_not_run(tmp_path, imdb_dir, cache_dir, capfd):
    class CreatesFile:
        def __init__(self, target: Path):
            self.target = target

        def __reduce__(self):
            return (open, (str(self.target), "w"))  # unpickling would create the file

    control, target = tmp_path / "created-by-plain-pickle", tmp_path / "must-not-exist"
    torch.save({"x": CreatesFile(control)}, tmp_path / "control.pt")
    torch.load(tmp_path / "control.pt", weights_only=False)
    assert control.exists()  # the payload works when loaded unsafely

    evil = tmp_path / "run" / "checkpoints" / "last.pt"
    evil.parent.mkdir(parents=True)
    torch.save({"config": {}, "progress": {}, "training": {"model": CreatesFile(target)}}, evil)
    with pytest.raises(checkpoint.CheckpointError, match="refused"):
        checkpoint.load(evil)
    raw = tmp_path / "raw.pt"
    raw.write_bytes(pickle.dumps(CreatesFile(target)))  # a bare pickle, not torch.save's zip
    with pytest.raises(checkpoint.CheckpointError):
        checkpoint.load(raw)
    capfd.readouterr()
    args = ["--model", "tiny", "--data-dir", str(imdb_dir), "--cache-dir", str(cache_dir), "--resume", str(evil)]
    assert main(args) == EXIT_BAD_INPUT
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "refused to load" in err[0]
    assert not target.exists()


def test_nan_loss_stops_naming_step_and_keeps_good_checkpoints(imdb_dir, cache_dir, tmp_path, monkeypatch, capfd):
    import fastpt.loop.step as step

    out, original, calls = tmp_path / "run", step.classify, []

    def poisoned(model, batch, max_length):
        logits = original(model, batch, max_length)
        if model.training:
            calls.append(1)
        return logits * float("nan") if len(calls) == 8 and model.training else logits  # the 8th training batch

    monkeypatch.setattr(step, "classify", poisoned)
    assert main(flags(imdb_dir, cache_dir, out)) == 1
    err = capfd.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: training loss became NaN/inf at step 8")
    assert checkpoint_step(out) == 6  # written before the bad step, not overwritten after it
    best = checkpoint.load(out / "checkpoints" / "best.pt")
    assert best["step"] == 6 and all(torch.isfinite(v).all() for v in best["model"].values()
                                     if v.is_floating_point())
    assert not (out / "results.json").exists()


# ---------------------------------------------------------------------------- finished runs, shared folders and caches

def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.rglob("*"))}


def test_resume_auto_on_a_finished_run_changes_nothing(reference, imdb_dir, cache_dir, tmp_path, capfd):
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    before = snapshot(out)
    capfd.readouterr()
    assert main(flags(imdb_dir, cache_dir, out, "--resume", "auto")) == 0
    captured = capfd.readouterr()
    lines = (captured.out + captured.err).strip().splitlines()
    assert len(lines) == 1 and "is finished" in lines[0], lines
    assert snapshot(out) == before  # no test rerun, no results.json, config.json or events rewritten


def test_a_stale_lock_of_a_dead_run_does_not_block(imdb_dir, cache_dir, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / ".lock").write_text("999999\n")  # left by a killed run: the file stays, its flock died with it
    assert main(flags(imdb_dir, cache_dir, out, "--epochs", "1", "--no-tensorboard")) == 0
    assert (out / "results.json").exists() and not (out / ".lock").exists()


def _train_py(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args], env=env(), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow  # 12 s; the default set keeps the lock's refusal (test_bad_input: an --out another run holds)
def test_two_runs_started_at_once_into_one_folder_one_wins(imdb_dir, cache_dir, tmp_path):
    out = tmp_path / "shared"
    args = ["--model", "tiny", "--data-dir", str(imdb_dir), "--cache-dir", str(cache_dir), "--max-length", "32",
            "--batch-size", "8", "--train-size", "48", "--epochs", "1", "--no-progress", "--no-tensorboard",
            "--out", str(out)]
    runs = [_train_py(*args) for _ in range(2)]
    (code_a, err_a), (code_b, err_b) = zip(wait_all(runs, timeout=240), (p.stderr.read() for p in runs))
    assert sorted([code_a, code_b]) == [0, EXIT_BAD_INPUT], (err_a[-2000:], err_b[-2000:])
    loser = (err_a if code_a else err_b).strip().splitlines()
    # Refused while the winner runs, or (if the winner was quicker than the loser's start) as a finished run.
    assert len(loser) == 1 and ("in use by another run" in loser[0] or "holds a finished run" in loser[0]), loser
    results = json.loads((out / "results.json").read_text())
    assert results["global_steps"] == 6 and not (out / ".lock").exists()


def test_concurrent_cache_builds_both_succeed(imdb_dir, tmp_path):
    """Two builds of one missing cache at once (threads here, processes in use: the same lock file)."""
    import threading

    from fastpt.inputs import token_cache
    from fastpt.inputs.models import load_tokenizer

    tokenizer, cache, outcomes = load_tokenizer("tiny"), tmp_path / "cache", []

    def build():
        try:
            outcomes.append(token_cache.prepare_splits(str(imdb_dir), str(cache), tokenizer, 32))
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            outcomes.append(e)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(isinstance(o, tuple) for o in outcomes) and len(outcomes) == 2, outcomes
    (first, path), (second, same) = outcomes
    assert path == same and np.array_equal(first["train"].ids, second["train"].ids)
    assert sorted(p.name for p in cache.iterdir()) == [path.name]  # no temporary folder, no lock file left


def test_a_cache_build_that_loses_the_race_uses_the_winners_copy(imdb_dir, tmp_path):
    from fastpt.inputs import imdb, token_cache
    from fastpt.inputs.models import load_tokenizer

    tokenizer, source = load_tokenizer("tiny"), imdb.find_source(str(imdb_dir))
    target = tmp_path / f"imdb-{token_cache.cache_key(source, tokenizer)}"
    token_cache.build_cache(source, tokenizer, target)  # the winner published first...
    winner = token_cache.load_cache(target, 64)
    token_cache.build_cache(source, tokenizer, target)  # ...the loser, having passed the same check, finishes second
    assert np.array_equal(token_cache.load_cache(target, 64)["train"].ids, winner["train"].ids)
    assert [p.name for p in tmp_path.iterdir()] == [target.name]


def test_the_cache_is_keyed_by_content_and_serves_every_length(imdb_dir, tmp_path):
    from fastpt.inputs import imdb, token_cache
    from fastpt.inputs.models import load_tokenizer

    tokenizer = load_tokenizer("tiny")
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    shutil.copy(imdb_dir / "aclImdb_v1.tar.gz", moved / "aclImdb_v1.tar.gz")
    long, path = token_cache.prepare_splits(str(imdb_dir), str(tmp_path / "cache"), tokenizer, 64)
    short, same_path = token_cache.prepare_splits(str(moved), str(tmp_path / "cache"), tokenizer, 12)
    assert same_path == path  # another path, same bytes: no second tokenisation, one cache for both lengths
    reviews = imdb.read_reviews(imdb.find_source(str(imdb_dir)))
    keys = token_cache.split_keys(path)["train"]
    for i in range(len(keys)):
        text = reviews.texts[reviews.keys.index(keys[i])].replace("<br />", " ")
        for split, length in ((short, 12), (long, 64)):
            direct = tokenizer(text, truncation=True, max_length=length)["input_ids"]
            assert split["train"][i][0].tolist() == direct  # cut on load == tokenised at that length


# ---------------------------------------------------------------------------- DeepSpeed alone, torchrun's output

def test_deepspeed_runs_as_a_one_rank_job_without_torchrun(imdb_dir, cache_dir, tmp_path, monkeypatch):
    import importlib

    # As tests/dist/run_many.py: gloo alone, without JIT-compiling DeepSpeed's shared-memory op.
    monkeypatch.setattr(importlib.import_module("deepspeed.comm.torch"), "build_shm_op", lambda: None)
    out = tmp_path / "run"
    assert main(flags(imdb_dir, cache_dir, out, "--deepspeed", "--amp", "--amp-dtype", "bfloat16",
                      "--epochs", "1", "--no-tensorboard")) == 0
    assert json.loads((out / "results.json").read_text())["strategy"] == "deepspeed"
    assert not any(name in os.environ for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT"))


@pytest.mark.parametrize("found_by", [pytest.param("rank 0", marks=pytest.mark.slow), "every rank"])
def test_bad_input_under_torchrun_is_one_line_and_a_plain_exit(imdb_dir, cache_dir, tmp_path, found_by):
    """Both ranks refuse bad input: rank 0 prints one line, no rank a traceback.

    Rank 0 finds an --out that holds another run and sends it to the others (run_folder.plan_out_dir);
    a --deepspeed-config that is not a JSON object every rank finds by itself, and torchrun stops
    every worker once one has exited: the others wait for rank 0 to print (shell.exit_process).
    Neither case depends on the hardware (DeepSpeed's float16 is refused by one CPU, runs on another)."""
    out = tmp_path / "run"
    if found_by == "rank 0":
        out.mkdir()
        (out / ".fastpt-run.json").write_text("{}\n")  # the marker: a fastpt run folder
        (out / "config.json").write_text("{}\n")
        extra = []
        expected = (f"error: --out {out} holds another run (config.json); pass --overwrite to replace it, "
                    f"--resume auto to continue it, or choose another folder")
    else:
        config = tmp_path / "ds.json"
        config.write_text("[1, 2]\n")
        extra = ["--deepspeed-config", str(config)]
        expected = (f"error: --deepspeed-config {config} holds an array, not a JSON object of DeepSpeed settings "
                    '({"zero_optimization": ...})')
    before = sorted(p.name for p in out.iterdir()) if out.exists() else None
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
                           str(ROOT / "train.py"), *flags(imdb_dir, cache_dir, out, "--deepspeed", *extra)],
                          env=env(), cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [expected], proc.stderr[-3000:]
    assert not fastpt_frames(proc.stderr), proc.stderr[-3000:]  # no rank's traceback
    assert "exitcode  : 2" in proc.stderr, proc.stderr[-3000:]  # a plain status 2 (torchrun then stops the other)
    assert (sorted(p.name for p in out.iterdir()) if out.exists() else None) == before  # nothing written, no lock


def test_stop_message_is_on_a_line_of_its_own(imdb_dir, cache_dir, tmp_path, monkeypatch, capfd):
    from fastpt.strategies.base import Strategy

    original, calls = Strategy.optimizer_step, []

    def step(self):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return original(self)

    monkeypatch.setattr(Strategy, "optimizer_step", step)
    args = [a for a in flags(imdb_dir, cache_dir, tmp_path / "run", "--no-tensorboard") if a != "--no-progress"]
    assert main(args) == EXIT_STOPPED
    lines = capfd.readouterr().err.splitlines()  # splits at the bar's carriage returns too
    assert any(line.startswith("stopped: SIGINT at step 2") for line in lines), lines[-3:]
