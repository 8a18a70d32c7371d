"""The single-GPU fast path, proved on the CPU: batches gathered on the device equal the
DataLoader's, steady-state steps read nothing back from the device, evaluation batches all
have one shape, and compile time, graph counts and rates are reported apart.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fastpt.inputs import data
from fastpt.loop import bookkeeping
from fastpt.inputs.device_data import DeviceLoader
from train import main


# Ops that make the host wait for a value computed on the device: `.item()`, `bool(t)`,
# `.tolist()` (all dispatch to _local_scalar_dense), comparisons returning a Python bool, and
# ops whose output size depends on the data.
HOST_READS = {"_local_scalar_dense", "item", "equal", "is_nonzero", "nonzero", "masked_select", "unique",
              "_unique", "_unique2", "unique_consecutive", "unique_dim"}


class HostReads(TorchDispatchMode):
    """Records every op that reads a device value back to the host."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in HOST_READS or (name == "repeat_interleave" and (kwargs or {}).get("output_size") is None
                                  and len(args) >= 1 and torch.is_tensor(args[0]) and len(args) < 3):
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def made_up_split(n: int = 40, seed: int = 0) -> data.TokenizedSplit:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, 30, size=n)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    ids = rng.integers(1000, 3000, size=offsets[-1]).astype(np.int32)
    return data.TokenizedSplit(ids, offsets, rng.integers(0, 2, size=n))


def loader_batches(split, sampler, collate) -> list[dict]:
    return list(data.make_loader(split, sampler, collate, num_workers=0, pin_memory=False, seed=0))


def assert_same_batches(expected: list[dict], got: list[dict]) -> None:
    assert len(expected) == len(got) > 0
    for a, b in zip(expected, got):
        assert a.keys() == b.keys()
        for key in a:
            if torch.is_tensor(a[key]):
                assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
            else:
                assert a[key] == b[key], key


@pytest.mark.parametrize("pad_to", ["max_length", "longest", "pack", "pack-16"])
def test_device_batches_equal_the_data_loaders(pad_to):
    from fastpt.speedups.packing import PackedCollator

    split = made_up_split()
    collate = (data.Collator(0, pad_to, 32) if not pad_to.startswith("pack")
               else PackedCollator(0, 16 if pad_to == "pack-16" else None))
    train = data.TrainBatchSampler(split, 6, rank=0, world_size=1, seed=3)
    train.set_epoch(1)
    assert_same_batches(loader_batches(split, train, collate), list(DeviceLoader(split, train, collate, "cpu")))
    evaluation = data.EvalBatchSampler(split, 16, rank=1, world_size=2, sort_by_length=True)
    assert_same_batches(loader_batches(split, evaluation, collate),
                        list(DeviceLoader(split, evaluation, collate, "cpu")))


def test_evaluation_batches_all_have_one_shape_and_count_each_review_once():
    split = made_up_split(n=37)
    for world_size in (1, 2):
        seen = []
        for rank in range(world_size):
            batches = list(data.EvalBatchSampler(split, 8, rank, world_size))
            assert {len(b) for b in batches} == {8}  # the last batch is filled: one shape to compile
            seen += [i for b in batches for i, w in b if w > 0]
        assert sorted(seen) == list(range(37))  # every review exactly once, fillers weigh 0


def test_host_read_detector_catches_item_and_bool():
    with HostReads() as reads:
        t = torch.ones(3)
        t.sum().item()
        bool(t.sum() > 0)
        torch.repeat_interleave(torch.arange(2), torch.tensor([1, 2]))  # output size read from the data
        torch.repeat_interleave(torch.arange(2), torch.tensor([1, 2]), output_size=3)  # known: no read
    assert reads.seen == ["_local_scalar_dense", "_local_scalar_dense", "repeat_interleave"]


def test_log_schedule_draws_short_runs_too():
    assert [s for s in range(1, 130) if bookkeeping.is_log_step(s, 50)] == [1, 2, 4, 8, 16, 32, 50, 100]


def test_results_report_compile_time_val_time_and_rates(tiny_args, tmp_path):
    out = tmp_path / "short"
    assert main(tiny_args("--max-steps", "2", "--epochs", "1", out=out)) == 0
    short = json.loads((out / "results.json").read_text())
    assert short["samples_per_s"] is None and "warm-up" in short["samples_per_s_note"]
    assert short["compile_time_s"] is None and short["compiled_graphs"] is None and short["compile_cache"] is None
    assert short["compile_torch_s"] is None
    assert short["train_examples"] == 112 and short["val_examples"] == 16 and short["test_examples"] == 32
    assert 0 < short["val_time_s"] < short["train_time_s"]
    assert short["train_time_no_compile_s"] == short["train_time_s"]


def tb_losses(out) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(out / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    return [e.value for e in events.Scalars("train/loss")]


@pytest.fixture
def no_dropout(monkeypatch):
    """The tiny model without dropout: packed attention applies none, so only then do the runs compare."""
    from fastpt.inputs import models
    original = models.tiny_config

    def config():
        c = original()
        c.dropout = c.attention_dropout = c.seq_classif_dropout = 0.0
        return c

    monkeypatch.setattr(models, "tiny_config", config)


def test_packed_and_device_batches_train_like_padded_ones(tiny_args, tmp_path, no_dropout):
    common = ("--epochs", "1", "--log-every", "1", "--lr", "1e-3")
    runs = {name: tmp_path / name for name in ("padded", "packed", "packed_device", "padded_device")}
    assert main(tiny_args(*common, out=runs["padded"])) == 0
    assert main(tiny_args(*common, "--pack", "--pack-multiple", "16", "--save-every", "2", out=runs["packed"])) == 0
    assert main(tiny_args(*common, "--pack", "--data-on-device", out=runs["packed_device"])) == 0
    assert main(tiny_args(*common, "--data-on-device", "--pad-to", "longest", out=runs["padded_device"])) == 0
    reference = torch.tensor(tb_losses(runs["padded"]))
    assert reference.max() - reference.min() > 1e-3  # it learns: the curves have something to match
    for name, out in runs.items():
        torch.testing.assert_close(torch.tensor(tb_losses(out)), reference, rtol=1e-4, atol=1e-5, msg=name)
    packed = json.loads((runs["packed"] / "results.json").read_text())
    padded = json.loads((runs["padded"] / "results.json").read_text())
    assert packed["test_acc"] == padded["test_acc"]
    assert packed["pack_attention"]["kernel"] == "loop"  # --pack-attention auto on a CPU
    assert packed["test_loss"] == pytest.approx(padded["test_loss"], rel=1e-4)
    assert padded["padding_efficiency"] < packed["padding_efficiency"] < 1.0  # rounded up to multiples of 16
    assert json.loads((runs["packed_device"] / "results.json").read_text())["padding_efficiency"] == 1.0


def test_steady_state_steps_read_nothing_back(tiny_args, tmp_path, monkeypatch):
    """Steps 9-16 (no log step among them) of the fast path, with AdamW, a cosine schedule and class
    weights: not one value read back from the device.

    On the CPU the packed attention takes the block-diagonal mask kernel (--pack-attention mask),
    the one that reads nothing back (CUDA's varlen kernel reads nothing either; the CPU's loop
    kernel reads each review's boundaries on the host, harmless there).
    """
    from fastpt.loop.bookkeeping import Bookkeeping

    all_ops = []
    original, original_log = Bookkeeping.after_step, Bookkeeping.log

    class Recorder(HostReads):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            all_ops.append(func.overloadpacket.__name__)
            return super().__torch_dispatch__(func, types, args, kwargs)

    reads = Recorder()

    def after_step(self, *args, **kwargs):
        if self.position.global_step == 15:  # step 16 is a log step: stop watching before it is accounted
            reads.__exit__(None, None, None)
        return original(self, *args, **kwargs)

    def log(self):
        original_log(self)  # the loop logs after after_step answers: step 8 is a log step
        if self.position.global_step == 8:
            reads.__enter__()

    monkeypatch.setattr(Bookkeeping, "after_step", after_step)
    monkeypatch.setattr(Bookkeeping, "log", log)
    flags = ("--pack", "--pack-attention", "mask", "--data-on-device", "--fused-adam", "--max-grad-norm", "1.0",
             "--batch-size", "4",
             "--log-every", "1000", "--max-steps", "20", "--epochs", "1",
             # the Trainer-style settings add no read either: AdamW's groups, the schedule, the loss's weights
             "--optimizer", "adamw", "--weight-decay", "0.01", "--lr-schedule", "cosine", "--warmup-steps", "3",
             "--class-weights", "balanced")
    assert main(tiny_args(*flags, out=tmp_path / "run")) == 0
    assert len(all_ops) > 500  # the mode saw the steps: forward, backward, clipping, Adam, the batch gather
    assert reads.seen == []
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["pack_attention"] == {"kernel": "mask", "source": "--pack-attention"}  # the flag reached it


def test_a_run_saved_by_an_older_fastpt_with_a_removed_kernel_resumes_on_the_loop_and_predicts(
        tiny_args, tmp_path, no_dropout):
    """last.pt and config.json as fastpt wrote them when it had the grouped kernel and --cheap-dropout:
    the resumed run attends with the loop, equals an uninterrupted run, and fastpt-predict reads the folder."""
    from fastpt.cli.predict import main as predict
    from fastpt.files import checkpoint

    common = ("--pack", "--save-every", "1000", "--lr", "1e-3")  # last.pt at each epoch's end
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    assert main(tiny_args(*common, out=reference)) == 0
    assert main(tiny_args(*common, "--epochs", "1", out=resumed)) == 0
    last = resumed / "checkpoints" / "last.pt"
    state = checkpoint.load(last)
    assert "pack_attention" not in state  # fastpt no longer records the kernel there: its rule decides
    old_settings = {"pack_attention": "grouped", "cheap_dropout": False}
    checkpoint.save_atomic({**state, "config": {**state["config"], **old_settings},
                            "pack_attention": {"kernel": "grouped", "device": "cpu"}}, last)
    config = json.loads((resumed / "config.json").read_text())
    (resumed / "config.json").write_text(json.dumps({**config, **old_settings}))
    assert main(tiny_args(*common, "--resume", "auto", out=resumed)) == 0
    got, expected = (json.loads((out / "results.json").read_text()) for out in (resumed, reference))
    assert got["pack_attention"] == expected["pack_attention"] == {
        "kernel": "loop", "source": "packed_attention_kernel's rule for this device"}
    assert got["history"][-1]["val_loss"] == expected["history"][-1]["val_loss"]
    assert (got["test_acc"], got["test_loss"]) == (expected["test_acc"], expected["test_loss"])
    texts = tmp_path / "new.csv"
    texts.write_text("text\na fine film\nnot good at all\n")
    assert predict(["--model", str(resumed), "--data", str(texts), "--out", str(tmp_path / "p.csv"), "--pack"]) == 0
    assert len((tmp_path / "p.csv").read_text().splitlines()) == 3


def test_a_removed_flag_is_one_line_saying_what_to_use_instead(tiny_args, tmp_path, capfd):
    cases = {("--cheap-dropout",): "--cheap-dropout is gone: ",
             ("--pack", "--pack-attention", "grouped"): "'grouped' is gone: ",
             ("--pack", "--pack-attention=grouped"): "'grouped' is gone: "}
    for flags, gone in cases.items():
        assert main(tiny_args(*flags, out=tmp_path / "run")) == 2
        [line] = capfd.readouterr().err.strip().splitlines()
        instead = "drop the flag" if "dropout" in gone else "use --pack-attention loop"
        assert line.startswith("error: ") and gone in line and instead in line, line
    assert not (tmp_path / "run").exists()  # refused before anything is written
