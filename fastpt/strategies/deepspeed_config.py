"""The DeepSpeed JSON fastpt's flags stand for (`deepspeed_config`), checked against them where the
user gives one (--deepspeed-config), and the precisions DeepSpeed has kernels for here
(`check_supported`). deepspeed.py's docstring says what each setting does and why these values.
"""

import json
import os
from pathlib import Path

import torch

from fastpt.config import TrainConfig
from fastpt.strategies.optimizer import has_schedule


# The ZeRO section of Lightning's DeepSpeedStrategy (lightning/pytorch/strategies/deepspeed.py, its
# __init__ defaults through _create_default_config), the same for every stage. DeepSpeed's own
# defaults differ: overlap_comm only for stage 3, 5e8-element buckets, 1e9-element sub-groups.
LIGHTNING_ZERO = {
    "contiguous_gradients": True,  # copy gradients into one buffer as they are reduced: no fragmentation
    "overlap_comm": True,  # reduce a full bucket while the backward computes the next gradients
    "allgather_partitions": True,  # the updated slices return to every rank by all-gather
    "reduce_scatter": True,  # each rank receives only its slice of the reduced gradients
    "allgather_bucket_size": 200_000_000,  # elements per collective
    "reduce_bucket_size": 200_000_000,
    "sub_group_size": 1_000_000_000_000,  # stage 3: the optimiser steps over its slice in groups this large
}


def deepspeed_config(cfg: TrainConfig, world_size: int) -> dict:
    """The DeepSpeed JSON fastpt's flags stand for, or the user's --deepspeed-config checked against them."""
    generated = {
        "train_micro_batch_size_per_gpu": cfg.batch_size,
        "gradient_accumulation_steps": cfg.grad_accum,
        "train_batch_size": cfg.batch_size * cfg.grad_accum * world_size,
        "zero_optimization": {"stage": cfg.zero_stage, **LIGHTNING_ZERO},
        "gradient_clipping": cfg.max_grad_norm or 0.0,
        "fp16": {"enabled": cfg.amp and cfg.amp_dtype == "float16"},  # dynamic loss scaling by default
        "bf16": {"enabled": cfg.amp and cfg.amp_dtype == "bfloat16"},
        "steps_per_print": 10**9,  # fastpt logs; keep the engine quiet
    }
    if cfg.deepspeed_config is None:
        return generated
    try:
        user = json.loads(Path(cfg.deepspeed_config).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--deepspeed-config {cfg.deepspeed_config}: {e}") from None
    if not isinstance(user, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(user), "a number")
        raise ValueError(f"--deepspeed-config {cfg.deepspeed_config} holds {kind}, not a JSON object of "
                         f"DeepSpeed settings ({{\"zero_optimization\": ...}})")
    _check_user_config(user, generated)
    _check_user_optimizer(user, cfg)
    fixed = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size", "steps_per_print")
    return {**{k: generated[k] for k in fixed}, **user}


def check_supported(cfg: TrainConfig, device: torch.device) -> None:
    """Point DeepSpeed at the run's device, and refuse before any work a precision it has no kernels for.

    DeepSpeed guesses its accelerator (and warns when it settles for the CPU); naming it keeps the
    guess from disagreeing with --device. Its CPU accelerator has bfloat16, and float16 only where
    oneDNN has float16 kernels (AVX512-FP16 or AVX-NE-CONVERT): without this check the engine fails
    inside deepspeed.initialize, on every rank, after the run folder exists.
    """
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if device.type == "cuda" else "cpu")
    if not cfg.amp:
        return
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if not (accelerator.is_fp16_supported() if cfg.amp_dtype == "float16" else accelerator.is_bf16_supported()):
        other = "bfloat16" if cfg.amp_dtype == "float16" else "float16"
        raise ValueError(f"--deepspeed --amp: DeepSpeed has no {cfg.amp_dtype} on this device "
                         f"({accelerator.device_name()}); use --amp-dtype {other} or drop --amp")


def _check_user_config(user: dict, generated: dict) -> None:
    """Refuse a JSON that contradicts the flags: the data loader, the loop and the NaN check use them."""
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size"):
        if key in user and user[key] not in ("auto", generated[key]):
            raise ValueError(f"--deepspeed-config sets {key}={user[key]}, but the flags give {generated[key]} "
                             f"(--batch-size, --grad-accum, number of processes)")
    for dtype in ("fp16", "bf16"):
        wanted = generated[dtype]["enabled"]
        if bool(user.get(dtype, {}).get("enabled", False)) != wanted:
            raise ValueError(f"--deepspeed-config {'enables' if not wanted else 'does not enable'} {dtype}, "
                             f"but --amp/--amp-dtype say the opposite")


def _check_user_optimizer(user: dict, cfg: TrainConfig) -> None:
    """A JSON that names DeepSpeed's own optimiser or scheduler replaces fastpt's: their flags would do nothing."""
    if "optimizer" in user and (cfg.optimizer != "adam" or cfg.weight_decay):
        raise ValueError("--deepspeed-config names its own optimizer; drop --optimizer / --weight-decay, or the "
                         "JSON's \"optimizer\" section")
    if "scheduler" in user and has_schedule(cfg):
        raise ValueError("--deepspeed-config names its own scheduler; drop --lr-schedule / --warmup-ratio / "
                         "--warmup-steps, or the JSON's \"scheduler\" section")
