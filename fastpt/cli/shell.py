"""The command line around the run: flags and checks, the process group, the run folder and its
lock, one-line errors and exit statuses. Nothing here trains, and nothing here decides the run's
order: train.py calls it, in this order,

    shell = CommandLine(argv)
    with shell.exit_status():                          # any failure inside: one line and its status
        cfg, dist = shell.parse()                      # flags, environment, device, process group
        cfg, out_dir, resume_state = shell.claim_run_folder()  # the lock; a new run or a resume; cfg resolved
        inputs = load_inputs(cfg, dist)                # model and data
        cfg = shell.start_run(inputs)                  # notes, then config.json: the first write
        train(cfg, dist, inputs, out_dir, resume_state)
    return shell.status

The config is a value (config.py): each step that settles more of it returns a new one.

Exit status: 0 done (or nothing to do: the run is already finished); 2 bad input (one line on
stderr, before any work, nothing written); 3 stopped by SIGTERM/SIGINT/SIGHUP (or --requeue-signal)
after writing checkpoints/last.pt, 0 if that signal then requeued the SLURM job (cluster/slurm.py);
1 the run failed (e.g. the loss became NaN, the disk is full; earlier checkpoints are left
untouched); 130 Ctrl-C, 143 SIGTERM before training started (what the new run wrote removed, no
run folder left; a resumed run's checkpoints as they were). Under torchrun every rank returns the
same status and only rank 0 prints, except that each rank that lost contact with the others
(--dist-timeout) says so: status 1.

The order matters for "nothing written on bad input": every check that can fail on what the
user passed (flags, environment, output places, the run folder, the resume checkpoint, the
model, the data) runs before `start_run` creates, clears or writes the run folder's files.
The checks, the resolved config and the notes are preflight.py's.

Imports of torch and transformers wait until the command line is parsed: `--help` and flag
errors answer at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import shutil
import signal
import sys
import time
from pathlib import Path

from fastpt.cli.args import parse_args
from fastpt.cli.preflight import check_device_support, check_environment, notes, resolve_config
from fastpt.cli import run_folder
from fastpt.config import TrainConfig
from fastpt.errors import (EXIT_STOPPED, CheckpointError, DataError, DiskFull, ModelError, NonFiniteLoss,
                           Requeued, StopRequested, one_line)
from fastpt.cluster.signals import Interrupted, hold_warning_signal, interrupt_on_signals, settle, terminal_streams


EXIT_BAD_INPUT = 2
EXIT_FAILED = 1


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

@dataclasses.dataclass
class CommandLine:
    """One command's life: parse, check, claim the run folder, start it; the exit status at the end."""

    argv: list | None = None
    cfg: TrainConfig | None = None
    dist: object = None
    lock: object = None
    plan: object = None
    notes: list[str] = dataclasses.field(default_factory=list)
    started: bool = False  # the run folder has been written: failures are no longer "bad input"
    status: int = EXIT_FAILED

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

    def claim_run_folder(self) -> tuple[TrainConfig, Path, dict | None]:
        """Lock the run folder and plan it (a new run, or what last.pt resumes); nothing is written yet.
        The config, resolved (resolve_config; on another number of processes, resize.adapt's batch)."""
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
            from fastpt.speedups.compile import check_compile_cache
            check_compile_cache(cache)
        # new: choose_out named the folder (runs/<time>) rather than --out or --resume
        out, self.lock = run_folder.claim_out_dir(out, dist, new=not cfg.out and cfg.resume is None)
        if cfg.export_dir:
            run_folder.check_export_dir(Path(cfg.export_dir), out, cfg.overwrite)
        self.plan = run_folder.plan_out_dir(cfg, dist, out)
        if self.plan.resume_state:
            cfg, resized = resize.adapt(cfg, self.plan.resume_state, dist.world_size)
            if resized:
                self.notes.append(resized)
                if cfg.strategy == "deepspeed":
                    check_device_support(cfg, dist)  # a --deepspeed-config must agree with the new batch
        elif cfg.resume == "auto":
            self.notes.append(f"note: no checkpoint in {out} to resume; starting a new run")
        self.cfg = cfg = resolve_config(cfg, dist, out)
        return cfg, self.plan.out, self.plan.resume_state

    def start_run(self, inputs) -> TrainConfig:
        """A resume's data and weights checked against last.pt's, what differs from what the flags suggest
        (one line each), then the run folder's first write. The config, with IMDB's folder as loading found it."""
        from fastpt.cli import resume_check
        from fastpt.loop.build import saved_config

        cfg, dist = self.cfg, self.dist
        if not cfg.data and not cfg.data_dir:  # where loading found (or put) the data
            self.cfg = cfg = dataclasses.replace(cfg, data_dir=str(Path("data").resolve()))
        resume_check.check_same_data(self.plan, cfg, inputs)  # a resume on changed data: refused, nothing written
        if dist.is_main:
            for line in self.notes + notes(cfg, dist, inputs):
                print(line, file=sys.stderr)
        self.started = True
        run_folder.start_out_dir(self.plan, saved_config(cfg, inputs), dist, resume_check.data_key(inputs))
        return cfg

    @contextlib.contextmanager
    def exit_status(self):
        """Runs the command's body; whatever stops it becomes one line on stderr and `self.status`."""
        stack = self.stack = contextlib.ExitStack()  # what exit_status undoes at the end (parse adds to it)
        try:
            stack.enter_context(terminal_streams())  # a terminal that hangs up (SIGHUP) fails no write
            # Until the loop installs its graceful stop, SIGTERM, SIGINT and SIGHUP stop the command at once.
            stack.enter_context(interrupt_on_signals())
            yield self
            self._say(f"outputs: {shlex.quote(str(self.plan.out.resolve()))}", sys.stdout)
            self.status = 0
        except SystemExit as e:  # argparse: --help (0), or an unknown flag (2, its line already printed)
            self.status = e.code if isinstance(e.code, int) else EXIT_BAD_INPUT
        except run_folder.RunFinished as e:
            self._say(str(e), sys.stdout)
            self.status = 0
        except (ValueError, DataError, ModelError, CheckpointError, NonFiniteLoss) as e:
            if self.started and not isinstance(e, (CheckpointError, NonFiniteLoss)):
                raise  # a bug, not bad input: the traceback says where
            # Bad input before the run folder was written: status 2. After it, a checkpoint that cannot be
            # written (a full disk) or a loss that diverged: status 1, earlier checkpoints untouched; a full
            # disk before it (the token cache) is status 1 too, not bad input.
            self.status = EXIT_FAILED if self.started or isinstance(e, (DiskFull, NonFiniteLoss)) else EXIT_BAD_INPUT
            self._say(f"error: {one_line(e)}", sys.stderr)
        except StopRequested as e:
            below_bar = "\n" if self.cfg.progress else ""  # a line of its own, not glued to the bar
            self._say(f"{below_bar}{'' if isinstance(e, Requeued) else 'stopped: '}{e}", sys.stderr)
            self.status = 0 if isinstance(e, Requeued) else EXIT_STOPPED  # requeued: SLURM runs it again
            if self.dist.world_size > 1:
                settle(self.status)  # the launcher's SIGTERM to the last ranks leaves the status as it is
        except KeyboardInterrupt as e:  # SIGINT / SIGTERM while tokenising or building: nothing left behind
            if self.started and not isinstance(e, Interrupted):
                raise  # a plain KeyboardInterrupt after training: Python's own behaviour
            kept = self._unstart() if self.started else "nothing was kept"
            self._say(f"\nstopped: {getattr(e, 'name', 'interrupted')} before training started; {kept}", sys.stderr)
            self.status = 128 + getattr(e, "signum", signal.SIGINT)  # 130 for Ctrl-C, 143 for SIGTERM
        except RuntimeError as e:  # a rank missing or dead: the group did not form, or a collective timed out
            from fastpt.cluster import distributed
            if not distributed.lost_contact(e):
                raise
            self.status = _lost_contact(e, self.dist.rank if self.dist else int(os.environ.get("RANK", 0)), self.cfg)
        finally:
            stack.close()
            if self.lock is not None:
                self.lock.release(keep=self.started)  # nothing written yet (or undone): no run folder left behind
            if self.dist is not None:
                from fastpt.cluster import distributed
                distributed.shutdown()

    def _say(self, text: str, stream) -> None:
        """Print on rank 0 alone; before the process group exists, rank 0 by the launcher's variables."""
        if self.dist.is_main if self.dist else os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":
            print(text, file=stream)

    def _unstart(self) -> str:
        """A stop after config.json but before training: remove what this new run wrote (rank 0).

        A resumed run's folder held the run before this command and keeps it."""
        if self.plan.resume_state is not None:
            return f"the checkpoints in {self.plan.out} are as they were: --resume auto continues it"
        if self.dist.is_main:
            out = self.plan.out
            made_here = self.lock is not None and out in self.lock.created  # else the marker was there before
            for name in ("config.json", "tb", *([run_folder.MARKER] if made_here else [])):
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
    if status in (EXIT_BAD_INPUT, EXIT_STOPPED) and os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) != "0":
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
