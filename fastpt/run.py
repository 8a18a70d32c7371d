"""`train.py`'s body: parse, check, build, train, close, with clear exits.

Exit status: 0 done; 2 bad input (one line on stderr, before any work, nothing written);
3 stopped by SIGTERM/SIGINT after writing checkpoints/last.pt; 1 the run failed (e.g. the
loss became NaN; earlier checkpoints are left untouched).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import time
from pathlib import Path

from fastpt import distributed
from fastpt.checkpoint import CheckpointError, load as load_checkpoint
from fastpt.config import RESUME_SENSITIVE, TrainConfig, parse_args
from fastpt.imdb import DataError
from fastpt.models import ModelError
from fastpt.signals import EXIT_STOPPED, StopRequested
from fastpt.tracking import write_json_atomic

EXIT_BAD_INPUT = 2
RUN_FILES = ("config.json", "results.json", "checkpoints", "tb")


def check_environment(cfg: TrainConfig) -> None:
    """Checks that need no data and no process group; ValueError on failure."""
    if cfg.strategy == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        raise ValueError("--deepspeed needs the deepspeed package (pip install deepspeed)")
    if cfg.compile:
        from fastpt.compile import check_compile_supported
        check_compile_supported()
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # must be set before cuBLAS starts
    if cfg.resume not in (None, "auto") and not Path(cfg.resume).is_file():
        raise ValueError(f"--resume {cfg.resume}: no such checkpoint file")


def prepare_out_dir(cfg: TrainConfig, dist: distributed.DistInfo) -> tuple[Path, dict | None]:
    """The run folder, and the resume state if continuing. Refuses to clobber another run."""
    if cfg.out:
        out = Path(cfg.out)
    elif cfg.resume not in (None, "auto"):
        out = Path(cfg.resume).resolve().parent.parent
    else:
        out = Path("runs") / distributed.broadcast_object(time.strftime("%Y%m%d-%H%M%S"))
    resume_path = None
    if cfg.resume == "auto":
        candidate = out / "checkpoints" / "last.pt"
        resume_path = candidate if candidate.is_file() else None
    elif cfg.resume:
        resume_path = Path(cfg.resume)
    state = None
    if resume_path is not None:
        state = load_checkpoint(resume_path)
        check_resume_compatible(cfg, state, dist.world_size, resume_path)
    else:
        existing = [name for name in RUN_FILES if (out / name).exists()]
        if existing and not cfg.overwrite:
            raise ValueError(f"--out {out} holds another run ({', '.join(existing)}); pass --overwrite to replace it, "
                             f"--resume auto to continue it, or choose another folder")
        distributed.barrier()  # every rank has looked before rank 0 clears anything
        if existing and dist.is_main:
            for name in existing:
                path = out / name
                shutil.rmtree(path) if path.is_dir() else path.unlink()
    return out, state


def check_resume_compatible(cfg: TrainConfig, state: dict, world_size: int, path: Path) -> None:
    if not isinstance(state, dict) or "progress" not in state or "config" not in state:
        raise CheckpointError(f"{path} is not a fastpt last.pt checkpoint")
    saved = state["config"]
    for name in RESUME_SENSITIVE:
        if saved.get(name) != getattr(cfg, name):
            raise CheckpointError(f"cannot resume from {path}: --{name.replace('_', '-')} was "
                                  f"{saved.get(name)!r}, now {getattr(cfg, name)!r}")
    if state.get("world_size") != world_size:
        raise CheckpointError(f"cannot resume from {path}: it was written by {state.get('world_size')} "
                              f"process(es), this run has {world_size}")


def main(argv=None) -> int:
    try:
        cfg = parse_args(argv)
        check_environment(cfg)
    except ValueError as e:
        return _bad_input(e)
    try:
        dist = distributed.init(cfg.device, needs_group=cfg.strategy != "single")
    except ValueError as e:
        return _bad_input(e)
    try:
        from fastpt.trainer import NonFiniteLoss, Trainer

        if cfg.strategy != "single" and dist.world_size == 1 and dist.is_main:
            print(f"note: --{cfg.strategy} in a single process runs as a one-rank job; "
                  f"launch with torchrun --nproc_per_node=N for N processes", file=sys.stderr)
        if cfg.amp:
            from fastpt.amp import check_dtype_supported
            check_dtype_supported(cfg.amp_dtype, dist.device)
        out, resume_state = prepare_out_dir(cfg, dist)
        trainer = Trainer(cfg, dist, out)
        trainer.resume_state = resume_state
        if dist.is_main:
            out.mkdir(parents=True, exist_ok=True)
            write_json_atomic(out / "config.json", {**cfg.to_dict(), "world_size": dist.world_size})
        trainer.fit()
        if dist.is_main:
            print(f"outputs: {out}")
        return 0
    except (ValueError, DataError, ModelError, CheckpointError) as e:
        return _bad_input(e, dist.is_main)
    except StopRequested as e:
        if dist.is_main:
            print(f"stopped: {e}", file=sys.stderr)
        return EXIT_STOPPED
    except NonFiniteLoss as e:
        if dist.is_main:
            print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        distributed.shutdown()


def _bad_input(e: Exception, is_main: bool = True) -> int:
    if is_main:
        print(f"error: {e}", file=sys.stderr)
    return EXIT_BAD_INPUT
