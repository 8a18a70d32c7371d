"""Cheaper dropout masks on the CPU (`--cheap-dropout`).

What it does: every `nn.Dropout` of the model is replaced by a `CheapDropout` of the same `p`,
which draws its keep mask from 16-bit slices of random 64-bit integers instead of one
`bernoulli_` draw per element. A word of 64 random bits (`random_` over int64's full range) is
viewed as four int16 values, each uniform over its 65,536 values; an element is dropped when its
value falls among the lowest round(p x 65536). The kept elements are scaled by 1 / keep rate, the
gradient is the incoming one times the same mask and scale, and in eval mode the layer is the
identity, as `nn.Dropout`.

Why it is faster: on the CPU `F.dropout` (`aten::dropout`) fills a tensor of the input's dtype with
`bernoulli_(1 - p)`, a serial loop that draws one double (64 bits: two 32-bit Mersenne Twister
numbers) per element, then divides that tensor by 1 - p and multiplies. Here one 64-bit draw serves
four elements (a quarter of the generator's work), and the threshold, the scale and the zeros are
vectorised passes. scripts/dropout_masks.py times both, the alternatives (`rand_like >= p`,
`bernoulli_` into a uint8 buffer, Inductor's masks) and packed MiniLM steps; its table is
scripts/results/dropout-masks-cpu.md. On a 2-core AVX2 EPYC, one thread: dropout's forward +
backward 1.3-1.4x faster in float32, 1.6x in bfloat16; but a whole packed MiniLM float32 step only
1.01x (dropout is 10% of that step, bernoulli_ 3.7%: the rest is its passes over memory).

What it costs:
- The keep rate is quantised to 1/65536: p = 0.1 keeps 58982/65536 = 0.8999939 of the elements
  (|error| 6.1e-6); the scale is 1 / that keep rate, so the mean is preserved exactly.
- The masks are other random numbers than `nn.Dropout`'s: a run with the flag trains on different
  masks than one without (as a different seed would), not on worse ones. They come from the
  default generator of the tensor's device, like `bernoulli_`'s, so the RNG state that last.pt
  keeps makes a resumed run bitwise equal to an uninterrupted one.
- The saved mask is one byte per element (`bool`), not one element of the input's dtype.
- Under torch.compile the layer is plain `F.dropout`. Inductor draws its mask inside its generated
  kernel (Philox, seeded from the same generator) unless `fallback_random` is on; on the CPU above
  that compiled dropout measured slower than eager `bernoulli_` (the table's "compiled F.dropout"),
  so a compiled CPU run turns `fallback_random` on (speedups/backends.py) and the graph calls
  `bernoulli_` as eager does.
- Off by default: with other masks than nn.Dropout's, a run no longer equals the ladder scripts
  (scripts/ladder/) and the Lightning / accelerate peers (scripts/compare_peers.py) mask for mask.
- Measured on the CPU only. On CUDA `F.dropout` is already one fused kernel (`native_dropout`).

Lightning has no flag for this; its models use `nn.Dropout`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MASK_BITS = 16
LEVELS = 1 << MASK_BITS  # values one int16 slice takes


def dropped_levels(p: float) -> int:
    """How many of the 65,536 values of a slice drop an element: round(p x 65536)."""
    return round(p * LEVELS)


def keep_rate(p: float) -> float:
    """The exact probability that an element is kept (1 - p, quantised to 1/65536)."""
    return 1 - dropped_levels(p) / LEVELS


def drop_mask(shape: torch.Size, p: float, device: torch.device) -> torch.Tensor:
    """A bool tensor, True where an element is dropped (probability dropped_levels(p) / 65536 each,
    independently), from random_ on the default generator of `device`."""
    n = shape.numel()
    words = torch.empty((n + 3) // 4, dtype=torch.int64, device=device).random_(-2**63, None)  # 64 uniform bits
    slices = words.view(torch.int16)[:n]  # uniform over [-32768, 32767], each from its own 16 bits
    return (slices < dropped_levels(p) - LEVELS // 2).view(shape)


class _MaskedScale(torch.autograd.Function):
    """x x scale with the dropped elements zeroed; the backward applies the same mask and scale."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dropped: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(dropped)
        ctx.scale = scale
        return (x * scale).masked_fill_(dropped, 0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (dropped,) = ctx.saved_tensors
        return (grad * ctx.scale).masked_fill_(dropped, 0), None, None


def cheap_dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """Dropout with 16-bit masks (see the module's docstring); `F.dropout` where it is as cheap or cheaper."""
    if not training or p == 0:
        return x
    if p == 1 or dropped_levels(p) == LEVELS or torch.compiler.is_compiling():
        return F.dropout(x, p, training)  # everything dropped; or Inductor's in-kernel mask
    return _MaskedScale.apply(x, drop_mask(x.shape, p, x.device), 1 / keep_rate(p))


class CheapDropout(nn.Dropout):
    """nn.Dropout (same p, same train/eval switch, no state) whose mask is `cheap_dropout`'s."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cheap_dropout(x, self.p, self.training)


def apply_cheap_dropout(model: nn.Module) -> nn.Module:
    """Replaces every nn.Dropout in `model` by a CheapDropout of the same p, in place; returns the model.

    Code that reads a dropout module's `p` (Hugging Face passes `self.dropout.p` to SDPA as its
    attention dropout) still reads it; that attention dropout itself is SDPA's, unchanged."""
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if type(child) is nn.Dropout:
                replacement = CheapDropout(child.p, child.inplace)
                replacement.train(child.training)
                setattr(parent, name, replacement)
    return model
