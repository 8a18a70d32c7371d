"""Process-wide switches, set in one place before anything runs: TF32, deterministic algorithms,
and, with --compile, what a compiled run changes while it lasts (its cache folder, and the Inductor
settings that keep a compiled CPU step on one graph and on eager's dropout masks: compile.py says
what each does and why).

- `--tf32`: float32 matmuls on Ampere and newer GPUs run on tensor cores with a 10-bit
  mantissa (TF32): up to 8x the float32 rate, at about bfloat16-like input precision. Off by
  default: PyTorch's own default for matmuls (`torch.backends.cuda.matmul.allow_tf32` is False),
  while `torch.backends.cudnn.allow_tf32` defaults to True; fastpt sets both to `--tf32` on CUDA.
  With `--amp` most matmuls are 16-bit anyway.
- Not here: `torch.backends.cudnn.benchmark`, often listed as a speed switch. It lets cuDNN time
  its convolution algorithms for each new input shape and keep the fastest; a transformer
  classifier has no convolutions, so it would change nothing. (`cudnn.allow_tf32` follows
  `--tf32` only for completeness: it too concerns convolutions alone.)
- `--deterministic`: `torch.use_deterministic_algorithms(True)` (Lightning's
  `deterministic=True`): bitwise-repeatable runs, at a measured cost in speed. It is
  process-wide, so `restore()` turns it back off when the run ends.
- On a CPU, freed memory kept for reuse (`keep_freed_memory`; glibc only). glibc's malloc serves
  a block over 32 MiB (its largest mmap threshold) with a fresh `mmap` and returns it to the
  kernel on `free`, so every step pays the kernel's page faults again for the same big tensors:
  the word embeddings' dense gradient (MiniLM: 30,522 x 384 float32, 47 MB) is allocated and
  zeroed at every backward, and zeroing it took 65 ms of a 0.7-0.9 s packed bf16 step at 512
  tokens (torch.profiler's `fill_` on [30522, 384]). With `mmap` off and the heap never trimmed,
  the memory a step frees serves the next one. What the CPU tuning guides get by preloading
  jemalloc or tcmalloc, without a library: the articles' workload in bf16 on a 2-core AVX512-BF16
  EPYC trained 1.18-1.28x faster in three pairs, 1.11x by the median of five (docs/fast-path.md),
  its results bit for bit the same. The cost: the process gives nothing back until it ends.
  Process-wide and for the process's life; left alone where the user tuned malloc already
  (GLIBC_TUNABLES, MALLOC_* variables).
"""

import ctypes
import os
from pathlib import Path

import torch

from fastpt.speedups.compile import compiled_run_settings, restore_settings


def configure(cfg, device: torch.device, cache_root: Path) -> None:
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
        torch.backends.cudnn.allow_tf32 = cfg.tf32
    if device.type == "cpu":
        keep_freed_memory()
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True)
    if cfg.compile:
        compiled_run_settings(device, cache_root)


def restore(cfg) -> None:
    if cfg.deterministic:
        torch.use_deterministic_algorithms(False)
    restore_settings()


M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)
_kept = {"freed_memory": False}  # the process's state: once set, nothing undoes it


def keep_freed_memory() -> bool:
    """glibc's malloc without `mmap` and never trimmed: a CPU step reuses what the last one freed."""
    if "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", "") or any(k.startswith("MALLOC_") for k in os.environ):
        return _kept["freed_memory"]  # the user's own malloc settings stand
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # no glibc (macOS): nothing to set
        return False
    _kept["freed_memory"] = bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
    return _kept["freed_memory"]


def cpu_allocator() -> str:
    """results.json's `cpu_allocator`: whether this process kept freed memory (`keep_freed_memory`)."""
    return "glibc malloc, freed memory kept (no mmap, no trim)" if _kept["freed_memory"] else "unchanged"
