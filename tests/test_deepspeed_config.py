"""--deepspeed's generated config against the one the installed Lightning builds for `deepspeed_stage_N`.

The article's DeepSpeed row ran Lightning's `strategy="deepspeed_stage_2"`; fastpt's row compares
with it only if the engine gets the same settings. Lightning's strategy objects are built here
without launching anything: their constructor writes the config, and `_format_precision_config`
adds the fp16/bf16 block as `Trainer.fit` would.
"""

from __future__ import annotations

import os

import pytest

from fastpt.config import TrainConfig
from fastpt.strategies.deepspeed_config import deepspeed_config


pytest.importorskip("deepspeed")
os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before Lightning imports deepspeed: no accelerator guessing
lightning_strategies = pytest.importorskip("lightning.pytorch.strategies")
lightning_deepspeed = pytest.importorskip("lightning.fabric.strategies.deepspeed")


def lightning_config(stage: int, precision: str = "32-true") -> dict:
    """The config Lightning's DeepSpeedStrategy holds for strategy=f"deepspeed_stage_{stage}" and `precision`."""
    strategy = lightning_strategies.StrategyRegistry.get(f"deepspeed_stage_{stage}")
    config = dict(strategy.config)
    lightning_deepspeed._format_precision_config(
        config=config, precision=precision, loss_scale=strategy.loss_scale,
        loss_scale_window=strategy.loss_scale_window, min_loss_scale=strategy.min_loss_scale,
        initial_scale_power=strategy.initial_scale_power, hysteresis=strategy.hysteresis)
    return config


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_section_is_lightnings(stage):
    ours = deepspeed_config(TrainConfig(strategy="deepspeed", zero_stage=stage), world_size=4)
    assert ours["zero_optimization"] == lightning_config(stage)["zero_optimization"]


@pytest.mark.parametrize("precision, amp_dtype", [("16-mixed", "float16"), ("bf16-mixed", "bfloat16")])
def test_precision_block_means_what_lightnings_does(precision, amp_dtype):
    """fastpt writes only `enabled`; DeepSpeed's defaults fill in the loss scaler as Lightning spells it out."""
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config

    ours = deepspeed_config(TrainConfig(strategy="deepspeed", amp=True, amp_dtype=amp_dtype), world_size=4)
    theirs = lightning_config(2, precision)
    for key, parse in (("fp16", DeepSpeedFP16Config), ("bf16", DeepSpeedBF16Config)):
        assert parse(**ours[key]) == parse(**theirs.get(key, {"enabled": False})), key
