"""--pack-attention: the CPU's kernel chosen by measurement (fastpt/speedups/attention_probe.py), cached
per machine as plain JSON and measured again when the file is not to be trusted; the flag's way to
the kernel."""

from __future__ import annotations

import json

import pytest
import torch

from fastpt.cli.args import parse_args
from fastpt.loop.build import pack_attention_choice
from fastpt.cluster.distributed import DistInfo
from fastpt.speedups import attention_probe
from fastpt.speedups.packing import PackedClassifier

SHAPE = dict(dtype=torch.float32, heads=2, head_dim=8, batch_size=4, max_length=32)


class FakeTimer:
    """Seconds per kernel, as given; counts the calls."""

    def __init__(self, **seconds):
        self.seconds, self.calls = seconds, []

    def __call__(self, kernel, lengths, heads, head_dim, dtype):
        self.calls.append(kernel)
        return self.seconds[kernel]


def cached_files(root):
    return sorted((root / "pack-attention").glob("pack-attention-*.json"))


@pytest.mark.parametrize("loop,grouped,expected", [(2.0, 1.0, "grouped"), (1.0, 3.0, "loop")])
def test_the_probe_picks_the_faster_kernel_and_caches_it(tmp_path, loop, grouped, expected):
    timer = FakeTimer(loop=loop, grouped=grouped)
    first = attention_probe.measured_kernel(**SHAPE, cache_root=tmp_path, timer=timer)
    assert first["kernel"] == expected and first["seconds"] == {"loop": loop, "grouped": grouped}
    assert first["source"] == "measured at the start of this run"
    assert timer.calls == ["loop", "grouped", "grouped", "loop"]  # A B B A
    assert first["shapes"]["lengths"] == attention_probe.imdb_like_lengths(4, 32)
    [path] = cached_files(tmp_path)
    again = attention_probe.measured_kernel(**SHAPE, cache_root=tmp_path, timer=FakeTimer())  # no timing: cached
    assert again["kernel"] == expected and again["source"].startswith("measured earlier")
    attention_probe.measured_kernel(**{**SHAPE, "dtype": torch.bfloat16}, cache_root=tmp_path, timer=timer)
    assert len(cached_files(tmp_path)) == 2  # another dtype: another entry
    assert json.loads(path.read_text())["key"]["threads"] == torch.get_num_threads()


@pytest.mark.parametrize("tamper", [
    lambda found: "not json {",
    lambda found: json.dumps([1, 2]),
    lambda found: json.dumps({**found, "kernel": "loop"}),  # not the fastest of its own figures
    lambda found: json.dumps({**found, "kernel": "mask", "seconds": {"mask": 0.1}}),  # not a candidate
    lambda found: json.dumps({**found, "seconds": {"loop": "fast", "grouped": 1.0}}),
    lambda found: json.dumps({**found, "key": {**found["key"], "threads": -1}}),  # measured for other settings
])
def test_a_bad_cache_file_is_measured_again(tmp_path, tamper):
    attention_probe.measured_kernel(**SHAPE, cache_root=tmp_path, timer=FakeTimer(loop=2.0, grouped=1.0))
    [path] = cached_files(tmp_path)
    path.write_text(tamper(json.loads(path.read_text())))
    timer = FakeTimer(loop=2.0, grouped=1.0)
    found = attention_probe.measured_kernel(**SHAPE, cache_root=tmp_path, timer=timer)
    assert found["kernel"] == "grouped" and found["source"] == "measured at the start of this run"
    assert len(timer.calls) == 4
    assert json.loads(path.read_text())["kernel"] == "grouped"  # rewritten


def test_the_real_timer_times_each_candidate_forward_and_backward():
    seconds = attention_probe.time_kernel("grouped", [5, 9, 9, 3], heads=2, head_dim=8, dtype=torch.float32,
                                          repeats=1)
    assert 0 < seconds < 10


def tiny_bert():
    from transformers import AutoModelForSequenceClassification, BertConfig
    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64)
    return AutoModelForSequenceClassification.from_config(config, attn_implementation="sdpa")


CPU = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


@pytest.mark.parametrize("kernel", ["loop", "grouped", "mask"])
def test_the_flag_reaches_the_kernel(kernel, tmp_path):
    cfg = parse_args(["--pack", "--pack-attention", kernel, "--cache-dir", str(tmp_path)])
    choice = pack_attention_choice(cfg, CPU, tiny_bert())
    assert choice == {"kernel": kernel, "source": "--pack-attention"}
    assert PackedClassifier(tiny_bert(), choice["kernel"], choice=choice).kernel == kernel
    assert cached_files(tmp_path) == []  # a chosen kernel is not measured


def test_auto_measures_on_a_cpu_with_the_models_heads(tmp_path, monkeypatch):
    seen = {}

    def timer(kernel, lengths, heads, head_dim, dtype):
        seen.update(heads=heads, head_dim=head_dim, dtype=dtype, longest=max(lengths), reviews=len(lengths))
        return {"loop": 2.0, "grouped": 1.0}[kernel]

    monkeypatch.setattr(attention_probe, "time_kernel", timer)
    cfg = parse_args(["--pack", "--batch-size", "6", "--max-length", "48", "--cache-dir", str(tmp_path)])
    assert cfg.pack_attention == "auto"
    choice = pack_attention_choice(cfg, CPU, tiny_bert())
    assert choice["kernel"] == "grouped" and choice["seconds"] == {"loop": 2.0, "grouped": 1.0}
    assert seen == {"heads": 4, "head_dim": 8, "dtype": torch.float32, "longest": 48, "reviews": 6}


def test_a_resumed_run_keeps_the_kernel_it_started_with_on_the_same_device(tmp_path, monkeypatch):
    monkeypatch.setattr(attention_probe, "time_kernel", lambda kernel, *shape: {"loop": 1.0, "grouped": 2.0}[kernel])
    cfg = parse_args(["--pack", "--batch-size", "6", "--max-length", "48", "--cache-dir", str(tmp_path)])
    started = {"progress": {}, "pack_attention": {"kernel": "grouped", "device": "cpu"}}  # last.pt's record
    assert pack_attention_choice(cfg, CPU, tiny_bert(), started) == {
        "kernel": "grouped", "source": "last.pt: the kernel the run started with"}  # not the probe's loop
    started["pack_attention"]["device"] = "cuda"  # another kind of device: choose again
    assert pack_attention_choice(cfg, CPU, tiny_bert(), started)["kernel"] == "loop"
    assert pack_attention_choice(cfg, CPU, tiny_bert(), {"progress": {}})["kernel"] == "loop"  # an older last.pt


def test_the_flag_needs_pack_and_a_known_kernel(capsys):
    with pytest.raises(ValueError, match="--pack-attention needs --pack"):
        parse_args(["--pack-attention", "grouped"])
    with pytest.raises(SystemExit) as stop:
        parse_args(["--pack", "--pack-attention", "varlen"])  # CUDA's rule picks it under auto, never the flag
    assert stop.value.code == 2 and "--pack-attention" in capsys.readouterr().err
