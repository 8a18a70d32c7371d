"""The process group, from torchrun's environment, and the few collectives the loop needs.

`torchrun --nproc_per_node=N train.py ...` starts N processes and sets RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT in each. `init()` reads them, picks the device
(cuda:LOCAL_RANK, set before the group exists, or the CPU) and the backend (NCCL on CUDA,
gloo on the CPU). Without torchrun it is the single-process case: rank 0 of 1, no group; a
strategy that needs a group gets a one-rank one, with the variables torchrun would have set
(DeepSpeed reads LOCAL_RANK itself), removed again by `shutdown()`.

Multi-node is the same code: `torchrun --nnodes=2 --nproc_per_node=4 --rdzv-backend=c10d
--rdzv-endpoint=HOST:29500 train.py --ddp`. No rank reads another node's disk: what ranks need
from rank 0's files (the resume state, best.pt's weights) comes over the group (`broadcast_state`),
and each node builds or reads its own token cache (token_cache.prepare_splits).

Under SLURM, `srun --ntasks=N python train.py --ddp` works without torchrun: `init` first sets
torchrun's variables from SLURM's (cluster/slurm.py).

Elastic restarts (`torchrun --max-restarts=N`): torchrun's c10d rendezvous by default hands the
workers a TCPStore that its agent hosts and keeps across restarts (TORCHELASTIC_USE_AGENT_STORE=True).
The keys a killed group wrote stay in it, so in the next group the first rank to start reads
the dead ranks' gloo/NCCL addresses and fails in `connectFullMesh ... Connection refused`, on
every restart (pytorch/pytorch#135712; torch's own retry prefix, TORCHELASTIC_RESTART_COUNT,
differs between nodes, so a prefix here cannot fix it). `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` in
torchrun's environment gives each rendezvous round a fresh store on a fresh port, hosted by that
round's rank 0: a restart survives the loss of any rank; `init` prints a note when it sees the
shared store with restarts allowed. `timeout` (--dist-timeout) bounds joining the group and every
collective: a rank whose peers are gone or hung stops with an error (`lost_contact`) instead of
waiting forever.
"""

import os
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from fastpt.cluster import slurm
from fastpt.files.checkpoint import from_bytes, to_bytes


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def local_world_size(self) -> int:
        return int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init(device: str = "auto", needs_group: bool = False, timeout_s: int = 600) -> DistInfo:
    """Set the device and, under torchrun, create the default process group.

    Strategies that need a group (DDP, FSDP, DeepSpeed) started without torchrun get a
    one-rank group in this process, so they run as a one-rank job.
    """
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda, but no CUDA device is available")
    slurm.join_srun_step(needs_group)  # `srun -n N python train.py --ddp`: torchrun's variables from SLURM's
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    info = DistInfo(int(os.environ.get("RANK", 0)), local_rank, int(os.environ.get("WORLD_SIZE", 1)),
                    torch.device("cuda", local_rank) if use_cuda else torch.device("cpu"))
    if use_cuda:
        torch.cuda.set_device(local_rank)  # before init: NCCL binds each rank to its own GPU
    if launched_by_torchrun() and not dist.is_initialized():
        if info.is_main and restart_may_fail():
            print("note: torchrun --max-restarts with its agent's shared store: a restart can fail to connect (stale "
                  "addresses); set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun on every node", file=sys.stderr)
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(seconds=timeout_s),
                                **({"device_id": info.device} if use_cuda else {}))
    elif needs_group and not dist.is_initialized():
        _set_one_rank_environment()
        dist.init_process_group("nccl" if use_cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    return info


def restart_may_fail() -> bool:
    """An elastic run on the agent's shared store: its restarts read the dead group's addresses."""
    return (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)) > 0)


def lost_contact(error: BaseException) -> bool:
    """Whether a collective or the group's setup failed because another rank is gone or too slow.

    Gloo raises a plain RuntimeError naming its transport ("Connection closed by peer", "Timed out
    waiting ... for recv"), NCCL and the store raise torch.distributed.DistError.
    """
    return isinstance(error, dist.DistError) or (
        isinstance(error, RuntimeError) and any(mark in str(error) for mark in ("gloo", "NCCL", "Connection closed")))


def node_first_rank(info: DistInfo) -> int:
    """Global rank of this node's LOCAL_RANK 0: torchrun numbers each node's ranks consecutively."""
    return info.rank - info.local_rank


_ONE_RANK_VARIABLES: list[str] = []  # what _set_one_rank_environment added, for shutdown() to remove


def _set_one_rank_environment() -> None:
    """torchrun's variables for a job of one process, on a free port (nothing listens on it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    wanted = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    _ONE_RANK_VARIABLES.extend(name for name in wanted if name not in os.environ)
    os.environ.update({name: wanted[name] for name in _ONE_RANK_VARIABLES})


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    while _ONE_RANK_VARIABLES:
        os.environ.pop(_ONE_RANK_VARIABLES.pop(), None)


def leave(status: int) -> None:
    """End a torchrun worker with `status` now, skipping the interpreter's teardown; else return.

    `destroy_process_group()` unregisters a group, but the group object lives on while anything
    still refers to it (a DDP module, FSDP's device mesh, DeepSpeed's groups), and its gloo worker
    threads are joined only when it is freed. A worker thread that drops a finished collective's
    tensors just after the interpreter has begun to shut down aborts the whole process ("terminate
    called without an active exception", SIGABRT): torchrun then reports a finished run as failed,
    or restarts it under --max-restarts. A one-off measurement (docs/results.md; two ranks, a module-level
    reference to the group): 7 of 40 launches aborted leaving by sys.exit, none of 40 by `leave`,
    which calls `os._exit` once the results are written and the streams flushed. Only a process
    torchrun started leaves this way: one that trains in-process (a notebook, a test) returns.
    """
    if not launched_by_torchrun():
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over ranks, in place; a no-op in a single process."""
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def broadcast_object(obj, src: int = 0):
    """Rank src's Python object on every rank."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def broadcast_state(obj, src: int = 0):
    """Rank src's object of tensors and plain data (a state dict, last.pt) on every rank; None stays None.

    It travels as torch.save bytes, read back with weights_only=True as a checkpoint file is:
    how the resume state and best.pt's weights reach ranks on nodes that do not see rank 0's
    disk. The bytes go through broadcast_object_list: on NCCL via the GPU, so it briefly needs
    their size in device memory.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    mine = dist.get_rank() == src
    data = broadcast_object(to_bytes(obj) if mine and obj is not None else None, src)
    return obj if mine or data is None else from_bytes(data)


def all_gather_object(obj) -> list:
    """Every rank's Python object, as a list indexed by rank, on every rank."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank if it is True on any rank: a stop decision all ranks take together."""
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    return bool(all_reduce_sum(t).item() > 0)
