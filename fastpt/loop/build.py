"""The build step: what train.py's loop works with, built in one documented order, as plain parts.

    load_inputs(cfg, dist) -> Inputs        tokenizer, model (initial weights), tokenised splits
    build(cfg, dist, inputs, strategy, out_dir, resume_state) -> Parts:
        backends                            TF32, deterministic kernels, the compile cache (backends.py)
        tracker                             console, TensorBoard (rank 0 writes; monitoring/tracking.py)
        loaders                             global batches, each rank its share (inputs/data.py)
        --pack                              packed batches and their attention kernel (speedups/packing.py)
        attention's precision               on a CPU under --amp, measured (speedups/attention_precision.py)
        strategy.setup(model)               to device -> compile -> DDP / FSDP / DeepSpeed -> optimizer
        forward_loss, eval_sums             step.py / evaluation.py, compiled where the strategy does
        bookkeeping, record                 counters, throughput (bookkeeping.py); best epoch, early stopping (record.py)

`build` builds; it does not decide the order of a run, and the parts have no methods that run
one. train.py does: for each epoch `step.train_epoch`, `evaluation.evaluate`, the best tracker,
best.pt, early stopping; then the best weights, the test and results.json (cli/outputs.py).
What Lightning's `Trainer.fit` + `Trainer.test` do, written out.
"""

from __future__ import annotations

import contextlib
import random
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from fastpt.inputs import columns, data, own_data
from fastpt.inputs.models import check_max_length, check_model_source, count_parameters, load_model, load_tokenizer
from fastpt.inputs.token_cache import cache_root, prepare_splits
from fastpt.loop.early_stopping import BestTracker, EarlyStopping
from fastpt.loop.evaluation import make_eval_sums
from fastpt.loop.record import RunRecord
from fastpt.loop.step import class_weights, make_forward_loss
from fastpt.cluster import distributed
from fastpt.monitoring import metrics
from fastpt.loop.bookkeeping import Bookkeeping
from fastpt.config import TrainConfig
from fastpt.cluster.signals import GracefulStop
from fastpt.monitoring.tracking import NullTracker, Tracker
from fastpt.speedups import attention_precision, backends
from fastpt.strategies.base import Strategy
from fastpt.strategies.optimizer import total_steps


IMDB_LABELS = ("neg", "pos")  # imdb.py: label 1 = the pos/ folder
WARMUP_STEPS = 3  # left out of throughput: allocator warm-up, compilation, autotuning


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class Inputs:
    """What a run reads before it writes anything: bad input fails here, with the run folder untouched."""
    tokenizer: object
    model: torch.nn.Module  # initial weights, on the CPU; the strategy takes it over
    splits: dict  # "train", "validation", "test" -> data.TokenizedSplit, cut to --train-size etc.
    cache_path: Path  # the token cache they came from
    label_names: list  # id i is label_names[i] (IMDB: neg, pos)
    model_config: object = None  # the model's config, for --export-dir (the strategy takes the model)

    def train_examples_used(self, cfg: TrainConfig, world_size: int) -> int:
        """Reviews one epoch trains on, over all processes: its whole global batches (TrainBatchSampler
        drops the last, short one)."""
        global_batch = cfg.batch_size * world_size
        return len(self.splits["train"]) // global_batch * global_batch


def load_inputs(cfg: TrainConfig, dist: distributed.DistInfo) -> Inputs:
    """Tokenizer, model and data: everything bad input can break."""
    tokenizer = load_tokenizer(cfg.model)
    check_max_length(tokenizer, cfg.max_length)
    check_model_source(cfg.model, cfg.random_init)  # the model loads after the data (its labels): fail first
    # Each node's first process builds or reads the cache in its own --cache-dir (nodes need not share a disk).
    shared = dict(builds=dist.local_rank == 0, gather=distributed.all_gather_object,
                  builder=distributed.node_first_rank(dist))
    if cfg.data is None:  # IMDB, the article's split
        splits, cache_path = prepare_splits(cfg.data_dir, cfg.cache_dir, tokenizer, cfg.max_length, **shared)
        label_names = None  # the model's config as the article's run has it
        cfg.label_names = list(IMDB_LABELS)
    else:  # --data: your own table (own_data.py)
        splits, cache_path, label_names, cfg.data_splits = own_data.prepare_own_splits(cfg, tokenizer, **shared)
        label_names = cfg.label_names = columns.named_labels(label_names, cfg.label_names)  # --label-names, if given
    seed_everything(cfg.seed)  # identical initial weights on every rank (FSDP does not broadcast)
    model = load_model(cfg.model, cfg.random_init, cfg.attn_implementation, label_names)
    check_model_fits(cfg, model, tokenizer)
    sizes = {"train": cfg.train_size, "validation": cfg.val_size, "test": cfg.test_size}
    inputs = Inputs(tokenizer, model, {name: splits[name].head(n) for name, n in sizes.items()}, cache_path,
                    cfg.label_names, model.config)
    if inputs.train_examples_used(cfg, dist.world_size) == 0:
        raise ValueError(f"{len(inputs.splits['train'])} training examples over {dist.world_size} process(es) "
                         f"make no full batch of {cfg.batch_size}")
    cfg.class_weight_values = class_weights(cfg.class_weights, inputs.splits["train"].labels, cfg.label_names)
    return inputs


def check_model_fits(cfg: TrainConfig, model, tokenizer) -> None:
    """What --pack and sentence pairs need of the model, refused before anything is written."""
    from fastpt.speedups.packing import PACKED_MODELS

    kind = model.config.model_type
    if cfg.pack and kind not in PACKED_MODELS:
        raise ValueError(f"--pack supports {', '.join(PACKED_MODELS)} models, not {kind}; drop --pack")
    if cfg.pack and needs_token_types(cfg, model.config):
        raise ValueError(f"--pack cannot carry the token_type_ids that {kind} gives a sentence pair's second "
                         f"text; drop --pack or --text-pair-column")
    if needs_token_types(cfg, model.config):  # the batches rebuild token_type_ids from [SEP]: check that it holds
        sample = tokenizer("a first text", "and a second one", return_tensors="pt")
        rebuilt = data.pair_token_types(sample["input_ids"], sample["attention_mask"], tokenizer.sep_token_id)
        if "token_type_ids" not in sample or not torch.equal(rebuilt, sample["token_type_ids"]):
            raise ValueError(f"--text-pair-column: {type(tokenizer).__name__} does not mark a pair's second text "
                             f"after the first separator token as fastpt's batches assume; drop --text-pair-column")


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


def build_loaders(cfg: TrainConfig, dist: distributed.DistInfo, inputs: Inputs) -> Loaders:
    device, splits = dist.device, inputs.splits
    pad_id = inputs.tokenizer.pad_token_id or 0
    sep_id = inputs.tokenizer.sep_token_id if needs_token_types(cfg, inputs.model_config) else None
    workers, pin = data.loader_settings(cfg, device.type == "cuda", dist.local_world_size)
    collate = data.make_collator(cfg, pad_id, sep_id)
    train_sampler = data.TrainBatchSampler(splits["train"], cfg.batch_size, dist.rank, dist.world_size, cfg.seed,
                                           cfg.bucket, cfg.bucket_multiplier, balance_tokens=cfg.pack)
    eval_samplers = {name: data.EvalBatchSampler(splits[name], cfg.eval_batch_size, dist.rank, dist.world_size,
                                                 sort_by_length=cfg.varying_lengths)
                     for name in ("validation", "test")}
    if cfg.data_on_device:
        from fastpt.inputs.device_data import DeviceLoader
        loaders = {"train": DeviceLoader(splits["train"], train_sampler, collate, device),
                   **{name: DeviceLoader(splits[name], sampler, collate, device)
                      for name, sampler in eval_samplers.items()}}
    else:
        loaders = {"train": data.make_loader(splits["train"], train_sampler, collate, workers, pin, cfg.seed),
                   **{name: data.make_loader(splits[name], sampler, collate, workers, pin, cfg.seed)
                      for name, sampler in eval_samplers.items()}}
    return Loaders(train_sampler, **loaders, num_workers=workers, pin_memory=pin)


@dataclass
class Parts:
    """What train.py's loop works with, each used directly (no hub object in between)."""
    loaders: Loaders
    forward_loss: Callable  # step.py: autocast, forward, loss, metric sums; compiled whole where the strategy does
    eval_sums: Callable  # evaluation.py: the same for evaluation
    tracker: Tracker | NullTracker  # console and TensorBoard on rank 0, nothing elsewhere
    bookkeeping: Bookkeeping  # where the run is: epoch, step, sums kept on the device, what is due
    record: RunRecord  # history, best epoch, early stopping, validation time (what last.pt keeps beside the weights)


@contextlib.contextmanager
def build(cfg: TrainConfig, dist: distributed.DistInfo, inputs: Inputs, strategy: Strategy, out_dir: Path,
          resume_state: dict | None = None):
    """The parts, built in the order of the module's docstring; what they hold is closed when the run ends.

    After a resume, the bookkeeping starts from last.pt's counters and sums; the weights, optimiser,
    RNG and record are restored by train.py (cli/outputs.py:restore).
    """
    device = dist.device
    backends.configure(cfg, device, cache_root(cfg.cache_dir))
    resume_step = resume_state["progress"]["global_step"] if resume_state else None
    # purge_step: drop what a killed run logged after its checkpoint (logged up to and including it).
    purge_step = None if resume_step is None else resume_step + 1
    tracker = Tracker(out_dir, cfg.progress, cfg.tensorboard, purge_step=purge_step) if dist.is_main else NullTracker()
    splits = inputs.splits
    tracker.print(f"data: {inputs.cache_path} | train {len(splits['train'])}, "
                  f"validation {len(splits['validation'])}, test {len(splits['test'])}")
    loaders = build_loaders(cfg, dist, inputs)
    model, inputs.model = inputs.model, None  # the strategy holds it from here on
    n_params, n_matmul = count_parameters(model)
    layers, hidden = metrics.model_shape(model)
    if cfg.pack:  # padding-free batches: attention per review, the head on each review's first token
        from fastpt.speedups.packing import PackedClassifier
        choice = pack_attention_choice(cfg, dist.device.type)
        model = PackedClassifier(model, choice["kernel"], choice=choice)
    precision = attention_precision.for_run(cfg, dist, model, splits["train"], resume_state)  # rank 0 measures
    model = attention_precision.apply(model, precision)
    if line := attention_precision.describe(precision):  # measured: the choice and both times
        tracker.print(line)
    # to device -> compile -> DDP / FSDP / DeepSpeed -> optimizer, schedule (strategies/base.py)
    batches_per_epoch = inputs.train_examples_used(cfg, dist.world_size) // loaders.train_sampler.global_batch_size
    strategy.setup(model, training_steps=total_steps(cfg, batches_per_epoch))
    weights = (torch.tensor(cfg.class_weight_values, dtype=torch.float32, device=device)
               if cfg.class_weight_values else None)  # --class-weights: the loss's weight of each class
    forward_loss = make_forward_loss(strategy, cfg.max_length, class_weights=weights)
    eval_sums = make_eval_sums(strategy, cfg.max_length, class_weights=weights)
    peak = device_peak(cfg, dist, hidden)  # MFU's denominator: the vendor's figure, or measured (CPUs)
    torch.manual_seed(cfg.seed + dist.rank)  # different dropout masks per rank
    meter = metrics.Throughput(device, WARMUP_STEPS,
                               lambda lengths: metrics.review_flops(lengths, n_matmul, layers, hidden),
                               peak["flops_per_s"], peak_info=peak)
    stopper = GracefulStop(warning_signal=signal.Signals[f"SIG{cfg.requeue_signal}"],  # slurm.py
                           timeout_s=cfg.dist_timeout)  # a hung rank stops the others at the first step's check
    bookkeeping = Bookkeeping(cfg, dist, out_dir, tracker, meter, stopper, strategy, resume=resume_state)
    record = RunRecord(BestTracker(cfg.monitor_mode),
                       EarlyStopping(cfg.monitor_mode, cfg.early_stopping_patience, cfg.min_delta),
                       epoch_offset=resume_state["progress"].get("epoch_offset", 0) if resume_state else 0,
                       batch_size_flag=(resume_state or {}).get("batch_size_flag", cfg.batch_size),
                       label_names=list(inputs.label_names))
    if resume_state:
        tracker.print(f"resumed from step {bookkeeping.global_step} "
                      f"(epoch {bookkeeping.epoch + 1}, batch {bookkeeping.batch_in_epoch})")
    tracker.print(f"model: {cfg.model} ({n_params / 1e6:.1f}M parameters) | strategy: {strategy.name} "
                  f"x{dist.world_size} on {device} | amp: {cfg.amp_dtype if cfg.amp else 'off'} | "
                  f"compile: {cfg.compile} | {'pack' if cfg.pack else f'pad to {cfg.pad_to}'}"
                  f"{' (bucket)' if cfg.bucket else ''}")
    tracker.text("config", cfg.to_json())
    metrics.reset_peak_memory(device)  # the reported peak is training's, not model loading's
    stopper.install()
    try:
        yield Parts(loaders, forward_loss, eval_sums, tracker, bookkeeping, record)
    finally:
        backends.restore(cfg)
        stopper.uninstall()
        strategy.close()
        tracker.close()


def pack_attention_choice(cfg, device_type: str) -> dict:
    """{"kernel", "source"}: --pack-attention's kernel, else the device's rule (packed_attention_kernel).
    The rule reads only settings a resume keeps (--amp) or that change the numbers anyway (the device,
    --compile), so a resumed run attends as it started; an older last.pt's record of a kernel fastpt no
    longer has ("grouped") is not read: such a run continues with the loop, as the rule gives on a CPU."""
    from fastpt.speedups.packed_attention import packed_attention_kernel
    if cfg.pack_attention != "auto":
        return {"kernel": cfg.pack_attention, "source": "--pack-attention"}
    return {"kernel": packed_attention_kernel(device_type, cfg.compile, cfg.amp),
            "source": "packed_attention_kernel's rule for this device"}


def device_peak(cfg, dist, hidden: int) -> dict:
    """The dense peak FLOP/s at the run's precision: the vendor's figure for a known GPU, else the best
    rate of a short matmul probe on this device (monitoring/peak.py), cached per machine."""
    vendor = metrics.device_peak_flops(dist.device, cfg.amp, cfg.tf32)
    if vendor is not None:
        return {"flops_per_s": vendor, "source": f"vendor's dense figure for {torch.cuda.get_device_name(dist.device)}"}
    from fastpt.monitoring import peak
    distributed.barrier()  # the ranks of one host probe together, sharing its cores as their steps will
    dtype = getattr(torch, cfg.amp_dtype) if cfg.amp else torch.float32
    return peak.measured_peak(dist.device, dtype, hidden, Path(cfg.cache_dir) if cfg.cache_dir else None,
                              dist.local_world_size)
