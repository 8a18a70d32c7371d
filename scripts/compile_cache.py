"""What a cold and a warm `torch.compile` start cost: the same compiled run twice, one Inductor cache.

    python scripts/compile_cache.py --data-dir ../shared/data                 # MiniLM, 128 tokens, CPU
    python scripts/compile_cache.py --data-dir DIR -- --model distilbert-base-uncased --random-init \\
        --max-length 512 --amp --amp-dtype bfloat16 --pack                      # on a GPU

Both runs are `train.py --compile --max-steps N` with `TORCHINDUCTOR_CACHE_DIR` pointing at one
new, empty folder: the first compiles everything and fills it, the second finds its kernels
and graphs there. The table gives each run's `compile_time_s` (host time of the steps and
evaluation batches that compiled a graph), `first_step_s` and wall time of the whole process.
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
from reproduce import ROOT, default_data_dir, machine  # noqa: E402

WORKLOAD = ("--model", "minilm", "--max-length", "128", "--train-size", "240", "--val-size", "48",
            "--test-size", "48", "--epochs", "1")


def run_once(flags: list, out: Path, cache: Path) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache), HF_HUB_OFFLINE=os.environ.get("HF_HUB_OFFLINE", "1"))
    start = time.perf_counter()
    subprocess.run([sys.executable, "train.py", *flags, "--out", str(out), "--overwrite", "--no-progress",
                    "--no-tensorboard"], cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    results = json.loads((out / "results.json").read_text())
    results["process_wall_s"] = time.perf_counter() - start
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", default=None)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--report", default=None, help="Markdown file to write (default: print only)")
    p.add_argument("train_flags", nargs="*", help=f"train.py flags after --; default: {' '.join(WORKLOAD)}")
    args = p.parse_args(argv)
    data_dir = args.data_dir or default_data_dir()
    flags = [*(args.train_flags or WORKLOAD), *(["--data-dir", data_dir] if data_dir else []),
             "--compile", "--max-steps", str(args.steps)]
    with tempfile.TemporaryDirectory(prefix="fastpt-compile-") as tmp:
        cache = Path(tmp) / "inductor"
        rows = [(name, run_once(flags, Path(tmp) / name, cache)) for name in ("cold", "warm")]
    lines = [
        "# torch.compile: cold and warm start",
        "",
        f"- date: {time.strftime('%Y-%m-%d %H:%M %Z')}; machine: {machine()}",
        f"- command: `python scripts/compile_cache.py {' '.join(argv if argv is not None else sys.argv[1:])}`",
        f"- each run: `train.py {' '.join(flags)}`, one empty Inductor cache shared by both",
        "",
        "| start | compile time (s) | graphs compiled | first step (s) | process wall time (s) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, r in rows:
        lines.append(f"| {name} | {r['compile_time_s']:.1f} | {r['compiled_graphs']} | {r['first_step_s']:.1f} | "
                     f"{r['process_wall_s']:.1f} |")
    md = "\n".join(lines) + "\n"
    print(md)
    if args.report:
        Path(args.report).write_text(md)
        print(f"written: {args.report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
