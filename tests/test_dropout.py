"""Cheaper dropout masks (fastpt/speedups/dropout.py): the keep rate and independence of the 16-bit masks
(tested statistically), the scale, the gradient, eval mode, the model swap, compiled use, and a resumed
run with them bitwise equal to an uninterrupted one.

The statistical bounds are 5 standard deviations of the statistic under the hypothesis (keep rate
exactly 58982/65536, independent elements): a correct mask fails one such check with probability
below 6e-7, and the masks come from fixed seeds, so each check is deterministic anyway.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from test_optimization import stop_at_step
from test_reliability import assert_same_run, checkpoint_step, fault_rng, flags, results
from transformers import AutoModelForSequenceClassification, DistilBertConfig

from fastpt.errors import EXIT_STOPPED
from fastpt.speedups import dropout
from fastpt.strategies.base import Strategy
from train import main

P = 0.1
N = 1 << 20  # elements: a keep rate to +-5 x 3e-4, a correlation to +-5 x 1e-3


def masks(seed: int, shape=(N,), count: int = 1) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    return [(~dropout.drop_mask(torch.Size(shape), P, torch.device("cpu"))).double() for _ in range(count)]


def test_the_quantised_keep_rate_is_1_minus_p_to_16_bits():
    assert dropout.dropped_levels(P) == 6554 and dropout.keep_rate(P) == 1 - 6554 / 65536
    assert abs(dropout.keep_rate(P) - (1 - P)) < 2e-5
    assert all(abs(dropout.keep_rate(p) - (1 - p)) <= 0.5 / 65536 for p in (0.01, 0.1, 0.25, 0.5, 0.9))


def test_keep_rate_passes_a_binomial_test():
    q = dropout.keep_rate(P)
    for seed in range(3):
        kept = masks(seed)[0].sum().item()
        z = (kept - N * q) / math.sqrt(N * q * (1 - q))
        assert abs(z) < 5, (seed, z)


def correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a - a.mean(), b - b.mean()
    return float((a * b).sum() / math.sqrt(float((a * a).sum() * (b * b).sum())))


def test_neighbours_and_successive_masks_are_uncorrelated():
    """Independent elements have a sample correlation of mean 0 and standard deviation 1 / sqrt(n) (n pairs).
    Lags 1-3 pair slices of one 64-bit word, lag 4 neighbouring words; two successive masks, one draw apart."""
    first, second = masks(0, count=2)
    for lag in (1, 2, 3, 4, 384):
        n = N - lag
        assert abs(correlation(first[:-lag], first[lag:])) < 5 / math.sqrt(n), lag
    assert abs(correlation(first, second)) < 5 / math.sqrt(N)
    assert not torch.equal(first, second)


def test_the_scale_keeps_the_mean_and_the_gradient_is_mask_times_scale():
    torch.manual_seed(0)
    ones = torch.ones(N)
    out = dropout.cheap_dropout(ones, P)
    q = dropout.keep_rate(P)
    assert abs(out.mean().item() - 1) < 5 * math.sqrt(q * (1 - q) / N) / q  # out = B / q, B ~ Bernoulli(q)
    assert set(out.unique().tolist()) == {0.0, torch.tensor(1 / q).item()}  # 1 / q in float32
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(64, 48, dtype=dtype).add_(5).requires_grad_()  # no zero in x: out == 0 marks a drop
        grad = torch.randn(64, 48, dtype=dtype)
        out = dropout.cheap_dropout(x, P)
        out.backward(grad)
        dropped = out == 0
        assert 0 < dropped.sum() < dropped.numel()
        assert torch.equal(out, (x.detach() * (1 / q)).masked_fill(dropped, 0))
        assert torch.equal(x.grad, (grad * (1 / q)).masked_fill(dropped, 0))


def test_the_masks_are_drawn_from_torchs_generator():
    torch.manual_seed(3)
    state = torch.get_rng_state()
    a = dropout.drop_mask(torch.Size([1000]), P, torch.device("cpu"))
    torch.set_rng_state(state)
    assert torch.equal(a, dropout.drop_mask(torch.Size([1000]), P, torch.device("cpu")))
    assert not torch.equal(a, dropout.drop_mask(torch.Size([1000]), P, torch.device("cpu")))


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = DistilBertConfig(vocab_size=100, dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=16)
    return AutoModelForSequenceClassification.from_config(config, attn_implementation="sdpa")


def test_apply_swaps_every_dropout_keeps_p_and_eval_is_the_identity():
    reference, model = tiny_model(), tiny_model()
    before = {name: m.p for name, m in model.named_modules() if isinstance(m, torch.nn.Dropout)}
    dropout.apply_cheap_dropout(model)
    after = {name: m.p for name, m in model.named_modules() if isinstance(m, dropout.CheapDropout)}
    assert after == before and len(after) >= 5
    assert model.state_dict().keys() == reference.state_dict().keys()
    ids = torch.randint(0, 100, (2, 16))
    reference.eval(), model.eval()
    assert torch.equal(model(ids).logits, reference(ids).logits)
    x = torch.randn(8)
    layer = dropout.CheapDropout(P).eval()
    assert layer(x) is x and dropout.CheapDropout(0.0)(x) is x
    model.train()
    torch.manual_seed(1)
    assert not torch.equal(model(ids).logits, model(ids).logits)  # training: masks drawn, each call anew


@pytest.mark.slow  # a 16 s compile on 2 cores
def test_compiled_uses_inductors_masks_in_one_graph():
    """Under torch.compile the layer is F.dropout (Inductor draws the mask in its kernel): one graph, a valid mask."""
    layer = dropout.CheapDropout(P)
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    x = torch.randn(256, 64).add_(5)
    out = compiled(x)
    kept = out != 0
    assert torch.allclose(out[kept], x[kept] / (1 - P))
    assert abs(kept.double().mean().item() - (1 - P)) < 5 * math.sqrt(P * (1 - P) / x.numel())
    torch.manual_seed(0)
    first = compiled(x)
    torch.manual_seed(0)
    assert torch.equal(compiled(x), first)  # seeded from torch's generator, as eager
    layer.eval()
    assert torch.equal(compiled(x), x)


@pytest.mark.slow  # four tiny runs (~25 s); the default set keeps the swap and the masks' statistics
def test_a_stopped_run_with_cheap_dropout_resumes_bitwise(imdb_dir, cache_dir, tmp_path, monkeypatch):
    """Resumed == uninterrupted (the masks come from the RNG state last.pt keeps), and a run with
    nn.Dropout's masks (the default) differs: the flag is applied."""
    reference, out, plain = tmp_path / "reference", tmp_path / "run", tmp_path / "plain"
    cheap = ("--cheap-dropout", "--epochs", "1")  # 6 steps (a second epoch would test nothing more here)
    assert main(flags(imdb_dir, cache_dir, reference, *cheap)) == 0
    assert json.loads((reference / "config.json").read_text())["cheap_dropout"] is True
    stop = fault_rng().randint(1, 5)  # of 6 steps
    with monkeypatch.context() as patch:
        stop_at_step(patch, Strategy, stop)
        assert main(flags(imdb_dir, cache_dir, out, *cheap)) == EXIT_STOPPED
    assert checkpoint_step(out) == stop
    assert main(flags(imdb_dir, cache_dir, out, *cheap, "--resume", "auto")) == 0
    assert_same_run(reference, out)
    assert main(flags(imdb_dir, cache_dir, plain, "--epochs", "1")) == 0
    assert json.loads((plain / "config.json").read_text())["cheap_dropout"] is False
    assert results(plain)["history"] != results(reference)["history"]


@pytest.mark.parametrize("p", [0.0, 1.0])
def test_the_ends_of_p(p):
    x = torch.randn(100)
    assert torch.equal(dropout.cheap_dropout(x, p), F.dropout(x, p, True))
