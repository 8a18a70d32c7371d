"""What a cold and a warm `torch.compile` start cost, for each `--compile-scope`: the same run twice, one cache.

    python scripts/compile_cache.py --data-dir ../shared/data     # MiniLM, 128 tokens, packed, bf16 autocast
    python scripts/compile_cache.py --data-dir DIR --scopes layers -- --model minilm --max-length 512 \
        --pack --amp --amp-dtype bfloat16 --fused-adam                          # issue 27's workload

For each scope, both runs are `train.py --compile --compile-scope SCOPE --max-steps N` with
`TORCHINDUCTOR_CACHE_DIR` pointing at one new, empty folder (a folder per scope): the first
compiles everything and fills it, the second finds its graphs there. The table gives each run's
`compile_torch_s` (torch's own count of the time spent compiling: tracing, AOTAutograd, Inductor,
the C++ compiler, loading from the caches), `compile_time_s` (host time of the steps and
evaluation batches that compiled a graph: the compiling plus those calls' own work), the
graphs Dynamo compiled, the caches' counters (`compile_cache` in results.json: FX graph cache and
AOTAutograd cache hits / misses / bypasses; a warm run that works shows hits and no misses), the
mean step time after the warm-up steps (from `samples_per_s`, when the run is long enough), and
the wall time of the whole process. Timings on a shared machine are rough; the counters are not.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reproduce import ROOT, default_data_dir, machine, print_report  # noqa: E402

# Issue 27's workload (MiniLM, packed, bfloat16 autocast, fused Adam) at 128 tokens: minutes, not hours, on a CPU.
WORKLOAD = ("--model", "minilm", "--max-length", "128", "--pack", "--amp", "--amp-dtype", "bfloat16", "--fused-adam",
            "--train-size", "240", "--val-size", "48", "--test-size", "48", "--epochs", "1")


def run_once(flags: list, out: Path, cache: Path) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache), HF_HUB_OFFLINE=os.environ.get("HF_HUB_OFFLINE", "1"))
    start = time.perf_counter()
    subprocess.run([sys.executable, "train.py", *flags, "--out", str(out), "--overwrite", "--no-progress",
                    "--no-tensorboard"], cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    results = json.loads((out / "results.json").read_text())
    results["process_wall_s"] = time.perf_counter() - start
    return results


def counters(cache: dict) -> str:
    """`fxgraph 3 hit / 0 miss / 0 bypass; autograd ...`, from results.json's compile_cache."""
    events = ("hit", "miss", "bypass")
    return "; ".join(f"{kind} " + " / ".join(f"{cache[f'{kind}_{event}']} {event}" for event in events)
                     for kind in ("fxgraph", "autograd"))


def step_ms(r: dict) -> str:
    if not r.get("samples_per_s"):
        return "–"  # the run was too short to measure past the warm-up steps
    config = json.loads((Path(r["out"]) / "config.json").read_text())
    return f"{1000 * config['batch_size'] / r['samples_per_s']:.0f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", default=None)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--scopes", nargs="+", default=["layers", "whole"], choices=["layers", "whole"])
    p.add_argument("--report", default=None, help="Markdown file to write (default: print only)")
    p.add_argument("train_flags", nargs="*", help=f"train.py flags after --; default: {' '.join(WORKLOAD)}")
    args = p.parse_args(argv)
    data_dir = args.data_dir or default_data_dir()
    flags = [*(args.train_flags or WORKLOAD), *(["--data-dir", data_dir] if data_dir else []),
             "--compile", "--max-steps", str(args.steps)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="fastpt-compile-") as tmp:
        for scope in args.scopes:
            cache = Path(tmp) / f"inductor-{scope}"  # a cold start for each scope
            for start in ("cold", "warm"):
                out = Path(tmp) / f"{scope}-{start}"
                r = run_once([*flags, "--compile-scope", scope], out, cache)
                rows.append((scope, start, r, step_ms(dict(r, out=out))))
    lines = [
        "# torch.compile: cold and warm start, by compile scope",
        "",
        f"- date: {time.strftime('%Y-%m-%d %H:%M %Z')}; machine: {machine()}",
        f"- command: `python scripts/compile_cache.py {' '.join(argv if argv is not None else sys.argv[1:])}`",
        f"- each run: `train.py {' '.join(flags)} --compile-scope SCOPE`; one empty Inductor cache per scope, "
        "shared by its cold and warm run",
        "",
        "| scope | start | compiling, torch's count (s) | calls that compiled (s) | graphs compiled | "
        "cache counters | first step (s) | step (ms) | process wall time (s) |",
        "|---|---|---:|---:|---:|---|---:|---:|---:|",
    ]
    for scope, start, r, ms in rows:
        lines.append(f"| {scope} | {start} | {r['compile_torch_s']:.1f} | {r['compile_time_s']:.1f} | "
                     f"{r['compiled_graphs']} | "
                     f"{counters(r['compile_cache'])} | {r['first_step_s']:.1f} | {ms} | {r['process_wall_s']:.1f} |")
    print_report("\n".join(lines) + "\n", args.report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
