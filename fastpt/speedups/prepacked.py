"""bfloat16 weights prepacked for the CPU's matrix kernel: fastpt-predict's linear layers on a CPU.

oneDNN, which runs PyTorch's bfloat16 matrix products on a CPU, computes on weights laid out in its
own blocks. `F.linear` hands it the plain [out, in] weight at every call, which the kernel reorders
or reads in place as it sees fit; a model that never trains can reorder it once. `prepack_linears`
replaces each nn.Linear with a PrepackedLinear holding
`torch.ops.mkldnn._reorder_linear_weight(weight)` and calling `torch.ops.mkldnn._linear_pointwise`:
what Inductor's freezing does for a compiled CPU model
(torch/_inductor/fx_passes/mkldnn_fusion.py), without compiling. The same kernel otherwise, so the
same results bit for bit (tests/test_predict.py).

Measured on a 2-core AVX512-BF16 EPYC (no AMX), torch 2.13, MiniLM, 400 IMDB reviews at 512 tokens
(`python scripts/bench_predict.py --data-dir ../shared/data --n 400 --fastpt-batch-sizes 4,16
--prepack-pairs 6`, 2026-12-03 15:04 UTC): fastpt-predict 1.06x faster at batch 4 and 1.09x at
batch 16, medians of six pairs alternating in one process (single pairs 0.95-1.19x: this machine
drifts by more than the gain). A small gain, free of any change in the results. Only bfloat16, only
on a CPU where oneDNN has bfloat16 kernels: float32 through MKL's packed GEMM was no faster in a
one-off check there, and a GPU's libraries pick their own layouts. Not in training: weights that
change at every step would be reordered at every step.

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
