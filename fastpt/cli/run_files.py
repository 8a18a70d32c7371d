"""What a run folder holds, by name, and what `--overwrite` (or a restart with `--resume auto`) may
remove of it: fastpt's own files and nothing else (run_folder.py's docstring says the rule)."""

from __future__ import annotations

import re
from pathlib import Path

from fastpt.cli.resume_check import a_few, is_fastpt_config, saved_config
from fastpt.cli.run_lock import LOCK_NAME

TOP_FILES = ("config.json", "results.json", "predictions.csv")  # the files a run writes at its folder's top
RUN_FILES = (*TOP_FILES, "checkpoints", "tb")


MARKER = ".fastpt-run.json"  # the run folder's first file: fastpt wrote what is here
TB_EVENTS = re.compile(r"events\.out\.tfevents\..+")  # SummaryWriter's files, in tb/ and tb/hparams/


def remove_stale_temporaries(out: Path) -> None:
    """The half-written files of a run killed mid-save (`.last.pt.<hex>.tmp`): under the lock, no run
    is writing them. Only regular files named after a file fastpt writes there are removed."""
    from fastpt.files.checkpoint import temporary_of

    for folder, names in ((out, (*TOP_FILES, MARKER)), (out / "checkpoints", ("best.pt", "last.pt"))):
        for path in folder.glob(".*.tmp"):  # none where the folder is missing
            if temporary_of(path.name) in names and path.is_file() and not path.is_symlink():
                path.unlink(missing_ok=True)


def removable(out: Path) -> list[str]:
    """Everything --overwrite removes from the run folder, every file before its folder; ValueError,
    before anything is removed, unless all of it is fastpt's.

    fastpt's: the folder has the marker (or, a run from before the marker, a config.json with
    fastpt's settings), and everything in the run's places is what fastpt writes there: config.json,
    results.json, predictions.csv, checkpoints/{best,last}.pt, checkpoints/deepspeed/ (DeepSpeed's own
    layout), tb/'s event files, their temporaries. A symbolic link there is never followed nor removed. Files
    beside those (a log that a script keeps in the run folder, notes) are left where they are.
    """
    from fastpt.files.checkpoint import temporary_of

    paths, foreign = [], []
    for entry in sorted(out.iterdir()):
        if entry.name in (LOCK_NAME, MARKER) and entry.is_file() and not entry.is_symlink():
            continue  # kept: the lock is held, the marker stays true
        if entry.name not in RUN_FILES and temporary_of(entry.name) not in (*TOP_FILES, MARKER):
            continue  # beside the run, not in its places (a script's log): kept, neither removed nor followed
        _walk(out, entry, paths, foreign)
    if foreign:
        raise ValueError(f"--out {out} holds {a_few(foreign)}, not written by fastpt; --overwrite removes only a "
                         f"fastpt run's files: move them away or choose another folder")
    if not (out / MARKER).is_file() and not is_fastpt_config(saved_config(out)):
        raise ValueError(f"--out {out} is not a fastpt run folder (no {MARKER}, no config.json of fastpt's); "
                         f"--overwrite removes only a fastpt run's files: choose another folder")
    return paths


def _walk(out: Path, path: Path, paths: list[str], foreign: list[str]) -> None:
    """Collect path (and below it) into paths if fastpt writes it, else its name into foreign."""
    relative = path.relative_to(out).parts
    if path.is_symlink():
        raise ValueError(f"--out {out} holds a symbolic link fastpt did not make, {path.relative_to(out)}; "
                         f"--overwrite never follows or removes one: move it away or choose another folder")
    if not _fastpt_writes(relative, path.is_dir()):
        foreign.append("/".join(relative) + ("/" if path.is_dir() else ""))
        return
    if path.is_dir():
        for child in sorted(path.iterdir()):
            _walk(out, child, paths, foreign)
    paths.append("/".join(relative))


def _fastpt_writes(relative: tuple[str, ...], is_dir: bool) -> bool:
    """Whether a run writes this path (relative to the run folder)."""
    from fastpt.files.checkpoint import temporary_of

    top, name = relative[0], relative[-1]
    if len(relative) == 1:
        if is_dir:
            return top in ("checkpoints", "tb")
        return top in TOP_FILES or temporary_of(top) in (*TOP_FILES, MARKER)
    if top == "checkpoints":  # DeepSpeed's own layout below deepspeed/; best.pt, last.pt and their temporaries
        return relative[1] == "deepspeed" or (len(relative) == 2 and not is_dir
                                              and (temporary_of(name) or name) in ("best.pt", "last.pt"))
    return top == "tb" and (is_dir or TB_EVENTS.fullmatch(name) is not None)
