"""Single-device speed-ups, each checked against a reference on the CPU with tiny models.

Mixed precision: low-precision activations, float32 master weights, a scaler that skips an
inf step and clips the true (unscaled) gradients. Compile: same loss, gradients and
evaluation as eager, one graph for every bucketed length, interchangeable checkpoints.
Gradient accumulation: N micro-batches give the gradients of one N-times-larger batch.
Deterministic mode: two runs are bitwise equal. Plus the MFU formula against a FLOP counter,
the throughput meter's warm-up handling and the loader / optimiser settings.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from fastpt.inputs import data, models
from fastpt.config import TrainConfig
from fastpt.loop.evaluation import evaluate
from fastpt.loop.step import classify, make_forward_loss
from fastpt.monitoring import metrics
from fastpt.files.checkpoint import load_model_weights
from fastpt.cluster.distributed import DistInfo
from fastpt.speedups import backends
from fastpt.strategies import build_strategy
from fastpt.strategies.base import Strategy
from train import main


CPU = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
TINY_CONFIG = models.tiny_config  # kept: tests swap models.tiny_config for the dropout-free one


def no_dropout_tiny_config(n_layers: int = 2, dropout: float = 0.0):
    config = TINY_CONFIG()
    config.n_layers, config.dropout, config.attention_dropout, config.seq_classif_dropout = n_layers, dropout, 0.0, 0.0
    return config


def tiny_strategy(n_layers: int = 2, dropout: float = 0.0, **settings) -> tuple[Strategy, torch.nn.Module]:
    """A set-up strategy on a tiny model (dropout-free unless asked), and an untouched eager copy of that model."""
    torch.manual_seed(0)
    model = models._from_config(no_dropout_tiny_config(n_layers, dropout), "sdpa")
    reference = copy.deepcopy(model)
    strategy = build_strategy(TrainConfig(model="tiny", **settings), CPU)
    strategy.setup(model)
    return strategy, reference


def make_batch(batch_size: int = 4, length: int = 24, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1000, 3000, (batch_size, length), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, length // 2:] = 0  # one padded row
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "labels": torch.randint(0, 2, (batch_size,), generator=g), "weight": torch.ones(batch_size)}


def forward_logits(strategy, batch) -> torch.Tensor:
    with strategy.precision.autocast():
        return classify(strategy.model, batch, max_length=512)


def train_loss(strategy, batch) -> torch.Tensor:
    forward_loss = strategy.compile_step(make_forward_loss(strategy.precision, max_length=512))
    loss, _ = forward_loss(strategy.model, strategy.to_device(batch))
    return loss


def grads(module) -> dict:
    return {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}


# --------------------------------------------------------------------------- mixed precision

@pytest.mark.parametrize("amp,dtype,expected", [(False, "float16", torch.float32),
                                                (True, "float16", torch.float16),
                                                (True, "bfloat16", torch.bfloat16)])
def test_autocast_runs_matmuls_low_precision_and_keeps_float32_master_weights(amp, dtype, expected):
    strategy, _ = tiny_strategy(amp=amp, amp_dtype=dtype)
    seen = []
    linear = strategy.module.distilbert.transformer.layer[0].attention.q_lin
    linear.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    batch = make_batch()
    strategy.backward(train_loss(strategy, batch))
    assert all(p.grad.dtype == torch.float32 for p in strategy.module.parameters() if p.grad is not None)
    strategy.optimizer_step()
    assert all(p.dtype == torch.float32 for p in strategy.module.parameters())
    assert all(s.dtype == torch.float32 for st in strategy.optimizer.state.values() for s in st.values()
               if torch.is_tensor(s) and s.numel() > 1)
    assert strategy.grad_scaler.is_enabled() == (amp and dtype == "float16")  # bf16 needs no scaler
    evaluate(strategy, [batch])  # evaluation runs under the same autocast
    assert seen == [expected, expected]


def test_grad_scaler_skips_a_step_with_inf_gradients_then_recovers():
    strategy, _ = tiny_strategy(amp=True, amp_dtype="float16")
    scaler = strategy.grad_scaler
    scale = scaler.get_scale()
    before = {n: p.detach().clone() for n, p in strategy.module.named_parameters()}
    strategy.backward(train_loss(strategy, make_batch()))
    strategy.module.classifier.weight.grad[0, 0] = float("inf")
    strategy.optimizer_step()
    assert all(torch.equal(p, before[n]) for n, p in strategy.module.named_parameters())  # step skipped
    assert scaler.get_scale() == scale / 2  # and the scale backed off
    assert strategy.training_state(None)["scaler"]["scale"] == scale / 2  # what last.pt keeps
    strategy.backward(train_loss(strategy, make_batch(seed=1)))
    strategy.optimizer_step()
    assert not torch.equal(strategy.module.classifier.weight, before["classifier.weight"])  # stepping again
    assert scaler.get_scale() == scale / 2
    restored, _ = tiny_strategy(amp=True, amp_dtype="float16")
    restored.load_training_state(strategy.training_state(None), None)
    assert restored.grad_scaler.get_scale() == scale / 2


def test_clipping_sees_the_unscaled_gradients(monkeypatch):
    strategy, _ = tiny_strategy(amp=True, amp_dtype="float16", max_grad_norm=1e9)
    norms = []
    clip = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda *a, **k: norms.append(clip(*a, **k)) or norms[-1])
    strategy.backward(train_loss(strategy, make_batch()))
    scaled = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads(strategy.module).values()]))
    true_norm = scaled / strategy.grad_scaler.get_scale()
    strategy.optimizer_step()
    assert len(norms) == 1
    torch.testing.assert_close(norms[0], true_norm, rtol=1e-4, atol=0)


# --------------------------------------------------------------------------- torch.compile

@pytest.mark.slow  # two Inductor compiles (train, eval): ~40 s on an idle 2-core CPU, minutes when loaded
@pytest.mark.parametrize("scope", ["whole", "layers"])
def test_compiled_step_matches_eager_for_every_bucketed_length_and_checkpoints_interchange(scope, tmp_path):
    torch._dynamo.reset()
    settings = dict(compile=True, compile_scope=scope, bucket=True)  # bucket: dynamic padding
    backends.configure(SimpleNamespace(**settings, deterministic=False, tf32=False), CPU.device, tmp_path)
    try:
        # Layer by layer, two layers: the second runs the first one's graph.
        check_compiled_step_matches_eager(*tiny_strategy(n_layers=2 if scope == "layers" else 1, dropout=0.1,
                                                         **settings))
    finally:
        backends.restore(SimpleNamespace(**settings, deterministic=False))


def check_compiled_step_matches_eager(strategy, eager):
    # One device: the step function (whole) or each layer in place (layers) is compiled; the model stays itself.
    assert strategy.model is strategy.module
    graphs = metrics.compiled_graph_count()
    forward_loss = strategy.compile_step(make_forward_loss(strategy.precision, max_length=512))  # as train.py
    # Dropout on: on a CPU the compiled graph draws eager's masks (backends.configure), from the same seed.
    strategy.train(True)
    eager.train()
    for i, length in enumerate((40, 33, 57)):
        batch = make_batch(length=length, seed=i)
        # fullgraph=True: a graph break is an error. After the first length, so is a recompile:
        # the token dimension is marked dynamic, so one graph serves all.
        torch.manual_seed(i)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            loss, sums = forward_loss(strategy.model, strategy.to_device(batch))
            loss.backward()
        torch.manual_seed(i)
        eager_logits = eager(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        eager_loss = F.cross_entropy(eager_logits, batch["labels"])
        eager_loss.backward()
        torch.testing.assert_close(loss, eager_loss, rtol=1e-4, atol=1e-5)
        correct = (eager_logits.argmax(-1) == batch["labels"]).sum().item()
        assert sums[1].item() == correct and sums[2].item() == 4  # the metric sums come out of the same graph
        compiled_grads, eager_grads = grads(strategy.module), grads(eager)
        assert compiled_grads.keys() == eager_grads.keys()
        for name in eager_grads:
            torch.testing.assert_close(compiled_grads[name], eager_grads[name], rtol=1e-3, atol=1e-5, msg=name)
        strategy.optimizer.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)
    batches = [make_batch(length=n, seed=n) for n in (20, 31)]
    compiled_eval = evaluate(strategy, batches)  # evaluation under compile
    eager.eval()
    with torch.no_grad():
        losses = [F.cross_entropy(eager(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits,
                                  b["labels"], reduction="sum") for b in batches]
    assert compiled_eval["n"] == 8
    assert metrics.compiled_graph_count() - graphs == 2  # training and evaluation: one graph each, every length
    assert compiled_eval["loss"] == pytest.approx(float(sum(losses)) / 8, rel=1e-4)

    # Checkpoints carry no `_orig_mod.` prefix and move both ways between compiled and eager.
    state = strategy.model_state_dict()
    assert state.keys() == eager.state_dict().keys()
    with torch.no_grad():
        for p in eager.parameters():
            p.mul_(1.01)
    strategy.load_model_state_dict(eager.state_dict())
    strategy.train(False)
    probe = make_batch(length=29, seed=9)
    with torch.no_grad():
        expected = eager(input_ids=probe["input_ids"], attention_mask=probe["attention_mask"]).logits
        compiled_loss, _ = forward_loss(strategy.model, strategy.to_device(probe))
        torch.testing.assert_close(compiled_loss, F.cross_entropy(expected, probe["labels"]), rtol=1e-4, atol=1e-5)
        eager.load_state_dict(state)
        torch.testing.assert_close(eager.classifier.weight, state["classifier.weight"])


# --------------------------------------------------------------------------- through the training loop

def record_step_grads(monkeypatch) -> list:
    recorded = []
    step = Strategy.optimizer_step

    def recording_step(self):
        recorded.append(grads(self.module))
        step(self)

    monkeypatch.setattr(Strategy, "optimizer_step", recording_step)
    return recorded


def test_grad_accumulation_equals_one_larger_batch(tiny_args, tmp_path, monkeypatch):
    monkeypatch.setattr(models, "tiny_config", no_dropout_tiny_config)
    recorded = record_step_grads(monkeypatch)
    common = ("--epochs", "1", "--max-steps", "1", "--no-tensorboard")
    assert main(tiny_args(*common, "--batch-size", "8", out=tmp_path / "big")) == 0
    assert main(tiny_args(*common, "--batch-size", "4", "--grad-accum", "2", out=tmp_path / "accum")) == 0
    big, accumulated = recorded
    assert big.keys() == accumulated.keys()
    for name in big:
        torch.testing.assert_close(accumulated[name], big[name], rtol=1e-4, atol=1e-7, msg=name)


def test_a_short_last_accumulation_group_is_averaged_over_its_own_batches(tiny_args, tmp_path, monkeypatch):
    # 3 batches of 4 with --grad-accum 2: the epoch ends on a group of one batch, whose gradient
    # must be that batch's own mean gradient (not half of it). A vanishing learning rate keeps
    # the weights where they started, so the reference is the third step of an unaccumulated run.
    monkeypatch.setattr(models, "tiny_config", no_dropout_tiny_config)
    recorded = record_step_grads(monkeypatch)
    common = ("--epochs", "1", "--train-size", "12", "--batch-size", "4", "--lr", "1e-12", "--no-tensorboard")
    assert main(tiny_args(*common, out=tmp_path / "plain")) == 0
    assert main(tiny_args(*common, "--grad-accum", "2", out=tmp_path / "accum")) == 0
    assert len(recorded) == 3 + 2
    third_batch, short_group = recorded[2], recorded[4]
    for name in third_batch:
        torch.testing.assert_close(short_group[name], third_batch[name], rtol=1e-4, atol=1e-7, msg=name)


def test_deterministic_mode_gives_bitwise_equal_runs(tiny_args, tmp_path, monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    enabled_while_training = []
    step = Strategy.optimizer_step
    monkeypatch.setattr(Strategy, "optimizer_step", lambda self: enabled_while_training.append(
        torch.are_deterministic_algorithms_enabled()) or step(self))
    runs = []
    try:
        for name in ("a", "b"):
            out = tmp_path / name
            flags = ("--deterministic", "--epochs", "1", "--max-steps", "4", "--no-tensorboard")
            assert main(tiny_args(*flags, out=out)) == 0
            assert not torch.are_deterministic_algorithms_enabled()  # a process-wide switch, turned back off
            runs.append((json.loads((out / "results.json").read_text()),
                         load_model_weights(out / "checkpoints" / "best.pt")))
    finally:
        torch.use_deterministic_algorithms(False)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert enabled_while_training == [True] * 8
    (first, first_weights), (second, second_weights) = runs
    assert [h["train_loss"] for h in first["history"]] == [h["train_loss"] for h in second["history"]]
    assert first["test_loss"] == second["test_loss"]
    assert all(torch.equal(first_weights[k], second_weights[k]) for k in first_weights)


# --------------------------------------------------------------------------- measuring

def test_flops_per_token_matches_a_flop_counter_on_the_article_model():
    model = models._from_config(models.distilbert_base_uncased_config(), "sdpa")
    _, n_matmul = models.count_parameters(model)
    layers, hidden = metrics.model_shape(model)
    batch, length = 1, 96
    input_ids = torch.randint(1000, 3000, (batch, length))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).logits.sum().backward()
    formula = metrics.flops_per_token(n_matmul, layers, hidden, length) * batch * length
    # The formula also charges the classifier head and layer norms to every token: ~1% high.
    assert formula == pytest.approx(counter.get_total_flops(), rel=0.03)


def test_throughput_leaves_warmup_out_and_counts_real_and_padded_tokens():
    meter = metrics.Throughput(torch.device("cpu"), warmup_steps=2, peak_flops=1e6,
                               flops_fn=lambda lengths: sum(10.0 * n * n for n in lengths))
    meter.start()
    for step in range(5):
        lengths = [7] * 100 if step < 2 else [10, 5, 5, 10]  # warm-up steps must not count
        meter.record(lengths, computed_tokens=40, data_s=0.0)
        meter.end_step()
    rates = meter.read()
    assert meter.total["samples"] == 12 and meter.total["real_tokens"] == 90 and meter.total["padded_tokens"] == 120
    assert meter.total["flops"] == 3 * 10.0 * (100 + 25 + 25 + 100)  # real tokens only
    assert rates["padding_efficiency"] == 0.75
    assert rates["samples_per_s"] * 10 == pytest.approx(rates["padded_tokens_per_s"])
    assert rates["mfu"] == pytest.approx(meter.total["flops"] / meter.total["time_s"] / 1e6)
    assert metrics.device_peak_flops(torch.device("cpu"), amp=True, tf32=False) is None  # unknown: no MFU


def test_loader_and_optimiser_settings(imdb_dir, cache_dir):
    assert data.default_num_workers(on_cuda=False, local_world_size=1) == 0
    assert data.default_num_workers(on_cuda=True, local_world_size=1) >= 1
    split = data.TokenizedSplit(np.array([1, 2, 3, 4]), np.array([0, 2, 4]), np.array([0, 1]))
    loader = data.make_loader(split, [[0, 1]], data.Collator(0, "longest", 8), num_workers=2, pin_memory=False, seed=1)
    assert loader.persistent_workers and loader.prefetch_factor == 4
    fused, _ = tiny_strategy(fused_adam=True)
    plain, _ = tiny_strategy(fused_adam=False)
    assert fused.optimizer.defaults["fused"] and not plain.optimizer.defaults["fused"]
    for strategy in (fused, plain):
        strategy.backward(train_loss(strategy, make_batch()))
        strategy.optimizer_step()
    for (name, a), b in zip(fused.module.named_parameters(), plain.module.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=name)  # same maths, one kernel


FAULTS = """
import resource, sys, torch
from fastpt.speedups import backends
def faults():  # minor page faults of zeroing a fresh 64 MiB tensor, twice over
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(2):
        torch.zeros(16 * 2**20).sum()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults()
default = faults()
kept = backends.keep_freed_memory()
for _ in range(4):  # the heap settles: the first blocks land around the small ones Python holds
    faults()
print(default, faults(), kept, backends.cpu_allocator())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_cpu_run_reuses_freed_memory_without_new_page_faults():
    """keep_freed_memory: a big tensor freed and allocated again costs the kernel no new page faults
    (counted, not timed); a user's own malloc settings are left alone."""
    run = subprocess.run([sys.executable, "-c", FAULTS], capture_output=True, text=True, check=True)
    default, kept_faults, kept, allocator = run.stdout.split(maxsplit=3)
    assert kept == "True" and allocator.startswith("glibc malloc, freed memory kept")
    assert int(default) >= 2 * 16 * 4 * 2**20 // 4096 // 2  # each allocation faulted in afresh (pages of 4 KiB)
    assert int(kept_faults) < int(default) // 10
    env = {**os.environ, "GLIBC_TUNABLES": "glibc.malloc.mmap_max=65536"}
    run = subprocess.run([sys.executable, "-c", FAULTS], capture_output=True, text=True, check=True, env=env)
    assert run.stdout.split()[2:4] == ["False", "unchanged"]
