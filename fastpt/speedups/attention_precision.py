"""Attention in its fastest precision on a CPU (`--amp` there): measured once, at the run's start.

What it does: under bfloat16 (or float16) autocast on a CPU, the attention calls run where they are
fastest on this machine: SDPA's CPU flash kernel in the autocast dtype, or the same kernel on
float32 copies of the query, key and value, its output cast back to the autocast dtype (and its
backward in float32 too: autograd casts the gradient up before it). Both the packed attention (the
per-review loop, packed_attention.py) and the padded path's SDPA call take the choice: the model's
attention function becomes `packed_attention(..., float32=True)` (FLOAT32_ATTENTION).
Which one wins is measured at the start of the run (`measured_precision`), at the run's own
shapes: the model's heads and head width, the first batch of the training split (its reviews'
lengths, packed, or padded as the run pads them), a few forward + backward calls of each,
interleaved A B B A, the medians compared. float32 has to win by 10% (`MARGIN`): where the two are
about even the autocast dtype stays, so that two runs of one command do not follow the noise apart.
Under torchrun rank 0 measures and sends its choice to every rank; a resumed run keeps the one its
last.pt records; `--deterministic` measures nothing and keeps the autocast dtype (no timing decides
the numbers of a run that must repeat bitwise). results.json's `attention_precision` holds the
choice and both times, and the run prints them. fastpt-predict measures the same way at its own
first batch, forward only (its work has no backward).

Why it can be faster: CPU flash attention converts 16-bit inputs inside the kernel, and on a CPU
without AMX that path is slower than its own float32 one. Measured on a 2-core AMD EPYC with
AVX512-BF16 but no AMX (2026-12-02, scripts/results/compare-peers-goal-before-aa90c3f.md), the
goal workload's packed bfloat16 run (MiniLM, 400 reviews, 512 tokens) measured one layer's
attention at 77.7 ms in bfloat16 and 63.6 ms on float32 copies, took float32, and trained in
36.3 s against 39.9 s with attention always in bfloat16, test accuracy unchanged. On a CPU with
AMX (oneDNN's bfloat16 tiles) the order may be the other, hence a measurement and not a rule. On CUDA
bfloat16 flash (and varlen) is the fast path: nothing is measured and nothing changes.

What it costs: the measurement (under a second at the articles' shapes), once per run; the
float32 copies (q, k, v and the output, twice the bytes of 16-bit ones, kept for the backward);
two casts per layer, which Inductor fuses into the neighbouring ops under torch.compile (they sit
outside the opaque custom operator for that reason). Numerically the float32 form is the more
exact one: the same 16-bit inputs, attended in float32, rounded once at the end.

Lightning has no flag for this: `precision="bf16-mixed"` runs SDPA in bfloat16 wherever it runs.
"""

import statistics
import time
from types import SimpleNamespace
from typing import Callable, Optional

import numpy as np
import torch

from fastpt.cluster import distributed
from fastpt.speedups.amp import DTYPES
from fastpt.speedups.packed_attention import apply_packed_attention, packed_attention

REPEATS = 2  # A B B A passes after one warm-up call of each: four timings of each, their median kept
# float32 is taken only when faster by this factor: where the two are about even, a choice that followed
# the noise would make two runs of one command compute differently, for no speed.
MARGIN = 1.1
STAND_IN = SimpleNamespace(is_causal=False)  # what SDPA's Hugging Face wrapper reads of an attention module


def rule(device_type: str, amp_dtype: Optional[str], attn_implementation: str = "sdpa",
         deterministic: bool = False) -> Optional[dict]:
    """{"precision", "source"} where nothing is measured: the inputs' own without --amp (float32); the
    autocast dtype on CUDA, with the eager attention, or under --deterministic (a run that repeats
    bitwise lets no timing decide its numbers). None where it is measured: SDPA on a CPU under --amp."""
    if amp_dtype is None:
        return {"precision": "float32", "source": "no --amp: float32 throughout"}
    if device_type != "cpu" or attn_implementation != "sdpa":
        return {"precision": amp_dtype, "source": f"--amp's: nothing is measured on {device_type} with "
                                                  f"{attn_implementation} attention"}
    if deterministic:
        return {"precision": amp_dtype, "source": "--amp's: --deterministic lets no timing decide the numbers"}
    return None


def attention_inputs(lengths: list, heads: int, head_dim: int, dtype: torch.dtype, packed: bool,
                     padded_to: Optional[int] = None, kernel: str = "loop") -> tuple:
    """(query, key, value, keyword arguments of packed_attention) as a layer hands them over: [B, H, L, d]
    views of [B, L, H, d] tensors; packed, B = 1 and the reviews end to end with their `cu_seqlens`;
    padded, to `padded_to` (else the longest) with a boolean mask of each review's keys."""
    g = torch.Generator().manual_seed(0)  # its own: the run's random state stays untouched
    if packed:
        shape = (1, sum(lengths))
        extra = {"cu_seqlens": torch.tensor(np.cumsum([0, *lengths]), dtype=torch.int32),
                 "attention_mask": None, "max_seqlen": max(lengths), "packed_kernel": kernel}
    else:
        width = padded_to or max(lengths)
        keys = torch.arange(width)[None] < torch.tensor(lengths)[:, None]
        shape, extra = (len(lengths), width), {"attention_mask": keys[:, None, None, :].expand(-1, 1, width, -1)}
    qkv = [torch.randn(*shape, heads, head_dim, generator=g).to(dtype).transpose(1, 2) for _ in range(3)]
    return (*qkv, extra)


def attention_shape(model: torch.nn.Module) -> tuple[int, int]:
    """(heads, head width) of a DistilBERT- or BERT-style config."""
    c = model.config
    heads = getattr(c, "n_heads", None) or c.num_attention_heads
    return heads, (getattr(c, "dim", None) or c.hidden_size) // heads


def time_attention(float32: bool, inputs: tuple, backward: bool = True) -> float:
    """Seconds of one attention call (with `float32`: on float32 copies), and its backward, under autocast."""
    *qkv, extra = inputs
    query, key, value = (x.detach().requires_grad_(backward) for x in qkv)
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=query.dtype), torch.set_grad_enabled(backward):
        out, _ = packed_attention(STAND_IN, query, key, value, float32=float32, **extra)
    if backward:
        out.sum().backward()
    return time.perf_counter() - start


def measured_precision(amp_dtype: str, inputs: tuple, backward: bool = True,
                       timer: Optional[Callable[..., float]] = None) -> dict:
    """{"precision", "seconds": {precision: median s}, "source"}: the faster of the autocast dtype and float32."""
    timer = timer or time_attention
    times = {amp_dtype: [], "float32": []}
    for name in times:  # a warm-up call of each: first-call allocations and kernel set-up stay out
        timer(name == "float32", inputs, backward)
    for _ in range(REPEATS):
        for name in (amp_dtype, "float32", "float32", amp_dtype):  # A B B A: a load from elsewhere weighs on both
            times[name].append(timer(name == "float32", inputs, backward))
    seconds = {name: statistics.median(t) for name, t in times.items()}
    faster = seconds["float32"] * MARGIN < seconds[amp_dtype]
    return {"precision": "float32" if faster else amp_dtype, "seconds": seconds,
            "source": "measured at the start of this run"}


def choose(fixed: Optional[dict], measure: Callable[[], dict], recorded: Optional[dict] = None,
           measures: bool = True, broadcast: Callable = lambda found: found) -> dict:
    """The rule's choice where it has one (`fixed`); else the one last.pt `recorded` (a resume attends as
    it started); else `measure()`'s, on the rank that `measures` (rank 0), sent to all (`broadcast`)."""
    if fixed is not None:
        return fixed
    if recorded and recorded.get("precision") in recorded.get("seconds", {}):
        return {**recorded, "source": "last.pt: the precision the run started with"}
    return broadcast(measure() if measures else None)


def for_run(cfg, dist, model: torch.nn.Module, train_split, resume_state: Optional[dict] = None) -> dict:
    """A training run's choice, measured on its model's shapes and its first batch (padded or packed as it
    runs); every rank takes part (the broadcast)."""
    amp_dtype = cfg.amp_dtype if cfg.amp else None
    lengths = [min(int(n), cfg.max_length) for n in train_split.lengths[:cfg.batch_size]]
    padded_to = cfg.max_length if cfg.pad_to == "max_length" else None
    kernel = getattr(model, "kernel", "loop")  # a PackedClassifier's

    def measure() -> dict:
        inputs = attention_inputs(lengths, *attention_shape(model), DTYPES[cfg.amp_dtype], cfg.pack, padded_to, kernel)
        return measured_precision(cfg.amp_dtype, inputs)

    return choose(rule(dist.device.type, amp_dtype, cfg.attn_implementation, cfg.deterministic), measure,
                  (resume_state or {}).get("attention_precision"), dist.is_main, distributed.broadcast_object)


def for_predictions(amp_dtype: Optional[str], dist, model: torch.nn.Module, loader) -> dict:
    """fastpt-predict's choice, measured the same way on its own first batch, forward only (inference)."""
    def measure() -> dict:
        batch = next(iter(loader))
        inputs = attention_inputs(batch["lengths"], *attention_shape(model), DTYPES[amp_dtype], "cu_seqlens" in batch,
                                  batch["input_ids"].shape[1], getattr(model, "kernel", "loop"))
        with torch.inference_mode():
            return measured_precision(amp_dtype, inputs, backward=False)

    implementation = "eager" if model.config._attn_implementation == "eager" else "sdpa"
    return choose(rule(dist.device.type, amp_dtype, implementation), measure, measures=dist.is_main,
                  broadcast=distributed.broadcast_object)


def apply(model: torch.nn.Module, choice: dict) -> torch.nn.Module:
    """The model's attention in the chosen precision; `model.attention_precision` keeps the choice (for
    last.pt and results.json). A measured float32 switches its attention function to FLOAT32_ATTENTION
    (a PackedClassifier's encoder, or the plain model, whose padded batches then take it too)."""
    model.attention_precision = choice
    if choice["precision"] == "float32" and "seconds" in choice:  # measured: 16-bit inputs, cast up
        encoder = getattr(model, getattr(model, "encoder_name", ""), None)
        apply_packed_attention(encoder if encoder is not None else model, float32=True)
    return model


def describe(choice: dict) -> str | None:
    """The console's line where there was a measurement (the precision, both times, where they came
    from); None where a rule decided (results.json has that choice too)."""
    seconds = choice.get("seconds")
    if not seconds:
        return None
    times = ", ".join(f"{name} {1e3 * s:.1f} ms" for name, s in seconds.items())
    return f"attention: {choice['precision']} ({times} per layer's attention call) | {choice['source']}"
