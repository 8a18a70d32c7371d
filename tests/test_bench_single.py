"""scripts/bench_single.py beyond its table: the probe that watches a window of train.py's steps (the GPU
check's steady-state test and `profile` use it), what `profile` and `compile-cache` refuse, and smoke runs
of both (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import bench_single  # noqa: E402


def test_the_probe_profiles_the_window_of_steps_it_was_given(tiny_args, tmp_path):
    report = tmp_path / "probe.json"
    train = tiny_args("--epochs", "1", "--max-steps", "4", "--pack", "--no-tensorboard", out=tmp_path / "run")
    assert bench_single.main(["probe", "--start-after", "1", "--sync-steps", "1", "--profile-steps", "2",
                              "--top", "5", "--report", str(report), "--", *train]) == 0
    probe = json.loads(report.read_text())
    assert probe["passed"] and probe["error"] is None and probe["steps"] == 4
    assert probe["sync_window"] == [2, 2] and probe["profile_window"] == [3, 4]
    assert probe["profile_sort"] == "self CPU time" and probe["step_s"] > 0
    lines = probe["profile_table"].splitlines()  # torch.profiler's table: rule, header, rule, rows, rule, total
    rules = [i for i, line in enumerate(lines) if line.strip() and set(line.strip()) <= {"-", " "}]
    assert len(rules) == 3
    assert rules[2] - rules[1] - 1 == 5  # --top: five operator rows, whatever their names (aten::, autograd, ...)
    assert json.loads((tmp_path / "run" / "results.json").read_text())["global_steps"] == 4  # train.py unchanged


@pytest.mark.parametrize("argv,why", [
    (["compile-cache", "--configs", "fp32-pack"], "compile-cache needs compiled configurations, not fp32-pack"),
    (["profile", "--configs", "fp32-pack,ddp-fp16"], "profile runs one process: leave out ddp-fp16"),
    (["profile", "--configs", "fp64"], "unknown configuration(s) fp64"),
])
def test_a_subcommand_refuses_what_it_cannot_run_in_one_line(argv, why, tmp_path, capsys):
    assert bench_single.main([*argv, "--out", str(tmp_path / "out"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and why in err, err


def run_bench(imdb_dir, cache_dir, tmp_path, *argv) -> subprocess.CompletedProcess:
    command = [sys.executable, "scripts/bench_single.py", *argv, "--model", "tiny", "--max-length", "32",
               "--batch-size", "8", "--device", "cpu", "--data-dir", str(imdb_dir), "--cache-dir", str(cache_dir),
               "--out", str(tmp_path / "out"), "--runs-dir", str(tmp_path / "runs")]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)


@pytest.mark.slow  # a tiny run in its own process under the profiler
def test_profile_writes_the_top_operators_of_packed_steps(imdb_dir, cache_dir, tmp_path):
    done = run_bench(imdb_dir, cache_dir, tmp_path, "profile", "--configs", "fp32-pack", "--profile-steps", "2",
                     "--top", "6")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    probe = json.loads((tmp_path / "runs" / "profile-fp32-pack" / "probe.json").read_text())
    assert probe["passed"] and probe["profile_window"] == [4, 5]  # after train.py's 3 warm-up steps
    md = (tmp_path / "out" / "profile.md").read_text()
    assert "- date:" in md and "machine:" in md and "### fp32-pack: `--pack`" in md
    assert probe["profile_table"].strip() in md


@pytest.mark.slow  # two compiled runs, the first from an empty Inductor cache: minutes on a loaded 2-core CPU
def test_compile_cache_runs_a_cold_then_a_warm_start_over_one_cache(imdb_dir, cache_dir, tmp_path):
    done = run_bench(imdb_dir, cache_dir, tmp_path, "compile-cache", "--configs", "fp32-pack-compile",
                     "--scopes", "layers", "--steps", "4")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    cold, warm = (json.loads((tmp_path / "runs" / f"compile-fp32-pack-compile-layers-{start}" / "results.json")
                             .read_text())["compile_cache"] for start in ("cold", "warm"))
    assert cold["fxgraph_miss"] > 0 and cold["fxgraph_hit"] == 0
    assert warm["fxgraph_hit"] == cold["fxgraph_miss"] and warm["fxgraph_miss"] == 0
    md = (tmp_path / "out" / "compile-cache.md").read_text()
    assert "| fp32-pack-compile | layers | cold |" in md and "| fp32-pack-compile | layers | warm |" in md
