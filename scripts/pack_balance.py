"""Tokens per rank per step with --pack: shared out by place (before) and balanced (data.balance_tokens).

    python scripts/pack_balance.py --data-dir ../shared/data                  # the table (seconds)
    python scripts/pack_balance.py --data-dir ../shared/data --time-steps 12  # + 2-process step times

With --pack a rank computes exactly its reviews' tokens, and every DDP step waits for the rank with
the most. For one epoch of the real training split at 512 tokens (MiniLM's tokenizer, seed 123,
--batch-size 12 per process) this prints and writes (--out, Markdown) the mean and the worst
max/mean ratio of tokens per rank per step, for 2 and 4 processes, with the reviews of each global
batch shared out by place (every world_size-th review, as DistributedSampler does) and balanced.
These are the numbers a run reports as `rank_token_imbalance` in results.json.

With --time-steps N it also trains `torchrun --nproc_per_node=2 train.py --ddp --pack` (MiniLM,
512 tokens, --max-steps N, float32) twice on this machine, by place and balanced, and reports the
seconds per step after warm-up from results.json. On a CPU both processes share the cores, so the
gain shows only as far as the slower rank's extra tokens keep the other waiting; on a GPU per rank
it is the whole gap. The timing is only as quiet as the machine.
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


ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def ratios(train, batch_size: int, world_size: int, balance: bool, seed: int = 123) -> list[float]:
    """max/mean tokens per rank for every step of epoch 0."""
    import numpy as np

    from fastpt.inputs import data

    sampler = data.TrainBatchSampler(train, batch_size, 0, world_size, seed, balance_tokens=balance)
    out = []
    for global_batch in sampler.global_batches():
        tokens = [int(train.lengths[share].sum()) for share in sampler.shares(global_batch)]
        out.append(max(tokens) / np.mean(tokens))
    return out


def imbalance_table(data_dir, cache_dir, model: str, batch_size: int) -> list[dict]:
    import numpy as np

    from fastpt.inputs import token_cache
    from fastpt.inputs.models import load_tokenizer

    splits, _ = token_cache.prepare_splits(data_dir, cache_dir, load_tokenizer(model), 512)
    train = splits["train"]
    rows = []
    for world_size in (2, 4):
        for balance in (False, True):
            r = ratios(train, batch_size, world_size, balance)
            rows.append({"processes": world_size, "split": "balanced" if balance else "by place",
                         "steps": len(r), "mean": float(np.mean(r)), "p95": float(np.percentile(r, 95)),
                         "max": float(np.max(r))})
    return rows


def timed_run(args, balance: bool, out: Path) -> dict:
    """One torchrun launch of train.py --ddp --pack on 2 processes; its results.json."""
    flags = ["--model", args.model, "--max-length", "512", "--batch-size", str(args.batch_size), "--pack", "--ddp",
             "--epochs", "1", "--max-steps", str(args.time_steps), "--val-size", "24", "--test-size", "24",
             "--no-progress", "--out", str(out), "--overwrite"]
    if args.data_dir:
        flags += ["--data-dir", args.data_dir]
    if args.cache_dir:
        flags += ["--cache-dir", args.cache_dir]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // 2))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", __file__,
           "--worker", "balanced" if balance else "by-place", "--", *flags]
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=not args.verbose)
    return json.loads((out / "results.json").read_text())


def worker(split: str, train_args: list[str]) -> int:
    """Inside torchrun: train.py's main, with the balancing switched off for 'by-place'."""
    from fastpt.inputs import data
    from train import main as train_main

    if split == "by-place":
        data.TrainBatchSampler.shares = lambda self, b: [b[r::self.world_size] for r in range(self.world_size)]
    return train_main(train_args)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", default=os.environ.get("FASTPT_DATA_DIR"))
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--model", default="minilm")
    p.add_argument("--batch-size", type=int, default=12)
    p.add_argument("--time-steps", type=int, default=0, help="also time 2-process training for this many steps")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per split, alternating")
    p.add_argument("--out", default=str(ROOT / "scripts" / "results" / "pack-balance.md"))
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args()

    rows = imbalance_table(args.data_dir, args.cache_dir, args.model, args.batch_size)
    lines = [f"# Tokens per rank per step with --pack ({args.model} tokenizer, 512 tokens, --batch-size "
             f"{args.batch_size} per process, one epoch of the training split, seed 123)", "",
             f"`python scripts/pack_balance.py{' --time-steps ' + str(args.time_steps) if args.time_steps else ''}`"
             f" ({time.strftime('%Y-%m-%d')}). max/mean of the tokens each rank computes in a step: 1.00 means no "
             f"rank waits for another.", "",
             "| processes | reviews shared out | steps | mean max/mean | p95 | worst |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['processes']} | {r['split']} | {r['steps']} | {r['mean']:.3f} | {r['p95']:.3f} "
                     f"| {r['max']:.3f} |")
    if args.time_steps:
        times = {"by-place": [], "balanced": []}
        load_before = os.getloadavg()[0]
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(args.repeats):
                for split in times:
                    res = timed_run(args, split == "balanced", Path(tmp) / f"{split}-{i}")
                    step_s = 2 * args.batch_size / res["samples_per_s"]
                    times[split].append((step_s, res.get("rank_token_imbalance")))
        lines += ["", f"2 processes on this machine ({os.cpu_count()} cores, gloo, float32, MiniLM, "
                      f"`--max-steps {args.time_steps}`, steps after the warm-up; runs alternate; 1-minute load "
                      f"average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after):", "",
                  "| reviews shared out | seconds per step (each run) "
                  "| rank_token_imbalance (results.json: the epoch's mean) |",
                  "|---|---|---|"]
        for split, values in times.items():
            lines.append(f"| {split} | {', '.join(f'{s:.2f}' for s, _ in values)} | "
                         f"{values[0][1]:.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        from train import exit_process
        exit_process(worker(sys.argv[2], sys.argv[4:]))
    main()
