"""SLURM: the process group from `srun`'s variables, and a job that requeues itself before its time limit.

Lightning's `SLURMEnvironment` and its signal connector (auto-requeue on SIGUSR1) replaced, in two
functions.

The process group. `srun --ntasks=N python train.py --ddp` starts N copies of the command, one per
task, and tells each who it is in SLURM's variables, not torchrun's. `torchrun_environment()`
translates them before `distributed.init` reads torchrun's:

    RANK = SLURM_PROCID        LOCAL_RANK = SLURM_LOCALID        WORLD_SIZE = SLURM_NTASKS
    MASTER_ADDR = the first node of SLURM_STEP_NODELIST (or SLURM_JOB_NODELIST): task 0 runs there
    MASTER_PORT = 15000 + the job id's last four digits (Lightning's rule), unless MASTER_PORT is set
    LOCAL_WORLD_SIZE = this node's entry of SLURM_STEP_TASKS_PER_NODE ("2(x3),1": 2, 2, 2, 1)

Only a task that srun started is part of a group: srun sets SLURM_STEP_ID. A batch script's own
shell (`sbatch` running `python train.py` directly) and an `salloc` shell see SLURM_NTASKS of the
whole allocation but are one process: no group. torchrun's variables, when present (`srun torchrun
...`), win: torchrun numbers the workers itself.

The time limit. `sbatch --signal=USR1@90 --requeue` sends SIGUSR1 to every task 90 s before the
job's time limit. The graceful stop (signals.py) treats it like SIGTERM: every rank finishes its
step, all agree, last.pt is written. Then `requeue_after_stop` has rank 0 put the job back in the
queue (`scontrol requeue`, the array task by `<array job>_<task>`) when the job allows it
(`Requeue=1` in `scontrol show job`), and every rank exits with status 0: SLURM records the job
as requeued, not failed, and starts it again (SLURM_RESTART_COUNT=1, 2, ...), where `--resume
auto` continues from last.pt. SIGTERM (scancel, preemption) saves and stops without requeueing: a
cancelled job stays cancelled, and a preempted one is requeued by SLURM itself where the cluster's
PreemptMode says so.

No torch import at the top: the command line reads this before torch loads.
"""

import os
import re
import subprocess


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list, expanded: "gpu[01-03,07],cpu1" -> gpu01 gpu02 gpu03 gpu07 cpu1.

    What `scontrol show hostnames` prints; written out here so that no process depends on finding
    scontrol on every node. Ranges keep their zero padding; a name may hold several bracket groups
    ("rack[1-2]-n[1-2]": rack1-n1 rack1-n2 rack2-n1 rack2-n2).
    """
    return [host for item in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", nodelist) for host in _expand_one(item)]


def _expand_one(name: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", name)
    if match is None:
        return [name]
    head, tail = name[:match.start()], name[match.end():]
    numbers = []
    for part in match.group(1).split(","):
        low, _, high = part.partition("-")
        numbers += [f"{n:0{len(low)}d}" for n in range(int(low), int(high or low) + 1)]
    return [head + n + rest for n in numbers for rest in _expand_one(tail)]


def tasks_per_node(spec: str) -> list[int]:
    """SLURM_STEP_TASKS_PER_NODE, one entry per node: "2(x3),1" -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise ValueError(f"SLURM_STEP_TASKS_PER_NODE={spec!r}: not SLURM's form (e.g. 2(x3),1)")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def default_port(job_id: str) -> int:
    """Lightning's rule: 15000 + the job id's last four digits, so every task of the job picks the same
    port without talking, and two jobs sharing a first node rarely collide."""
    return 15000 + int(job_id) % 10000


def srun_tasks() -> int:
    """How many tasks the srun step that started this process has; 1 outside a step or under torchrun."""
    if "RANK" in os.environ or "SLURM_STEP_ID" not in os.environ:
        return 1
    return int(os.environ.get("SLURM_STEP_NUM_TASKS", os.environ.get("SLURM_NTASKS", 1)))


def torchrun_environment() -> dict[str, str]:
    """torchrun's variables for this srun task, from SLURM's (see the module docstring)."""
    env = os.environ
    nodes = expand_nodelist(env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"])
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    return {
        "RANK": env["SLURM_PROCID"],
        "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
        "WORLD_SIZE": str(srun_tasks()),
        "LOCAL_WORLD_SIZE": str(tasks_per_node(per_node)[int(env.get("SLURM_NODEID", 0))] if per_node else 1),
        "MASTER_ADDR": env.get("MASTER_ADDR") or nodes[0],
        "MASTER_PORT": env.get("MASTER_PORT") or str(default_port(env["SLURM_JOB_ID"])),
    }


def join_srun_step(needs_group: bool) -> None:
    """Under `srun -n N` (N > 1), set torchrun's variables from SLURM's; a run without a strategy is refused.

    Without --ddp/--fsdp/--deepspeed each of the N tasks would train the whole run alone, all
    writing the same run folder: ValueError (exit 2, one line) instead.
    """
    tasks = srun_tasks()
    if tasks == 1:
        return
    if not needs_group:
        raise ValueError(f"srun started {tasks} tasks, but without --ddp, --fsdp or --deepspeed each would train "
                         f"alone; add one of them, or run one task (srun --ntasks=1)")
    os.environ.update(torchrun_environment())


# ---------------------------------------------------------------------------- requeue

def job_to_requeue() -> str | None:
    """This job as scontrol names it (an array task as <array job>_<task>); None outside SLURM."""
    env = os.environ
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env.get("SLURM_JOB_ID")


def requeue(job: str) -> str | None:
    """Put `job` back in the queue; None when done, else why not (one line)."""
    try:
        shown = subprocess.run(["scontrol", "show", "job", "--oneliner", job], capture_output=True, text=True,
                               timeout=30)
        if shown.returncode == 0 and "Requeue=0" in shown.stdout.split():
            return "the job does not allow it (sbatch --no-requeue, or JobRequeue=0 without --requeue)"
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"scontrol failed: {e}"
    if done.returncode != 0:
        return f"scontrol requeue {job} failed: {' '.join((done.stderr or done.stdout).split())}"
    return None


def requeue_after_stop(stopper, is_main: bool, broadcast_object) -> str | None:
    """After the warning signal, under SLURM, with last.pt written: rank 0 requeues the job.

    Returns what happened for the console line when the job was requeued (every rank: all then
    exit with status 0), None when it was not (another signal, not a SLURM job, or the job cannot
    be requeued: rank 0 says why). Every rank calls it: the outcome is sent to all with
    `broadcast_object` (distributed.py's, passed in: distributed.py imports this file).
    """

    job = job_to_requeue()
    if stopper.stop_signal != stopper.warning_signal or job is None:
        return None
    # Requeueing ends this run of the job: SLURM sends SIGTERM to every task, which would find the
    # graceful stop still installed (a second signal: exit 143 at once, the console line unsaid).
    # Nothing is left to save; the processes only need to leave, before SLURM's KillWait runs out.
    stopper.ignore_signals()
    failed = broadcast_object(requeue(job) if is_main else None)
    if failed:
        if is_main:
            print(f"note: job {job} not requeued: {failed}", flush=True)
        return None
    return f"job {job} requeued"
