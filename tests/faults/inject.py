"""Run train.py's main() with one fault injected at a chosen point (used by test_reliability.py).

    python tests/faults/inject.py kill-at-step K -- TRAIN ARGS      # SIGKILL itself inside step K
    python tests/faults/inject.py signal-at-step K TERM -- ARGS     # send itself SIGTERM in step K
    python tests/faults/inject.py die-in-save N -- ARGS             # die halfway through writing
                                                                    # the N-th last.pt
    python tests/faults/inject.py two-runs -- ARGS1 -- ARGS2        # no fault: two runs, one launch
Also works under torchrun (every rank injects the same fault at the same point). Steps are
counted from 1 in this process, before the optimiser step of step K runs.
"""

from __future__ import annotations

import io
import os
import signal
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from fastpt.files import checkpoint  # noqa: E402
from fastpt.strategies.base import Strategy  # noqa: E402
from train import exit_process, main  # noqa: E402


def at_step(k: int, action) -> None:
    """Call action() at the start of the k-th Strategy.optimizer_step in this process."""
    original = Strategy.optimizer_step
    calls = {"n": 0}

    def step(self):
        calls["n"] += 1
        if calls["n"] == k:
            action()
        return original(self)

    Strategy.optimizer_step = step


def die_in_save(n: int) -> None:
    """On the n-th write of last.pt: write half of it to the temporary file, then die (no cleanup)."""
    original_save, original_save_atomic = torch.save, checkpoint.save_atomic
    calls = {"n": 0, "dying": False}

    def save_atomic(obj, path):
        if Path(path).name == "last.pt":
            calls["n"] += 1
            calls["dying"] = calls["n"] == n
        return original_save_atomic(obj, path)

    def save(obj, f, *args, **kwargs):
        if calls["dying"] and not isinstance(f, io.BytesIO):
            buffer = io.BytesIO()
            original_save(obj, buffer, *args, **kwargs)
            f.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
            f.flush()
            os._exit(137)
        return original_save(obj, f, *args, **kwargs)

    torch.save = save
    checkpoint.save_atomic = save_atomic


def two_runs(first: list[str], second: list[str]) -> int:
    """Two runs in the same processes, keeping the process group: saves a torchrun launch."""
    from fastpt.cluster import distributed

    shutdown, distributed.shutdown = distributed.shutdown, lambda: None
    status = main(first)
    distributed.shutdown = shutdown
    return status or main(second)


def main_with_fault(argv: list[str]) -> int:
    split = argv.index("--")
    fault, train_args = argv[:split], argv[split + 1:]
    kind = fault[0]
    if kind == "two-runs":
        split = train_args.index("--")
        return two_runs(train_args[:split], train_args[split + 1:])
    if kind == "kill-at-step":
        at_step(int(fault[1]), lambda: os.kill(os.getpid(), signal.SIGKILL))
    elif kind == "signal-at-step":
        sig = getattr(signal, "SIG" + fault[2])
        at_step(int(fault[1]), lambda: os.kill(os.getpid(), sig))
    elif kind == "die-in-save":
        die_in_save(int(fault[1]))
    else:
        raise SystemExit(f"unknown fault {kind}")
    return main(train_args)


if __name__ == "__main__":
    exit_process(main_with_fault(sys.argv[1:]))
