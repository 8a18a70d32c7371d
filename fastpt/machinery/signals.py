"""Graceful stop on SIGTERM / SIGINT (preemption, `kill`, Ctrl-C).

The first signal only sets a flag: the loop finishes the step it is in, writes
`checkpoints/last.pt`, and the process exits with status `EXIT_STOPPED` (3) and a one-line
message saying how to resume. A second signal exits at once (status 128 + signal number);
checkpoints are written atomically, so even then no half-written file is left in place.

Under torchrun every rank receives the signal; the flag is combined across ranks on a small
gloo group (host memory, no GPU synchronisation) so all ranks stop after the same step.
"""

from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist


class GracefulStop:
    def __init__(self):
        self.signum = None
        self._previous = {}
        self._group = None

    def install(self) -> "GracefulStop":
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        if dist.is_initialized():
            self._group = dist.new_group(backend="gloo")
        return self

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            os._exit(128 + signum)  # second signal: stop now
        self.signum = signum

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else "no signal"

    def requested(self) -> bool:
        """True on every rank if any rank received a signal (a collective under torchrun)."""
        if self._group is None:
            return self.signum is not None
        flag = torch.tensor([0 if self.signum is None else 1], dtype=torch.int32)  # host memory: no GPU sync
        dist.all_reduce(flag, group=self._group)
        return bool(flag.item())

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
