"""Padding-free batches: the same reviews packed or padded give the same logits and gradients.

Tiny DistilBERT and BERT (MiniLM-like) models, fp32, dropout off. The reference is the plain
Hugging Face model on the padded batch with an attention mask (SDPA). Compiled runs use the
"aot_eager" backend: it traces forward and backward exactly as Inductor would receive them,
without spending minutes in a C++ compiler on a small CPU.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForSequenceClassification, BertConfig, DistilBertConfig

from fastpt.inputs.data import Collator
from fastpt.speedups import packed_attention
from fastpt.speedups.compile import compile_layers, mark_token_dim_dynamic
from fastpt.speedups.packed_attention import apply_packed_attention, packed_attention_kernel
from fastpt.speedups.packing import PackedClassifier, PackedCollator, is_packed, packed_logits, unwrap


MAX_LENGTH = 64
CPU_KERNELS = ("loop", "mask")
LENGTHS = [9, 30, 2, MAX_LENGTH, 17, 60, 28, 58]  # short and long reviews, one as long as the model allows


def tiny_model(kind: str, seed: int = 0, attention_dropout: float = 0.0):
    torch.manual_seed(seed)
    if kind == "distilbert":
        config = DistilBertConfig(vocab_size=100, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                                  max_position_embeddings=MAX_LENGTH, dropout=0.0,
                                  attention_dropout=attention_dropout, seq_classif_dropout=0.0)
    else:
        config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=64, max_position_embeddings=MAX_LENGTH, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=attention_dropout)
    return AutoModelForSequenceClassification.from_config(config, attn_implementation="sdpa")


def make_items(lengths, seed: int = 0):
    """(tokens, label, weight) items as TokenizedSplit yields them; tokens avoid the pad id 0."""
    rng = np.random.default_rng(seed)
    return [(rng.integers(1, 100, size=n).astype(np.int32), int(rng.integers(0, 2)), 1.0) for n in lengths]


def random_lengths(n: int, seed: int):
    return np.random.default_rng(seed).integers(2, MAX_LENGTH + 1, size=n).tolist()


def padded_logits(model, items):
    batch = Collator(pad_id=0, pad_to="longest", max_length=MAX_LENGTH)(items)
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


def logits_and_grads(forward, model, seed: int = 1):
    """Logits, and each parameter's gradient of a fixed random combination of them."""
    model.zero_grad(set_to_none=True)
    logits = forward()
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(seed))
    (logits * weights).sum().backward()
    parameters = unwrap(model).named_parameters()  # no `_orig_mod.` prefix
    return logits.detach(), {name: p.grad.clone() for name, p in parameters if p.grad is not None}


def assert_same(got, expected, rtol=1e-5, atol=1e-6):
    (logits, grads), (ref_logits, ref_grads) = got, expected
    torch.testing.assert_close(logits, ref_logits, rtol=rtol, atol=atol)
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=rtol, atol=atol, msg=name)


# --------------------------------------------------------------------------- the collator

def test_collator_lays_reviews_end_to_end_with_offsets_and_positions():
    items = make_items([3, 5, 2])
    batch = PackedCollator(pad_id=0)(items)
    assert batch["input_ids"].shape == (1, 10) and batch["input_ids"].dtype == torch.long
    assert batch["input_ids"][0].tolist() == np.concatenate([t for t, _, _ in items]).tolist()
    assert batch["position_ids"][0].tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1]
    assert batch["cu_seqlens"].dtype == torch.int32 and batch["cu_seqlens"].tolist() == [0, 3, 8, 10]
    assert batch["labels"].tolist() == [label for _, label, _ in items] and batch["labels"].dtype == torch.long
    assert batch["weight"].dtype == torch.float32
    assert all(type(n) is int for n in batch["lengths"]) and sum(batch["lengths"]) == batch["num_tokens"] == 10
    assert is_packed(batch) and not is_packed(Collator(0, "longest", MAX_LENGTH)(items))


def test_collator_rounds_the_stream_with_pad_tokens_outside_every_review():
    items = make_items([3, 5, 2])
    batch = PackedCollator(pad_id=7, multiple=8)(items)
    assert batch["num_tokens"] == 16 and batch["input_ids"].shape == (1, 16)
    assert sum(batch["lengths"]) == 10 and batch["cu_seqlens"].tolist() == [0, 3, 8, 10]
    assert batch["input_ids"][0, 10:].tolist() == [7] * 6
    assert batch["position_ids"][0, 10:].tolist() == [0] * 6  # a valid position, read by nobody
    assert PackedCollator(pad_id=0, multiple=5)(make_items([5]))["num_tokens"] == 5  # already a multiple


def test_collator_refuses_empty_reviews_and_bad_multiples():
    with pytest.raises(ValueError, match="empty review"):
        PackedCollator(pad_id=0)(make_items([3, 0]))
    with pytest.raises(ValueError, match="multiple"):
        PackedCollator(pad_id=0, multiple=0)


# --------------------------------------------------------------------------- packed == padded

@pytest.mark.parametrize("multiple", [None, 16])
@pytest.mark.parametrize("kernel", CPU_KERNELS)
@pytest.mark.parametrize("kind", ["distilbert", "bert"])
def test_packed_matches_padded_logits_and_gradients(kind, kernel, multiple):
    reference = tiny_model(kind).eval()
    packed = PackedClassifier(copy.deepcopy(reference), kernel).eval()
    items = make_items(LENGTHS)
    batch = PackedCollator(pad_id=0, multiple=multiple)(items)
    assert_same(logits_and_grads(lambda: packed_logits(packed, batch, MAX_LENGTH), packed),
                logits_and_grads(lambda: padded_logits(reference, items), reference))


def test_rounding_tokens_change_no_review():
    packed = PackedClassifier(tiny_model("bert"), "mask").eval()
    items = make_items([9, 30, 2])
    exact = packed_logits(packed, PackedCollator(pad_id=0)(items), MAX_LENGTH)
    rounded = packed_logits(packed, PackedCollator(pad_id=0, multiple=64)(items), MAX_LENGTH)
    torch.testing.assert_close(rounded, exact, rtol=1e-5, atol=1e-6)


def test_packed_attention_applies_no_attention_dropout():
    """Documented behaviour: varlen_attn has no dropout, so no packed kernel drops attention."""
    packed = PackedClassifier(tiny_model("distilbert", attention_dropout=0.5), "loop")
    batch = PackedCollator(pad_id=0)(make_items([9, 30]))
    train_logits = packed_logits(packed.train(), batch, MAX_LENGTH)
    torch.testing.assert_close(train_logits, packed_logits(packed.eval(), batch, MAX_LENGTH))


def test_the_switched_model_still_runs_padded_batches():
    reference = tiny_model("distilbert").eval()
    switched = apply_packed_attention(copy.deepcopy(reference))
    items = make_items([9, 30, 2])
    torch.testing.assert_close(padded_logits(switched, items), padded_logits(reference, items))


def test_packed_logits_wants_a_packed_classifier_and_kernel_choice():
    with pytest.raises(TypeError, match="PackedClassifier"):
        packed_logits(tiny_model("bert"), PackedCollator(0)(make_items([3])), MAX_LENGTH)
    with pytest.raises(ValueError, match="kernel"):
        PackedClassifier(tiny_model("bert"), "flash")
    assert packed_attention_kernel("cpu", compiled=False) == "loop"
    assert packed_attention_kernel("cpu", compiled=True) == "loop"
    assert packed_attention_kernel("cuda", compiled=True, low_precision=False) == "mask"


def reference_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None):
    """What `varlen_attn` computes, on the CPU: tokens-first [T, heads, head_dim]; rows outside
    `cu_seq_q` are left unwritten (NaN here, whatever memory held on the GPU)."""
    assert query.dim() == 3 and cu_seq_q.dtype == torch.int32 and type(max_q) is int
    out = torch.full_like(query, float("nan"))
    edges = cu_seq_q.tolist()
    for start, end in zip(edges[:-1], edges[1:]):
        assert end - start <= max_q
        q, k, v = (x[start:end].transpose(0, 1) for x in (query, key, value))
        out[start:end] = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale).transpose(0, 1)
    return out


def test_varlen_kernel_layout_and_rounding_tail(monkeypatch):
    """The CUDA kernel's glue (layout, offsets, the unwritten tail) checked on the CPU with a stand-in."""
    monkeypatch.setattr(torch.nn.attention.varlen, "varlen_attn", reference_varlen_attn)
    model = tiny_model("bert").to(torch.bfloat16)
    reference = PackedClassifier(copy.deepcopy(model), "loop").eval()
    varlen = PackedClassifier(model, "varlen").eval()
    batch = PackedCollator(pad_id=0, multiple=16)(make_items([9, 30, 2]))
    got = logits_and_grads(lambda: packed_logits(varlen, batch, MAX_LENGTH), varlen)
    assert all(grad.isfinite().all() for grad in got[1].values())
    expected = logits_and_grads(lambda: packed_logits(reference, batch, MAX_LENGTH), reference)
    # bf16: the two differ by rounding (a few units in the last place of the largest entries);
    # a wrong layout or offset would be off by the size of the entries themselves. (Key biases
    # have no gradient in exact arithmetic, hence the absolute floor.)
    for got_tensor, expected_tensor in [(got[0], expected[0])] + [(got[1][n], g) for n, g in expected[1].items()]:
        scale = expected_tensor.float().abs().max().item()
        torch.testing.assert_close(got_tensor.float(), expected_tensor.float(), rtol=0, atol=0.02 * scale + 1e-6)
    with pytest.raises(ValueError, match="fp16 or bf16"):
        packed_logits(PackedClassifier(tiny_model("bert"), "varlen"), batch, MAX_LENGTH)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashAttention's varlen kernel runs on CUDA")
@pytest.mark.parametrize("kind", ["distilbert", "bert"])
def test_varlen_kernel_on_cuda_matches_the_mask_kernel(kind):
    model = tiny_model(kind).cuda()
    masked = PackedClassifier(copy.deepcopy(model), "mask").eval()
    varlen = PackedClassifier(model, "varlen").eval()
    batch = PackedCollator(pad_id=0, multiple=64)(make_items([9, 30, 2, MAX_LENGTH]))
    batch = {key: value.cuda() if torch.is_tensor(value) else value for key, value in batch.items()}
    results = []
    for packed in (varlen, masked):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            results.append(logits_and_grads(lambda: packed_logits(packed, batch, MAX_LENGTH).float(), packed))
    (logits, grads), (ref_logits, ref_grads) = results
    torch.testing.assert_close(logits, ref_logits, rtol=2e-2, atol=2e-2)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=5e-2, atol=5e-2, msg=name)


# --------------------------------------------------------------------------- torch.compile

@pytest.mark.parametrize("kind,kernel", [("distilbert", "mask"), ("bert", "mask"), ("distilbert", "loop"),
                                         ("bert", "loop")])
def test_compiled_packed_matches_eager_with_one_graph_for_all_lengths(kind, kernel):
    # The loop kernel's host read and data-dependent split are inside one custom operator: the
    # compiler sees an op of the query's shape, so fullgraph holds and one graph serves every length.
    torch._dynamo.reset()
    eager = PackedClassifier(tiny_model(kind), kernel).eval()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(copy.deepcopy(eager), backend=counter, fullgraph=True)
    for step in range(20):
        batch = mark_token_dim_dynamic(PackedCollator(pad_id=0)(make_items(random_lengths(4, seed=step), seed=step)))
        got = logits_and_grads(lambda: packed_logits(compiled, batch, MAX_LENGTH), compiled)
        if step < 3:  # the first graph, and two new lengths through it
            assert_same(got, logits_and_grads(lambda: packed_logits(eager, batch, MAX_LENGTH), eager))
    assert counter.frame_count == 1  # the token dimension was marked dynamic before the first call


@pytest.mark.parametrize("kind", ["distilbert", "bert"])
def test_layer_by_layer_compile_matches_eager_with_one_graph_for_every_layer_and_length(kind, monkeypatch):
    # --compile-scope layers: each layer compiled in place, and Dynamo's one graph of the first layer
    # serves the second (same class, parameters passed in as inputs) and every packed length.
    torch._dynamo.reset()
    eager = PackedClassifier(tiny_model(kind), "loop")
    counter = CompileCounterWithBackend("aot_eager")
    compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda target, **options: compile(target, **{**options, "backend": counter}))
    compiled = compile_layers(copy.deepcopy(eager), dynamic_tokens=True)
    assert compiled.state_dict().keys() == eager.state_dict().keys()  # in place: no `_orig_mod.` anywhere
    with torch._dynamo.config.patch(specialize_float=True):  # as a compiled run sets it (compile.py)
        for step in range(4):
            batch = PackedCollator(pad_id=0)(make_items(random_lengths(4, seed=step), seed=step))
            assert_same(logits_and_grads(lambda: packed_logits(compiled, batch, MAX_LENGTH), compiled),
                        logits_and_grads(lambda: packed_logits(eager, batch, MAX_LENGTH), eager))
    assert counter.frame_count == 1


def test_compiled_static_shapes_compile_once_per_rounded_size():
    torch._dynamo.reset()
    packed = PackedClassifier(tiny_model("distilbert"), "mask").eval()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(packed, backend=counter, fullgraph=True)
    sizes = set()
    # Forward only: the number of graphs is decided there; keep every size static.
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False), torch.no_grad():
        for step in range(10):
            batch = PackedCollator(pad_id=0, multiple=64)(make_items(random_lengths(4, seed=step), seed=step))
            sizes.add(batch["num_tokens"])
            packed_logits(compiled, batch, MAX_LENGTH)
    assert 1 < len(sizes) < 10 and counter.frame_count == len(sizes)


# --------------------------------------------------------------------------- host reads

HOST_READS = ("_local_scalar_dense", "item", "nonzero", "equal", "is_nonzero", "masked_select",
              "_unique", "unique_dim", "unique_consecutive", "_unique2", "repeat_interleave")


class RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def host_reads_of(kernel: str) -> set[str]:
    packed = PackedClassifier(tiny_model("bert"), kernel).eval()
    batch = PackedCollator(pad_id=0, multiple=16)(make_items([9, 30, 2]))
    with RecordOps() as recorder:
        packed_logits(packed, batch, MAX_LENGTH).sum().backward()
    return {op for op in recorder.ops if op in HOST_READS}


def test_the_recorder_sees_a_host_read():
    with RecordOps() as recorder:
        torch.ones(3).sum().item()
    assert "_local_scalar_dense" in recorder.ops


def test_mask_kernel_reads_nothing_back_to_the_host():
    assert host_reads_of("mask") == set()


def run_on_meta(kernel: str) -> None:
    """Forward and backward on meta tensors, which hold no data: any read back to the host raises.

    This also catches `Tensor.tolist()`, which on a CPU tensor reads memory without an aten op
    that a dispatch mode could see.
    """
    packed = PackedClassifier(tiny_model("bert"), kernel).to("meta")
    batch = PackedCollator(pad_id=0, multiple=16)(make_items([9, 30, 2]))
    batch = {key: value.to("meta") if torch.is_tensor(value) else value for key, value in batch.items()}
    packed_logits(packed, batch, MAX_LENGTH).sum().backward()


def test_mask_kernel_runs_without_data():
    run_on_meta("mask")


def test_loop_kernel_reads_the_offsets_only_inside_its_operator():
    """It cuts the stream at offsets read on the host (one sync per layer on a GPU), inside a custom
    operator whose shape rule needs no data: that is what lets a compiled graph hold it."""
    run_on_meta("loop")
    with pytest.raises(NotImplementedError, match="meta"):
        packed_attention._attend_each_review(*(torch.empty(1, 2, 8, 4, device="meta") for _ in range(3)),
                                             torch.tensor([0, 3, 8], device="meta"), 0.5)


# --------------------------------------------------------------------------- checkpoints

def test_checkpoint_from_packed_training_loads_into_a_plain_model():
    packed = PackedClassifier(tiny_model("bert"), "loop").train()
    optimizer = torch.optim.AdamW(packed.parameters(), lr=1e-2)
    for step in range(3):
        batch = PackedCollator(pad_id=0)(make_items(random_lengths(4, seed=step), seed=step))
        loss = torch.nn.functional.cross_entropy(packed_logits(packed, batch, MAX_LENGTH), batch["labels"])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    state = unwrap(torch.compile(packed)).state_dict()
    plain = tiny_model("bert", seed=1).eval()
    assert list(state) == list(plain.state_dict())
    plain.load_state_dict(state, strict=True)
    items = make_items([9, 30, 2])
    torch.testing.assert_close(padded_logits(plain, items),
                               packed_logits(packed.eval(), PackedCollator(pad_id=0)(items), MAX_LENGTH),
                               rtol=1e-5, atol=1e-6)
