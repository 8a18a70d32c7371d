"""The prepared GPU check (scripts/device_stage.sh, gpu_check.sh, gpu_check.py) on the CPU.

A GPU is lent only now and then, so the check must work the first time it meets one: its dry
run stages everything as for the offline GPU machine and runs the same script end to end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zipfile
from argparse import Namespace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_check  # noqa: E402
from gpu_check import DRY, Budget, Row  # noqa: E402


def make_wheel(folder: Path, name: str, version: str, requires=(), tag: str = "py3-none-any") -> Path:
    path = folder / f"{name}-{version}-{tag}.whl"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    metadata += "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA", metadata)
    return path


def test_staged_wheel_requirements_are_checked_against_the_gpu_machine(tmp_path):
    make_wheel(tmp_path, "alpha", "1.0", ["beta>=2", "numpy>=99", "nosuchpkg", "pyarrow>=24",
                                          'winonly; sys_platform == "win32"', 'extra-dep; extra == "docs"'])
    make_wheel(tmp_path, "beta", "2.1")
    problems, unverified = gpu_check.check_requirements(tmp_path, gpu_check.gpu_machine_version,
                                                        gpu_check.GPU_MACHINE_MARKERS)
    assert problems == ["alpha needs numpy>=99, found numpy 2.5.2",
                        "alpha needs nosuchpkg: neither staged nor installed"]
    assert unverified == ["alpha needs pyarrow>=24"]  # on the machine, version not known here


def test_only_wheels_this_python_can_install_are_installed(tmp_path):
    pure = make_wheel(tmp_path, "alpha", "1.0")
    other = make_wheel(tmp_path, "beta", "1.0", tag="cp27-cp27m-win32")
    assert gpu_check.installable_wheels(tmp_path) == ([pure], [other])


def test_staged_tokenizer_loads_offline_as_distilbert_base_uncased(tmp_path):
    from transformers import AutoTokenizer

    gpu_check.stage_tokenizer(tmp_path / "hub")
    tokenizer = AutoTokenizer.from_pretrained("distilbert-base-uncased", cache_dir=tmp_path / "hub")
    text, ids = gpu_check.TOKENIZER_PROBE
    assert tokenizer(text)["input_ids"] == ids
    assert tokenizer.model_max_length == 512


def test_best_row_flags_are_train_py_flags():
    from fastpt.config import build_parser, parse_args

    known = build_parser()._option_string_actions
    assert all(f in known for f in gpu_check.BEST_FLAGS if f.startswith("--"))
    parse_args(gpu_check.BEST_FLAGS)  # and valid together
    flags, note = gpu_check.choose_best_flags(Namespace(best_flags=None))
    assert flags == gpu_check.BEST_FLAGS and "BEST_FLAGS" in note
    assert gpu_check.choose_best_flags(Namespace(best_flags="--amp --pack"))[0] == ["--amp", "--pack"]


def test_rows_pair_each_article_configuration_with_lightning():
    args = Namespace(rows=None, no_compile=False, dry=False)
    rows = gpu_check.plan_rows(args, ["--amp", "--compile", "--compile-mode", "reduce-overhead"])
    names = [r.name for r in rows]
    assert names[:6] == ["fp32", "fp32-lightning", "fp16", "fp16-lightning", "fp16-compile", "fp16-compile-lightning"]
    assert [r.pair for r in rows[1:6:2]] == ["fp32", "fp16", "fp16-compile"]
    assert (rows[2].flags, rows[3].flags) == (["--amp"], ["--precision", "16"])
    dry = gpu_check.plan_rows(Namespace(rows="fp16,fp16-lightning", no_compile=False, dry=True), [])
    # bf16 on both sides, as Lightning does on a CPU
    assert [r.flags for r in dry] == [["--amp", "--amp-dtype", "bfloat16"], ["--precision", "bf16"]]
    args = Namespace(rows="best,best-probe", no_compile=True, dry=True)
    assert [(r.name, r.flags) for r in gpu_check.plan_rows(args, ["--amp", "--compile", "--compile-mode", "default"])] \
        == [("best", ["--amp"]), ("best-probe", ["--amp"])]


def test_a_row_that_would_overrun_is_skipped_and_marked(tmp_path):
    args = Namespace(runs_dir=str(tmp_path), data_dir=None, cache_dir=None)
    row = Row("fp32", "fastpt", [])
    gpu_check.run_row(row, DRY, args, Budget(time.time(), budget_s=30, reserve_s=15), done=[])
    assert row.status.startswith(f"skipped: needs ~{1.15 * DRY.prior_s['eager']:.0f} s, 15 s left")
    assert not (tmp_path / "fp32").exists()  # nothing started, nothing half-written
    compiled = Row("fp16-compile", "fastpt", ["--amp", "--compile"], status="ok", wall_s=100.0)
    assert Budget.estimate(Row("best", "fastpt", ["--compile"]), [compiled], DRY) == pytest.approx(115.0)
    assert Budget.estimate(Row("best-full-run", "fastpt", [], kind="full"), [compiled], DRY) == float("inf")
    best = Row("best", "fastpt", ["--amp"], status="ok", wall_s=100.0, result={"samples_per_s": 12.0})
    # its start-up and compile, 3 epochs of 60 at 12/s, 3 x 24 + 24 evaluated at ~3x the training rate
    expected = 1.15 * (100 + 3 * 60 / 12 + (3 * 24 + 24) / 36)
    full = Row("best-full-run", "fastpt", ["--amp"], kind="full")
    assert Budget.estimate(full, [best], DRY) == pytest.approx(expected)


def test_mfu_counts_real_tokens_under_either_results_format():
    rows = [Row("fp32", "fastpt", [], status="ok",
                result={"samples_per_s": 10.0, "mfu": 0.4, "padding_efficiency": 0.5}),
            Row("fp32-lightning", "lightning", [], pair="fp32", status="ok",
                result={"samples_per_s": 8.0, "real_tokens_per_s": 100.0, "mfu": 0.3})]
    ours, theirs = (gpu_check.figures(r, rows, DRY) for r in rows)
    assert ours["mfu_real"] == pytest.approx(0.2)  # counted over padded tokens: scaled to the real ones
    assert theirs["mfu_real"] == pytest.approx(0.3)  # real_tokens_per_s present: mfu already counts real tokens
    assert theirs["fastpt_over_lightning"] == pytest.approx(1.25)
    assert ours["article_train_min"] == pytest.approx(3 * 35_000 / 10 / 60)


@pytest.mark.slow  # three short training processes on the tiny model: about a minute on 2 busy cores
def test_dry_run_stages_and_runs_the_gpu_check_end_to_end(imdb_dir, tmp_path):
    """Staging as for the GPU machine (wheels only from the local cache: no download in tests),
    then the check itself: Lightning paired with fastpt, the probe, the full run, the report."""
    out, stage = tmp_path / "out", tmp_path / "stage"
    env = {**os.environ, "PYTHON": sys.executable, "FASTPT_CACHE_DIR": str(tmp_path / "cache")}
    command = ["bash", "scripts/gpu_check.sh", "--dry", "--offline", "--wheel-cache", str(ROOT / ".cache" / "wheels"),
               "--stage", str(stage), "--data-dir", str(imdb_dir), "--out", str(out),
               "--runs-dir", str(tmp_path / "runs"),
               "--rows", "fp32-lightning,best-probe,best-full-run", "--no-compile"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]

    assert sorted(p.name for p in out.iterdir()) == [
        "gpu_check.json", "gpu_check.log", "gpu_check.md", "gpu_check.png", "profile.txt"]  # flat, under 8 files
    assert (stage / "data" / "aclImdb_v1.tar.gz").is_file()
    report = json.loads((out / "gpu_check.json").read_text())
    rows = {r["name"]: r for r in report["rows"]}
    assert {name: r["status"] for name, r in rows.items()} == dict.fromkeys(rows, "ok")
    assert report["setup"]["tokenizer"].startswith("ok")  # the staged cache, offline, gave the BERT ids
    wheels = report["setup"].get("staged_wheels")
    assert wheels is None or "requirements all met" in wheels
    assert rows["fp32-lightning"]["figures"]["samples_per_s"] > 0
    probe = rows["best-probe"]["probe"]
    assert probe["passed"] and probe["steps"] == sum(DRY.probe_window) + 1
    assert probe["sync_window"] == [4, 6] and probe["profile_window"] == [7, 8]
    assert "Self CPU" in (out / "profile.txt").read_text()
    assert rows["best-full-run"]["results"]["epochs_run"] == 3
    md = (out / "gpu_check.md").read_text()
    assert "| fp32-lightning | lightning | `--precision 32` |" in md
    assert "passed: no synchronising call" in md and "## The best configuration's full run" in md
