"""Run train.py's main() once per argument list, in one process: one torchrun launch, several runs.

    torchrun --nproc_per_node=2 tests/dist/run_many.py [--no-dropout] -- ARGS... -- ARGS...

Starting processes and importing torch, transformers and deepspeed costs far more than a tiny
run, so the distributed tests launch once and train every strategy in turn. The process group
is created by the first run and kept for the next ones (a second group cannot rendezvous on
torchrun's store under the same name); it is destroyed once, at the end.

Each rank writes `rank<R>_result.json` ({"rank", "global_steps", "stopped_early", "epochs_run"})
into the run folder, so a test can check that every rank ended at the same step (rank 0 alone
writes results.json). `--no-dropout` builds the tiny model without dropout, so runs that differ only in
how the batch is split over processes must give the same losses.
"""

import json
import os
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import train  # noqa: E402
from fastpt.cli.shell import exit_process  # noqa: E402
from fastpt.inputs import models  # noqa: E402
from fastpt.cluster import distributed  # noqa: E402


def no_dropout_tiny_config():
    config = _tiny_config()
    config.dropout = config.attention_dropout = config.seq_classif_dropout = 0.0
    return config


_tiny_config = models.tiny_config
_train = train.train


def train_and_report(cfg, dist, inputs, out_dir, resume_state=None):
    results = _train(cfg, dist, inputs, out_dir, resume_state)
    report = {"rank": dist.rank, "global_steps": results["global_steps"],
              "stopped_early": results["stopped_early"], "epochs_run": results["epochs_run"]}
    (out_dir / f"rank{dist.rank}_result.json").write_text(json.dumps(report))
    return results


def skip_deepspeed_shm_build() -> None:
    """Let DeepSpeed talk over the existing gloo group without its shared-memory all-reduce op.

    On the CPU, DeepSpeed JIT-compiles that C++ op on first use, which takes minutes on a
    small machine; gloo alone is correct and fast enough for a tiny model.
    """
    import importlib

    # By module path: the package `deepspeed.comm` re-exports the name `torch` (the torch package).
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--no-dropout":
        models.tiny_config = no_dropout_tiny_config
        argv = argv[1:]
    train.train = train_and_report  # train.main looks it up in the module
    if "--deepspeed" in argv:
        skip_deepspeed_shm_build()
    runs, current = [], None
    for arg in argv:
        if arg == "--":
            current = []
            runs.append(current)
        else:
            current.append(arg)
    shutdown, distributed.shutdown = distributed.shutdown, lambda: None
    worst = 0
    try:
        for args in runs:
            code = train.main(args)
            # One write per line: under PYTHONUNBUFFERED print writes the text and its newline separately,
            # and the ranks' lines, sharing one pipe, could interleave.
            sys.stdout.write("EXIT " + json.dumps({"rank": int(os.environ.get("RANK", 0)), "exit": code,
                                                   "args": args}) + "\n")
            sys.stdout.flush()
            worst = worst or code
    finally:
        shutdown()
    return worst


if __name__ == "__main__":
    exit_process(main(sys.argv[1:]))
