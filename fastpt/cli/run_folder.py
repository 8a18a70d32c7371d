"""The run folder: claimed with a lock, checked, planned (a new run or a resume), then started.

The folder is claimed first, with an exclusive lock on `<out>/.lock` held for the whole run,
so two runs started into the same folder at the same instant cannot mix their files: one
proceeds, the other stops with status 2. The lock is the kernel's (flock): it dies with its
process, so a killed run never leaves a folder locked.

Planning reads and writes nothing but the lock: what an earlier run left (`results.json`,
`checkpoints/last.pt`, `config.json`) decides whether this run resumes it, starts again, or is
refused. Only rank 0 reads the folder; its plan, or its error, reaches the other ranks over the
process group, so nodes need not share a disk. `start_out_dir` is the first write.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from fastpt.machinery.config import RESUME_SENSITIVE, TrainConfig


RUN_FILES = ("config.json", "results.json", "checkpoints", "tb")


LOCK_NAME = ".lock"


class RunFinished(Exception):
    """--resume on a run that has its results.json: nothing to do."""


@dataclass
class OutPlan:
    """Where the run writes, what it continues from, and what of an earlier run it replaces."""
    out: Path
    resume_state: dict | None = None
    to_clear: list[str] = field(default_factory=list)


def check_output_folder(path: Path, flag: str) -> None:
    """A folder we can create or write in; ValueError naming the flag (or environment variable) otherwise."""
    named = f"{flag} {path}" if flag.startswith("--") else f"{flag}={path}"
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{named}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{named}: cannot write in {existing} (read-only file system or no permission)")


def run_folder_of(checkpoint_path: Path) -> Path:
    return checkpoint_path.resolve().parent.parent  # <run>/checkpoints/last.pt


def choose_out(cfg: TrainConfig) -> Path:
    from fastpt.machinery import distributed

    if cfg.resume not in (None, "auto"):
        return run_folder_of(Path(cfg.resume))
    if cfg.out:
        return Path(cfg.out)
    return Path("runs") / distributed.broadcast_object(time.strftime("%Y%m%d-%H%M%S"))


class RunFolderLock:
    """`<out>/.lock`, exclusively flock-ed by the one run that writes in `out`.

    The folder (and any missing parent) is created to hold the lock; `release(keep=False)` removes
    what was created, so a refused run leaves no trace. The file is removed on release, while
    still locked; a run that opened it just before then finds it replaced and locks the new one.
    """

    def __init__(self, out: Path):
        self.out, self.path, self.fd = out, out / LOCK_NAME, None
        self.created = [p for p in (out, *out.parents) if not p.exists()]

    def acquire(self) -> "RunFolderLock":
        import fcntl

        try:
            self.out.mkdir(parents=True, exist_ok=True)
            while True:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
                    os.close(fd)
                    self.release(keep=False)
                    raise ValueError(f"--out {self.out} is in use by another run (process {holder}); "
                                     f"wait for it or choose another folder") from None
                if self.path.exists() and os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                    break
                os.close(fd)  # the previous holder removed the file after we opened it: lock the new one
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            self.fd = fd
        except OSError as e:
            self.release(keep=False)
            raise ValueError(f"--out {self.out}: cannot write there ({e.strerror or e})") from None
        return self

    def release(self, keep: bool = True) -> None:
        if self.fd is not None:
            self.path.unlink(missing_ok=True)
            os.close(self.fd)
            self.fd = None
        if not keep:
            for folder in self.created:  # deepest first
                try:
                    folder.rmdir()
                except OSError:
                    break


def claim_out_dir(out: Path, dist) -> RunFolderLock | None:
    """Rank 0 locks the run folder; every rank gets its error, so all stop together."""
    from fastpt.machinery import distributed

    lock, error = None, None
    if dist.is_main:
        try:
            lock = RunFolderLock(out).acquire()
        except ValueError as e:
            error = str(e)
    error = distributed.broadcast_object(error)
    if error:
        raise ValueError(error)
    return lock


def plan_out_dir(cfg: TrainConfig, dist, out: Path) -> OutPlan:
    """Rank 0's plan for the run folder (`read_out_dir`), on every rank.

    Rank 0 alone reads the folder: on a cluster without a shared file system the other nodes
    see their own --out (or nothing), and a resume reads last.pt where rank 0 wrote it. Its
    plan (the resume state as torch.save bytes) or its error travels to every rank, so every
    rank continues from the same state or stops with the same line.
    """
    from fastpt.machinery import distributed
    from fastpt.machinery.errors import CheckpointError

    if dist.world_size == 1:
        return read_out_dir(cfg, dist, out)
    plan, outcome = OutPlan(out), None
    if dist.is_main:
        try:
            plan = read_out_dir(cfg, dist, out)
            outcome = ("plan", plan.to_clear)
        except (ValueError, CheckpointError, RunFinished) as e:
            distributed.broadcast_object(("error", type(e).__name__, str(e)))
            raise
    kind, *detail = distributed.broadcast_object(outcome)
    if kind == "error":
        name, message = detail
        raise {"ValueError": ValueError, "CheckpointError": CheckpointError, "RunFinished": RunFinished}[name](message)
    return OutPlan(out, resume_state=distributed.broadcast_state(plan.resume_state), to_clear=detail[0])


def read_out_dir(cfg: TrainConfig, dist, out: Path) -> OutPlan:
    """The resume state and what to replace in the run folder, read without writing anything.

    Refuses to replace another run unless --overwrite. With --resume auto and no last.pt yet
    (killed before its first checkpoint) the run starts again in the same folder, provided the
    folder's config.json is this configuration and the run there never finished. A finished
    run (results.json) with nothing left to train under these flags is left alone: RunFinished.
    Asking it for more (a larger --epochs or --max-steps) continues it.
    """
    from fastpt.machinery.checkpoint import load as load_checkpoint

    finished = (out / "results.json").exists()
    resume_path = Path(cfg.resume) if cfg.resume not in (None, "auto") else None
    if cfg.resume == "auto" and (out / "checkpoints" / "last.pt").is_file():
        resume_path = out / "checkpoints" / "last.pt"
    if resume_path is not None:
        if not resume_path.is_file():
            raise ValueError(f"--resume {cfg.resume}: no such checkpoint file")
        state = load_checkpoint(resume_path)
        check_resume_compatible(cfg, state, dist.world_size, resume_path)
        if finished and not cfg.overwrite and nothing_left(cfg, state):
            raise RunFinished(f"the run in {out} is finished (results.json); nothing to do "
                              f"(--overwrite without --resume trains it again)")
        return OutPlan(out, resume_state=state)
    existing = [name for name in RUN_FILES if (out / name).exists()]
    if existing and not cfg.overwrite:
        if cfg.resume != "auto" or finished:
            what = "a finished run" if finished else f"another run ({', '.join(existing)})"
            if finished:  # nothing to continue, unless its last.pt is asked for more epochs
                more = (", --resume auto with a larger --epochs to train it further"
                        if not cfg.resume and (out / "checkpoints" / "last.pt").is_file() else "")
            else:
                more = "" if cfg.resume else ", --resume auto to continue it"
            raise ValueError(f"--out {out} holds {what}; pass --overwrite to replace it{more}, "
                             f"or choose another folder")
        _check_same_run(cfg, out, dist.world_size)
    return OutPlan(out, to_clear=existing)


def nothing_left(cfg: TrainConfig, state: dict) -> bool:
    """Whether the checkpointed run has already done all these flags ask for."""
    progress, early = state["progress"], state.get("early_stopping") or {}
    return (bool(early.get("stopped")) or progress["epoch"] >= cfg.epochs
            or (cfg.max_steps is not None and progress["global_step"] >= cfg.max_steps))


def _check_same_run(cfg: TrainConfig, out: Path, world_size: int) -> None:
    """--resume auto over a folder with no checkpoint: start again only if it is this run."""
    try:
        saved = json.loads((out / "config.json").read_text())
    except (OSError, ValueError):
        raise ValueError(f"--out {out} holds files of a run without a readable config.json and no "
                         f"checkpoints/last.pt to resume; pass --overwrite to replace it") from None
    _compare_settings(cfg, saved, world_size, f"cannot continue the run in {out}")


def check_resume_compatible(cfg: TrainConfig, state: dict, world_size: int, path: Path) -> None:
    from fastpt.machinery import resize
    from fastpt.machinery.errors import CheckpointError

    if not isinstance(state, dict) or not {"progress", "config", "training", "per_rank"} <= state.keys():
        raise CheckpointError(f"{path} is not a fastpt last.pt checkpoint")
    _compare_settings(cfg, {**state["config"], "world_size": state.get("world_size")}, world_size,
                      f"cannot resume from {path}", batch_size_flag=resize.batch_size_flag(state))


def _compare_settings(cfg: TrainConfig, saved: dict, world_size: int, context: str,
                      batch_size_flag: int | None = None) -> None:
    """CheckpointError naming the first setting that differs from the saved run's.

    With a checkpoint (batch_size_flag given) the number of processes may change (resize.py), and
    --batch-size may then be the one the run was started with or one that keeps the global batch.
    """
    from fastpt.machinery import resize
    from fastpt.machinery.errors import CheckpointError

    resuming = batch_size_flag is not None
    for name in RESUME_SENSITIVE:
        if name == "batch_size" and resuming and resize.accepts_batch_size(
                cfg.batch_size, saved["batch_size"], batch_size_flag, saved.get("world_size"), world_size):
            continue
        if saved.get(name) != getattr(cfg, name):
            raise CheckpointError(f"{context}: --{name.replace('_', '-')} was {saved.get(name)!r}, "
                                  f"now {getattr(cfg, name)!r}")
    if saved.get("world_size") != world_size and not resuming:
        raise CheckpointError(f"{context}: it was written by {saved.get('world_size')} process(es), "
                              f"this run has {world_size}")


def start_out_dir(plan: OutPlan, cfg: TrainConfig, dist) -> None:
    """The first write: clear the replaced run's files (rank 0), then save config.json."""
    from fastpt.machinery import distributed
    from fastpt.machinery.tracking import write_json_atomic

    distributed.barrier()  # every rank has looked at the folder before rank 0 changes it
    if dist.is_main:
        for name in plan.to_clear:
            path = plan.out / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        plan.out.mkdir(parents=True, exist_ok=True)
        write_json_atomic(plan.out / "config.json", {**cfg.to_dict(), "world_size": dist.world_size})
    distributed.barrier()
