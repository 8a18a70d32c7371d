"""The "grouped" packed-attention kernel: reviews of similar length attended together, one batched
call per group, instead of one call per review ("loop", packed_attention.py).

What it does: inside one packed batch, the reviews (and the rounding tail, one more segment) are
sorted by length, longest first, and cut into groups (`length_groups`). Each group is gathered
from the token stream into [G, heads, L, head_dim], padded to its longest review L, and attended
in one call with a key-padding mask (0 for a review's keys, -inf for the padding); the outputs
are scattered back to the stream. Exact: a review's queries see only its own keys, as in the
padded model.

Why it can be faster: the loop makes B x heads small products per layer (12 reviews x 12 heads of
~50-512 tokens on IMDB), each too small to keep the matrix units (AMX tiles, wide AVX-512) busy,
and pays the kernel's fixed cost B times. A group of G reviews is one call over G x heads
matrices. Whether that wins depends on the CPU: the probe (attention_probe.py) times both.

What it costs: padding inside each group. A group's attention work is about G x L^2 (the padded
scores), its reviews' exact work the sum of their l^2; `length_groups` keeps the first within
(1 + MAX_WASTE) of the second, so grouping never adds more than MAX_WASTE of the exact work (two
reviews join when the shorter has at least 0.77 of the longer's length; scripts/packing_kernels.py
times other bounds). Plus one gather and one scatter of q, k, v and the output (linear in tokens).

The mask: the CPU flash kernel (`_scaled_dot_product_flash_attention_for_cpu`) takes `attn_mask`,
but only in the query's dtype (an additive mask; torch 2.13 refuses a boolean one: SDPA converts
booleans before calling it). On a CPU, SDPA's only other backend with a mask is the unfused math
path (the memory-efficient one is CUDA's). Padded rows are zeros: a padded query scores 0 against
each of its review's real keys (a uniform softmax: no row is fully masked, no NaN), and its output
is dropped at the scatter, so nothing leaks.

The backward saves what the loop's does (q, k, v, output, log-sum-exp, all in the stream's
layout: no padded copy is kept between forward and backward) and gathers them into the groups
again. The incoming gradient is zero on the padded rows, which removes their contribution to the
keys' and values' gradients (their log-sum-exp, gathered as 0, only has to keep the weights finite).
A group of one review is a view of the stream: no copy in or out but the output's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastpt.speedups.custom_ops import connect_backward

MAX_WASTE = 0.25  # padded attention work of a group over its exact work, at most 1 + this


def length_groups(sizes: list[int], max_waste: float | None = None) -> list[list[int]]:
    """The segments' indices, longest first, cut greedily into groups whose padded work
    len(group) * longest^2 stays within (1 + max_waste) * sum of length^2 (default: MAX_WASTE)."""
    max_waste = MAX_WASTE if max_waste is None else max_waste
    groups: list[list[int]] = []
    exact = 0
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        if groups and (len(groups[-1]) + 1) * sizes[groups[-1][0]] ** 2 <= (1 + max_waste) * (exact + sizes[i] ** 2):
            groups[-1].append(i)
            exact += sizes[i] ** 2
        else:
            groups.append([i])
            exact = sizes[i] ** 2
    return groups


def group_plan(cu_seqlens: torch.Tensor, num_tokens: int) -> list[tuple[int, list[tuple[int, int]]]]:
    """The groups, each (longest length L, [(start, length) of each member in the stream])."""
    edges = cu_seqlens.tolist()  # the host read, as in the loop kernel
    if edges[-1] < num_tokens:  # the rounding tail: one more segment, attending among itself
        edges.append(num_tokens)
    segments = [(s, e - s) for s, e in zip(edges[:-1], edges[1:])]
    return [(segments[members[0]][1], [segments[m] for m in members])
            for members in length_groups([n for _, n in segments])]


def _gather(tokens: torch.Tensor, group) -> torch.Tensor:
    """[T, H, d] stream -> [G, H, L, d]: the group's members, zeros after each one's end. A group of
    one is a view. Zero padded rows are safe everywhere: a zero query scores 0 against every real
    key (a uniform softmax, no NaN), masked keys weigh nothing, a zero gradient row adds nothing."""
    longest, members = group
    if len(members) == 1:
        start, n = members[0]
        return tokens[start:start + n][None].transpose(1, 2)
    rows = tokens.new_empty(len(members), longest, *tokens.shape[1:])
    for row, (start, n) in zip(rows, members):
        row[:n].copy_(tokens[start:start + n])
        row[n:].zero_()
    return rows.transpose(1, 2)


def _scatter(parts: list[torch.Tensor], groups, tokens: torch.Tensor) -> torch.Tensor:
    """One [G, H, L, ...] per group -> their members' rows written into `tokens` [T, H, ...]."""
    for part, (_, members) in zip(parts, groups):
        for row, (start, n) in zip(part.transpose(1, 2), members):
            tokens[start:start + n].copy_(row[:n])
    return tokens


def _key_padding_mask(group, like: torch.Tensor, boolean: bool = False):
    """[G, 1, 1, L] mask: additive in the query's dtype (0 inside a review, -inf after), or boolean
    (True inside); None for a group without padding."""
    longest, members = group
    if all(n == longest for _, n in members):
        return None
    keep = torch.arange(longest)[None] < torch.tensor([n for _, n in members])[:, None]
    if boolean:
        return keep[:, None, None, :].to(like.device)
    return torch.zeros(keep.shape, dtype=like.dtype).masked_fill_(~keep, float("-inf"))[:, None, None, :]


def _tokens_first(x: torch.Tensor) -> torch.Tensor:
    return x[0].transpose(0, 1)  # [1, H, T, d] -> [T, H, d], a view


def _padded(tokens: torch.Tensor, group) -> torch.Tensor:
    """`_gather` out of place (pad and stack): differentiable."""
    longest, members = group
    return torch.stack([F.pad(tokens[s:s + n], (0, 0, 0, 0, 0, longest - n)) for s, n in members]).transpose(1, 2)


def grouped_sdpa(query, key, value, cu_seqlens, scaling):
    """The grouped kernel in plain differentiable torch (SDPA with a boolean mask): [1, T, H, d].
    The operator's path off the CPU (its backward: torch.func.vjp of this), and a reference."""
    groups = group_plan(cu_seqlens, query.shape[2])
    q, k, v = (_tokens_first(x) for x in (query, key, value))
    outs = [F.scaled_dot_product_attention(_padded(q, g), _padded(k, g), _padded(v, g),
                                           attn_mask=_key_padding_mask(g, q, boolean=True), scale=scaling)
            for g in groups]
    # index_put, not in-place copies: differentiable under torch.func
    rows = torch.cat([o.transpose(1, 2)[j, :n] for o, (_, members) in zip(outs, groups) for j, (_, n) in
                      enumerate(members)])
    order = torch.tensor([start + i for _, members in groups for start, n in members for i in range(n)])
    return torch.empty_like(q).index_put((order.to(q.device),), rows)[None]


CPU_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
CPU_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


@torch.library.custom_op("fastpt::attend_grouped_reviews", mutates_args=())
def attend_grouped_reviews(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                           scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(output [1, T, H, d], log-sum-exp [1, H, T] on a CPU, empty elsewhere), as attend_each_review."""
    if query.device.type != "cpu":
        return grouped_sdpa(query, key, value, cu_seqlens, scaling), query.new_empty(0, dtype=torch.float32)
    groups = group_plan(cu_seqlens, query.shape[2])
    q, k, v = (_tokens_first(x) for x in (query, key, value))
    outs, lses = zip(*(CPU_FLASH(_gather(q, g), _gather(k, g), _gather(v, g), 0.0, False,
                                 attn_mask=_key_padding_mask(g, q), scale=scaling) for g in groups))
    out = _scatter(outs, groups, torch.empty_like(q))
    lse = _scatter([m[..., None] for m in lses], groups, q.new_empty(q.shape[0], q.shape[1], 1, dtype=lses[0].dtype))
    return out[None], lse[..., 0].T[None].contiguous()


@attend_grouped_reviews.register_fake
def _(query, key, value, cu_seqlens, scaling):
    lse_shape = (query.shape[0], query.shape[1], query.shape[2]) if query.device.type == "cpu" else (0,)
    return (query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3]),
            query.new_empty(lse_shape, dtype=torch.float32))


@torch.library.custom_op("fastpt::attend_grouped_reviews_backward", mutates_args=())
def attend_grouped_reviews_backward(grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                    cu_seqlens: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                                    scaling: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not lse.numel():  # off the CPU: a second forward, differentiated
        _, pullback = torch.func.vjp(lambda q, k, v: grouped_sdpa(q, k, v, cu_seqlens, scaling), query, key, value)
        return tuple(g.contiguous() for g in pullback(grad))
    groups = group_plan(cu_seqlens, query.shape[2])
    streams = [_tokens_first(x) for x in (query, key, value)] + [grad[0], out[0], lse[0].T[..., None]]
    # A padded row's log-sum-exp is gathered as 0 (its query is zero, its scores 0: finite weights)
    # and its gradient is zero, so it adds nothing to the keys' and values' gradients.
    grads = []
    for g in groups:
        q, k, v, dout, o, m = (_gather(x, g) for x in streams)
        grads.append(CPU_FLASH_BACKWARD(dout, q, k, v, o, m[..., 0].contiguous(), 0.0, False,
                                        attn_mask=_key_padding_mask(g, q), scale=scaling))
    results = tuple(x.new_empty(x.shape) for x in (query, key, value))  # contiguous, as the shape rule says
    for parts, result in zip(zip(*grads), results):
        _scatter(list(parts), groups, _tokens_first(result))
    return results


connect_backward(attend_grouped_reviews, attend_grouped_reviews_backward)


def grouped_attention(query, key, value, cu_seqlens, max_seqlen, scaling):
    """The kernel's entry, as packed_attention.py's others: [1, H, T, d] in, [1, T, H, d] out."""
    scaling = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    return attend_grouped_reviews(query, key, value, cu_seqlens, scaling)[0]
