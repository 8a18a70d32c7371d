"""The GPU check's plan: its rows, each row's command, and the planner that starts a row only where it fits.

Rows run in order, most valuable first (`plan_rows`). Each row's cost is estimated from the rows
before it (`Budget.estimate`), and `run_rows` starts one only where START_MARGIN times its estimate
fits in the time left; otherwise it is marked "skipped for time", which is not a failure.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench_single import CONFIGS, cap_pack_multiple

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"

ARTICLE = {"epochs": 3, "train": 35_000, "validation": 5_000, "test": 10_000, "batch_size": 12}
ARTICLE_MINUTES = ("one A100, 3 epochs with validation: fp32 22.63 min (23.09 with the best checkpoint), "
                   "16-mixed 8.75 min; no single-GPU figure for + compile")

# The articles' single-GPU configurations: name, train.py flags, lightning_ref.py flags.
ARTICLE_CONFIGS = [
    ("fp32", [], ["--precision", "32"]),
    ("fp16", ["--amp"], ["--precision", "16"]),
    ("fp16-compile", ["--amp", "--compile"], ["--precision", "16", "--compile"]),
]

# fastpt's best single-GPU configuration (bench_single.py's "best", the one place to tune it):
# packed batches without padding, bfloat16 autocast, the compiled step replayed as CUDA graphs,
# the token ids kept on the GPU, one fused Adam kernel, and large evaluation batches.
BEST_FLAGS = [*CONFIGS["best"], "--eval-batch-size", "128"]


@dataclass
class Mode:
    """What differs between the GPU check and its dry run on the CPU."""
    name: str
    model: list[str]
    device: str
    max_length: int
    steps: int                   # training batches per measured row (3 are warm-up)
    val_size: int                # validation reviews per measured row: the validation rate
    test_size: int
    full: dict                   # the full run's split sizes
    probe_window: tuple          # (start after step, sync-debug steps, profiled steps)
    budget_s: float
    prior_s: dict                # a row's cost before any row of its kind has run


GPU = Mode("gpu", ["--model", "distilbert-base-uncased", "--random-init"], "cuda", 512, steps=100, val_size=480,
           test_size=120, full=dict(train=35_000, validation=5_000, test=10_000), probe_window=(10, 10, 5),
           budget_s=470, prior_s={"eager": 45, "compiled": 150})
DRY = Mode("dry", ["--model", "tiny"], "cpu", 128, steps=8, val_size=48, test_size=24,
           full=dict(train=60, validation=24, test=24), probe_window=(3, 3, 2),
           budget_s=1800, prior_s={"eager": 40, "compiled": 400})


@dataclass
class Row:
    name: str
    framework: str                      # "fastpt" or "lightning"
    flags: list[str]
    kind: str = "measure"               # measure, probe, full
    pair: str | None = None             # for a Lightning row: the fastpt row beside it
    status: str = "pending"             # ok, failed: ..., skipped: ..., skipped for time: ...
    wall_s: float | None = None
    estimate_s: float | None = None     # what the planner expected it to take, when it started it
    result: dict = field(default_factory=dict)
    probe: dict = field(default_factory=dict)

    @property
    def compiled(self) -> bool:
        return "--compile" in self.flags


# --------------------------------------------------------------------------- rows

def plan_rows(args, best_flags: list[str]) -> list[Row]:
    """Every row, in run order. The dry run uses the GPU's flags, except that its 16-bit pairs run
    bfloat16 on both sides: Lightning turns 16-mixed into bf16-mixed on a CPU (with a warning); and
    its --pack-multiple is at most its --max-length, which train.py requires."""
    if args.dry:
        best_flags = cap_pack_multiple(best_flags, DRY.max_length)
    # The full run before the probe: it is worth more, and the probe, after it, still finds the cache warm.
    rows = [Row("best", "fastpt", best_flags), Row("best-full-run", "fastpt", best_flags, kind="full"),
            Row("best-probe", "fastpt", best_flags, kind="probe")]
    for name, ours, theirs in ARTICLE_CONFIGS:
        if args.dry and "--amp" in ours:
            ours = [*ours, "--amp-dtype", "bfloat16"]
            theirs = ["bf16" if f == "16" else f for f in theirs]
        rows.append(Row(name, "fastpt", ours))
        rows.append(Row(f"{name}-lightning", "lightning", theirs, pair=name))
    rows.append(Row("deepspeed", "fastpt", ["--amp", "--deepspeed"]))  # ZeRO-2 in one process
    if args.dry:
        rows[-1].status = ("skipped: GPU only (on a CPU DeepSpeed first builds a C++ extension, minutes; "
                           "tests/test_distributed.py runs --deepspeed on the CPU)")
    if args.no_compile:
        for row in rows:
            row.flags = strip_compile(row.flags)
    if args.rows:
        wanted = args.rows.split(",")
        unknown = sorted(set(wanted) - {r.name for r in rows})
        if unknown:
            raise SystemExit(f"error: unknown row(s) {', '.join(unknown)}; rows: {', '.join(r.name for r in rows)}")
        rows = [r for r in rows if r.name in wanted]
    return rows


def strip_compile(flags: list[str]) -> list[str]:
    out, skip = [], False
    for f in flags:
        if skip:
            skip = False
        elif f == "--compile-mode":
            skip = True
        elif f != "--compile":
            out.append(f)
    return out


def choose_best_flags(args) -> tuple[list[str], str]:
    """BEST_FLAGS, or the flags given with --best-flags; and a note saying which."""
    if args.best_flags:
        return args.best_flags.split(), "best row: flags given with --best-flags"
    return list(BEST_FLAGS), f"best row: BEST_FLAGS ({' '.join(BEST_FLAGS)})"


def row_command(row: Row, mode: Mode, args, out: Path) -> list[str]:
    sizes = mode.full if row.kind == "full" else dict(
        train=(sum(mode.probe_window) + 1 if row.kind == "probe" else mode.steps) * ARTICLE["batch_size"],
        validation=mode.val_size, test=mode.test_size)
    flags = [*mode.model, "--max-length", str(mode.max_length), "--batch-size", str(ARTICLE["batch_size"]),
             "--epochs", str(ARTICLE["epochs"] if row.kind == "full" else 1),
             "--train-size", str(sizes["train"]), "--val-size", str(sizes["validation"]),
             "--test-size", str(sizes["test"]), "--device", mode.device, "--out", str(out)]
    flags += ["--data-dir", args.data_dir] if args.data_dir else []
    flags += ["--cache-dir", args.cache_dir] if args.cache_dir else []
    if row.framework == "lightning":
        return [sys.executable, str(SCRIPTS / "peers" / "lightning_ref.py"), *flags, *row.flags]
    flags += ["--no-progress", "--no-tensorboard", "--overwrite"]
    if row.kind != "full":  # log lines read the loss back from the GPU: none inside a measured window
        flags += ["--log-every", str(10**6)]
    if row.kind == "probe":
        start, sync_steps, profiled = mode.probe_window
        return [sys.executable, str(SCRIPTS / "bench_single.py"), "probe", "--start-after", str(start),
                "--sync-steps", str(sync_steps), "--profile-steps", str(profiled),
                "--report", str(out / "probe.json"), "--", *flags, *row.flags]
    if "--deepspeed" in row.flags:  # DeepSpeed reads LOCAL_RANK: a one-process torchrun sets it
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                str(ROOT / "train.py"), *flags, *row.flags]
    return [sys.executable, str(ROOT / "train.py"), *flags, *row.flags]


# --------------------------------------------------------------------------- budget

START_MARGIN = 1.5  # a row starts only where this many times its estimate fits in the time left
TIMEOUT_FACTOR = 3.0  # a row's timeout: at least START_MARGIN x its estimate, so it stops only a hung row
MIN_TIMEOUT_S = 120.0
# A rerun of compiled flags reads the Inductor cache the first run filled, so its compile costs a share of the
# first's: 7.2 of 49.7 s measured on the CPU (scripts/results/compile-cache-cpu.md). 0.5 leaves room for a GPU,
# where Dynamo still traces and CUDA graphs are recorded again.
WARM_COMPILE_SHARE = 0.5


class Budget:
    """Seconds left until the deadline, and what a row is expected to cost.

    `clock` is time.time; tests/test_gpu_check.py drives the planner with a fake one."""

    def __init__(self, started_at: float, budget_s: float, reserve_s: float = 15.0, clock=time.time):
        self.deadline = started_at + budget_s - reserve_s  # the reserve writes the report
        self.clock = clock

    def left(self) -> float:
        return self.deadline - self.clock()

    @staticmethod
    def estimate(row: Row, done: list[Row], mode: Mode) -> float:
        """Expected seconds, from the rows done; inf for a full run without a short run of its flags."""
        if row.kind == "full":
            return full_run_estimate(row, done, mode)
        first = same_flags_run(row, done)
        if first is not None:  # the probe: the best row again, over fewer steps, from a warm cache
            return warm_rerun_s(first)
        seen = [r.wall_s for r in done if r.status == "ok" and r.kind == "measure" and r.wall_s
                and r.compiled == row.compiled]  # each of these compiled from a cold cache, like this row
        return max(seen) if seen else mode.prior_s["compiled" if row.compiled else "eager"]


def same_flags_run(row: Row, done: list[Row]) -> Row | None:
    """The first short run of the same flags that gave a rate (a measured row before a probe)."""
    runs = [r for r in done if r.flags == row.flags and r.framework == row.framework and r.kind != "full"
            and r.status == "ok" and r.wall_s and r.result.get("samples_per_s")]
    return min(runs, key=lambda r: r.kind != "measure", default=None)


def warm_rerun_s(first: Row) -> float:
    """`first`'s wall time with its compilation done again from the warm cache it left."""
    return first.wall_s - (1 - WARM_COMPILE_SHARE) * (first.result.get("compile_time_s") or 0.0)


def full_run_estimate(full: Row, done: list[Row], mode: Mode) -> float:
    """A short run of the same flags started again (its start-up, warm compile and short run), plus
    3 epochs at its training rate and its validation rate without compilation."""
    first = same_flags_run(full, done)
    if first is None:
        return float("inf")
    sps = first.result["samples_per_s"]
    train_s = ARTICLE["epochs"] * mode.full["train"] / sps
    eval_rate = measured_val_rate(first.result, mode) or 3 * sps  # forward only: ~3x
    eval_s = (ARTICLE["epochs"] * mode.full["validation"] + mode.full["test"]) / eval_rate
    return warm_rerun_s(first) + train_s + eval_s


def measured_val_rate(result: dict, mode: Mode) -> float | None:
    """Validation reviews per second without compiling: `val_time_no_compile_s`. `val_time_s` counts
    compiling the evaluation graph, which a short run cannot spread as a long one does (48 reviews in
    26 s in a dry run); only an uncompiled run's, from before that figure, stands in for it."""
    seconds = result.get("val_time_no_compile_s")
    if seconds is None and result.get("compile_time_s") is None:
        seconds = result.get("val_time_s")
    reviews = (result.get("val_examples") or mode.val_size) * (result.get("epochs_run") or 1)
    return reviews / seconds if seconds and seconds > 0 else None


# --------------------------------------------------------------------------- the planner

def run_rows(rows: list[Row], mode: Mode, budget: Budget, launch) -> None:
    """The planner: the pending rows in order, each started only where START_MARGIN x its estimate
    fits in the time left. `launch(row, timeout_s)` runs one and fills in its status, wall time and
    results (launch_process; a simulated row in tests/test_gpu_check.py)."""
    done: list[Row] = []
    for row in rows:
        if row.status == "pending":
            start_if_it_fits(row, mode, budget, done, launch)
        else:
            print(f"[{row.name}] {row.status}", flush=True)
        done.append(row)


def start_if_it_fits(row: Row, mode: Mode, budget: Budget, done: list[Row], launch) -> None:
    left = budget.left()
    needed = Budget.estimate(row, done, mode)
    if needed == float("inf"):
        row.status = "skipped: no short run of its flags to estimate it from"
    elif START_MARGIN * needed > left:
        row.status = f"skipped for time: needs ~{needed:.0f} s (x{START_MARGIN:g}: {START_MARGIN * needed:.0f} s), " \
                     f"{max(left, 0):.0f} s left"
    if row.status != "pending":
        print(f"[{row.name}] {row.status}", flush=True)
        return
    row.estimate_s = needed
    # Never under START_MARGIN x the estimate (it fits in `left`, tested above), so a row that runs as
    # estimated is not stopped; the cap keeps a hung row from taking the time of the rows after it.
    launch(row, min(left, max(TIMEOUT_FACTOR * needed, MIN_TIMEOUT_S)))
