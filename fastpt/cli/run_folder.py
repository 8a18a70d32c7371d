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

import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from fastpt.config import LATER_SETTINGS, RESUME_SENSITIVE, TrainConfig


TOP_FILES = ("config.json", "results.json", "predictions.csv")  # the files a run writes at its folder's top
RUN_FILES = (*TOP_FILES, "checkpoints", "tb")


LOCK_NAME = ".lock"
MARKER = ".fastpt-run.json"  # the run folder's first file: fastpt wrote what is here
TB_EVENTS = re.compile(r"events\.out\.tfevents\..+")  # SummaryWriter's files, in tb/ and tb/hparams/


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
        raise ValueError(f"--export-dir {path} holds {_a_few(foreign)}, not written by a fastpt export; "
                         f"choose another folder (--overwrite replaces only an earlier export's own files)")
    if not overwrite:
        raise ValueError(f"--export-dir {path} holds an earlier export; pass --overwrite to replace it, "
                         f"or choose another folder")


def _a_few(names: list[str], shown: int = 3) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


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


def check_owner(path: Path, what: str, advice: str = "choose another --out") -> None:
    """ValueError unless path passes the owner rule (files/trust.py): the line says how to proceed."""
    from fastpt.files import trust

    refused = trust.refusal(path, what, advice)
    if refused:
        raise ValueError(refused)


def is_default_out(cfg: TrainConfig) -> bool:
    """Whether choose_out named the folder (runs/<time>) rather than --out or --resume."""
    return not cfg.out and cfg.resume is None


class RunFolderLock:
    """`<out>/.lock`, exclusively flock-ed by the one run that writes in `out`.

    The folder (and any missing parent) is created to hold the lock; `release(keep=False)` removes
    what was created, so a refused run leaves no trace. The file is removed on release, while
    still locked; a run that opened it just before then finds it replaced and locks the new one.
    """

    def __init__(self, out: Path, new: bool = False):
        self.out, self.path, self.fd, self.new = out, out / LOCK_NAME, None, new
        self.created = [p for p in (out, *out.parents) if not p.exists()]

    def acquire(self) -> "RunFolderLock":
        import fcntl

        from fastpt.files import trust

        try:
            if self.new:
                self._make_new_folder()
            self.out.mkdir(mode=trust.folder_mode(self.out), parents=True, exist_ok=True)
            check_owner(self.out, "--out")
            while True:
                fd = self._open_lock()
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
        except ValueError:
            self.release(keep=False)
            raise
        except OSError as e:
            self.release(keep=False)
            raise ValueError(f"--out {self.out}: cannot write there ({e.strerror or e})") from None
        return self

    def _open_lock(self) -> int:
        """`.lock`, opened (created if missing) never through a symbolic link and only if it is a regular file
        of this user's: its pid is written into it, so a link planted there would have that written over
        another file."""
        import errno

        from fastpt.files import trust

        try:
            fd = trust.open_regular(self.path, os.O_RDWR | os.O_CREAT, trust.file_mode(self.path))
        except OSError as e:
            if e.errno != errno.ELOOP and not isinstance(e, trust.NotRegular):
                raise
            what = "a symbolic link" if e.errno == errno.ELOOP else trust.kind(os.lstat(self.path).st_mode)
            raise ValueError(f"--out {self.out}: its {LOCK_NAME} is {what}, not a file fastpt made; fastpt never "
                             f"writes through one: remove it if it is yours, or choose another --out") from None
        try:
            check_owner(self.path, "the lock file")
        except ValueError:
            os.close(fd)
            raise
        return fd

    def _make_new_folder(self) -> None:
        """out, or out-2, out-3, ...: the first that does not exist yet. mkdir is atomic, so runs
        started in the same second (the default folder's name) each get a folder of their own."""
        from fastpt.files import trust

        self.out.parent.mkdir(parents=True, exist_ok=True)
        base, n = self.out, 1
        while True:
            try:
                self.out.mkdir(mode=trust.folder_mode(self.out))
                break
            except FileExistsError:
                n += 1
                self.out = base.with_name(f"{base.name}-{n}")
        self.path = self.out / LOCK_NAME
        self.created = [self.out, *(p for p in self.created if p != base)]  # deepest first

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


def claim_out_dir(out: Path, dist, new: bool = False) -> tuple[Path, RunFolderLock | None]:
    """Rank 0 locks the run folder (with `new`, one it creates: out, or out-2, ...) and removes the
    temporaries a killed run left; every rank gets the folder, or its error, so all stop together."""
    from fastpt.cluster import distributed

    lock, outcome = None, None
    if dist.is_main:
        try:
            lock = RunFolderLock(out, new=new).acquire()
            remove_stale_temporaries(lock.out)
            outcome = ("ok", str(lock.out))
        except ValueError as e:
            outcome = ("error", str(e))
    status, value = distributed.broadcast_object(outcome)
    if status == "error":
        raise ValueError(value)
    return Path(value), lock


def remove_stale_temporaries(out: Path) -> None:
    """The half-written files of a run killed mid-save (`.last.pt.<hex>.tmp`): under the lock, no run
    is writing them. Only regular files named after a file fastpt writes there are removed."""
    from fastpt.files.checkpoint import temporary_of

    written_by_fastpt = {out: (*TOP_FILES, MARKER), out / "checkpoints": ("best.pt", "last.pt")}
    for folder, names in written_by_fastpt.items():
        if not folder.is_dir():
            continue
        for path in folder.iterdir():
            if temporary_of(path.name) in names and path.is_file() and not path.is_symlink():
                path.unlink(missing_ok=True)


def plan_out_dir(cfg: TrainConfig, dist, out: Path) -> OutPlan:
    """Rank 0's plan for the run folder (`read_out_dir`), on every rank.

    Rank 0 alone reads the folder: on a cluster without a shared file system the other nodes
    see their own --out (or nothing), and a resume reads last.pt where rank 0 wrote it. Its
    plan (the resume state as torch.save bytes) or its error travels to every rank, so every
    rank continues from the same state or stops with the same line.
    """
    from fastpt.cluster import distributed
    from fastpt.errors import CheckpointError

    if dist.world_size == 1:
        return read_out_dir(cfg, dist, out)
    plan, outcome = OutPlan(out), None
    if dist.is_main:
        try:
            plan = read_out_dir(cfg, dist, out)
            outcome = ("plan", plan.to_clear, plan.data_key)
        except (ValueError, CheckpointError, RunFinished) as e:
            distributed.broadcast_object(("error", type(e).__name__, str(e)))
            raise
    kind, *detail = distributed.broadcast_object(outcome)
    if kind == "error":
        name, message = detail
        raise {"ValueError": ValueError, "CheckpointError": CheckpointError, "RunFinished": RunFinished}[name](message)
    return OutPlan(out, resume_state=distributed.broadcast_state(plan.resume_state), to_clear=detail[0],
                   data_key=detail[1])


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

    finished = finished_run(out, cfg.overwrite)
    resume_path = Path(cfg.resume) if cfg.resume not in (None, "auto") else None
    if cfg.resume == "auto" and (out / "checkpoints" / "last.pt").is_file():
        resume_path = out / "checkpoints" / "last.pt"
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
        saved = _saved_config(out)
        return OutPlan(out, resume_state=state, data_key=(saved or {}).get("data_key"))
    existing = [name for name in RUN_FILES if os.path.lexists(out / name)]
    if not existing:
        return OutPlan(out)
    restart = cfg.resume == "auto" and not finished and not cfg.overwrite  # this run, killed before last.pt
    if restart:
        _check_same_run(cfg, out, dist.world_size)
    to_clear = removable(out)
    if not cfg.overwrite and not restart:
        what = "a finished run" if finished else f"another run ({', '.join(existing)})"
        if finished:  # nothing to continue, unless its last.pt is asked for more epochs
            more = (", --resume auto with a larger --epochs to train it further"
                    if not cfg.resume and (out / "checkpoints" / "last.pt").is_file() else "")
        else:
            more = "" if cfg.resume else ", --resume auto to continue it"
        raise ValueError(f"--out {out} holds {what}; pass --overwrite to replace it{more}, "
                         f"or choose another folder")
    return OutPlan(out, to_clear=to_clear, data_key=_saved_config(out).get("data_key") if restart else None)


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
                         f"a plain file); move it away to continue the run (--resume auto), or pass --overwrite to train "
                         f"it again")
    return True


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
        raise ValueError(f"--out {out} holds {_a_few(foreign)}, not written by fastpt; --overwrite removes only a "
                         f"fastpt run's files: move them away or choose another folder")
    if not (out / MARKER).is_file() and not _is_fastpt_config(_saved_config(out)):
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
    if top == "checkpoints":
        if relative[1] == "deepspeed":
            return True
        return len(relative) == 2 and not is_dir and (name in ("best.pt", "last.pt")
                                                      or temporary_of(name) in ("best.pt", "last.pt"))
    if top == "tb":
        return is_dir or TB_EVENTS.fullmatch(name) is not None
    return False


def _saved_config(out: Path) -> dict | None:
    """The run folder's config.json; None if missing, unreadable or not a JSON object."""
    from fastpt.files import trust

    try:
        saved = trust.read_json(out / "config.json")
    except (OSError, ValueError):
        return None
    return saved if isinstance(saved, dict) else None


def _is_fastpt_config(saved: dict | None) -> bool:
    """A config.json that fastpt wrote: every setting a resume compares, and the number of processes."""
    return saved is not None and {*RESUME_SENSITIVE, "world_size"} - {*LATER_SETTINGS} <= saved.keys()


def nothing_left(cfg: TrainConfig, state: dict) -> bool:
    """Whether the checkpointed run has already done all these flags ask for."""
    progress, early = state["progress"], state.get("early_stopping") or {}
    return (bool(early.get("stopped")) or progress["epoch"] >= cfg.epochs
            or (cfg.max_steps is not None and progress["global_step"] >= cfg.max_steps))


def _check_same_run(cfg: TrainConfig, out: Path, world_size: int) -> None:
    """--resume auto over a folder with no checkpoint: start again only if it is this run."""
    saved = _saved_config(out)
    if saved is None:
        what = "pass --overwrite to replace it" if (out / MARKER).is_file() else "choose another folder"
        raise ValueError(f"--out {out} holds files of a run without a readable config.json (a JSON object) and "
                         f"no checkpoints/last.pt to resume; {what}")
    _compare_settings(cfg, saved, world_size, f"cannot continue the run in {out}")


def check_resume_compatible(cfg: TrainConfig, state: dict, world_size: int, path: Path) -> None:
    from fastpt.cluster import resize
    from fastpt.errors import CheckpointError

    if not isinstance(state, dict) or not {"progress", "config", "training", "per_rank"} <= state.keys():
        raise CheckpointError(f"{path} is not a fastpt last.pt checkpoint")
    _compare_settings(cfg, {**state["config"], "world_size": state.get("world_size")}, world_size,
                      f"cannot resume from {path}", batch_size_flag=resize.batch_size_flag(state))
    if cfg.strategy == "deepspeed":  # last.pt names a folder of DeepSpeed pickles: checked before any work
        from fastpt.strategies.deepspeed_checkpoint import check_resume
        check_resume(state["training"], path.parent)


def _compare_settings(cfg: TrainConfig, saved: dict, world_size: int, context: str,
                      batch_size_flag: int | None = None) -> None:
    """CheckpointError naming the first setting that differs from the saved run's.

    With a checkpoint (batch_size_flag given) the number of processes may change (resize.py), and
    --batch-size may then be the one the run was started with or one that keeps the global batch.
    """
    from fastpt.cluster import resize
    from fastpt.errors import CheckpointError

    resuming = batch_size_flag is not None
    for name in RESUME_SENSITIVE:
        if name == "batch_size" and resuming and resize.accepts_batch_size(
                cfg.batch_size, saved["batch_size"], batch_size_flag, saved.get("world_size"), world_size):
            continue
        was = saved.get(name, getattr(TrainConfig, name)) if name in LATER_SETTINGS else saved.get(name)
        if was != getattr(cfg, name):
            raise CheckpointError(f"{context}: --{name.replace('_', '-')} was {_shown(was)}, "
                                  f"now {_shown(getattr(cfg, name))}")
    if saved.get("world_size") != world_size and not resuming:
        raise CheckpointError(f"{context}: it was written by {saved.get('world_size')} process(es), "
                              f"this run has {world_size}")


def _shown(value) -> str:
    """A setting's value in a message: "unset" for a flag not given (None), else as Python writes it."""
    return "unset" if value is None else repr(value)


def data_key(inputs) -> str:
    """The data's identity: the name of its token cache, keyed by the data's content (token_cache.py, own_data.py)."""
    return Path(inputs.cache_path).name


def check_same_data(plan: OutPlan, cfg: TrainConfig, inputs) -> None:
    """A resume continues on the data it started on, into the model it started with; CheckpointError
    otherwise, before anything is written (config.json included).

    The same path with other rows, or a new class, is other data: its content key differs from the
    one config.json recorded. Runs from before the key still have their labels and weights compared.
    """
    import torch

    from fastpt.errors import CheckpointError

    where = f"cannot continue the run in {plan.out}"
    if plan.data_key is not None and plan.data_key != data_key(inputs):
        raise CheckpointError(f"{where}: its data changed since it started (content key {plan.data_key}, now "
                              f"{data_key(inputs)}); a resume trains on the same data: choose another --out")
    state = plan.resume_state
    if not state:
        return
    saved_labels = state["config"].get("label_names")
    if saved_labels is not None and list(saved_labels) != list(inputs.label_names):
        raise CheckpointError(f"{where}: it was trained on the labels {saved_labels}, now they are "
                              f"{inputs.label_names} (the data's, or --label-names); resume with the same, or choose "
                              f"another --out")
    weights = state["training"].get("model") if isinstance(state["training"], dict) else None
    if weights is None:
        return  # DeepSpeed keeps the weights in its own files (checkpoints/deepspeed)
    model = inputs.model.state_dict()
    if not isinstance(weights, dict) or weights.keys() != model.keys():
        missing = sorted(model.keys() - (weights.keys() if isinstance(weights, dict) else set()))
        raise CheckpointError(f"{where}: its last.pt does not hold this model's weights "
                              f"({_a_few(missing) or 'other names'} missing)")
    for name, tensor in model.items():
        saved = weights[name]
        if not torch.is_tensor(saved) or saved.shape != tensor.shape:
            shape = list(saved.shape) if torch.is_tensor(saved) else type(saved).__name__
            raise CheckpointError(f"{where}: its last.pt's {name} is {shape}, this model's is {list(tensor.shape)} "
                                  f"(a last.pt of another model or data); choose another --out")


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
                try:
                    path.rmdir()
                except OSError:
                    pass  # holds something written since it was checked: kept
            else:
                path.unlink(missing_ok=True)
        write_json_atomic(plan.out / "config.json", {**config, "world_size": dist.world_size,
                                                     "data_key": data_key})
    distributed.barrier()
