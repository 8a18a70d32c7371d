"""The build step: what train.py's loop works with, built in one documented order, as plain parts.

    load_inputs(cfg, dist) -> Inputs        tokenizer, model (initial weights), tokenised splits, and
                                            what the data decides: label names, class weights
    build(cfg, dist, inputs, strategy, out_dir, resume_state) -> Parts:
        backends                            TF32, deterministic kernels, the compile cache (backends.py)
        tracker                             console, TensorBoard (rank 0 writes; monitoring/tracking.py)
        loaders                             global batches, each rank its share (inputs/data.py)
        --pack                              packed batches and their attention kernel (speedups/packing.py)
        attention's precision               on a CPU under --amp, measured (speedups/attention_precision.py)
        the model, training_steps           what train.py hands strategy.setup (strategies/base.py)
        forward_loss, eval_sums             step.py / evaluation.py, eager: train.py has the strategy compile them
        bookkeeping, stopper, record        position, device sums, clocks, what is due, the bar (bookkeeping.py);
                                            the graceful stop (signals.py); best epoch, early stopping (record.py)

`build` builds; it does not decide the order of a run, and the parts have no methods that run
one. train.py does: strategy.setup (to device -> compile -> DDP / FSDP / DeepSpeed -> optimizer),
then for each epoch `step.train_epoch`, `evaluation.evaluate`, the best tracker, best.pt, early
stopping; then the best weights, the test and results.json (cli/outputs.py).
What Lightning's `Trainer.fit` + `Trainer.test` do, written out.
"""

import contextlib
import json
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
from fastpt.loop.bookkeeping import Bookkeeping, Clocks, DeviceSums, DueCheck, Position
from fastpt.loop.early_stopping import BestTracker, EarlyStopping
from fastpt.loop.evaluation import make_eval_sums
from fastpt.loop.loaders import Loaders, build_loaders, needs_token_types
from fastpt.loop.record import RunRecord
from fastpt.loop.step import class_weights, make_forward_loss
from fastpt.cluster import distributed
from fastpt.monitoring import metrics
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
    """What a run reads before it writes anything: bad input fails here, with the run folder untouched.

    What the data decides travels here, not in the config: the label names (the table's, or
    --label-names), where each split came from, the class weights' values (--class-weights balanced
    counts the training split)."""
    tokenizer: object
    model: torch.nn.Module  # initial weights, on the CPU; the strategy takes it over
    splits: dict  # "train", "validation", "test" -> data.TokenizedSplit, cut to --train-size etc.
    cache_path: Path  # the token cache they came from
    label_names: list  # id i is label_names[i] (IMDB: neg, pos)
    model_config: object = None  # the model's config, for --export-dir (the strategy takes the model)
    data_splits: dict | None = None  # --data: where each split came from (own_data.py); IMDB: None
    class_weight_values: list | None = None  # --class-weights: the loss's weight of each class
    # Where --label-names renamed them, the data's own labels in id order ("0", "1"): what a file labelled
    # like the training data holds, read by fastpt-predict and by predictions.csv's check.
    data_label_names: list | None = None

    def train_examples_used(self, cfg: TrainConfig, world_size: int) -> int:
        """Reviews one epoch trains on, over all processes: its whole global batches (TrainBatchSampler
        drops the last, short one)."""
        global_batch = cfg.batch_size * world_size
        return len(self.splits["train"]) // global_batch * global_batch


def saved_config(cfg: TrainConfig, inputs: Inputs) -> dict:
    """The config as a run saves it (config.json, best.pt, last.pt): every setting, and what the data decided."""
    return {**cfg.to_dict(), "label_names": list(inputs.label_names), "data_splits": inputs.data_splits,
            "class_weight_values": inputs.class_weight_values, "data_label_names": inputs.data_label_names}


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
        label_names, data_splits, data_label_names = None, None, None  # the model's config as the article's run has it
    else:  # --data: your own table (own_data.py)
        splits, cache_path, data_labels, data_splits = own_data.prepare_own_splits(cfg, tokenizer, **shared)
        label_names = columns.named_labels(data_labels, cfg.label_names)  # --label-names, if given
        data_label_names = data_labels if label_names != data_labels else None
    seed_everything(cfg.seed)  # identical initial weights on every rank (FSDP does not broadcast)
    model = load_model(cfg.model, cfg.random_init, cfg.attn_implementation, label_names)
    check_model_fits(cfg, model, tokenizer)
    sizes = {"train": cfg.train_size, "validation": cfg.val_size, "test": cfg.test_size}
    inputs = Inputs(tokenizer, model, {name: splits[name].head(n) for name, n in sizes.items()}, cache_path,
                    label_names or list(IMDB_LABELS), model.config, data_splits, data_label_names=data_label_names)
    if inputs.train_examples_used(cfg, dist.world_size) == 0:
        raise ValueError(f"{len(inputs.splits['train'])} training examples over {dist.world_size} process(es) "
                         f"make no full batch of {cfg.batch_size}")
    inputs.class_weight_values = class_weights(cfg.class_weights, inputs.splits["train"].labels, inputs.label_names)
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


@dataclass
class Parts:
    """What train.py's loop works with, each used directly (no hub object in between)."""
    loaders: Loaders
    model: torch.nn.Module  # for strategy.setup: packed where --pack asks, on the CPU until then
    training_steps: int  # the run's optimiser steps: the learning-rate schedule's length
    forward_loss: Callable  # step.py: autocast, forward, loss, metric sums (eager: strategy.compile_step)
    eval_sums: Callable  # evaluation.py: the same for evaluation
    config: dict  # the config as best.pt and last.pt keep it (saved_config)
    tracker: Tracker | NullTracker  # console and TensorBoard on rank 0, nothing elsewhere
    bookkeeping: Bookkeeping  # the parts around the step: position, device sums, clocks, what is due, the bar
    stopper: GracefulStop  # SIGTERM / SIGINT / --requeue-signal: train.py installs it when training starts
    record: RunRecord  # history, best epoch, early stopping, validation time (what last.pt keeps beside the weights)


@contextlib.contextmanager
def build(cfg: TrainConfig, dist: distributed.DistInfo, inputs: Inputs, strategy: Strategy, out_dir: Path,
          resume_state: dict | None = None):
    """The parts, built in the order of the module's docstring; what they hold is closed when the run ends.

    After a resume, the bookkeeping starts from last.pt's position, sums and clocks; the weights,
    optimiser, RNG and record are restored by train.py (loop/checkpoints.py:restore).
    """
    device = dist.device
    backends.configure(cfg, device, cache_root(cfg.cache_dir))
    # purge_step: drop what a killed run logged after its checkpoint (logged up to and including it).
    purge_step = resume_state["progress"]["global_step"] + 1 if resume_state else None
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
    training_steps = total_steps(cfg, batches_per_epoch)  # the schedule's length, for strategy.setup (train.py)
    weights = (torch.tensor(inputs.class_weight_values, dtype=torch.float32, device=device)
               if inputs.class_weight_values else None)  # --class-weights: the loss's weight of each class
    forward_loss = make_forward_loss(strategy.precision, cfg.max_length, class_weights=weights)
    eval_sums = make_eval_sums(strategy.precision, cfg.max_length, class_weights=weights)
    peak = device_peak(cfg, dist, hidden)  # MFU's denominator: the vendor's figure, or measured (CPUs)
    meter = metrics.Throughput(device, WARMUP_STEPS,
                               lambda lengths: metrics.review_flops(lengths, n_matmul, layers, hidden),
                               peak["flops_per_s"], peak_info=peak)
    stopper = GracefulStop(warning_signal=signal.Signals[f"SIG{cfg.requeue_signal}"],  # slurm.py
                           timeout_s=cfg.dist_timeout)  # a hung rank stops the others at the first step's check
    progress = resume_state["progress"] if resume_state else None
    position = Position.resumed(progress) if progress else Position()
    bookkeeping = Bookkeeping(position, DeviceSums(device, resume_state and resume_state["per_rank"][dist.rank]),
                              Clocks(device, meter, progress), DueCheck(cfg, dist, stopper, out_dir), tracker, strategy,
                              cfg.epochs, dist.world_size)
    record = RunRecord(BestTracker(cfg.monitor_mode),
                       EarlyStopping(cfg.monitor_mode, cfg.early_stopping_patience, cfg.min_delta),
                       epoch_offset=progress.get("epoch_offset", 0) if progress else 0,
                       batch_size_flag=(resume_state or {}).get("batch_size_flag", cfg.batch_size),
                       label_names=list(inputs.label_names))
    if resume_state:
        tracker.print(f"resumed from step {position.global_step} "
                      f"(epoch {position.epoch + 1}, batch {position.batch_in_epoch})")
    tracker.print(f"model: {cfg.model} ({n_params / 1e6:.1f}M parameters) | strategy: {strategy.name} "
                  f"x{dist.world_size} on {device} | amp: {cfg.amp_dtype if cfg.amp else 'off'} | "
                  f"compile: {cfg.compile} | {'pack' if cfg.pack else f'pad to {cfg.pad_to}'}"
                  f"{' (bucket)' if cfg.bucket else ''}")
    config = saved_config(cfg, inputs)
    tracker.text("config", json.dumps(config, indent=2, sort_keys=True))
    try:
        yield Parts(loaders, model, training_steps, forward_loss, eval_sums, config, tracker, bookkeeping, stopper,
                    record)
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
