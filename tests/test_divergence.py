"""A diverged run stops with exit 1 and one line, also under float16 AMP, whose GradScaler skips NaN steps.

Without these checks `--lr 1e30 --amp` trained 28 NaN steps (every one skipped by the scaler), saved a
"best" checkpoint from a finite val_acc beside a NaN val_loss, wrote results.json with test_loss NaN and
exited 0.
"""

from __future__ import annotations

import types

import pytest
import torch

from fastpt.cli.shell import EXIT_FAILED
from fastpt.files import checkpoint
from fastpt.loop.bookkeeping import MAX_SKIPPED_STEPS_IN_A_ROW
from train import main


def small(tiny_args, out, *extra):
    """The tiny run, shorter: 16 tokens, 32 training reviews (4 steps of 8 per epoch)."""
    return tiny_args(out=out) + ["--max-length", "16", "--train-size", "32", "--no-tensorboard", *extra]


def error_line(capfd) -> str:
    errors = [line for line in capfd.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, errors
    return errors[0]


@pytest.mark.parametrize("amp", [["--amp"], []], ids=["float16", "float32"])
def test_a_nan_validation_loss_stops_the_run_without_a_best_checkpoint(amp, tiny_args, tmp_path, capfd):
    """--lr 1e30: the first step sends the weights to inf; from then on every loss is NaN."""
    out = tmp_path / "run"
    capfd.readouterr()
    assert main(small(tiny_args, out, "--lr", "1e30", "--save-every", "2", *amp)) == EXIT_FAILED
    line = error_line(capfd)
    if amp:  # the scaler skipped steps 2-4, too few to call it diverged: the validation loss says so
        assert line.startswith("error: validation loss is nan after epoch 1 (step 4)"), line
    else:  # without a scaler the NaN training loss is caught first, at the save step after it
        assert line.startswith("error: training loss became NaN/inf at step 2"), line
    assert "--amp" not in line and "--lr" in line  # never point at the mode that hid the problem
    assert not (out / "checkpoints" / "best.pt").exists()
    assert not (out / "results.json").exists()


def _poison_training(monkeypatch, bad_steps):
    """NaN logits in the training forward of the given (1-based) steps; validation and test stay finite."""
    import fastpt.loop.step as step

    original, calls = step.classify, []

    def poisoned(model, batch, max_length):
        logits = original(model, batch, max_length)
        if model.training:
            calls.append(1)
            if len(calls) in bad_steps:
                return logits * float("nan")
        return logits

    monkeypatch.setattr(step, "classify", poisoned)


def test_a_long_run_of_skipped_float16_steps_stops_the_run(tiny_args, tmp_path, monkeypatch, capfd):
    """Every step NaN while validation stays finite: only the scaler's skips show that nothing trains."""
    _poison_training(monkeypatch, bad_steps=range(1, 10**6))
    out = tmp_path / "run"
    capfd.readouterr()
    # 2 reviews a batch: 36 steps in the epoch, log lines at every 8th.
    assert main(small(tiny_args, out, "--amp", "--batch-size", "2", "--train-size", "72", "--epochs", "1",
                      "--max-length", "8", "--log-every", "8", "--save-every", "8")) == EXIT_FAILED
    line = error_line(capfd)
    assert line == (f"error: training diverged: the float16 loss scaler skipped {MAX_SKIPPED_STEPS_IN_A_ROW} steps "
                    f"in a row from step 1 (inf/NaN gradients at every scale it tried); "
                    f"try a lower --lr or --max-grad-norm"), line
    # Found at the log/save step 32, before that step's checkpoint; nothing from validation or test.
    assert checkpoint.load(out / "checkpoints" / "last.pt")["progress"]["global_step"] == 24
    assert not (out / "checkpoints" / "best.pt").exists() and not (out / "results.json").exists()


def test_a_shorter_run_of_skipped_steps_is_the_scaler_at_work(tiny_args, tmp_path, monkeypatch, capfd):
    """One skip fewer than the limit, then finite steps: the run goes on and finishes."""
    _poison_training(monkeypatch, bad_steps=range(1, MAX_SKIPPED_STEPS_IN_A_ROW))
    out = tmp_path / "run"
    assert main(small(tiny_args, out, "--amp", "--batch-size", "2", "--train-size", "72", "--epochs", "1",
                      "--max-length", "8", "--log-every", "8")) == 0
    assert (out / "results.json").exists() and (out / "checkpoints" / "best.pt").exists()


def test_deepspeed_fp16_skips_are_read_from_the_engine_counter():
    """DeepSpeed's own fp16 scaler (no float16 on this CPU, so a stand-in engine): its skipped_steps counter."""
    from fastpt.strategies.deepspeed import DeepSpeedStrategy

    strategy = DeepSpeedStrategy.__new__(DeepSpeedStrategy)
    strategy.model = types.SimpleNamespace(skipped_steps=5)  # restored from a checkpoint: not this run's
    strategy._skipped_before = 5
    seen = []
    for skipped in (True, True, False, True):
        strategy.model.skipped_steps += skipped
        seen.append(bool(strategy.step_was_skipped()))
    assert seen == [True, True, False, True]


def test_the_grad_scaler_skips_are_seen_on_the_device():
    """The single-device strategy reads skips from GradScaler's scale, from the first step on."""
    from fastpt.config import TrainConfig
    from fastpt.cluster.distributed import DistInfo
    from fastpt.strategies.base import Strategy

    strategy = Strategy(TrainConfig(model="tiny", amp=True), DistInfo(0, 0, 1, torch.device("cpu")))
    strategy.setup(torch.nn.Linear(2, 1))
    seen = []
    for bad in (True, True, False, False, True):
        with strategy.precision.autocast():
            loss = strategy.model(torch.ones(1, 2)).sum() * (float("nan") if bad else 1.0)
        strategy.backward(loss)
        strategy.optimizer_step()
        seen.append(bool(strategy.step_was_skipped()))
    assert seen == [True, True, False, False, True]
