"""Run configuration: one typed dataclass, built from the command line, validated once, then frozen.

Every setting of a run lives in `TrainConfig`. `parse_args` turns `train.py`'s command line
into one; `TrainConfig.__post_init__` checks every value and raises `ValueError` with a
one-line message that names the bad setting, before any data is read or any folder written,
fills in the defaults that depend on other settings, and freezes it: assigning to a setting
afterwards raises `dataclasses.FrozenInstanceError`. A config is a value, passed down to every
layer that reads it.

A real change later is a new value, `dataclasses.replace(cfg, ...)` (checked again), passed on:
`cli/preflight.py:resolve_config` fills in every "decide for me" setting (absolute paths, loader
workers and pinned memory, fused Adam on CUDA), a resume on another number of processes gets its
per-process batch (`cluster/resize.py:adapt`), and the IMDB folder that loading found is recorded.
What the data decides is not a setting: `loop/build.py:load_inputs` puts the label names (and,
where --label-names renamed them, the data's own as `data_label_names`), where each split came
from and the class weights' values on `Inputs`, and the saved config (`config.json` next to the
results, and inside every checkpoint) adds them under the names `label_names`,
`data_label_names`, `data_splits` and `class_weight_values`.

Defaults are the article's run: distilbert-base-uncased, 3 epochs, batch 12, Adam 5e-5,
seed 123, sequences truncated and padded to 512 tokens.
"""

import dataclasses
import math
from dataclasses import dataclass

# The rules between settings (config_rules.py): the command line, the resume check and TensorBoard read them here.
from fastpt.config_rules import (CHOICES, LATER_SETTINGS, NEEDS, RESUME_SENSITIVE,  # noqa: F401
                                 STRATEGIES, check, flag_name)


@dataclass
class TrainConfig:
    # What to train on.
    model: str = "distilbert-base-uncased"
    random_init: bool = False
    data_dir: str | None = None
    cache_dir: str | None = None
    max_length: int = 512
    train_size: int | None = None
    val_size: int | None = None
    test_size: int | None = None
    # Your own data instead of IMDB (fastpt/inputs/own_data.py); None: IMDB, the article's run.
    data: str | None = None  # a CSV / TSV / JSON Lines / Parquet file, a save_to_disk folder or a Hub name
    val_data: str | None = None  # the validation split's own file (else carved from --data)
    test_data: str | None = None  # the test split's own file (else carved from --data)
    text_column: str | None = None  # "text" with --data
    text_pair_column: str | None = None  # a second text (sentence pairs): tokenizer(text, pair)
    label_column: str | None = None  # "label" with --data
    val_fraction: float | None = None  # carved from the training set where --data has no validation split
    test_fraction: float | None = None  # likewise for test
    split_seed: int = 0  # the carving's shuffle (not --seed: a new --seed keeps the split)
    export_dir: str | None = None  # the tested weights as a Hugging Face model folder
    # --label-names: --data's integer labels named (a comma list, one name per label, in the ids' order).
    # The names a run trains with are the data's (Inputs.label_names): these, or the ones the table has.
    label_names: list | None = None

    # The article's hyperparameters.
    batch_size: int = 12
    epochs: int = 3
    lr: float = 5e-5
    seed: int = 123
    max_steps: int | None = None

    # Optimiser, schedule and loss as transformers' Trainer has them (strategies/optimizer.py); the
    # defaults are the article's: Adam at a constant rate, plain cross-entropy.
    optimizer: str = "adam"  # or adamw: decoupled weight decay
    weight_decay: float = 0.0  # with adamw: on every weight but biases and LayerNorm weights
    lr_schedule: str = "constant"  # or linear / cosine decay to 0 over the run's optimiser steps
    warmup_ratio: float | None = None  # the share of the run's steps warming up from 0 (rounded up)
    warmup_steps: int | None = None  # or that many steps
    class_weights: object | None = None  # "balanced" or one weight per class (a comma list on the command line)

    # Lightning behaviours reproduced by hand.
    early_stopping_patience: int | None = None
    min_delta: float = 0.0
    monitor: str = "val_acc"
    test_on: str = "best"

    # Data loading.
    num_workers: int | None = None
    pin_memory: bool | None = None
    pad_to: str = "max_length"
    bucket: bool = False
    bucket_multiplier: int = 50
    pack: bool = False
    pack_multiple: int | None = None
    pack_attention: str = "auto"  # the packed attention kernel; auto: the device's (packed_attention_kernel)
    data_on_device: bool = False
    eval_batch_size: int = 128

    # Single-device speed-ups.
    device: str = "auto"
    amp: bool = False
    amp_dtype: str = "float16"
    compile: bool = False
    compile_mode: str = "default"
    compile_scope: str = "layers"
    fused_adam: bool | None = None
    tf32: bool = False
    attn_implementation: str = "sdpa"
    grad_accum: int = 1
    max_grad_norm: float | None = None
    deterministic: bool = False

    # Multi-process strategies.
    strategy: str = "single"
    fsdp_reshard_after_forward: bool = True
    zero_stage: int = 2
    deepspeed_config: str | None = None
    dist_timeout: int = 600  # seconds any collective (and joining the group) may wait for the other ranks

    # Outputs and reliability.
    out: str | None = None
    overwrite: bool = False
    log_every: int = 50
    save_every: int | None = None
    save_every_minutes: float = 10.0  # last.pt by rank 0's clock too (bookkeeping.py); 0: off
    resume: str | None = None
    requeue_signal: str = "USR1"  # SLURM's warning before a time limit: save, requeue the job (cluster/slurm.py)
    progress: bool = True
    tensorboard: bool = True
    verbose: bool = False

    def __post_init__(self) -> None:
        """Fill in what depends on other settings, check every value (config_rules.check), then freeze."""
        self.requeue_signal = self.requeue_signal.upper().removeprefix("SIG")
        if self.bucket and self.pad_to == "max_length":
            # Bucketing exists to pad each batch to its own longest sequence.
            self.pad_to = "longest"
        if self.data is not None:  # --data's defaults, filled in here so that a resumed run compares what ran
            self.text_column = self.text_column or "text"
            self.label_column = self.label_column or "label"
            if self.val_data is None and self.val_fraction is None:
                self.val_fraction = 0.1
            if self.test_data is None and self.test_fraction is None:
                self.test_fraction = 0.2
        check(self)
        self._check_optimisation()
        object.__setattr__(self, "_frozen", True)

    def __setattr__(self, name: str, value) -> None:
        # dataclass(frozen=True) would refuse __post_init__'s own defaults too; this refuses what comes after.
        if self.__dict__.get("_frozen"):
            raise dataclasses.FrozenInstanceError(f"cannot assign to {name!r}: a config is resolved once; "
                                                  f"make a changed copy with dataclasses.replace")
        object.__setattr__(self, name, value)

    def _check_optimisation(self) -> None:
        """--weight-decay, the warmup, --class-weights and --label-names (parsed here from their comma lists)."""
        if self.warmup_ratio is not None and self.warmup_steps is not None:
            raise ValueError("--warmup-ratio and --warmup-steps both set the warmup; give one of them")
        if isinstance(self.class_weights, str) and self.class_weights != "balanced":
            self.class_weights = parse_class_weights(self.class_weights)
        elif isinstance(self.class_weights, (list, tuple)):
            self.class_weights = parse_class_weights(",".join(map(str, self.class_weights)))
        if self.data is None and isinstance(self.class_weights, list) and len(self.class_weights) != 2:
            raise ValueError(f"--class-weights gives {len(self.class_weights)} weight(s), the data has 2 classes "
                             f"(neg, pos: IMDB's): give one each")
        if isinstance(self.label_names, str):
            names = [name.strip() for name in self.label_names.split(",")]
            if self.data is None:
                raise ValueError("--label-names names --data's integer labels; IMDB's are neg, pos already")
            if not all(names) or len(set(names)) < len(names):
                raise ValueError(f"--label-names {self.label_names!r}: give one distinct, non-empty name per "
                                 f"label, comma-separated (e.g. neg,pos)")
            self.label_names = names

    @property
    def varying_lengths(self) -> bool:
        """Whether batches differ in token count (dynamic padding or packing)."""
        return self.pad_to == "longest" or self.pack

    @property
    def monitor_mode(self) -> str:
        return "min" if self.monitor == "val_loss" else "max"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


FLOAT32_TINY = 2.0 ** -126  # float32's smallest normal number (numpy.finfo("float32").tiny)
FLOAT32_MAX = (2 - 2.0 ** -23) * 2.0 ** 127  # and its largest


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
        if not FLOAT32_TINY <= weight <= FLOAT32_MAX:  # the loss weighs in float32: 1e-320 would be 0 there
            raise ValueError(f"--class-weights {text!r}: {item.strip()} is {'0 or subnormal' if weight < 1 else 'inf'} "
                             f"in float32, the loss's precision; give weights between {FLOAT32_TINY:.2g} and "
                             f"{FLOAT32_MAX:.2g}")
        weights.append(weight)
    return weights
