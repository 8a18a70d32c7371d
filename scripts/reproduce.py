"""The articles' ladder of speed-ups, run with fastpt, tabulated beside the articles' own figures.

Run it to reproduce the articles' table on your own hardware (GPUs: --preset article), or on a CPU
to see the ladder's ratios there (--preset cpu).

    python scripts/reproduce.py --preset cpu              # MiniLM on a subset of IMDB, ~25 min on 2 cores
    python scripts/reproduce.py --preset article --nproc 4  # full size, on GPUs
    python scripts/reproduce.py --preset smoke --data-dir DIR  # tiny model, a minute (tests)

Each configuration is a real `train.py` run in its own process (under torchrun where it needs
several), in the articles' order: plain fp32, + best checkpoint, + mixed precision,
+ torch.compile, + DDP, + DeepSpeed ZeRO-2, + FSDP, then fastpt's additions (length bucketing,
bf16, fused Adam, padding-free packing, the single-device fast path, and everything together).
Each run's results.json is collected into one
Markdown table beside the articles' reported times and accuracies, with speed-ups over each
side's own baseline, since only ratios compare across hardware; and a PNG chart.

Resumable: a configuration whose results.json exists, written by the same command, is
skipped unless --force. A configuration that fails is reported as failed, with its log, and
the ladder goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent

# The articles' figures: DistilBERT on IMDB, 35k/5k/10k, 3 epochs, A100 GPUs (minutes, test accuracy %).
ARTICLE_BASELINE_MIN = 22.63


@dataclass(frozen=True)
class Rung:
    key: str
    label: str
    flags: tuple  # train.py flags; "{amp}" / "{fast}" expand to the preset's mixed-precision / fast-path flags
    multi_process: bool = False
    article_min: Optional[float] = None
    article_acc: Optional[float] = None
    article_note: str = ""


LADDER = (
    Rung("baseline", "plain PyTorch, fp32 (tests the last epoch)", ("--test-on", "last"), False, 22.63, 91.43),
    Rung("best-ckpt", "+ best checkpoint (Lightning Trainer)", (), False, 23.09, 92.0),
    Rung("amp", "+ mixed precision", ("{amp}",), False, 8.75, 92.2),
    Rung("compile", "+ torch.compile", ("{amp}", "--compile")),
    Rung("ddp", "+ DDP", ("{amp}", "--ddp"), True, 3.52, 93.1, "4 GPUs"),
    Rung("deepspeed", "+ DeepSpeed ZeRO-2", ("{amp}", "--deepspeed", "--zero-stage", "2"), True, 3.15, 92.6, "4 GPUs"),
    Rung("fsdp", "+ FSDP", ("{amp}", "--fsdp"), True, 3.62, None, "4 GPUs"),
    Rung("bucket", "fastpt: + length bucketing", ("{amp}", "--bucket")),
    Rung("bf16", "fastpt: + bf16", ("--amp", "--amp-dtype", "bfloat16", "--bucket")),
    Rung("fused-adam", "fastpt: + fused Adam", ("--amp", "--amp-dtype", "bfloat16", "--bucket", "--fused-adam")),
    Rung("pack", "fastpt: + packing instead of bucketing",
         ("--amp", "--amp-dtype", "bfloat16", "--pack", "--fused-adam")),
    Rung("fast", "fastpt: single-device fast path",
         ("--amp", "--amp-dtype", "bfloat16", "--pack", "--fused-adam", "--compile", "--data-on-device", "{fast}")),
    Rung("all", "fastpt: all together, multi-process",
         ("--amp", "--amp-dtype", "bfloat16", "--bucket", "--fused-adam", "--compile", "--ddp"), True),
)


@dataclass(frozen=True)
class Preset:
    description: str
    flags: tuple  # workload flags passed to every train.py run
    amp: tuple  # what "+ mixed precision" means on this hardware
    fast: tuple = ()  # the fast path's hardware-specific flags (CUDA graphs need a GPU)
    skip: dict = field(default_factory=dict)  # rung key -> why it is left out


PRESETS = {
    "article": Preset("the articles' run: distilbert-base-uncased, 512 tokens, batch 12, 3 epochs, full split",
                      ("--model", "distilbert-base-uncased", "--max-length", "512", "--epochs", "3"),
                      ("--amp",), ("--compile-mode", "reduce-overhead", "--pack-multiple", "256")),
    "cpu": Preset("pretrained MiniLM-L6 on the first 480/160/320 reviews of the split, 128 tokens, batch 12, "
                  "2 epochs; bfloat16 autocast for mixed precision (float16 on a CPU is emulated and slow)",
                  ("--model", "minilm", "--max-length", "128", "--epochs", "2", "--train-size", "480",
                   "--val-size", "160", "--test-size", "320"),
                  ("--amp", "--amp-dtype", "bfloat16")),
    "smoke": Preset("2-layer 64-wide DistilBERT (random init), 32 tokens, batch 8, 2 epochs (tests only)",
                    ("--model", "tiny", "--max-length", "32", "--batch-size", "8", "--epochs", "2",
                     "--train-size", "64", "--val-size", "16", "--test-size", "32"),
                    ("--amp", "--amp-dtype", "bfloat16")),
}


@dataclass
class Run:
    rung: Rung
    command: list
    out: Path
    procs: int
    status: str = "not run"  # done | skipped (cached) | failed | left out
    results: Optional[dict] = None
    wall_s: Optional[float] = None


# --------------------------------------------------------------------------- commands

def expand(rung: Rung, preset: Preset) -> list:
    flags = []
    for flag in rung.flags:
        flags.extend(preset.amp if flag == "{amp}" else preset.fast if flag == "{fast}" else [flag])
    return flags


def plan(preset_name: str, nproc: int, data_args: list, runs_dir: Path, only=None) -> list:
    """One Run per rung, duplicates of an earlier rung's flags dropped (e.g. bf16 where AMP is bf16)."""
    preset = PRESETS[preset_name]
    runs, seen = [], set()
    for rung in LADDER:
        if only and rung.key not in only:
            continue
        flags = expand(rung, preset)
        procs = nproc if rung.multi_process else 1
        identity = (tuple(sorted(flags)), procs)
        out = runs_dir / rung.key
        launcher = [sys.executable, "train.py"]
        if procs > 1:
            launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}",
                        "train.py"]
        command = [*launcher, *preset.flags, *data_args, *flags, "--out", str(out), "--overwrite", "--no-progress"]
        run = Run(rung, command, out, procs)
        if identity in seen:
            run.status = "left out (same flags as an earlier row on this preset)"
        elif rung.key in preset.skip:
            run.status = f"left out ({preset.skip[rung.key]})"
        elif rung.multi_process and nproc < 2:
            run.status = "left out (--nproc 1)"
        seen.add(identity)
        runs.append(run)
    return runs


def thread_env(procs: int) -> dict:
    """Split the CPU cores between processes, so two processes on two cores take one each."""
    env = dict(os.environ, HF_HUB_OFFLINE=os.environ.get("HF_HUB_OFFLINE", "1"), TOKENIZERS_PARALLELISM="false")
    if "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(max(1, cpu_count() // procs))
    return env


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def execute(run: Run, force: bool) -> None:
    """Run one configuration unless the same command already left its results."""
    stamp = run.out / "reproduce.json"
    results_path = run.out / "results.json"
    if not force and results_path.exists() and stamp.exists():
        if json.loads(stamp.read_text()).get("command") == run.command[1:]:
            run.results = json.loads(results_path.read_text())
            run.status = "done (cached)"
            print(f"[{run.rung.key}] results exist, skipped (use --force to rerun)")
            return
    run.out.mkdir(parents=True, exist_ok=True)
    print(f"[{run.rung.key}] {shlex.join(run.command)}", flush=True)
    start = time.perf_counter()
    with open(run.out / "train.log", "w") as log:
        code = subprocess.call(run.command, cwd=ROOT, env=thread_env(run.procs), stdout=log, stderr=subprocess.STDOUT)
    run.wall_s = time.perf_counter() - start
    if code == 0 and results_path.exists():
        run.results = json.loads(results_path.read_text())
        run.status = "done"
        # Written only after success: the command without the interpreter path, which may differ by venv.
        stamp.write_text(json.dumps({"command": run.command[1:], "process_wall_s": run.wall_s}))
        print(f"[{run.rung.key}] done in {run.wall_s:.0f} s: test acc {run.results['test_acc']:.4f}, "
              f"train time {run.results['train_time_s']:.1f} s", flush=True)
    else:
        run.status = f"failed (exit {code}, see {run.out / 'train.log'})"
        print(f"[{run.rung.key}] {run.status}", flush=True)
        tail = (run.out / "train.log").read_text(errors="replace").strip().splitlines()[-3:]
        for line in tail:
            print(f"    {line}")


# --------------------------------------------------------------------------- the report

def _fmt(value, spec: str, none: str = "–") -> str:
    return none if value is None else format(value, spec)


def _memory(n: Optional[int]) -> str:
    if not n:
        return "–"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def table(runs: list) -> str:
    """The Markdown table: ours beside the articles', speed-ups over each side's baseline."""
    base = next((r.results for r in runs if r.rung.key == "baseline" and r.results), None)
    header = ("| configuration | procs | time (min) | speed-up | test acc | samples/s | tokens/s | MFU | peak memory "
              "| article time (min) | article speed-up | article acc |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for run in runs:
        r, a = run.results, run.rung
        article = [_fmt(a.article_min, ".2f") + (f" ({a.article_note})" if a.article_note and a.article_min else ""),
                   _fmt(ARTICLE_BASELINE_MIN / a.article_min if a.article_min else None, ".2f", "–") +
                   ("x" if a.article_min else ""),
                   _fmt(a.article_acc, ".2f") + ("%" if a.article_acc else "")]
        if r is None:
            lines.append(f"| {a.label} | {run.procs} | {run.status} | | | | | | | " + " | ".join(article) + " |")
            continue
        speedup = base["train_time_s"] / r["train_time_s"] if base and r["train_time_s"] else None
        cells = [a.label, str(r.get("world_size", run.procs)), f"{r['train_time_s'] / 60:.2f}",
                 _fmt(speedup, ".2f") + ("x" if speedup else ""), f"{100 * r['test_acc']:.2f}%",
                 f"{r['samples_per_s']:.1f}", f"{r['tokens_per_s']:.0f}",
                 _fmt(100 * r["mfu"] if r.get("mfu") is not None else None, ".1f") + ("%" if r.get("mfu") else ""),
                 _memory(r.get("peak_memory_bytes")), *article]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def machine() -> str:
    import torch

    if torch.cuda.is_available():
        gpus = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    else:
        gpus = "no GPU"
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{cpu}, {cpu_count()} cores ({cpu_flags()}); {gpus}; {platform.system()} {platform.release()}; "
            f"torch {torch.__version__}")


def cpu_flags() -> str:
    """The CPU's vector and matrix units as Linux names them, and what torch's CPU kernels use:
    `flags avx2 fma f16c, no avx512 / amx; torch's CPU capability AVX2` (bfloat16 emulated there)."""
    import torch

    try:
        flags = next(line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = []
    shown = [f for f in flags if f in ("avx2", "fma", "f16c") or f.startswith(("avx512", "amx", "avx_vnni"))]
    missing = [unit for unit in ("avx512", "amx") if not any(f.startswith(unit) for f in flags)]
    return (f"flags {' '.join(shown) or 'unknown'}" + (f", no {' / '.join(missing)}" if missing and flags else "")
            + f"; torch's CPU capability {torch.backends.cpu.get_cpu_capability()}")


def report(runs: list, preset_name: str, argv: list, nproc: int) -> str:
    preset = PRESETS[preset_name]
    flags = {run.rung.key: " ".join(expand(run.rung, preset)) or "(none)" for run in runs}
    return "\n".join([
        f"# fastpt ablation ladder, preset `{preset_name}`",
        "",
        f"- date: {time.strftime('%Y-%m-%d %H:%M %Z')}",
        f"- machine: {machine()}",
        f"- command: `python scripts/reproduce.py {shlex.join(argv)}`",
        f"- workload: {preset.description}; every run: `{' '.join(preset.flags)}`",
        f"- multi-process rows: {nproc} processes (torchrun); CPU threads per process: cores / processes",
        "- time = `train_time_s` (training + validation, all epochs; no setup, checkpoint writing or test); "
        "samples/s and tokens/s over training steps after 3 warm-up steps, all processes together; "
        "peak memory: CUDA allocator peak, or the process's peak RSS on a CPU (rank 0).",
        "- speed-up: each side over its own baseline (first row); the articles ran full size on A100s "
        f"({ARTICLE_BASELINE_MIN} min baseline), so compare ratios, not minutes.",
        "",
        table(runs),
        "",
        "Flags per row: " + "; ".join(f"{run.rung.key}: `{flags[run.rung.key]}`" for run in runs),
        "",
    ])


def chart(runs: list, path: Path, title: str) -> bool:
    """Three panels, ours beside the articles': time, speed-up over baseline, test accuracy.

    matplotlib is an extra (requirements-dev.txt): without it the table is still written, and one
    line says how to get the chart. Returns whether the chart was written.
    """
    try:
        import matplotlib
    except ModuleNotFoundError:
        print(f"no chart {path.name}: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r.rung.key for r in runs]
    base = next((r.results for r in runs if r.rung.key == "baseline" and r.results), None)
    ours_min = [r.results["train_time_s"] / 60 if r.results else 0 for r in runs]
    ours_speed = [base["train_time_s"] / r.results["train_time_s"] if r.results and base else 0 for r in runs]
    ours_acc = [100 * r.results["test_acc"] if r.results else 0 for r in runs]
    art_min = [r.rung.article_min or 0 for r in runs]
    art_speed = [ARTICLE_BASELINE_MIN / r.rung.article_min if r.rung.article_min else 0 for r in runs]
    art_acc = [r.rung.article_acc or 0 for r in runs]
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.5))
    x = range(len(runs))
    width = 0.4
    panels = [("time (min)", ours_min, art_min), ("speed-up over own baseline", ours_speed, art_speed),
              ("test accuracy (%)", ours_acc, art_acc)]
    for ax, (name, ours, theirs) in zip(axes, panels):
        ax.bar([i - width / 2 for i in x], ours, width, label="fastpt (this machine)", color="tab:blue")
        ax.bar([i + width / 2 for i in x], theirs, width, label="articles (A100)", color="tab:orange")
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels, rotation=45, ha="right")
        ax.set_title(name)
        if name.startswith("time"):
            ax.set_yscale("log")  # CPU subsets and full-size GPU runs differ by orders of magnitude
        if name.startswith("test"):
            low = min([v for v in ours + theirs if v > 0], default=50)
            ax.set_ylim(max(0, low - 5), 100)
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------- main

def default_nproc() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def default_data_dir() -> Optional[str]:
    """$FASTPT_DATA_DIR, else ./data, else the shared read-only copy next to the checkout."""
    if os.environ.get("FASTPT_DATA_DIR") or (ROOT / "data").exists():
        return None  # train.py finds it
    shared = ROOT.parent / "shared" / "data"
    return str(shared) if shared.is_dir() else None


def data_args(data_dir: Optional[str], cache_dir: Optional[str]) -> list:
    """train.py's --data-dir / --cache-dir for the runs a script launches (data_dir defaults as above),
    as absolute paths: a run may start in another folder (compare_peers.py --before)."""
    data_dir = data_dir or default_data_dir()
    return ((["--data-dir", str(Path(data_dir).resolve())] if data_dir else [])
            + (["--cache-dir", str(Path(cache_dir).resolve())] if cache_dir else []))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="cpu", choices=sorted(PRESETS))
    p.add_argument("--nproc", type=int, default=None, help="processes for the multi-process rows (default: GPUs, or 2)")
    p.add_argument("--only", default=None, help="comma-separated row keys: " + ",".join(r.key for r in LADDER))
    p.add_argument("--data-dir", default=None, help="IMDB data (default: $FASTPT_DATA_DIR, ./data or ../shared/data)")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--runs-dir", default=None, help="run folders (default: runs/reproduce-<preset>)")
    p.add_argument("--report-dir", default=str(ROOT / "scripts" / "results"),
                   help="where reproduce-<preset>.md and .png go")
    p.add_argument("--force", action="store_true", help="rerun configurations whose results exist")
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    nproc = args.nproc or default_nproc()
    only = set(args.only.split(",")) if args.only else None
    if only and only - {r.key for r in LADDER}:
        print(f"error: unknown --only keys: {', '.join(sorted(only - {r.key for r in LADDER}))}", file=sys.stderr)
        return 2
    data_dir = args.data_dir or default_data_dir()
    data_flags = data_args(data_dir, args.cache_dir)
    runs_dir = Path(args.runs_dir or ROOT / "runs" / f"reproduce-{args.preset}").resolve()
    runs = plan(args.preset, nproc, data_flags, runs_dir, only)
    for run in runs:
        if run.status == "not run":
            execute(run, args.force)
        else:
            print(f"[{run.rung.key}] {run.status}")
    report_dir = Path(args.report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    md = report(runs, args.preset, argv, nproc)
    (report_dir / f"reproduce-{args.preset}.md").write_text(md)
    charted = chart(runs, report_dir / f"reproduce-{args.preset}.png",
                    f"fastpt ladder, preset {args.preset}: {machine()}")
    print(md)
    print(f"written: {report_dir / f'reproduce-{args.preset}.md'}{' and .png' if charted else ''}")
    return 0 if all(r.results or r.status.startswith("left out") for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
