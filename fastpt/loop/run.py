"""The run's set-up: what train.py's loop works with, built in one documented order.

    load_inputs(cfg, dist) -> Inputs        tokenizer, model (initial weights), tokenised splits
    Run(cfg, dist, inputs, out_dir, resume_state):
        backends                            TF32, deterministic kernels, the compile cache (backends.py)
        loaders                             global batches, each rank its share (data.py)
        strategy.setup(model)               to device -> compile -> DDP / FSDP / DeepSpeed -> optimizer
        forward_loss, eval_sums             step.py / evaluation.py, compiled where the strategy does
        tracker, meter, bookkeeping         console, TensorBoard, throughput, counters (machinery/)
        early stopping, best tracker        Lightning's semantics (early_stopping.py)
        last.pt                             after a resume: weights, optimiser, scaler, RNG, counters

`Run` builds; it does not decide the order of a run. train.py does: for each epoch
`start_epoch`, `step.train_epoch`, `evaluate`, `save_best`, `end_epoch`; then `load_best`,
`evaluate("test")`, `report`. What Lightning's `Trainer.fit` + `Trainer.test` do, written out.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fastpt.inputs import data, own_data
from fastpt.inputs.models import check_max_length, check_model_source, count_parameters, load_model, load_tokenizer
from fastpt.inputs.token_cache import cache_root, prepare_splits
from fastpt.machinery.config import TrainConfig
from fastpt.loop.early_stopping import BestTracker, EarlyStopping
from fastpt.loop.evaluation import evaluate, make_eval_sums, per_class
from fastpt.loop.step import make_forward_loss
from fastpt.machinery import checkpoint, distributed, metrics
from fastpt.machinery.bookkeeping import Bookkeeping
from fastpt.machinery.errors import NonFiniteLoss
from fastpt.machinery.signals import GracefulStop
from fastpt.machinery.tracking import NullTracker, Tracker
from fastpt.speedups import backends
from fastpt.strategies import build_strategy


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
        splits, cache_path, label_names, cfg.data_splits = own_data.prepare_splits(cfg, tokenizer, **shared)
        cfg.label_names = label_names
    seed_everything(cfg.seed)  # identical initial weights on every rank (FSDP does not broadcast)
    model = load_model(cfg.model, cfg.random_init, cfg.attn_implementation, label_names)
    check_model_fits(cfg, model, tokenizer)
    sizes = {"train": cfg.train_size, "validation": cfg.val_size, "test": cfg.test_size}
    inputs = Inputs(tokenizer, model, {name: splits[name].head(n) for name, n in sizes.items()}, cache_path,
                    cfg.label_names, model.config)
    if inputs.train_examples_used(cfg, dist.world_size) == 0:
        raise ValueError(f"{len(inputs.splits['train'])} training examples over {dist.world_size} process(es) "
                         f"make no full batch of {cfg.batch_size}")
    return inputs


def check_model_fits(cfg: TrainConfig, model, tokenizer) -> None:
    """What --pack and sentence pairs need of the model, refused before anything is written."""
    from fastpt.speedups.packing import PACKED_MODELS

    kind = model.config.model_type
    if cfg.pack and kind not in PACKED_MODELS:
        raise ValueError(f"--pack supports {', '.join(PACKED_MODELS)} models, not {kind}; drop --pack")
    if cfg.pack and pair_token_types(cfg, model.config):
        raise ValueError(f"--pack cannot carry the token_type_ids that {kind} gives a sentence pair's second "
                         f"text; drop --pack or --text-pair-column")
    if pair_token_types(cfg, model.config):  # the batches rebuild token_type_ids from [SEP]: check that it holds
        sample = tokenizer("a first text", "and a second one", return_tensors="pt")
        rebuilt = data.pair_token_types(sample["input_ids"], sample["attention_mask"], tokenizer.sep_token_id)
        if "token_type_ids" not in sample or not torch.equal(rebuilt, sample["token_type_ids"]):
            raise ValueError(f"--text-pair-column: {type(tokenizer).__name__} does not mark a pair's second text "
                             f"after the first separator token as fastpt's batches assume; drop --text-pair-column")


def pair_token_types(cfg: TrainConfig, model_config) -> bool:
    """Whether batches need token_type_ids: sentence pairs on a model with segment embeddings (BERT; not
    DistilBERT, which has none, nor RoBERTa, which has one)."""
    return bool(cfg.text_pair_column) and getattr(model_config, "type_vocab_size", 0) > 1


class Run:
    """Everything the loop in train.py calls, built in the order above; `with Run(...)` closes it."""

    def __init__(self, cfg: TrainConfig, dist: distributed.DistInfo, inputs: Inputs, out_dir: Path,
                 resume_state: dict | None = None):
        self.cfg, self.dist, self.out_dir, self.inputs = cfg, dist, out_dir, inputs
        self.device = dist.device
        self.ckpt_dir = out_dir / "checkpoints"
        self.resume_state = resume_state
        self.splits = inputs.splits
        self.epoch_offset = resume_state["progress"].get("epoch_offset", 0) if resume_state else 0
        self.history: list[dict] = []
        self.val_time_s = 0.0
        self.val_compile_s = 0.0  # the part of val_time_s spent compiling evaluation graphs
        self.early_stopping = EarlyStopping(cfg.monitor_mode, cfg.early_stopping_patience, cfg.min_delta)
        self.best = BestTracker(cfg.monitor_mode)
        self.stopper = GracefulStop()

        backends.configure(cfg, self.device, cache_root(cfg.cache_dir))
        sep_id = inputs.tokenizer.sep_token_id if pair_token_types(cfg, inputs.model_config) else None
        self._build_loaders(inputs.tokenizer.pad_token_id or 0, sep_id)
        model, inputs.model = inputs.model, None  # the strategy holds it from here on
        resume_step = resume_state["progress"]["global_step"] if resume_state else None
        # purge_step: drop what a killed run logged after its checkpoint (logged up to and including it).
        self.tracker = (Tracker(out_dir, cfg.progress, cfg.tensorboard,
                                purge_step=None if resume_step is None else resume_step + 1)
                        if dist.is_main else NullTracker())
        self.tracker.print(f"data: {inputs.cache_path} | train {len(self.splits['train'])}, "
                           f"validation {len(self.splits['validation'])}, test {len(self.splits['test'])}")
        n_params, n_matmul = count_parameters(model)
        layers, hidden = metrics.model_shape(model)
        if cfg.pack:  # padding-free batches: attention per review, the head on each review's first token
            from fastpt.speedups.packing import PackedClassifier, packed_attention_kernel
            model = PackedClassifier(model, packed_attention_kernel(self.device.type, cfg.compile, cfg.amp))
        self.strategy = build_strategy(cfg, dist)
        self.strategy.setup(model)
        self.forward_loss = make_forward_loss(self.strategy, cfg.max_length)
        self.eval_sums = make_eval_sums(self.strategy, cfg.max_length)
        torch.manual_seed(cfg.seed + dist.rank)  # different dropout masks per rank
        peak = metrics.device_peak_flops(self.device, cfg.amp, cfg.tf32)
        meter = metrics.Throughput(self.device, WARMUP_STEPS,
                                   lambda lengths: metrics.review_flops(lengths, n_matmul, layers, hidden), peak)
        if resume_state:
            self._restore(resume_state)
        self.book = Bookkeeping(cfg, dist, out_dir, self.tracker, meter, self.stopper,
                                self.strategy.skips_nonfinite_steps,
                                lr=lambda: self.strategy.optimizer.param_groups[0]["lr"], resume=resume_state,
                                step_was_skipped=self.strategy.step_was_skipped)
        if resume_state:
            self.tracker.print(f"resumed from step {self.book.global_step} "
                               f"(epoch {self.book.epoch + 1}, batch {self.book.batch_in_epoch})")
        self.tracker.print(f"model: {cfg.model} ({n_params / 1e6:.1f}M parameters) | strategy: {self.strategy.name} "
                           f"x{dist.world_size} on {self.device} | amp: {cfg.amp_dtype if cfg.amp else 'off'} | "
                           f"compile: {cfg.compile} | {'pack' if cfg.pack else f'pad to {cfg.pad_to}'}"
                           f"{' (bucket)' if cfg.bucket else ''}")
        self.tracker.text("config", cfg.to_json())
        metrics.reset_peak_memory(self.device)  # the reported peak is training's, not model loading's
        self.stopper.install()

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc) -> None:
        backends.restore(self.cfg)
        self.stopper.uninstall()
        self.strategy.close()
        self.tracker.close()

    def _build_loaders(self, pad_id: int, sep_id: int | None = None) -> None:
        """The training sampler and loader, and one evaluation loader per split (data.py)."""
        cfg, dist = self.cfg, self.dist
        workers, pin = data.loader_settings(cfg, self.device.type == "cuda", dist.local_world_size)
        collate = data.make_collator(cfg, pad_id, sep_id)
        self.train_sampler = data.TrainBatchSampler(self.splits["train"], cfg.batch_size, dist.rank, dist.world_size,
                                                    cfg.seed, cfg.bucket, cfg.bucket_multiplier,
                                                    balance_tokens=cfg.pack)
        eval_samplers = {name: data.EvalBatchSampler(self.splits[name], cfg.eval_batch_size, dist.rank,
                                                     dist.world_size, sort_by_length=cfg.varying_lengths)
                         for name in ("validation", "test")}
        if cfg.data_on_device:
            from fastpt.inputs.device_data import DeviceLoader
            self.train_loader = DeviceLoader(self.splits["train"], self.train_sampler, collate, self.device)
            self.eval_loaders = {name: DeviceLoader(self.splits[name], sampler, collate, self.device)
                                 for name, sampler in eval_samplers.items()}
        else:
            self.train_loader = data.make_loader(self.splits["train"], self.train_sampler, collate, workers, pin,
                                                 cfg.seed)
            self.eval_loaders = {name: data.make_loader(self.splits[name], sampler, collate, workers, pin, cfg.seed)
                                 for name, sampler in eval_samplers.items()}
        self.num_workers, self.pin_memory = workers, pin

    def train_examples_used(self) -> int:
        return self.inputs.train_examples_used(self.cfg, self.dist.world_size)

    # ------------------------------------------------------------------ the epoch
    def start_epoch(self) -> None:
        """The epoch's shuffle (after a resume: what is left of it), its clock, sums and progress bar."""
        self.train_sampler.set_epoch(self.book.epoch, self.book.batch_in_epoch, self.epoch_offset)
        self.book.start_epoch(len(self.train_loader))

    def evaluate(self, split: str) -> dict:
        """{'loss', 'acc', 'macro_f1', 'confusion', 'n'} of the validation or test split: no gradients,
        every rank its share."""
        loader = self.eval_loaders[split]
        bar = self.tracker.bar(len(loader), f"{split}")
        start, compiled_before = time.perf_counter(), self.book.compile_clock.seconds
        out = evaluate(self.strategy, loader, self.eval_sums, bar, self.book.compile_clock,
                       num_labels=len(self.inputs.label_names))
        if split == "validation":
            self.val_time_s += time.perf_counter() - start  # evaluate() ends reading the sums: synchronised
            # Host time of the batches that compiled (the clock's, as for train_time_no_compile_s): taking it
            # out leaves the steady rate over every review, with no sync added. Dropping whole first batches
            # instead would bias it: sorted evaluation batches start with the longest reviews.
            self.val_compile_s += self.book.compile_clock.seconds - compiled_before
        bar.close()
        return out

    def check_finite(self, val: dict) -> None:
        """A NaN validation loss: the run diverged. Stop, with no best.pt, early-stopping verdict or last.pt from it."""
        if not math.isfinite(val["loss"]):
            raise NonFiniteLoss(f"validation loss is {val['loss']} after epoch {self.book.epoch + 1} "
                                f"(step {self.book.global_step}): the model diverged (no best.pt is saved from it; "
                                f"try a lower --lr or --max-grad-norm)")

    def end_epoch(self, train_metrics: dict, val: dict, improved: bool) -> None:
        """The epoch's line, TensorBoard and history; the epoch clock stops; last.pt with --save-every."""
        cfg, book = self.cfg, self.book
        book.stop_epoch_clock()
        row = {"epoch": book.epoch + 1, "step": book.global_step, **train_metrics,
               "val_loss": val["loss"], "val_acc": val["acc"], "val_macro_f1": val["macro_f1"],
               "train_time_s": book.train_time_s}
        self.history.append(row)
        self.tracker.scalars({k: v for k, v in row.items() if k not in ("epoch", "step")}, book.global_step, "epoch/")
        self.tracker.print(f"epoch {book.epoch + 1}: train loss {row['train_loss']:.4f} acc {row['train_acc']:.4f} | "
                           f"val loss {val['loss']:.4f} acc {val['acc']:.4f} macro-F1 {val['macro_f1']:.4f}"
                           f"{' (best)' if improved else ''} | "
                           f"{book.train_time_s:.1f} s")
        if self.early_stopping.stopped:
            self.tracker.print(f"early stopping: {self.early_stopping.reason}")
        book.next_epoch()
        self.epoch_offset = 0  # only a resumed epoch starts off a global-batch boundary (resize.py)
        if cfg.save_every is not None:
            self.save_last()

    # ------------------------------------------------------------------ checkpoints
    def save_best(self, value: float) -> None:
        state = self.strategy.model_state_dict()  # a collective where the model is sharded
        if self.dist.is_main:
            checkpoint.save_atomic({"model": state, "config": self.cfg.to_dict(), "epoch": self.book.epoch + 1,
                                    "step": self.book.global_step, "monitor": self.cfg.monitor, "value": value},
                                   self.ckpt_dir / "best.pt")

    def save_last(self) -> None:
        """checkpoints/last.pt: everything needed to continue exactly from this step.

        Per rank: the RNG states (dropout masks) and the bookkeeping's running sums, so a resumed
        run logs, averages and draws exactly what the uninterrupted run would have.
        """
        training = self.strategy.training_state(self.ckpt_dir)
        mine = checkpoint.to_bytes({"rng": checkpoint.rng_state(), **self.book.rank_state()})
        per_rank = [checkpoint.from_bytes(b) for b in distributed.all_gather_object(mine)]
        if not self.dist.is_main:
            return
        state = {
            "config": self.cfg.to_dict(),
            "world_size": self.dist.world_size,
            "training": training,
            "progress": {**self.book.progress(), "val_time_s": self.val_time_s, "val_compile_s": self.val_compile_s,
                         "examples_in_epoch": self.examples_in_epoch()},
            "batch_size_flag": (self.resume_state or {}).get("batch_size_flag", self.cfg.batch_size),  # resize.py
            "early_stopping": self.early_stopping.state_dict(),
            "best": self.best.state_dict(),
            "history": self.history,
            "per_rank": per_rank,
        }
        checkpoint.save_atomic(state, self.ckpt_dir / "last.pt")

    def examples_in_epoch(self) -> int:
        """Reviews of the epoch's order already trained on (or skipped): the position on any number of processes."""
        done = self.book.batch_in_epoch
        return self.epoch_offset + done * self.train_sampler.global_batch_size if done else 0

    def _restore(self, state: dict) -> None:
        """Model, optimiser, scaler, RNG, early stopping and history from last.pt.

        The bookkeeping reads its own part (counters, sums) when it is built."""
        self.strategy.load_training_state(state["training"], self.ckpt_dir)
        if state["early_stopping"]:
            self.early_stopping.load_state_dict(state["early_stopping"])
        self.best.load_state_dict(state["best"])
        self.history = list(state["history"])
        self.val_time_s = state["progress"].get("val_time_s", 0.0)
        self.val_compile_s = state["progress"].get("val_compile_s", 0.0)
        checkpoint.set_rng_state(state["per_rank"][self.dist.rank]["rng"])

    def load_best(self) -> None:
        """The weights to test: best.pt's (--test-on best, where one was saved), else the last ones."""
        self.tested_on = self.cfg.test_on
        if self.cfg.test_on != "best":
            return
        best_path = self.ckpt_dir / "best.pt"
        # Rank 0 wrote best.pt and reads it; the weights reach the other ranks over the group,
        # so no rank needs to see rank 0's disk.
        weights = checkpoint.load_model_weights(best_path) if self.dist.is_main and best_path.exists() else None
        weights = distributed.broadcast_state(weights)
        if weights is not None:
            self.strategy.load_model_state_dict(weights)
        else:
            self.tested_on = "last (no best checkpoint)"

    # ------------------------------------------------------------------ results
    def report(self, test: dict) -> dict:
        """results.json (and the console's last line, TensorBoard's test scalars and HPARAMS)."""
        cfg, book = self.cfg, self.book
        tested_on = self.tested_on
        stopped_early = self.early_stopping.stopped
        compile_s = book.compile_clock.seconds
        results = {
            "test_acc": test["acc"], "test_loss": test["loss"], "test_examples": test["n"], "tested_on": tested_on,
            "train_examples": len(self.splits["train"]), "train_examples_used": self.train_examples_used(),
            "val_examples": len(self.splits["validation"]),
            "best_val_acc": max((h["val_acc"] for h in self.history), default=None),
            "test_macro_f1": test["macro_f1"],
            # (a run resumed from a last.pt of an older fastpt has epochs without it)
            "best_val_macro_f1": max((h["val_macro_f1"] for h in self.history if "val_macro_f1" in h), default=None),
            "label_names": self.inputs.label_names,
            # per label: support (true), predicted, correct, precision, recall, F1; confusion[true][predicted]
            "test_per_class": per_class(test["confusion"], self.inputs.label_names),
            "test_confusion": test["confusion"],
            "best_monitor": self.best.best, "monitor": cfg.monitor, "best_epoch": self.best.best_epoch,
            "epochs_run": len(self.history), "global_steps": book.global_step,
            "stopped_early": stopped_early,
            "stop_reason": self.early_stopping.reason if stopped_early else "",
            "train_time_s": book.train_time_s,  # training + validation, compilation included (the article's)
            "compile_time_s": compile_s if cfg.compile else None,
            "train_time_no_compile_s": book.train_time_s - compile_s,
            "val_time_s": self.val_time_s,  # every validation, compilation included
            "val_time_no_compile_s": self.val_time_s - self.val_compile_s,  # over epochs_run x val_examples reviews
            "first_step_s": book.first_step_s,
            "compiled_graphs": book.compile_clock.graphs if cfg.compile else None,
            "batch_shapes": len(book.token_shapes),  # distinct token widths (packed: lengths) this process trained on
            # Mean over the last epoch's steps of max / mean tokens per rank: every step waits for the fullest rank.
            "rank_token_imbalance": data.rank_token_imbalance(self.train_sampler, data.computed_tokens(cfg)),
            **metrics.rate_results(book.meter, self.dist.world_size, book.resumed_at_step),
            "peak_memory_bytes": metrics.peak_memory_bytes(self.device),
            "memory_per_rank": distributed.all_gather_object(self.strategy.memory_report()),  # list, by rank
            "strategy": self.strategy.name, "world_size": self.dist.world_size, "device": str(self.device),
            "device_name": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
            "num_workers": self.num_workers, "pin_memory": self.pin_memory,
            "history": self.history,
            "torch": torch.__version__,
        }
        rate = results["samples_per_s"]
        self.tracker.print(f"test ({tested_on}): loss {test['loss']:.4f} acc {test['acc']:.4f} "
                           f"macro-F1 {test['macro_f1']:.4f} "
                           f"on {test['n']} {'examples' if cfg.data else 'reviews'} | "
                           f"train time {book.train_time_s / 60:.2f} min"
                           + (f" | {rate:.1f} samples/s" if rate is not None else ""))
        self.tracker.scalars({"test_acc": test["acc"], "test_loss": test["loss"], "test_macro_f1": test["macro_f1"]},
                             book.global_step, "test/")
        self.tracker.scalars({f"rank{r}/{k}": v for r, m in enumerate(results["memory_per_rank"])
                              for k, v in m.items()},
                             book.global_step, "memory/")
        self.tracker.hparams(cfg.to_dict(), {k: results[k] for k in ("test_acc", "test_loss", "test_macro_f1",
                                                                     "best_val_acc",
                                                                     "train_time_s", "samples_per_s")
                                             if results[k] is not None})
        self.tracker.write_json("results.json", results)
        return results

    # ------------------------------------------------------------------ export
    def export(self) -> None:
        """--export-dir: the tested weights as a Hugging Face model folder (weights, config with the
        label names, tokenizer); `transformers.pipeline("text-classification", model=DIR)` loads it."""
        from transformers import AutoModelForSequenceClassification

        from fastpt.inputs.models import label_config

        state = self.strategy.model_state_dict()  # a collective where the model is sharded
        if not self.dist.is_main:
            return
        config = self.inputs.model_config
        labels = label_config(self.inputs.label_names)
        config.id2label, config.label2id = labels["id2label"], labels["label2id"]
        model = AutoModelForSequenceClassification.from_config(config)
        model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
        out = Path(self.cfg.export_dir)
        model.save_pretrained(out)
        self.inputs.tokenizer.save_pretrained(out)
        self.tracker.print(f"exported: {out} (transformers.pipeline('text-classification', model=...))")
