"""Which packed-attention kernel is fastest on this CPU: measured, not assumed.

What it does: `--pack-attention auto` (the default) on a CPU times forward + backward of each
candidate kernel (`CANDIDATES`: the per-review "loop" and the length-"grouped" one) on one packed
batch of IMDB-like review lengths, at the run's dtype, head count and head width, and keeps the
fastest. On CUDA `auto` keeps packed_attention_kernel's rules (FlashAttention's varlen).

Why: which wins depends on the CPU, not on the model. On a 2-core AMX Xeon the per-review flash
calls took 44% of a packed bf16 step's CPU time with attention a tenth of its FLOPs (many small
calls that keep the tiles idle), which grouping addresses; on a 2-core AVX2 EPYC in float32 the
loop's calls are already large enough, and grouping's padding and copies cost more than they
save (scripts/results/packing-kernels-cpu.md).

What it costs: each kernel timed in two passes (A B B A, the faster kept), about 2 s in float32
and 6 s in bfloat16 on a 2-core AVX2 CPU (which emulates bfloat16), once per machine: the figures
are cached as JSON under the cache folder (`<cache dir>/pack-attention/`, as monitoring/peak.py
caches the matmul peak), keyed by the CPU, torch's version, threads, ranks per host, dtype, heads,
head width, and the batch's lengths.
The file records each kernel's seconds and the shapes; one that another user wrote, that does not
parse, or whose choice is not the fastest of its own figures, is measured again.
The nested-jagged SDPA and the block-diagonal "mask" kernel are not candidates: 9 to 25 times
slower than the loop here (scripts/packing_kernels.py times them).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from fastpt.monitoring import peak
from fastpt.speedups.packed_attention import KERNEL_FUNCTIONS

CANDIDATES = ("loop", "grouped")
REPEATS = 2  # timings per pass after one warm-up; the median is kept


def imdb_like_lengths(batch_size: int, max_length: int = 512, seed: int = 0) -> list[int]:
    """Review lengths drawn like IMDB's in BERT tokens: mean ~270, a long tail cut at max_length."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(5.5, 0.55, size=batch_size), 16, max_length).astype(int).tolist()


def time_kernel(kernel: str, lengths: list[int], heads: int, head_dim: int, dtype: torch.dtype,
                repeats: int = REPEATS) -> float:
    """Median seconds of one call of `kernel`, forward + backward, on one packed batch of `lengths`."""
    cu_seqlens = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    g = torch.Generator().manual_seed(0)  # its own: the run's random state stays untouched
    # [1, heads, T, d] views of [1, T, heads, d] tensors: the layout a Hugging Face layer hands over
    inputs = [torch.randn(1, int(cu_seqlens[-1]), heads, head_dim, generator=g).to(dtype).transpose(1, 2)
              for _ in range(3)]
    runs = []
    for _ in range(repeats + 1):  # the first run warms up
        q, k, v = (x.detach().requires_grad_() for x in inputs)
        start = time.perf_counter()
        KERNEL_FUNCTIONS[kernel](q, k, v, cu_seqlens, max(lengths), None).sum().backward()
        runs.append(time.perf_counter() - start)
    return float(np.median(runs[1:]))


def measured_kernel(dtype: torch.dtype, heads: int, head_dim: int, batch_size: int, max_length: int,
                    cache_root: Optional[Path], ranks_per_host: int = 1,
                    timer: Optional[Callable[..., float]] = None) -> dict:
    """{"kernel", "seconds": {kernel: s}, "shapes", "source"}: the fastest candidate, cached, else measured now."""
    lengths = imdb_like_lengths(batch_size, max_length)
    key = {"cpu": peak.cpu_identity(), "torch": torch.__version__, "threads": torch.get_num_threads(),
           "ranks_per_host": ranks_per_host, "dtype": str(dtype).removeprefix("torch."),
           "heads": heads, "head_dim": head_dim, "lengths": lengths, "candidates": list(CANDIDATES)}
    path = peak.cache_path(cache_root, "pack-attention", key) if cache_root is not None else None
    if path is not None:
        cached = peak.read_cached(path, key)
        if cached is not None and _consistent(cached):
            return {**cached, "source": f"measured earlier on this machine ({path})"}
    timer = timer or time_kernel
    seconds = {kernel: float("inf") for kernel in CANDIDATES}
    for kernel in CANDIDATES + CANDIDATES[::-1]:  # A B B A: a load from elsewhere weighs on both alike
        seconds[kernel] = min(seconds[kernel], timer(kernel, lengths, heads, head_dim, dtype))
    found = {"key": key, "kernel": min(seconds, key=seconds.get), "seconds": seconds,
             "shapes": {"dtype": key["dtype"], "heads": heads, "head_dim": head_dim, "lengths": lengths}}
    if path is not None:
        peak.write_cached(path, found)
    return {**found, "source": "measured at the start of this run"}


def _consistent(found: dict) -> bool:
    """A cached choice is one of the candidates, each timed, and the fastest of its own figures."""
    seconds = found.get("seconds")
    return (isinstance(seconds, dict) and sorted(seconds) == sorted(CANDIDATES)
            and all(peak.positive_number(s) for s in seconds.values())
            and found.get("kernel") == min(seconds, key=seconds.get))
