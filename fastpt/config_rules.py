"""The rules a run's settings are checked against: the fixed choices of some settings, the switch
others need, the ones a resume compares, and `check`, which `TrainConfig.__post_init__` runs
(config.py). Each rule is one line in a table or one `ValueError` whose message names the flag.
"""

import math
import os


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
    "pack_attention": ("auto", "loop", "mask"),  # see packed_attention.py
    "strategy": ("single",) + STRATEGIES,
    "zero_stage": (1, 2, 3),
    "optimizer": ("adam", "adamw"),
    "lr_schedule": ("constant", "linear", "cosine"),
}

# Settings that mean something only beside a switch: (the switch's flag, whether a config has it on, the settings).
# The command line refuses them without it (args.py); TensorBoard's HPARAMS leaves them out (tracking.py).
SWITCHES = (
    ("--amp", lambda c: c.get("amp"), ("amp_dtype",)),
    ("--compile", lambda c: c.get("compile"), ("compile_mode", "compile_scope")),
    ("--bucket", lambda c: c.get("bucket"), ("bucket_multiplier",)),
    ("--pack", lambda c: c.get("pack"), ("pack_attention", "pack_multiple")),
    ("--deepspeed", lambda c: c.get("strategy") == "deepspeed", ("zero_stage", "deepspeed_config")),
    ("--fsdp", lambda c: c.get("strategy") == "fsdp", ("fsdp_reshard_after_forward",)),
    ("--early-stopping-patience", lambda c: c.get("early_stopping_patience") is not None, ("min_delta",)),
    ("--optimizer adamw", lambda c: c.get("optimizer") == "adamw", ("weight_decay",)),
    # Your own data (fastpt/inputs/own_data.py): these describe the table --data names.
    ("--data", lambda c: c.get("data"), ("val_data", "test_data", "text_column", "text_pair_column", "label_column",
                                         "val_fraction", "test_fraction", "split_seed")),
)
# Each setting of those: (the switch's flag, whether a config has it on).
NEEDS = {name: (flag, present) for flag, present, names in SWITCHES for name in names}

# Settings that change what a checkpoint holds: resuming with any of them changed is refused.
RESUME_SENSITIVE = (
    "model", "random_init", "max_length", "batch_size", "lr", "seed", "grad_accum", "train_size", "strategy", "amp",
    "amp_dtype", "zero_stage", "bucket", "pad_to", "pack", "data", "val_data", "test_data", "text_column",
    "text_pair_column", "label_column", "val_fraction", "test_fraction", "split_seed", "optimizer", "weight_decay",
    "lr_schedule", "warmup_ratio", "warmup_steps", "class_weights",
)
# Of those, the ones added after runs were first saved: a config.json or last.pt without them ran with
# their defaults (the article's Adam at a constant rate, an unweighted loss).
LATER_SETTINGS = ("optimizer", "weight_decay", "lr_schedule", "warmup_ratio", "warmup_steps", "class_weights")


# --requeue-signal: by name without SIG, as sbatch --signal writes it; the ones a job is sent and can catch.
CATCHABLE_SIGNALS = ("USR1", "USR2", "TERM", "INT", "HUP", "QUIT", "ALRM", "XCPU")


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


# The numbers' ranges, in the order they are checked: (the settings, the rule as the message says it, the test).
# A setting left unset (None) passes; float("nan") and float("inf") parse as floats, so the finite test comes first.
RANGES = (
    (("save_every_minutes",), "must be 0 (off) or positive", lambda v: math.isfinite(v) and v >= 0),
    (("lr", "min_delta", "max_grad_norm", "weight_decay", "warmup_ratio"), "must be a finite number", math.isfinite),
    (("max_length", "batch_size", "epochs", "grad_accum", "log_every", "bucket_multiplier", "lr", "eval_batch_size",
      "dist_timeout", "train_size", "val_size", "test_size", "max_steps", "save_every", "early_stopping_patience",
      "pack_multiple", "max_grad_norm"), "must be positive", lambda v: v > 0),
    (("min_delta", "num_workers", "weight_decay", "warmup_steps"), "must be >= 0", lambda v: v >= 0),
    (("warmup_ratio",), "must be between 0 and 1", lambda v: 0 <= v <= 1),
    (("seed", "split_seed"), "must be between 0 and 2**32 - 1", lambda v: 0 <= v < 2**32),  # numpy's RandomState
)


def check(cfg) -> None:
    """Every value alone and beside the others; ValueError, with a one-line message naming the flag."""
    for names, rule, ok in RANGES:
        for name in names:
            value = getattr(cfg, name)
            if value is not None and not ok(value):
                raise ValueError(f"--{flag_name(name)} {rule}, got {value}")
    if cfg.requeue_signal not in CATCHABLE_SIGNALS:
        raise ValueError(f"--requeue-signal {cfg.requeue_signal}: choose one of {', '.join(CATCHABLE_SIGNALS)}")
    if cfg.max_length > 512:
        raise ValueError(f"--max-length {cfg.max_length} exceeds the 512 positions of BERT-style models")
    if cfg.num_workers is not None and cfg.num_workers > max_workers():
        # Each worker is a process with its own copy of the loader's state: thousands exhaust the machine.
        raise ValueError(f"--num-workers {cfg.num_workers} is more than this machine can use: at most "
                         f"{max_workers()} (4 per core, {usable_cores()} cores)")
    for name, allowed in CHOICES.items():
        if getattr(cfg, name) not in allowed:
            raise ValueError(f"--{flag_name(name)} must be one of {', '.join(map(str, allowed))}; "
                             f"got {getattr(cfg, name)!r}")
    # A config built in code is held to these switches too (the command line to all of NEEDS: args.py).
    for name in ("deepspeed_config", "pack_attention", "pack_multiple", "min_delta", "weight_decay"):
        switch, present = NEEDS[name]
        if getattr(cfg, name) != getattr(type(cfg), name) and not present(vars(cfg)):
            raise ValueError(f"--{flag_name(name)} needs {switch}")
    if cfg.strategy == "deepspeed" and cfg.compile:
        raise ValueError("--compile is not supported with --deepspeed (DeepSpeed wraps the model itself)")
    if cfg.strategy == "fsdp" and cfg.compile and cfg.compile_scope == "whole":
        raise ValueError("--compile-scope whole is not supported with --fsdp: its hooks run between the layers, "
                         "so each layer is compiled (--compile-scope layers)")
    if cfg.pack and cfg.bucket:
        raise ValueError("--pack leaves no padding for --bucket to remove; use one of them")
    if cfg.pack and cfg.attn_implementation != "sdpa":
        raise ValueError("--pack brings its own attention kernel; drop --attn-implementation")
    if cfg.pack_multiple is not None and cfg.pack_multiple > cfg.max_length:
        # The rounding tail (< --pack-multiple tokens) is one more attention sequence: see packed_attention.py.
        raise ValueError(f"--pack-multiple {cfg.pack_multiple} exceeds --max-length {cfg.max_length}")
    if cfg.data_on_device and (cfg.num_workers or cfg.pin_memory):
        raise ValueError("--data-on-device gathers batches on the device: drop --num-workers / --pin-memory")
    if cfg.data is not None:
        check_own_data(cfg)


def check_own_data(cfg) -> None:
    """--data's settings (their defaults already filled in: config.py)."""
    if cfg.data_dir is not None:
        raise ValueError("--data-dir is IMDB's folder; with --data, drop it")
    # Each flag may list several names (one per file, columns.resolve_columns); no name may serve two roles.
    names = [set(n.strip() for n in v.split(",")) | {v}
             for v in (cfg.text_column, cfg.text_pair_column, cfg.label_column) if v is not None]
    if any(a & b for i, a in enumerate(names) for b in names[i + 1:]):
        raise ValueError("--text-column, --text-pair-column and --label-column must name different columns")
    for split, flag in (("val", "--val-data"), ("test", "--test-data")):
        fraction = getattr(cfg, f"{split}_fraction")
        if getattr(cfg, f"{split}_data") is not None and fraction is not None:
            raise ValueError(f"--{split}-fraction carves a split from --data; with {flag} drop it")
        if fraction is not None and not (math.isfinite(fraction) and 0 < fraction < 1):
            raise ValueError(f"--{split}-fraction must be between 0 and 1, got {fraction}")
    carved = (cfg.val_fraction or 0) + (cfg.test_fraction or 0)
    if carved >= 1:
        raise ValueError(f"--val-fraction {cfg.val_fraction} + --test-fraction {cfg.test_fraction} "
                         f"= {carved:g} leaves no training data; keep the sum below 1")
