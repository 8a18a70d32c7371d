"""The device's matmul peak, measured: the denominator of MFU where no vendor figure applies.

MFU needs the device's dense peak FLOP/s at the run's precision. For the GPUs fastpt knows
(metrics.PEAK_FLOPS) that is the vendor's figure. For a CPU there is no such figure to look up: the
same model name runs with 2 cores or 64, with or without AMX tiles, and bfloat16 is a native
instruction on some and emulated on others (AVX2). So fastpt measures it: a short matmul probe at
the run's precision, on the model's own shapes (tokens x hidden @ hidden x 4*hidden, the
feed-forward layer, the largest matmul of a step) and a square 2048 x 2048, with the run's thread
count; the best rate is the peak. On a CPU in bfloat16 the probe also times oneDNN's product on a
weight prepacked once into its blocked layout (what fastpt-predict's linear layers run,
speedups/prepacked.py), where `torch.mm` hands it the plain layout; the faster of the two is the
peak. On a 2-core AVX512-BF16 EPYC the prepacked product ran as fast as `torch.mm` at MiniLM's
feed-forward shape and 1.11-1.17x faster at the square one and at DistilBERT's shapes
(results.json's `peak_probe` lists each shape's and kernel's rate), so a peak from `torch.mm` alone
made fastpt-predict's bfloat16 rows look closer to the peak than they were. Every rank of a job on
one host probes at the same time, so ranks that share the cores share them in the probe too.

What it costs: about a second (two for bfloat16 on a CPU), at most once every ten minutes per
machine setting: the figure is cached as JSON under the cache folder (`<cache dir>/peak/`), keyed
by the CPU (model and flags), torch's version, the thread count, ranks per host, the precision, the
shapes and the kernels, with the time it was measured. An older figure is measured again, because a
machine's matmul speed drifts: on the 2-core VM this project measures on, the bf16 probe gave 1.0
TFLOP/s at 02:19 and 07:20 UTC and 0.53-0.60 at 09:45 on 2026-12-03, so a figure kept from a fast
hour understated a slow hour's MFU by 40%. The file records each shape's and kernel's rate next to
the peak, so a reader sees what was measured. A file another user wrote, one in a folder others can
change, or one that does not parse, is measured again (a wrong peak would only mislead, but nothing
in a shared folder is trusted), and the cache is written the way a shared folder needs
(`write_cached`: no name someone else chose is ever written through).

This is an achieved peak, not a datasheet one: MFU against it says how much of what this
machine's matmuls reach the step uses, which is the question a CPU run asks.
"""

import contextlib
import hashlib
import json
import os
import platform
import time
from pathlib import Path
from typing import Optional

import torch

from fastpt.errors import DiskFull
from fastpt.files import checkpoint, trust
from fastpt.monitoring.metrics import synchronize

SQUARE = 2048
PROBE_S = 0.25  # seconds per timing; the best of three timings per shape
CALIBRATION_ROWS = 32  # the first, small product: how fast this precision is on this device
CACHE_LIMIT = 1 << 20  # bytes: a cached figure is a few hundred
MAX_AGE_S = 600  # a cached figure older than this is measured again (the machine's speed drifts)


def cpu_identity() -> dict:
    """The CPU's model name and instruction-set flags (Linux /proc/cpuinfo; platform's name elsewhere)."""
    info = {}  # each key's first value: every core repeats them
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    model = info.get("model name") or platform.processor() or platform.machine()
    flags = info.get("flags") or info.get("Features", "")  # x86's name, Arm's
    return {"model": model, "flags_sha1": hashlib.sha1(flags.encode()).hexdigest()[:12],
            "capability": torch.backends.cpu.get_cpu_capability()}


def probe_shapes(hidden: int) -> list[tuple[int, int, int]]:
    """(m, k, n) of the probe: the feed-forward matmul of 4096 tokens, and a square one."""
    return [(4096, hidden, 4 * hidden), (SQUARE, SQUARE, SQUARE)]


def matmul_flops_per_s(m: int, k: int, n: int, dtype: torch.dtype, device: torch.device,
                       prepacked: bool = False) -> tuple[float, int]:
    """(the best rate of an (m' x k) @ (k x n) matmul over up to three timings of about PROBE_S, m'), by
    `torch.mm` or, `prepacked`, oneDNN's kernel on (k x n) prepacked once.

    m' <= m: a few rows first measure how fast this precision is here, and the rows are cut so one
    product takes about PROBE_S. Emulated float16 / bfloat16 (a CPU without AVX512-FP16 / BF16)
    can be a hundred times slower than float32: the full shape would take minutes.
    """
    g = torch.Generator(device).manual_seed(0)  # its own: the run's random state (dropout masks) stays untouched
    b = torch.randn(k, n, device=device, generator=g).to(dtype)
    by_b = _prepacked_product(b) if prepacked else lambda a: torch.mm(a, b)
    few = min(m, CALIBRATION_ROWS)
    a = torch.randn(few, k, device=device, generator=g).to(dtype)
    _seconds(by_b, a, device)  # first call: oneDNN / cuBLAS picks and prepares its kernel
    rate = 2 * few * k * n / max(_seconds(by_b, a, device), 1e-9)
    rows = int(min(m, max(few, PROBE_S * rate / (2 * k * n))))
    if rows > few:
        a = torch.randn(rows, k, device=device, generator=g).to(dtype)
        _seconds(by_b, a, device)
    once = max(_seconds(by_b, a, device), 1e-6)
    reps = max(1, int(PROBE_S / once))
    timings = 3 if once < PROBE_S else 1  # a slow matmul: one timing is enough
    return max(2 * rows * k * n * reps / _seconds(by_b, a, device, reps) for _ in range(timings)), rows


def _prepacked_product(b: torch.Tensor):
    """a -> a @ b by oneDNN on b in its blocked layout, as speedups/prepacked.py's PrepackedLinear runs."""
    weight = torch.ops.mkldnn._reorder_linear_weight(b.t().contiguous())
    return lambda a: torch.ops.mkldnn._linear_pointwise(a, weight, None, "none", [], "")


def kernels(device: torch.device, dtype: torch.dtype) -> list[str]:
    """The products the probe times: `torch.mm`, and the prepacked one where speedups/prepacked.py uses it."""
    prepacks = (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
                and torch.ops.mkldnn._is_mkldnn_bf16_supported())  # speedups/prepacked.py's prepacking_pays
    return ["mm", "prepacked"] if prepacks else ["mm"]


def _seconds(product, a: torch.Tensor, device: torch.device, reps: int = 1) -> float:
    """Seconds of `reps` products of a, the device synchronised before the clock is read."""
    start = time.perf_counter()
    for _ in range(reps):
        product(a)
    synchronize(device)
    return time.perf_counter() - start


def measured_peak(device: torch.device, dtype: torch.dtype, hidden: int, cache_root: Optional[Path],
                  ranks_per_host: int = 1) -> dict:
    """{"flops_per_s", "dtype", "shapes": [{"mnk", "flops_per_s"}], "measured_at", "source"}: cached within
    MAX_AGE_S, else measured now."""
    key = {"cpu": cpu_identity() if device.type == "cpu" else None,
           "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "threads": torch.get_num_threads(), "ranks_per_host": ranks_per_host,
           "dtype": str(dtype).removeprefix("torch."), "shapes": probe_shapes(hidden),
           "kernels": kernels(device, dtype)}
    path = cache_path(cache_root, "peak", key) if cache_root is not None else None
    cached = read_cached(path, key) if path is not None else None
    if cached is not None and positive_number(cached.get("flops_per_s")) and positive_number(cached.get("measured_at")):
        age = time.time() - cached["measured_at"]
        if 0 <= age < MAX_AGE_S:
            return {**cached, "source": f"measured earlier on this machine, {age:.0f} s ago ({path})"}
    rates = []
    for m, k, n in key["shapes"]:
        for kernel in key["kernels"]:
            rate, rows = matmul_flops_per_s(m, k, n, dtype, device, prepacked=kernel == "prepacked")
            rates.append({"mnk": [rows, k, n], "kernel": kernel, "flops_per_s": rate})
    found = {"key": key, "flops_per_s": max(r["flops_per_s"] for r in rates), "dtype": key["dtype"], "shapes": rates,
             "measured_at": time.time()}
    if path is not None:
        write_cached(path, found)
    return {**found, "source": "measured at the start of this run"}


def read_cached(path: Path, key: dict) -> Optional[dict]:
    """The cached JSON object if this user wrote it, it parses and it was measured for exactly `key`
    (the caller checks its figures). JSON only: reading a cache never runs code. A symbolic link, a
    FIFO or a device at the cache's name (none of them written here) is never read: it would hang the
    run or fill its memory."""
    try:
        if trust.problem(path.parent) is not None or path.lstat().st_uid != os.getuid():
            return None
        found = trust.read_json(path, CACHE_LIMIT)
        return found if isinstance(found, dict) and found.get("key") == json.loads(json.dumps(key)) else None
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def positive_number(x) -> bool:
    """Whether a value read from JSON is a finite number > 0 (not a string, a list, NaN, a bool)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x < float("inf")


def cache_path(cache_root: Path, folder: str, key: dict) -> Path:
    """`<cache root>/<folder>/<folder>-<digest of key>.json`."""
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(cache_root) / folder / f"{folder}-{digest}.json"


def write_cached(path: Path, found: dict) -> None:
    """Atomically (ranks may write the same file at once), as every file a run writes
    (files/checkpoint.py's `write_atomic`: a temporary file of a random name created for this write
    alone, O_EXCL, renamed over the cache's name), so a symbolic link someone left at either name is
    replaced, never written through. Skipped where the folder is not this user's alone
    (files/trust.py), cannot be written, or the disk is full: the cache only saves a measurement."""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if trust.problem(path.parent) is None:
            checkpoint.write_atomic(path, lambda f: f.write(json.dumps(found, indent=1).encode()))
    except (OSError, DiskFull):
        pass
