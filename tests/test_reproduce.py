"""scripts/reproduce.py and scripts/compare_peers.py: the table arithmetic, and smoke runs end to end."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import reproduce  # noqa: E402


def _env() -> dict:
    # One thread per process: the tiny model gains nothing from more, and the test shares the machine.
    return dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")


def _fake_run(key: str, train_time_s: float, test_acc: float) -> reproduce.Run:
    rung = next(r for r in reproduce.LADDER if r.key == key)
    results = {"train_time_s": train_time_s, "test_acc": test_acc, "samples_per_s": 100.0, "tokens_per_s": 5000.0,
               "mfu": None, "peak_memory_bytes": 3 * 2**30, "world_size": 1}
    return reproduce.Run(rung, [], Path("."), 1, status="done", results=results)


def _row(md: str, label: str) -> list:
    line = next(line for line in md.splitlines() if line.startswith(f"| {label} |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_table_speedups_over_each_sides_baseline():
    runs = [_fake_run("baseline", 600.0, 0.9), _fake_run("amp", 240.0, 0.91)]
    failed = reproduce.Run(next(r for r in reproduce.LADDER if r.key == "ddp"), [], Path("."), 2,
                           status="failed (exit 1, see x.log)")
    md = reproduce.table(runs + [failed])
    base, amp, ddp = _row(md, runs[0].rung.label), _row(md, runs[1].rung.label), _row(md, failed.rung.label)
    assert base[2:5] == ["10.00", "1.00x", "90.00%"]
    assert amp[2:5] == ["4.00", "2.50x", "91.00%"]
    assert amp[8] == "3.00 GiB"
    assert amp[9:] == ["8.75", f"{22.63 / 8.75:.2f}x", "92.20%"]  # the articles' own ratio
    assert ddp[2] == "failed (exit 1, see x.log)" and ddp[9].startswith("3.52 (4 GPUs)")
    header_cells = md.splitlines()[0].count("|")
    assert all(line.count("|") == header_cells for line in md.splitlines())


def test_plan_launches_multi_process_rows_with_torchrun_and_drops_duplicates(tmp_path):
    runs = {r.rung.key: r for r in reproduce.plan("cpu", 2, [], tmp_path)}
    ddp = runs["ddp"].command
    assert ddp[1:4] == ["-m", "torch.distributed.run", "--standalone"] and "--nproc_per_node=2" in ddp
    assert "--ddp" in ddp and "bfloat16" in ddp  # the cpu preset's mixed precision is bf16
    assert runs["baseline"].command[1] == "train.py" and "--amp" not in runs["baseline"].command
    # On the cpu preset "+ mixed precision" is already bf16, so the bf16 row would repeat the bucketing row.
    assert runs["bf16"].status.startswith("left out") and runs["bucket"].status == "not run"
    single = {r.rung.key: r for r in reproduce.plan("cpu", 1, [], tmp_path)}
    assert single["ddp"].status == "left out (--nproc 1)"
    # CUDA graphs and the rounding that bounds their count are the GPU preset's alone.
    article = {r.rung.key: r for r in reproduce.plan("article", 4, [], tmp_path)}
    assert {"--pack", "--data-on-device", "reduce-overhead", "--pack-multiple"} <= set(article["fast"].command)
    assert "--pack" in runs["fast"].command and "reduce-overhead" not in runs["fast"].command


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:] if path.exists() else ""


@pytest.mark.slow
def test_reproduce_smoke_writes_table_and_chart_and_resumes(imdb_dir, cache_dir, tmp_path):
    runs_dir, report_dir = tmp_path / "runs", tmp_path / "report"
    cmd = [sys.executable, "scripts/reproduce.py", "--preset", "smoke", "--only", "baseline,ddp",
           "--data-dir", str(imdb_dir), "--cache-dir", str(cache_dir), "--runs-dir", str(runs_dir),
           "--report-dir", str(report_dir)]
    first = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    logs = "".join(_tail(runs_dir / k / "train.log") for k in ("baseline", "ddp"))
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:] + logs

    md = (report_dir / "reproduce-smoke.md").read_text()
    assert "- machine:" in md and "- date:" in md and "--preset smoke" in md
    for key in ("baseline", "ddp"):
        results = json.loads((runs_dir / key / "results.json").read_text())
        row = _row(md, next(r.label for r in reproduce.LADDER if r.key == key))
        assert row[1] == str(results["world_size"])
        assert row[2] == f"{results['train_time_s'] / 60:.2f}"
        assert row[4] == f"{100 * results['test_acc']:.2f}%"
    assert json.loads((runs_dir / "ddp" / "results.json").read_text())["world_size"] == 2
    assert _row(md, reproduce.LADDER[0].label)[3] == "1.00x"
    png = report_dir / "reproduce-smoke.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000

    stamps = {k: (runs_dir / k / "results.json").stat().st_mtime_ns for k in ("baseline", "ddp")}
    second = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stderr[-3000:]
    assert second.stdout.count("results exist, skipped") == 2
    assert stamps == {k: (runs_dir / k / "results.json").stat().st_mtime_ns for k in stamps}


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                    reason="lightning is not installed (pip install -r requirements-peers.txt)")
def test_compare_peers_smoke_same_inputs_same_fp32_result(imdb_dir, cache_dir, tmp_path):
    runs_dir, report_dir = tmp_path / "runs", tmp_path / "report"
    cmd = [sys.executable, "scripts/compare_peers.py", "--preset", "smoke", "--configs", "fp32", "--repeats", "1",
           "--data-dir", str(imdb_dir), "--cache-dir", str(cache_dir), "--runs-dir", str(runs_dir),
           "--report-dir", str(report_dir)]
    done = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    logs = "".join(_tail(p) for p in runs_dir.glob("fp32/*/rep0/run.log"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:] + logs

    md = (report_dir / "compare-peers-smoke.md").read_text()
    rows = {fw: _row(md, fw) for fw in ("fastpt", "lightning", "accelerate", "bare")}
    assert all(re.fullmatch(r"[\d.]+ \([\d., ]+\)", r[1]) for r in rows.values())  # median (single runs)
    assert rows["fastpt"][3] == "1.000" and rows["bare"][8] == "+0.0 (+0%)"  # ratios against fastpt and the bare loop
    assert all(re.fullmatch(r"[+-][\d.]+ \([+-]\d+%\)", rows[fw][8]) for fw in ("fastpt", "lightning", "accelerate"))
    assert all(re.fullmatch(r"[\d.]+%", r[7]) for r in rows.values())  # MFU for every framework, one peak
    assert "Verdict: vs lightning:" in md and "vs accelerate:" in md

    results = {fw: json.loads((runs_dir / "fp32" / fw / "rep0" / "results.json").read_text())
               for fw in ("fastpt", "lightning", "accelerate", "bare")}
    # Same batches, same initial weights, same dropout seed, fp32: after the first epoch the three frameworks
    # hold the same model. (Later epochs may differ: each framework draws from the global RNG at its own points,
    # e.g. when it creates loader iterators, which shifts the dropout masks.)
    assert results["lightning"]["test_examples"] == results["accelerate"]["test_examples"] == 32
    first_val_loss = results["fastpt"]["history"][0]["val_loss"]
    for peer in ("lightning", "accelerate"):
        assert results[peer]["global_steps"] == results["fastpt"]["global_steps"]
        assert results[peer]["history"][0]["val_loss"] == pytest.approx(first_val_loss, rel=1e-6)
    assert results["bare"]["global_steps"] == results["fastpt"]["global_steps"]


def test_compare_peers_runs_a_peer_once_for_configurations_that_differ_only_in_fastpts_flags(tmp_path):
    import compare_peers

    jobs = compare_peers.plan("smoke", ["fp32", "fp32-pack", "bf16", "bf16-pack"], ["fastpt", "lightning"], 2, 2,
                              [], tmp_path, on_cuda=False)
    ran = [j for j in jobs if j.same_as is None]
    assert [(j.config.key, j.framework) for j in ran[:6]] == [
        ("fp32", "fastpt"), ("fp32", "lightning"), ("fp32-pack", "fastpt"),
        ("bf16", "fastpt"), ("bf16", "lightning"), ("bf16-pack", "fastpt")]
    shared = {(j.config.key, j.repeat): (j.same_as.config.key, j.same_as.repeat) for j in jobs if j.same_as}
    assert shared == {("fp32-pack", 0): ("fp32", 0), ("bf16-pack", 0): ("bf16", 0),
                      ("fp32-pack", 1): ("fp32", 1), ("bf16-pack", 1): ("bf16", 1)}  # within its own repeat
    assert "--pack" in jobs[2].command and "--pack" not in jobs[1].command

    for job in jobs:  # what execute does for a shared job: it takes its source's outcome, it runs nothing
        if job.same_as:
            compare_peers.execute(job)
        else:
            job.results, job.wall_s = {"train_time_s": float(len(job.command))}, 1.0
    assert all(j.results is (j.same_as or j).results and j.wall_s == 1.0 for j in jobs)


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs the git history of this checkout")
def test_compare_peers_before_runs_the_earlier_commits_train_py_with_the_same_flags(tmp_path):
    import compare_peers

    assert "fastpt-before" not in compare_peers.build_parser().parse_args([]).frameworks  # only with --before
    with pytest.raises(ValueError, match="not a commit"):
        compare_peers.earlier_tree("no-such-commit", tmp_path)
    tree = compare_peers.earlier_tree("HEAD", tmp_path)
    committed = subprocess.run(["git", "show", "HEAD:train.py"], cwd=ROOT, capture_output=True, text=True).stdout
    assert (tree / "train.py").read_text() == committed and (tree / "fastpt" / "__init__.py").exists()
    jobs = compare_peers.plan("smoke", ["fp32-pack-compile"], ["fastpt", "fastpt-before"], 1, 2, [], tmp_path,
                              on_cuda=False, before=tree)
    now, then = jobs
    assert (now.cwd, then.cwd) == (ROOT, tree)
    assert then.command[1:] == [*now.command[1:-1], str(tmp_path / "fp32-pack-compile" / "fastpt-before" / "rep0")]

    # a compiled run starts from an empty Inductor cache of its own, in whichever tree it runs
    write_env = ("import json, os, sys; from pathlib import Path; d = os.environ['TORCHINDUCTOR_CACHE_DIR']; "
                 "Path(sys.argv[-1], 'results.json').write_text(json.dumps({'cache': d, 'files': os.listdir(d) "
                 "if os.path.isdir(d) else [], 'cwd': os.getcwd(), 'train_time_s': 1, 'samples_per_s': 1}))")
    for job in jobs:
        (job.out / "inductor-cache").mkdir(parents=True)
        (job.out / "inductor-cache" / "left-over").write_text("")
        job.command = [sys.executable, "-c", write_env, "--compile", str(job.out)]
        compare_peers.execute(job)
        assert job.results == {"cache": str(job.out / "inductor-cache"), "files": [], "cwd": str(job.cwd),
                               "train_time_s": 1, "samples_per_s": 1}


def test_the_peers_train_a_pretrained_model_in_train_mode(imdb_dir, cache_dir, tmp_path, monkeypatch):
    """from_pretrained returns a model in eval mode and Lightning >= 2.2 no longer calls .train() at fit:
    the peers set it themselves, or they would train with every dropout off (and faster for it)."""
    sys.path.insert(0, str(ROOT / "scripts" / "peers"))
    import common

    loaded = common.load_model
    monkeypatch.setattr(common, "load_model", lambda *a, **k: loaded(*a, **k).eval())  # as from_pretrained
    args = common.build_parser("test").parse_args(
        ["--model", "tiny", "--max-length", "32", "--train-size", "24", "--val-size", "8", "--test-size", "8",
         "--data-dir", str(imdb_dir), "--cache-dir", str(cache_dir), "--out", str(tmp_path / "out")])
    model, _, _ = common.build_inputs(args, 0, 1)
    assert all(m.training for m in model.modules())


def test_compare_peers_warm_configuration_times_a_second_start_over_the_cache_the_first_filled(tmp_path):
    import compare_peers

    cold, warm = (compare_peers.plan("smoke", [key], ["fastpt"], 1, 2, [], tmp_path, on_cuda=False)[0]
                  for key in ("bf16-pack-compile", "bf16-pack-compile-warm"))
    assert cold.command == [*warm.command[:-1], str(cold.out)]  # the same flags: only the timing differs
    # each start leaves one file in the cache and reports what it found there
    start = ("import json, os, sys; from pathlib import Path; d = os.environ['TORCHINDUCTOR_CACHE_DIR']; "
             "found = sorted(os.listdir(d)) if os.path.isdir(d) else []; os.makedirs(d, exist_ok=True); "
             "Path(d, sys.argv[-1].replace('/', '_')).write_text(''); os.makedirs(sys.argv[-1], exist_ok=True); "
             "Path(sys.argv[-1], 'results.json').write_text(json.dumps({'found': found, 'train_time_s': 1, "
             "'samples_per_s': 1}))")
    for job in (cold, warm):
        (job.out / "inductor-cache").mkdir(parents=True)
        (job.out / "inductor-cache" / "left-over").write_text("")  # an earlier benchmark's: always removed
        job.command = [sys.executable, "-c", start, "--compile", "--out", str(job.out)]
        compare_peers.execute(job)
    assert cold.results["found"] == []
    assert warm.results["found"] == [str(warm.out / "warm-up").replace("/", "_")]  # the untimed first start's
