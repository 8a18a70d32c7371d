"""The run's loaders: the training sampler and loader, and one evaluation loader per split, each rank
its share of every global batch (inputs/data.py has the samplers and collators; with
--data-on-device the splits sit on the device and batches are gathered there, inputs/device_data.py).
"""

from dataclasses import dataclass

from fastpt.cluster import distributed
from fastpt.config import TrainConfig
from fastpt.inputs import data


def needs_token_types(cfg: TrainConfig, model_config) -> bool:
    """Whether batches need token_type_ids: sentence pairs on a model with segment embeddings (BERT; not
    DistilBERT, which has none, nor RoBERTa, which has one)."""
    return bool(cfg.text_pair_column) and getattr(model_config, "type_vocab_size", 0) > 1


@dataclass
class Loaders:
    """The training sampler and loader, and one evaluation loader per split (data.py)."""
    train_sampler: data.TrainBatchSampler
    train: object
    validation: object
    test: object
    num_workers: int
    pin_memory: bool


def build_loaders(cfg: TrainConfig, dist: distributed.DistInfo, inputs) -> Loaders:
    """Every split's loader over `inputs.splits` (loop/build.py's Inputs), in the order the run reads them."""
    device, splits = dist.device, inputs.splits
    pad_id = inputs.tokenizer.pad_token_id or 0
    sep_id = inputs.tokenizer.sep_token_id if needs_token_types(cfg, inputs.model_config) else None
    workers, pin = data.loader_settings(cfg, device.type == "cuda", dist.local_world_size)
    collate = data.make_collator(cfg, pad_id, sep_id)
    samplers = {"train": data.TrainBatchSampler(splits["train"], cfg.batch_size, dist.rank, dist.world_size, cfg.seed,
                                                cfg.bucket, cfg.bucket_multiplier, balance_tokens=cfg.pack),
                **{name: data.EvalBatchSampler(splits[name], cfg.eval_batch_size, dist.rank, dist.world_size,
                                               sort_by_length=cfg.varying_lengths) for name in ("validation", "test")}}
    if cfg.data_on_device:  # the tokenised splits on the device, batches gathered there (no workers)
        from fastpt.inputs.device_data import DeviceLoader
        loaders = {name: DeviceLoader(splits[name], sampler, collate, device) for name, sampler in samplers.items()}
    else:
        loaders = {name: data.make_loader(splits[name], sampler, collate, workers, pin, cfg.seed)
                   for name, sampler in samplers.items()}
    return Loaders(samplers["train"], **loaders, num_workers=workers, pin_memory=pin)
