"""A warm compile cache serves a second run: what fastpt changes for that (speedups/compile.py), the counters
results.json reports (`compile_cache`), and two real runs sharing one Inductor cache (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters
from torch._functorch._aot_autograd.autograd_cache import BypassAOTAutogradCache, check_cacheable

from fastpt.monitoring import metrics
from fastpt.speedups import backends


ROOT = Path(__file__).resolve().parent.parent


def graph_of_a_step_entering_autocast():
    """The Dynamo graph of a function that enters autocast itself, as `--compile-scope whole` compiles the step."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def step(x, weight):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return (x @ weight).float().sum()

    torch._dynamo.reset()
    torch.compile(step, backend=keep, fullgraph=True)(torch.randn(4, 4), torch.randn(4, 4))
    return graphs[0]


def test_a_step_entering_autocast_is_cacheable_while_a_compiled_run_lasts(tmp_path):
    gm = graph_of_a_step_entering_autocast()
    assert any(node.target is torch.amp.autocast_mode._enter_autocast for node in gm.graph.nodes)
    with pytest.raises(BypassAOTAutogradCache, match="_enter_autocast"):  # torch 2.13 as it comes
        check_cacheable(gm)
    cfg = SimpleNamespace(compile=True, deterministic=False, tf32=False)
    specialize_float = torch._dynamo.config.specialize_float
    backends.configure(cfg, torch.device("cpu"), tmp_path)
    try:
        check_cacheable(gm)  # no bypass: AOTAutograd caches the graph
        assert torch._dynamo.config.specialize_float  # floats as constants: no "tensorify" restart
    finally:
        backends.restore(cfg)
    with pytest.raises(BypassAOTAutogradCache):  # the process as it was
        check_cacheable(gm)
    assert torch._dynamo.config.specialize_float == specialize_float


def test_inductors_vector_isa_checks_pass_once_per_machine(tmp_path, monkeypatch):
    """A check that passed is answered from the cache in later runs; one that failed is made again."""
    from torch._inductor import cpu_vec_isa

    made = []

    def inductors_check(isa, code):  # stands in for the build and the load in a new process
        made.append(code)
        return code == "passes"

    monkeypatch.setattr(cpu_vec_isa.VecISA, "check_build", inductors_check)
    cfg = SimpleNamespace(compile=True, deterministic=False, tf32=False)
    isa = cpu_vec_isa.VecAVX2()
    for run in ("first", "second"):
        backends.configure(cfg, torch.device("cpu"), tmp_path)
        try:
            assert [isa.check_build(code) for code in ("passes", "fails", "passes")] == [True, False, True]
        finally:
            backends.restore(cfg)
        assert cpu_vec_isa.VecISA.check_build is inductors_check  # Inductor's own again
    assert made == ["passes", "fails", "fails"]  # the first run made each once; the second, only the failed one
    assert len(json.loads(next((tmp_path / "vec-isa").glob("*.json")).read_text())["passed"]) == 1


def compiled_sums(sizes: list) -> tuple:
    """(graphs compiled, largest error against a float64 sum) for a float32 sum over a dynamic token
    dimension: the bias gradient of a layer, over the tokens of a packed batch (sums of about 200)."""
    torch._dynamo.reset()
    counters.clear()
    summed = torch.compile(lambda x: (x * 2).sum(0), dynamic=True)
    errors = []
    for n in sizes:
        x = torch.randn(n, 8, generator=torch.Generator().manual_seed(n))
        errors.append(float((summed(x).double() - (x.double() * 2).sum(0)).abs().max()))
    return metrics.compiled_graph_count(), max(errors)


def test_one_cpu_graph_serves_sums_over_any_number_of_tokens(tmp_path, monkeypatch):
    """Inductor picks the plain or the chunked float32 sum on the CPU by size (4,096) and guarded
    the first batch's choice: a batch of more tokens than the first side of 4,096 compiled again."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "before"))  # nothing found on disk
    assert compiled_sums([3000, 5000])[0] == 2  # Inductor's own rule: a second graph
    cfg = SimpleNamespace(compile=True, deterministic=False, tf32=False)
    backends.configure(cfg, torch.device("cpu"), tmp_path)
    try:
        graphs, error = compiled_sums([3000, 5000, 1000, 9000])
    finally:
        backends.restore(cfg)
        torch._dynamo.reset()
    assert graphs == 1 and error < 1e-3
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "after"))
    assert compiled_sums([3000, 5000])[0] == 2  # restored with the run's end
    torch._dynamo.reset()


def test_the_compile_clock_reports_this_runs_cache_events(monkeypatch):
    monkeypatch.setitem(counters, "inductor", counters["inductor"].copy())
    monkeypatch.setitem(counters, "aot_autograd", counters["aot_autograd"].copy())
    counters["inductor"]["fxgraph_cache_hit"] += 5  # an earlier run in this process
    clock = metrics.CompileClock()
    counters["inductor"]["fxgraph_cache_hit"] += 2
    counters["inductor"]["fxgraph_cache_miss"] += 1
    counters["aot_autograd"]["autograd_cache_bypass"] += 1
    assert clock.cache == {"fxgraph_hit": 2, "fxgraph_miss": 1, "fxgraph_bypass": 0,
                           "autograd_hit": 0, "autograd_miss": 0, "autograd_bypass": 1}


def test_the_compile_clock_reports_torchs_own_compile_time_of_this_run(monkeypatch):
    from torch._dynamo.utils import cumulative_time_spent_ns

    monkeypatch.setattr(sys.modules["torch._dynamo.utils"], "cumulative_time_spent_ns",
                        type(cumulative_time_spent_ns)(float, {"entire_frame_compile": 4e9}))  # an earlier run's
    clock = metrics.CompileClock()
    utils = sys.modules["torch._dynamo.utils"]
    utils.cumulative_time_spent_ns["entire_frame_compile"] += 2.5e9  # a forward traced and compiled
    utils.cumulative_time_spent_ns["entire_backward_compile"] += 1e9  # its backward
    utils.cumulative_time_spent_ns["inductor_compile"] += 3e9  # inside the two above: not counted again
    assert clock.torch_seconds == pytest.approx(3.5)


@pytest.mark.slow  # two runs that compile (the first cold): minutes on a loaded 2-core CPU
def test_a_second_run_finds_every_graph_in_the_compile_cache(imdb_dir, cache_dir, tmp_path):
    """Packed, bfloat16 autocast, layer by layer (the default scope): the warm run misses nothing."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    results = []
    for name in ("cold", "warm"):
        out = tmp_path / name
        subprocess.run([sys.executable, "train.py", "--model", "tiny", "--data-dir", str(imdb_dir), "--cache-dir",
                        str(cache_dir), "--max-length", "32", "--batch-size", "8", "--epochs", "1", "--max-steps",
                        "2", "--val-size", "8", "--test-size", "8", "--pack", "--amp", "--amp-dtype", "bfloat16",
                        "--compile", "--no-progress", "--no-tensorboard", "--out", str(out)],
                       cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        results.append(json.loads((out / "results.json").read_text()))
    cold, warm = (r["compile_cache"] for r in results)
    assert cold["fxgraph_miss"] > 0 and cold["autograd_miss"] > 0 and cold["fxgraph_hit"] == 0
    # Forward and backward of the training layer, the evaluation layer: all found, nothing bypassed.
    assert warm["fxgraph_hit"] == cold["fxgraph_miss"] and warm["autograd_hit"] == cold["autograd_miss"]
    assert warm["fxgraph_miss"] == warm["autograd_miss"] == warm["fxgraph_bypass"] == warm["autograd_bypass"] == 0
    assert 0 < results[1]["compile_torch_s"] < results[0]["compile_torch_s"] <= results[0]["compile_time_s"]
    assert results[0]["compiled_graphs"] == results[1]["compiled_graphs"] == 2  # train and eval: one layer graph each
    # the cached graphs compute what the compiled ones did
    assert results[1]["test_loss"] == pytest.approx(results[0]["test_loss"], rel=1e-5)
