"""One packed attention call, forward + backward, timed per CPU kernel against padded SDPA.

    python scripts/packing_kernels.py [--dtype float32] [--batch-size 12] [--out table.md]

12 reviews of IMDB-like lengths (attention_probe.imdb_like_lengths: a lognormal cut at 512 tokens,
mean ~270, like IMDB's in BERT tokens), 12 heads of 32 (MiniLM's; DistilBERT has 12 of 64).
Besides fastpt's kernels it times SDPA on a nested jagged tensor (the kernel fastpt does not use),
and the grouped kernel at several padding bounds (grouped_attention.MAX_WASTE is the default).
Prints a Markdown table with the CPU's model, capability and threads;
scripts/results/packing-kernels-cpu.md is its output on the machine named there.
"""

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fastpt.monitoring.peak import cpu_identity  # noqa: E402
from fastpt.speedups import grouped_attention, packed_attention  # noqa: E402
from fastpt.speedups.attention_probe import imdb_like_lengths  # noqa: E402

WASTE_BOUNDS = (0.0, 0.1, 0.5, 1.0)  # besides MAX_WASTE


def jagged_attention(query, key, value, lengths):
    """SDPA on a nested jagged tensor: [1, H, T, d] -> [1, T, H, d], the reviews' lengths on the host."""
    offsets = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int64)

    def nested(x):  # [1, H, T, d] -> [B, H, j, d] with a ragged j
        tokens_first = x[0].transpose(0, 1).contiguous()
        return torch.nested.nested_tensor_from_jagged(tokens_first, offsets, max_seqlen=max(lengths)).transpose(1, 2)

    out = F.scaled_dot_product_attention(nested(query), nested(key), nested(value))
    return out.transpose(1, 2).values()[None]


def grouped_with_bound(max_waste: float):
    def attend(query, key, value, cu_seqlens, max_seqlen, scaling):
        default = grouped_attention.MAX_WASTE
        grouped_attention.MAX_WASTE = max_waste  # read by group_plan's callers at call time
        try:
            return grouped_attention.grouped_attention(query, key, value, cu_seqlens, max_seqlen, scaling)
        finally:
            grouped_attention.MAX_WASTE = default
    return attend


def benchmark_kernels(batch_size: int = 12, heads: int = 12, head_dim: int = 32, max_length: int = 512,
                      dtype: torch.dtype = torch.float32, repeats: int = 5, seed: int = 0,
                      slow: bool = True) -> dict[str, float]:
    """Median seconds of one attention call, forward + backward, per CPU kernel and padded SDPA."""
    lengths = imdb_like_lengths(batch_size, max_length, seed)
    cu_seqlens = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    total = int(cu_seqlens[-1])
    g = torch.Generator().manual_seed(seed)
    # [1, H, T, d] views of [1, T, H, d]: the layout a Hugging Face layer hands the kernels
    packed = [torch.randn(1, total, heads, head_dim, generator=g).to(dtype).transpose(1, 2) for _ in range(3)]
    padded = [torch.randn(batch_size, heads, max_length, head_dim, generator=g).to(dtype) for _ in range(3)]
    pad_mask = (torch.arange(max_length)[None] < torch.tensor(lengths)[:, None])[:, None, None, :]
    kernels = packed_attention.KERNEL_FUNCTIONS
    cases = {"loop": (kernels["loop"], packed),
             f"grouped (waste {grouped_attention.MAX_WASTE})": (kernels["grouped"], packed)}
    cases.update({f"grouped (waste {w})": (grouped_with_bound(w), packed) for w in WASTE_BOUNDS})
    if slow:
        cases["mask"] = (kernels["mask"], packed)
        cases["jagged"] = (lambda q, k, v, *_: jagged_attention(q, k, v, lengths), packed)
        cases["padded-512"] = (lambda q, k, v, *_: F.scaled_dot_product_attention(q, k, v, attn_mask=pad_mask), padded)
    runs: dict[str, list[float]] = {name: [] for name in cases}
    for repeat in range(repeats + 1):  # round robin, so that a load from elsewhere hits every kernel alike
        for name, (attend, inputs) in cases.items():
            q, k, v = (x.detach().requires_grad_() for x in inputs)
            start = time.perf_counter()
            attend(q, k, v, cu_seqlens, max_length, None).sum().backward()
            if repeat:  # the first round warms up
                runs[name].append(time.perf_counter() - start)
    timings = {name: float(np.median(r)) for name, r in runs.items()}
    return timings


def table(batch_size: int, heads: int, head_dim: int, dtype: torch.dtype, timings: dict[str, float]) -> str:
    lengths = imdb_like_lengths(batch_size)
    cpu = cpu_identity()
    groups = len(grouped_attention.length_groups(lengths))
    lines = [f"CPU: {cpu['model']} ({cpu['capability']}), {torch.get_num_threads()} threads, "
             f"torch {torch.__version__}",
             "",
             f"One attention call, forward + backward, {str(dtype).removeprefix('torch.')}, "
             f"{heads} heads x {head_dim}, "
             f"{batch_size} reviews (lengths mean {np.mean(lengths):.0f}, max {max(lengths)}; "
             f"{groups} groups at the default waste bound {grouped_attention.MAX_WASTE}). Median of 5.",
             "", "| kernel | ms | vs loop |", "|---|---:|---:|"]
    lines += [f"| {name} | {s * 1e3:.1f} | {s / timings['loop']:.2f}x |" for name, s in timings.items()]
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--batch-size", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--fast", action="store_true", help="leave out mask, jagged and padded-512 (seconds each)")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    timings = benchmark_kernels(args.batch_size, args.heads, args.head_dim, dtype=dtype, slow=not args.fast)
    print(table(args.batch_size, args.heads, args.head_dim, dtype, timings))
