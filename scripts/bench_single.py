"""The single-device benchmark: run it to see what each speed-up buys on your machine, before choosing flags.

    python scripts/bench_single.py --data-dir ../shared/data                 # CPU: tiny model, a few minutes
    python scripts/bench_single.py --model distilbert-base-uncased --random-init \\
        --max-length 512 --steps 60 --data-dir DIR                           # GPU: the headline numbers
    python scripts/bench_single.py profile --model minilm --max-length 512   # where a packed step's time goes
    python scripts/bench_single.py compile-cache --model minilm --max-length 512   # a cold and a warm compile

Each configuration is a real `train.py --max-steps N` run in its own process (fresh memory
peak, fresh compile caches), under torchrun for the multi-GPU ones (`--nproc`); its
results.json gives the numbers, so the training loop, the warm-up handling and the meters are
the project's own. `--flags "..."` adds train.py flags to every run. Three subcommands, each
writing a Markdown report into `--out` (default scripts/results/bench_single-<device>-<model>/):

- `table` (the default), bench.md: samples/s, real tokens/s, padding efficiency, MFU, peak
  memory, compile/first-step time, speed-up over the first configuration and the time the
  article's run (3 epochs of 35,000 reviews) would take at that speed; bench.json; a PNG bar
  chart; and the padding efficiency of the real training split at 512 tokens (every review padded
  to 512, random batches padded to their longest, --bucket, --pack and each --pack-multiple).
- `profile`, profile.md: torch.profiler's top operators by self time over `--profile-steps` of
  train.py's own training steps after the warm-up (default configuration: packed).
- `compile-cache`, compile-cache.md: each compiled configuration twice per `--scopes` over one
  new Inductor cache, cold then warm: torch's own compile time, the host time of the calls that
  compiled, the graphs, the FX graph and AOTAutograd caches' hits / misses / bypasses, the step time.

On a CPU the default set trains in bfloat16 only where the CPU computes it natively (AVX512-BF16
or AMX); on an AVX2 CPU it is float32 throughout, and the first line printed says which.
(`probe`, train.py in this process with a profiled window of steps, serves `profile` and the GPU check.)

The throughput numbers are only as quiet as the machine: measure on an otherwise idle one.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# name -> train.py flags. The first configuration run is the baseline of the speed-up column.
CONFIGS = {
    "fp32": [],  # the article's baseline: float32, every review padded to --max-length
    "fp32-tf32": ["--tf32"],
    "fp16": ["--amp"],  # precision="16-mixed"
    "fp16-compile": ["--amp", "--compile"],
    "fp16-compile-bucket": ["--amp", "--compile", "--bucket"],
    "bf16": ["--amp", "--amp-dtype", "bfloat16"],  # precision="bf16-mixed"
    "bf16-compile": ["--amp", "--amp-dtype", "bfloat16", "--compile"],
    "bf16-compile-bucket": ["--amp", "--amp-dtype", "bfloat16", "--compile", "--bucket"],
    "bf16-bucket": ["--amp", "--amp-dtype", "bfloat16", "--bucket"],
    "fp32-compile": ["--compile"],
    "fp32-compile-bucket": ["--compile", "--bucket"],
    "fp32-bucket": ["--bucket"],
    "fp32-pack": ["--pack"],  # padding-free batches
    "bf16-pack": ["--amp", "--amp-dtype", "bfloat16", "--pack"],
    "fp32-pack-compile": ["--pack", "--compile"],
    "bf16-pack-compile": ["--amp", "--amp-dtype", "bfloat16", "--pack", "--compile"],
    # fastpt's best single-GPU configuration: packed, bf16, the compiled step replayed as CUDA graphs
    # over a few rounded shapes, batches gathered on the GPU, one fused Adam kernel.
    "best": ["--amp", "--amp-dtype", "bfloat16", "--pack", "--pack-multiple", "256", "--compile",
             "--compile-mode", "reduce-overhead", "--data-on-device", "--fused-adam"],
    "fp16-deterministic": ["--amp", "--deterministic"],  # the cost of bitwise-repeatable runs
    "fp32-deterministic": ["--deterministic"],
    # Multi-process strategies, launched with torchrun --nproc_per_node=--nproc.
    "ddp-fp16": ["--amp", "--ddp"],
    "fsdp-fp16": ["--amp", "--fsdp"],
    "deepspeed-fp16": ["--amp", "--deepspeed"],
}
DISTRIBUTED = ("ddp-fp16", "fsdp-fp16", "deepspeed-fp16")
DEFAULT_CONFIGS = {
    # float16 autocast on most CPUs is emulated and slow; bfloat16 is the CPU's mixed precision
    # where the CPU computes it natively (see cpu_fast_precision).
    "cpu": ["fp32", "fp32-bucket", "fp32-pack", "bf16-pack", "fp32-pack-compile"],
    "cpu-fp32": ["fp32", "fp32-bucket", "fp32-pack", "fp32-pack-compile"],
    "cuda": ["fp32", "fp32-tf32", "fp16", "fp16-compile", "fp16-compile-bucket", "bf16", "bf16-pack",
             "bf16-pack-compile", "best", "fp16-deterministic"],
}
ARTICLE = {"epochs": 3, "train_reviews": 35_000}
WARMUP_STEPS = 3  # train.py's own (fastpt/loop/build.py): left out of its rates, and before a profiled window


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("command", nargs="?", default="table", choices=("table", "profile", "compile-cache"))
    p.add_argument("--model", default="tiny", help="tiny, minilm, distilbert-base-uncased (with --random-init), ...")
    p.add_argument("--random-init", action="store_true")
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=12)
    p.add_argument("--steps", type=int, default=24, help="optimiser steps per configuration (3 are warm-up)")
    p.add_argument("--configs", default=None,
                   help=f"comma-separated, from: {', '.join(CONFIGS)} (default: a set for the device)")
    p.add_argument("--nproc", type=int, default=1, help="processes for the ddp/fsdp/deepspeed configurations")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--data-dir", default=os.environ.get("FASTPT_DATA_DIR"))
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--out", default=None, help="where the table, JSON and chart go (default: scripts/results/...)")
    p.add_argument("--runs-dir", default=str(ROOT / "runs" / "bench"), help="the runs' own folders")
    p.add_argument("--run-timeout", type=float, default=900, help="seconds before one configuration is abandoned")
    p.add_argument("--deadline", type=float, default=None,
                   help="seconds for the whole benchmark: configurations that would start later are skipped")
    p.add_argument("--no-padding-report", dest="padding_report", action="store_false",
                   help="skip the real-data padding efficiency")
    p.add_argument("--no-chart", dest="chart", action="store_false")
    p.add_argument("--title", default=None, help="heading of the Markdown table")
    p.add_argument("--flags", default="", help="more train.py flags for every run, e.g. \"--fused-adam\"")
    p.add_argument("--profile-steps", type=int, default=5, help="profile: steps profiled after the warm-up")
    p.add_argument("--top", type=int, default=15, help="profile: operators shown")
    p.add_argument("--scopes", nargs="+", default=["layers", "whole"], choices=["layers", "whole"],
                   help="compile-cache: the --compile-scope values, each over a new Inductor cache")
    return p.parse_args(argv)


def device_type(choice: str) -> str:
    if choice != "auto":
        return choice
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def cpu_fast_precision() -> tuple[str, str]:
    """("bfloat16" or "float32", why): the CPU's fast training precision.

    bfloat16 is native only with AVX512-BF16 or AMX; on a CPU whose best instruction set is
    AVX2 (`torch.backends.cpu.get_cpu_capability()`), every bfloat16 operation is converted to
    and from float32 in software, so mixed precision runs slower than plain float32.
    """
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    native = any(getattr(torch.cpu, probe, lambda: False)()
                 for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    if native:
        return "bfloat16", f"CPU capability {capability} with native bfloat16"
    return "float32", f"CPU capability {capability}, no native bfloat16: bfloat16 would be emulated, so float32"


# --------------------------------------------------------------------------- running

def run_logged(command: list[str], log_path: Path, timeout: float, env: dict | None = None) -> tuple[object, float]:
    """Run one command with its output in log_path: (exit code or "timeout", wall seconds).

    The command runs in a process group of its own, killed whole on timeout: torchrun's workers
    and compiler subprocesses would otherwise outlive it, holding the GPU or a build lock.
    """
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
                                     **(env or {})})
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = "timeout"
    return rc, time.perf_counter() - start


def log_tail(log_path: Path, lines: int = 3) -> list[str]:
    return log_path.read_text(errors="replace").strip().splitlines()[-lines:]


def train_command(args, name: str, out: Path) -> list[str]:
    flags = ["--model", args.model, "--max-length", str(args.max_length), "--batch-size", str(args.batch_size),
             "--epochs", "1", "--max-steps", str(args.steps), "--log-every", str(args.steps),
             # Evaluation is not what is measured: two batches keep its (compiled) run short.
             "--val-size", str(2 * args.batch_size), "--test-size", str(2 * args.batch_size),
             "--device", args.device, "--no-progress", "--no-tensorboard", "--overwrite", "--out", str(out)]
    flags += ["--random-init"] if args.random_init else []
    flags += ["--data-dir", args.data_dir] if args.data_dir else []
    flags += ["--cache-dir", args.cache_dir] if args.cache_dir else []
    flags += cap_pack_multiple(CONFIGS[name], args.max_length)  # a rounding tail is at most one review long
    flags += shlex.split(args.flags)
    if name in DISTRIBUTED:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}"]
        return launcher + [str(ROOT / "train.py")] + flags
    return [sys.executable, str(ROOT / "train.py")] + flags


def cap_pack_multiple(flags: list[str], max_length: int) -> list[str]:
    """`flags` with `--pack-multiple N` lowered to `max_length` where N is larger (train.py refuses it)."""
    return [str(min(int(f), max_length)) if i and flags[i - 1] == "--pack-multiple" else f
            for i, f in enumerate(flags)]


def run_once(name: str, command: list[str], out: Path, timeout: float, env: dict | None = None) -> dict:
    """One run in its own process, its output in out/run.log: its results.json with `process_wall_s`,
    or {"failed": why, "process_wall_s": ...} after printing the log's end."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").unlink(missing_ok=True)  # an earlier run's numbers are not this one's
    print(f"[{name}] {shlex.join(command[1:])}", flush=True)
    rc, wall = run_logged(command, out / "run.log", timeout, env)
    shutil.rmtree(out / "checkpoints", ignore_errors=True)  # only the numbers are kept; full-size ones are large
    if rc != 0 or not (out / "results.json").exists():
        failed = "timed out" if rc == "timeout" else f"exit {rc}"
        print(f"[{name}] failed ({failed}) after {wall:.0f} s; {out / 'run.log'} ends:\n  "
              + "\n  ".join(log_tail(out / "run.log", 25)), flush=True)
        return {"failed": failed, "process_wall_s": wall}
    return dict(json.loads((out / "results.json").read_text()), process_wall_s=wall)


def run_config(args, name: str, timeout: float) -> dict:
    """One configuration's row of the table: its figures, or why there are none."""
    out = Path(args.runs_dir) / name
    r = run_once(name, train_command(args, name, out), out, timeout)
    if "failed" in r:
        return {"name": name, "failed": r["failed"], "wall_s": r["process_wall_s"]}
    print(f"[{name}] {r['samples_per_s']:.2f} samples/s, first step {r['first_step_s']:.1f} s, "
          f"{r['process_wall_s']:.0f} s in all", flush=True)
    return {"name": name, "flags": " ".join(CONFIGS[name]), "wall_s": r["process_wall_s"], **{k: r.get(k) for k in (
        "samples_per_s", "tokens_per_s", "padded_tokens_per_s", "padding_efficiency", "mfu", "data_wait_share",
        "peak_memory_bytes", "first_step_s", "compiled_graphs", "batch_shapes", "world_size", "device_name",
        "torch")}}


# --------------------------------------------------------------------------- reporting

def padding_report(args) -> dict:
    """Real tokens / computed tokens over one epoch of the real training split at 512 tokens, batch
    --batch-size, seed 123: every review padded to 512, random batches padded to their longest, --bucket;
    and for `--pack [--pack-multiple M]` (multiple, real-token share, distinct batch shapes): what rounding
    costs in work, and how many CUDA graphs (one per shape) `--compile-mode reduce-overhead` would record."""
    from fastpt.config import TrainConfig
    from fastpt.inputs import data, token_cache
    from fastpt.inputs.models import load_tokenizer
    from fastpt.speedups.bucketing import padding_efficiency

    splits, _ = token_cache.prepare_splits(args.data_dir, args.cache_dir, load_tokenizer(args.model), 512)
    train = splits["train"]

    def batches(**bucketing) -> list:
        sampler = data.TrainBatchSampler(train, args.batch_size, 0, 1, seed=123, **bucketing)
        sampler.set_epoch(0)
        return list(sampler)

    plain = batches()
    totals = [int(train.lengths[b].sum()) for b in plain]
    pack = []
    for m in (None, 64, 128, 256, 512):
        rounded = totals if m is None else [-(-t // m) * m for t in totals]
        pack.append((m, sum(totals) / sum(rounded), len(set(rounded))))
    bucketed = batches(bucket=True, bucket_multiplier=TrainConfig.bucket_multiplier)
    return {"examples": len(train), "mean_tokens": float(train.lengths.mean()), "batch_size": args.batch_size,
            "pad_to_512": padding_efficiency(train.lengths, plain, pad_to=512),
            "random_batches_to_longest": padding_efficiency(train.lengths, plain),
            "bucket": padding_efficiency(train.lengths, bucketed), "pack": pack}


def _fmt(value, spec: str, missing: str = "n/a") -> str:
    return missing if value is None else format(value, spec)


def markdown(args, rows: list[dict], padding: dict | None) -> str:
    base = next((r for r in rows if "failed" not in r), None)
    total = ARTICLE["epochs"] * ARTICLE["train_reviews"]
    lines = [f"## {args.title or 'Single-device speed-ups'}", "",
             f"model `{args.model}`{' (random init)' if args.random_init else ''}, batch {args.batch_size}, "
             f"max length {args.max_length}, {args.steps} steps per configuration (3 warm-up steps left out), "
             f"device {next((r['device_name'] for r in rows if r.get('device_name')), '?')}, "
             f"torch {next((r['torch'] for r in rows if r.get('torch')), '?')}", "",
             "| configuration | flags | samples/s | real tokens/s | padding eff. | MFU | peak memory | "
             "first step (compile) | graphs | speed-up | est. 3 x 35k train steps |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "failed" in r:
            lines.append(f"| {r['name']} | {' '.join(CONFIGS[r['name']])} | {r['failed']} | | | | | | | | |")
            continue
        speedup = r["samples_per_s"] / base["samples_per_s"] if base and base["samples_per_s"] else None
        minutes = total / r["samples_per_s"] / 60 if r["samples_per_s"] else None
        nproc = f" (x{r['world_size']})" if (r.get("world_size") or 1) > 1 else ""
        lines.append(f"| {r['name']}{nproc} | `{r['flags'] or '(none)'}` | {r['samples_per_s']:.2f} | "
                     f"{r['tokens_per_s']:.0f} | {_fmt(r['padding_efficiency'], '.3f')} | "
                     f"{_fmt(r['mfu'] and 100 * r['mfu'], '.1f')}{'%' if r['mfu'] else ''} | "
                     f"{r['peak_memory_bytes'] / 2**30:.2f} GiB | {r['first_step_s']:.1f} s | "
                     f"{_fmt(r.get('compiled_graphs'), 'd', '–')} | {_fmt(speedup, '.2f')}x | "
                     f"{_fmt(minutes, '.1f')} min |")
    lines += ["", "Speed-up: samples/s over the first row (same reviews, so it is the time ratio). "
              "Estimated time: 3 epochs x 35,000 reviews at the measured samples/s, training steps only "
              "(validation, testing and compilation excluded). MFU: model FLOPs of the real tokens "
              "(6N + 12Ldn per token of a review of n tokens) over the device's dense peak (H100/H200: 989 "
              "TFLOP/s bf16); n/a where the peak is unknown (CPUs). Graphs: graphs TorchDynamo compiled in the "
              "whole run (training and evaluation). Peak memory: CUDA allocator peak on a GPU, process peak "
              "RSS on the CPU."]
    if padding:
        lines += ["", f"Padding efficiency on the real IMDB training split ({padding['examples']:,} reviews, "
                  f"mean {padding['mean_tokens']:.0f} tokens, batch {padding['batch_size']}, 512 tokens):", "",
                  "| batches | real / computed tokens |", "|---|---:|",
                  f"| every review padded to 512 (the article) | {padding['pad_to_512']:.3f} |",
                  f"| random batches padded to their longest | {padding['random_batches_to_longest']:.3f} |",
                  f"| `--bucket` (length-grouped, padded to their longest) | {padding['bucket']:.3f} |",
                  f"| `--pack` (padding-free) | {padding['pack'][0][1]:.3f} |"]
        lines += ["", "`--pack --pack-multiple M` over one epoch of the same split: the real-token share that "
                  "rounding leaves, and the distinct batch shapes (a CUDA graph each under "
                  "`--compile-mode reduce-overhead`):", "",
                  "| rounding | real / computed tokens | distinct shapes |", "|---|---:|---:|",
                  *(f"| {'none' if m is None else f'`--pack-multiple {m}`'} | {share:.3f} | {shapes} |"
                    for m, share, shapes in padding["pack"])]
    return "\n".join(lines) + "\n"


def bar_chart(rows: list[dict], path: Path, title: str) -> bool:
    """Samples/s per configuration, with the speed-up over the first; whether the chart was written.

    matplotlib is an extra (requirements-dev.txt): without it one line says how to get the chart.
    """
    try:
        import matplotlib
    except ModuleNotFoundError:
        print(f"no chart {path.name}: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if "failed" not in r]
    if not done:
        return False
    base = done[0]["samples_per_s"]
    fig, ax = plt.subplots(figsize=(1.3 * len(done) + 2, 4))
    bars = ax.bar([r["name"] for r in done], [r["samples_per_s"] for r in done], color="tab:blue")
    for bar, r in zip(bars, done):
        ax.annotate(f"{r['samples_per_s'] / base:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("training samples / s")
    ax.set_title(title, fontsize=10)
    ax.tick_params(axis="x", labelrotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def default_configs(command: str, dev: str) -> list[str]:
    """The configurations a subcommand runs when --configs names none: packed ones for a profile or a compile."""
    precision = "bfloat16"
    if dev == "cpu":
        precision, why = cpu_fast_precision()
        print(f"note: {why}", flush=True)
    if command == "table":
        return DEFAULT_CONFIGS["cuda" if dev == "cuda" else "cpu" if precision == "bfloat16" else "cpu-fp32"]
    packed = "bf16-pack" if precision == "bfloat16" else "fp32-pack"
    return [packed if command == "profile" else f"{packed}-compile"]


def table(args, names: list[str], out: Path) -> int:
    started = time.perf_counter()
    padding = padding_report(args) if args.padding_report else None  # also builds the token cache once
    rows = []
    for name in names:
        left = None if args.deadline is None else args.deadline - (time.perf_counter() - started)
        if name in DISTRIBUTED and args.nproc < 2:
            print(f"[{name}] skipped: needs --nproc 2 or more", flush=True)
            continue
        if left is not None and left < 30:
            print(f"[{name}] skipped: the --deadline is reached", flush=True)
            rows.append({"name": name, "failed": "skipped (deadline)"})
            continue
        rows.append(run_config(args, name, args.run_timeout if left is None else min(args.run_timeout, left)))
    md = markdown(args, rows, padding)
    print("\n" + md)
    (out / "bench.md").write_text(md)
    (out / "bench.json").write_text(json.dumps({"args": vars(args), "rows": rows, "padding": padding}, indent=2) + "\n")
    charted = args.chart and bar_chart(rows, out / "bench.png",
                                       f"{args.model}, batch {args.batch_size}, length {args.max_length}")
    print(f"written: {out}/bench.md, bench.json{', bench.png' if charted else ''} "
          f"({time.perf_counter() - started:.0f} s in all)")
    failed = [r["name"] for r in rows if "failed" in r and not r["failed"].startswith("skipped")]
    if padding and padding["bucket"] < 0.97:
        print(f"error: --bucket padding efficiency {padding['bucket']:.3f} is below 0.97", file=sys.stderr)
        return 1
    return 1 if failed else 0


# --------------------------------------------------------------------------- profile and compile-cache

def report_head(title: str, args, argv: list[str], what: str) -> list[str]:
    from reproduce import machine

    return [f"# {title}", "", f"- date: {time.strftime('%Y-%m-%d %H:%M %Z')}; machine: {machine()}",
            f"- command: `python scripts/bench_single.py {shlex.join(argv)}`",
            f"- model `{args.model}`{' (random init)' if args.random_init else ''}, batch {args.batch_size}, "
            f"max length {args.max_length}; {what}", ""]


def profile(args, names: list[str], out: Path, argv: list[str]) -> int:
    """torch.profiler's top operators over a window of train.py's steps, one run per configuration."""
    lines = report_head("A training step, profiled", args, argv,
                        f"{args.profile_steps} steps profiled after {WARMUP_STEPS} warm-up steps, train mode "
                        f"(dropout on); top {args.top} operators by self time (each row: time in that operator "
                        f"itself, not in what it calls)")
    window = argparse.Namespace(**{**vars(args), "steps": WARMUP_STEPS + args.profile_steps})
    failed = False
    for name in names:
        run_dir = Path(args.runs_dir) / f"profile-{name}"
        train = train_command(window, name, run_dir)
        command = [sys.executable, str(Path(__file__).resolve()), "probe", "--start-after", str(WARMUP_STEPS),
                   "--profile-steps", str(args.profile_steps), "--top", str(args.top),
                   "--report", str(run_dir / "probe.json"), "--", *train[2:]]
        (run_dir / "probe.json").unlink(missing_ok=True)
        done = run_once(name, command, run_dir, args.run_timeout)
        probe_report = json.loads((run_dir / "probe.json").read_text()) if (run_dir / "probe.json").exists() else {}
        lines += [f"### {name}: `{' '.join([*CONFIGS[name], *shlex.split(args.flags)]) or '(none)'}`", ""]
        if not probe_report.get("profile_table"):
            failed = True
            lines += [f"failed: {probe_report.get('error') or done.get('failed')} (log: {run_dir / 'run.log'})", ""]
            continue
        lines += [f"mean step {probe_report['step_s']:.3f} s over the profiled steps (the profiler's own cost "
                  f"included)", "", "```", probe_report["profile_table"].rstrip(), "```", ""]
    print_report("\n".join(lines), out / "profile.md")
    return 1 if failed else 0


def cache_counters(cache: dict) -> str:
    """`fxgraph 3 hit / 0 miss / 0 bypass; autograd ...`, from results.json's compile_cache."""
    return "; ".join(f"{kind} " + " / ".join(f"{cache[f'{kind}_{event}']} {event}" for event in ("hit", "miss",
                                                                                                 "bypass"))
                     for kind in ("fxgraph", "autograd"))


def compile_cache(args, names: list[str], out: Path, argv: list[str]) -> int:
    """Each compiled configuration twice per scope over one new Inductor cache: the cold start, then the warm."""
    lines = report_head("torch.compile: cold and warm start, by compile scope", args, argv,
                        f"{args.steps} steps; one new, empty Inductor cache (TORCHINDUCTOR_CACHE_DIR) per "
                        "configuration and scope, filled by its cold run and read by its warm run")
    lines += ["| configuration | scope | start | compiling, torch's count (s) | calls that compiled (s) | graphs | "
              "cache counters | first step (s) | step (ms) | process wall time (s) |",
              "|---|---|---|---:|---:|---:|---|---:|---:|---:|"]
    failed = False
    with tempfile.TemporaryDirectory(prefix="fastpt-compile-") as caches:
        for name, scope in ((name, scope) for name in names for scope in args.scopes):
            env = {"TORCHINDUCTOR_CACHE_DIR": str(Path(caches) / f"{name}-{scope}")}
            for start in ("cold", "warm"):
                run_dir = Path(args.runs_dir) / f"compile-{name}-{scope}-{start}"
                r = run_once(name, [*train_command(args, name, run_dir), "--compile-scope", scope], run_dir,
                             args.run_timeout, env)
                if "failed" in r:
                    failed = True
                    lines.append(f"| {name} | {scope} | {start} | failed | | | | | | |")
                    continue
                step_ms = 1000 * args.batch_size / r["samples_per_s"] if r.get("samples_per_s") else None
                lines.append(f"| {name} | {scope} | {start} | {r['compile_torch_s']:.1f} | {r['compile_time_s']:.1f} "
                             f"| {r['compiled_graphs']} | {cache_counters(r['compile_cache'])} | "
                             f"{r['first_step_s']:.1f} | {_fmt(step_ms, '.0f', '–')} | {r['process_wall_s']:.1f} |")
    lines += ["", "A warm start that works shows hits and no misses. Step: the mean after the warm-up steps "
              "(– where the run is too short). Timings on a shared machine are rough; the counters are not."]
    print_report("\n".join(lines) + "\n", out / "compile-cache.md")
    return 1 if failed else 0


def print_report(md: str, path: Path) -> None:
    print("\n" + md)
    path.write_text(md)
    print(f"written: {path}")


# --------------------------------------------------------------------------- probe

def probe(argv: list[str]) -> int:
    """train.py in this process, with a window of its optimiser steps watched: `bench_single.py probe`.

    After optimiser step `--start-after`, `torch.cuda.set_sync_debug_mode("error")` turns any
    call that waits for the GPU into an exception for `--sync-steps` steps (the GPU check's
    steady-state test; none by default); then the profiler records `--profile-steps` steps. The hook
    is torch's global optimizer step post-hook, so train.py runs unchanged (fastpt compiles the
    model, not the optimiser step). The report (JSON): the windows, the top operators, the mean
    step time of the profiled window, and the error that ended the run, if any.
    """
    p = argparse.ArgumentParser(prog="bench_single.py probe")
    p.add_argument("--start-after", type=int, required=True)
    p.add_argument("--sync-steps", type=int, default=0)
    p.add_argument("--profile-steps", type=int, required=True)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--report", required=True)
    p.add_argument("train_args", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from train import main as train_main

    cuda = torch.cuda.is_available()
    sync_end = args.start_after + args.sync_steps
    profile_end = sync_end + args.profile_steps
    state = {"steps": 0, "profiler": None, "sync_window_done": False, "profile_started": None}
    report = {"sync_debug": "error" if cuda else "not available without CUDA (window counted only)",
              "sync_window": [args.start_after + 1, sync_end], "profile_window": [sync_end + 1, profile_end],
              "profile_sort": "self CUDA time" if cuda else "self CPU time", "error": None}

    def after_step(optimizer, *_):
        state["steps"] += 1
        step = state["steps"]
        if step == args.start_after and cuda and args.sync_steps:
            torch.cuda.set_sync_debug_mode("error")
        if step == sync_end:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
                torch.cuda.synchronize()  # the window's clock starts with the GPU idle
            state["sync_window_done"] = True
            kinds = torch.profiler.ProfilerActivity
            state["profiler"] = torch.profiler.profile(activities=[kinds.CPU, kinds.CUDA] if cuda else [kinds.CPU])
            state["profiler"].__enter__()
            state["profile_started"] = time.perf_counter()
        if step == profile_end and state["profiler"] is not None:
            if cuda:
                torch.cuda.synchronize()
            report["step_s"] = (time.perf_counter() - state["profile_started"]) / args.profile_steps
            prof, state["profiler"] = state["profiler"], None
            prof.__exit__(None, None, None)
            report["profile_table"] = profile_table(prof, cuda, args.top)

    hook = register_optimizer_step_post_hook(after_step)
    try:
        rc = train_main(args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args)
    except Exception as e:  # a synchronising call inside the window lands here
        frames = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in traceback.extract_tb(e.__traceback__)
                  if "site-packages" not in f.filename][-3:]
        report["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]} at {' <- '.join(reversed(frames))}"
        rc = 1
    finally:
        hook.remove()  # torch's hook is global: the process's later optimisers are not watched
        if state["profiler"] is not None:  # the run ended inside the profiled window
            state["profiler"].__exit__(None, None, None)
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
    report.update(steps=state["steps"], passed=rc == 0 and state["sync_window_done"] and not report["error"])
    Path(args.report).write_text(json.dumps(report, indent=2))
    return rc


def profile_table(prof, cuda: bool, top: int) -> str:
    averages = prof.key_averages()
    for key in (("self_device_time_total", "self_cuda_time_total") if cuda else ("self_cpu_time_total",)):
        try:
            return averages.table(sort_by=key, row_limit=top, max_name_column_width=70)
        except (AttributeError, KeyError, ValueError):
            continue
    return averages.table(row_limit=top)


# --------------------------------------------------------------------------- command line

def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["probe"]:
        return probe(argv[1:])
    args = parse_args(argv)
    dev = device_type(args.device)
    names = args.configs.split(",") if args.configs else default_configs(args.command, dev)
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        print(f"error: unknown configuration(s) {', '.join(unknown)}; choose from {', '.join(CONFIGS)}",
              file=sys.stderr)
        return 2
    if args.command != "table" and set(names) & set(DISTRIBUTED):
        print(f"error: {args.command} runs one process: leave out {', '.join(set(names) & set(DISTRIBUTED))}",
              file=sys.stderr)
        return 2
    uncompiled = [n for n in names if "--compile" not in CONFIGS[n]]
    if args.command == "compile-cache" and uncompiled:
        print(f"error: compile-cache needs compiled configurations, not {', '.join(uncompiled)}", file=sys.stderr)
        return 2
    out = Path(args.out or ROOT / "scripts" / "results" / f"bench_single-{dev}-{args.model.split('/')[-1]}")
    out.mkdir(parents=True, exist_ok=True)
    if args.command == "profile":
        return profile(args, names, out, argv)
    if args.command == "compile-cache":
        return compile_cache(args, names, out, argv)
    return table(args, names, out)


if __name__ == "__main__":
    sys.exit(main())
