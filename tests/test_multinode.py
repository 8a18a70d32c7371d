"""Multi-node without a shared file system, and elastic restarts that survive the loss of any rank.

Two torchrun launchers on this machine act as two nodes (one process each, gloo):
- each node with its own --out and its own --cache-dir (nothing of rank 0's disk is visible to
  node 1), and both with the same ones (a shared file system); the runs must equal one
  launcher with two processes: results, best.pt, last.pt, bitwise;
- in the node-local layout, a run stopped after epoch 1 continues with `--resume auto` from
  rank 0's last.pt (node 1 has none) to the same result;
- `torchrun --max-restarts=2` with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (docs/multi-node.md): SIGKILL of the
  rank-0 or rank-1 worker mid-training restarts the group, which resumes from last.pt and ends
  bitwise equal to the uninterrupted run;
- a rank that stops answering makes every rank stop after --dist-timeout with one line, not wait.
Without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 the restarted group reads the dead group's addresses
from torchrun's store and fails in connectFullMesh (see fastpt/cluster/distributed.py).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import fastpt_frames, wait_all

from fastpt.files import checkpoint


ROOT = Path(__file__).resolve().parent.parent
RUN_MANY = ROOT / "tests" / "dist" / "run_many.py"
ELASTIC_KILL = ROOT / "tests" / "faults" / "elastic_kill.py"
TIMING_KEYS = {"train_time_s", "first_step_s", "samples_per_s", "tokens_per_s", "padded_tokens_per_s",
               "data_wait_share", "mfu", "peak_memory_bytes", "padding_efficiency", "val_time_s",
               "train_time_no_compile_s", "compile_time_s", "compile_torch_s", "samples_per_s_note", "batch_shapes",
               "memory_per_rank", "peak_flops_per_s", "peak_source", "peak_probe"}

pytestmark = pytest.mark.timeout(300)


def flags(imdb_dir, cache_dir: Path, out: Path, *extra: str) -> list[str]:
    """A tiny deterministic DDP run: 48 reviews, 2 ranks x batch 8 = 3 steps per epoch, 2 epochs."""
    return ["--ddp", "--model", "tiny", "--data-dir", str(imdb_dir), "--cache-dir", str(cache_dir),
            "--max-length", "32", "--batch-size", "8", "--train-size", "48", "--val-size", "15", "--test-size", "17",
            "--epochs", "2", "--log-every", "1", "--save-every", "2", "--deterministic", "--no-progress",
            "--no-tensorboard", "--out", str(out), *extra]


def env(**extra: str) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "PYTHONPATH": str(ROOT), **extra}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_many_args(runs: list[list[str]]) -> list[str]:
    # --no-dropout first: torchrun drops a "--" that directly follows the script.
    return [str(RUN_MANY), "--no-dropout"] + [arg for run in runs for arg in ("--", *run)]


def launch_nodes(per_node: list[list[str]], launcher: list[str], timeout: int, **extra_env: str) -> list[tuple]:
    """One torchrun per node, started together; [(returncode, output)] by node."""
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *launcher(node), *args],
                              env=env(**extra_env), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
             for node, args in enumerate(per_node)]
    try:
        return list(zip(wait_all(procs, timeout), (p.stdout.read() for p in procs)))
    finally:
        for p in procs:  # SIGTERM first: torchrun then stops its workers (each in a session of its own)
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


def c10d_two_nodes(port: int):
    """docs/multi-node.md's command on each node: c10d rendezvous, restarts allowed, a fresh store per round."""
    return lambda node: ["--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                         "--rdzv-id=two-nodes", "--max-restarts=2", "--monitor-interval=0.5"]


def untimed(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in TIMING_KEYS and not k.endswith("_s")}  # seconds vary


def results(out: Path) -> dict:
    data = json.loads((out / "results.json").read_text())
    data["history"] = [untimed(row) for row in data["history"]]
    return untimed(data)


def assert_same_run(reference: Path, run: Path) -> None:
    from test_reliability import assert_equal_tree

    assert results(run) == results(reference)
    assert_equal_tree(checkpoint.load(reference / "checkpoints" / "best.pt")["model"],
                      checkpoint.load(run / "checkpoints" / "best.pt")["model"], "best.pt")
    ref_last, last = (checkpoint.load(r / "checkpoints" / "last.pt") for r in (reference, run))
    assert_equal_tree(ref_last["training"], last["training"], "last.pt/training")
    assert_equal_tree(ref_last["per_rank"], last["per_rank"], "last.pt/per_rank")


@pytest.fixture(scope="module")
def reference(imdb_dir, tmp_path_factory) -> Path:
    """The uninterrupted run: one launcher, two processes."""
    root = tmp_path_factory.mktemp("one_node")
    out = root / "run"
    start = time.perf_counter()
    [(code, output)] = launch_nodes([run_many_args([flags(imdb_dir, root / "cache", out)])],
                                    lambda node: ["--standalone", "--nproc_per_node=2"], timeout=240)
    print(f"reference launch: {time.perf_counter() - start:.1f} s")
    assert code == 0, output[-4000:]
    return out


@pytest.mark.slow  # the default set keeps the elastic restart after a kill of rank 0 (same reference run)
def test_two_nodes_with_local_disks_or_a_shared_one_match_one_node(reference, imdb_dir, tmp_path):
    """(a) each node its own --out and cache, (b) both the same; and (a) stopped after epoch 1, then resumed.

    Each launcher runs docs/multi-node.md's command (c10d, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) with its own folders.
    """
    local = [tmp_path / f"node{n}" for n in range(2)]
    shared = tmp_path / "shared"
    for folder in local:  # run_many writes rank<R>_result.json there; fastpt itself writes nothing on node 1
        for name in ("run", "resumed"):
            (folder / name).mkdir(parents=True)
    per_node = [run_many_args([
        flags(imdb_dir, local[n] / "cache", local[n] / "run"),
        flags(imdb_dir, local[n] / "cache", local[n] / "resumed", "--epochs", "1"),
        flags(imdb_dir, local[n] / "cache", local[n] / "resumed", "--resume", "auto"),
        flags(imdb_dir, shared / "cache", shared / "run"),
    ]) for n in range(2)]
    start = time.perf_counter()
    nodes = launch_nodes(per_node, c10d_two_nodes(free_port()), timeout=240, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    print(f"two-node launch: {time.perf_counter() - start:.1f} s")
    for code, output in nodes:
        assert code == 0, output[-4000:]
    # c10d numbers the nodes itself (by address, then the launcher's pid): rank 0's node holds results.json.
    if (local[1] / "run" / "results.json").exists():
        local, nodes = local[::-1], nodes[::-1]

    assert_same_run(reference, local[0] / "run")
    assert_same_run(reference, local[0] / "resumed")
    assert_same_run(reference, shared / "run")
    # Node 1 built its own cache, and holds none of rank 0's files.
    assert list((local[1] / "cache").glob("imdb-*/dataset_dict.json"))
    assert not any((local[1] / name / "results.json").exists() for name in ("run", "resumed"))
    assert not any((local[1] / name / "checkpoints").exists() for name in ("run", "resumed"))
    assert "resumed from step 3" in nodes[0][1]


# ---------------------------------------------------------------------------- elastic restarts

@pytest.mark.slow  # 41 s with its reference run: the default set keeps one process's SIGKILL resume
@pytest.mark.parametrize("victim", [0, 1])
def test_elastic_restart_survives_sigkill_of_any_rank(reference, imdb_dir, tmp_path, victim):
    """SIGKILL of one worker in step 5 (last.pt at step 4): torchrun restarts both, and they resume."""
    out = tmp_path / "run"
    port = free_port()
    elastic = ["--nnodes=1", "--nproc_per_node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
               "--max-restarts=2", "--monitor-interval=0.5"]
    start = time.perf_counter()
    command = [str(ELASTIC_KILL), str(victim), "5", "--no-dropout", "--",
               *flags(imdb_dir, tmp_path / "cache", out, "--resume", "auto")]
    [(code, output)] = launch_nodes([command],
                                    lambda node: elastic, timeout=240, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    print(f"elastic launch: {time.perf_counter() - start:.1f} s")
    assert code == 0, output[-4000:]
    assert "resumed from step 4" in output, output[-4000:]
    assert "connectFullMesh" not in output
    assert_same_run(reference, out)


@pytest.mark.slow  # a 12 s hang and two timeouts
def test_a_hung_rank_stops_every_rank_after_dist_timeout(imdb_dir, tmp_path):
    """Rank 1 stops answering in step 2: rank 0 gives up after --dist-timeout with one line, then rank 1 too."""
    command = [str(ELASTIC_KILL), "1", "2", "--hang", "12", "--no-dropout", "--",
               *flags(imdb_dir, tmp_path / "cache", tmp_path / "run", "--dist-timeout", "5")]
    start = time.perf_counter()
    [(code, output)] = launch_nodes([command], lambda node: ["--standalone", "--nproc_per_node=2"], timeout=200)
    print(f"hung-rank launch: {time.perf_counter() - start:.1f} s")
    assert code != 0
    for rank in (0, 1):
        assert f"error: rank {rank} lost contact with the other processes" in output, output[-4000:]
    assert not fastpt_frames(output), output[-4000:]  # no traceback through fastpt's code, wherever it lives
