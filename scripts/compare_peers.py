"""fastpt against Lightning and accelerate: same workload, same machine, interleaved runs.

Run it to see what fastpt saves or costs against the frameworks it replaces, on your machine; after
a change to fastpt, `--before COMMIT` puts the earlier train.py beside it.

    python scripts/compare_peers.py                       # preset cpu: MiniLM, fp32 / bf16 / 2-process DDP
    python scripts/compare_peers.py --preset tiny         # the tiny model: framework overhead per step
    python scripts/compare_peers.py --preset article --nproc 4 --configs fp16,ddp-fp16   # GPUs
    python scripts/compare_peers.py --preset goal --frameworks fastpt,lightning --repeats 1
        # 512 tokens: fastpt's own flags (--pack, --fused-adam, --compile) against Lightning at the same precision
    python scripts/compare_peers.py --preset goal --frameworks fastpt,lightning --before 9bc6df2 --repeats 1
        # the same, with fastpt as it was at an earlier commit beside it (row "fastpt-before")

Configurations named after a precision alone give every framework the same work; those with more
in their name (fp32-pack, bf16-pack-compile) add fastpt's own speed-ups, and the peers run the
plain precision once per repeat, shared by all of them.

For each configuration, fastpt's `train.py`, the Lightning reference (scripts/peers/lightning_ref.py)
and the accelerate reference (scripts/peers/accelerate_ref.py) train on the same inputs (fastpt's
data split, model, tokenisation, padding and batches, seed 123, Adam 5e-5); single-process
configurations also run the bare PyTorch loop (scripts/peers/bare_loop.py), the floor for
per-step overhead. Runs are interleaved (A B C A B C ...) so that machine drift hits every
framework alike; each number in the table is the median over --repeats.

All three measure time the same way (fastpt's): `train_time_s` = training + validation of
every epoch, without setup, checkpoint writing or the test; samples/s over the training
steps after 3 warm-up steps. "process wall" is the whole process, imports included.

`--before COMMIT` adds the row `fastpt-before`: this repository's `train.py` as it was at COMMIT
(`git archive` into the runs folder), run with the same flags, interleaved with the others: a
before/after table measured on one machine in one run. Every fastpt run with `--compile` starts
from an empty Inductor cache of its own, so compilation is always counted in full; `-warm`
configurations (bf16-pack-compile-warm) first run the same command once, untimed, over that cache,
and time the second start: what a user's next run on the same machine costs.

Lightning and accelerate are optional: `pip install '.[peers]'` (or `-r requirements-peers.txt`).
Without one, its rows are reported as not run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reproduce import ROOT, cpu_count, data_args, default_data_dir, machine  # noqa: E402

FRAMEWORKS = ("fastpt", "fastpt-before", "lightning", "accelerate", "bare")
PEER_SCRIPTS = {"lightning": "scripts/peers/lightning_ref.py", "accelerate": "scripts/peers/accelerate_ref.py",
                "bare": "scripts/peers/bare_loop.py"}


@dataclass(frozen=True)
class Config:
    key: str
    fastpt_flags: tuple
    precision: str  # the peers' --precision
    multi_process: bool = False
    warm_compile: bool = False  # fastpt's compiled run times a second start, over the cache a first one filled


CONFIGS = {
    "fp32": Config("fp32", (), "32"),
    "bf16": Config("bf16", ("--amp", "--amp-dtype", "bfloat16"), "bf16"),
    "fp16": Config("fp16", ("--amp",), "16"),
    "ddp": Config("ddp", ("--ddp",), "32", True),
    "ddp-bf16": Config("ddp-bf16", ("--amp", "--amp-dtype", "bfloat16", "--ddp"), "bf16", True),
    "ddp-fp16": Config("ddp-fp16", ("--amp", "--ddp"), "16", True),
    # fastpt's own speed-ups on top, the peers at the same precision (their runs are shared with the
    # plain configuration's: one Lightning bf16 run serves bf16, bf16-pack and bf16-pack-compile)
    "fp32-pack": Config("fp32-pack", ("--pack",), "32"),
    "fp32-pack-compile": Config("fp32-pack-compile", ("--pack", "--compile"), "32"),
    "bf16-pack": Config("bf16-pack", ("--pack", "--amp", "--amp-dtype", "bfloat16", "--fused-adam"), "bf16"),
    "bf16-pack-compile": Config("bf16-pack-compile",
                                ("--pack", "--amp", "--amp-dtype", "bfloat16", "--fused-adam", "--compile"), "bf16"),
    "bf16-pack-compile-warm": Config("bf16-pack-compile-warm",
                                     ("--pack", "--amp", "--amp-dtype", "bfloat16", "--fused-adam", "--compile"),
                                     "bf16", warm_compile=True),
}

# Workload flags, spelt the same for train.py and the peers.
PRESETS = {
    "cpu": ("pretrained MiniLM-L6, first 288/96/240 reviews, 128 tokens, batch 12, 2 epochs",
            ("--model", "minilm", "--max-length", "128", "--batch-size", "12", "--epochs", "2",
             "--train-size", "288", "--val-size", "96", "--test-size", "240"), ("fp32", "bf16", "ddp")),
    "tiny": ("2-layer 64-wide DistilBERT (random init), first 1200/120/240 reviews, 64 tokens, batch 12, 1 epoch: "
             "framework overhead dominates", ("--model", "tiny", "--max-length", "64", "--batch-size", "12",
                                              "--epochs", "1", "--train-size", "1200", "--val-size", "120",
                                              "--test-size", "240"), ("fp32", "bf16", "ddp")),
    "smoke": ("tiny model on tiny data (tests only)",
              ("--model", "tiny", "--max-length", "32", "--batch-size", "8", "--epochs", "2",
               "--train-size", "64", "--val-size", "16", "--test-size", "32"), ("fp32",)),
    "goal": ("pretrained MiniLM-L6, first 400/100/200 reviews, the articles' 512 tokens, batch 12, 1 epoch",
             ("--model", "minilm", "--max-length", "512", "--batch-size", "12", "--epochs", "1",
              "--train-size", "400", "--val-size", "100", "--test-size", "200"),
             ("fp32", "fp32-pack", "fp32-pack-compile", "bf16", "bf16-pack", "bf16-pack-compile",
              "bf16-pack-compile-warm")),
    "article": ("the articles' run: distilbert-base-uncased, 512 tokens, batch 12, 3 epochs, full split",
                ("--model", "distilbert-base-uncased", "--max-length", "512", "--epochs", "3"),
                ("fp32", "fp16", "ddp-fp16")),
}


# Threads per process where the cores are not simply split between processes: on the tiny model a
# second thread buys little and makes every step hostage to any other load on the machine.
THREADS = {"tiny": 1, "smoke": 1}


@dataclass
class Job:
    config: Config
    framework: str
    repeat: int
    command: list
    out: Path
    procs: int
    threads: Optional[int] = None  # OMP threads per process; None: the cores split between processes
    results: Optional[dict] = None
    wall_s: Optional[float] = None
    error: str = ""
    same_as: Optional["Job"] = None  # a peer's run shared by configurations that differ only in fastpt's flags
    cwd: Path = ROOT  # the tree the command runs in (fastpt-before: the earlier commit's)


def is_fastpt(framework: str) -> bool:
    return framework in ("fastpt", "fastpt-before")


def launcher(framework: str, procs: int, on_cuda: bool) -> list:
    script = "train.py" if is_fastpt(framework) else PEER_SCRIPTS[framework]
    if procs == 1:
        return [sys.executable, script]
    if framework == "accelerate" and on_cuda:
        return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", f"--num_processes={procs}", script]
    # On a CPU, `accelerate launch --cpu --num_processes N` starts one process (multi-CPU needs MPI),
    # so accelerate runs under torchrun there, which it supports; so do fastpt and Lightning.
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}", script]


def earlier_tree(commit: str, runs_dir: Path) -> Path:
    """This repository's files at `commit`, unpacked under runs_dir (once per commit)."""
    sha = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}"], cwd=ROOT,
                         capture_output=True, text=True).stdout.strip()
    if not sha:
        raise ValueError(f"--before {commit!r} is not a commit of this repository")
    tree = runs_dir / f"fastpt-{sha[:12]}"
    if not (tree / "train.py").exists():
        tree.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", sha], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def plan(preset: str, config_keys: list, frameworks: list, repeats: int, nproc: int, data_args: list,
         runs_dir: Path, on_cuda: bool, before: Optional[Path] = None) -> list:
    """Jobs in interleaved order: for each repeat, for each configuration, every framework in turn."""
    workload = list(PRESETS[preset][1])
    jobs = []
    threads = THREADS.get(preset)
    for repeat in range(repeats):
        peer_runs = {}  # (framework, precision, processes): the job that runs it in this repeat
        for key in config_keys:
            config = CONFIGS[key]
            procs = nproc if config.multi_process else 1
            for framework in frameworks:
                if framework == "bare" and config.multi_process:
                    continue
                out = runs_dir / key / framework / f"rep{repeat}"
                extra = (list(config.fastpt_flags) + ["--overwrite", "--no-progress"] if is_fastpt(framework)
                         else ["--precision", config.precision])
                command = [*launcher(framework, procs, on_cuda), *workload, *data_args, *extra, "--out", str(out)]
                job = Job(config, framework, repeat, command, out, procs, threads,
                          cwd=before if framework == "fastpt-before" else ROOT)
                if not is_fastpt(framework):
                    job.same_as = peer_runs.setdefault((framework, config.precision, procs), job)
                    job.same_as = None if job.same_as is job else job.same_as
                jobs.append(job)
    return jobs


def execute(job: Job) -> None:
    if job.same_as is not None:  # run already, for another configuration (interleaving keeps it earlier)
        job.results, job.wall_s, job.error = job.same_as.results, job.same_as.wall_s, job.same_as.error
        print(f"[{job.config.key} {job.framework} #{job.repeat + 1}] the {job.same_as.config.key} run's results",
              flush=True)
        return
    env = dict(os.environ, HF_HUB_OFFLINE=os.environ.get("HF_HUB_OFFLINE", "1"), TOKENIZERS_PARALLELISM="false")
    if "OMP_NUM_THREADS" not in os.environ:  # the same for every framework
        env["OMP_NUM_THREADS"] = str(job.threads or max(1, cpu_count() // job.procs))
    (job.out / "results.json").unlink(missing_ok=True)
    job.out.mkdir(parents=True, exist_ok=True)
    if "--compile" in job.command:  # a cold start every time: compilation counted in full
        shutil.rmtree(job.out / "inductor-cache", ignore_errors=True)
        env["TORCHINDUCTOR_CACHE_DIR"] = str(job.out / "inductor-cache")
        if job.config.warm_compile:  # ... unless the configuration asks for a warm one: a first, untimed start fills it
            warm_up = [*job.command[:-1], str(job.out / "warm-up")]
            print(f"[{job.config.key} {job.framework} #{job.repeat + 1}] warm-up (untimed): {shlex.join(warm_up)}",
                  flush=True)
            with open(job.out / "warm-up.log", "w") as log:
                subprocess.call(warm_up, cwd=job.cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
    print(f"[{job.config.key} {job.framework} #{job.repeat + 1}] {shlex.join(job.command)}", flush=True)
    start = time.perf_counter()
    with open(job.out / "run.log", "w") as log:
        code = subprocess.call(job.command, cwd=job.cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
    job.wall_s = time.perf_counter() - start
    if code == 0 and (job.out / "results.json").exists():
        job.results = json.loads((job.out / "results.json").read_text())
        print(f"    {job.results['train_time_s']:.1f} s, {job.results['samples_per_s']:.1f} samples/s, "
              f"process {job.wall_s:.0f} s", flush=True)
    else:
        job.error = f"exit {code}, see {job.out / 'run.log'}"
        print(f"    failed: {job.error}", flush=True)


# --------------------------------------------------------------------------- the report

def median_of(jobs: list, field: str) -> Optional[float]:
    values = [j.results[field] for j in jobs if j.results and j.results.get(field) is not None]
    return statistics.median(values) if values else None


def summarise(jobs: list, batch_size: int) -> dict:
    """{config: {framework: medians}} over repeats."""
    out = {}
    for job in jobs:
        out.setdefault(job.config.key, {}).setdefault(job.framework, []).append(job)
    summary = {}
    for key, by_framework in out.items():
        summary[key] = {}
        for framework, group in by_framework.items():
            sps = median_of(group, "samples_per_s")
            procs = group[0].procs
            summary[key][framework] = {
                "runs": sum(1 for j in group if j.results), "of": len(group),
                "shared_from": group[0].same_as.config.key if group[0].same_as else None,
                "errors": [j.error for j in group if j.error],
                "train_time_s": median_of(group, "train_time_s"),
                "train_times": [round(j.results["train_time_s"], 1) for j in group if j.results],
                "wall_s": (statistics.median([j.wall_s for j in group if j.results])
                           if any(j.results for j in group) else None),
                "samples_per_s": sps,
                "step_ms": 1000 * batch_size * procs / sps if sps else None,
                "mfu": median_of(group, "mfu"),
                "test_acc": median_of(group, "test_acc"),
                "test_examples": median_of(group, "test_examples"),
            }
    return summary


def _f(v, spec: str) -> str:
    return "–" if v is None else format(v, spec)


def config_table(key: str, rows: dict) -> list:
    fast = rows.get("fastpt", {})
    bare = rows.get("bare", {})
    config = CONFIGS[key]
    lines = [f"### {key}", "", f"fastpt's flags: `{' '.join(config.fastpt_flags) or '(none)'}`; the peers: "
             f"`--precision {config.precision}`.", "",
             "| framework | train time (s) | runs | time / fastpt | samples/s | fastpt speed / this | "
             "ms per step | MFU | overhead vs bare loop (ms/step) | test acc | process wall (s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for framework in FRAMEWORKS:
        if framework not in rows:
            continue
        r = rows[framework]
        if not r["runs"]:
            lines.append(f"| {framework} | not run ({'; '.join(r['errors']) or 'skipped'}) | 0/{r['of']} "
                         f"| | | | | | | | |")
            continue
        time_ratio = r["train_time_s"] / fast["train_time_s"] if fast.get("train_time_s") else None
        speed_ratio = (fast["samples_per_s"] / r["samples_per_s"]
                       if fast.get("samples_per_s") and r["samples_per_s"] else None)
        overhead = (r["step_ms"] - bare["step_ms"]) if bare.get("step_ms") and r["step_ms"] else None
        overhead_pct = 100 * overhead / bare["step_ms"] if overhead is not None else None
        acc = "– (no test)" if framework == "bare" else _f(100 * r["test_acc"], ".2f") + "%"
        name = f"{framework} (the {r['shared_from']} run)" if r.get("shared_from") else framework
        lines.append(
            f"| {name} | {r['train_time_s']:.1f} ({', '.join(map(str, r['train_times']))}) "
            f"| {r['runs']}/{r['of']} "
            f"| {_f(time_ratio, '.3f')} | {_f(r['samples_per_s'], '.1f')} | {_f(speed_ratio, '.3f')} "
            f"| {_f(r['step_ms'], '.1f')} | {_f(r['mfu'] and 100 * r['mfu'], '.1f')}{'%' if r['mfu'] else ''} | "
            + ("–" if overhead is None else f"{overhead:+.1f} ({overhead_pct:+.0f}%)")
            + f" | {acc} | {_f(r['wall_s'], '.0f')} |")
    lines += ["", verdict(rows), ""]
    return lines


def verdict(rows: dict) -> str:
    """fastpt as fast as both peers? Test accuracies within sampling noise?"""
    fast = rows.get("fastpt", {})
    if not fast.get("runs"):
        return "No fastpt result: no verdict."
    parts = []
    for peer in ("lightning", "accelerate"):
        r = rows.get(peer)
        if not r or not r["runs"]:
            continue
        faster = fast["train_time_s"] <= r["train_time_s"] and fast["samples_per_s"] >= r["samples_per_s"]
        n = fast["test_examples"] or 1
        p = (fast["test_acc"] + r["test_acc"]) / 2
        noise = 2 * math.sqrt(2 * p * (1 - p) / n)  # two standard errors of a difference of two accuracies
        diff = fast["test_acc"] - r["test_acc"]
        parts.append(f"vs {peer}: fastpt {'at least as fast' if faster else 'SLOWER'} "
                     f"(time x{fast['train_time_s'] / r['train_time_s']:.3f}, "
                     f"samples/s x{fast['samples_per_s'] / r['samples_per_s']:.3f}); "
                     f"accuracy difference {100 * diff:+.2f} points, "
                     f"{'within' if abs(diff) <= noise else 'OUTSIDE'} noise (±{100 * noise:.2f} at n={int(n)})")
    return "Verdict: " + ("; ".join(parts) if parts else "no peer results.")


def report(summary: dict, preset: str, argv: list, repeats: int, nproc: int, versions: dict,
           before: Optional[Path] = None) -> str:
    lines = [f"# fastpt vs Lightning vs accelerate, preset `{preset}`", "",
             f"- date: {time.strftime('%Y-%m-%d %H:%M %Z')}",
             f"- machine: {machine()}",
             f"- command: `python scripts/compare_peers.py {shlex.join(argv)}`",
             f"- workload: {PRESETS[preset][0]}: `{' '.join(PRESETS[preset][1])}`",
             f"- versions: {', '.join(f'{k} {v}' for k, v in versions.items())}",
             *([f"- fastpt-before: train.py at {described(before)}; fastpt: at {described(ROOT)}"] if before else []),
             "- every fastpt `--compile` run starts from an empty Inductor cache of its own: "
             "compilation counted in full",
             f"- {repeats} repeat(s), interleaved; each cell is the median (single runs in brackets); "
             f"DDP rows: {nproc} processes; CPU threads per process (same for every framework): "
             f"{os.environ.get('OMP_NUM_THREADS') or THREADS.get(preset) or 'cores / processes'}.",
             "- train time: training + validation of all epochs (fastpt's `train_time_s`, measured the same way in "
             "every script); samples/s: training steps after 3 warm-up steps; ms per step = global batch / samples/s; "
             "overhead = ms per step minus the bare loop's (same precision, same batches, no validation); "
             "MFU: useful model FLOP/s on real tokens over the device's peak at the run's precision (on a CPU the "
             "matmul peak measured by fastpt/monitoring/peak.py, the same figure for every framework).",
             ""]
    for key, rows in summary.items():
        lines += config_table(key, rows)
    return "\n".join(lines)


def described(tree: Path) -> str:
    """`9bc6df2 (2026-12-02)` for an unpacked commit; the working tree's HEAD (and `+ changes`) for ROOT."""
    if tree != ROOT:
        sha = tree.name.split("-")[1]
        date = subprocess.run(["git", "log", "-1", "--format=%cs", sha], cwd=ROOT, capture_output=True, text=True)
        return f"commit {sha[:7]} ({date.stdout.strip()})"
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    return f"commit {head.stdout.strip()}" + (" with uncommitted changes" if dirty else "")


def versions() -> dict:
    import torch
    out = {"torch": torch.__version__}
    for name in ("lightning", "accelerate", "transformers"):
        if importlib.util.find_spec(name):
            out[name] = __import__(name).__version__
    return out


# --------------------------------------------------------------------------- main

def build_parser() -> argparse.ArgumentParser:
    import torch
    on_cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="article" if on_cuda else "cpu", choices=sorted(PRESETS))
    p.add_argument("--configs", default=None,
                   help=f"comma-separated, from {', '.join(CONFIGS)} (default: the preset's)")
    p.add_argument("--frameworks", default=",".join(f for f in FRAMEWORKS if f != "fastpt-before"),
                   help="comma-separated (fastpt-before comes with --before)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--nproc", type=int, default=None, help="processes for DDP configurations (default: GPUs, or 2)")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--runs-dir", default=None, help="default: runs/compare-peers-<preset>")
    p.add_argument("--report-dir", default=str(ROOT / "scripts" / "results"))
    p.add_argument("--before", default=None, metavar="COMMIT",
                   help="also run train.py as it was at COMMIT (frameworks gain fastpt-before)")
    return p


def main(argv=None) -> int:
    import torch

    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    on_cuda = torch.cuda.is_available()
    nproc = args.nproc or (torch.cuda.device_count() if on_cuda else 2)
    config_keys = args.configs.split(",") if args.configs else list(PRESETS[args.preset][2])
    frameworks = args.frameworks.split(",")
    unknown = [k for k in config_keys if k not in CONFIGS] + [f for f in frameworks if f not in FRAMEWORKS]
    if unknown or "fastpt" not in frameworks or args.repeats < 1:
        print(f"error: unknown configurations/frameworks {unknown}, or fastpt missing, or --repeats < 1",
              file=sys.stderr)
        return 2
    for peer in ("lightning", "accelerate"):
        if peer in frameworks and importlib.util.find_spec(peer) is None:
            print(f"note: {peer} is not installed (pip install '.[peers]'); its rows are left out", file=sys.stderr)
            frameworks.remove(peer)
    data_dir = args.data_dir or default_data_dir()
    data_flags = data_args(data_dir, args.cache_dir)
    runs_dir = Path(args.runs_dir or ROOT / "runs" / f"compare-peers-{args.preset}").resolve()
    before = None
    if args.before:
        try:
            before = earlier_tree(args.before, runs_dir)
        except (ValueError, subprocess.CalledProcessError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if "fastpt-before" not in frameworks:
            frameworks.insert(1, "fastpt-before")
    elif "fastpt-before" in frameworks:
        print("error: the framework fastpt-before needs --before COMMIT", file=sys.stderr)
        return 2
    jobs = plan(args.preset, config_keys, frameworks, args.repeats, nproc, data_flags, runs_dir, on_cuda, before)
    for job in jobs:
        execute(job)
    workload = PRESETS[args.preset][1]
    batch_size = int(workload[workload.index("--batch-size") + 1]) if "--batch-size" in workload else 12
    summary = summarise(jobs, batch_size)
    md = report(summary, args.preset, argv, args.repeats, nproc, versions(), before)
    report_dir = Path(args.report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    name = (f"compare-peers-{args.preset}" + ("-bf16" if all(k.startswith("bf16") for k in config_keys) else "")
            + (f"-before-{before.name.split('-')[1][:7]}" if before else ""))  # bf16 tables beside the float32 ones
    (report_dir / f"{name}.md").write_text(md)
    (runs_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(md)
    print(f"written: {report_dir / f'{name}.md'}")
    return 0 if all(job.results for job in jobs) else 1


if __name__ == "__main__":
    sys.exit(main())
