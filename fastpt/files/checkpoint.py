"""Checkpoints: written atomically, loaded safely, always without wrapper prefixes.

- `save_atomic` writes to a temporary file in the same folder, flushes and fsyncs it, then
  renames it over the target: a crash mid-write leaves the previous file intact. A full disk
  removes the temporary file and says how many bytes the file needs (`DiskFull`).
- `load` uses `torch.load(weights_only=True)`: only tensors and plain containers are
  unpickled, so a file crafted to run code on load is refused instead of executed.
- `write_export` writes --export-dir's Hugging Face folder and lists its files in
  `.fastpt-export.json`: the next `--overwrite` removes those and nothing else.
- Model weights come from `strategy.module`, the plain model that every strategy keeps beside
  its wrapper (DDP's `module.`, DeepSpeed's engine, FSDP's gathered shards); torch.compile
  compiles the step function or the layers in place, so no `_orig_mod.` prefix appears either.
  A saved state dict loads into a plain Hugging Face model.
"""

import contextlib
import io
import json
import os
import pickle
import random
import re
import secrets
import shutil
import stat
from pathlib import Path

import numpy as np
import torch

from fastpt.errors import CheckpointError, DiskFull, disk_full, one_line
from fastpt.files import trust


EXPORT_MANIFEST = ".fastpt-export.json"  # in an --export-dir: the files fastpt wrote there


def save_atomic(obj, path: Path) -> None:
    write_atomic(path, lambda f: torch.save(obj, f))


def write_atomic(path: Path, write) -> None:
    """`write(f)` into a temporary file beside `path`, flushed and fsynced, then renamed over it.

    Every file a run leaves (checkpoints, config.json, results.json) is written this way: a
    crash mid-write leaves the previous file intact, never a half-written one.
    """
    path = Path(path)
    path.parent.mkdir(mode=trust.folder_mode(path.parent), parents=True, exist_ok=True)
    fd, tmp = _create_temporary(path)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if disk_full(e):
            needed = _size_of(write)
            raise DiskFull(f"no space left in {path.parent} for {path.name}: "
                           f"{'?' if needed is None else f'{needed:,}'} bytes needed, "
                           f"{shutil.disk_usage(path.parent).free:,} free") from None
        raise
    _fsync_dir(path.parent)


def _create_temporary(path: Path) -> tuple[int, Path]:
    """A new empty file beside `path`, of a random name created for this write alone (O_EXCL, as
    `tempfile.mkstemp`: a name someone planted is never opened), with the permissions a plain `open`
    gives less others' write (files/trust.py: 0o644 less the umask; 0o666 in a trusted folder).

    Not `tempfile.mkstemp` itself: its mode 0o600 would survive the rename, and teammates on a shared
    file system could not read results.json or best.pt.
    """
    while True:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, trust.file_mode(path)), tmp
        except FileExistsError:
            continue


def temporary_of(name: str) -> str | None:
    """The file a temporary of `_create_temporary`'s naming was for (".last.pt.1a2b3c4d.tmp": "last.pt"), else None.

    A run killed mid-write leaves its temporary; the next run in the folder removes it (cli/run_folder.py).
    """
    match = re.fullmatch(r"\.(.+)\.[0-9a-f]{8}\.tmp", name)
    return match.group(1) if match else None


class _ByteCounter(io.IOBase):
    """A file that keeps nothing and counts what is written to it."""
    written = 0

    def write(self, data) -> int:
        self.written += len(data)
        return len(data)


def _size_of(write) -> int | None:
    """How many bytes `write(f)` writes, found by writing once more into nothing (only after a failure)."""
    counter = _ByteCounter()
    try:
        write(counter)
    except Exception:
        return None
    return counter.written


def _fsync_dir(folder: Path) -> None:
    """Make the rename durable, where the file system lets a folder be opened and synced."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
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


def exported_files(folder: Path) -> list[str]:
    """The files an earlier fastpt export wrote in folder, as its manifest lists them ([] without one)."""
    try:
        listed = json.loads((Path(folder) / EXPORT_MANIFEST).read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        return []
    names = listed if isinstance(listed, list) else []
    return [name for name in names if isinstance(name, str) and name not in ("", ".", "..") and "/" not in name]


def write_export(folder: Path, save) -> None:
    """`save(folder)` writes a Hugging Face model folder, over an earlier fastpt export if there is one.

    The earlier export's files (those its manifest lists) go first, so no stale shard, index or
    pytorch_model.bin is left beside the new weights; nothing else in the folder is touched (the
    command line refused a folder holding anything else). The new files get the permissions any
    run file gets (safetensors writes 0600 whatever the umask) and are listed in a new manifest.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name in exported_files(folder):
        path = folder / name
        if path.is_file() and not path.is_symlink():
            path.unlink()
    before = {p.name for p in folder.iterdir()}
    save(folder)
    written = sorted(p.name for p in folder.iterdir()
                     if p.name not in before and p.is_file() and not p.is_symlink())
    manifest = {"written_by": "fastpt --export-dir", "files": written}
    write_atomic(folder / EXPORT_MANIFEST, lambda f: f.write((json.dumps(manifest, indent=2) + "\n").encode()))
    mode = stat.S_IMODE(os.stat(folder / EXPORT_MANIFEST).st_mode)  # a run file's (umask, trust, default ACL)
    for name in written:
        os.chmod(folder / name, mode)


def rng_state(seed: int | None = None) -> dict:
    """Every random generator training draws from (dropout masks, workers' seeds), as checkpoint-safe data:
    last.pt keeps one per rank, so a resumed run draws exactly what the uninterrupted one would have.

    With `seed`: the same layout for fresh generators seeded with it (a new rank's, cluster/resize.py),
    CUDA's left as seeded at start (seed + rank)."""
    python, numpy, generator = (random, np.random, torch.default_generator) if seed is None else (
        random.Random(seed), np.random.RandomState(seed), torch.Generator().manual_seed(seed))
    np_state = numpy.get_state()
    return {
        "python": python.getstate(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]),
        "torch": generator.get_state(),
        "cuda": torch.cuda.get_rng_state_all() if seed is None and torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict) -> None:
    """Put back what `rng_state` saved."""
    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy(), *rest))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
