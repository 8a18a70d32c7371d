"""The command-line shell around the training: parse, check, claim the run folder, train, close,
with clear exits. The training itself is `train.py:train` -> `Trainer.fit` (trainer.py) ->
`step.train_epoch` -> `step.train_step`; nothing here is needed to follow it.

Exit status: 0 done (or nothing to do: the run is already finished); 2 bad input (one line on
stderr, before any work, nothing written); 3 stopped by SIGTERM/SIGINT after writing
checkpoints/last.pt; 1 the run failed (e.g. the loss became NaN, the disk is full; earlier
checkpoints are left untouched); 130 Ctrl-C before training started (nothing written, no run
folder left). Under torchrun every rank returns the same status and only rank 0 prints,
except that each rank that lost contact with the others (--dist-timeout) says so: status 1.

The order matters for "nothing written on bad input": every check that can fail on what the
user passed (flags, environment, output places, the run folder, the resume checkpoint, the
model, the data) runs before the run folder's files are created, cleared or written.

The run folder is claimed first, with an exclusive lock on `<out>/.lock` held for the whole run,
so two runs started into the same folder at the same instant cannot mix their files: one
proceeds, the other stops with status 2. The lock is the kernel's (flock): it dies with its
process, so a killed run never leaves a folder locked.

Imports of torch and transformers wait until the command line is parsed: `--help` and flag
errors answer at once.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from fastpt.config import RESUME_SENSITIVE, TrainConfig, parse_args
from fastpt.errors import one_line

EXIT_BAD_INPUT = 2
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130  # 128 + SIGINT, the shell's status for a command stopped by Ctrl-C
RUN_FILES = ("config.json", "results.json", "checkpoints", "tb")
LOCK_NAME = ".lock"


def __getattr__(name: str):
    """`fastpt.run.distributed`, imported on first use (it imports torch)."""
    if name == "distributed":
        from fastpt import distributed
        return distributed
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class RunFinished(Exception):
    """--resume on a run that has its results.json: nothing to do."""


@dataclass
class OutPlan:
    """Where the run writes, what it continues from, and what of an earlier run it replaces."""
    out: Path
    resume_state: dict | None = None
    to_clear: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------- checks before any work

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
        # Under torchrun rank 0 alone looks for it (plan_out_dir): another node may not see the file.
        if "RANK" not in os.environ and not Path(cfg.resume).is_file():
            raise ValueError(f"--resume {cfg.resume}: no such checkpoint file")
        if cfg.out and Path(cfg.out).resolve() != _run_folder_of(Path(cfg.resume)):
            raise ValueError(f"--resume {cfg.resume} continues in its own run folder "
                             f"{_run_folder_of(Path(cfg.resume))}, not --out {cfg.out}; drop --out")


def check_device_support(cfg: TrainConfig, dist) -> None:
    """Checks that need the device: precision support, the DeepSpeed config."""
    if cfg.amp:
        from fastpt.amp import check_dtype_supported
        check_dtype_supported(cfg.amp_dtype, dist.device)
    if cfg.strategy == "deepspeed":
        from fastpt.strategies.deepspeed import check_supported, deepspeed_config
        check_supported(cfg, dist.device)
        deepspeed_config(cfg, dist.world_size)  # reads and checks --deepspeed-config


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


def _run_folder_of(checkpoint_path: Path) -> Path:
    return checkpoint_path.resolve().parent.parent  # <run>/checkpoints/last.pt


def choose_out(cfg: TrainConfig) -> Path:
    from fastpt import distributed

    if cfg.resume not in (None, "auto"):
        return _run_folder_of(Path(cfg.resume))
    if cfg.out:
        return Path(cfg.out)
    return Path("runs") / distributed.broadcast_object(time.strftime("%Y%m%d-%H%M%S"))


# ---------------------------------------------------------------------------- the run folder

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
    from fastpt import distributed

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
    from fastpt import distributed
    from fastpt.checkpoint import CheckpointError

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
    from fastpt.checkpoint import load as load_checkpoint

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
    from fastpt import resize
    from fastpt.checkpoint import CheckpointError

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
    from fastpt import resize
    from fastpt.checkpoint import CheckpointError

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


def resolve_config(cfg: TrainConfig, dist, out: Path) -> None:
    """Fill in every "decide for me" setting, so config.json says what really ran."""
    from fastpt import data

    on_cuda = dist.device.type == "cuda"
    cfg.out = str(out.resolve())
    cfg.cache_dir = str(data.cache_root(cfg.cache_dir).resolve())
    if cfg.data_dir or os.environ.get("FASTPT_DATA_DIR"):  # else ./data, found or downloaded while loading
        cfg.data_dir = str(Path(cfg.data_dir or os.environ["FASTPT_DATA_DIR"]).resolve())
    cfg.num_workers, cfg.pin_memory = data.loader_settings(cfg, on_cuda, dist.local_world_size)
    if cfg.fused_adam is None:
        cfg.fused_adam = on_cuda


def start_out_dir(plan: OutPlan, cfg: TrainConfig, dist) -> None:
    """The first write: clear the replaced run's files (rank 0), then save config.json."""
    from fastpt import distributed
    from fastpt.tracking import write_json_atomic

    distributed.barrier()  # every rank has looked at the folder before rank 0 changes it
    if dist.is_main:
        for name in plan.to_clear:
            path = plan.out / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        plan.out.mkdir(parents=True, exist_ok=True)
        write_json_atomic(plan.out / "config.json", {**cfg.to_dict(), "world_size": dist.world_size})
    distributed.barrier()


# ---------------------------------------------------------------------------- notes on what runs

def notes(cfg: TrainConfig, dist, trainer) -> list[str]:
    """One line each for what differs from what the flags might suggest."""
    from fastpt import data, imdb

    lines = []
    difference = imdb.differs_from_article(data.split_keys(trainer.cache_path))
    if difference:
        lines.append(f"note: the data in {cfg.data_dir} holds {difference}")
    if cfg.strategy != "single" and dist.world_size == 1:
        lines.append(f"note: --{cfg.strategy} in a single process runs as a one-rank job; "
                     f"launch with torchrun --nproc_per_node=N for N processes")
    for flag, split in (("train-size", "train"), ("val-size", "validation"), ("test-size", "test")):
        asked, used = getattr(cfg, flag.replace("-", "_")), len(trainer.splits[split])
        if asked is not None and asked > used:
            lines.append(f"note: --{flag} {asked} is more than the {split} split has; using all {used}")
    # Each epoch drops the last, short batch of its shuffle (the article's DataLoader does too): worth a
    # line once it is a noticeable share of the reviews (the article's run leaves out 8 of 35,000).
    reviews, used = len(trainer.splits["train"]), trainer.train_examples_used()
    if reviews - used >= 0.01 * reviews:
        lines.append(f"note: each epoch trains on {used} of the {reviews} training reviews: whole batches of "
                     f"{cfg.batch_size}{f' x {dist.world_size} processes' if dist.world_size > 1 else ''} "
                     f"only, the rest of each epoch's shuffle is left out")
    batches = used // (cfg.batch_size * dist.world_size)  # per process
    if cfg.grad_accum > batches:
        lines.append(f"note: --grad-accum {cfg.grad_accum}, but an epoch has {batches} batch"
                     f"{'' if batches == 1 else 'es'}{' per process' if dist.world_size > 1 else ''}: "
                     f"each epoch makes one optimiser step, over {batches}")
    if cfg.amp and cfg.amp_dtype == "bfloat16" and dist.device.type == "cpu" and not cpu_has_native_bfloat16():
        lines.append("note: this CPU has no native bfloat16 (no AVX512-BF16 or AMX): --amp-dtype bfloat16 "
                     "is emulated here and slower than float32")
    return lines


def cpu_has_native_bfloat16() -> bool:
    import torch

    if torch.backends.cpu.get_cpu_capability() not in ("AVX512", "AVX512_BF16", "AMX"):
        return False
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def quiet_libraries(verbose: bool) -> None:
    """Hugging Face and DeepSpeed print load reports, retries and progress bars; fastpt prints its own lines."""
    import logging

    if verbose:
        return
    import huggingface_hub.utils.logging as hub_logging
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    hub_logging.set_verbosity_error()
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)


# ---------------------------------------------------------------------------- main

def main(argv=None, train=None) -> int:
    """The whole command: returns the exit status. `train(trainer)` runs the training itself
    (default `trainer.fit()`; train.py passes its own, so a reader starts there)."""
    train = train or (lambda trainer: trainer.fit())
    try:
        cfg = parse_args(argv)
        check_environment(cfg)
    except SystemExit as e:  # argparse: --help (0), or an unknown flag (2, its line already printed)
        return e.code if isinstance(e.code, int) else EXIT_BAD_INPUT
    except ValueError as e:
        return _bad_input(e, is_main=os.environ.get("RANK", "0") == "0")  # before the group: torchrun's rank
    from fastpt import distributed

    quiet_libraries(cfg.verbose)
    try:
        dist = distributed.init(cfg.device, needs_group=cfg.strategy != "single", timeout_s=cfg.dist_timeout)
    except ValueError as e:
        return _bad_input(e)
    except RuntimeError as e:  # the group did not form: a rank missing, or a stale address (see distributed.py)
        if not distributed.lost_contact(e):
            raise
        return _lost_contact(e, int(os.environ.get("RANK", 0)), cfg)
    lock, status = None, EXIT_FAILED
    try:
        from fastpt import data, resize
        from fastpt.bookkeeping import NonFiniteLoss
        from fastpt.checkpoint import CheckpointError
        from fastpt.imdb import DataError
        from fastpt.models import ModelError
        from fastpt.signals import EXIT_STOPPED, StopRequested
        from fastpt.trainer import Trainer

        # Everything that can fail on bad input, before the run folder's files are touched.
        try:
            check_device_support(cfg, dist)
            out = choose_out(cfg)
            check_output_folder(out, "--out")
            check_output_folder(data.cache_root(cfg.cache_dir), data.cache_setting(cfg.cache_dir))
            lock = claim_out_dir(out, dist)
            plan = plan_out_dir(cfg, dist, out)
            resized = resize.adapt(cfg, plan.resume_state, dist.world_size) if plan.resume_state else None
            if resized and cfg.strategy == "deepspeed":
                check_device_support(cfg, dist)  # a --deepspeed-config must agree with the new batch
            resolve_config(cfg, dist, out)
            trainer = Trainer(cfg, dist, plan.out, resume_state=plan.resume_state)
            trainer.load_inputs()
        except RunFinished as e:
            if dist.is_main:
                print(e)
            status = 0
            return status
        except (ValueError, DataError, ModelError, CheckpointError) as e:
            status = _bad_input(e, dist.is_main)
            return status
        except KeyboardInterrupt:  # Ctrl-C while tokenising, say: nothing written yet, so nothing left behind
            if dist.is_main:
                print("\nstopped: interrupted before training started; nothing was written", file=sys.stderr)
            status = EXIT_INTERRUPTED
            return status
        cfg.data_dir = cfg.data_dir or str(Path("data").resolve())  # where loading found (or put) the data

        if dist.is_main:
            if cfg.resume == "auto" and plan.resume_state is None:
                print(f"note: no checkpoint in {out} to resume; starting a new run", file=sys.stderr)
            for line in ([resized] if resized else []) + notes(cfg, dist, trainer):
                print(line, file=sys.stderr)
        try:
            start_out_dir(plan, cfg, dist)
            train(trainer)
        except StopRequested as e:
            if dist.is_main:
                below_bar = "\n" if cfg.progress else ""  # a line of its own, not glued to the bar
                print(f"{below_bar}stopped: {e}", file=sys.stderr)
            status = EXIT_STOPPED
            return status
        except (NonFiniteLoss, CheckpointError) as e:
            if dist.is_main:
                print(f"error: {one_line(e)}", file=sys.stderr)
            return status
        if dist.is_main:
            print(f"outputs: {shlex.quote(str(plan.out.resolve()))}")
        status = 0
        return status
    except RuntimeError as e:
        if not distributed.lost_contact(e):
            raise
        return _lost_contact(e, dist.rank, cfg)
    finally:
        if lock is not None:
            lock.release(keep=status not in (EXIT_BAD_INPUT, EXIT_INTERRUPTED))
        distributed.shutdown()


def _lost_contact(e: Exception, rank: int, cfg: TrainConfig) -> int:
    """One line from every rank that saw it (rank 0 may be the one that died): status 1."""
    print(f"error: rank {rank} lost contact with the other processes: another one died, or did not answer within "
          f"--dist-timeout {cfg.dist_timeout} s ({one_line(e, limit=160)}); with --save-every, the same command "
          f"with --resume auto continues from checkpoints/last.pt", file=sys.stderr)
    return EXIT_FAILED


def _bad_input(e: Exception, is_main: bool = True) -> int:
    if is_main:
        print(f"error: {one_line(e)}", file=sys.stderr)
    return EXIT_BAD_INPUT


def cli() -> None:
    """The `fastpt-train` command and `python -m fastpt`: train.py's command line."""
    sys.exit(main())
