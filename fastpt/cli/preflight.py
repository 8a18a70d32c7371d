"""What the command line checks and settles before the run: the checks that need no data (flags
against the environment) and those that need the device, the resolved config (every "decide for
me" setting, a new value), and the notes on what runs (one line each where it differs from what
the flags suggest). cli/shell.py calls them, in its order; none of them writes anything.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
from pathlib import Path

from fastpt.cli.run_folder import run_folder_of
from fastpt.config import TrainConfig


# ---------------------------------------------------------------------------- checks before any work

def check_environment(cfg: TrainConfig) -> None:
    """Checks that need no data and no process group; ValueError on failure."""
    if cfg.strategy == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        raise ValueError("--deepspeed needs the deepspeed package: pip install '.[deepspeed]' "
                         "(or pip install deepspeed)")
    if cfg.compile:
        from fastpt.speedups.compile import check_compile_supported
        check_compile_supported()
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # must be set before cuBLAS starts
    if cfg.resume == "auto" and not cfg.out:
        raise ValueError("--resume auto needs --out: the run folder to continue")
    if cfg.resume not in (None, "auto"):
        # Under torchrun rank 0 alone looks for it (plan_out_dir): another node may not see the file.
        if "RANK" not in os.environ and not Path(cfg.resume).is_file():
            raise ValueError(f"--resume {cfg.resume}: no such checkpoint file")
        if cfg.out and Path(cfg.out).resolve() != run_folder_of(Path(cfg.resume)):
            raise ValueError(f"--resume {cfg.resume} continues in its own run folder "
                             f"{run_folder_of(Path(cfg.resume))}, not --out {cfg.out}; drop --out")


def check_device_support(cfg: TrainConfig, dist) -> None:
    """Checks that need the device: precision support, the DeepSpeed config."""
    if cfg.amp:
        from fastpt.speedups.amp import check_dtype_supported
        check_dtype_supported(cfg.amp_dtype, dist.device)
    if cfg.strategy == "deepspeed":
        from fastpt.strategies.deepspeed_config import check_supported, deepspeed_config
        check_supported(cfg, dist.device)
        deepspeed_config(cfg, dist.world_size)  # reads and checks --deepspeed-config


# ---------------------------------------------------------------------------- the resolved config

def resolve_config(cfg: TrainConfig, dist, out: Path) -> TrainConfig:
    """The config with every "decide for me" setting filled in, so config.json says what really ran."""
    from fastpt.inputs import data, token_cache

    on_cuda = dist.device.type == "cuda"
    paths = {"out": str(out.resolve()), "cache_dir": str(token_cache.cache_root(cfg.cache_dir).resolve())}
    if cfg.data:  # your own data: local paths resolved (a Hub name stays a name)
        paths.update({name: str(Path(value).resolve()) for name in ("data", "val_data", "test_data")
                      if (value := getattr(cfg, name)) and Path(value).exists()})
    elif cfg.data_dir or os.environ.get("FASTPT_DATA_DIR"):  # else ./data, found or downloaded while loading
        paths["data_dir"] = str(Path(cfg.data_dir or os.environ["FASTPT_DATA_DIR"]).resolve())
    if cfg.export_dir:
        paths["export_dir"] = str(Path(cfg.export_dir).resolve())
    num_workers, pin_memory = data.loader_settings(cfg, on_cuda, dist.local_world_size)
    # A batch job's log file: bars would redraw into it; a line every --log-every steps instead (bookkeeping.py).
    progress = cfg.progress and sys.stderr.isatty()
    if not progress:
        import datasets
        datasets.disable_progress_bars()  # nor the token cache's tokenising and saving bars
    return dataclasses.replace(cfg, **paths, num_workers=num_workers, pin_memory=pin_memory, progress=progress,
                               fused_adam=on_cuda if cfg.fused_adam is None else cfg.fused_adam)


# ---------------------------------------------------------------------------- notes on what runs

def notes(cfg: TrainConfig, dist, inputs) -> list[str]:
    """One line each for what differs from what the flags might suggest."""
    from fastpt.inputs import imdb, own_data, token_cache

    lines = [f"note: {line}" for line in own_data.reading_notes(inputs.cache_path)] if cfg.data else []
    difference = None if cfg.data else imdb.differs_from_article(token_cache.split_keys(inputs.cache_path))
    if difference:
        lines.append(f"note: the data in {cfg.data_dir} holds {difference}")
    if cfg.strategy != "single" and dist.world_size == 1:
        lines.append(f"note: --{cfg.strategy} in a single process runs as a one-rank job; "
                     f"launch with torchrun --nproc_per_node=N for N processes")
    for flag, split in (("train-size", "train"), ("val-size", "validation"), ("test-size", "test")):
        asked, used = getattr(cfg, flag.replace("-", "_")), len(inputs.splits[split])
        if asked is not None and asked > used:
            lines.append(f"note: --{flag} {asked} is more than the {split} split has; using all {used}")
    # Each epoch drops the last, short batch of its shuffle (the article's DataLoader does too): worth a
    # line once it is a noticeable share of the reviews (the article's run leaves out 8 of 35,000).
    reviews, used = len(inputs.splits["train"]), inputs.train_examples_used(cfg, dist.world_size)
    if reviews - used >= 0.01 * reviews:
        lines.append(f"note: each epoch trains on {used} of the {reviews} training "
                     f"{'examples' if cfg.data else 'reviews'}: whole batches of "
                     f"{cfg.batch_size}{f' x {dist.world_size} processes' if dist.world_size > 1 else ''} "
                     f"only, the rest of each epoch's shuffle is left out")
    batches = used // (cfg.batch_size * dist.world_size)  # per process
    if cfg.grad_accum > batches:
        lines.append(f"note: --grad-accum {cfg.grad_accum}, but an epoch has {batches} batch"
                     f"{'' if batches == 1 else 'es'}{' per process' if dist.world_size > 1 else ''}: "
                     f"each epoch makes one optimiser step, over {batches}")
    from fastpt.strategies.optimizer import has_schedule, total_steps, warmup_steps
    steps = total_steps(cfg, batches)
    if has_schedule(cfg) and warmup_steps(cfg, steps) >= steps:
        lines.append(f"note: the warmup takes {warmup_steps(cfg, steps)} optimiser steps and the run makes {steps}: "
                     f"the learning rate never reaches --lr {cfg.lr:g}")
    if cfg.amp and cfg.amp_dtype == "bfloat16" and dist.device.type == "cpu" and not cpu_has_native_bfloat16():
        lines.append("note: this CPU has no native bfloat16 (no AVX512-BF16 or AMX): --amp-dtype bfloat16 "
                     "is emulated here and slower than float32")
    return lines


def cpu_has_native_bfloat16() -> bool:
    import torch

    return torch.backends.cpu.get_cpu_capability() in ("AVX512", "AVX512_BF16", "AMX") and bool(
        torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
