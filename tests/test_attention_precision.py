"""Attention in its fastest precision on a CPU under --amp (fastpt/speedups/attention_precision.py): the
float32 form is exact against the padded float32 reference within bfloat16's tolerance, eager and
compiled, packed and padded; the choice is the faster of two measured medians (A B B A), made on rank 0,
kept by a resume, reported in results.json and on the console, and made the same way by fastpt-predict.
"""

from __future__ import annotations

import copy
import functools
import json
from types import SimpleNamespace

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils._python_dispatch import TorchDispatchMode

from fastpt.speedups import attention_precision as precision
from fastpt.speedups import backends
from fastpt.inputs.data import Collator
from fastpt.loop.step import classify
from fastpt.speedups.compile import compile_layers
from fastpt.speedups.packing import PackedClassifier, PackedCollator, packed_logits
from test_packing import LENGTHS, MAX_LENGTH, logits_and_grads, make_items, padded_logits, tiny_model
from train import main

MEASURED = {"seconds": {"bfloat16": 2.0, "float32": 1.0}, "source": "measured at the start of this run"}


class AttentionDtypes(TorchDispatchMode):
    """The dtype of the query each attention kernel is called with."""

    def __init__(self):
        super().__init__()
        self.seen: set[tuple[str, torch.dtype]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if "scaled_dot_product" in name or "attend_each_review" in name:
            self.seen.add((name.removesuffix("_backward"), args[0].dtype if "backward" not in name else args[1].dtype))
        return func(*args, **(kwargs or {}))


def in_precision(model, chosen: str):
    return precision.apply(model, {"precision": chosen, **MEASURED})


def assert_close_in_bfloat16(got, expected):
    """Within bfloat16's rounding of the largest entries (a wrong cast or layout is off by their size)."""
    (logits, grads), (ref_logits, ref_grads) = got, expected
    assert grads.keys() == ref_grads.keys()
    for name, tensor, ref in [("logits", logits, ref_logits)] + [(n, grads[n], ref_grads[n]) for n in ref_grads]:
        scale = ref.float().abs().max().item()
        torch.testing.assert_close(tensor.float(), ref.float(), rtol=0, atol=0.03 * scale + 1e-5, msg=name)


def bf16(forward):
    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return forward().float()
    return run


@pytest.mark.parametrize("chosen", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["distilbert", "bert"])
def test_either_precision_matches_the_float32_padded_reference_packed_and_padded(kind, chosen):
    reference = tiny_model(kind).eval()
    items = make_items(LENGTHS)
    expected = logits_and_grads(lambda: padded_logits(reference, items), reference)
    packed = in_precision(PackedClassifier(copy.deepcopy(reference), "loop").eval(), chosen)
    padded = in_precision(copy.deepcopy(reference), chosen)
    batch = PackedCollator(pad_id=0)(items)
    for model, forward in ((packed, lambda: packed_logits(packed, batch, MAX_LENGTH)),
                           (padded, lambda: padded_logits(padded, items))):
        with AttentionDtypes() as dtypes:
            got = logits_and_grads(bf16(forward), model)
        assert_close_in_bfloat16(got, expected)
        assert {dtype for _, dtype in dtypes.seen} == {getattr(torch, chosen)}, dtypes.seen  # forward and backward


def test_the_float32_form_is_closer_to_the_reference_than_bfloat16_attention():
    """Same 16-bit inputs, attended in float32 and rounded once: nearer the float32 model, summed over the logits."""
    reference = tiny_model("bert").eval()
    items = make_items(LENGTHS)
    with torch.no_grad():
        expected = padded_logits(reference, items)
        errors = {}
        for chosen in ("float32", "bfloat16"):
            model = in_precision(PackedClassifier(copy.deepcopy(reference), "loop").eval(), chosen)
            logits = bf16(lambda: packed_logits(model, PackedCollator(pad_id=0)(items), MAX_LENGTH))()
            errors[chosen] = (logits - expected).abs().sum().item()
    assert errors["float32"] < errors["bfloat16"], errors


def batch_of(items, packed: bool) -> dict:
    collate = PackedCollator(pad_id=0) if packed else Collator(pad_id=0, pad_to="longest", max_length=MAX_LENGTH)
    return collate(items)


def logits_of(model, batch: dict) -> torch.Tensor:
    """Logits under bfloat16 autocast, entered inside (as the step enters it)."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return classify(model, batch, MAX_LENGTH).float()


def check_compiled_matches_eager(packed: bool, scope: str, backend: str, monkeypatch, tmp_path):
    """Compiled as fastpt compiles: each layer in place, or the whole forward with fullgraph."""
    torch._dynamo.reset()
    reference = tiny_model("bert")
    eager = in_precision(PackedClassifier(reference, "loop") if packed else reference, "float32")
    model = copy.deepcopy(eager)
    counter = CompileCounterWithBackend(backend)
    if scope == "layers":
        compile = torch.compile
        monkeypatch.setattr(torch, "compile",
                            lambda target, **options: compile(target, **{**options, "backend": counter}))
        compiled = functools.partial(logits_of, compile_layers(model, dynamic_tokens=True))
    else:
        compiled = torch.compile(functools.partial(logits_of, model), backend=counter, fullgraph=True, dynamic=True)
    settings = SimpleNamespace(compile=True, deterministic=False, tf32=False)
    backends.configure(settings, torch.device("cpu"), tmp_path)  # a compiled run's settings (compile.py)
    try:
        for step in range(3):  # three lengths, one graph
            batch = batch_of(make_items(LENGTHS[step:step + 5], seed=step), packed)
            assert_close_in_bfloat16(logits_and_grads(lambda: compiled(batch), model),
                                     logits_and_grads(lambda: logits_of(eager, batch), eager))
    finally:
        backends.restore(settings)
    assert counter.frame_count == 1


@pytest.mark.parametrize("scope", ["layers", "whole"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_compiled_float32_attention_matches_eager_in_one_graph(packed, scope, monkeypatch, tmp_path):
    """The casts and the autocast switch sit in the compiled code's Python: fullgraph holds, one graph serves
    every length. aot_eager traces forward and backward exactly as Inductor receives them."""
    check_compiled_matches_eager(packed, scope, "aot_eager", monkeypatch, tmp_path)


@pytest.mark.slow  # Inductor's C++ compile of the tiny model: about a minute each on 2 cores
@pytest.mark.parametrize("scope", ["layers", "whole"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_inductor_compiled_float32_attention_matches_eager(packed, scope, monkeypatch, tmp_path):
    """Inductor itself: the casts it fuses into its generated kernels compute what eager does."""
    check_compiled_matches_eager(packed, scope, "inductor", monkeypatch, tmp_path)


# --------------------------------------------------------------------------- the choice

class FakeTimer:
    def __init__(self, bfloat16: list, float32: list):
        self.left = {False: list(bfloat16), True: list(float32)}
        self.calls = []

    def __call__(self, float32, inputs, backward):
        self.calls.append("float32" if float32 else "bfloat16")
        return self.left[float32].pop(0)


def test_the_measurement_leaves_out_the_warm_up_and_keeps_the_faster_median():
    # warm-up, then medians of [3, 3, 3, 9] = 3 against [9, 1, 1, 1] = 1: float32 wins though its warm-up was slow
    timer = FakeTimer(bfloat16=[0.1, 3, 3, 3, 9], float32=[50, 9, 1, 1, 1])
    found = precision.measured_precision("bfloat16", inputs=None, timer=timer)
    assert sorted(timer.calls) == ["bfloat16"] * 5 + ["float32"] * 5  # each timed as often
    assert found == {"precision": "float32", "seconds": {"bfloat16": 3, "float32": 1},
                     "source": "measured at the start of this run"}


@pytest.mark.parametrize("float32_s,expected", [(0.95, "bfloat16"), (0.91, "bfloat16"), (0.9, "float32")])
def test_float32_has_to_win_by_the_margin(float32_s, expected):
    """About even is not faster: the autocast dtype stays, so that noise does not pick the numbers."""
    found = precision.measured_precision("bfloat16", None, timer=FakeTimer([1.0] * 5, [float32_s] * 5))
    assert found["precision"] == expected


def test_the_rule_a_resume_and_rank_0_decide_what_is_measured():
    def measure():
        raise AssertionError("measured")

    chosen = {(device, amp, implementation, deterministic): (precision.rule(device, amp, implementation, deterministic)
                                                             or {}).get("precision")
              for device in ("cpu", "cuda") for amp in (None, "bfloat16", "float16")
              for implementation in ("sdpa", "eager") for deterministic in (False, True)}
    measured = {key for key, value in chosen.items() if value is None}
    assert measured == {("cpu", amp, "sdpa", False) for amp in ("bfloat16", "float16")}  # only SDPA on a CPU, --amp
    assert all(chosen[key] == (key[1] or "float32") for key in chosen.keys() - measured)  # else the inputs' own
    cuda = precision.rule("cuda", "bfloat16")
    assert precision.choose(cuda, measure) == cuda  # CUDA: autocast's flash, unchanged
    recorded = {"precision": "float32", **MEASURED}
    kept = precision.choose(None, measure, recorded=recorded)
    assert kept["precision"] == "float32" and kept["seconds"] == MEASURED["seconds"]
    assert kept["source"].startswith("last.pt")
    sent = precision.choose(None, measure, recorded={"precision": "grouped"}, measures=False,
                            broadcast=lambda found: {"precision": "float32", "from rank 0": found})
    assert sent == {"precision": "float32", "from rank 0": None}  # another rank: it waits for rank 0's


def test_the_real_timer_runs_both_precisions_packed_and_padded_forward_and_backward():
    for packed in (True, False):
        inputs = precision.attention_inputs([5, 9, 3], heads=2, head_dim=8, dtype=torch.bfloat16, packed=packed,
                                            padded_to=None if packed else 12)
        for backward in (True, False):
            found = precision.measured_precision("bfloat16", inputs, backward=backward)
            assert set(found["seconds"]) == {"bfloat16", "float32"}
            seconds = found["seconds"]
            assert (found["precision"] == "float32") == (seconds["float32"] * precision.MARGIN < seconds["bfloat16"])


def test_cuda_or_a_rule_leaves_the_models_attention_alone():
    model = tiny_model("bert")
    precision.apply(model, {"precision": "bfloat16", "source": "the rule"})
    assert model.config._attn_implementation == "sdpa"
    precision.apply(model, {"precision": "float32", "source": "the rule (no --amp)"})  # float32 inputs anyway
    assert model.config._attn_implementation == "sdpa"


# --------------------------------------------------------------------------- a run, its resume, predict

@pytest.fixture
def float32_wins(monkeypatch):
    calls = []

    def timer(float32, inputs, backward):
        calls.append(backward)
        return 1.0 if float32 else 2.0

    monkeypatch.setattr(precision, "time_attention", timer)
    return calls


@pytest.mark.parametrize("layout", [("--pack",), ("--pad-to", "longest")], ids=["packed", "padded"])
def test_a_bfloat16_cpu_run_measures_records_resumes_and_predicts_with_the_choice(
        layout, tiny_args, tmp_path, float32_wins, capfd):
    from fastpt.cli.predict import main as predict
    from fastpt.files import checkpoint

    flags = (*layout, "--amp", "--amp-dtype", "bfloat16", "--save-every", "1000", "--no-tensorboard")
    run = tmp_path / "run"
    assert main(tiny_args(*flags, "--epochs", "1", out=run)) == 0
    assert float32_wins == [True] * 10  # forward + backward: 1 warm-up and 4 timings of each
    out = capfd.readouterr().out
    assert "attention: float32 (bfloat16 2000.0 ms, float32 1000.0 ms per layer's attention call)" in out
    first = json.loads((run / "results.json").read_text())["attention_precision"]
    assert first == {"precision": "float32", "seconds": {"bfloat16": 2.0, "float32": 1.0},
                     "source": "measured at the start of this run"}
    assert checkpoint.load(run / "checkpoints" / "last.pt")["attention_precision"] == first
    float32_wins.clear()
    assert main(tiny_args(*flags, "--epochs", "2", "--resume", "auto", out=run)) == 0
    assert float32_wins == []  # the resume kept last.pt's choice
    resumed = json.loads((run / "results.json").read_text())["attention_precision"]
    assert resumed["precision"] == "float32" and resumed["source"].startswith("last.pt")
    texts = tmp_path / "new.csv"
    texts.write_text("text\na fine film\nnot good at all\n")
    pack = ["--pack"] if "--pack" in layout else []
    assert predict(["--model", str(run), "--data", str(texts), "--out", str(tmp_path / "p.csv"), "--amp", "bfloat16",
                    *pack]) == 0
    assert float32_wins == [False] * 10  # measured again on its own first batch, forward only
    assert "attention: float32 (bfloat16 2000.0 ms" in capfd.readouterr().out


@pytest.mark.parametrize("flags,expected", [((), "float32"), (("--amp", "--amp-dtype", "bfloat16", "--deterministic"),
                                                              "bfloat16")], ids=["float32", "deterministic"])
def test_a_float32_or_deterministic_run_measures_nothing(flags, expected, tiny_args, tmp_path, float32_wins):
    assert main(tiny_args("--pack", "--epochs", "1", *flags, out=tmp_path / "run")) == 0
    assert float32_wins == []
    assert json.loads((tmp_path / "run" / "results.json").read_text())["attention_precision"]["precision"] == expected
