"""Fully sharded data parallel (`--fsdp`): Lightning's `strategy="fsdp"`, written with FSDP2.

What it does: like DDP, every process trains on its own shard of each batch, but no process
holds the whole model. `fully_shard` splits every parameter along its first dimension, one
piece per rank, as a DTensor. Before a transformer layer runs, its pieces are all-gathered
into full weights; after it runs they are freed again (`--fsdp-reshard-after-forward`, the
default, frees them after forward and gathers them again for backward). Gradients are
reduce-scattered, so each rank receives the summed gradient of its own piece only, and the
optimiser (built after sharding) keeps Adam's moments for that piece only.

Why it helps: parameters, gradients and optimiser state per GPU shrink to about 1/N, so models
and batches that do not fit with DDP fit. Sharding each transformer layer separately, then the
root (embeddings and classifier), lets the all-gather of layer i+1 overlap the compute of layer i.

What it costs: an all-gather per layer in forward (and another in backward when resharding) on
top of DDP's gradient reduction. The article measured 3.62 min on 4 A100s vs DDP's 3.52: for a
66M-parameter model that fits on one GPU, sharding buys memory, not speed.

Mixed precision (`--amp`): FSDP's own `MixedPrecisionPolicy` casts each rank's local shard to the
16-bit dtype before the all-gather, so the all-gather moves half the bytes and the gathered weights
need no per-op casts; gradients are reduced in float32. Autocast stays on around forward so that
the ops its device keeps in float32 (on CUDA layer norm and softmax; speedups/amp.py) do so as
without FSDP. float16 needs loss scaling with a scaler that all-reduces
its "found inf" flag, because each rank only sees its own gradient shard: `ShardedGradScaler`.

Clipping (`--max-grad-norm`) needs nothing of its own in torch 2.13 (checked by
tests/test_fsdp_clip.py against one process): the gradients are DTensors, so the stock
`torch.nn.utils.clip_grad_norm_` (the base strategy's) computes the whole model's norm: each
shard's norm is a partial (`_NormPartial`) DTensor, summed over the ranks by one all-reduce
inside the call into a replicated total, and every rank scales its shard by the same factor. The
returned total is still a DTensor; `full_tensor()` turns it into a plain tensor (as torchtitan
does), which for a replicated one costs no communication. FSDP1's flat gradients needed its own
`FullyShardedDataParallel.clip_grad_norm_`.

Checkpoints: `model_state_dict` gathers the full, unsharded state on rank 0 (a collective), so
`best.pt` loads into a plain model. `training_state` (resume) gathers the full model and the
full optimiser state the same way (torch.distributed.checkpoint.state_dict with
`full_state_dict=True`) and keeps them in last.pt: one self-contained file, loadable with
`weights_only=True` and by any world size. Distributed checkpointing (DCP, one file per rank,
no gather) is what scales to models that do not fit in one process's memory; this project's
models do, and one file keeps resume identical across strategies.
"""

import contextlib

import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from fastpt.speedups.compile import compile_layers, transformer_layers
from fastpt.strategies.base import Strategy


# Gather to full tensors on rank 0's CPU; other ranks get an empty dict (saving is rank 0's job).
GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)
# Every rank holds the full state read from the file; each keeps its own shard of it.
SCATTER = StateDictOptions(full_state_dict=True)


def apply_fsdp(model: torch.nn.Module, reshard_after_forward: bool = True,
               param_dtype: torch.dtype | None = None, compile_mode: str | None = None,
               dynamic_tokens: bool = False) -> torch.nn.Module:
    """Shard each transformer layer, then the root; the model is changed in place and returned.

    With `compile_mode`, each layer is compiled in place before sharding (torchtitan's order):
    the compiled regions are the layers, and FSDP's all-gather / reduce-scatter hooks run
    between them, so no collective breaks a compiled graph and parameter names do not change.
    A layer's input is a hidden state, not the marked input ids, so where lengths vary
    (`dynamic_tokens`) each layer is compiled with dynamic shapes.
    """
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    if compile_mode is not None:  # in place, before sharding; without fullgraph, as FSDP always compiled them
        compile_layers(model, compile_mode, dynamic_tokens, fullgraph=False)
    for layer in transformer_layers(model):
        fully_shard(layer, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)
    # The root holds the embeddings and the classifier; FSDP keeps its weights gathered
    # between forward and backward, since backward needs them straight away.
    fully_shard(model, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)
    return model


class FSDPStrategy(Strategy):
    name = "fsdp"

    def __init__(self, cfg, dist):
        super().__init__(cfg, dist)
        if self.grad_scaler.is_enabled():
            # Each rank checks only its gradient shard for inf/NaN; this scaler all-reduces
            # the flag so every rank skips (or takes) the same step.
            self.precision.grad_scaler = ShardedGradScaler(self.device.type)

    def wrap(self, module: torch.nn.Module) -> torch.nn.Module:
        return apply_fsdp(module, self.cfg.fsdp_reshard_after_forward, self.precision.dtype if self.cfg.amp else None,
                          self.cfg.compile_mode if self.cfg.compile else None, self.cfg.varying_lengths)

    def grad_sync(self, enabled: bool):
        """On accumulation micro-batches keep full local gradients instead of reduce-scattering."""
        self.module.set_requires_gradient_sync(enabled)  # every step's last micro-batch sets it back
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ state
    def model_state_dict(self) -> dict:
        """The full model on rank 0 (an all-gather per parameter: every rank must call it)."""
        return get_model_state_dict(self.module, options=GATHER)

    def load_model_state_dict(self, state: dict) -> None:
        set_model_state_dict(self.module, state, options=SCATTER)

    def optimizer_state_dict(self) -> dict:
        """The full optimiser state on rank 0, gathered as the model's is (training_state: last.pt)."""
        return get_optimizer_state_dict(self.module, self.optimizer, options=GATHER)

    def load_optimizer_state_dict(self, state: dict) -> None:
        set_optimizer_state_dict(self.module, self.optimizer, state, options=SCATTER)
