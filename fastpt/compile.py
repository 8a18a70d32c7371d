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
(`--pad-to max_length`) every batch has one shape, so the graph stays static; where lengths
vary (`--bucket`, `--pad-to longest`, `--pack`) the token dimension, and only it, is marked
dynamic on every batch (`mark_token_dim_dynamic`), so one graph serves every length from the
start. `reduce-overhead` records a CUDA graph per distinct shape: it pays off with fixed
padding, or with `--pack --pack-multiple N`, which rounds every batch to a few sizes.

Where it applies (fixed in the strategies, see strategies/base.py): on one device the whole
step function (forward, loss and metric sums: `step.forward_loss`) is compiled with
`fullgraph=True`, so any graph break is an error rather than a silent slowdown. Under DDP the
model is compiled and then wrapped, which lets DDP's optimizer split the graph at
gradient-bucket boundaries so communication overlaps the backward; under FSDP each transformer
layer is compiled in place and then sharded (strategies/fsdp.py, torchtitan's order), so the
all-gather / reduce-scatter hooks between layers never break a compiled graph.
The compiled function or module leaves the model's parameter names alone, so checkpoints
(`strategy.module`, the plain model) never carry an `_orig_mod.` prefix.

Replaces Lightning's `model = torch.compile(model)` before `Trainer.fit`.
"""

from __future__ import annotations

import sys

import torch


TOKEN_KEYS = ("input_ids", "attention_mask", "position_ids")  # the tensors whose dim 1 is tokens


def compile_options(mode: str = "default", dynamic: bool | None = None, fullgraph: bool = False) -> dict:
    """torch.compile's keyword arguments for --compile-mode (one place for the mapping)."""
    return {"mode": None if mode == "default" else mode, "dynamic": dynamic, "fullgraph": fullgraph}


def apply_compile(target, mode: str = "default", fullgraph: bool = False):
    """`target` (a function or a module) compiled by TorchDynamo + Inductor.

    `dynamic=None`: sizes start static; the dimensions `mark_token_dim_dynamic` marks are
    symbolic from the first call.
    """
    return torch.compile(target, **compile_options(mode, fullgraph=fullgraph))


def mark_token_dim_dynamic(batch: dict) -> dict:
    """Compile the token dimension as a symbol: one graph for every batch length, no recompiles."""
    for key in TOKEN_KEYS:
        if key in batch:
            torch._dynamo.mark_dynamic(batch[key], 1)
    return batch


def check_compile_supported() -> None:
    """Fail early, with one line, where TorchDynamo cannot run."""
    try:
        import torch._dynamo  # noqa: F401
    except Exception as e:  # pragma: no cover - depends on the interpreter
        raise ValueError(f"--compile is not supported here: {e}") from None
    if not torch._dynamo.is_dynamo_supported():  # pragma: no cover
        raise ValueError(f"--compile is not supported on Python {sys.version.split()[0]} "
                         f"with torch {torch.__version__}")
