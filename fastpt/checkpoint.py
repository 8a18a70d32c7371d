"""Checkpoints: written atomically, loaded safely, always without wrapper prefixes.

- `save_atomic` writes to a temporary file in the same folder, flushes and fsyncs it, then
  renames it over the target: a crash mid-write leaves the previous file intact.
- `load` uses `torch.load(weights_only=True)`: only tensors and plain containers are
  unpickled, so a file crafted to run code on load is refused instead of executed.
- Model weights come from `strategy.module`, the plain model that every strategy keeps beside
  its wrapper (DDP's `module.`, DeepSpeed's engine, FSDP's gathered shards); torch.compile
  compiles the step function or the layers in place, so no `_orig_mod.` prefix appears either.
  A saved state dict loads into a plain Hugging Face model.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import tempfile
from pathlib import Path

import torch

from fastpt.errors import one_line


class CheckpointError(RuntimeError):
    """A checkpoint cannot be read or does not fit this run."""


def save_atomic(obj, path: Path) -> None:
    write_atomic(path, lambda f: torch.save(obj, f))


def write_atomic(path: Path, write) -> None:
    """`write(f)` into a temporary file beside `path`, flushed and fsynced, then renamed over it.

    Every file a run leaves (checkpoints, config.json, results.json) is written this way: a
    crash mid-write leaves the previous file intact, never a half-written one.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load(path: Path) -> dict:
    """Load a checkpoint with weights_only=True; a clear CheckpointError for anything else."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "weights only load failed" in str(e).lower():
            # The restricted unpickler met a global it does not allow (a class, a function to call).
            culprit = re.search(r"GLOBAL (\S+)", str(e))
            detail = f"it would import {culprit.group(1)}" if culprit else "not plain tensors and data"
            raise CheckpointError(f"refused to load {path}: {detail} "
                                  f"(only tensors and plain data are loaded)") from None
        raise CheckpointError(f"cannot read checkpoint {path}: {one_line(e, limit=200)} "
                              f"(corrupt or not a checkpoint?)") from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {one_line(e, limit=200)} "
                              f"(corrupt or incomplete?)") from None


def to_bytes(obj) -> bytes:
    """obj as torch.save bytes: how tensors travel through all_gather_object between ranks
    (pickling tensors directly there fails on load), and are read back with weights_only."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def from_bytes(data: bytes):
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def load_model_weights(path: Path) -> dict:
    """The model state dict of a best.pt / last.pt."""
    ckpt = load(path)
    state = ckpt.get("model") if isinstance(ckpt, dict) else None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds no model state")
    return state
