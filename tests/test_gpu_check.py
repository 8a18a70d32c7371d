"""The prepared GPU check (scripts/device_stage.sh, gpu_check.sh, the gpu_check package) on the CPU.

A GPU is lent only now and then, so the check must work the first time it meets one: its dry
run stages everything as for the offline GPU machine and runs the same script end to end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from argparse import Namespace
from types import SimpleNamespace
from dataclasses import dataclass, field
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from gpu_check import plan, report, stage  # noqa: E402
from gpu_check.plan import DRY, GPU, START_MARGIN, Budget, Row  # noqa: E402


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
    problems, unverified = stage.check_requirements(tmp_path, stage.gpu_machine_version,
                                                    stage.GPU_MACHINE_MARKERS)
    assert problems == ["alpha needs numpy>=99, found numpy 2.5.2",
                        "alpha needs nosuchpkg: neither staged nor installed"]
    assert unverified == ["alpha needs pyarrow>=24"]  # on the machine, version not known here


def test_only_wheels_this_python_can_install_are_installed(tmp_path):
    pure = make_wheel(tmp_path, "alpha", "1.0")
    other = make_wheel(tmp_path, "beta", "1.0", tag="cp27-cp27m-win32")
    assert stage.installable_wheels(tmp_path) == ([pure], [other])


def test_staged_tokenizer_loads_offline_as_distilbert_base_uncased(tmp_path):
    from transformers import AutoTokenizer

    stage.stage_tokenizer(tmp_path / "hub")
    tokenizer = AutoTokenizer.from_pretrained("distilbert-base-uncased", cache_dir=tmp_path / "hub")
    text, ids = stage.TOKENIZER_PROBE
    assert tokenizer(text)["input_ids"] == ids
    assert tokenizer.model_max_length == 512


def test_best_row_flags_are_train_py_flags():
    from fastpt.cli.args import build_parser, parse_args

    known = build_parser()._option_string_actions
    assert all(f in known for f in plan.BEST_FLAGS if f.startswith("--"))
    parse_args(plan.BEST_FLAGS)  # and valid together
    for mode in (GPU, DRY):  # at each mode's --max-length, which bounds --pack-multiple
        best = plan.plan_rows(Namespace(rows="best", no_compile=False, dry=mode is DRY), plan.BEST_FLAGS)
        parse_args(["--max-length", str(mode.max_length), *best[0].flags])
    flags, note = plan.choose_best_flags(Namespace(best_flags=None))
    assert flags == plan.BEST_FLAGS and "BEST_FLAGS" in note
    assert plan.choose_best_flags(Namespace(best_flags="--amp --pack"))[0] == ["--amp", "--pack"]


def test_rows_run_by_value_and_pair_each_article_configuration_with_lightning():
    args = Namespace(rows=None, no_compile=False, dry=False)
    rows = plan.plan_rows(args, ["--amp", "--compile", "--compile-mode", "reduce-overhead"])
    names = [r.name for r in rows]
    # fastpt's headline first (the full run and the probe reuse the best row's warm cache), then the pairs
    assert names == ["best", "best-full-run", "best-probe", "fp32", "fp32-lightning", "fp16", "fp16-lightning",
                     "fp16-compile", "fp16-compile-lightning", "deepspeed"]
    assert [r.pair for r in rows[4:9:2]] == ["fp32", "fp16", "fp16-compile"]
    assert (rows[5].flags, rows[6].flags) == (["--amp"], ["--precision", "16"])
    dry = plan.plan_rows(Namespace(rows="fp16,fp16-lightning", no_compile=False, dry=True), [])
    # bf16 on both sides, as Lightning does on a CPU
    assert [r.flags for r in dry] == [["--amp", "--amp-dtype", "bfloat16"], ["--precision", "bf16"]]
    args = Namespace(rows="best,best-probe", no_compile=True, dry=True)
    assert [(r.name, r.flags) for r in plan.plan_rows(args, ["--amp", "--compile", "--compile-mode", "default"])] \
        == [("best", ["--amp"]), ("best-probe", ["--amp"])]


def test_a_row_starts_only_where_its_estimate_with_the_margin_fits():
    prior = DRY.prior_s["eager"]  # nothing run yet: the prior
    started = []
    for left, expected in ((START_MARGIN * prior - 1, None), (START_MARGIN * prior + 1, START_MARGIN * prior + 1)):
        row = Row("fp32", "fastpt", [])
        budget = Budget(0.0, budget_s=left + 15, reserve_s=15, clock=lambda: 0.0)
        plan.run_rows([row], DRY, budget, lambda r, timeout: started.append((r.name, timeout)))
        if expected is None:
            assert row.status == (f"skipped for time: needs ~{prior:.0f} s (x1.5: {1.5 * prior:.0f} s), "
                                  f"{left:.0f} s left")
        else:
            assert row.status == "pending" and row.estimate_s == prior  # handed to the launcher
    # started with all the time left: a row that runs as estimated is never stopped by its timeout
    assert started == [("fp32", pytest.approx(START_MARGIN * prior + 1))]


def test_estimates_come_from_the_rows_before():
    compiled = Row("fp16-compile", "fastpt", ["--amp", "--compile"], status="ok", wall_s=100.0,
                   result={"samples_per_s": 50.0, "compile_time_s": 60.0})
    assert Budget.estimate(Row("other", "fastpt", ["--compile"]), [compiled], DRY) == pytest.approx(100.0)
    assert Budget.estimate(Row("best-full-run", "fastpt", [], kind="full"), [compiled], DRY) == float("inf")
    # the probe: the same flags again, compiled from the cache the first run left (half its compile time)
    assert Budget.estimate(Row("probe", "fastpt", ["--amp", "--compile"], kind="probe"), [compiled], DRY) \
        == pytest.approx(100 - 0.5 * 60)
    # The full run: the short run again from a warm cache, 3 epochs of 60 at 12/s, 3 x 24 + 24 evaluated at
    # the validation rate without compiling (48 reviews in 2 s: 24/s), not val_time_s (26 s, compiling).
    result = {"samples_per_s": 12.0, "compile_time_s": 40.0, "val_time_s": 26.0, "val_time_no_compile_s": 2.0,
              "val_examples": 48, "epochs_run": 1}
    best = Row("best", "fastpt", ["--amp", "--compile"], status="ok", wall_s=100.0, result=result)
    full = Row("best-full-run", "fastpt", ["--amp", "--compile"], kind="full")
    expected = (100 - 0.5 * 40) + 3 * 60 / 12 + (3 * 24 + 24) / 24
    assert Budget.estimate(full, [best], DRY) == pytest.approx(expected)
    # results.json from before val_time_no_compile_s: a compiled run's val_time_s is no rate (~3x training's)
    old = Row("best", "fastpt", ["--amp", "--compile"], status="ok", wall_s=100.0,
              result={k: v for k, v in result.items() if k != "val_time_no_compile_s"})
    assert Budget.estimate(full, [old], DRY) == pytest.approx(expected - 4 + 96 / 36)


def test_validation_time_leaves_out_only_the_calls_that_compiled(monkeypatch):
    """The full run's estimate reads val_time_no_compile_s (val_time_s less each validation's `compile_s`): the
    host time of exactly the evaluation calls that compiled a graph. A real Dynamo compile, on a clock that
    gives each call one second."""
    import torch

    from fastpt.loop import evaluation
    from fastpt.monitoring import metrics

    now = [0.0]
    clock = SimpleNamespace(perf_counter=lambda: now[0])
    monkeypatch.setattr(evaluation, "time", clock)
    monkeypatch.setattr(metrics, "time", clock)
    model = torch.nn.Linear(4, 2)

    def sums_of(model, batch):  # evaluation's layout: loss, correct, weight, loss weight, a 2 x 2 confusion
        logits = model(batch["x"])
        return torch.cat([logits.sum().reshape(1), torch.zeros(7)]).double(), logits, logits.argmax(-1)

    compiled = torch.compile(sums_of, backend="eager", fullgraph=True)

    def eval_sums(model, batch):
        now[0] += 1.0
        return compiled(model, batch)

    strategy = SimpleNamespace(model=model, train=model.train, to_device=lambda batch: batch,
                               device=torch.device("cpu"))
    batches = [{"x": torch.randn(3, 4)} for _ in range(3)]
    compile_clock = metrics.CompileClock()
    first, second = (evaluation.evaluate(strategy, batches, eval_sums, compile_clock=compile_clock) for _ in range(2))
    assert compile_clock.graphs == 1
    assert (first["time_s"], first["compile_s"]) == (3.0, 1.0)  # three calls, the first compiled
    assert (second["time_s"], second["compile_s"]) == (3.0, 0.0)  # the graph is reused: nothing compiled


# --------------------------------------------------------------------------- the planner, simulated

STEP_S = {"best": 0.004, "fp32": 0.075, "fp16": 0.015, "fp16-compile": 0.01, "deepspeed": 0.02}  # on a GPU


@dataclass
class CostModel:
    """A row's wall time on the GPU: set-up, the configuration's compile, its steps and evaluation."""
    compile_s: float  # a configuration's first compile, training and evaluation graphs
    warm_share: float = 0.15  # a compile again from a warm Inductor cache (compile-cache-cpu.md: 7.2 of 49.7 s)
    setup_s: float = 45.0  # wheels, tokenizer, token cache, import checks: before the first row
    startup_s: float = 15.0  # one process: imports, CUDA context, model, data
    step_s: dict = field(default_factory=lambda: dict(STEP_S))  # batch of 12; evaluation: a third per review
    compiled: set = field(default_factory=set)  # configurations whose compiled graphs are in the cache

    def run(self, row: Row) -> tuple[float, dict]:
        config = row.pair or row.name.removesuffix("-full-run").removesuffix("-probe")
        step_s = self.step_s[config] * (1.1 if row.framework == "lightning" else 1.0)
        compile_s = 0.0
        if row.compiled:
            key = (row.framework, tuple(row.flags))
            compile_s = self.compile_s * (self.warm_share if key in self.compiled else 1.0)
            self.compiled.add(key)
        epochs, val, test = ((3, GPU.full["validation"], GPU.full["test"]) if row.kind == "full"
                             else (1, GPU.val_size, GPU.test_size))
        steps = {"full": 3 * GPU.full["train"] // 12, "probe": sum(GPU.probe_window) + 1}.get(row.kind, GPU.steps)
        review_s = step_s / 12 / 3
        wall = (self.startup_s + (10 if row.framework == "lightning" else 0) + compile_s + steps * step_s
                + (epochs * val + test) * review_s)
        eval_compile_s = compile_s / 3
        return wall, {"samples_per_s": 12 / step_s, "compile_time_s": compile_s if row.compiled else None,
                      "val_time_s": epochs * val * review_s + eval_compile_s,
                      "val_time_no_compile_s": epochs * val * review_s, "val_examples": val, "epochs_run": epochs}


def simulate(cost: CostModel) -> tuple[list[Row], list[dict], Budget]:
    """The real planner (run_rows, Budget) over every GPU row, with a fake clock and rows that cost `cost`."""
    now = [cost.setup_s]
    budget = Budget(0.0, GPU.budget_s, clock=lambda: now[0])
    started = []

    def launch(row: Row, timeout: float) -> None:
        started.append({"name": row.name, "left": budget.left(), "estimate": row.estimate_s, "timeout": timeout})
        wall, result = cost.run(row)
        row.wall_s = min(wall, timeout)
        now[0] += row.wall_s
        row.status, row.result = ("ok", result) if wall <= timeout else ("failed: timed out", {})

    rows = plan.plan_rows(Namespace(rows=None, no_compile=False, dry=False), list(plan.BEST_FLAGS))
    plan.run_rows(rows, GPU, budget, launch)
    return rows, started, budget


@pytest.mark.parametrize("warm_share", [0.15, 1.0])
@pytest.mark.parametrize("compile_s", [30, 60, 120])
def test_planner_measures_the_best_row_and_its_full_run_whenever_they_fit(compile_s, warm_share):
    cost = CostModel(compile_s, warm_share)
    headline = [cost.run(Row("best", "fastpt", plan.BEST_FLAGS))[0],
                cost.run(Row("best-full-run", "fastpt", plan.BEST_FLAGS, kind="full"))[0]]
    cost.compiled.clear()
    rows, started, budget = simulate(cost)
    status = {r.name: r.status for r in rows}
    assert cost.setup_s + sum(headline) <= budget.deadline  # they fit: both must be measured
    assert status["best"] == status["best-full-run"] == "ok", status
    for s in started:  # nothing started that the estimate says cannot finish, nor given a timeout that stops it
        assert START_MARGIN * s["estimate"] <= s["left"] and s["timeout"] >= START_MARGIN * s["estimate"]
    assert not [name for name, st in status.items() if st.startswith("failed")]
    assert sum(r.wall_s for r in rows if r.wall_s) + cost.setup_s <= budget.deadline
    assert all(st == "ok" or st.startswith("skipped for time") for st in status.values())


def test_planner_skips_for_time_what_does_not_fit():
    """A budget too short for the full run: it is skipped, not started to be killed at the deadline."""
    cost = CostModel(120)
    cost.setup_s = GPU.budget_s - 15 - 150 * START_MARGIN  # just enough for the best row's prior, with margin
    rows, started, _ = simulate(cost)
    status = {r.name: r.status for r in rows}
    assert [s["name"] for s in started][0] == "best" and status["best"] == "ok"
    assert status["best-full-run"].startswith("skipped for time")
    assert not [st for st in status.values() if st.startswith("failed")]


def test_mfu_counts_real_tokens_under_either_results_format():
    rows = [Row("fp32", "fastpt", [], status="ok",
                result={"samples_per_s": 10.0, "mfu": 0.4, "padding_efficiency": 0.5}),
            Row("fp32-lightning", "lightning", [], pair="fp32", status="ok",
                result={"samples_per_s": 8.0, "real_tokens_per_s": 100.0, "mfu": 0.3})]
    ours, theirs = (report.figures(r, rows, DRY) for r in rows)
    assert ours["mfu_real"] == pytest.approx(0.2)  # counted over padded tokens: scaled to the real ones
    assert theirs["mfu_real"] == pytest.approx(0.3)  # real_tokens_per_s present: mfu already counts real tokens
    assert theirs["fastpt_over_lightning"] == pytest.approx(1.25)
    assert ours["article_train_min"] == pytest.approx(3 * 35_000 / 10 / 60)


@pytest.mark.slow  # 93 s of a 2-core CI run: the default set keeps the GPU check's table and budget tests
def test_dry_run_stages_and_runs_the_gpu_check_end_to_end(imdb_dir, tmp_path):
    """Staging as for the GPU machine (wheels only from the local cache: no download in tests),
    then the check itself: Lightning paired with fastpt, the probe, the full run, the report."""
    out, stage = tmp_path / "out", tmp_path / "stage"
    env = {**os.environ, "PYTHON": sys.executable, "FASTPT_CACHE_DIR": str(tmp_path / "cache")}
    command = ["bash", "scripts/gpu_check.sh", "--dry", "--offline", "--wheel-cache", str(ROOT / ".cache" / "wheels"),
               "--stage", str(stage), "--data-dir", str(imdb_dir), "--out", str(out),
               "--runs-dir", str(tmp_path / "runs"),
               "--rows", "fp32-lightning,best,best-probe,best-full-run", "--no-compile"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]

    assert sorted(p.name for p in out.iterdir()) == [
        "gpu_check.json", "gpu_check.log", "gpu_check.md", "gpu_check.png", "profile.txt"]  # flat, under 8 files
    assert (stage / "data" / "aclImdb_v1.tar.gz").is_file()
    written = json.loads((out / "gpu_check.json").read_text())
    rows = {r["name"]: r for r in written["rows"]}
    assert {name: r["status"] for name, r in rows.items()} == dict.fromkeys(rows, "ok")
    assert written["setup"]["tokenizer"].startswith("ok")  # the staged cache, offline, gave the BERT ids
    wheels = written["setup"].get("staged_wheels")
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
