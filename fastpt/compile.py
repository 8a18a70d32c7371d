"""`torch.compile` (`--compile`, `--compile-mode`).

What it does: TorchDynamo captures the model's forward (and AOTAutograd its backward) as
graphs; Inductor fuses their element-wise ops into a few generated Triton (GPU) or C++ (CPU)
kernels. `max-autotune` also benchmarks matmul kernels; `reduce-overhead` adds CUDA graphs.

Why it is faster: fewer kernel launches and fewer round trips through memory for the
element-wise work between matmuls (GELU, dropout, layer norm, residual adds).

What it costs: the first steps compile (tens of seconds, reported apart from training time),
a new input shape may recompile (bucketed batches vary in length: after the second distinct
length the graph is marked dynamic), and errors show up as long traces.

Order against the other wrappers (fixed in the strategies, see strategies/base.py):
model.to(device) -> [FSDP shards the layers] -> compile -> [DDP wraps the compiled module].
Compiling inside DDP lets DDP's optimizer split the graph at gradient-bucket boundaries so
communication overlaps the backward; FSDP2 must shard first so compile sees DTensor params.
The compiled module keeps the original as `_orig_mod`; checkpoints use `unwrap_model` so they
never carry that prefix and load into an uncompiled model.

Replaces Lightning's `model = torch.compile(model)` before `Trainer.fit`.
"""

from __future__ import annotations

import sys

import torch


def apply_compile(model: torch.nn.Module, mode: str = "default") -> torch.nn.Module:
    return torch.compile(model, mode=None if mode == "default" else mode)


def check_compile_supported() -> None:
    """Fail early, with one line, where TorchDynamo cannot run."""
    try:
        import torch._dynamo  # noqa: F401
    except Exception as e:  # pragma: no cover - depends on the interpreter
        raise ValueError(f"--compile is not supported here: {e}") from None
    if not torch._dynamo.is_dynamo_supported():  # pragma: no cover
        raise ValueError(f"--compile is not supported on Python {sys.version.split()[0]} with torch {torch.__version__}")
