"""The optimiser and its learning-rate schedule, as Hugging Face's Trainer builds them (`--optimizer`,
`--weight-decay`, `--lr-schedule`, `--warmup-ratio`, `--warmup-steps`).

What it does: the article trains with plain Adam at a constant 5e-5, and that stays the default
(`--optimizer adam`, `--lr-schedule constant`, no warmup: no schedule object at all). Fine-tuning
recipes written for `transformers.Trainer` use AdamW with weight decay and a learning rate that
warms up linearly from 0, then decays:
- `--optimizer adamw --weight-decay W`: decoupled weight decay (each step also shrinks a weight by
  lr x W) on every weight except biases and LayerNorm weights, Trainer's two parameter groups
  (`decay_parameter_names` follows `Trainer.get_decay_parameter_names`: a parameter of a LayerNorm,
  or one whose name has "bias", "layernorm", "rmsnorm" or a "norm" part, does not decay). Decaying
  a LayerNorm's gain pulls it towards 0, which only hurts; biases hold no "size" worth limiting.
- `--lr-schedule constant|linear|cosine` with `--warmup-ratio R` or `--warmup-steps N`: the
  multiplier of `--lr` at optimiser step s is transformers' `get_constant_schedule_with_warmup`,
  `get_linear_schedule_with_warmup` or `get_cosine_schedule_with_warmup`, formula for formula
  (`lr_factor`). A ratio becomes ceil(R x total steps) warmup steps, as `TrainingArguments`.
  Total steps are the optimiser steps the run will take: epochs x ceil(batches per epoch /
  --grad-accum) (an epoch's short last window is a step too), or --max-steps where that is sooner.

When the schedule moves: once per optimiser step, after the step (torch's `LambdaLR.step`), so
step s trains with factor(s), from factor(0) (0 with warmup) on. A step that float16's loss scaler
skipped (inf/NaN gradients, so no update) does not move it: Trainer's rule (it asks accelerate's
`optimizer_step_was_skipped`) and DeepSpeed's (its engine steps the schedule only without overflow).
Knowing whether a step was skipped means reading one flag back from the device each step: only
under float16 with a schedule, and accelerate reads the scale back every step in that case too.

What it costs: nothing measurable; the schedule is host arithmetic, one float per parameter group
per step. The schedule's position is saved in last.pt (DeepSpeed: in its own checkpoint), so a
resumed run continues at the same learning rate, bitwise.

Lightning has no flag for either: a LightningModule's `configure_optimizers` returns the optimiser
and an `lr_scheduler` dict with `"interval": "step"`.
"""

import math
import re

import torch
from torch import nn

from fastpt.config import TrainConfig


# Trainer.get_decay_parameter_names (transformers 5): matched against the lower-cased parameter name.
NO_DECAY_NAMES = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")


def decay_parameter_names(model: nn.Module) -> set[str]:
    """The parameters weight decay applies to: not inside a LayerNorm, no bias or norm in the name."""
    in_layer_norm = {f"{prefix}.{name}" if prefix else name
                     for prefix, module in model.named_modules() if isinstance(module, nn.LayerNorm)
                     for name, _ in module.named_parameters()}
    return {name for name, _ in model.named_parameters()
            if name not in in_layer_norm and not NO_DECAY_NAMES.search(name.lower())}


def build_optimizer(model: nn.Module, cfg: TrainConfig, fused: bool) -> torch.optim.Optimizer:
    """Adam over every parameter (the article's), or AdamW with Trainer's decay and no-decay groups."""
    if cfg.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=cfg.lr, fused=fused or None)
    decay = decay_parameter_names(model)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in named if n in decay], "weight_decay": cfg.weight_decay},
              {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, fused=fused or None)


def total_steps(cfg: TrainConfig, batches_per_epoch: int) -> int:
    """The optimiser steps the run takes: every epoch's, or --max-steps if it ends the run sooner."""
    steps = cfg.epochs * math.ceil(batches_per_epoch / cfg.grad_accum)
    return min(steps, cfg.max_steps) if cfg.max_steps is not None else steps


def warmup_steps(cfg: TrainConfig, total: int) -> int:
    """--warmup-steps, or ceil(--warmup-ratio x total) as TrainingArguments.get_warmup_steps; 0 without either."""
    if cfg.warmup_steps is not None:
        return cfg.warmup_steps
    return math.ceil(total * cfg.warmup_ratio) if cfg.warmup_ratio else 0


def lr_factor(kind: str, step: int, warmup: int, total: int) -> float:
    """The multiplier of --lr at optimiser step `step` (from 0), as transformers' schedules compute it."""
    if step < warmup:
        return float(step) / float(max(1, warmup))  # up from 0, linearly
    if kind == "constant":
        return 1.0
    span = float(max(1, total - warmup))
    if kind == "linear":
        return max(0.0, float(total - step) / span)  # down to 0 at the last step
    progress = float(step - warmup) / span
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)))  # half a cosine wave (num_cycles 0.5)


def has_schedule(cfg: TrainConfig) -> bool:
    """Whether the learning rate ever differs from --lr (the article's constant rate: no schedule at all)."""
    return cfg.lr_schedule != "constant" or bool(cfg.warmup_steps) or bool(cfg.warmup_ratio)


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig,
                       training_steps: int | None) -> torch.optim.lr_scheduler.LambdaLR | None:
    """torch's LambdaLR with `lr_factor` (it sets the first step's rate at once); None for the constant rate."""
    if not has_schedule(cfg):
        return None
    if training_steps is None:
        raise ValueError("a learning-rate schedule needs the run's number of optimiser steps")
    warmup = warmup_steps(cfg, training_steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(cfg.lr_schedule, s, warmup, training_steps))
