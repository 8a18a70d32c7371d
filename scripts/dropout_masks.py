"""Dropout masks on the CPU: eager `F.dropout` against cheaper ways to draw them, and dropout's share of a step.

    python scripts/dropout_masks.py --report scripts/results/dropout-masks-cpu.md

1. Dropout alone, forward + backward at p = 0.1, on the shapes a packed MiniLM step drops: tokens x 384
   (embeddings, attention output, feed-forward output: 13 per step with 6 layers) and tokens x 1536 (the
   width of the feed-forward's inner layer, which BERT does not drop, timed for scale), in float32 and
   bfloat16. The fastest of --repeats interleaved runs by the process's CPU time (the ways take turns):
   - `F.dropout`: what nn.Dropout runs; on the CPU `aten::dropout` -> `bernoulli_(1 - p)` on a tensor of
     x's dtype, `div_(1 - p)`, `mul` (the script prints the ops its profiler saw);
   - `bernoulli_ uint8`: the same draw into a 1-byte buffer, then a masked scale;
   - `rand_like f32 >= p`: one float32 uniform per element, thresholded;
   - `16-bit slices` (fastpt/speedups/dropout.py): four 16-bit slices of each `random_` int64;
   - `compiled F.dropout`: torch.compile of F.dropout (Inductor's mask, generated inside the kernel).
2. A Linear(384 -> 1536) + GELU + dropout block, eager with each mask and compiled.
3. A packed MiniLM training step (12 reviews of IMDB-like lengths, random token ids, AdamW) under
   torch.profiler: the step's time and the shares of bernoulli_ / random_ in its self CPU time, with
   nn.Dropout, with fastpt's `apply_cheap_dropout` and with p = 0 (no dropout), in float32 (and bfloat16
   autocast with --step-dtypes float32,bfloat16).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fastpt.speedups import dropout as cheap  # noqa: E402
from packing_kernels import imdb_like_lengths  # noqa: E402

P = 0.1


class MaskedScale(torch.autograd.Function):
    """x x scale where keep, else 0; its backward applies the same mask (for the masks drawn here)."""

    @staticmethod
    def forward(ctx, x, keep, scale):
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return x * keep * scale

    @staticmethod
    def backward(ctx, grad):
        (keep,) = ctx.saved_tensors
        return grad * keep * ctx.scale, None, None


def bernoulli_uint8(x, p):
    return MaskedScale.apply(x, torch.empty_like(x, dtype=torch.uint8).bernoulli_(1 - p), 1 / (1 - p))


def rand_threshold(x, p):
    return MaskedScale.apply(x, torch.rand_like(x, dtype=torch.float32) >= p, 1 / (1 - p))


WAYS = {"F.dropout (eager)": lambda x, p: F.dropout(x, p, True),
        "bernoulli_ uint8": bernoulli_uint8,
        "rand_like f32 >= p": rand_threshold,
        "16-bit slices": cheap.cheap_dropout}


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def interleaved(cases: dict, repeats: int) -> dict:
    """(CPU seconds, wall seconds) of each case's fastest run, the cases taking turns; each runs once first
    to warm up (and compile).

    CPU time (the process's, all its threads) and the fastest run: on a CPU shared with other jobs the
    wall clock mostly measures who else runs (parallel regions most, when a thread waits for a descheduled
    one); the process's CPU time counts only its own work, and its fastest run is the least disturbed."""
    for run in cases.values():
        run()
    cpu, wall = {name: [] for name in cases}, {name: [] for name in cases}
    for _ in range(repeats):
        for name, run in cases.items():
            start_cpu, start = time.process_time(), time.perf_counter()
            run()
            cpu[name].append(time.process_time() - start_cpu)
            wall[name].append(time.perf_counter() - start)
    return {name: (min(cpu[name]), min(wall[name])) for name in cases}


def forward_backward(fn, x, grad):
    def run():
        x.grad = None
        fn(x).backward(grad)
    return run


def aten_ops_of_dropout(x) -> list[str]:
    with torch.profiler.profile() as prof:
        F.dropout(x, P, True).backward(torch.ones_like(x))
    return sorted({e.key for e in prof.key_averages() if e.key.startswith("aten::")})


def compiled_code_calls(fn, x) -> dict:
    """What Inductor's code for `fn` (forward and backward) calls to draw random numbers."""
    from torch._inductor.utils import run_and_get_code
    _, code = run_and_get_code(lambda: fn(x).sum().backward())
    text = "\n".join(code)
    return {"aten bernoulli": "bernoulli" in text, "in-kernel random (Philox)": "rand" in text.replace("randint", "")}


def dropout_table(tokens: int, repeats: int) -> list[tuple]:
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for width in (384, 1536):
            x = torch.randn(tokens, width, dtype=dtype, requires_grad=True)
            grad = torch.randn_like(x)
            ways = {name: (lambda x, f=f: f(x, P)) for name, f in WAYS.items()}
            ways["compiled F.dropout"] = torch.compile(lambda x: F.dropout(x, P, True), dynamic=False)
            times = interleaved({name: forward_backward(f, x, grad) for name, f in ways.items()}, repeats)
            with torch.no_grad():
                kept = {name: float(f(x).ne(0).float().mean()) for name, f in ways.items()}
            base = times["F.dropout (eager)"][0]
            for name, (seconds, wall) in times.items():
                rows.append((str(dtype).removeprefix("torch."), f"{tokens} x {width}", name,
                             seconds * 1e3, wall * 1e3, base / seconds, kept[name]))
                print(f"  {rows[-1][0]:>8} {rows[-1][1]:>11}  {name:<20} CPU {seconds * 1e3:8.2f} ms  "
                      f"wall {wall * 1e3:8.2f} ms  x{base / seconds:5.2f}  kept {kept[name]:.4f}", flush=True)
    return rows


def block_table(tokens: int, repeats: int) -> list[tuple]:
    """Linear(384 -> 1536) + GELU + dropout, forward + backward."""
    rows = []
    torch.manual_seed(0)
    linear = torch.nn.Linear(384, 1536)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(tokens, 384, requires_grad=True)
        grad = torch.randn(tokens, 1536, dtype=dtype)

        def block(x, drop=F.dropout):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                return drop(F.gelu(linear(x)), P, True)

        cases = {"eager, F.dropout": block, "eager, 16-bit slices": lambda x: block(x, cheap.cheap_dropout),
                 "eager, no dropout": lambda x: block(x, lambda h, p, t: h),
                 "compiled, F.dropout": torch.compile(block, dynamic=False)}
        times = interleaved({name: forward_backward(f, x, grad) for name, f in cases.items()}, repeats)
        base = times["eager, F.dropout"][0]
        for name, (seconds, wall) in times.items():
            rows.append((str(dtype).removeprefix("torch."), name, seconds * 1e3, wall * 1e3, base / seconds))
            print(f"  {rows[-1][0]:>8}  {name:<22} CPU {seconds * 1e3:8.2f} ms  wall {wall * 1e3:8.2f} ms  "
                  f"x{base / seconds:5.2f}", flush=True)
    return rows


STEP_DROPOUTS = ("nn.Dropout", "16-bit slices", "none (p = 0)")


def packed_step(dtype: torch.dtype, dropout: str, batch: int, max_length: int):
    """One packed MiniLM training step (forward, loss, backward, AdamW) on a fixed batch of random token ids."""
    from fastpt.inputs.models import load_model
    from fastpt.speedups.packing import PackedClassifier
    torch.manual_seed(0)
    model = load_model("minilm", random_init=False)
    if dropout == "16-bit slices":
        cheap.apply_cheap_dropout(model)
    if dropout.startswith("none"):
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0  # F.dropout returns its input at p = 0
    model = PackedClassifier(model, "loop").train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    lengths = imdb_like_lengths(batch, max_length)
    cu_seqlens = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    input_ids = torch.randint(1000, 20000, (1, int(cu_seqlens[-1])))
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = torch.randint(0, 2, (batch,))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            logits = model(input_ids, position_ids, cu_seqlens, max_length)
        F.cross_entropy(logits.float(), labels).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step.tokens = int(cu_seqlens[-1])
    return step


def self_cpu_shares(step, ops=("bernoulli_", "random_")) -> dict:
    """Each op's share of the self CPU time of one step, by torch.profiler."""
    with torch.profiler.profile() as prof:
        step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    return {op: sum(e.self_cpu_time_total for e in events if e.key == f"aten::{op}") / total for op in ops}


def step_table(dtype: torch.dtype, steps: int) -> list[tuple]:
    """The variants' steps interleaved (fastest time), then one profiled step each."""
    variants = {name: packed_step(dtype, name, batch=12, max_length=512) for name in STEP_DROPOUTS}
    times = interleaved(variants, steps)
    rows = []
    for name, step in variants.items():
        shares = self_cpu_shares(step)
        (seconds, wall), base = times[name], times["nn.Dropout"][0]
        rows.append((str(dtype).removeprefix("torch."), name, step.tokens, seconds, wall,
                     base / seconds, shares["bernoulli_"], shares["random_"]))
        print(f"  step {rows[-1][0]} {name}: CPU {seconds:.2f} s, wall {wall:.2f} s, x{base / seconds:.2f}, "
              f"bernoulli_ {100 * shares['bernoulli_']:.1f} %, random_ {100 * shares['random_']:.1f} %", flush=True)
    return rows


def markdown(header: list, rows: list) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(rows_cell for rows_cell in row) + " |" for row in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="rows of the dropped tensors")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--steps", type=int, default=5, help="timed training steps per case")
    parser.add_argument("--step-dtypes", default="float32", help="comma-separated: float32,bfloat16")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--report", type=Path, default=None, help="write the Markdown table here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    machine = (f"{cpu_model()}; {torch.backends.cpu.get_cpu_capability()}; {torch.get_num_threads()} threads; "
               f"torch {torch.__version__}")
    load_start = os.getloadavg()[0]
    print(machine, flush=True)
    probe = torch.randn(64, 64, requires_grad=True)
    ops = aten_ops_of_dropout(probe)
    compiled_calls = compiled_code_calls(torch.compile(lambda x: F.dropout(x, P, True)), probe)
    torch._dynamo.reset()
    print(f"aten ops of F.dropout + backward: {', '.join(ops)}\ncompiled F.dropout calls: {compiled_calls}")
    dropout_rows = dropout_table(args.tokens, args.repeats)
    block_rows = block_table(args.tokens, args.repeats)
    step_rows = [row for name in args.step_dtypes.split(",") for row in step_table(getattr(torch, name), args.steps)]

    levels = cheap.dropped_levels(P)
    lines = [f"# Dropout masks on the CPU (p = {P})", "",
             f"- machine: {machine}",
             f"- command: `python scripts/dropout_masks.py --tokens {args.tokens} --repeats {args.repeats} "
             f"--steps {args.steps} --step-dtypes {args.step_dtypes}"
             f"{f' --threads {args.threads}' if args.threads else ''}"
             f"{f' --report {args.report}' if args.report else ''}`",
             f"- load average (1 min) at the start and end: {load_start:.1f}, {os.getloadavg()[0]:.1f} "
             f"(on {os.cpu_count()} cores; other jobs shared them)",
             f"- aten ops of eager F.dropout, forward + backward (profiler): {', '.join(ops)}",
             f"- Inductor's code for a compiled F.dropout: aten bernoulli called: {compiled_calls['aten bernoulli']}; "
             f"random numbers drawn in-kernel: {compiled_calls['in-kernel random (Philox)']}",
             f"- 16-bit slices: an element drops when its slice < {levels} of 65536, keep rate "
             f"{cheap.keep_rate(P):.7f} (error {cheap.keep_rate(P) - (1 - P):+.1e}), scale 1 / keep rate", "",
             f"## Dropout alone, forward + backward (fastest of {args.repeats} interleaved runs)", ""]
    lines += markdown(["dtype", "shape", "mask", "CPU ms", "wall ms", "speed-up vs F.dropout (CPU)", "kept share"],
                      [(d, s, n, f"{ms:.2f}", f"{w:.2f}", f"{x:.2f}", f"{k:.4f}")
                       for d, s, n, ms, w, x, k in dropout_rows])
    lines += ["", f"## Linear(384 -> 1536) + GELU + dropout, forward + backward (fastest of {args.repeats})", ""]
    lines += markdown(["dtype", "block", "CPU ms", "wall ms", "speed-up vs eager F.dropout (CPU)"],
                      [(d, n, f"{ms:.2f}", f"{w:.2f}", f"{x:.2f}") for d, n, ms, w, x in block_rows])
    lines += ["", f"## A packed MiniLM training step (12 reviews, random token ids, AdamW; fastest of {args.steps} "
              "interleaved steps after one warm-up; shares from one profiled step)", ""]
    lines += markdown(["dtype", "dropout", "tokens", "step CPU (s)", "step wall (s)", "speed-up vs nn.Dropout (CPU)",
                       "bernoulli_ self (% of CPU)", "random_ self (% of CPU)"],
                      [(d, n, str(t), f"{sec:.2f}", f"{w:.2f}", f"{x:.2f}", f"{100 * b:.1f}", f"{100 * r:.1f}")
                       for d, n, t, sec, w, x, b, r in step_rows])
    text = "\n".join(lines) + "\n"
    print(text)
    if args.report:
        args.report.write_text(text)


if __name__ == "__main__":
    main()
