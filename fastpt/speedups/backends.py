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
"""

from pathlib import Path

import torch

from fastpt.speedups.compile import compiled_run_settings, restore_settings


def configure(cfg, device: torch.device, cache_root: Path) -> None:
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
        torch.backends.cudnn.allow_tf32 = cfg.tf32
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True)
    if cfg.compile:
        compiled_run_settings(device, cache_root)


def restore(cfg) -> None:
    if cfg.deterministic:
        torch.use_deterministic_algorithms(False)
    restore_settings()
