"""`train.py`'s body: parse, check, build, train, close, with clear exits.

Exit status: 0 done; 2 bad input (one line on stderr, before any work, nothing written);
3 stopped by SIGTERM/SIGINT after writing checkpoints/last.pt; 1 the run failed (e.g. the
loss became NaN; earlier checkpoints are left untouched).

The order matters for "nothing written on bad input": every check that can fail on what the
user passed (flags, environment, the run folder, the resume checkpoint, the model, the data)
runs before the run folder is created, cleared or written.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from fastpt import distributed
from fastpt.checkpoint import CheckpointError, load as load_checkpoint
from fastpt.config import RESUME_SENSITIVE, TrainConfig, parse_args
from fastpt.imdb import DataError
from fastpt.models import ModelError
from fastpt.signals import EXIT_STOPPED, StopRequested
from fastpt.tracking import write_json_atomic

EXIT_BAD_INPUT = 2
EXIT_FAILED = 1
RUN_FILES = ("config.json", "results.json", "checkpoints", "tb")


@dataclass
class OutPlan:
    """Where the run writes, what it continues from, and what of an earlier run it replaces."""
    out: Path
    resume_state: dict | None = None
    to_clear: list[str] = field(default_factory=list)


def check_environment(cfg: TrainConfig) -> None:
    """Checks that need no data and no process group; ValueError on failure."""
    if cfg.strategy == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        raise ValueError("--deepspeed needs the deepspeed package (pip install deepspeed)")
    if cfg.compile:
        from fastpt.compile import check_compile_supported
        check_compile_supported()
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # must be set before cuBLAS starts
    if cfg.resume == "auto" and not cfg.out:
        raise ValueError("--resume auto needs --out: the run folder to continue")
    if cfg.resume not in (None, "auto"):
        if not Path(cfg.resume).is_file():
            raise ValueError(f"--resume {cfg.resume}: no such checkpoint file")
        if cfg.out and Path(cfg.out).resolve() != _run_folder_of(Path(cfg.resume)):
            raise ValueError(f"--resume {cfg.resume} continues in its own run folder "
                             f"{_run_folder_of(Path(cfg.resume))}, not --out {cfg.out}; drop --out")


def _run_folder_of(checkpoint_path: Path) -> Path:
    return checkpoint_path.resolve().parent.parent  # <run>/checkpoints/last.pt


def plan_out_dir(cfg: TrainConfig, dist: distributed.DistInfo) -> OutPlan:
    """The run folder and the resume state, read without writing anything.

    Refuses to replace another run unless --overwrite. With --resume auto and no last.pt yet
    (killed before its first checkpoint) the run starts again in the same folder, provided the
    folder's config.json is this configuration and the run there never finished.
    """
    if cfg.resume not in (None, "auto"):
        out = _run_folder_of(Path(cfg.resume))
    elif cfg.out:
        out = Path(cfg.out)
    else:
        out = Path("runs") / distributed.broadcast_object(time.strftime("%Y%m%d-%H%M%S"))
    resume_path = Path(cfg.resume) if cfg.resume not in (None, "auto") else None
    if cfg.resume == "auto" and (out / "checkpoints" / "last.pt").is_file():
        resume_path = out / "checkpoints" / "last.pt"
    if resume_path is not None:
        state = load_checkpoint(resume_path)
        check_resume_compatible(cfg, state, dist.world_size, resume_path)
        return OutPlan(out, resume_state=state)
    existing = [name for name in RUN_FILES if (out / name).exists()]
    if existing and not cfg.overwrite:
        if cfg.resume != "auto" or "results.json" in existing:
            what = "a finished run" if "results.json" in existing else f"another run ({', '.join(existing)})"
            raise ValueError(f"--out {out} holds {what}; pass --overwrite to replace it"
                             f"{'' if cfg.resume else ', --resume auto to continue it'}, or choose another folder")
        _check_same_run(cfg, out, dist.world_size)
    return OutPlan(out, to_clear=existing)


def _check_same_run(cfg: TrainConfig, out: Path, world_size: int) -> None:
    """--resume auto over a folder with no checkpoint: start again only if it is this run."""
    try:
        saved = json.loads((out / "config.json").read_text())
    except (OSError, ValueError):
        raise ValueError(f"--out {out} holds files of a run without a readable config.json and no "
                         f"checkpoints/last.pt to resume; pass --overwrite to replace it") from None
    _compare_settings(cfg, saved, world_size, f"cannot continue the run in {out}")


def check_resume_compatible(cfg: TrainConfig, state: dict, world_size: int, path: Path) -> None:
    if not isinstance(state, dict) or not {"progress", "config", "training", "per_rank"} <= state.keys():
        raise CheckpointError(f"{path} is not a fastpt last.pt checkpoint")
    _compare_settings(cfg, {**state["config"], "world_size": state.get("world_size")}, world_size,
                      f"cannot resume from {path}")


def _compare_settings(cfg: TrainConfig, saved: dict, world_size: int, context: str) -> None:
    """CheckpointError naming the first setting that differs from the saved run's."""
    for name in RESUME_SENSITIVE:
        if saved.get(name) != getattr(cfg, name):
            raise CheckpointError(f"{context}: --{name.replace('_', '-')} was {saved.get(name)!r}, "
                                  f"now {getattr(cfg, name)!r}")
    if saved.get("world_size") != world_size:
        raise CheckpointError(f"{context}: it was written by {saved.get('world_size')} process(es), "
                              f"this run has {world_size}")


def start_out_dir(plan: OutPlan, cfg: TrainConfig, dist: distributed.DistInfo) -> None:
    """The first write: clear the replaced run's files (rank 0), then save config.json."""
    distributed.barrier()  # every rank has looked at the folder before rank 0 changes it
    if dist.is_main:
        for name in plan.to_clear:
            path = plan.out / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        plan.out.mkdir(parents=True, exist_ok=True)
        write_json_atomic(plan.out / "config.json", {**cfg.to_dict(), "world_size": dist.world_size})
    distributed.barrier()


def main(argv=None) -> int:
    try:
        cfg = parse_args(argv)
        check_environment(cfg)
    except SystemExit as e:  # argparse: --help (0), or an unknown flag (2, its line already printed)
        return e.code if isinstance(e.code, int) else EXIT_BAD_INPUT
    except ValueError as e:
        return _bad_input(e)
    try:
        dist = distributed.init(cfg.device, needs_group=cfg.strategy != "single")
    except ValueError as e:
        return _bad_input(e)
    try:
        from fastpt.bookkeeping import NonFiniteLoss
        from fastpt.trainer import Trainer

        # Everything that can fail on bad input, before the run folder is touched.
        try:
            if cfg.amp:
                from fastpt.amp import check_dtype_supported
                check_dtype_supported(cfg.amp_dtype, dist.device)
            plan = plan_out_dir(cfg, dist)
            trainer = Trainer(cfg, dist, plan.out, resume_state=plan.resume_state)
            trainer.load_inputs()
        except (ValueError, DataError, ModelError, CheckpointError) as e:
            return _bad_input(e, dist.is_main)

        if cfg.strategy != "single" and dist.world_size == 1 and dist.is_main:
            print(f"note: --{cfg.strategy} in a single process runs as a one-rank job; "
                  f"launch with torchrun --nproc_per_node=N for N processes", file=sys.stderr)
        start_out_dir(plan, cfg, dist)
        try:
            trainer.fit()
        except StopRequested as e:
            if dist.is_main:
                print(f"stopped: {e}", file=sys.stderr)
            return EXIT_STOPPED
        except (NonFiniteLoss, CheckpointError) as e:
            if dist.is_main:
                print(f"error: {_one_line(e)}", file=sys.stderr)
            return EXIT_FAILED
        if dist.is_main:
            print(f"outputs: {plan.out}")
        return 0
    finally:
        distributed.shutdown()


def _bad_input(e: Exception, is_main: bool = True) -> int:
    if is_main:
        print(f"error: {_one_line(e)}", file=sys.stderr)
    return EXIT_BAD_INPUT


def _one_line(e: Exception) -> str:
    """The message on one line: some (tarfile's, for one) span several."""
    return " ".join(str(e).split()) or e.__class__.__name__
