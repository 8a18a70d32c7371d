"""Attention's share of a packed training step, per CPU kernel, from torch.profiler.

    python scripts/attention_share.py [--model minilm] [--batch-size 12] [--steps 3] [--kernels loop grouped]

A packed batch of IMDB-like review lengths (attention_probe.imdb_like_lengths, cut at 512 tokens;
random token ids: only the lengths matter for speed), float32, forward + backward + AdamW step,
dropout as in training. Per kernel: the step's wall time, and the CPU time inside the packed
attention operators (forward and backward, with their gathers and copies) as a share of it.
One warm-up step is left out. The tables in scripts/results/packing-kernels-cpu.md come from it.
"""

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fastpt.inputs.models import load_model  # noqa: E402
from fastpt.speedups.attention_probe import imdb_like_lengths  # noqa: E402
from fastpt.speedups.packing import PackedClassifier, PackedCollator  # noqa: E402

ATTENTION_OPS = ("fastpt::attend_each_review", "fastpt::attend_grouped_reviews")  # + "_backward"


def attention_share(model_name: str, kernel: str, batch_size: int, steps: int, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = PackedClassifier(load_model(model_name, random_init=False), kernel).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    rng = np.random.default_rng(seed)
    batches = []
    for step in range(steps + 1):
        lengths = imdb_like_lengths(batch_size, 512, seed=seed + step)
        items = [(rng.integers(1000, 20000, size=n), int(rng.integers(0, 2)), 1.0) for n in lengths]
        batches.append(PackedCollator(pad_id=0)(items))

    def train_step(batch):
        logits = model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"], 512)
        torch.nn.functional.cross_entropy(logits, batch["labels"]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    train_step(batches[0])  # warm-up
    wall = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for batch in batches[1:]:
            start = time.perf_counter()
            with record_function("train_step"):
                train_step(batch)
            wall.append(time.perf_counter() - start)
    totals = {e.key: e.cpu_time_total for e in prof.key_averages()}
    step_us = totals["train_step"]
    attention_us = sum(totals.get(op, 0) + totals.get(op + "_backward", 0) for op in ATTENTION_OPS)
    return {"kernel": kernel, "step_s": float(np.mean(wall)), "attention_share": attention_us / step_us,
            "tokens": int(np.mean([b["num_tokens"] for b in batches[1:]]))}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="minilm")
    parser.add_argument("--batch-size", type=int, default=12)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--kernels", nargs="+", default=["loop", "grouped"])
    args = parser.parse_args()
    print(f"{args.model}, packed, float32, {args.batch_size} reviews per step, mean of {args.steps} steps, "
          f"{torch.get_num_threads()} threads\n")
    print("| kernel | step (s) | attention's share of the step | tokens per step |\n|---|---:|---:|---:|")
    for kernel in args.kernels:
        r = attention_share(args.model, kernel, args.batch_size, args.steps)
        print(f"| {kernel} | {r['step_s']:.2f} | {100 * r['attention_share']:.0f}% | {r['tokens']} |", flush=True)
