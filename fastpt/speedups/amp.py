"""Automatic mixed precision (`--amp`): autocast, and a GradScaler for float16.

What it does: inside `torch.autocast`, matrix multiplications and attention (SDPA, its softmax
included) run in float16 or bfloat16, while the weights and the optimiser state stay in float32.
Which other ops autocast keeps in float32 depends on the device: CUDA's list holds layer norm,
softmax and the losses; on the CPU (measured, torch 2.13) layer norm and softmax run in the
bfloat16 of their input and only ops such as the loss (nll_loss) are cast up. fastpt computes the
loss from `logits.float()`, so it is float32 on both.

Why it is faster: tensor cores run 16-bit matmuls many times faster than float32 (A100: 312
vs 19.5 TFLOP/s dense), and activations take half the memory and bandwidth. The article
measured 22.63 -> 8.75 min from this alone.

What it costs: float16 has a narrow range, so small gradients underflow to zero. The
GradScaler multiplies the loss by a large factor before backward, divides the gradients back
(`unscale_`) before clipping and stepping, skips a step whose gradients overflowed to inf/NaN
and lowers the factor. bfloat16 has float32's range and needs no scaler, but fewer mantissa
bits. Evaluation runs under the same autocast, so it measures the model as trained.

Where the lines are: `autocast()` opens the context in `step.forward_loss` and in the
`eval_sums` that `evaluation.make_eval_sums` builds; the GradScaler's four calls (`scale` in
`Strategy.backward`; `unscale_`, `step`, `update` in `Strategy.optimizer_step`) sit together in
`strategies/base.py`.

Replaces Lightning's `precision="16-mixed"` (`--amp`) and `precision="bf16-mixed"`
(`--amp --amp-dtype bfloat16`).
"""

import contextlib

import torch


DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


class MixedPrecision:
    """The autocast context and the gradient scaler of one run."""

    def __init__(self, enabled: bool, dtype: str, device: torch.device):
        self.enabled = enabled
        self.dtype = DTYPES[dtype]
        self.device_type = device.type
        # Only float16 needs loss scaling. A disabled GradScaler's methods are pass-throughs
        # (scale returns the loss, step calls optimizer.step), so the step needs no `if`.
        self.grad_scaler = torch.amp.GradScaler(device.type, enabled=enabled and dtype == "float16")

    def autocast(self):
        return torch.autocast(self.device_type, self.dtype) if self.enabled else contextlib.nullcontext()

    def live_scale(self) -> tuple[torch.Tensor, float]:
        """(the loss scale as the live device tensor, the scale it started from), read without a host sync.

        GradScaler's public `get_scale()` calls `.item()` (the host waits for the device), so this reads
        its private `_get_scale_async()` and `_init_scale` (torch 2.13's names), here and nowhere else.
        """
        return self.grad_scaler._get_scale_async(), self.grad_scaler._init_scale

    # A disabled GradScaler saves {} and loads nothing; an enabled one refuses the {} a run without it saved.
    def state_dict(self) -> dict:
        return self.grad_scaler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if state:
            self.grad_scaler.load_state_dict(state)


def check_dtype_supported(dtype: str, device: torch.device) -> None:
    """Refuse bfloat16 on a GPU that has no bfloat16 support (before Ampere)."""
    if dtype == "bfloat16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError(f"--amp-dtype bfloat16 is not supported on {torch.cuda.get_device_name(device)}")
