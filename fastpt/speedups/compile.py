"""`torch.compile` (`--compile`, `--compile-mode`).

What it does: TorchDynamo captures the model's forward (and AOTAutograd its backward) as
graphs; Inductor fuses their element-wise ops into a few generated Triton (GPU) or C++ (CPU)
kernels. The modes (torch._inductor.list_mode_options):
- `default`: fusion only;
- `max-autotune-no-cudagraphs`: also benchmarks matmul kernels and tunes the generated ones;
- `reduce-overhead`: fusion plus CUDA graphs;
- `max-autotune`: both, so it records CUDA graphs too.
Only `reduce-overhead` and `max-autotune` record CUDA graphs (on CUDA; a CPU run has none).

Why it is faster: fewer kernel launches and fewer round trips through memory for the
element-wise work between matmuls (GELU, dropout, layer norm, residual adds). A CUDA graph
goes further: the CPU launches a whole recorded graph at once instead of one kernel at a time.

What it costs: the first step compiles (tens of seconds on a GPU, minutes on a small CPU;
`first_step_s` in results.json reports it apart from the measured steps, which leave it out),
evaluation compiles once more (no_grad and eval mode change the graph), and errors show up as
long traces. Shapes: the first graph is static, specialised to the sizes it saw. A call with a
new size recompiles once, with the dimensions that changed made symbolic ("automatic dynamic
shapes"), and that graph then serves every later size of those dimensions; a dimension that
changes later (say the shorter last batch) costs one more recompile. With fixed padding
(`--pad-to max_length`) the token count never changes. Where it varies (`--bucket`,
`--pad-to longest`, `--pack`) the token dimension, and only it, is marked dynamic on every
batch (`mark_token_dim_dynamic`): that saves the static first graph and its recompile, so one
graph serves every length from the start.

CUDA graphs (`reduce-overhead`, `max-autotune`): a graph is recorded once per distinct input
shape (so it pays off with fixed padding, or with `--pack --pack-multiple N`, which rounds every
batch to a few sizes) and then replayed. What that requires:
- static memory: every replay reads the same addresses, so each batch is first copied into the
  graph's input buffers (parameters stay where they are), and outputs come back in the graph's
  own buffers. Each replay overwrites the previous one's outputs: the step's metric sums are
  added into a fresh tensor (`sums + batch_sums` in `step.train_step`, `sums +=` in
  `evaluation.evaluate`) before the next call, and the loss is consumed by its backward;
- nothing that needs the host inside: no `.item()` (with `fullgraph=True` an error already), no
  CPU tensors, no input changed in place. A graph that breaks these rules runs without a CUDA
  graph (Inductor logs "skipping cudagraphs due to ..." with TORCH_LOGS=cudagraphs);
- memory: the recorded graphs share one memory pool (CUDA graph trees) that other work cannot
  use, and each recorded shape adds its own input buffers: many shapes cost memory as well as
  recording time.
What is captured is what Inductor compiled (below; on one device the forward, loss and metric
sums, and their backward); the input copy, gradient reduction under DDP/FSDP, GradScaler,
clipping and the optimizer step run eagerly between the replays.

Where it applies (`--compile-scope`, fixed in the strategies, see strategies/base.py):
- `layers` (the default; PyTorch's recipe "regional compilation"): each transformer layer is
  compiled in place (`compile_layers`), with `fullgraph=True` so a graph break is an error; the
  embeddings, the head, the loss and the metric sums run eagerly around them. The layers are
  instances of one class with parameters of one shape, and Dynamo passes a module's parameters
  to its graph as inputs (`inline_inbuilt_nn_modules`, on by default), so the first layer's graph
  serves every layer: Dynamo traces and Inductor compiles one layer, not the stack, so the cold
  compile no longer grows with depth (`scripts/compile_cache.py` times both scopes, cold and
  warm). The layers hold nearly all of a step's work (matmuls, attention), so the eager remainder
  (embeddings, head, loss) costs little; what is lost is fusion across layer boundaries.
- `whole`: the largest unit the strategy allows. On one device the step's forward, loss and
  metric sums (`step.forward_loss`) are compiled as one function with `fullgraph=True`; under
  DDP the model is compiled and then wrapped, which lets DDP's optimizer split the graph at
  gradient-bucket boundaries so communication overlaps the backward. It traces every layer
  again, so the cold compile grows with depth.
AOTAutograd compiles the backward of what is compiled. The optimizer step (GradScaler,
clipping, Adam) is not compiled: it runs eagerly (with --fused-adam, as Adam's fused kernel).
Under FSDP each transformer layer is compiled in place and then sharded (strategies/fsdp.py,
torchtitan's order), whatever the scope: the all-gather / reduce-scatter hooks between layers
must stay outside the compiled graphs, so `--compile-scope whole` is refused there.

The cache: a second run with the same graphs finds them on disk (speedups/backends.py names the
folder) and skips Inductor (the FX graph cache) and, if the graph qualifies, AOTAutograd's
tracing and partitioning of the backward (the AOTAutograd cache); Dynamo still traces the Python
code each run. results.json's `compile_cache` counts both caches' hits, misses and bypasses.
The compiled function or module leaves the model's parameter names alone, so checkpoints
(`strategy.module`, the plain model) never carry an `_orig_mod.` prefix.

Replaces Lightning's `model = torch.compile(model)` before `Trainer.fit`.
"""

from __future__ import annotations

import sys

import torch


TOKEN_KEYS = ("input_ids", "attention_mask", "token_type_ids", "position_ids")  # the tensors whose dim 1 is tokens


def compile_options(mode: str = "default", dynamic: bool | None = None, fullgraph: bool = False) -> dict:
    """torch.compile's keyword arguments for --compile-mode (one place for the mapping)."""
    return {"mode": None if mode == "default" else mode, "dynamic": dynamic, "fullgraph": fullgraph}


def apply_compile(target, mode: str = "default", fullgraph: bool = False):
    """`target` (a function or a module) compiled by TorchDynamo + Inductor.

    `dynamic=None`: sizes start static; the dimensions `mark_token_dim_dynamic` marks are
    symbolic from the first call.
    """
    return torch.compile(target, **compile_options(mode, fullgraph=fullgraph))


def transformer_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks: DistilBERT's, BERT's (MiniLM), RoBERTa's encoder layers (also inside PackedClassifier)."""
    if hasattr(model, "distilbert"):
        return list(model.distilbert.transformer.layer)
    if hasattr(model, "bert"):
        return list(model.bert.encoder.layer)
    encoder = getattr(getattr(model, getattr(model, "base_model_prefix", ""), None), "encoder", None)
    if hasattr(encoder, "layer"):  # RoBERTa and the other BERT-style encoders
        return list(encoder.layer)
    raise ValueError(f"fastpt does not know where the transformer layers of {type(model).__name__} are")


def compile_layers(model: torch.nn.Module, mode: str = "default", dynamic_tokens: bool = False,
                   fullgraph: bool = True) -> torch.nn.Module:
    """Regional compilation: each transformer layer compiled in place (`Module.compile`); `model` is returned.

    In place, so parameter names (and checkpoints) do not change. A layer's input is a hidden
    state computed eagerly, not the input ids `mark_token_dim_dynamic` marks, so where lengths
    vary (`dynamic_tokens`) the layers are compiled with dynamic shapes from the start: one graph
    for every length instead of a static first graph and a recompile.
    """
    for layer in transformer_layers(model):
        layer.compile(**compile_options(mode, dynamic=True if dynamic_tokens else None, fullgraph=fullgraph))
    return model


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
