"""The interface every strategy implements, and the single-device strategy itself.

The training step (`step.train_step`) never asks which strategy it runs. It calls, in the
textbook order:

    with strategy.grad_sync(enabled=last_micro_batch):   # DDP / FSDP: reduce gradients only on the last
        loss = forward_loss(strategy.model, batch)        # forward under strategy.precision.autocast(), the loss
        strategy.backward(loss / micro_batches)           # grad_scaler.scale(loss).backward()
    strategy.optimizer_step()                             # unscale_, clip, step, update, zero_grad

Strategies differ in how they wrap the model (`wrap`), run backward and step (DeepSpeed's
engine owns both), and gather state for checkpoints (FSDP and ZeRO-3 hold shards). Every setup
follows one documented order (see `setup`).
"""

import contextlib
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from fastpt.config import TrainConfig
from fastpt.cluster.distributed import DistInfo
from fastpt.speedups.amp import MixedPrecision
from fastpt.speedups.compile import apply_compile, compile_layers, mark_token_dim_dynamic
from fastpt.strategies.optimizer import build_lr_scheduler, build_optimizer


class Strategy:
    """One process, one device: Lightning's `Trainer(devices=1)`."""

    name = "single"

    def __init__(self, cfg: TrainConfig, dist: DistInfo):
        self.cfg, self.dist, self.device = cfg, dist, dist.device
        self.precision = MixedPrecision(cfg.amp, cfg.amp_dtype, dist.device)
        self.module: torch.nn.Module | None = None  # the plain model: what checkpoints hold
        self.model: torch.nn.Module | None = None  # what the step calls: wrapped (DDP, FSDP, engine)
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler = None  # --lr-schedule / warmup (optimizer.py); None: the article's constant rate
        self.step_lr: float | None = None  # the learning rate the last step trained with (logged)
        self._skipped: torch.Tensor | None = None  # whether the scaler skipped the last step, on the device

    @property
    def grad_scaler(self) -> torch.amp.GradScaler:
        return self.precision.grad_scaler

    # ------------------------------------------------------------------ setup
    def setup(self, model: torch.nn.Module, training_steps: int | None = None) -> None:
        """The one order, which train.py calls: to device -> wrap (compile the layers in place; DDP
        compiles, then wraps: ddp.py's apply_ddp; FSDP compiles, then shards each layer: fsdp.py's
        apply_fsdp) -> optimizer -> learning-rate schedule (over `training_steps` optimiser steps).

        The optimizer is built last, from the parameters as they finally are (FSDP replaces
        them with sharded DTensors).
        """
        self.module = model.to(self.device)
        self.model = self.wrap(self.module)
        self.optimizer = self.build_optimizer(self.module)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, self.cfg, training_steps)

    def wrap(self, module: torch.nn.Module) -> torch.nn.Module:
        """One device: with `--compile-scope layers` each transformer layer is compiled in place; the
        module itself is what the step calls."""
        if self.compiles("layers"):
            compile_layers(module, self.cfg.compile_mode, self.cfg.varying_lengths)
        return module

    def compiles(self, scope: str) -> bool:
        return self.cfg.compile and self.cfg.compile_scope == scope

    def compile_step(self, fn):
        """`fn(model, batch)` compiled whole (`fullgraph=True`) with `--compile --compile-scope whole`;
        else fn itself.

        On one device the whole compiled unit is the step's forward, loss and metric sums, so a
        reader reads exactly what runs. DDP and FSDP compile the model or its layers in `wrap`
        instead (their communication hooks sit between the compiled regions) and leave `fn` eager.
        """
        return apply_compile(fn, self.cfg.compile_mode, fullgraph=True) if self.compiles("whole") else fn

    def build_optimizer(self, module: torch.nn.Module) -> torch.optim.Optimizer:
        """The article's Adam (lr 5e-5, no weight decay), or AdamW (optimizer.py), fused where asked or on CUDA.

        PyTorch's default Adam on CUDA is the foreach implementation: each step of Adam's update
        (moments, bias correction, the weight update) is one multi-tensor kernel over the parameters,
        so every tensor is read and written several times. The fused implementation does the whole
        update in one kernel per group of tensors; the maths is the same. PyTorch does not make it
        the default yet (torch/optim/adam.py: "bake-in time"). On the CPU the default is a loop
        over the parameter tensors (no foreach kernels there); fused runs on the CPU too.
        """
        fused = self.cfg.fused_adam if self.cfg.fused_adam is not None else self.device.type == "cuda"
        return build_optimizer(module, self.cfg, fused)

    # ------------------------------------------------------------------ the step
    def to_device(self, batch: dict) -> dict:
        """The batch's tensors on this rank's device (asynchronous from pinned memory)."""
        moved = {k: v.to(self.device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
        if self.cfg.compile and self.cfg.varying_lengths:
            mark_token_dim_dynamic(moved)  # one compiled graph for every length
        return moved

    def grad_sync(self, enabled: bool):
        """Whether this backward reduces gradients across processes (DDP, FSDP); nothing to do here."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        self.grad_scaler.scale(loss).backward()  # float16: scaled up so small gradients do not underflow

    def optimizer_step(self) -> None:
        """The GradScaler's remaining calls in their order around clipping and the step; then the schedule."""
        self.step_lr = self.optimizer.param_groups[0]["lr"]
        scaled = self.grad_scaler.is_enabled()
        if scaled:  # the scale the step starts from: the initial one, or the checkpoint's after a resume
            scale = self.precision.live_scale()[0]  # the live tensor: update() changes it in place
            before = scale.clone()
        if self.cfg.max_grad_norm is not None:
            self.grad_scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
            self.clip_grad_norm_(self.cfg.max_grad_norm)
        self.grad_scaler.step(self.optimizer)  # skipped if the gradients hold inf/NaN
        self.grad_scaler.update()  # lower the scale after a skipped step, raise it after many good ones
        self.optimizer.zero_grad(set_to_none=True)
        # GradScaler halves its scale on every skipped step and lowers it at no other time (it doubles
        # it after 2000 good steps in a row), so a scale below the one the step started from marks a skip.
        if scaled:
            self._skipped = scale < before
        # The next step's rate; a skipped step (no update) leaves it, as transformers' Trainer does: the
        # one host read per step here, and only under float16 with a schedule (optimizer.py).
        if self.lr_scheduler is not None and not (self._skipped is not None and bool(self._skipped)):
            self.lr_scheduler.step()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale all gradients so that their global norm is at most max_norm; that norm, as a plain tensor.

        Under FSDP2 the gradients are DTensors, and the stock call computes the whole model's norm: each
        shard's norm is a partial DTensor (`_NormPartial`, pending a sum over the ranks), and combining
        them into the total makes DTensor all-reduce them, inside the call, so the total comes back
        replicated (a `Replicate` DTensor, torch 2.13) and every rank clips as one process would.
        `full_tensor()` makes it a plain tensor to log or compare; on a replicated DTensor it moves
        nothing, and on a partial one it would be the all-reduce, so the value is right either way
        (tests/test_fsdp_clip.py: one all-reduce in all, the norm and the gradients of one process).
        """
        total_norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm)
        return total_norm.full_tensor() if isinstance(total_norm, DTensor) else total_norm

    @property
    def skips_nonfinite_steps(self) -> bool:
        """True where a NaN/inf loss is expected now and then and handled (float16's GradScaler)."""
        return self.grad_scaler.is_enabled()

    def step_was_skipped(self) -> torch.Tensor:
        """Whether the scaler skipped the step just taken (inf/NaN gradients): a bool on the device, no host read."""
        return self._skipped if self._skipped is not None else torch.tensor(False)

    def train(self, mode: bool = True) -> None:
        self.model.train(mode)

    # ------------------------------------------------------------------ state
    def model_state_dict(self) -> dict:
        """The full, unwrapped model state on CPU (rank 0 uses it; collective where sharded)."""
        return {k: v.detach().cpu().clone() for k, v in self.module.state_dict().items()}

    def load_model_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state)

    def training_state(self, ckpt_dir: Path) -> dict:
        """Everything to continue training, as tensors and plain containers (weights_only-safe). The
        schedule keeps its position (its step count; the rate itself is in the optimiser's param groups)."""
        schedule = {"lr_scheduler": self.lr_scheduler.state_dict()} if self.lr_scheduler is not None else {}
        return {"model": self.model_state_dict(), "optimizer": self.optimizer_state_dict(),
                "scaler": self.precision.state_dict(), **schedule}

    def load_training_state(self, state: dict, ckpt_dir: Path) -> None:
        self.load_model_state_dict(state["model"])
        self.load_optimizer_state_dict(state["optimizer"])
        self.precision.load_state_dict(state["scaler"])
        if self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])

    def optimizer_state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_optimizer_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)

    def memory_report(self) -> dict:
        """Bytes of parameters, gradients and optimiser state held by this rank."""
        params = list(self.module.parameters())
        return {"param_bytes": sum(local_bytes(p) for p in params),
                # Gradients are freed after each step; while held they take the parameters' layout.
                "grad_bytes": sum(local_bytes(p) for p in params if p.requires_grad),
                "optimizer_bytes": optimizer_state_bytes(self.optimizer)}

    def close(self) -> None:
        pass


def local_bytes(t: torch.Tensor) -> int:
    """Bytes this rank stores for t: a DTensor's local shard, else the tensor."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimiser's state tensors (Adam's moments) this rank holds."""
    return sum(local_bytes(t) for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t))
