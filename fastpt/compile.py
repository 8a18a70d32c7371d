"""`torch.compile` (`--compile`, `--compile-mode`).

What it does: TorchDynamo captures the model's forward (and AOTAutograd its backward) as
graphs; Inductor fuses their element-wise ops into a few generated Triton (GPU) or C++ (CPU)
kernels. `max-autotune` also benchmarks matmul kernels; `reduce-overhead` adds CUDA graphs.

Why it is faster: fewer kernel launches and fewer round trips through memory for the
element-wise work between matmuls (GELU, dropout, layer norm, residual adds).

What it costs: the first step compiles (tens of seconds on a GPU, minutes on a small CPU;
`first_step_s` in results.json reports it apart from the measured steps, which leave it out),
evaluation compiles once more (no_grad and eval mode change the graph), and errors show up as
long traces. Each new input shape would recompile a static graph: with fixed padding
(`--pad-to max_length`) every batch has one shape, so the graph stays static; with dynamic
padding (`--bucket`, `--pad-to longest`) every batch has its own length, so the sizes are
compiled as symbols from the start (`dynamic=True`) - one compile for every length, instead of
a static compile, then a recompile once the second length shows up. `reduce-overhead` records
a CUDA graph per distinct shape, so it pays off with fixed padding, less with dynamic padding.

Order against the other wrappers (fixed in the strategies, see strategies/base.py):
model.to(device) -> compile -> [DDP wraps the compiled module]; under FSDP, each transformer
layer is compiled in place and then sharded (strategies/fsdp.py, torchtitan's order).
Compiling inside DDP lets DDP's optimizer split the graph at gradient-bucket boundaries so
communication overlaps the backward; under FSDP the compiled regions are the layers, so the
all-gather / reduce-scatter hooks between them never break a compiled graph.
The compiled module keeps the original as `_orig_mod`; checkpoints use `unwrap_model` so they
never carry that prefix and load into an uncompiled model.

Replaces Lightning's `model = torch.compile(model)` before `Trainer.fit`.
"""

from __future__ import annotations

import sys

import torch


def apply_compile(model: torch.nn.Module, mode: str = "default", dynamic_shapes: bool = False) -> torch.nn.Module:
    """The compiled model. `dynamic_shapes`: batches vary in length (dynamic padding).

    Without it, `dynamic=None` lets TorchDynamo mark a size dynamic only once it changes (the
    last, smaller evaluation batch), keeping the fixed-shape training graph fully static.
    """
    return torch.compile(model, mode=None if mode == "default" else mode, dynamic=True if dynamic_shapes else None)


def check_compile_supported() -> None:
    """Fail early, with one line, where TorchDynamo cannot run."""
    try:
        import torch._dynamo  # noqa: F401
    except Exception as e:  # pragma: no cover - depends on the interpreter
        raise ValueError(f"--compile is not supported here: {e}") from None
    if not torch._dynamo.is_dynamo_supported():  # pragma: no cover
        raise ValueError(f"--compile is not supported on Python {sys.version.split()[0]} with torch {torch.__version__}")
