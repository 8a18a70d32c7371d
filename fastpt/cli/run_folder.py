"""The run folder: claimed with a lock, checked, planned (a new run or a resume), then started.

The folder is claimed first, with an exclusive lock on `<out>/.lock` held for the whole run,
so two runs started into the same folder at the same instant cannot mix their files: one
proceeds, the other stops with status 2. The lock is the kernel's (flock): it dies with its
process, so a killed run never leaves a folder locked.

On a node shared with other users the folder is claimed only if it is yours and no one else can
change it (files/trust.py's owner rule, unless FASTPT_TRUST_DIRS names it), and so is what a
resume reads (checkpoints/, last.pt, best.pt); `.lock` is never opened through a symbolic link,
and `--overwrite` never replaces what a symbolic link named by `--out` points to.

Planning reads and writes nothing but the lock: what an earlier run left (`results.json`,
`checkpoints/last.pt`, `config.json`) decides whether this run resumes it, starts again, or is
refused. Only rank 0 reads the folder; its plan, or its error, reaches the other ranks over the
process group, so nodes need not share a disk. `start_out_dir` is the first write.

What `--overwrite` (or a restart with `--resume auto`) removes is fastpt's own and nothing else:
every run folder holds `.fastpt-run.json`, written before anything else, and only a folder with
it (or, from before the marker, a config.json with fastpt's settings) whose config.json,
results.json, predictions.csv, checkpoints/ and tb/ hold only what fastpt writes there (`removable`)
is cleared; a symbolic link there, or any other file, refuses the run with one line naming it. Everything is
checked before the first file is removed; files beside those places are kept. An export folder
is fastpt's by its manifest (`checkpoint.write_export`).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from fastpt.cli.resume_check import a_few, check_resume_compatible, compare_settings, nothing_left, saved_config
from fastpt.cli.run_files import MARKER, RUN_FILES, remove_stale_temporaries, removable
from fastpt.cli.run_lock import RunFolderLock, check_owner
from fastpt.config import TrainConfig


class RunFinished(Exception):
    """--resume on a run that has its results.json: nothing to do."""


@dataclass
class OutPlan:
    """Where the run writes, what it continues from, and what of an earlier run it replaces.

    `to_clear`: paths relative to `out`, every file before its folder; `data_key`: the data the run
    being continued was started on, as its config.json records it (None for a new run, or an old one).
    """
    out: Path
    resume_state: dict | None = None
    to_clear: list[str] = field(default_factory=list)
    data_key: str | None = None


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


def check_export_dir(path: Path, out: Path, overwrite: bool) -> None:
    """--export-dir: writable, apart from the run folder, and empty unless it holds only a fastpt export.

    An export in (or around) the run folder would write its own config.json over the run's. An
    --overwrite replaces an earlier export's files, those its manifest lists, and refuses a folder
    holding anything else (a model sharded by another tool, say), naming a few of them.
    """
    from fastpt.files.checkpoint import EXPORT_MANIFEST, exported_files

    check_output_folder(path, "--export-dir")
    export, run = path.resolve(), out.resolve()
    relation = ("is" if export == run else "is inside" if run in export.parents
                else "contains" if export in run.parents else None)
    if relation:
        raise ValueError(f"--export-dir {path} {relation} the run folder {out}: the export would write over the "
                         f"run's files; choose a folder outside it")
    if not path.is_dir() or not any(path.iterdir()):
        return
    ours = {*exported_files(path), EXPORT_MANIFEST} if (path / EXPORT_MANIFEST).is_file() else set()
    foreign = sorted(p.name + ("/" if p.is_dir() and not p.is_symlink() else "") for p in path.iterdir()
                     if p.name not in ours or p.is_symlink() or not p.is_file())
    if foreign:
        raise ValueError(f"--export-dir {path} holds {a_few(foreign)}, not written by a fastpt export; "
                         f"choose another folder (--overwrite replaces only an earlier export's own files)")
    if not overwrite:
        raise ValueError(f"--export-dir {path} holds an earlier export; pass --overwrite to replace it, "
                         f"or choose another folder")


def run_folder_of(checkpoint_path: Path) -> Path:
    return checkpoint_path.resolve().parent.parent  # <run>/checkpoints/last.pt


def choose_out(cfg: TrainConfig) -> Path:
    from fastpt.cluster import distributed

    if cfg.resume not in (None, "auto"):
        return run_folder_of(Path(cfg.resume))
    if cfg.out:
        return Path(cfg.out)
    # The time names it; claim_out_dir adds -2, -3, ... if a run started in the same second has it.
    return Path("runs") / distributed.broadcast_object(time.strftime("%Y%m%d-%H%M%S"))


def check_out_link(out: Path, overwrite: bool) -> None:
    """--overwrite replaces the run in the folder --out names, never one that a symbolic link there points to."""
    if overwrite and out.is_symlink():
        raise ValueError(f"--out {out} is a symbolic link (to {os.readlink(out)}); --overwrite never replaces what a "
                         f"link points to: give the run folder itself, or choose another --out")


def claim_out_dir(out: Path, dist, new: bool = False) -> tuple[Path, RunFolderLock | None]:
    """Rank 0 locks the run folder (with `new`, one it creates: out, or out-2, ...) and removes the
    temporaries a killed run left; every rank gets the folder, or its error, so all stop together."""
    from fastpt.cluster import distributed

    lock, outcome = None, None
    if dist.is_main:
        try:
            lock = RunFolderLock(out, new=new).acquire()
            remove_stale_temporaries(lock.out)
            outcome = lock.out
        except ValueError as e:
            outcome = e
    return raised_everywhere(distributed.broadcast_object(outcome)), lock


def raised_everywhere(outcome):
    """Rank 0's outcome, broadcast: its error is raised on every rank, so all stop with the same line."""
    if isinstance(outcome, Exception):
        raise outcome
    return outcome


def plan_out_dir(cfg: TrainConfig, dist, out: Path) -> OutPlan:
    """Rank 0's plan for the run folder (`read_out_dir`), on every rank.

    Rank 0 alone reads the folder: on a cluster without a shared file system the other nodes
    see their own --out (or nothing), and a resume reads last.pt where rank 0 wrote it. Its
    plan (the resume state as torch.save bytes) or its error travels to every rank, so every
    rank continues from the same state or stops with the same line.
    """
    from fastpt.cluster import distributed
    from fastpt.errors import CheckpointError

    plan, outcome = OutPlan(out), None
    if dist.is_main:
        try:
            plan = read_out_dir(cfg, dist, out)
            outcome = plan.to_clear, plan.data_key
        except (ValueError, CheckpointError, RunFinished) as e:
            outcome = e
    to_clear, data_key = raised_everywhere(distributed.broadcast_object(outcome))
    return OutPlan(out, distributed.broadcast_state(plan.resume_state), to_clear, data_key)


def read_out_dir(cfg: TrainConfig, dist, out: Path) -> OutPlan:
    """The resume state and what to replace in the run folder, read without writing anything.

    Refuses to replace another run unless --overwrite, and to replace anything but fastpt's own
    files even then (`removable`). With --resume auto and no last.pt yet (killed before its first
    checkpoint) the run starts again in the same folder, provided the folder's config.json is this
    configuration and the run there never finished. A finished run (results.json) with nothing
    left to train under these flags is left alone: RunFinished. Asking it for more (a larger
    --epochs or --max-steps) continues it.
    """
    from fastpt.files.checkpoint import load as load_checkpoint

    finished, saved, last = finished_run(out, cfg.overwrite), saved_config(out), out / "checkpoints" / "last.pt"
    resume_path = Path(cfg.resume) if cfg.resume not in (None, "auto") else None
    if cfg.resume == "auto" and last.is_file():
        resume_path = last
    if resume_path is not None:
        if not resume_path.is_file():
            raise ValueError(f"--resume {cfg.resume}: no such checkpoint file")
        # What a resume reads: another user's checkpoint, or one others could have changed, is not continued.
        for path, what in ((resume_path.parent, "the checkpoint folder"), (resume_path, "the checkpoint"),
                           (resume_path.parent / "best.pt", "the checkpoint")):
            check_owner(path, what, "resume a run of your own")
        state = load_checkpoint(resume_path)
        check_resume_compatible(cfg, state, dist.world_size, resume_path)
        if finished and not cfg.overwrite and nothing_left(cfg, state):
            raise RunFinished(f"the run in {out} is finished (results.json); nothing to do "
                              f"(--overwrite without --resume trains it again)")
        return OutPlan(out, resume_state=state, data_key=(saved or {}).get("data_key"))
    existing = [name for name in RUN_FILES if os.path.lexists(out / name)]
    if not existing:
        return OutPlan(out)
    restart = cfg.resume == "auto" and not finished and not cfg.overwrite  # this run, killed before last.pt
    if restart:
        _check_same_run(cfg, out, saved, dist.world_size)
    to_clear = removable(out)
    if not cfg.overwrite and not restart:
        if finished:  # nothing to continue, unless its last.pt is asked for more epochs
            what, more = "a finished run", (", --resume auto with a larger --epochs to train it further"
                                            if not cfg.resume and last.is_file() else "")
        else:
            what, more = f"another run ({', '.join(existing)})", "" if cfg.resume else ", --resume auto to continue it"
        raise ValueError(f"--out {out} holds {what}; pass --overwrite to replace it{more}, "
                         f"or choose another folder")
    return OutPlan(out, to_clear=to_clear, data_key=saved.get("data_key") if restart else None)


def finished_run(out: Path, overwrite: bool) -> bool:
    """Whether the run in `out` finished: its results.json is there, whole (written last, atomically).

    One there but cut short or damaged (a copy interrupted, a full disk elsewhere) says nothing about
    the run: ValueError, so that neither "finished" nor a restart over it is decided on it; --overwrite
    replaces it as any file of the run."""
    path = out / "results.json"
    if not os.path.lexists(path):
        return False
    if overwrite:
        return True
    try:
        results = json.loads(path.read_text()) if path.is_file() and not path.is_symlink() else None
    except (OSError, ValueError):
        results = None
    if not isinstance(results, dict) or "test_acc" not in results:
        raise ValueError(f"--out {out} holds a results.json that is not a finished run's (cut short, damaged, or not "
                         f"a plain file); move it away to continue the run (--resume auto), or pass --overwrite to "
                         f"train it again")
    return True


def _check_same_run(cfg: TrainConfig, out: Path, saved: dict | None, world_size: int) -> None:
    """--resume auto over a folder with no checkpoint (its config.json: `saved`): start again only if it is this run."""
    if saved is None:
        what = "pass --overwrite to replace it" if (out / MARKER).is_file() else "choose another folder"
        raise ValueError(f"--out {out} holds files of a run without a readable config.json (a JSON object) and "
                         f"no checkpoints/last.pt to resume; {what}")
    compare_settings(cfg, saved, world_size, f"cannot continue the run in {out}")


def start_out_dir(plan: OutPlan, config: dict, dist, data_key: str | None = None) -> None:
    """The first write: the marker, then clear the replaced run's files (rank 0), then config.json.

    Only what `removable` listed is removed: a file that appeared since stays (its folder too).
    """
    from fastpt.cluster import distributed
    from fastpt.monitoring.tracking import write_json_atomic

    distributed.barrier()  # every rank has looked at the folder before rank 0 changes it
    if dist.is_main:
        plan.out.mkdir(parents=True, exist_ok=True)
        if not (plan.out / MARKER).is_file():
            write_json_atomic(plan.out / MARKER, {"written_by": "fastpt", "what": "a run folder: --overwrite "
                                                  "removes config.json, results.json, predictions.csv, checkpoints/ "
                                                  "and tb/ here"})
        for name in plan.to_clear:
            path = plan.out / name
            if path.is_dir() and not path.is_symlink():
                with contextlib.suppress(OSError):  # holds something written since it was checked: kept
                    path.rmdir()
            else:
                path.unlink(missing_ok=True)
        write_json_atomic(plan.out / "config.json", {**config, "world_size": dist.world_size,
                                                     "data_key": data_key})
    distributed.barrier()
