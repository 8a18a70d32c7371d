"""The autograd wiring the packed attention operators share (packed_attention.py, grouped_attention.py).

Each kernel is a pair of custom operators, opaque to torch.compile: a forward that returns
(output, what its backward needs) and a backward operator that takes the forward's inputs and
outputs. `connect_backward` registers the backward's shape rule and joins the two through autograd.
"""

from __future__ import annotations


def connect_backward(forward_op, backward_op) -> None:
    """forward_op(query, key, value, cu_seqlens, scaling) -> (out, saved); backward_op(grad, query,
    key, value, cu_seqlens, out, saved, scaling) -> (grad_query, grad_key, grad_value)."""

    @backward_op.register_fake
    def _(grad, query, key, value, cu_seqlens, out, saved, scaling):
        return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)

    def save_inputs(ctx, inputs, output):
        query, key, value, cu_seqlens, ctx.scaling = inputs
        ctx.save_for_backward(query, key, value, cu_seqlens, *output)

    def backward(ctx, grad, grad_saved):
        return *backward_op(grad, *ctx.saved_tensors, ctx.scaling), None, None

    forward_op.register_autograd(backward, setup_context=save_inputs)
