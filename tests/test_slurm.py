"""SLURM: srun's process group, the warning signal, the requeue, against a real SLURM on this host.

The daemons are the Debian packages' (`apt-get install slurm-wlm munge`), run by
scripts/slurm/local_cluster.sh as a one-node cluster (.ci/run starts it before the suite; this
file starts it too when it is installed but not running, and stops what it started). Where SLURM is
not installed, or cannot start, the tests that need it skip with the reason; the node-list
parser and the variable translation are tested everywhere.

- a 2-task `srun python train.py --ddp` follows `torchrun --nproc_per_node=2` bitwise;
- `srun -n 2` without a strategy: exit 2, one line, no run folder;
- `scancel --signal=USR1` on a `sbatch --requeue` job: last.pt at the step of the line
  `signal USR1: saved step N, job J requeued`, the job back in the queue (`scontrol show job`);
- `scancel` (SIGTERM, as preemption sends): last.pt written, status 3, the job not requeued;
- slow: the requeued job starts again after SLURM's delay (about two minutes) and finishes
  with exactly the uninterrupted run's losses; the `srun torchrun` form passes the signal on; a
  `--no-requeue` job says it was not requeued and stops with status 3.
In-process (no SLURM needed): SIGUSR1 stops after the step, requeues under SLURM (scontrol
replaced), is held while the model loads; a log file (stderr not a terminal) gets lines, no bars.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import wait_for
from fastpt.cluster import slurm

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = ROOT / "scripts" / "slurm" / "local_cluster.sh"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
       "HF_DATASETS_OFFLINE": "1"}
SLURM_VARIABLES = [name for name in os.environ if name.startswith("SLURM_")]


# ---------------------------------------------------------------------------- without SLURM

@pytest.mark.parametrize("nodelist, hosts", [
    ("vm", ["vm"]),
    ("gpu[01-04,07]", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07"]),
    ("gpu[09-11],cpu5", ["gpu09", "gpu10", "gpu11", "cpu5"]),
    ("a[1-2]-ib,b7", ["a1-ib", "a2-ib", "b7"]),
    ("rack[1-2]-n[8-9]", ["rack1-n8", "rack1-n9", "rack2-n8", "rack2-n9"]),
    ("node[098-101]", ["node098", "node099", "node100", "node101"]),
])
def test_node_lists_expand_as_scontrol_show_hostnames(nodelist, hosts):
    assert slurm.expand_nodelist(nodelist) == hosts
    if shutil.which("scontrol"):  # SLURM's own expansion, where it is installed
        shown = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True)
        if shown.returncode == 0 and shown.stdout.strip():  # 22.05 refuses "a[1-2]-ib", later versions take it
            assert shown.stdout.split() == hosts


def test_tasks_per_node_and_port():
    assert slurm.tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert slurm.tasks_per_node("4") == [4]
    with pytest.raises(ValueError, match="SLURM_STEP_TASKS_PER_NODE"):
        slurm.tasks_per_node("2x3")
    assert slurm.default_port("123") == 15123
    assert slurm.default_port("4567891") == 15000 + 7891  # Lightning's: 15000 + the last four digits


def _clear_launch_variables(monkeypatch):
    """No launcher's variables; the test's own (join_srun_step sets torchrun's) are removed after it."""
    for name in [*SLURM_VARIABLES, "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT"]:
        monkeypatch.setenv(name, "")  # recorded as it was, so that the test's own value is undone too
        monkeypatch.delenv(name)


def test_an_srun_task_gets_torchrun_variables(monkeypatch):
    _clear_launch_variables(monkeypatch)
    step = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_LOCALID": "1",
            "SLURM_NODEID": "1", "SLURM_NTASKS": "6", "SLURM_STEP_NUM_TASKS": "6", "SLURM_STEP_TASKS_PER_NODE": "4,2",
            "SLURM_JOB_NODELIST": "gpu[01-04,07]", "SLURM_STEP_NODELIST": "gpu[03-04]"}
    for name, value in step.items():
        monkeypatch.setenv(name, value)
    slurm.join_srun_step(needs_group=True)
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    assert {name: os.environ[name] for name in names} == {
        "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "gpu03",
        "MASTER_PORT": "19242"}
    monkeypatch.delenv("SLURM_STEP_NODELIST")
    monkeypatch.delenv("MASTER_ADDR")
    monkeypatch.setenv("MASTER_PORT", "29555")  # the user's port wins
    assert slurm.torchrun_environment()["MASTER_ADDR"] == "gpu01"
    assert slurm.torchrun_environment()["MASTER_PORT"] == "29555"


def test_a_batch_shell_or_one_task_is_one_process(monkeypatch):
    _clear_launch_variables(monkeypatch)
    # sbatch --ntasks=2 running `python train.py` itself: the batch step has no SLURM_STEP_ID
    for name, value in {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
                        "SLURM_JOB_NODELIST": "vm"}.items():
        monkeypatch.setenv(name, value)
    slurm.join_srun_step(needs_group=False)
    assert "RANK" not in os.environ
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    slurm.join_srun_step(needs_group=False)
    assert "RANK" not in os.environ
    monkeypatch.setenv("SLURM_NTASKS", "2")
    with pytest.raises(ValueError, match="srun started 2 tasks, but without --ddp"):
        slurm.join_srun_step(needs_group=False)


def test_array_tasks_are_requeued_by_their_array_name(monkeypatch):
    _clear_launch_variables(monkeypatch)
    assert slurm.job_to_requeue() is None
    monkeypatch.setenv("SLURM_JOB_ID", "101")
    assert slurm.job_to_requeue() == "101"
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "100")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    assert slurm.job_to_requeue() == "100_3"


# ---------------------------------------------------------------------------- in this process

def _signal_at_step(monkeypatch, step: int, signum: int):
    """Send `signum` to this process as optimiser step `step` begins."""
    from fastpt.strategies.base import Strategy
    original, calls = Strategy.optimizer_step, []

    def optimizer_step(self):
        calls.append(1)
        if len(calls) == step:
            os.kill(os.getpid(), signum)
        return original(self)

    monkeypatch.setattr(Strategy, "optimizer_step", optimizer_step)


def test_usr1_stops_after_the_step_and_requeues_under_slurm(tiny_args, tmp_path, monkeypatch, capfd):
    from train import main

    _clear_launch_variables(monkeypatch)
    out = tmp_path / "run"
    _signal_at_step(monkeypatch, 3, signal.SIGUSR1)
    assert main(tiny_args(out=out)) == 3  # outside SLURM: a graceful stop, as after SIGTERM
    assert capfd.readouterr().err.strip().splitlines()[-1].startswith("stopped: SIGUSR1 at step 3, checkpoint saved")
    assert last_step(out) == 3

    asked = []
    monkeypatch.setattr(slurm, "requeue", lambda job: asked.append(job))  # scontrol's success: None
    monkeypatch.setenv("SLURM_JOB_ID", "123")
    _signal_at_step(monkeypatch, 3, signal.SIGUSR1)  # the resumed run's third step: step 6
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)
    assert main(tiny_args("--resume", "auto", out=out)) == 0  # requeued: SLURM runs it again
    assert capfd.readouterr().err.strip().splitlines()[-1] == "signal USR1: saved step 6, job 123 requeued"
    assert asked == ["123"] and last_step(out) == 6
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)) == before


def test_usr1_after_the_last_step_finishes_the_run_without_requeue(tiny_args, tmp_path, monkeypatch, capfd):
    from fastpt.loop import checkpoints
    from train import main

    _clear_launch_variables(monkeypatch)
    asked, original = [], checkpoints.load_best
    monkeypatch.setattr(slurm, "requeue", lambda job: asked.append(job))
    monkeypatch.setenv("SLURM_JOB_ID", "123")

    def load_best(*args, **kwargs):  # training is over: the test comes next
        os.kill(os.getpid(), signal.SIGUSR1)
        return original(*args, **kwargs)

    monkeypatch.setattr(checkpoints, "load_best", load_best)
    out = tmp_path / "run"
    assert main(tiny_args(out=out)) == 0  # a finished run: nothing to continue
    assert asked == [] and (out / "results.json").exists()
    assert "requeued" not in capfd.readouterr().err


def test_usr1_while_loading_stops_at_the_first_step(tiny_args, tmp_path, monkeypatch, capfd):
    from fastpt import strategies as strategies_module
    from train import main

    _clear_launch_variables(monkeypatch)
    original = strategies_module.build_strategy

    def build_strategy(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGUSR1)  # SIGUSR1's default action would end the process here
        return original(*args, **kwargs)

    monkeypatch.setattr(strategies_module, "build_strategy", build_strategy)
    assert main(tiny_args(out=tmp_path / "run")) == 3
    assert capfd.readouterr().err.strip().splitlines()[-1].startswith("stopped: SIGUSR1 at step 1")


def test_a_log_file_gets_lines_not_bars(tiny_args, tmp_path, monkeypatch, capfd):
    """stderr not a terminal (a batch job's log): no tqdm bars, not even the token cache's; log lines."""
    from train import main

    _clear_launch_variables(monkeypatch)

    args = [a for a in tiny_args("--cache-dir", str(tmp_path / "fresh"), out=tmp_path / "run") if a != "--no-progress"]
    assert main(args) == 0
    captured = capfd.readouterr()
    assert "\r" not in captured.err and "it/s" not in captured.err and "examples/s" not in captured.err, captured.err
    assert "step 2: loss" in captured.out and "step 4: loss" in captured.out


# ---------------------------------------------------------------------------- the real SLURM

def _node_up() -> bool:
    shown = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], capture_output=True, text=True)
    return shown.returncode == 0 and shown.stdout.split()[:1] in (["idle"], ["mix"], ["alloc"])


@pytest.fixture(scope="module")
def cluster():
    """The local cluster, up; started here (and stopped after) if it is installed but not running."""
    if not shutil.which("sbatch") or not shutil.which("slurmctld"):
        pytest.skip("SLURM is not installed (apt-get install slurm-wlm munge; .ci/run does)")
    if _node_up():
        yield
        return
    if os.geteuid() != 0:
        pytest.skip("SLURM is installed but not running, and only root can start it (scripts/slurm/local_cluster.sh)")
    started = subprocess.run(["bash", str(CLUSTER), "start"], capture_output=True, text=True, timeout=120)
    if started.returncode != 0 or not _node_up():
        pytest.skip(f"the local SLURM cluster did not start: {(started.stderr or started.stdout).strip()[-300:]}")
    yield
    subprocess.run(["bash", str(CLUSTER), "stop"], capture_output=True, timeout=120)


def train_args(imdb_dir, cache_dir, out: Path, *extra: str) -> list[str]:
    return ["train.py", "--model", "tiny", "--data-dir", str(imdb_dir), "--cache-dir", str(cache_dir),
            "--max-length", "32", "--batch-size", "4", "--epochs", "2", "--log-every", "1",
            "--out", str(out), *extra]


def srun(args: list[str], tasks: int = 2, timeout: int = 300, kill_on_bad_exit: bool = True):
    """`srun python train.py ...`, waited for."""
    cmd = ["srun", f"--ntasks={tasks}", f"--kill-on-bad-exit={int(kill_on_bad_exit)}", sys.executable, *args]
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


def sbatch(script: str, log: Path, *options: str) -> str:
    """Submit `script` (the lines after #!/bin/bash); the job id."""
    path = log.with_suffix(".sbatch")
    path.write_text(f"#!/bin/bash\ncd {ROOT}\n{script}\n")
    done = subprocess.run(["sbatch", "--parsable", f"--output={log}", "--open-mode=append", *options, str(path)],
                          env=ENV, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def job_fields(job: str) -> dict[str, str]:
    shown = subprocess.run(["scontrol", "show", "job", "--oneliner", job], capture_output=True, text=True)
    return dict(field.split("=", 1) for field in shown.stdout.split() if "=" in field)


def log_has(log: Path, text: str) -> bool:
    return log.is_file() and text in log.read_text()


def results(out: Path) -> dict:
    return json.loads((out / "results.json").read_text())


def free_port() -> int:
    """A port nothing listens on now (a fixed one can still be held by an earlier test's store)."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def losses(out: Path) -> dict:
    """What the run computed: every logged training loss, each epoch's losses, the test loss."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    res = results(out)
    return {"steps": [(e.step, e.value) for e in events.Scalars("train/loss")],
            "epochs": [(h["train_loss"], h["val_loss"]) for h in res["history"]], "test_loss": res["test_loss"]}


def last_step(out: Path) -> int:
    import torch
    state = torch.load(out / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    return state["progress"]["global_step"]


@pytest.mark.slow  # two 2-process runs side by side; the default set keeps the requeue path under SLURM
def test_srun_ddp_follows_torchrun(cluster, imdb_dir, cache_dir, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
           *train_args(imdb_dir, cache_dir, tmp_path / "torchrun", "--ddp")]
    torchrun = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:  # both at once: the reference runs beside the cluster, not in it
        by_srun = srun(train_args(imdb_dir, cache_dir, tmp_path / "srun", "--ddp"))
        _, torchrun_err = torchrun.communicate(timeout=300)
    finally:
        torchrun.kill()
    assert by_srun.returncode == 0, by_srun.stdout[-2000:] + by_srun.stderr[-3000:]
    assert "strategy: ddp x2 on cpu" in by_srun.stdout
    assert torchrun.returncode == 0, torchrun_err[-3000:]
    assert losses(tmp_path / "srun") == losses(tmp_path / "torchrun")  # bitwise: the same ranks, the same sums
    assert results(tmp_path / "srun")["world_size"] == 2


def test_srun_tasks_without_a_strategy_are_refused(cluster, imdb_dir, cache_dir, tmp_path):
    out = tmp_path / "runs" / "alone"
    done = srun(train_args(imdb_dir, cache_dir, out), kill_on_bad_exit=False)  # each task stops by itself
    assert done.returncode == 2, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if not line.startswith("srun:")]  # srun's own report
    assert len(lines) == 1 and lines[0].startswith("error: srun started 2 tasks") and "--ddp" in lines[0], done.stderr
    assert not (tmp_path / "runs").exists()


def _submit(imdb_dir, cache_dir, folder: Path, *sbatch_options, epochs: int = 3) -> tuple[str, Path, Path]:
    """A 2-task sbatch job training `epochs` epochs (14 steps each) with --resume auto: (job, log, run folder).

    A job that a test signals mid-run trains many epochs: the signal stops it at once, and on a loaded
    machine a 3-epoch job could finish (about 10 s) before the test got to signal it."""
    folder.mkdir(parents=True, exist_ok=True)
    out, log = folder / "run", folder / "job.log"
    args = " ".join(train_args(imdb_dir, cache_dir, out, "--epochs", str(epochs), "--resume", "auto", "--ddp"))
    job = sbatch(f'echo "job $SLURM_JOB_ID restart ${{SLURM_RESTART_COUNT:-0}}"\n'
                 f"srun --kill-on-bad-exit=1 {sys.executable} {args}\necho \"srun status $?\"",
                 log, "--ntasks=2", *sbatch_options)
    return job, log, out


def _wait_for_training(job: str, log: Path) -> None:
    """Until the job's second step is logged: mid-epoch (an epoch is 14 steps)."""
    try:
        wait_for(lambda: log_has(log, "\nstep 2:"), "the job's second step", timeout=240)
    except AssertionError:
        subprocess.run(["scancel", job])
        raise AssertionError(log.read_text()[-3000:] if log.is_file() else "no log")


@pytest.fixture(scope="module")
def signalled_jobs(cluster, imdb_dir, cache_dir, tmp_path_factory):
    """Two --requeue jobs side by side (--overcommit: both fit on the 2-CPU node), signalled mid-epoch:
    {"USR1": (job, log, out), "TERM": (...)}."""
    root = tmp_path_factory.mktemp("signalled")
    jobs = {name: _submit(imdb_dir, cache_dir, root / name, "--requeue", "--overcommit", epochs=30)
            for name in ("USR1", "TERM")}
    try:
        for name, (job, log, _) in jobs.items():
            _wait_for_training(job, log)
        # USR1: what --signal=USR1@90 sends before the time limit; TERM: what preemption sends the tasks first
        for name, (job, _, _) in jobs.items():
            subprocess.run(["scancel", f"--signal={name}", job], check=True)
        yield jobs
    finally:
        for job, _, _ in jobs.values():  # whatever a failed test left running or queued
            subprocess.run(["scancel", job])


def test_usr1_saves_last_pt_and_requeues_the_job(signalled_jobs):
    job, log, out = signalled_jobs["USR1"]
    line = wait_for(lambda: next((x for x in log.read_text().splitlines() if x.startswith("signal USR1")), None),
                    "the requeue line", timeout=90)
    assert line == f"signal USR1: saved step {last_step(out)}, job {job} requeued"
    fields = wait_for(lambda: (f := job_fields(job)).get("JobState") in ("PENDING", "REQUEUED") and f,
                      "the job back in the queue", timeout=30)
    subprocess.run(["scancel", job])  # not run again here: that waits out SLURM's requeue delay (the slow test)
    assert fields["Restarts"] == "1"
    assert not (out / "results.json").exists()


def test_sigterm_saves_last_pt_and_stops_without_requeue(signalled_jobs):
    job, log, out = signalled_jobs["TERM"]
    wait_for(lambda: log_has(log, "srun status"), "the job's end", timeout=90)
    text = log.read_text()
    assert (f"stopped: SIGTERM at step {last_step(out)}, checkpoint saved; resume with --resume auto --out {out}"
            in text), text
    assert "srun status 3" in text and "requeued" not in text, text
    fields = wait_for(lambda: (f := job_fields(job)).get("JobState") not in ("RUNNING", "COMPLETING", None) and f,
                      "the job's end state", timeout=30)
    assert fields["Restarts"] == "0"


@pytest.mark.slow
def test_a_requeued_job_continues_bitwise(cluster, imdb_dir, cache_dir, tmp_path):
    """USR1 mid-epoch, requeue, SLURM's delay, the restart; then the same again in the restarted job:
    exactly the uninterrupted run's losses."""
    uninterrupted = srun(train_args(imdb_dir, cache_dir, tmp_path / "whole", "--epochs", "3", "--ddp"))
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    job, log, out = _submit(imdb_dir, cache_dir, tmp_path, "--requeue")
    _wait_for_training(job, log)
    try:
        subprocess.run(["scancel", "--signal=USR1", job], check=True)
        wait_for(lambda: log_has(log, f"job {job} restart 1"), "the restart", timeout=400)  # SLURM's own delay
        # The restarted job, a few steps on (an epoch is 14 steps, 3 epochs: 42), is warned again.
        wait_for(lambda: re.search(r"^resumed from step \d+ .*\n(?:.*\n)*step \d+:.*\n(?:.*\n)*step \d+:",
                                   log.read_text(), re.M), "two steps after the resume", timeout=240)
        subprocess.run(["scancel", "--signal=USR1", job], check=True)
        wait_for(lambda: log_has(log, f"job {job} restart 2"), "the second restart", timeout=400)
        wait_for(lambda: log_has(log, "srun status 0"), "the continued run's end", timeout=300)
    except AssertionError:
        subprocess.run(["scancel", job])
        raise
    text = log.read_text()
    saved = re.findall(rf"^signal USR1: saved step (\d+), job {job} requeued$", text, re.M)
    assert len(saved) == 2 and int(saved[0]) < int(saved[1]), text
    assert all(f"resumed from step {step} " in text for step in saved), text
    assert losses(out) == losses(tmp_path / "whole")


@pytest.mark.slow
def test_srun_torchrun_passes_the_warning_signal_on(cluster, imdb_dir, cache_dir, tmp_path):
    out, log = tmp_path / "run", tmp_path / "job.log"
    args = " ".join(train_args(imdb_dir, cache_dir, out, "--epochs", "3", "--resume", "auto", "--ddp"))
    job = sbatch(f"srun --ntasks-per-node=1 {sys.executable} -m torch.distributed.run --nnodes=1 "
                 f"--nproc_per_node=2 --rdzv-backend=c10d --rdzv-endpoint=localhost:{free_port()} "
                 f"--signals-to-handle=SIGTERM,SIGINT,SIGUSR1 {args}", log, "--ntasks=1", "--cpus-per-task=2",
                 "--requeue")
    try:
        wait_for(lambda: log_has(log, "\nstep 2:"), "the job's second step", timeout=240)
        subprocess.run(["scancel", "--signal=USR1", job], check=True)
        line = wait_for(lambda: next((x for x in log.read_text().splitlines() if x.startswith("signal USR1")), None),
                        "the requeue line", timeout=60)
        assert line == f"signal USR1: saved step {last_step(out)}, job {job} requeued"
        fields = wait_for(lambda: (f := job_fields(job)).get("JobState") in ("PENDING", "REQUEUED") and f,
                          "the job back in the queue", timeout=30)
        assert fields["Restarts"] == "1"
    except AssertionError as e:
        raise AssertionError(f"{e}\n{log.read_text()[-4000:]}\n{job_fields(job)}") from None
    finally:
        subprocess.run(["scancel", job])


@pytest.mark.slow
def test_a_job_that_may_not_be_requeued_stops_as_after_sigterm(cluster, imdb_dir, cache_dir, tmp_path):
    job, log, out = _submit(imdb_dir, cache_dir, tmp_path, "--no-requeue", epochs=30)
    _wait_for_training(job, log)
    subprocess.run(["scancel", "--signal=USR1", job], check=True)
    wait_for(lambda: log_has(log, "srun status"), "the job's end", timeout=90)
    text = log.read_text()
    assert f"note: job {job} not requeued: the job does not allow it" in text, text
    assert f"stopped: SIGUSR1 at step {last_step(out)}, checkpoint saved" in text and "srun status 3" in text, text
    assert job_fields(job)["Restarts"] == "0"
