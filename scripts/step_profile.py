"""Where a packed training step's time goes: torch.profiler's top rows, now and at an earlier commit.

    python scripts/step_profile.py                                # this tree: MiniLM, 512 tokens, fp32
    python scripts/step_profile.py --before 9bc6df2 --report scripts/results/step-profile-cpu.md
    python scripts/step_profile.py --amp-dtype bfloat16 --fused-adam   # issue 27's bf16 profile

In each tree (this one, and with --before this repository's files at COMMIT, unpacked by `git
archive`), a fresh process builds that tree's PackedClassifier around the pretrained model, its
packed-attention kernel (--kernel, `loop` by default: the one both trees have), Adam 5e-5 as
train.py does, and runs --steps training steps on the same packed batches of IMDB-like review
lengths (attention_probe.imdb_like_lengths, cut at --max-length; random token ids: only the
lengths matter for speed) after one warm-up step, in train mode (dropout as in training), --repeats
times per tree, interleaved. For the run with the median step time, the table gives the
operators with the most self CPU time summed over those steps, their calls and their share, and
the mean step time. Self time adds up to the whole: each row is time spent in
that operator itself, not in what it calls.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reproduce import ROOT, machine, print_report  # noqa: E402

# Run in the tree being measured (cwd), with that tree's fastpt; settings come as JSON in argv[1].
PROFILE_STEPS = r'''
import json, sys, time
import torch
from torch.profiler import ProfilerActivity, profile
sys.path.insert(0, ".")
from fastpt.inputs.models import load_model
from fastpt.speedups.packing import PackedClassifier, PackedCollator

s = json.loads(sys.argv[1])
torch.manual_seed(0)
model = PackedClassifier(load_model(s["model"], random_init=False), s["kernel"]).train()
optimizer = torch.optim.Adam(model.parameters(), lr=5e-5, fused=s["fused_adam"] or None)
g = torch.Generator().manual_seed(0)
batches = [PackedCollator(pad_id=0)([(torch.randint(1000, 20000, (n,), generator=g).tolist(), i % 2, 1.0)
                                     for i, n in enumerate(lengths)]) for lengths in s["batches"]]
dtype = getattr(torch, s["amp_dtype"]) if s["amp_dtype"] else None

def step(batch):
    with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
        logits = model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"], s["max_length"])
    torch.nn.functional.cross_entropy(logits.float(), batch["labels"]).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

step(batches[0])  # warm-up
wall = []
with profile(activities=[ProfilerActivity.CPU]) as prof:
    for batch in batches[1:]:
        start = time.perf_counter()
        step(batch)
        wall.append(time.perf_counter() - start)
rows = sorted(((e.key, e.self_cpu_time_total, e.count) for e in prof.key_averages()), key=lambda r: -r[1])
print(json.dumps({"step_s": sum(wall) / len(wall), "rows": rows, "tokens": [sum(b) for b in s["batches"][1:]]}))
'''


def profile_tree(tree: Path, settings: dict) -> dict:
    done = subprocess.run([sys.executable, "-c", PROFILE_STEPS, json.dumps(settings)], cwd=tree,
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"profiling in {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def top_rows(result: dict, top: int) -> list:
    total = sum(us for _, us, _ in result["rows"])
    return [(name, us / 1e6, calls, us / total) for name, us, calls in result["rows"][:top]]


def table(label: str, result: dict, top: int, steps: int) -> list:
    every_run = ", ".join(f"{s:.3f}" for s in result["all_steps_s"])
    lines = [f"### {label}", "", f"mean step {result['step_s']:.3f} s ({sum(result['tokens']) // steps} tokens "
             f"a step); each run's: {every_run} s", "",
             "| operator | self CPU (s) | calls | share |", "|---|---:|---:|---:|"]
    lines += [f"| `{name}` | {s:.3f} | {calls} | {100 * share:.1f}% |" for name, s, calls, share in
              top_rows(result, top)]
    return lines + [""]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", default=None, metavar="COMMIT", help="also profile the tree as it was at COMMIT")
    p.add_argument("--model", default="minilm")
    p.add_argument("--kernel", default="loop", help="packed attention kernel (both trees must have it)")
    p.add_argument("--batch-size", type=int, default=12)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3, help="runs per tree, interleaved; the median run is shown")
    p.add_argument("--amp-dtype", default=None, choices=[None, "bfloat16", "float16"])
    p.add_argument("--fused-adam", action="store_true")
    p.add_argument("--runs-dir", default=None, help="where --before's tree is unpacked (default: runs/step-profile)")
    p.add_argument("--report", default=None, help="Markdown file to write (default: print only)")
    args = p.parse_args(argv)

    from compare_peers import described, earlier_tree
    sys.path.insert(0, str(ROOT))
    from fastpt.speedups.attention_probe import imdb_like_lengths

    settings = {"model": args.model, "kernel": args.kernel, "max_length": args.max_length,
                "amp_dtype": args.amp_dtype, "fused_adam": args.fused_adam,
                "batches": [imdb_like_lengths(args.batch_size, args.max_length, seed=step)
                            for step in range(args.steps + 1)]}
    trees = [("now", ROOT)]
    if args.before:
        try:
            runs_dir = Path(args.runs_dir or ROOT / "runs" / "step-profile")
            trees.insert(0, ("before", earlier_tree(args.before, runs_dir)))
        except (ValueError, subprocess.CalledProcessError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    runs = {name: [] for name, _ in trees}
    for _ in range(args.repeats):  # interleaved: drift on a shared machine hits both trees alike
        for name, tree in trees:
            runs[name].append(profile_tree(tree, settings))
    results = {name: sorted(r, key=lambda x: x["step_s"])[len(r) // 2] for name, r in runs.items()}  # the median
    for name, r in runs.items():
        results[name]["all_steps_s"] = [x["step_s"] for x in r]
    lines = ["# A packed training step, profiled", "",
             f"- date: {time.strftime('%Y-%m-%d %H:%M %Z')}; machine: {machine()}",
             f"- command: `python scripts/step_profile.py {' '.join(argv)}`",
             f"- model {args.model}, kernel `{args.kernel}`, batch {args.batch_size}, IMDB-like lengths cut at "
             f"{args.max_length}, {args.amp_dtype or 'float32'}, Adam{' (fused)' if args.fused_adam else ''}; "
             f"{args.steps} steps after one warm-up; {args.repeats} runs per tree, interleaved, the one with the "
             f"median step time shown; top {args.top} operators by self CPU time", ""]
    for name, tree in trees:
        lines += table(f"{name}: {described(tree)}", results[name], args.top, args.steps)
    if args.before:
        lines.append(f"Median step time now / before: {results['now']['step_s'] / results['before']['step_s']:.3f}")
    print_report("\n".join(lines) + "\n", args.report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
