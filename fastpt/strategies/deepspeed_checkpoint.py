"""DeepSpeed's checkpoint files, loaded without running what a crafted file asks.

DeepSpeed reads its files with a full unpickler (`torch.load(weights_only=False)`), which runs
whatever a crafted file asks. Every one of those loads is made `weights_only=True` here
(`weights_only_loads`), admitting only the few DeepSpeed classes its checkpoints hold
(`trusted_classes`), and last.pt's tag is taken only as `global_stepN` inside the run folder
(`checked_tag`): a tag is a path DeepSpeed reads. `check_resume` runs both before any work.
"""

import contextlib
import os
import pickle
import re
import zipfile
from pathlib import Path

import torch

from fastpt.errors import CheckpointError


def written_by(tag_folder: Path) -> int:
    """How many data-parallel processes wrote a ZeRO checkpoint: one optimiser-state file each."""
    return len(list(tag_folder.glob("*zero_pp_rank_*_mp_rank_*_optim_states.pt")))


def trusted_classes() -> list:
    """The classes DeepSpeed pickles into its checkpoints, beyond tensors and plain containers.

    Found by saving ZeRO-1, 2 and 3 checkpoints in float32 and bfloat16 and listing what
    `torch.serialization.get_unsafe_globals_in_checkpoint` reports: the optimiser shards hold the
    loss scaler object (DynamicLossScaler with float16), the ZeRO stage as an enum and, for stages
    1-2, each parameter's place in the flat partition. The engine's model-states file holds none.
    """
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def _refused(path: Path, error: Exception) -> CheckpointError:
    """The restricted unpickler's error as one line: which file, and what it would have imported."""
    culprit = re.search(r"GLOBAL (\S+)|module (\S+) is blocked", str(error))
    what = f"it would import {culprit.group(1) or culprit.group(2)}" if culprit else "it holds more than plain data"
    return CheckpointError(f"refused to load {path}: {what}, an object fastpt does not trust (DeepSpeed checkpoints "
                           f"load only tensors, plain data and DeepSpeed's "
                           f"{', '.join(c.__name__ for c in trusted_classes())})")


@contextlib.contextmanager
def weights_only_loads(folder: Path):
    """Every torch.load inside, DeepSpeed's included, made with weights_only=True and `trusted_classes`.

    DeepSpeed passes weights_only=False itself (TorchCheckpointEngine.load, ds_to_universal, the
    universal loader). TORCH_FORCE_WEIGHTS_ONLY_LOAD is torch's switch that overrides the argument
    at every call; it is read per call, so setting it for the duration is enough.
    """
    previous = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        with torch.serialization.safe_globals(trusted_classes()):
            yield
    except pickle.UnpicklingError as e:
        raise _refused(folder, e) from None
    finally:
        if previous is None:
            os.environ.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD", None)
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = previous


def checked_tag(training: dict, ckpt_dir: Path) -> str:
    """last.pt's DeepSpeed tag, accepted only as the name fastpt writes: a folder global_stepN in checkpoints/deepspeed.

    The tag becomes a path that DeepSpeed reads; a tag such as "../../elsewhere" would load files
    from outside the run folder.
    """
    tag, folder = training.get("deepspeed_tag"), ckpt_dir / "deepspeed"
    if not (isinstance(tag, str) and re.fullmatch(r"global_step\d+", tag)
            and (folder / tag).resolve().parent == folder.resolve()):
        raise CheckpointError(f"{ckpt_dir / 'last.pt'} names the DeepSpeed checkpoint {tag!r}, not a folder "
                              f"global_stepN in {folder}; refusing to load it")
    return tag


def check_resume(training: dict, ckpt_dir: Path) -> None:
    """Before any work: the tag, and every DeepSpeed file this process sees loads with weights_only.

    Memory-mapped, so the tensors are not read (but for files written with DeepSpeed's
    "checkpoint_serialization": false, torch's older format); the load itself
    (`load_training_state`) checks again on every rank, also the files only other nodes see.
    """
    folder, tag = ckpt_dir / "deepspeed", checked_tag(training, ckpt_dir)
    for path in sorted([*(folder / tag).rglob("*.pt"), *(folder / f"{tag}-universal").rglob("*.pt")]):
        with weights_only_loads(path):
            try:
                torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
            except (RuntimeError, EOFError, OSError, ValueError) as e:
                raise CheckpointError(f"cannot read DeepSpeed checkpoint file {path}: {e} "
                                      f"(corrupt or incomplete?)") from None
