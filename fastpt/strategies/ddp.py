"""Distributed data parallel (`--ddp`): Lightning's `strategy="ddp"`.

What it does: every process holds a full copy of the model and trains on its own shard of
each epoch (DistributedSampler). During backward, DistributedDataParallel all-reduces the
gradients in buckets, averaging them over processes, so every copy takes the same step.

Why it is faster: N GPUs process N batches at once; the gradient all-reduce overlaps the rest
of backward, bucket by bucket. The article measured 3.52 min on 4 A100s vs 8.75 on one.

What it costs: a full model, gradients and optimiser state on every GPU (see --fsdp and
--deepspeed for sharding them), and one all-reduce of all gradients per step. With gradient
accumulation, `grad_sync(enabled=False)` (DDP's `no_sync`) skips the all-reduce on every
micro-batch but the last.

The effective batch is batch_size x world_size: 2 processes with batch 12 take the same
steps as one process with batch 24.
"""

import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel

from fastpt.speedups.compile import apply_compile, compile_layers
from fastpt.strategies.base import Strategy


def apply_ddp(model: torch.nn.Module, device: torch.device, compile_mode: str | None = None,
              compile_scope: str = "layers", dynamic_tokens: bool = False) -> torch.nn.Module:
    """`model` compiled (with `compile_mode`), then wrapped in DistributedDataParallel: what the step calls.

    Compile first, then wrap. The whole model (`compile_scope` "whole"): DDP's graph-break
    optimizer (DDPOptimizer) splits the compiled graph at bucket boundaries so each bucket's
    all-reduce starts as soon as its gradients are ready. The layers: each compiled in place, and
    DDP's hooks fire between them.
    """
    if compile_mode is not None and compile_scope == "whole":
        model = apply_compile(model, compile_mode)
    elif compile_mode is not None:
        compile_layers(model, compile_mode, dynamic_tokens)
    # Every rank starts from rank 0's weights (DDP broadcasts them); gradients are averaged in backward.
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


class DDPStrategy(Strategy):
    name = "ddp"

    def wrap(self, module: torch.nn.Module) -> torch.nn.Module:
        return apply_ddp(module, self.device, self.cfg.compile_mode if self.cfg.compile else None,
                         self.cfg.compile_scope, self.cfg.varying_lengths)

    def compile_step(self, fn):
        return fn  # the model inside DDP is compiled (see wrap)

    def grad_sync(self, enabled: bool):
        return contextlib.nullcontext() if enabled else self.model.no_sync()
