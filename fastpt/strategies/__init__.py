"""Training strategies behind one interface (see base.py): single device, DDP, FSDP, DeepSpeed; each builds
its optimiser and learning-rate schedule from optimizer.py."""

from fastpt.config import TrainConfig
from fastpt.cluster.distributed import DistInfo
from fastpt.strategies.base import Strategy


def build_strategy(cfg: TrainConfig, dist: DistInfo) -> Strategy:
    """The strategy object for cfg.strategy. FSDP and DeepSpeed are imported only when asked for."""
    if cfg.strategy == "ddp":
        from fastpt.strategies.ddp import DDPStrategy
        return DDPStrategy(cfg, dist)
    if cfg.strategy == "fsdp":
        from fastpt.strategies.fsdp import FSDPStrategy
        return FSDPStrategy(cfg, dist)
    if cfg.strategy == "deepspeed":
        from fastpt.strategies.deepspeed import DeepSpeedStrategy
        return DeepSpeedStrategy(cfg, dist)
    return Strategy(cfg, dist)
