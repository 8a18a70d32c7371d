"""The interface every strategy implements, and the single-device strategy itself.

The training loop never asks which strategy it runs. It calls, in the textbook order:

    with strategy.no_sync(not last_micro_step):      # DDP: skip the all-reduce
        with strategy.autocast():                     # mixed precision, if on
            loss = loss_fn(strategy.model(**inputs))
        strategy.backward(loss / grad_accum)          # GradScaler / engine.backward
    if last_micro_step:
        strategy.step()                               # unscale, clip, step, update, zero_grad

Strategies differ in how they wrap the model (`wrap`), run backward and step (DeepSpeed's
engine owns both), and gather state for checkpoints (FSDP and ZeRO-3 hold shards). Every
setup follows one documented order (see `setup`).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from fastpt.amp import MixedPrecision
from fastpt.compile import apply_compile
from fastpt.config import TrainConfig
from fastpt.distributed import DistInfo


class Strategy:
    """One process, one device: Lightning's `Trainer(devices=1)`."""

    name = "single"
    lightning = 'Trainer(devices=1)'

    def __init__(self, cfg: TrainConfig, dist: DistInfo):
        self.cfg, self.dist = cfg, dist
        self.device = dist.device
        self.precision = MixedPrecision(cfg.amp, cfg.amp_dtype, dist.device)
        self.module: torch.nn.Module | None = None  # the plain model: what checkpoints hold
        self.model: torch.nn.Module | None = None  # what the loop calls: compiled / wrapped
        self.optimizer: torch.optim.Optimizer | None = None

    # ------------------------------------------------------------------ setup
    def setup(self, model: torch.nn.Module) -> None:
        """The one order: to device -> compile -> wrap (DDP; FSDP compiles then shards each layer) -> optimizer.

        The optimizer is built last, from the parameters as they finally are (FSDP replaces
        them with sharded DTensors).
        """
        self.module = model.to(self.device)
        self.model = self.wrap(self.module)
        self.optimizer = self.build_optimizer(self.module)

    def wrap(self, module: torch.nn.Module) -> torch.nn.Module:
        if not self.cfg.compile:
            return module
        return apply_compile(module, self.cfg.compile_mode, dynamic_shapes=self.cfg.pad_to == "longest")

    def build_optimizer(self, module: torch.nn.Module) -> torch.optim.Optimizer:
        """The article's Adam (lr 5e-5, no weight decay), fused into one kernel where asked or on CUDA.

        The fused implementation updates every parameter in one kernel instead of a handful
        of kernels per parameter tensor; the maths is the same.
        """
        fused = self.cfg.fused_adam if self.cfg.fused_adam is not None else self.device.type == "cuda"
        return torch.optim.Adam(module.parameters(), lr=self.cfg.lr, fused=fused or None)

    # ------------------------------------------------------------------ the step
    def autocast(self):
        return self.precision.autocast()

    def no_sync(self, skip: bool):
        """Skip gradient synchronisation on accumulation micro-steps (DDP); nothing here."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        self.precision.scale(loss).backward()

    def step(self) -> None:
        if self.cfg.max_grad_norm is not None:
            self.precision.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.cfg.max_grad_norm)
        self.precision.step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)

    def train(self, mode: bool = True) -> None:
        self.model.train(mode)

    # ------------------------------------------------------------------ state
    def model_state_dict(self) -> dict:
        """The full, unwrapped model state on CPU (rank 0 uses it; collective where sharded)."""
        return {k: v.detach().cpu().clone() for k, v in self.module.state_dict().items()}

    def load_model_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state)

    def training_state(self, ckpt_dir: Path) -> dict:
        """Everything to continue training, as tensors and plain containers (weights_only-safe)."""
        return {
            "model": self.model_state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.precision.state_dict(),
        }

    def load_training_state(self, state: dict, ckpt_dir: Path) -> None:
        self.load_model_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.precision.load_state_dict(state["scaler"])

    def memory_report(self) -> dict:
        """Bytes of parameters, gradients and optimiser state held by this rank."""
        params = list(self.module.parameters())
        optim = [v for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        return {
            "param_bytes": sum(_local_bytes(p) for p in params),
            # Gradients are freed after each step; while held they take the parameters' layout.
            "grad_bytes": sum(_local_bytes(p) for p in params if p.requires_grad),
            "optimizer_bytes": sum(_local_bytes(t) for t in optim),
        }

    def close(self) -> None:
        pass


def _local_bytes(t: torch.Tensor) -> int:
    """Bytes this rank stores for t: a DTensor's local shard, else the tensor."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()
