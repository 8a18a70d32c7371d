"""The command line around the run: flags and checks, the process group, the run folder and its
lock, one-line errors and exit statuses. Nothing here trains, and nothing here decides the run's
order: train.py calls it, in this order,

    shell = CommandLine(argv)
    with shell.exit_status():                          # any failure inside: one line and its status
        cfg, dist = shell.parse()                      # flags, environment, device, process group
        out_dir, resume_state = shell.claim_run_folder()  # the lock; a new run or a resume
        inputs = load_inputs(cfg, dist)                # model and data
        shell.start_run(inputs)                        # notes, then config.json: the first write
        train(cfg, dist, inputs, out_dir, resume_state)
    return shell.status

Exit status: 0 done (or nothing to do: the run is already finished); 2 bad input (one line on
stderr, before any work, nothing written); 3 stopped by SIGTERM/SIGINT (or --requeue-signal)
after writing checkpoints/last.pt, 0 if that signal then requeued the SLURM job (cluster/slurm.py);
1 the run failed (e.g. the loss became NaN, the disk is full; earlier checkpoints are left
untouched); 130 Ctrl-C, 143 SIGTERM before training started (what the new run wrote removed, no
run folder left; a resumed run's checkpoints as they were). Under torchrun every rank returns the
same status and only rank 0 prints, except that each rank that lost contact with the others
(--dist-timeout) says so: status 1.

The order matters for "nothing written on bad input": every check that can fail on what the
user passed (flags, environment, output places, the run folder, the resume checkpoint, the
model, the data) runs before `start_run` creates, clears or writes the run folder's files.

Imports of torch and transformers wait until the command line is parsed: `--help` and flag
errors answer at once.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shlex
import shutil
import signal
import sys
import time
from pathlib import Path

from fastpt.cli.args import parse_args
from fastpt.cli.run_folder import RunFinished, run_folder_of
from fastpt.config import TrainConfig
from fastpt.errors import (EXIT_STOPPED, CheckpointError, DataError, DiskFull, ModelError, NonFiniteLoss,
                                     Requeued, StopRequested, one_line)
from fastpt.cluster.signals import hold_warning_signal


EXIT_BAD_INPUT = 2
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130  # 128 + SIGINT, the shell's status for a command stopped by Ctrl-C
EXIT_TERMINATED = 143  # 128 + SIGTERM, likewise for a `kill` before training started


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

def resolve_config(cfg: TrainConfig, dist, out: Path) -> None:
    """Fill in every "decide for me" setting, so config.json says what really ran."""
    from fastpt.inputs import data, token_cache

    on_cuda = dist.device.type == "cuda"
    cfg.out = str(out.resolve())
    cfg.cache_dir = str(token_cache.cache_root(cfg.cache_dir).resolve())
    if cfg.data:  # your own data: local paths resolved (a Hub name stays a name)
        for name in ("data", "val_data", "test_data"):
            value = getattr(cfg, name)
            if value and Path(value).exists():
                setattr(cfg, name, str(Path(value).resolve()))
    elif cfg.data_dir or os.environ.get("FASTPT_DATA_DIR"):  # else ./data, found or downloaded while loading
        cfg.data_dir = str(Path(cfg.data_dir or os.environ["FASTPT_DATA_DIR"]).resolve())
    if cfg.export_dir:
        cfg.export_dir = str(Path(cfg.export_dir).resolve())
    cfg.num_workers, cfg.pin_memory = data.loader_settings(cfg, on_cuda, dist.local_world_size)
    if cfg.fused_adam is None:
        cfg.fused_adam = on_cuda
    if cfg.progress and not sys.stderr.isatty():  # a batch job's log file: bars would redraw into it
        cfg.progress = False  # a line every --log-every steps instead (bookkeeping.py)
    if not cfg.progress:
        import datasets
        datasets.disable_progress_bars()  # nor the token cache's tokenising and saving bars


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


# ---------------------------------------------------------------------------- the shell

class CommandLine:
    """One command's life: parse, check, claim the run folder, start it; the exit status at the end."""

    def __init__(self, argv=None):
        self.argv = argv
        self.cfg: TrainConfig | None = None
        self.dist = None
        self.lock = None
        self.plan = None
        self.notes: list[str] = []
        self.started = False  # the run folder has been written: failures are no longer "bad input"
        self.status = EXIT_FAILED
        self.stack = contextlib.ExitStack()  # what exit_status undoes at the end

    def parse(self):
        """Flags and the checks that need no data; the device and, under torchrun, the process group."""
        self.cfg = cfg = parse_args(self.argv)
        # SLURM's warning signal: held until training runs, then acted on
        self.stack.enter_context(hold_warning_signal(cfg.requeue_signal))
        check_environment(cfg)
        quiet_libraries(cfg.verbose)
        from fastpt.cluster import distributed  # torch: only once the flags are good
        self.dist = distributed.init(cfg.device, needs_group=cfg.strategy != "single", timeout_s=cfg.dist_timeout)
        return cfg, self.dist

    def claim_run_folder(self) -> tuple[Path, dict | None]:
        """Lock the run folder and plan it (a new run, or what last.pt resumes); nothing is written yet."""
        from fastpt.cli import run_folder
        from fastpt.inputs import token_cache
        from fastpt.cluster import resize
        from fastpt.files import shared_cache

        cfg, dist = self.cfg, self.dist
        check_device_support(cfg, dist)
        out = run_folder.choose_out(cfg)
        run_folder.check_output_folder(out, "--out")
        cache = token_cache.cache_root(cfg.cache_dir)
        run_folder.check_output_folder(cache, shared_cache.cache_setting(cfg.cache_dir))
        run_folder.check_out_link(out, cfg.overwrite)
        if cfg.compile:  # compiled kernels run as this user: only from a folder no one else can change
            from fastpt.speedups.backends import check_compile_cache
            check_compile_cache(cache)
        out, self.lock = run_folder.claim_out_dir(out, dist, new=run_folder.is_default_out(cfg))
        if cfg.export_dir:
            run_folder.check_export_dir(Path(cfg.export_dir), out, cfg.overwrite)
        self.plan = run_folder.plan_out_dir(cfg, dist, out)
        if self.plan.resume_state:
            resized = resize.adapt(cfg, self.plan.resume_state, dist.world_size)
            if resized:
                self.notes.append(resized)
                if cfg.strategy == "deepspeed":
                    check_device_support(cfg, dist)  # a --deepspeed-config must agree with the new batch
        elif cfg.resume == "auto":
            self.notes.append(f"note: no checkpoint in {out} to resume; starting a new run")
        resolve_config(cfg, dist, out)
        return self.plan.out, self.plan.resume_state

    def start_run(self, inputs) -> None:
        """A resume's data and weights checked against last.pt's, what differs from what the flags suggest
        (one line each), then the run folder's first write."""
        from fastpt.cli import run_folder

        cfg, dist = self.cfg, self.dist
        if not cfg.data:
            cfg.data_dir = cfg.data_dir or str(Path("data").resolve())  # where loading found (or put) the data
        run_folder.check_same_data(self.plan, cfg, inputs)  # a resume on changed data: refused, nothing written
        if dist.is_main:
            for line in self.notes + notes(cfg, dist, inputs):
                print(line, file=sys.stderr)
        self.started = True
        run_folder.start_out_dir(self.plan, cfg, dist, run_folder.data_key(inputs))

    @contextlib.contextmanager
    def exit_status(self):
        """Runs the command's body; whatever stops it becomes one line on stderr and `self.status`."""
        from fastpt.cluster.signals import interrupt_on_signals

        is_main = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"  # until the group exists
        stack = self.stack = contextlib.ExitStack()
        try:
            # Until the loop installs its graceful stop, SIGTERM and SIGINT stop the command at once.
            stack.enter_context(interrupt_on_signals())
            yield self
            if self.dist.is_main:
                print(f"outputs: {shlex.quote(str(self.plan.out.resolve()))}")
            self.status = 0
        except SystemExit as e:  # argparse: --help (0), or an unknown flag (2, its line already printed)
            self.status = e.code if isinstance(e.code, int) else EXIT_BAD_INPUT
        except RunFinished as e:
            if self.dist.is_main:
                print(e)
            self.status = 0
        except (ValueError, DataError, ModelError, CheckpointError) as e:
            if self.started and not isinstance(e, CheckpointError):
                raise  # a bug, not bad input: the traceback says where
            # Bad input before the run folder was written: status 2. After it, a checkpoint that
            # cannot be written (a full disk): status 1, earlier checkpoints untouched; a full
            # disk before it (the token cache) is status 1 too, not bad input.
            self.status = EXIT_FAILED if self.started or isinstance(e, DiskFull) else EXIT_BAD_INPUT
            if self.dist.is_main if self.dist else is_main:
                print(f"error: {one_line(e)}", file=sys.stderr)
        except NonFiniteLoss as e:
            if self.dist.is_main:
                print(f"error: {one_line(e)}", file=sys.stderr)
            self.status = EXIT_FAILED
        except StopRequested as e:
            if self.dist.is_main:
                below_bar = "\n" if self.cfg.progress else ""  # a line of its own, not glued to the bar
                print(f"{below_bar}{'' if isinstance(e, Requeued) else 'stopped: '}{e}", file=sys.stderr)
            self.status = 0 if isinstance(e, Requeued) else EXIT_STOPPED  # requeued: SLURM runs it again
            if self.dist.world_size > 1:
                from fastpt.cluster.signals import settle
                settle(self.status)  # the launcher's SIGTERM to the last ranks leaves the status as it is
        except KeyboardInterrupt as e:  # SIGINT / SIGTERM while tokenising or building: nothing left behind
            from fastpt.cluster.signals import Interrupted
            if self.started and not isinstance(e, Interrupted):
                raise  # a plain KeyboardInterrupt after training: Python's own behaviour
            kept = self._unstart() if self.started else "nothing was kept"
            if self.dist.is_main if self.dist else is_main:
                print(f"\nstopped: {getattr(e, 'name', 'interrupted')} before training started; {kept}",
                      file=sys.stderr)
            self.status = 128 + getattr(e, "signum", signal.SIGINT)  # 130 for Ctrl-C, 143 for SIGTERM
        except RuntimeError as e:  # a rank missing or dead: the group did not form, or a collective timed out
            from fastpt.cluster import distributed
            if not distributed.lost_contact(e):
                raise
            self.status = _lost_contact(e, self.dist.rank if self.dist else int(os.environ.get("RANK", 0)),
                                        self.cfg)
        finally:
            stack.close()
            if self.lock is not None:
                self.lock.release(keep=self.started)  # nothing written yet (or undone): no run folder left behind
            if self.dist is not None:
                from fastpt.cluster import distributed
                distributed.shutdown()

    def _unstart(self) -> str:
        """A stop after config.json but before training: remove what this new run wrote (rank 0).

        A resumed run's folder held the run before this command and keeps it."""
        if self.plan.resume_state is not None:
            return f"the checkpoints in {self.plan.out} are as they were: --resume auto continues it"
        if self.dist.is_main:
            out = self.plan.out
            from fastpt.cli.run_folder import MARKER
            made_here = self.lock is not None and out in self.lock.created  # else the marker was there before
            for name in ("config.json", "tb", *([MARKER] if made_here else [])):
                path = out / name
                if path.is_symlink() or path.is_file():
                    path.unlink()
                elif path.is_dir():
                    shutil.rmtree(path)
            with contextlib.suppress(OSError):
                (out / "checkpoints").rmdir()  # empty before the first step
        self.started = False  # as if never started: the lock's release removes the folders it made
        return "nothing was kept"


RANK_0_FIRST_S = 3.0


def exit_process(status: int) -> None:
    """sys.exit(status); a torchrun worker leaves with os._exit instead (distributed.leave says why)."""
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
    if status in (EXIT_BAD_INPUT, EXIT_STOPPED) and rank != "0":
        # torchrun (and srun --kill-on-bad-exit) stops every worker once one has exited. Bad input
        # that each rank finds by itself (a flag, a config file) and a stop are printed by rank 0
        # alone: the others give it time to say it.
        time.sleep(RANK_0_FIRST_S)
    if "torch.distributed" in sys.modules:  # --help and a bad flag never load torch
        from fastpt.cluster import distributed
        distributed.leave(status)
    sys.exit(status)


def _lost_contact(e: Exception, rank: int, cfg: TrainConfig) -> int:
    """One line from every rank that saw it (rank 0 may be the one that died): status 1."""
    # One write (print would write the text and its newline apart): every rank's line shares one stderr.
    sys.stderr.write(f"error: rank {rank} lost contact with the other processes: another one died, or did not answer "
                     f"within --dist-timeout {cfg.dist_timeout} s ({one_line(e, limit=160)}); the same command with "
                     f"--resume auto continues from checkpoints/last.pt where one was saved\n")
    return EXIT_FAILED
