"""Run configuration: one typed dataclass, built from the command line, validated once.

Every setting of a run lives in `TrainConfig`. `parse_args` turns `train.py`'s command line
into one; `TrainConfig.__post_init__` checks every value and raises `ValueError` with a
one-line message that names the bad setting, before any data is read or any folder written.
The resolved config is saved as `config.json` next to the results and inside every checkpoint.

Defaults are the article's run: distilbert-base-uncased, 3 epochs, batch 12, Adam 5e-5,
seed 123, sequences truncated and padded to 512 tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from dataclasses import dataclass
from typing import Optional

STRATEGIES = ("ddp", "fsdp", "deepspeed")

# The allowed values of every setting with a fixed set: argparse's choices and the dataclass check.
CHOICES = {
    "monitor": ("val_acc", "val_loss"),
    "test_on": ("best", "last"),
    "pad_to": ("max_length", "longest"),
    "device": ("auto", "cpu", "cuda"),
    "amp_dtype": ("float16", "bfloat16"),
    "compile_mode": ("default", "max-autotune-no-cudagraphs", "max-autotune", "reduce-overhead"),  # see compile.py
    "attn_implementation": ("sdpa", "eager"),
    "strategy": ("single",) + STRATEGIES,
    "zero_stage": (1, 2, 3),
}

# Settings that change what a checkpoint holds: resuming with any of them changed is refused.
RESUME_SENSITIVE = (
    "model", "random_init", "max_length", "batch_size", "lr", "seed", "grad_accum",
    "train_size", "strategy", "amp", "amp_dtype", "zero_stage", "bucket", "pad_to", "pack",
)


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

    # The article's hyperparameters.
    batch_size: int = 12
    epochs: int = 3
    lr: float = 5e-5
    seed: int = 123
    max_steps: Optional[int] = None

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
    data_on_device: bool = False
    eval_batch_size: int = 128

    # Single-device speed-ups.
    device: str = "auto"
    amp: bool = False
    amp_dtype: str = "float16"
    compile: bool = False
    compile_mode: str = "default"
    fused_adam: Optional[bool] = None
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
    resume: Optional[str] = None
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
                raise ValueError(f"--{_flag(name)} must be positive, got {getattr(self, name)}")
        for name in optional_positive:
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"--{_flag(name)} must be positive, got {value}")
        # float("nan") and float("inf") parse as floats; none of these settings means anything with them.
        for name in ("lr", "min_delta", "max_grad_norm"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise ValueError(f"--{_flag(name)} must be a finite number, got {value}")
        if not self.lr > 0:
            raise ValueError(f"--lr must be positive, got {self.lr}")
        if self.max_length > 512:
            raise ValueError(f"--max-length {self.max_length} exceeds the 512 positions of BERT-style models")
        if self.min_delta < 0:
            raise ValueError(f"--min-delta must be >= 0, got {self.min_delta}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"--max-grad-norm must be positive, got {self.max_grad_norm}")
        if self.num_workers is not None and self.num_workers < 0:
            raise ValueError(f"--num-workers must be >= 0, got {self.num_workers}")
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"--{_flag(name)} must be one of {', '.join(map(str, allowed))}; "
                                 f"got {getattr(self, name)!r}")
        if self.bucket and self.pad_to == "max_length":
            # Bucketing exists to pad each batch to its own longest sequence.
            self.pad_to = "longest"
        if self.deepspeed_config is not None and self.strategy != "deepspeed":
            raise ValueError("--deepspeed-config needs --deepspeed")
        if self.strategy == "deepspeed" and self.compile:
            raise ValueError("--compile is not supported with --deepspeed (DeepSpeed wraps the model itself)")
        if self.pack and self.bucket:
            raise ValueError("--pack leaves no padding for --bucket to remove; use one of them")
        if self.pack and self.attn_implementation != "sdpa":
            raise ValueError("--pack brings its own attention kernel; drop --attn-implementation")
        if self.pack_multiple is not None and not self.pack:
            raise ValueError("--pack-multiple needs --pack")
        if self.pack_multiple is not None and self.pack_multiple > self.max_length:
            # The rounding tail (< --pack-multiple tokens) is one more attention sequence: see packing.py.
            raise ValueError(f"--pack-multiple {self.pack_multiple} exceeds --max-length {self.max_length}")
        if self.data_on_device and (self.num_workers or self.pin_memory):
            raise ValueError("--data-on-device gathers batches on the device: drop --num-workers / --pin-memory")
        if self.early_stopping_patience is None and self.min_delta != 0.0:
            raise ValueError("--min-delta needs --early-stopping-patience")

    @property
    def varying_lengths(self) -> bool:
        """Whether batches differ in token count (dynamic padding or packing)."""
        return self.pad_to == "longest" or self.pack

    @property
    def monitor_mode(self) -> str:
        return "max" if self.monitor == "val_acc" else "min"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


def _flag(name: str) -> str:
    return name.replace("_", "-")


class _OneLineParser(argparse.ArgumentParser):
    """argparse, but errors are one line on stderr and exit code 2 (no usage dump).

    Under torchrun every rank parses the same command line; only rank 0 prints the line.
    """

    def error(self, message: str):  # noqa: D401 - argparse API
        if os.environ.get("RANK", "0") == "0":
            sys.stderr.write(f"error: {message}\n")
        sys.exit(2)


class _DefaultsFormatter(argparse.HelpFormatter):
    """Shows each flag's default once: appended unless the help already says it.

    On/off switches (store_true / store_false) show none: the flag's name says what it turns on or off.
    """

    def _get_help_string(self, action):
        text = action.help or ""
        switch = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
        if switch or "default" in text or action.default in (None, argparse.SUPPRESS) or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)".lstrip()


def build_parser() -> argparse.ArgumentParser:
    d = TrainConfig()
    p = _OneLineParser(
        description="Fine-tune DistilBERT on IMDB in plain PyTorch, with every speed-up behind a flag.",
        formatter_class=_DefaultsFormatter,
    )
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default=d.model,
                   help="hub id, local folder, 'minilm' (offline pretrained MiniLM-L6) or 'tiny' (tests)")
    g.add_argument("--random-init", action="store_true", help="build the architecture from its config, random weights")
    g.add_argument("--data-dir", default=None,
                   help="folder with aclImdb_v1.tar.gz, the labelled tarball or an extracted aclImdb/ "
                        "(default: $FASTPT_DATA_DIR, else ./data, downloading if missing)")
    g.add_argument("--cache-dir", default=None,
                   help="tokenised-split cache (default: $FASTPT_CACHE_DIR or ~/.cache/fastpt)")
    g.add_argument("--max-length", type=int, default=d.max_length, help="tokens per review, truncated")
    g.add_argument("--train-size", type=int, default=None, help="use the first N training reviews")
    g.add_argument("--val-size", type=int, default=None, help="use the first N validation reviews")
    g.add_argument("--test-size", type=int, default=None, help="use the first N test reviews")

    g = p.add_argument_group("optimisation")
    g.add_argument("--batch-size", type=int, default=d.batch_size, help="per process")
    g.add_argument("--epochs", type=int, default=d.epochs, help="passes over the training split")
    g.add_argument("--lr", type=float, default=d.lr, help="Adam learning rate")
    g.add_argument("--seed", type=int, default=d.seed, help="weights, dropout and shuffling")
    g.add_argument("--max-steps", type=int, default=None, help="stop after N optimiser steps (benchmarks)")
    g.add_argument("--grad-accum", type=int, default=d.grad_accum, help="batches per optimiser step")
    g.add_argument("--max-grad-norm", type=float, default=None,
                   help="clip gradients to this norm (default: no clipping)")

    g = p.add_argument_group("early stopping and checkpoints")
    g.add_argument("--early-stopping-patience", type=int, default=None, help="validation checks without improvement")
    g.add_argument("--min-delta", type=float, default=d.min_delta, help="smallest change that counts as an improvement")
    g.add_argument("--monitor", default=d.monitor, choices=CHOICES["monitor"],
                   help="validation metric for best.pt and early stopping")
    g.add_argument("--test-on", default=d.test_on, choices=CHOICES["test_on"],
                   help="weights the test split is scored with")

    g = p.add_argument_group("data loading")
    g.add_argument("--num-workers", type=int, default=None, help="DataLoader workers (default: from CPU count)")
    g.add_argument("--pin-memory", dest="pin_memory", action="store_true", default=None,
                   help="page-locked batches (default: on with CUDA)")
    g.add_argument("--no-pin-memory", dest="pin_memory", action="store_false", help="pageable batches")
    g.add_argument("--pad-to", default=d.pad_to, choices=CHOICES["pad_to"],
                   help="pad each batch to --max-length or to its longest review (--bucket implies longest)")
    g.add_argument("--bucket", action="store_true", help="length-grouped batches with dynamic padding")
    g.add_argument("--pack", action="store_true",
                   help="padding-free batches: the batch's reviews end to end as one token stream")
    g.add_argument("--pack-multiple", type=int, default=None,
                   help="with --pack: round each batch's token count up to a multiple of N "
                        "(few shapes for CUDA graphs); at most --max-length")
    g.add_argument("--data-on-device", action="store_true",
                   help="keep the tokenised splits on the device and gather batches there (no workers, no copies)")
    g.add_argument("--eval-batch-size", type=int, default=d.eval_batch_size,
                   help="batch size for validation and test (no gradients: larger batches fit)")
    g.add_argument("--bucket-multiplier", type=int, default=None,
                   help=f"mega-batch size in batches for --bucket (default: {d.bucket_multiplier}); smaller mixes "
                        "lengths more within a batch and pads more")

    g = p.add_argument_group("single-device speed-ups")
    g.add_argument("--device", default=d.device, choices=CHOICES["device"], help="auto: CUDA when available")
    g.add_argument("--amp", action="store_true", help="automatic mixed precision")
    g.add_argument("--amp-dtype", default=None, choices=CHOICES["amp_dtype"],
                   help=f"with --amp (default: {d.amp_dtype})")
    g.add_argument("--compile", action="store_true", help="torch.compile the model")
    g.add_argument("--compile-mode", default=None, choices=CHOICES["compile_mode"],
                   help=f"with --compile (default: {d.compile_mode}); reduce-overhead and max-autotune "
                        "also record CUDA graphs")
    g.add_argument("--fused-adam", dest="fused_adam", action="store_true", default=None,
                   help="one fused Adam kernel (default: on with CUDA)")
    g.add_argument("--no-fused-adam", dest="fused_adam", action="store_false", help="per-tensor Adam")
    g.add_argument("--tf32", action="store_true", help="TF32 matmuls on CUDA")
    g.add_argument("--attn-implementation", default=d.attn_implementation, choices=CHOICES["attn_implementation"],
                   help="scaled_dot_product_attention or the eager matmuls")
    g.add_argument("--deterministic", action="store_true", help="bitwise-repeatable kernels (slower)")

    g = p.add_argument_group("multi-process strategies (launch with torchrun)")
    g.add_argument("--ddp", action="store_true", help="DistributedDataParallel")
    g.add_argument("--fsdp", action="store_true", help="FSDP2 fully_shard")
    g.add_argument("--deepspeed", action="store_true", help="DeepSpeed ZeRO")
    g.add_argument("--fsdp-reshard-after-forward", dest="fsdp_reshard_after_forward",
                   action=argparse.BooleanOptionalAction, default=None, help="with --fsdp (default: on)")
    g.add_argument("--zero-stage", type=int, default=None, choices=CHOICES["zero_stage"],
                   help=f"with --deepspeed (default: {d.zero_stage})")
    g.add_argument("--deepspeed-config", default=None, help="a DeepSpeed JSON config to use instead of fastpt's")
    g.add_argument("--dist-timeout", type=int, default=d.dist_timeout, metavar="SECONDS",
                   help="how long a rank waits for the others (joining, any collective) before it stops "
                        "with status 1; longer than any one rank's solo work (the first tokenisation)")

    g = p.add_argument_group("outputs and reliability")
    g.add_argument("--out", default=None, help="run folder (default: runs/<timestamp>)")
    g.add_argument("--overwrite", action="store_true", help="allow writing into a folder that holds another run")
    g.add_argument("--log-every", type=int, default=d.log_every, help="optimiser steps between log lines")
    g.add_argument("--save-every", type=int, default=None, help="write checkpoints/last.pt every N optimiser steps")
    g.add_argument("--resume", default=None, help="'auto' or a path to last.pt")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no tqdm bars")
    g.add_argument("--no-tensorboard", dest="tensorboard", action="store_false", help="no tb/ event files")
    g.add_argument("--verbose", action="store_true",
                   help="also show the libraries' own messages (Hugging Face, DeepSpeed)")
    return p


def parse_args(argv=None) -> TrainConfig:
    """Command line -> validated TrainConfig. Raises ValueError on a bad value."""
    args = vars(build_parser().parse_args(argv))
    chosen = [name for name in STRATEGIES if args.pop(name)]
    if len(chosen) > 1:
        raise ValueError(f"choose one strategy, not {' and '.join('--' + c for c in chosen)}")
    args["strategy"] = chosen[0] if chosen else "single"
    # A flag that only means something beside another is refused without it, never ignored.
    for name, needed, present in (
        ("amp_dtype", "--amp", args["amp"]),
        ("compile_mode", "--compile", args["compile"]),
        ("bucket_multiplier", "--bucket", args["bucket"]),
        ("zero_stage", "--deepspeed", args["strategy"] == "deepspeed"),
        ("fsdp_reshard_after_forward", "--fsdp", args["strategy"] == "fsdp"),
    ):
        if args[name] is None:
            args[name] = getattr(TrainConfig, name)
        elif not present:
            raise ValueError(f"--{_flag(name)} needs {needed}")
    return TrainConfig(**args)
