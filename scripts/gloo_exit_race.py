"""How often a two-rank gloo job aborts at exit, leaving by sys.exit or by `distributed.leave`.

    python scripts/gloo_exit_race.py --launches 40

Each launch is `torchrun --nproc_per_node=2` of this file as a worker: 64 asynchronous
all-reduces of tensors that Python drops before they finish, a reference to the group kept (as a
DDP module or FSDP's device mesh keeps one), `destroy_process_group()`, then the exit. A gloo worker
thread that frees the last tensors after the interpreter has begun to shut down aborts the
process ("terminate called without an active exception"). Prints the aborted launches per way out.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KEPT = []


def worker(way_out: str) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT))
    from fastpt.cluster.distributed import leave

    dist.init_process_group("gloo")
    KEPT.append(dist.group.WORLD)  # a module-level reference, as FSDP's device meshes and DeepSpeed's groups keep one
    works = [dist.all_reduce(torch.ones(1000), async_op=True) for _ in range(64)]
    for work in works:
        work.wait()
    del works
    dist.destroy_process_group()
    if way_out == "leave":
        leave(0)
    sys.exit(0)  # KEPT still refers to the group: its gloo threads are joined during the teardown


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--launches", type=int, default=40, help="torchrun launches per way out")
    args = p.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for way_out in ("sys.exit", "leave"):
        aborted = 0
        for _ in range(args.launches):
            proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
                                   __file__, "--worker", way_out], env=env, capture_output=True, text=True)
            aborted += proc.returncode != 0 and "terminate called" in proc.stderr
        print(f"{way_out:>8}: {aborted} of {args.launches} launches aborted at exit", flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
    else:
        main()
