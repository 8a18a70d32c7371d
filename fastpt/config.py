"""Run configuration: one typed dataclass, built from the command line, validated once, then frozen.

Every setting of a run lives in `TrainConfig`. `parse_args` turns `train.py`'s command line
into one; `TrainConfig.__post_init__` checks every value and raises `ValueError` with a
one-line message that names the bad setting, before any data is read or any folder written,
fills in the defaults that depend on other settings, and freezes it: assigning to a setting
afterwards raises `dataclasses.FrozenInstanceError`. A config is a value, passed down to every
layer that reads it.

A real change later is a new value, `dataclasses.replace(cfg, ...)` (checked again), passed on:
`cli/shell.py:resolve_config` fills in every "decide for me" setting (absolute paths, loader
workers and pinned memory, fused Adam on CUDA), a resume on another number of processes gets its
per-process batch (`cluster/resize.py:adapt`), and the IMDB folder that loading found is recorded.
What the data decides is not a setting: `loop/build.py:load_inputs` puts the label names, where
each split came from and the class weights' values on `Inputs`, and the saved config
(`config.json` next to the results, and inside every checkpoint) adds them under the names
`label_names`, `data_splits` and `class_weight_values`.

Defaults are the article's run: distilbert-base-uncased, 3 epochs, batch 12, Adam 5e-5,
seed 123, sequences truncated and padded to 512 tokens.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Optional


STRATEGIES = ("ddp", "fsdp", "deepspeed")

# The allowed values of every setting with a fixed set: argparse's choices and the dataclass check.
CHOICES = {
    "monitor": ("val_acc", "val_loss", "val_macro_f1"),
    "test_on": ("best", "last"),
    "pad_to": ("max_length", "longest"),
    "device": ("auto", "cpu", "cuda"),
    "amp_dtype": ("float16", "bfloat16"),
    "compile_mode": ("default", "max-autotune-no-cudagraphs", "max-autotune", "reduce-overhead"),  # see compile.py
    "compile_scope": ("layers", "whole"),  # see compile.py
    "attn_implementation": ("sdpa", "eager"),
    "pack_attention": ("auto", "loop", "grouped", "mask"),  # see packed_attention.py, attention_probe.py
    "strategy": ("single",) + STRATEGIES,
    "zero_stage": (1, 2, 3),
    "optimizer": ("adam", "adamw"),
    "lr_schedule": ("constant", "linear", "cosine"),
}

# Settings that mean something only beside a switch: (the switch's flag, whether a config has it on).
# The command line refuses them without it (args.py); TensorBoard's HPARAMS leaves them out (tracking.py).
NEEDS = {
    "amp_dtype": ("--amp", lambda c: c.get("amp")),
    "compile_mode": ("--compile", lambda c: c.get("compile")),
    "compile_scope": ("--compile", lambda c: c.get("compile")),
    "bucket_multiplier": ("--bucket", lambda c: c.get("bucket")),
    "pack_attention": ("--pack", lambda c: c.get("pack")),
    "zero_stage": ("--deepspeed", lambda c: c.get("strategy") == "deepspeed"),
    "deepspeed_config": ("--deepspeed", lambda c: c.get("strategy") == "deepspeed"),
    "fsdp_reshard_after_forward": ("--fsdp", lambda c: c.get("strategy") == "fsdp"),
    "min_delta": ("--early-stopping-patience", lambda c: c.get("early_stopping_patience") is not None),
    "weight_decay": ("--optimizer adamw", lambda c: c.get("optimizer") == "adamw"),
    # Your own data (fastpt/inputs/own_data.py): these describe the table --data names.
    **{name: ("--data", lambda c: c.get("data")) for name in (
        "val_data", "test_data", "text_column", "text_pair_column", "label_column", "val_fraction",
        "test_fraction", "split_seed")},
}

# Settings that change what a checkpoint holds: resuming with any of them changed is refused.
RESUME_SENSITIVE = (
    "model", "random_init", "max_length", "batch_size", "lr", "seed", "grad_accum",
    "train_size", "strategy", "amp", "amp_dtype", "zero_stage", "bucket", "pad_to", "pack",
    "data", "val_data", "test_data", "text_column", "text_pair_column", "label_column", "val_fraction",
    "test_fraction", "split_seed", "optimizer", "weight_decay", "lr_schedule", "warmup_ratio", "warmup_steps",
    "class_weights",
)
# Of those, the ones added after runs were first saved: a config.json or last.pt without them ran with
# their defaults (the article's Adam at a constant rate, an unweighted loss).
LATER_SETTINGS = ("optimizer", "weight_decay", "lr_schedule", "warmup_ratio", "warmup_steps", "class_weights")


# --requeue-signal: by name without SIG, as sbatch --signal writes it; the ones a job is sent and can catch.
CATCHABLE_SIGNALS = ("USR1", "USR2", "TERM", "INT", "HUP", "QUIT", "ALRM", "XCPU")


@dataclass
class TrainConfig:
    # What to train on.
    model: str = "distilbert-base-uncased"
    random_init: bool = False
    data_dir: Optional[str] = None
    cache_dir: Optional[str] = None
    max_length: int = 512
    train_size: Optional[int] = None
    val_size: Optional[int] = None
    test_size: Optional[int] = None
    # Your own data instead of IMDB (fastpt/inputs/own_data.py); None: IMDB, the article's run.
    data: Optional[str] = None  # a CSV / TSV / JSON Lines / Parquet file, a save_to_disk folder or a Hub name
    val_data: Optional[str] = None  # the validation split's own file (else carved from --data)
    test_data: Optional[str] = None  # the test split's own file (else carved from --data)
    text_column: Optional[str] = None  # "text" with --data
    text_pair_column: Optional[str] = None  # a second text (sentence pairs): tokenizer(text, pair)
    label_column: Optional[str] = None  # "label" with --data
    val_fraction: Optional[float] = None  # carved from the training set where --data has no validation split
    test_fraction: Optional[float] = None  # likewise for test
    split_seed: int = 0  # the carving's shuffle (not --seed: a new --seed keeps the split)
    export_dir: Optional[str] = None  # the tested weights as a Hugging Face model folder
    # --label-names: --data's integer labels named (a comma list, one name per label, in the ids' order).
    # The names a run trains with are the data's (Inputs.label_names): these, or the ones the table has.
    label_names: Optional[list] = None

    # The article's hyperparameters.
    batch_size: int = 12
    epochs: int = 3
    lr: float = 5e-5
    seed: int = 123
    max_steps: Optional[int] = None

    # Optimiser, schedule and loss as transformers' Trainer has them (strategies/optimizer.py); the
    # defaults are the article's: Adam at a constant rate, plain cross-entropy.
    optimizer: str = "adam"  # or adamw: decoupled weight decay
    weight_decay: float = 0.0  # with adamw: on every weight but biases and LayerNorm weights
    lr_schedule: str = "constant"  # or linear / cosine decay to 0 over the run's optimiser steps
    warmup_ratio: Optional[float] = None  # the share of the run's steps warming up from 0 (rounded up)
    warmup_steps: Optional[int] = None  # or that many steps
    class_weights: Optional[object] = None  # "balanced" or one weight per class (a comma list on the command line)

    # Lightning behaviours reproduced by hand.
    early_stopping_patience: Optional[int] = None
    min_delta: float = 0.0
    monitor: str = "val_acc"
    test_on: str = "best"

    # Data loading.
    num_workers: Optional[int] = None
    pin_memory: Optional[bool] = None
    pad_to: str = "max_length"
    bucket: bool = False
    bucket_multiplier: int = 50
    pack: bool = False
    pack_multiple: Optional[int] = None
    pack_attention: str = "auto"  # the packed attention kernel; auto: measured on a CPU (attention_probe.py)
    data_on_device: bool = False
    eval_batch_size: int = 128

    # Single-device speed-ups.
    device: str = "auto"
    amp: bool = False
    amp_dtype: str = "float16"
    compile: bool = False
    compile_mode: str = "default"
    compile_scope: str = "layers"
    fused_adam: Optional[bool] = None
    cheap_dropout: bool = False  # dropout masks from 16-bit slices (speedups/dropout.py)
    tf32: bool = False
    attn_implementation: str = "sdpa"
    grad_accum: int = 1
    max_grad_norm: Optional[float] = None
    deterministic: bool = False

    # Multi-process strategies.
    strategy: str = "single"
    fsdp_reshard_after_forward: bool = True
    zero_stage: int = 2
    deepspeed_config: Optional[str] = None
    dist_timeout: int = 600  # seconds any collective (and joining the group) may wait for the other ranks

    # Outputs and reliability.
    out: Optional[str] = None
    overwrite: bool = False
    log_every: int = 50
    save_every: Optional[int] = None
    save_every_minutes: float = 10.0  # last.pt by rank 0's clock too (bookkeeping.py); 0: off
    resume: Optional[str] = None
    requeue_signal: str = "USR1"  # SLURM's warning before a time limit: save, requeue the job (cluster/slurm.py)
    progress: bool = True
    tensorboard: bool = True
    verbose: bool = False

    def __post_init__(self) -> None:
        positive = ["max_length", "batch_size", "epochs", "grad_accum", "log_every", "bucket_multiplier",
                    "eval_batch_size", "dist_timeout"]
        optional_positive = ["train_size", "val_size", "test_size", "max_steps", "save_every",
                             "early_stopping_patience", "pack_multiple"]
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"--{flag_name(name)} must be positive, got {getattr(self, name)}")
        for name in optional_positive:
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"--{flag_name(name)} must be positive, got {value}")
        # float("nan") and float("inf") parse as floats; none of these settings means anything with them.
        if not (math.isfinite(self.save_every_minutes) and self.save_every_minutes >= 0):
            raise ValueError(f"--save-every-minutes must be 0 (off) or positive, got {self.save_every_minutes}")
        for name in ("lr", "min_delta", "max_grad_norm", "weight_decay", "warmup_ratio"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise ValueError(f"--{flag_name(name)} must be a finite number, got {value}")
        for name in ("seed", "split_seed"):  # numpy's RandomState takes 0 .. 2**32 - 1
            if not 0 <= getattr(self, name) < 2**32:
                raise ValueError(f"--{flag_name(name)} must be between 0 and 2**32 - 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"--lr must be positive, got {self.lr}")
        self.requeue_signal = self.requeue_signal.upper().removeprefix("SIG")
        if self.requeue_signal not in CATCHABLE_SIGNALS:
            raise ValueError(f"--requeue-signal {self.requeue_signal}: choose one of {', '.join(CATCHABLE_SIGNALS)}")
        if self.max_length > 512:
            raise ValueError(f"--max-length {self.max_length} exceeds the 512 positions of BERT-style models")
        if self.min_delta < 0:
            raise ValueError(f"--min-delta must be >= 0, got {self.min_delta}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"--max-grad-norm must be positive, got {self.max_grad_norm}")
        if self.num_workers is not None and self.num_workers < 0:
            raise ValueError(f"--num-workers must be >= 0, got {self.num_workers}")
        if self.num_workers is not None and self.num_workers > max_workers():
            # Each worker is a process with its own copy of the loader's state: thousands exhaust the machine.
            raise ValueError(f"--num-workers {self.num_workers} is more than this machine can use: at most "
                             f"{max_workers()} (4 per core, {usable_cores()} cores)")
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"--{flag_name(name)} must be one of {', '.join(map(str, allowed))}; "
                                 f"got {getattr(self, name)!r}")
        if self.bucket and self.pad_to == "max_length":
            # Bucketing exists to pad each batch to its own longest sequence.
            self.pad_to = "longest"
        if self.deepspeed_config is not None and self.strategy != "deepspeed":
            raise ValueError("--deepspeed-config needs --deepspeed")
        if self.strategy == "deepspeed" and self.compile:
            raise ValueError("--compile is not supported with --deepspeed (DeepSpeed wraps the model itself)")
        if self.strategy == "fsdp" and self.compile and self.compile_scope == "whole":
            raise ValueError("--compile-scope whole is not supported with --fsdp: its hooks run between the layers, "
                             "so each layer is compiled (--compile-scope layers)")
        if self.pack and self.bucket:
            raise ValueError("--pack leaves no padding for --bucket to remove; use one of them")
        if self.pack and self.attn_implementation != "sdpa":
            raise ValueError("--pack brings its own attention kernel; drop --attn-implementation")
        if self.pack_attention != "auto" and not self.pack:
            raise ValueError("--pack-attention needs --pack")
        if self.pack_multiple is not None and not self.pack:
            raise ValueError("--pack-multiple needs --pack")
        if self.pack_multiple is not None and self.pack_multiple > self.max_length:
            # The rounding tail (< --pack-multiple tokens) is one more attention sequence: see packed_attention.py.
            raise ValueError(f"--pack-multiple {self.pack_multiple} exceeds --max-length {self.max_length}")
        if self.data_on_device and (self.num_workers or self.pin_memory):
            raise ValueError("--data-on-device gathers batches on the device: drop --num-workers / --pin-memory")
        if self.early_stopping_patience is None and self.min_delta != 0.0:
            raise ValueError("--min-delta needs --early-stopping-patience")
        self._check_optimisation()
        self._check_own_data()
        object.__setattr__(self, "_frozen", True)

    def __setattr__(self, name: str, value) -> None:
        # dataclass(frozen=True) would refuse __post_init__'s own defaults too; this refuses what comes after.
        if self.__dict__.get("_frozen"):
            raise dataclasses.FrozenInstanceError(f"cannot assign to {name!r}: a config is resolved once; "
                                                  f"make a changed copy with dataclasses.replace")
        object.__setattr__(self, name, value)

    def _check_optimisation(self) -> None:
        """--weight-decay, the warmup, --class-weights and --label-names (parsed here from their comma lists)."""
        if self.weight_decay < 0:
            raise ValueError(f"--weight-decay must be >= 0, got {self.weight_decay}")
        if self.weight_decay and self.optimizer != "adamw":
            raise ValueError("--weight-decay needs --optimizer adamw")
        if self.warmup_ratio is not None and self.warmup_steps is not None:
            raise ValueError("--warmup-ratio and --warmup-steps both set the warmup; give one of them")
        if self.warmup_ratio is not None and not 0 <= self.warmup_ratio <= 1:
            raise ValueError(f"--warmup-ratio must be between 0 and 1, got {self.warmup_ratio}")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise ValueError(f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        if isinstance(self.class_weights, str) and self.class_weights != "balanced":
            self.class_weights = parse_class_weights(self.class_weights)
        elif isinstance(self.class_weights, (list, tuple)):
            self.class_weights = parse_class_weights(",".join(map(str, self.class_weights)))
        if isinstance(self.label_names, str):
            names = [name.strip() for name in self.label_names.split(",")]
            if self.data is None:
                raise ValueError("--label-names names --data's integer labels; IMDB's are neg, pos already")
            if not all(names) or len(set(names)) < len(names):
                raise ValueError(f"--label-names {self.label_names!r}: give one distinct, non-empty name per "
                                 f"label, comma-separated (e.g. neg,pos)")
            self.label_names = names

    def _check_own_data(self) -> None:
        """--data's settings; defaults filled in here, so a resumed run compares what ran."""
        if self.data is None:
            return  # IMDB: the article's split (imdb.py)
        if self.data_dir is not None:
            raise ValueError("--data-dir is IMDB's folder; with --data, drop it")
        self.text_column = self.text_column or "text"
        self.label_column = self.label_column or "label"
        # Each flag may list several names (one per file, columns.resolve_columns); no name may serve two roles.
        names = [set(n.strip() for n in v.split(",")) | {v}
                 for v in (self.text_column, self.text_pair_column, self.label_column) if v is not None]
        if any(a & b for i, a in enumerate(names) for b in names[i + 1:]):
            raise ValueError("--text-column, --text-pair-column and --label-column must name different columns")
        for split, flag in (("val", "--val-data"), ("test", "--test-data")):
            fraction = getattr(self, f"{split}_fraction")
            if getattr(self, f"{split}_data") is not None and fraction is not None:
                raise ValueError(f"--{split}-fraction carves a split from --data; with {flag} drop it")
            if fraction is not None and not (math.isfinite(fraction) and 0 < fraction < 1):
                raise ValueError(f"--{split}-fraction must be between 0 and 1, got {fraction}")
        if self.val_data is None and self.val_fraction is None:
            self.val_fraction = 0.1
        if self.test_data is None and self.test_fraction is None:
            self.test_fraction = 0.2
        carved = (self.val_fraction or 0) + (self.test_fraction or 0)
        if carved >= 1:
            raise ValueError(f"--val-fraction {self.val_fraction} + --test-fraction {self.test_fraction} "
                             f"= {carved:g} leaves no training data; keep the sum below 1")

    @property
    def varying_lengths(self) -> bool:
        """Whether batches differ in token count (dynamic padding or packing)."""
        return self.pad_to == "longest" or self.pack

    @property
    def monitor_mode(self) -> str:
        return "min" if self.monitor == "val_loss" else "max"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


def parse_class_weights(text: str) -> list:
    """--class-weights as a comma list: one positive, finite number per class; ValueError naming the bad one."""
    weights = []
    for item in text.split(","):
        try:
            weight = float(item)
        except ValueError:
            raise ValueError(f"--class-weights {text!r}: {item.strip()!r} is not a number; give 'balanced' or one "
                             f"weight per class, comma-separated (e.g. 1,3.5)") from None
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"--class-weights {text!r}: every weight must be a positive number, got {item.strip()}")
        weights.append(weight)
    return weights


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def max_workers() -> int:
    """The most DataLoader workers --num-workers takes: 4 per core, at least 8."""
    return max(8, 4 * usable_cores())


# Settings whose flag is not their name: torchrun's own parser reads every option before the
# script's name, and `--monitor` is ambiguous there (`--monitor-interval`, tests/test_torchrun_flags.py).
FLAG_NAMES = {"monitor": "monitor-metric"}


def flag_name(name: str) -> str:
    return FLAG_NAMES.get(name, name.replace("_", "-"))
