"""Gradient clipping under FSDP2 on two gloo processes equals clipping in one process.

FSDP2's gradients are DTensors sharded over the ranks; the stock `clip_grad_norm_` (the
strategy's `clip_grad_norm_` hook) must compute the norm of the whole model, not of this
rank's shard, and scale every shard by the same factor. Each rank trains on half of the batch;
the reference is the unsharded copy of the model on the whole batch, clipped in one process.
The norm the strategy returns is a plain tensor, and the whole clip costs one all-reduce: torch's
total comes back replicated, so making it a plain tensor (`full_tensor()`) moves nothing.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(120)
def test_fsdp_clipping_equals_one_process():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", __file__]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert sorted(line.split()[1] for line in proc.stdout.splitlines() if line.startswith("clipped ")) == ["0", "1"]


def main() -> None:
    """On each torchrun rank: clip FSDP2's sharded gradients and compare with the one-process reference."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.debug import CommDebugMode

    sys.path.insert(0, str(ROOT))
    from fastpt.config import TrainConfig
    from fastpt.cluster.distributed import DistInfo, leave
    from fastpt.strategies.fsdp import FSDPStrategy

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same model and batch on every rank
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))

    reference = copy.deepcopy(model)  # one process, the whole batch
    torch.nn.functional.cross_entropy(reference(x), y).backward()
    full_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), float("inf"))  # the norm, unclipped
    max_norm = full_norm.item() / 4  # well below the norm: clipping scales every gradient by about 1/4
    torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)

    for layer in model[0], model[2]:
        fully_shard(layer)
    fully_shard(model)
    half = slice(rank * 8 // world, (rank + 1) * 8 // world)  # FSDP averages the halves' gradients
    torch.nn.functional.cross_entropy(model(x[half]), y[half]).backward()
    strategy = FSDPStrategy(TrainConfig(), DistInfo(rank, rank, world, torch.device("cpu")))
    strategy.module = model
    unclipped = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))  # scales every gradient by 1
    assert isinstance(unclipped, DTensor) and unclipped.placements == (Replicate(),), unclipped.placements
    with CommDebugMode() as comms:
        norm = strategy.clip_grad_norm_(max_norm)

    assert not isinstance(norm, DTensor), "the returned norm is a plain tensor, ready to log"
    assert comms.get_total_counts() == 1, comms.get_comm_counts()  # the total's all-reduce, nothing after it
    torch.testing.assert_close(norm, full_norm)
    for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
        assert isinstance(p.grad, DTensor)
        torch.testing.assert_close(p.grad.full_tensor(), ref.grad, msg=name)
    # One write per line: under PYTHONUNBUFFERED, print's text and newline are two writes, and the
    # two ranks' lines, sharing torchrun's stdout, could interleave.
    sys.stdout.write(f"clipped {rank} norm {norm.item():.6f} reference {full_norm.item():.6f}\n")
    sys.stdout.flush()
    dist.destroy_process_group()
    leave(0)  # os._exit: FSDP's mesh still holds the group, whose gloo threads could abort the teardown


if __name__ == "__main__":
    main()
