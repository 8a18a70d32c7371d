"""Run train.py's main() once per argument list in one torchrun launch, recording what each rank trained on.

    torchrun --nproc_per_node=N tests/dist/resize_runs.py -- [--stop-at K] ARGS... -- [--stop-at K] ARGS...

Used by tests/test_resize.py. The tiny model is built without dropout (run_many.py), so runs that
differ only in how a global batch is split over processes compute the same losses. Every batch a
rank's training sampler hands out is appended to `<out>/batches-rank<R>.jsonl` as
{"epoch", "step_batch", "indices"}, so a test can check which reviews each step saw.
`--stop-at K` before a run's arguments sends this process SIGTERM in the run's K-th training step: the run saves last.pt
after that step, mid-epoch, and stops with status 3 (the runs after it still run).
"""

import json
import os
import signal
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import run_many  # noqa: E402

import train  # noqa: E402
from fastpt.cli.shell import exit_process  # noqa: E402
from fastpt.inputs import data, models  # noqa: E402
from fastpt.loop import step  # noqa: E402
from fastpt.cluster import distributed  # noqa: E402


CURRENT = {"out": None, "steps": 0, "stop_at": None}
_iter, _train, _train_step = data.TrainBatchSampler.__iter__, train.train, step.train_step


def recording_iter(self):
    rank = int(os.environ.get("RANK", 0))
    for i, batch in enumerate(_iter(self)):
        with open(Path(CURRENT["out"]) / f"batches-rank{rank}.jsonl", "a") as f:
            f.write(json.dumps({"epoch": self.epoch, "step_batch": self.start_batch + i, "indices": batch}) + "\n")
        yield batch


def recording_train(cfg, dist, inputs, out_dir, resume_state=None):
    CURRENT["out"], CURRENT["steps"] = out_dir, 0
    return _train(cfg, dist, inputs, out_dir, resume_state)


def stopping_step(*args):
    CURRENT["steps"] += 1
    if CURRENT["steps"] == CURRENT["stop_at"]:
        os.kill(os.getpid(), signal.SIGTERM)  # handled by GracefulStop: save after this step, then stop
    return _train_step(*args)


def main(argv: list[str]) -> int:
    models.tiny_config = run_many.no_dropout_tiny_config
    data.TrainBatchSampler.__iter__ = recording_iter
    train.train = recording_train  # train.main looks it up in the module
    step.train_step = stopping_step  # train_epoch looks it up in the module
    if "--deepspeed" in argv:
        run_many.skip_deepspeed_shm_build()
    runs = [[]]
    for arg in argv[1:] if argv[0] == "--" else argv:  # torchrun may drop the first "--"
        if arg == "--":
            runs.append([])
        else:
            runs[-1].append(arg)
    shutdown, distributed.shutdown = distributed.shutdown, lambda: None
    codes = []
    try:
        for args in runs:
            CURRENT["stop_at"] = int(args[1]) if args[0] == "--stop-at" else None
            codes.append(train.main(args[2:] if args[0] == "--stop-at" else args))
    finally:
        shutdown()
    sys.stdout.write("EXITS " + json.dumps(codes) + "\n")  # one write: the ranks' lines share a pipe
    sys.stdout.flush()
    return 0 if all(code in (0, 3) for code in codes) else 1


if __name__ == "__main__":
    exit_process(main(sys.argv[1:]))
