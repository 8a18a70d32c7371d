"""Graceful stop on SIGTERM / SIGINT (preemption, `kill`, Ctrl-C).

The first signal only sets a flag: the loop finishes the step it is in, writes
`checkpoints/last.pt`, and the process exits with status `EXIT_STOPPED` (3) and a one-line
message saying how to resume. A second signal exits at once (status 128 + signal number);
checkpoints are written atomically, so even then no half-written file is left in place.

The same signal again within `REPEAT_S` is the first one delivered twice, not a second request:
a launcher that passes its signals on to workers that got them already does that. Under
`srun torchrun`, SLURM signals every process of the step, torchrun included, and torchrun
passes the signal on to its workers a few milliseconds later; a terminal's Ctrl-C reaches
torchrun and its workers alike. The warning signal never stops a run at once: it only warns.

Under torchrun every rank receives the signal; the flag is combined across ranks on a small
gloo group (host memory, no GPU synchronisation) so all ranks stop after the same step. The
combined value is the signal's number (the largest, if ranks got different ones), so every rank
knows which signal stopped the run.

The warning signal (`--requeue-signal`, SIGUSR1 by default: what `sbatch --signal=USR1@90` sends
before a time limit) stops the same way; under SLURM the job is then requeued (slurm.py). Its
default action would kill the process, so from the command's start (`hold_warning_signal`) it is
only remembered: one that arrives while the model loads stops the run at its first step, one after
training is over changes nothing (a finished run is not requeued).

SIGHUP (the terminal closed, an `ssh` connection dropped) is a stop request like SIGTERM: its default
action would kill the run at once, without last.pt, leaving a half-written temporary and the lock.
Two exceptions: a run started with SIGHUP ignored (`nohup`) keeps ignoring it, as asked, and a run
that chose it as `--requeue-signal` treats it as that warning. A terminal that hung up takes no
more output (each write fails), so on SIGHUP the process's output that went to a terminal goes to
/dev/null instead: the stop completes, and its line is written wherever output still goes (a log file).

Before training starts (model loading, tokenising, building) there is no step to finish:
`interrupt_on_signals` makes SIGTERM, like SIGINT, raise `Interrupted` at once, so the command
removes what it created and says so (cli/shell.py) instead of dying silently with its lock left.
No torch import here: the command line installs this before torch loads.
"""

import contextlib
import datetime
import errno
import functools
import os
import signal
import sys
import threading
import time

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
REPEAT_S = 2.0  # the same signal again this soon: delivered twice (see top), not a second request


def stop_signals(warning_signal: int | None = None) -> tuple:
    """The signals that stop a run: SIGTERM, SIGINT and SIGHUP, less SIGHUP where the process ignores it
    (started under `nohup`) or where it is the warning signal (--requeue-signal HUP)."""
    if signal.SIGHUP == warning_signal or signal.getsignal(signal.SIGHUP) == signal.SIG_IGN:
        return STOP_SIGNALS
    return (*STOP_SIGNALS, signal.SIGHUP)


def leave_hung_up_terminal(signum: int) -> None:
    """After SIGHUP, standard output and error that went to a terminal go to /dev/null: a hung-up
    terminal fails every write, which would turn the graceful stop into a crash (and Python's last
    flush into status 120)."""
    if signum != signal.SIGHUP:
        return
    for fd in (1, 2):
        with contextlib.suppress(OSError):
            if os.isatty(fd):
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, fd)
                os.close(null)


class TerminalStream:
    """sys.stdout or sys.stderr on a terminal that may hang up. The write that meets the hung-up terminal
    (EIO) can come before the SIGHUP handler runs; it moves the output to /dev/null, as the handler does,
    instead of failing the step that was to finish and save."""

    def __init__(self, stream):
        self.stream = stream

    def _safely(self, call, *args):
        try:
            return call(*args)
        except OSError as e:
            if e.errno != errno.EIO:
                raise
            leave_hung_up_terminal(signal.SIGHUP)
            with contextlib.suppress(OSError):
                self.stream.flush()  # what the failed write left in the buffer goes to /dev/null
            return len(args[0]) if args else None

    def __getattr__(self, name):
        """The stream's own attributes, its write and flush made safe."""
        found = getattr(self.stream, name)
        return functools.partial(self._safely, found) if name in ("write", "flush") else found


@contextlib.contextmanager
def terminal_streams():
    """Inside the block, sys.stdout and sys.stderr that are terminals survive the terminal's hang-up
    (TerminalStream), where SIGHUP stops the run (not under nohup)."""
    wrapped = {}
    if signal.SIGHUP in stop_signals():
        for name in ("stdout", "stderr"):
            stream = getattr(sys, name)
            with contextlib.suppress(AttributeError, ValueError, OSError):
                if stream.isatty():
                    wrapped[name] = TerminalStream(stream)
                    setattr(sys, name, wrapped[name])
    try:
        yield
    finally:
        for name, stream in wrapped.items():
            if getattr(sys, name) is stream:
                setattr(sys, name, stream.stream)


def _repeated(first: tuple, signum: int) -> bool:
    """Whether `signum` is the first signal (`first`: its number and time) delivered again."""
    return signum == first[0] and time.monotonic() - first[1] < REPEAT_S


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGINT before training started (GracefulStop takes over from there)."""

    def __init__(self, signum: int):
        self.signum, self.name = signum, signal.Signals(signum).name
        super().__init__(self.name)


_training = threading.Event()  # set once GracefulStop is installed: from then on a stop is graceful, or plain


@contextlib.contextmanager
def interrupt_on_signals():
    """Inside the block, SIGTERM and SIGINT raise `Interrupted`; a second one exits at once."""
    if threading.current_thread() is not threading.main_thread():  # signal handlers live in the main thread
        yield
        return
    raised = []
    _training.clear()

    def handle(signum, frame):
        if _training.is_set():  # after the run (GracefulStop restored this handler): what Python does by default
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if raised:
            if _repeated(raised[0], signum):
                return
            os._exit(128 + signum)  # second signal while cleaning up: stop now
        leave_hung_up_terminal(signum)
        raised.append((signum, time.monotonic()))
        raise Interrupted(signum)

    _settled.clear()
    # --requeue-signal HUP is not known yet: hold_warning_signal, installed next, takes SIGHUP over then
    previous = {sig: signal.signal(sig, handle) for sig in stop_signals()}
    try:
        yield
    finally:
        if not _settled:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


_settled: list[int] = []  # the status a completed stop leaves with (settle)


def settle(status: int) -> None:
    """A rank's stop is complete (last.pt on disk, the line printed): from now on SIGTERM or SIGINT
    ends the process at once with the same status. A launcher stops the other ranks as soon as one
    has exited (torchrun; srun --kill-on-bad-exit), and its signal must not turn a clean stop
    (status 3) into a kill (143). For multi-process runs only: the process is about to exit."""
    _settled[:] = [status]

    def leave(signum, frame):
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(status)

    for sig in stop_signals():
        signal.signal(sig, leave)


_held: list[int] = []  # the warning signal, if it arrived before GracefulStop was installed


@contextlib.contextmanager
def hold_warning_signal(name: str):
    """Inside the block the signal `name` ("USR1") is remembered instead of killing the process
    (GracefulStop acts on it). SIGTERM and SIGINT keep their start-up meaning (interrupt_on_signals)."""
    signum = signal.Signals[f"SIG{name}"]
    if signum in STOP_SIGNALS or threading.current_thread() is not threading.main_thread():
        yield
        return
    _held.clear()
    previous = signal.signal(signum, lambda sig, frame: _held.append(sig))
    try:
        yield
    finally:
        signal.signal(signum, previous)


class GracefulStop:
    def __init__(self, warning_signal: int | None = None, timeout_s: int | None = None):
        self.timeout_s = timeout_s  # --dist-timeout: a group of its own does not inherit the default group's
        self.signum = None  # this process's signal: a second one exits at once
        self._signalled_at = 0.0
        self.agreed = None  # the signal all ranks stop for (poll())
        self.warning_signal = warning_signal
        self._previous = {}
        self._group = None

    def install(self) -> "GracefulStop":
        import torch.distributed as dist

        _training.set()
        signals = (*stop_signals(self.warning_signal), *([self.warning_signal] if self.warning_signal else []))
        self._previous = {sig: signal.signal(sig, self._handle) for sig in dict.fromkeys(signals)}
        if self.warning_signal in _held:  # it came while the run was being built: stop at the first step
            self.signum = self.warning_signal
        _held.clear()
        if dist.is_initialized():
            timeout = None if self.timeout_s is None else datetime.timedelta(seconds=self.timeout_s)
            self._group = dist.new_group(backend="gloo", timeout=timeout)
        return self

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            if signum == self.warning_signal or _repeated((self.signum, self._signalled_at), signum):
                return  # the first signal delivered again, or one more warning
            os._exit(128 + signum)  # second signal: stop now
        leave_hung_up_terminal(signum)
        self.signum, self._signalled_at = signum, time.monotonic()

    @property
    def stop_signal(self) -> int | None:
        return self.agreed or self.signum

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.stop_signal).name if self.stop_signal is not None else "no signal"

    def poll(self, save_due: bool = False) -> tuple[bool, bool]:
        """(stop, save), the same on every rank: whether any rank received a signal, and whether any
        rank's `save_due` is set (a collective under torchrun).

        `save_due` rides on this collective, which the loop runs anyway: rank 0's clock says last.pt
        is due (--save-every-minutes) and every rank saves at the same step, for no collective more.
        """
        import torch
        import torch.distributed as dist

        if self._group is None:
            return self.signum is not None, save_due
        flags = torch.tensor([self.signum or 0, int(save_due)], dtype=torch.int32)  # host memory: no GPU sync
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group)
        self.agreed = int(flags[0]) or None  # possibly another rank's signal: this rank stops for it too
        return self.agreed is not None, bool(flags[1])

    def ignore_signals(self) -> None:
        """The run is leaving (a requeued SLURM job's tasks get SIGTERM): its signals are ignored from now
        on, also after `uninstall`; the command line's own handlers put the original ones back at the end."""
        self._previous = dict.fromkeys(self._previous, signal.SIG_IGN)
        self.uninstall()

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
