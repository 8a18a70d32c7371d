"""The command line: `train.py`'s flags, parsed into a `TrainConfig` (config.py).

Errors are one line on stderr and exit status 2; `--help` shows every default once. A flag
that only means something beside another (`--amp-dtype` without `--amp`) is refused, never
ignored: `config.NEEDS` is the one table of which setting needs which switch.
"""

from __future__ import annotations

import argparse
import os
import sys

from fastpt.config import CHOICES, NEEDS, STRATEGIES, TrainConfig, flag_name


class OneLineParser(argparse.ArgumentParser):
    """argparse, but errors are one line on stderr and exit code 2 (no usage dump).

    Under torchrun every rank parses the same command line; only rank 0 prints the line.
    """

    def error(self, message: str):  # noqa: D401 - argparse API
        if os.environ.get("RANK", "0") == "0":
            sys.stderr.write(f"error: {message}\n")
        sys.exit(2)


class DefaultsFormatter(argparse.HelpFormatter):
    """Shows each flag's default once: appended unless the help already says it.

    On/off switches (store_true / store_false) show none: the flag's name says what it turns on or off.
    """

    def _get_help_string(self, action):
        text = action.help or ""
        switch = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
        if switch or "default" in text or action.default in (None, argparse.SUPPRESS) or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)".lstrip()


class Gone(argparse.Action):
    """A flag fastpt no longer has: refused with one line that says what to use instead (status 2)."""

    def __init__(self, option_strings, dest, instead: str, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        self.instead = instead

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is gone: {self.instead}")


# Removed because their own measurements showed no gain: what each said, and what to use instead.
GONE_FLAGS = {"--cheap-dropout": "its 16-bit dropout masks made a packed step only 1.01x faster; drop the flag "
                                 "(dropout keeps nn.Dropout's masks)"}
GONE_KERNELS = {"grouped": "the grouped kernel was slower than the per-review loop on every CPU measured; use "
                           "--pack-attention loop, or leave the default"}


def kernel_name(value: str) -> str:
    """--pack-attention's value; a removed kernel is refused with what to use instead."""
    if value in GONE_KERNELS:
        raise argparse.ArgumentTypeError(f"{value!r} is gone: {GONE_KERNELS[value]}")
    return value


def build_parser() -> argparse.ArgumentParser:
    d = TrainConfig()
    p = OneLineParser(description="Fine-tune a text classifier in plain PyTorch (by default DistilBERT on IMDB, or "
                      "--data your own table), with every speed-up behind a flag.", formatter_class=DefaultsFormatter,
                      allow_abbrev=False)  # no prefixes: a new flag must never change what an abbreviation meant
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default=d.model,
                   help="hub id, local folder, 'minilm' (offline pretrained MiniLM-L6) or 'tiny' (tests)")
    g.add_argument("--random-init", action="store_true", help="build the architecture from its config, random weights")
    g.add_argument("--data-dir", help="folder with aclImdb_v1.tar.gz, the labelled tarball or an extracted aclImdb/ "
                   "(default: $FASTPT_DATA_DIR, else ./data, downloading if missing)")
    g.add_argument("--data", metavar="PATH_OR_NAME",
                   help="your own data instead of IMDB: a .csv, .tsv, .jsonl or .parquet file, a folder written by "
                        "datasets' save_to_disk, or a Hugging Face Hub dataset name (docs/own-data.md)")
    g.add_argument("--val-data", metavar="FILE",
                   help="with --data: the validation split's own file (default: carved from --data)")
    g.add_argument("--test-data", metavar="FILE",
                   help="with --data: the test split's own file (default: carved from --data)")
    g.add_argument("--text-column", metavar="NAME[,NAME...]",
                   help="with --data: the column holding the text (default: text); several names, comma-separated, "
                        "where files name it differently (sentence,content): each file uses the one it has")
    g.add_argument("--text-pair-column", metavar="NAME[,NAME...]",
                   help="with --data: a second text column (sentence pairs), tokenised as (text, pair)")
    g.add_argument("--label-column", metavar="NAME[,NAME...]", help="with --data: the label column, integers or "
                   "strings; ids follow their sorted order (default: label)")
    g.add_argument("--label-names", metavar="NAME0,NAME1,...", help="with --data and integer labels: a name for each "
                   "label, in their order (0, 1, ...); results.json and the export's id2label use them")
    g.add_argument("--val-fraction", type=float, help="with --data and no validation split: the share of --data carved "
                   "out for it, stratified by label (default: 0.1)")
    g.add_argument("--test-fraction", type=float,
                   help="with --data and no test split: the share of --data carved out for it (default: 0.2)")
    g.add_argument("--split-seed", type=int,
                   help=f"with --data: the shuffle that carves the splits (default: {d.split_seed})")
    g.add_argument("--cache-dir", help="tokenised-split cache (default: $FASTPT_CACHE_DIR or ~/.cache/fastpt)")
    g.add_argument("--max-length", type=int, default=d.max_length, help="tokens per text, truncated")
    g.add_argument("--train-size", type=int, help="use the first N training examples")
    g.add_argument("--val-size", type=int, help="use the first N validation examples")
    g.add_argument("--test-size", type=int, help="use the first N test examples")

    g = p.add_argument_group("optimisation")
    g.add_argument("--batch-size", type=int, default=d.batch_size, help="per process")
    g.add_argument("--epochs", type=int, default=d.epochs, help="passes over the training split")
    g.add_argument("--lr", type=float, default=d.lr, help="the learning rate (with --lr-schedule, its peak)")
    g.add_argument("--seed", type=int, default=d.seed, help="weights, dropout and shuffling")
    g.add_argument("--max-steps", type=int, help="stop after N optimiser steps (benchmarks)")
    g.add_argument("--grad-accum", type=int, default=d.grad_accum, help="batches per optimiser step")
    g.add_argument("--max-grad-norm", type=float, help="clip gradients to this norm (default: no clipping)")
    g.add_argument("--optimizer", default=d.optimizer, choices=CHOICES["optimizer"], help="adam: the article's; adamw: "
                   "decoupled weight decay (--weight-decay), transformers' Trainer's optimiser")
    g.add_argument("--weight-decay", type=float, help="with --optimizer adamw: on every weight but biases and "
                   f"LayerNorm weights, as transformers' Trainer (default: {d.weight_decay}, Trainer's)")
    g.add_argument("--lr-schedule", default=d.lr_schedule, choices=CHOICES["lr_schedule"],
                   help="the learning rate over the run's optimiser steps: constant (the article's), or decaying "
                        "to 0 linearly or along half a cosine, as transformers' get_*_schedule_with_warmup")
    g.add_argument("--warmup-ratio", type=float, help="the share of the run's optimiser steps over which the rate "
                   "rises linearly from 0 (rounded up; any --lr-schedule)")
    g.add_argument("--warmup-steps", type=int, help="or that many optimiser steps of warmup")
    g.add_argument("--class-weights", metavar="balanced|W0,W1,...", help="weigh each class in the cross-entropy "
                   "(training and evaluation loss): 'balanced' (examples / (classes x the class's count) in the "
                   "training split, scikit-learn's rule) or one positive weight per class, in label-id order")

    g = p.add_argument_group("early stopping and checkpoints")
    g.add_argument("--early-stopping-patience", type=int, help="validation checks without improvement")
    g.add_argument("--min-delta", type=float,
                   help=f"smallest change that counts as an improvement (default: {d.min_delta})")
    g.add_argument("--monitor-metric", "--monitor", dest="monitor", default=d.monitor, choices=CHOICES["monitor"],
                   help="validation metric for best.pt and early stopping (--monitor, Lightning's name, works "
                        "outside torchrun only: torchrun's own parser takes it for its --monitor-interval)")
    g.add_argument("--test-on", default=d.test_on, choices=CHOICES["test_on"],
                   help="weights the test split is scored with")

    g = p.add_argument_group("data loading")
    g.add_argument("--num-workers", type=int, help="DataLoader workers (default: from CPU count)")
    g.add_argument("--pin-memory", action="store_true", default=None,
                   help="page-locked batches (default: on with CUDA)")
    g.add_argument("--no-pin-memory", dest="pin_memory", action="store_false", help="pageable batches")
    g.add_argument("--pad-to", default=d.pad_to, choices=CHOICES["pad_to"],
                   help="pad each batch to --max-length or to its longest text (--bucket implies longest)")
    g.add_argument("--bucket", action="store_true", help="length-grouped batches with dynamic padding")
    g.add_argument("--pack", action="store_true",
                   help="padding-free batches: the batch's texts end to end as one token stream")
    g.add_argument("--pack-multiple", type=int, help="with --pack: round each batch's token count up to a multiple of "
                   "N (few shapes for CUDA graphs); at most --max-length")
    g.add_argument("--pack-attention", type=kernel_name, choices=CHOICES["pack_attention"],
                   help="with --pack: the attention kernel; auto (default): on a CPU the per-text loop; on CUDA "
                        "FlashAttention's varlen (fp16/bf16), else loop (eager) or mask (compiled)")
    g.add_argument("--data-on-device", action="store_true",
                   help="keep the tokenised splits on the device and gather batches there (no workers, no copies)")
    g.add_argument("--eval-batch-size", type=int, default=d.eval_batch_size,
                   help="batch size for validation and test (no gradients: larger batches fit)")
    g.add_argument("--bucket-multiplier", type=int, help="mega-batch size in batches for --bucket (default: "
                   f"{d.bucket_multiplier}); smaller mixes lengths more within a batch and pads more")

    g = p.add_argument_group("single-device speed-ups")
    g.add_argument("--device", default=d.device, choices=CHOICES["device"], help="auto: CUDA when available")
    g.add_argument("--amp", action="store_true", help="automatic mixed precision")
    g.add_argument("--amp-dtype", choices=CHOICES["amp_dtype"], help=f"with --amp (default: {d.amp_dtype})")
    g.add_argument("--compile", action="store_true", help="torch.compile the model")
    g.add_argument("--compile-mode", choices=CHOICES["compile_mode"], help="with --compile (default: "
                   f"{d.compile_mode}); reduce-overhead and max-autotune also record CUDA graphs")
    g.add_argument("--compile-scope", choices=CHOICES["compile_scope"],
                   help=f"with --compile (default: {d.compile_scope}): each transformer layer, compiled once for "
                        "all (a short compile), or the whole step (one device) / model (DDP)")
    g.add_argument("--fused-adam", action="store_true", default=None,
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
    g.add_argument("--zero-stage", type=int, choices=CHOICES["zero_stage"],
                   help=f"with --deepspeed (default: {d.zero_stage})")
    g.add_argument("--deepspeed-config", help="a DeepSpeed JSON config to use instead of fastpt's")
    g.add_argument("--dist-timeout", type=int, default=d.dist_timeout, metavar="SECONDS",
                   help="how long a rank waits for the others (joining, any collective) before it stops "
                        "with status 1; longer than any one rank's solo work (the first tokenisation)")

    g = p.add_argument_group("outputs and reliability")
    g.add_argument("--out", help="run folder (default: runs/<timestamp>)")
    g.add_argument("--overwrite", action="store_true", help="allow writing into a folder that holds another run")
    g.add_argument("--log-every", type=int, default=d.log_every, help="optimiser steps between log lines")
    g.add_argument("--save-every", type=int, help="write checkpoints/last.pt every N optimiser steps")
    g.add_argument("--save-every-minutes", type=float, default=d.save_every_minutes, metavar="MINUTES",
                   help="also write last.pt once this long has passed since the last one, so a kill loses at most "
                        "minutes (rank 0's clock, checked after every step on one process, at log steps under "
                        "torchrun); 0: off")
    g.add_argument("--resume", help="'auto' or a path to last.pt")
    g.add_argument("--requeue-signal", default=d.requeue_signal, metavar="SIGNAL",
                   help="the signal that stops like SIGTERM and, under SLURM, requeues the job (sbatch "
                        f"--signal=USR1@90 --requeue; default: {d.requeue_signal})")
    g.add_argument("--export-dir", help="at the end, write the tested weights, config (with label names) and tokenizer "
                   "as a Hugging Face model folder (transformers.pipeline loads it)")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no tqdm bars")
    g.add_argument("--no-tensorboard", dest="tensorboard", action="store_false", help="no tb/ event files")
    g.add_argument("--verbose", action="store_true",
                   help="also show the libraries' own messages (Hugging Face, DeepSpeed)")
    for flag, instead in GONE_FLAGS.items():
        p.add_argument(flag, action=Gone, instead=instead)
    return p


def parse_args(argv=None) -> TrainConfig:
    """Command line -> validated TrainConfig. Raises ValueError on a bad value."""
    args = vars(build_parser().parse_args(argv))
    chosen = [name for name in STRATEGIES if args.pop(name)]
    if len(chosen) > 1:
        raise ValueError(f"choose one strategy, not {' and '.join('--' + c for c in chosen)}")
    args["strategy"] = chosen[0] if chosen else "single"
    # A flag that only means something beside another is refused without it, never ignored.
    for name, (switch, present) in NEEDS.items():
        if args[name] is None:  # not given: the dataclass default
            args[name] = getattr(TrainConfig, name)
        elif not present(args):
            raise ValueError(f"--{flag_name(name)} needs {switch}")
    return TrainConfig(**args)
