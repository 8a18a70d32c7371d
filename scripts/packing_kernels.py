"""One packed attention call, forward + backward, timed per CPU kernel against padded SDPA.

    python scripts/packing_kernels.py

12 reviews of IMDB-like lengths (a lognormal cut at 512 tokens: mean ~270, like IMDB's in BERT
tokens), 12 heads of 32, float32. fastpt/speedups/packed_attention.py's docstring quotes the result. Besides
fastpt's kernels it times SDPA on a nested jagged tensor, the kernel fastpt does not use.
"""

import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fastpt.speedups import packed_attention  # noqa: E402


def jagged_attention(query, key, value, lengths):
    """SDPA on a nested jagged tensor: [1, H, T, d] -> [1, T, H, d], the reviews' lengths on the host."""
    offsets = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int64)

    def nested(x):  # [1, H, T, d] -> [B, H, j, d] with a ragged j
        tokens_first = x[0].transpose(0, 1).contiguous()
        return torch.nested.nested_tensor_from_jagged(tokens_first, offsets, max_seqlen=max(lengths)).transpose(1, 2)

    out = F.scaled_dot_product_attention(nested(query), nested(key), nested(value))
    return out.transpose(1, 2).values()[None]


def imdb_like_lengths(batch_size: int, max_length: int = 512, seed: int = 0) -> list[int]:
    """Review lengths drawn like IMDB's in BERT tokens: mean ~270, a long tail cut at max_length."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(5.5, 0.55, size=batch_size), 16, max_length).astype(int).tolist()


def benchmark_kernels(batch_size: int = 12, heads: int = 12, head_dim: int = 32, max_length: int = 512,
                      repeats: int = 5, seed: int = 0) -> dict[str, float]:
    """Median seconds of one attention call, forward + backward, per CPU kernel and padded SDPA."""
    lengths = imdb_like_lengths(batch_size, max_length, seed)
    cu_seqlens = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    total = int(cu_seqlens[-1])
    g = torch.Generator().manual_seed(seed)
    packed = [torch.randn(1, heads, total, head_dim, generator=g) for _ in range(3)]
    padded = [torch.randn(batch_size, heads, max_length, head_dim, generator=g) for _ in range(3)]
    pad_mask = (torch.arange(max_length)[None] < torch.tensor(lengths)[:, None])[:, None, None, :]
    kernels = packed_attention._KERNEL_FUNCTIONS
    cases = {name: (lambda q, k, v, f=kernels[name]: f(q, k, v, cu_seqlens, max_length, None), packed)
             for name in ("loop", "mask")}
    cases["jagged"] = (lambda q, k, v: jagged_attention(q, k, v, lengths), packed)
    cases["padded-512"] = (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=pad_mask), padded)
    timings = {}
    for name, (attend, inputs) in cases.items():
        runs = []
        for _ in range(repeats + 1):  # the first run warms up
            q, k, v = (x.detach().requires_grad_() for x in inputs)
            start = time.perf_counter()
            attend(q, k, v).sum().backward()
            runs.append(time.perf_counter() - start)
        timings[name] = float(np.median(runs[1:]))
    return timings


if __name__ == "__main__":
    lengths = imdb_like_lengths(12)
    print(f"12 reviews, lengths mean {np.mean(lengths):.0f}, max {max(lengths)}; "
          f"attention forward + backward, 12 heads x 32, {torch.get_num_threads()} threads")
    for name, seconds in benchmark_kernels().items():
        print(f"  {name:>10}: {seconds * 1e3:8.1f} ms")
