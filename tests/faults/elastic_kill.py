"""In torchrun's first attempt only, one rank SIGKILLs itself inside step K (used by test_multinode.py).

    torchrun --max-restarts=N tests/faults/elastic_kill.py RANK K [--hang S] [--no-dropout] -- TRAIN ARGS

--hang S: the rank stops answering for S seconds instead (a hung peer, for --dist-timeout).

The restarted workers (TORCHELASTIC_RESTART_COUNT > 0) run the same command without the fault,
as a user's restarted job would. --no-dropout: the tiny model of tests/dist/run_many.py's references.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist"))

from inject import at_step  # noqa: E402

from fastpt.inputs import models  # noqa: E402
from train import exit_process, main  # noqa: E402


if __name__ == "__main__":
    split = sys.argv.index("--")
    victim, step, *options = sys.argv[1:split]
    victim, step = int(victim), int(step)
    if "--no-dropout" in options:
        import run_many
        models.tiny_config = run_many.no_dropout_tiny_config
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and int(os.environ["RANK"]) == victim:
        if "--hang" in options:
            seconds = float(options[options.index("--hang") + 1])
            at_step(step, lambda: time.sleep(seconds))
        else:
            at_step(step, lambda: os.kill(os.getpid(), signal.SIGKILL))
    exit_process(main(sys.argv[split + 1:]))
