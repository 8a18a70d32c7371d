"""The measured matmul peak behind MFU on a CPU (fastpt/monitoring/peak.py): measured, cached per
machine as plain JSON, and re-measured when the cached file is not this user's, not this key's or
older than ten minutes."""

from __future__ import annotations

import json
import os

import pytest
import torch

from fastpt.monitoring import peak


@pytest.fixture(autouse=True)
def short_probe(monkeypatch):
    monkeypatch.setattr(peak, "PROBE_S", 0.02)
    monkeypatch.setattr(peak, "SQUARE", 256)


def cached_files(root):
    return sorted((root / "peak").glob("peak-*.json"))


def test_the_probe_measures_the_model_shapes_and_a_square_one_and_caches_them(tmp_path):
    first = peak.measured_peak(torch.device("cpu"), torch.float32, 64, tmp_path)
    assert first["source"] == "measured at the start of this run"
    (m1, k1, n1), (m2, k2, n2) = [s["mnk"] for s in first["shapes"]]
    assert (k1, n1, k2, n2) == (64, 256, 256, 256) and 32 <= m1 <= 4096 and 32 <= m2 <= 256
    assert first["flops_per_s"] == max(s["flops_per_s"] for s in first["shapes"]) > 0
    [path] = cached_files(tmp_path)
    again = peak.measured_peak(torch.device("cpu"), torch.float32, 64, tmp_path)
    assert again["source"].startswith("measured earlier") and again["flops_per_s"] == first["flops_per_s"]
    # Another precision, thread count or width is another machine setting: measured, not reused.
    peak.measured_peak(torch.device("cpu"), torch.bfloat16, 64, tmp_path)
    peak.measured_peak(torch.device("cpu"), torch.float32, 32, tmp_path)
    assert len(cached_files(tmp_path)) == 3
    assert json.loads(path.read_text())["key"]["threads"] == torch.get_num_threads()


def test_in_bfloat16_on_a_cpu_the_prepacked_product_is_probed_too_and_computes_the_same():
    """Where fastpt-predict prepacks bfloat16 weights (speedups/prepacked.py), the probe times that product
    beside torch.mm at each shape, the peak the faster; it computes what torch.mm does."""
    from fastpt.speedups.prepacked import prepacking_pays

    cpu = torch.device("cpu")
    assert peak.kernels(cpu, torch.float32) == ["mm"]
    found = peak.measured_peak(cpu, torch.bfloat16, 64, None)
    kernels = ["mm", "prepacked"] if prepacking_pays(cpu, torch.bfloat16) else ["mm"]
    assert [(s["mnk"][1:], s["kernel"]) for s in found["shapes"]] == [
        ([k, n], kernel) for _, k, n in peak.probe_shapes(64) for kernel in kernels]
    assert found["flops_per_s"] == max(s["flops_per_s"] for s in found["shapes"]) > 0
    if kernels == ["mm"]:
        pytest.skip("oneDNN has no bfloat16 kernels on this CPU: nothing prepacked to probe")
    a, b = torch.randn(33, 64).bfloat16(), torch.randn(64, 48).bfloat16()
    assert torch.equal(peak._prepacked_product(b)(a), torch.mm(a, b))


def test_the_rate_is_the_matmul_flops_over_its_time(monkeypatch):
    clock = iter(float(t) for t in range(1000))
    monkeypatch.setattr(peak.time, "perf_counter", lambda: next(clock))  # every call: one second later
    # first timed call: 1 s, so one repetition per timing (1 s each): 2 * m * k * n FLOPs per second
    assert peak.matmul_flops_per_s(8, 4, 2, torch.float32, torch.device("cpu")) == (2 * 8 * 4 * 2, 8)


def test_a_slow_precision_is_probed_on_fewer_rows(monkeypatch):
    """32 rows take a whole (fake) second, 50x the time a timing may take: the full 4096 rows are never run."""
    clock = iter(float(t) for t in range(1000))
    monkeypatch.setattr(peak.time, "perf_counter", lambda: next(clock))
    calls = []
    monkeypatch.setattr(peak.torch, "mm", lambda a, b: calls.append(a.shape[0]))
    rate, rows = peak.matmul_flops_per_s(4096, 16, 16, torch.float32, torch.device("cpu"))
    assert rows == peak.CALIBRATION_ROWS and max(calls) == peak.CALIBRATION_ROWS
    assert rate == 2 * rows * 16 * 16


@pytest.mark.parametrize("tamper", ["garbage", "other key", "zero", "too old", "from the future", "other user"])
def test_a_cached_figure_that_cannot_be_trusted_is_measured_again(tmp_path, tamper):
    peak.measured_peak(torch.device("cpu"), torch.float32, 64, tmp_path)
    [path] = cached_files(tmp_path)
    found = json.loads(path.read_text())
    if tamper == "garbage":
        path.write_text("{not json")
    elif tamper == "other key":
        found["key"]["threads"] += 1
        found["flops_per_s"] = 1e30
        path.write_text(json.dumps(found))
    elif tamper == "zero":
        found["flops_per_s"] = 0
        path.write_text(json.dumps(found))
    elif tamper in ("too old", "from the future"):  # the machine's speed drifts: an old figure is measured again
        found["measured_at"] += -peak.MAX_AGE_S - 1 if tamper == "too old" else 60
        found["flops_per_s"] = 1e30
        path.write_text(json.dumps(found))
    else:
        found["flops_per_s"] = 1e30
        path.write_text(json.dumps(found))
        if os.getuid() != 0:
            pytest.skip("giving a file to another user needs root")
        os.chown(path, 4321, -1)
    again = peak.measured_peak(torch.device("cpu"), torch.float32, 64, tmp_path)
    assert again["source"] == "measured at the start of this run" and 0 < again["flops_per_s"] < 1e30


def test_without_a_cache_folder_it_still_measures(tmp_path):
    assert peak.measured_peak(torch.device("cpu"), torch.float32, 16, None)["flops_per_s"] > 0


def test_the_cpu_identity_names_the_model_and_a_digest_of_its_flags():
    cpu = peak.cpu_identity()
    assert cpu["model"] and len(cpu["flags_sha1"]) == 12
    assert cpu["capability"] == torch.backends.cpu.get_cpu_capability()


def test_the_probe_leaves_the_random_state_alone(tmp_path):
    """A run whose peak was cached and one that measured it draw the same dropout masks."""
    torch.manual_seed(0)
    expected = torch.rand(4)
    torch.manual_seed(0)
    peak.measured_peak(torch.device("cpu"), torch.float32, 16, tmp_path)
    assert torch.equal(torch.rand(4), expected)
