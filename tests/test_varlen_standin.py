"""The "varlen" kernel's glue, checked on the CPU against a stand-in that behaves like FlashAttention.

`torch.nn.attention.varlen.varlen_attn` dispatches to two custom operators,
`torch_attn::_varlen_attn` (forward) and `torch_attn::_varlen_attn_backward` (what its autograd
formula calls). Their real kernels run FlashAttention, CUDA only. Here CPU kernels are registered for
both, so that the whole path (fastpt's glue, varlen_attn, the operators' autograd and fake
implementations, torch.compile) runs as on a GPU, with one difference that matters: like
FlashAttention, which allocates its outputs with `empty_like` and writes only rows inside a sequence
(the backward passes `zero_tensors=false`), the stand-in leaves every other row of `out`, `dq`, `dk`
and `dv` unwritten, filled here with NaN. A Python-level stand-in for `varlen_attn` cannot show this:
autograd would give the rows it skipped zero gradients.

The registration lives in a `torch.library.Library` fragment destroyed after each test, so no other
test sees it. (`torch.library.register_kernel` on an operator made with `torch.library.custom_op`
ignores `lib=` and registers for the rest of the process; its kernel can only be disabled. So the
same CPU kernels are registered with `torch.library.impl(..., lib=...)`, which is undone with the
library.)
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from test_packing import MAX_LENGTH, make_items, tiny_model
from torch._dynamo.testing import CompileCounterWithBackend

from fastpt.cli.shell import EXIT_BAD_INPUT
from fastpt.inputs.data import Collator
from fastpt.loop.step import make_forward_loss
from fastpt.speedups import packed_attention
from fastpt.speedups.amp import MixedPrecision
from fastpt.speedups.compile import mark_token_dim_dynamic
from fastpt.speedups.packing import PackedClassifier, PackedCollator
from train import main


try:
    from torch.nn.attention import varlen
except ImportError:  # PyTorch < 2.10
    varlen = None
needs_varlen = pytest.mark.skipif(varlen is None, reason="this torch has no torch.nn.attention.varlen")

NAN = float("nan")


# --------------------------------------------------------------------------- the stand-in kernels

def sequences(cu_seq_q, cu_seq_k, max_q, max_k):
    """(start, end) of each sequence, checked against the kernel's contract."""
    assert cu_seq_q.dtype == torch.int32 and torch.equal(cu_seq_q, cu_seq_k) and max_q == max_k
    edges = cu_seq_q.tolist()
    assert edges[0] == 0 and all(s <= e for s, e in zip(edges[:-1], edges[1:])), edges
    for start, end in zip(edges[:-1], edges[1:]):
        # FlashAttention's grid has ceil(max_q / block) row blocks per sequence: rows past
        # max_q would be left unwritten (or computed by nobody). Refuse rather than guess.
        assert end - start <= max_q, f"a sequence of {end - start} rows exceeds max_seqlen {max_q}"
        if end > start:  # an empty sequence is skipped, as the kernel's blocks return at once
            yield start, end


def heads_first(x, start, end):
    return x[start:end].transpose(0, 1).float()  # [T, H, d] rows -> [H, n, d] in float32


def standin_forward(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, scale=None,
                    window_size=None, enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    """Exact attention inside each sequence; out and logsumexp of every other row left NaN."""
    assert query.dtype in packed_attention.VARLEN_DTYPES, "FlashAttention takes fp16 / bf16 only"
    assert not is_causal and window_size in (None, [-1, -1]) and not enable_gqa
    assert seqused_k is None and block_table is None
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    out = torch.full_like(query, NAN)
    lse = torch.full((query.shape[1], query.shape[0]), NAN)  # [H, T] float32, as the real kernel's
    for start, end in sequences(cu_seq_q, cu_seq_k, max_q, max_k):
        q, k, v = (heads_first(x, start, end) for x in (query, key, value))
        scores = scale * q @ k.transpose(1, 2)
        lse[:, start:end] = scores.logsumexp(-1)
        probs = (scores - lse[:, start:end, None]).exp()
        out[start:end] = (probs @ v).transpose(0, 1).to(query.dtype)
    return out, lse, torch.zeros(2, dtype=torch.uint64)


def standin_backward(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, is_causal,
                     rng_state, scale=None, window_size=None):
    """FlashAttention's backward formulas inside each sequence; dq, dk, dv of every other row left NaN."""
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    dq, dk, dv = (torch.full_like(x, NAN) for x in (query, key, value))
    for start, end in sequences(cu_seq_q, cu_seq_k, max_q, max_k):
        q, k, v, do = (heads_first(x, start, end) for x in (query, key, value, grad_out))
        probs = (scale * q @ k.transpose(1, 2) - lse[:, start:end, None]).exp()
        d_probs = do @ v.transpose(1, 2)
        # rowsum(dO * O) from O in float32 (FlashAttention reads the rounded `out`): exact, not bit-for-bit.
        d_scores = probs * (d_probs - (do * (probs @ v)).sum(-1, keepdim=True))
        for grad, rows in ((dq, scale * d_scores @ k), (dk, scale * d_scores.transpose(1, 2) @ q),
                           (dv, probs.transpose(1, 2) @ do)):
            grad[start:end] = rows.transpose(0, 1).to(grad.dtype)
    return dq, dk, dv


@contextlib.contextmanager
def flash_standin():
    """The stand-in kernels as the CPU kernels of varlen_attn's two operators, for the `with` block only."""
    with torch.library._scoped_library("torch_attn", "FRAGMENT") as lib:
        torch.library.impl("torch_attn::_varlen_attn", "cpu", standin_forward, lib=lib)
        torch.library.impl("torch_attn::_varlen_attn_backward", "cpu", standin_backward, lib=lib)
        yield


@pytest.fixture
def standin():
    torch._dynamo.reset()  # no compiled graph from another test holds on to a kernel
    with flash_standin():
        yield
    torch._dynamo.reset()


@needs_varlen
def test_the_standin_is_exact_inside_sequences_leaves_the_rest_unwritten_and_is_undone():
    """The stand-in against SDPA per sequence (fp32 reference), through varlen_attn and its autograd."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(12, 2, 8, generator=g).to(torch.bfloat16).requires_grad_() for _ in range(3))
    cu_seqlens = torch.tensor([0, 3, 3, 10], dtype=torch.int32)  # an empty sequence, then two rows outside
    grad_out = torch.randn(12, 2, 8, generator=g).to(torch.bfloat16)
    with flash_standin():
        out = varlen.varlen_attn(q, k, v, cu_seqlens, cu_seqlens, 7, 7)
        out.backward(grad_out)
    assert out[10:].isnan().all() and all(x.grad[10:].isnan().all() for x in (q, k, v))
    for start, end in ((0, 3), (3, 10)):
        rows = [x.detach()[start:end].float().transpose(0, 1).requires_grad_() for x in (q, k, v)]
        expected = F.scaled_dot_product_attention(*rows).transpose(0, 1)
        expected.backward(grad_out[start:end].float())
        torch.testing.assert_close(out[start:end].float(), expected, rtol=0, atol=2e-2)  # bf16 rounding
        for x, row in zip((q, k, v), rows):
            torch.testing.assert_close(x.grad[start:end].float(), row.grad.transpose(0, 1), rtol=0, atol=3e-2)
    with pytest.raises(NotImplementedError):  # after the block: CPU has no kernel again
        varlen.varlen_attn(q, k, v, cu_seqlens, cu_seqlens, 7, 7)


# --------------------------------------------------------------------------- one packed training step

class CpuStep:
    """The two things train.py's step function asks of a strategy: autocast (or none) and compiling.

    Compiled runs use the "aot_eager" backend, as tests/test_packing.py does: it traces forward and
    backward (the custom operators through their fake implementations) exactly as Inductor would
    receive them, without minutes in a C++ compiler on a small CPU. The counter counts the graphs.
    """

    def __init__(self, dtype=None, compiled: bool = False):
        self.dtype, self.compiled = dtype, compiled
        self.counter = CompileCounterWithBackend("aot_eager")
        dtype_name = str(dtype).removeprefix("torch.") if dtype else "bfloat16"
        self.precision = MixedPrecision(dtype is not None, dtype_name, torch.device("cpu"))  # autocast, or none

    def compile_step(self, fn):
        return torch.compile(fn, backend=self.counter, fullgraph=True) if self.compiled else fn


def step_gradients(forward_loss, model, batch):
    """Loss and every parameter's gradient after one forward_loss + backward (fastpt's step function)."""
    model.zero_grad(set_to_none=True)
    loss, _ = forward_loss(model, batch)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


# Four reviews a batch, as a run's batch size is fixed: 58 tokens rounded to 64 (a tail of 6), 65
# rounded to 128 (a tail of 63, the longest a multiple of 64 can leave, after a review of the full
# max_seqlen), and exactly 64 (no tail: the extra sequence is empty).
LENGTHS = {"tail-6": [9, 30, 2, 17], "tail-63": [1, MAX_LENGTH - 4, 4, 4], "no-tail": [30, 20, 10, 4]}


def packed_and_padded_steps(kind: str, dtype, compiled: bool):
    """For each LENGTHS batch: one `--pack --pack-multiple 64` step on the "varlen" kernel, and the
    padded model's step on the same reviews, both through fastpt's forward_loss with the same autocast.

    The padded reference is the plain Hugging Face model (SDPA with a mask), always eager. Compiled,
    one graph serves all three token counts (64, 128, 64): the token dimension is marked dynamic as
    `Strategy.to_device` marks it.
    """
    reference = tiny_model(kind).train()  # dropout is 0 in the tiny models: train mode changes nothing else
    packed = PackedClassifier(copy.deepcopy(reference), "varlen").train()
    strategy = CpuStep(dtype, compiled)
    packed_step = strategy.compile_step(make_forward_loss(strategy.precision, MAX_LENGTH))
    padded_step = make_forward_loss(CpuStep(dtype).precision, MAX_LENGTH)
    results = []
    for lengths in LENGTHS.values():
        items = make_items(lengths)
        batch = PackedCollator(pad_id=0, multiple=64, max_length=MAX_LENGTH)(items)
        assert batch["num_tokens"] % 64 == 0 and sum(batch["lengths"]) == sum(lengths)
        got = step_gradients(packed_step, packed, mark_token_dim_dynamic(batch) if compiled else batch)
        padded = Collator(pad_id=0, pad_to="longest", max_length=MAX_LENGTH)(items)
        results.append((got, step_gradients(padded_step, reference, padded)))
    assert strategy.counter.frame_count == (1 if compiled else 0)
    return results


def assert_finite(grads):
    assert all(grad.isfinite().all() for grad in grads.values()), \
        [name for name, grad in grads.items() if not grad.isfinite().all()]


# Each model is compiled once, in one precision (a compile costs ~10 s of CPU here); eager runs cover both.
CASES_FLOAT32 = [("distilbert", False), ("bert", False), ("distilbert", True)]
CASES_BFLOAT16 = [("distilbert", False), ("bert", False), ("bert", True)]


def case_id(case):
    return f"{case[0]}-{'compiled' if case[1] else 'eager'}"


@needs_varlen
@pytest.mark.parametrize("kind, compiled", CASES_FLOAT32, ids=map(case_id, CASES_FLOAT32))
def test_pack_multiple_step_on_the_varlen_kernel_equals_the_padded_step_in_float32(kind, compiled, standin,
                                                                                   monkeypatch):
    """Exact: every gradient equals the padded model's, to test_packing.py's float32 tolerances.

    FlashAttention takes only fp16 / bf16, and in bf16 a gradient that is a small difference of large
    terms (attention gradients of a tiny, nearly uniform model) is rounding noise on both sides, so
    it cannot be compared entry by entry there. Here the glue is let through in float32 (the stand-in
    computes in float32 anyway); everything else is the real path. The bf16 run is the next test.
    """
    monkeypatch.setattr(packed_attention, "VARLEN_DTYPES", packed_attention.VARLEN_DTYPES + (torch.float32,))
    for (loss, grads), (ref_loss, ref_grads) in packed_and_padded_steps(kind, None, compiled):
        assert_finite(grads)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        assert grads.keys() == ref_grads.keys()
        for name in ref_grads:
            torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)


@needs_varlen
@pytest.mark.parametrize("kind, compiled", CASES_BFLOAT16, ids=map(case_id, CASES_BFLOAT16))
def test_pack_multiple_step_on_the_varlen_kernel_in_bfloat16_is_finite_and_the_padded_step(kind, compiled, standin):
    """As on a GPU: bf16 autocast on both sides, float32 weights and gradients.

    Compared as one vector of all gradients: bf16 (8 bits of mantissa) makes the padded step itself
    differ from its float32 self by 0.3-0.7% in norm over these batches; the packed step differs from
    the padded one by at most 0.13%. So 1% is bf16's own error: it catches unwritten rows (NaN here,
    garbage on a GPU) and a wrong layout, but not subtler mistakes (the tail merged into the last
    review moves the gradients by 0.4-0.7%), which the float32 test above catches entry by entry.
    """
    for (loss, grads), (ref_loss, ref_grads) in packed_and_padded_steps(kind, torch.bfloat16, compiled):
        assert_finite(grads)
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-4)
        assert grads.keys() == ref_grads.keys()
        got, expected = (torch.cat([g[name].flatten() for name in ref_grads]) for g in (grads, ref_grads))
        assert (got - expected).norm() <= 1e-2 * expected.norm()


# --------------------------------------------------------------------------- the bound on --pack-multiple

def test_pack_multiple_longer_than_max_length_is_refused(tiny_args, tmp_path, monkeypatch, capfd):
    """The rounding tail is one more attention sequence, so it must fit in --max-length (exit 2, one line)."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    capfd.readouterr()
    assert main(tiny_args("--pack", "--pack-multiple", "65", out=out)) == EXIT_BAD_INPUT  # --max-length 64
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("error: ") and "--pack-multiple 65 exceeds --max-length 64" in err[0], err[0]
    assert not out.exists() and not (tmp_path / "runs").exists()


def test_the_collator_refuses_what_the_kernel_cannot_cover():
    with pytest.raises(ValueError, match="multiple 65 exceeds max_length 64"):
        PackedCollator(pad_id=0, multiple=65, max_length=64)
    with pytest.raises(ValueError, match="65 tokens exceeds max_length 64"):
        PackedCollator(pad_id=0, max_length=64)(make_items([3, 65]))
    assert PackedCollator(pad_id=0, multiple=64, max_length=64)(make_items([3]))["num_tokens"] == 64
