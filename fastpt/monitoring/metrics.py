"""Honest speed numbers: throughput, MFU, the data-loading share, peak memory.

Rules: synchronise the device before reading the clock (CUDA runs asynchronously, so a
timer read without it measures kernel launches, not work); leave warm-up and compile steps
out of throughput; count real tokens and padded tokens separately, since padding is compute
that does no useful work.

MFU (model FLOPs utilisation) = useful model FLOP/s / the device's dense peak. Useful means
real tokens only: padding and packing's round-up tokens are computed but do no work, so a
padded run's MFU is lower than its hardware utilisation by exactly its padding. FLOPs for
training one review of n tokens with an encoder (forward + backward = 3x forward, each
multiply-add = 2 FLOPs):

    n * (6 * N  +  12 * L * d * n)

N: parameters outside the embedding tables (matmul weights; embeddings are lookups),
L: layers, d: hidden width. The second term is attention's QK^T and AV products,
2 * 2 * n * d per token per layer forward (PaLM, appendix B, without the causal halving since
an encoder attends both ways), over the review's own length. The peaks are the vendors' dense
16-bit / TF32 / FP32 figures (H100 and H200 SXM: 989 TFLOP/s bf16 dense); a large bf16 matmul
measured about 790 TFLOP/s on an H200, so about 80% MFU is the practical ceiling. A CPU has no
such figure: its peak is measured by a short matmul probe (monitoring/peak.py).
"""

import resource
import sys
import time
from collections import Counter

import torch


# Dense peak FLOP/s per GPU: (16-bit tensor cores, TF32 tensor cores, plain FP32).
PEAK_FLOPS = {
    "A100": (312e12, 156e12, 19.5e12),
    "H100": (989e12, 494e12, 67e12),
    "H200": (989e12, 494e12, 67e12),
}


def device_peak_flops(device: torch.device, amp: bool, tf32: bool) -> float | None:
    """The vendor's peak for this GPU and precision, or None where unknown (CPUs, other GPUs: measured,
    monitoring/peak.py)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""  # a CPU matches no GPU's name
    for key, (half, tf32_peak, fp32) in PEAK_FLOPS.items():
        if key in name:
            return half if amp else tf32_peak if tf32 else fp32
    return None


def flops_per_token(n_params_no_embed: int, n_layers: int, hidden: int, seq_len: float) -> float:
    """Training FLOPs per token of a sequence of seq_len tokens."""
    return 6 * n_params_no_embed + 12 * n_layers * hidden * seq_len


def review_flops(lengths, n_params_no_embed: int, n_layers: int, hidden: int) -> float:
    """Training FLOPs of a batch's real tokens: each review over its own length."""
    return sum(n * flops_per_token(n_params_no_embed, n_layers, hidden, n) for n in lengths)


def model_shape(model: torch.nn.Module) -> tuple[int, int]:
    """(layers, hidden width) of a BERT- or DistilBERT-style config."""
    c = model.config
    return (getattr(c, "n_layers", None) or c.num_hidden_layers, getattr(c, "dim", None) or c.hidden_size)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA allocator peak on a GPU; the process's peak resident set size on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


SUMMED_OVER_RANKS = ("samples_per_s", "tokens_per_s", "padded_tokens_per_s")


class Throughput:
    """Counts samples, tokens and time after warm-up; reports rates over any window.

    `flops_fn(lengths)` gives the useful FLOPs of a batch's reviews (see `review_flops`).
    """

    def __init__(self, device: torch.device, warmup_steps: int, flops_fn, peak_flops: float | None,
                 peak_info: dict | None = None):
        self.device, self.warmup_steps = device, warmup_steps
        self.flops_fn, self.peak = flops_fn, peak_flops
        self.peak_info = peak_info  # where the peak comes from (monitoring/peak.py), for results.json
        self.steps, self.window_start = 0, None
        # samples, real_tokens, padded_tokens, flops, data_s (waiting for data), time_s; a Counter adds them up
        self.total, self.window = Counter(), Counter()

    def start(self) -> None:
        synchronize(self.device)
        self.window_start = time.perf_counter()

    def record(self, lengths: list[int], computed_tokens: int, data_s: float) -> None:
        """One micro-batch: its reviews' lengths and the tokens the device computes (Python ints: no sync)."""
        if self.steps < self.warmup_steps:
            return
        self.window.update(samples=len(lengths), real_tokens=sum(lengths), padded_tokens=computed_tokens,
                           flops=self.flops_fn(lengths), data_s=data_s)

    def end_step(self) -> None:
        """An optimiser step ended; at the end of warm-up the measured window (re)starts."""
        self.steps += 1
        if self.steps == self.warmup_steps:
            self.window = Counter()
            self.start()

    def read(self) -> dict:
        """Rates over the window since the last read (synchronises), folded into the total."""
        synchronize(self.device)
        now = time.perf_counter()
        w = self.window
        if self.steps >= self.warmup_steps and self.window_start is not None:
            w["time_s"] = now - self.window_start
            self.total.update(w)
        self.window, self.window_start = Counter(), now
        return self.rates(w)

    def rates(self, w: dict | None = None) -> dict:
        w = self.total if w is None else w
        t = w["time_s"]
        if t <= 0 or w["samples"] == 0:
            return {}
        out = {
            "samples_per_s": w["samples"] / t,
            "tokens_per_s": w["real_tokens"] / t,
            "padded_tokens_per_s": w["padded_tokens"] / t,
            "padding_efficiency": w["real_tokens"] / max(1, w["padded_tokens"]),
            "data_wait_share": min(1.0, w["data_s"] / t),
        }
        if self.peak:
            out["mfu"] = w["flops"] / t / self.peak
        return out


def rate_results(meter: Throughput, world_size: int, resumed_at_step: int | None = None) -> dict:
    """results.json's speed block: the measured totals, summed over ranks (they run in lockstep).

    Rates are None, with a note, when no step was measured (a run shorter than the warm-up).
    """
    totals = meter.rates()
    out = {k: (totals[k] * world_size if k in SUMMED_OVER_RANKS else totals[k]) if k in totals else None
           for k in (*SUMMED_OVER_RANKS, "padding_efficiency", "data_wait_share", "mfu")}
    if meter.peak:  # MFU's denominator, per rank, and where it comes from
        info = meter.peak_info or {}
        out.update(peak_flops_per_s=meter.peak, peak_source=info.get("source"))
        if "shapes" in info:
            out["peak_probe"] = {"dtype": info["dtype"], "shapes": info["shapes"]}
    if not totals:
        out["samples_per_s_note"] = (f"not measured: the first {meter.warmup_steps} optimiser steps are warm-up "
                                     f"and this run took {meter.steps}")
    elif resumed_at_step is not None:
        out["samples_per_s_note"] = f"measured after the resume at step {resumed_at_step} only"
    return out


def compiled_graph_count() -> int:
    """Graphs TorchDynamo has compiled in this process so far (0 where it was never imported)."""
    dynamo = sys.modules.get("torch._dynamo.utils")
    return dynamo.counters["stats"]["unique_graphs"] if dynamo else 0


def torch_compile_seconds() -> float:
    """Seconds torch has spent compiling in this process so far (0.0 before torch._dynamo): the
    wall time of every frame Dynamo compiled and of every compiled backward."""
    dynamo = sys.modules.get("torch._dynamo.utils")
    return dynamo.calculate_time_spent()["total_wall_time"] if dynamo else 0.0


# torch's counters of its two on-disk compile caches: Inductor's FX graph cache (generated kernels,
# one entry per forward or backward graph) and AOTAutograd's (the traced and partitioned
# forward/backward pair, which then loads its graphs from the FX graph cache).
CACHE_COUNTERS = {f"{cache}_{event}": (group, f"{cache}_cache_{event}")
                  for cache, group in (("fxgraph", "inductor"), ("autograd", "aot_autograd"))
                  for event in ("hit", "miss", "bypass")}


def compile_cache_counts() -> dict:
    """Hits, misses and bypasses of the compile caches in this process so far (all 0 before torch._dynamo)."""
    counters = sys.modules["torch._dynamo.utils"].counters if "torch._dynamo.utils" in sys.modules else {}
    return {name: counters[group][key] if group in counters else 0 for name, (group, key) in CACHE_COUNTERS.items()}


class CompileClock:
    """Host time of the steps during which a new graph was compiled, read without synchronising.

    Compilation runs on the host, synchronously, so the host time of a call that compiled is
    compile time plus the launch of that step's kernels. Backward graphs compile at their first
    backward, inside the same step, so timing whole steps catches both.
    """

    def __init__(self):
        self.start_count = self.count = compiled_graph_count()
        self.seconds, self.start_cache, self.start_torch_s = 0.0, compile_cache_counts(), torch_compile_seconds()

    def tick(self, since: float) -> None:
        now = compiled_graph_count()
        if now != self.count:
            self.seconds += time.perf_counter() - since
            self.count = now

    @property
    def graphs(self) -> int:
        return self.count - self.start_count

    @property
    def torch_seconds(self) -> float:
        """torch's own count of this run's compiling: Dynamo's tracing of each frame and the backward's
        compile (AOTAutograd, Inductor, loading from the caches), without the compiling calls' own work."""
        return torch_compile_seconds() - self.start_torch_s

    @property
    def cache(self) -> dict:
        """This run's compile-cache events: a warm cache shows hits and no misses (a bypass never caches)."""
        return {name: n - self.start_cache[name] for name, n in compile_cache_counts().items()}
