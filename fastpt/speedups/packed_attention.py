"""Attention inside each review of a packed batch (packing.py): the kernels, and their hook into
Hugging Face models (a registered attention function).

The attention kernels (`KERNELS`), all exact; `--pack-attention` picks one (auto, the default:
`packed_attention_kernel`'s rule):
- "varlen": `torch.nn.attention.varlen.varlen_attn`, FlashAttention on the stream (CUDA,
  fp16/bf16 only). Reads nothing back to the host. It writes outputs and gradients only for rows
  inside a sequence, so the rounding tail goes in as one more sequence, no longer than
  `max_seqlen`: hence `--pack-multiple` <= `--max-length`.
- "loop": plain SDPA on each review in turn, inside one custom operator (`attend_each_review`)
  that torch.compile treats as opaque. Reads `cu_seqlens` to the host (one sync per layer on a
  GPU, nothing on a CPU). The fastest CPU kernel by far.
- "mask": SDPA on the whole stream with a block-diagonal mask built on the device from
  `cu_seqlens`. O(T^2) work and memory, but no host read and no data-dependent shape: a CUDA
  graph compiled in fp32 (where varlen has no kernel) uses it.
Measured on an idle 2-core AMD EPYC (a one-off script since removed; docs/results.md): one attention call,
forward + backward, fp32, 12 heads of 32, 12 reviews of IMDB-like lengths (mean 266, longest
501): loop 51 ms, mask 0.49 s (3,198^2 scores per head), padded to 512 with a mask 0.18 s. SDPA
on a nested jagged tensor (`torch.nested`, layout=torch.jagged), a fifth way, took 1.4 s: torch
has no fused CPU kernel for jagged inputs (it copies them to a strided nested tensor and runs
the unfused math path), and on CUDA varlen is the fused kernel, so fastpt does not use it.
Reviews grouped by length, one padded call per group, were slower than the loop on both CPUs
measured (1.15-1.37x on an AVX2 EPYC in fp32, 1.14-1.28x on an AVX512-BF16 EPYC in bf16), so
fastpt has no such kernel.
"""

import functools
import inspect

import torch
import torch.nn.functional as F
from torch import nn


PACKED_ATTENTION = "fastpt_packed"  # the attention functions' names in Hugging Face's registry
FLOAT32_ATTENTION = "fastpt_packed_float32"
KERNELS = ("varlen", "loop", "mask")


# Each takes query/key/value as [1, heads, T, head_dim] and returns [1, T, heads, head_dim].
# Tokens after cu_seqlens[-1] (rounding) are one more segment in every kernel: they attend among
# themselves, no review sees them, and nothing reads their outputs (so their gradients are zero).

def _segment_sizes(cu_seqlens: torch.Tensor, num_tokens: int) -> list[int]:
    """Review lengths on the host, plus the rounding tail as one more segment if there is one."""
    edges = cu_seqlens.tolist()  # the host read of the "loop" kernel
    edges += [num_tokens] if edges[-1] < num_tokens else []
    return [e - s for s, e in zip(edges[:-1], edges[1:])]


def _attend_each_review(query, key, value, cu_seqlens, scaling):
    sizes = _segment_sizes(cu_seqlens, query.shape[2])
    # split, not slicing: the backward of B slices would write B full-size zero tensors and add
    # them up; split's backward is one concatenation.
    out = [F.scaled_dot_product_attention(q, k, v, scale=scaling)
           for q, k, v in zip(*(x.split(sizes, dim=2) for x in (query, key, value)))]
    return torch.cat(out, dim=2).transpose(1, 2).contiguous()


# The loop is one custom operator, opaque to torch.compile: the compiler sees an op whose output
# has the query's shape, not the host read and the data-dependent split inside it, so a graph
# compiled with fullgraph=True keeps the per-review loop (one graph for every length) instead of
# the mask kernel's T x T scores.
# Its backward needs each review's attention output and log-sum-exp. On a CPU the forward calls
# the flash kernel itself (what SDPA dispatches to there) and keeps both: the output is the one
# the next layer reads anyway, the log-sum-exp one float per token and head, and the backward
# calls the flash backward per review with them, as SDPA's own autograd would. Elsewhere (CUDA
# in float32, eager) the backward runs the loop again through torch.func.vjp: a second forward.
CPU_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
CPU_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _flash_each_review(query, key, value, cu_seqlens, scaling):
    """(output [1, T, H, d], log-sum-exp [1, H, T] float32): the CPU flash kernel on each review."""
    sizes = _segment_sizes(cu_seqlens, query.shape[2])
    outs, lses = zip(*(CPU_FLASH(q, k, v, 0.0, False, scale=scaling)
                       for q, k, v in zip(*(x.split(sizes, dim=2) for x in (query, key, value)))))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), torch.cat(lses, dim=2)


@torch.library.custom_op("fastpt::attend_each_review", mutates_args=())
def attend_each_review(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                       scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(output [1, T, H, d], log-sum-exp for the backward: [1, H, T] on a CPU, empty elsewhere)."""
    if query.device.type == "cpu":
        return _flash_each_review(query, key, value, cu_seqlens, scaling)
    return _attend_each_review(query, key, value, cu_seqlens, scaling), query.new_empty(0, dtype=torch.float32)


@attend_each_review.register_fake
def _(query, key, value, cu_seqlens, scaling):
    lse_shape = (query.shape[0], query.shape[1], query.shape[2]) if query.device.type == "cpu" else (0,)
    return (query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3]),
            query.new_empty(lse_shape, dtype=torch.float32))


@torch.library.custom_op("fastpt::attend_each_review_backward", mutates_args=())
def attend_each_review_backward(grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                cu_seqlens: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                                scaling: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if lse.numel():  # the CPU: the flash backward per review, from the forward's output and log-sum-exp
        sizes = _segment_sizes(cu_seqlens, query.shape[2])
        parts = zip(*(x.split(sizes, dim=2) for x in (grad.transpose(1, 2), query, key, value, out.transpose(1, 2))),
                    lse.split(sizes, dim=2))
        grads = zip(*(CPU_FLASH_BACKWARD(g, q, k, v, o, m, 0.0, False, scale=scaling) for g, q, k, v, o, m in parts))
        return tuple(torch.cat(g, dim=2).contiguous() for g in grads)
    # torch.func.vjp, not torch.autograd: autograd records nothing inside a custom operator.
    _, pullback = torch.func.vjp(lambda q, k, v: _attend_each_review(q, k, v, cu_seqlens, scaling), query, key, value)
    return tuple(g.contiguous() for g in pullback(grad))  # the strides the shape rule below promises


@attend_each_review_backward.register_fake
def _(grad, query, key, value, cu_seqlens, out, lse, scaling):
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


def _save_for_backward(ctx, inputs, output):
    query, key, value, cu_seqlens, ctx.scaling = inputs
    ctx.save_for_backward(query, key, value, cu_seqlens, *output)  # output: the attention and its log-sum-exp


def _backward(ctx, grad, grad_lse):  # only this backward reads the log-sum-exp: its gradient is unused
    return *attend_each_review_backward(grad, *ctx.saved_tensors, ctx.scaling), None, None


attend_each_review.register_autograd(_backward, setup_context=_save_for_backward)


def _loop_attention(query, key, value, cu_seqlens, max_seqlen, scaling):
    scaling = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    return attend_each_review(query, key, value, cu_seqlens, scaling)[0]


def _mask_attention(query, key, value, cu_seqlens, max_seqlen, scaling):
    # Segment id of each token: review i is i + 1, the rounding tail is B + 1. Same id, may attend.
    tokens = torch.arange(query.shape[2], device=query.device, dtype=cu_seqlens.dtype)
    segment = torch.searchsorted(cu_seqlens, tokens, right=True)
    mask = segment[:, None] == segment[None, :]
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling).transpose(1, 2)


VARLEN_DTYPES = (torch.float16, torch.bfloat16)  # FlashAttention's: no float32 kernel


def _varlen_attention(query, key, value, cu_seqlens, max_seqlen, scaling):
    from torch.nn.attention.varlen import varlen_attn  # PyTorch >= 2.10, CUDA only
    if query.dtype not in VARLEN_DTYPES:
        raise ValueError(f"the 'varlen' kernel (FlashAttention) needs fp16 or bf16 inputs, got {query.dtype}: "
                         "train under autocast, or use the 'loop' or 'mask' kernel")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, H, d], tokens first
    # FlashAttention writes only the rows inside a sequence: its outputs come from `empty_like`, in
    # the forward (out) and in the backward (dq, dk, dv: not zeroed), so a row outside every
    # sequence would send whatever memory held into the layers below. The rounding tail after
    # cu_seqlens[-1] therefore goes in as one more sequence (attending among itself, as in the other
    # kernels); it is shorter than --pack-multiple <= --max-length = max_seqlen (config.py), so the
    # kernel covers all of it. Without a tail it is an empty sequence, which the kernel skips (each
    # block returns at once). Built on the device, with the token count as a symbol under compile:
    # no host read, one graph for every length.
    cu_seqlens = torch.cat([cu_seqlens, cu_seqlens.new_full((1,), q.shape[0])])
    # Positional arguments only: torch 2.10 has `is_causal` as the 8th, later versions keyword-only
    # options; the default scale (head_dim ** -0.5) is the one BERT and DistilBERT use.
    options = {"scale": scaling} if "scale" in _VARLEN_OPTIONS else {}
    if not options and scaling is not None and abs(scaling - q.shape[-1] ** -0.5) >= 1e-12:
        raise ValueError("this torch's varlen_attn has no scale argument and the model's scale is not 1/sqrt(d)")
    return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **options)[None]


try:  # the parameters of this torch's varlen_attn, none before PyTorch 2.10
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
    _VARLEN_OPTIONS = frozenset(inspect.signature(_varlen_attn).parameters)
except ImportError:
    _VARLEN_OPTIONS = frozenset()
KERNEL_FUNCTIONS = {"varlen": _varlen_attention, "loop": _loop_attention, "mask": _mask_attention}


def packed_attention_kernel(device_type: str, compiled: bool, low_precision: bool = True) -> str:
    """The kernel `--pack-attention auto` uses: FlashAttention's varlen on CUDA in fp16/bf16; the
    per-review loop on a CPU, eager or compiled; on CUDA in fp32, the loop in eager mode and the block-diagonal mask
    under torch.compile (the loop's host read would stall a compiled step and break CUDA graphs)."""
    if device_type == "cuda" and low_precision and "cu_seq_q" in _VARLEN_OPTIONS:
        return "varlen"
    return "mask" if compiled and device_type == "cuda" else "loop"


def packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     cu_seqlens=None, max_seqlen=None, packed_kernel="loop", float32=False, **kwargs):
    """Transformers attention function: packed when `cu_seqlens` is given, else plain SDPA; with
    `float32`, on float32 copies of 16-bit inputs, the output cast back (attention_precision.py).

    The SDPA fallback keeps the same model usable on padded batches (evaluation, or loading
    it anywhere) after `apply_packed_attention`. Packed attention ignores `dropout` (packing.py).
    """
    if float32 and query.dtype != torch.float32:
        # The casts sit here, outside the custom operator that torch.compile cannot see into, so that
        # Inductor fuses them with the ops around (the projections' outputs, the next matmul's input).
        # Autograd casts the gradient up before the operator's backward: that runs in float32 too.
        dtype = query.dtype
        query, key, value = (x.float() for x in (query, key, value))
        if attention_mask is not None and attention_mask.is_floating_point():
            attention_mask = attention_mask.float()  # an additive mask goes with the query's dtype
        with torch.autocast(query.device.type, enabled=False):  # SDPA is on autocast's 16-bit list
            out, weights = packed_attention(module, query, key, value, attention_mask, scaling, dropout,
                                            cu_seqlens, max_seqlen, packed_kernel, **kwargs)
        return out.to(dtype), weights
    if cu_seqlens is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    return KERNEL_FUNCTIONS[packed_kernel](query, key, value, cu_seqlens, max_seqlen, scaling), None


def apply_packed_attention(model: nn.Module, float32: bool = False) -> nn.Module:
    """Switches a Hugging Face model to `packed_attention` (registered once, with SDPA's mask); with
    `float32`, to its float32 form (FLOAT32_ATTENTION)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask
    for name, function in ((PACKED_ATTENTION, packed_attention),
                           (FLOAT32_ATTENTION, functools.partial(packed_attention, float32=True))):
        AttentionInterface.register(name, function)
        AttentionMaskInterface.register(name, sdpa_mask)  # padded batches keep their mask
    model.set_attn_implementation(FLOAT32_ATTENTION if float32 else PACKED_ATTENTION)
    return model
