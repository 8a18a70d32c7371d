"""bfloat16 weights prepacked for the CPU's matrix kernel: fastpt-predict's linear layers on a CPU.

oneDNN, which runs PyTorch's bfloat16 matrix products on a CPU, computes on weights laid out in
its own blocks. `F.linear` hands it the plain [out, in] weight, and the kernel repacks it at every
call; a model that never trains can do that once. `prepack_linears` replaces each nn.Linear with a
PrepackedLinear holding `torch.ops.mkldnn._reorder_linear_weight(weight)` and calling
`torch.ops.mkldnn._linear_pointwise`: what Inductor's freezing does for a compiled CPU model
(torch/_inductor/fx_passes/mkldnn_fusion.py), without compiling. The same kernel otherwise, so the
same results bit for bit (tests/test_predict.py).

Measured on a 2-core AVX512-BF16 EPYC (no AMX), torch 2.13: MiniLM's matrix products alone ran
1.13-1.5x faster (6,144 tokens x 384 -> 1,536: 12.8 -> 9.6 ms); fastpt-predict's 400 IMDB reviews
1.06-1.18x faster, interleaved pairs (docs/predict.md). Only bfloat16, only on a CPU where oneDNN
has bfloat16 kernels: float32 through MKL's packed GEMM measured no faster there, and a GPU's
libraries pick their own layouts. Not in training: weights that change at every step would be
repacked at every step, which is what `F.linear` does already.

`fastpt.monitoring.peak` times the same prepacked product beside `torch.mm`, so that MFU's peak is
the fastest matrix product this machine ran, not the slower of its two.
"""

import torch


def prepacking_pays(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether bfloat16 weights on this device go to oneDNN's prepacked kernel (see above)."""
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PrepackedLinear(torch.nn.Module):
    """An nn.Linear that never trains, its bfloat16 weight in oneDNN's blocked layout."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach())  # opaque: not a buffer
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


def prepack_linears(model: torch.nn.Module) -> int:
    """Make `model`'s nn.Linear modules PrepackedLinear where that pays; how many it made. `model` is
    ready: on its device, in its dtype."""
    weight = next(model.parameters())
    if not prepacking_pays(weight.device, weight.dtype):
        return 0
    linears = {id(child): child for child in model.modules() if type(child) is torch.nn.Linear}
    packed = {key: PrepackedLinear(linear.weight, linear.bias)  # one each, however often it is held
              for key, linear in linears.items()}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in packed:
                setattr(parent, name, packed[id(child)])
    return len(packed)
