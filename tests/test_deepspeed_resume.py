"""--deepspeed --resume trusts nothing in the run folder beyond tensors, plain data and DeepSpeed's own
few classes; DeepSpeed's module-level state does not outlive a run; float16 is refused or accepted
as the accelerator reports.

A crafted pickle here is one whose unpickling would create a marker file: `os.system("touch ...")`.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")

from fastpt.cli.shell import EXIT_BAD_INPUT  # noqa: E402
from fastpt.config import TrainConfig  # noqa: E402
from fastpt.errors import CheckpointError  # noqa: E402
from fastpt.strategies import deepspeed as fastpt_deepspeed  # noqa: E402
from fastpt.strategies import deepspeed_checkpoint, deepspeed_config  # noqa: E402
from train import main  # noqa: E402


@pytest.fixture(autouse=True)
def no_shm_build(monkeypatch):
    """As tests/dist/run_many.py: gloo alone, without JIT-compiling DeepSpeed's shared-memory op."""
    monkeypatch.setattr(importlib.import_module("deepspeed.comm.torch"), "build_shm_op", lambda: None)


def ds_args(tiny_args, out: Path, *extra: str) -> list[str]:
    return tiny_args("--deepspeed", "--train-size", "16", "--max-length", "32", "--save-every", "1",
                     "--no-tensorboard", *extra, out=out)


class Planted:
    """Unpickling this runs `touch marker`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory, imdb_dir, cache_dir) -> Path:
    """A ZeRO-2 run stopped after its first epoch, with its DeepSpeed checkpoint: one to resume."""
    out = tmp_path_factory.mktemp("ds") / "run"
    args = ["--model", "tiny", "--data-dir", str(imdb_dir), "--cache-dir", str(cache_dir), "--batch-size", "8",
            "--epochs", "1", "--no-progress", "--out", str(out)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(importlib.import_module("deepspeed.comm.torch"), "build_shm_op", lambda: None)
        assert main(ds_args(lambda *extra, out: args + list(extra), out)) == 0
    (out / "results.json").unlink()  # as if stopped after its checkpoint: --resume auto --epochs 2 continues
    return out


@pytest.fixture
def run(stopped_run, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(stopped_run, copy)
    return copy


def the_tag(run: Path) -> str:
    return torch.load(run / "checkpoints" / "last.pt", weights_only=True)["training"]["deepspeed_tag"]


def resume(tiny_args, run: Path, capfd) -> tuple[int, list[str]]:
    capfd.readouterr()
    status = main(ds_args(tiny_args, run, "--resume", "auto"))
    return status, [line for line in capfd.readouterr().err.splitlines() if line.startswith("error:")]


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.rglob("*"))}


# The engine's state, this rank's optimiser shard, and a universal conversion planted beside the tag (a resume on
# another number of processes would read it instead of converting).
@pytest.mark.parametrize("planted", ["{tag}/zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                     "{tag}/mp_rank_00_model_states.pt",
                                     "{tag}-universal/zero/classifier.bias/fp32.pt"])
def test_a_crafted_deepspeed_file_is_refused_unopened(planted, run, tiny_args, tmp_path, capfd):
    marker = tmp_path / "MARKER"
    path = run / "checkpoints" / "deepspeed" / planted.format(tag=the_tag(run))
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"optimizer_state_dict": Planted(marker)}, path)
    before = snapshot(run)

    status, errors = resume(tiny_args, run, capfd)

    assert not marker.exists()
    assert status == EXIT_BAD_INPUT
    assert len(errors) == 1 and f"refused to load {path}: it would import posix.system" in errors[0], errors
    assert snapshot(run) == before


def test_deepspeeds_own_loads_are_weights_only(run, tmp_path):
    """The guard around engine.load_checkpoint: DeepSpeed's checkpoint engine passes weights_only=False itself."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    marker, crafted = tmp_path / "MARKER", tmp_path / "crafted.pt"
    torch.save({"loss_scaler": Planted(marker)}, crafted)
    genuine = next((run / "checkpoints" / "deepspeed" / the_tag(run)).glob("*optim_states.pt"))
    with deepspeed_checkpoint.weights_only_loads(genuine.parent):
        assert "loss_scaler" in TorchCheckpointEngine().load(str(genuine))["optimizer_state_dict"]
    with pytest.raises(CheckpointError, match="it would import posix.system"):
        with deepspeed_checkpoint.weights_only_loads(crafted):
            TorchCheckpointEngine().load(str(crafted))
    assert not marker.exists()
    assert "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ  # restored for the rest of the process


def test_the_float16_loss_scaler_loads_through_the_guard(tmp_path):
    """fp16 checkpoints (a GPU's; this CPU may have no float16) hold DeepSpeed's DynamicLossScaler."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    scaler = DynamicLossScaler(init_scale=2.0**16, scale_window=1000, min_scale=1, delayed_shift=2,
                               consecutive_hysteresis=False, dtype=torch.float16)
    torch.save({"loss_scaler": scaler, "zero_stage": ZeroStageEnum.gradients}, tmp_path / "shard.pt")
    with deepspeed_checkpoint.weights_only_loads(tmp_path):
        loaded = torch.load(tmp_path / "shard.pt", weights_only=False)  # as DeepSpeed calls it
    assert vars(loaded["loss_scaler"]) == vars(scaler) and loaded["zero_stage"] is ZeroStageEnum.gradients


def test_files_in_torchs_older_format_are_checked_too(tmp_path):
    """DeepSpeed's "checkpoint_serialization": false writes torch's pre-zip format, which cannot be memory-mapped."""
    folder = tmp_path / "checkpoints" / "deepspeed" / "global_step1"
    folder.mkdir(parents=True)
    torch.save({"module": {"w": torch.ones(2)}}, folder / "mp_rank_00_model_states.pt",
               _use_new_zipfile_serialization=False)
    deepspeed_checkpoint.check_resume({"deepspeed_tag": "global_step1"}, tmp_path / "checkpoints")
    marker = tmp_path / "MARKER"
    torch.save({"module": Planted(marker)}, folder / "mp_rank_00_model_states.pt", _use_new_zipfile_serialization=False)
    with pytest.raises(CheckpointError, match="it would import posix.system"):
        deepspeed_checkpoint.check_resume({"deepspeed_tag": "global_step1"}, tmp_path / "checkpoints")
    assert not marker.exists()


@pytest.mark.parametrize("tag", ["../../../../tmp/x", "global_step1/../../..", "/tmp/x", "global_step1/sub", ""])
def test_a_deepspeed_tag_that_is_not_a_plain_step_folder_is_refused(tag, run, tiny_args, capfd):
    state = torch.load(run / "checkpoints" / "last.pt", weights_only=True)
    state["training"]["deepspeed_tag"] = tag
    torch.save(state, run / "checkpoints" / "last.pt")
    before = snapshot(run)

    status, errors = resume(tiny_args, run, capfd)

    assert status == EXIT_BAD_INPUT
    assert len(errors) == 1 and f"names the DeepSpeed checkpoint {tag!r}, not a folder global_stepN" in errors[0]
    assert snapshot(run) == before


def test_a_tag_folder_linked_outside_the_run_folder_is_refused(run, tiny_args, tmp_path, capfd):
    tag_folder = run / "checkpoints" / "deepspeed" / the_tag(run)
    shutil.move(tag_folder, tmp_path / "elsewhere")
    tag_folder.symlink_to(tmp_path / "elsewhere")

    status, errors = resume(tiny_args, run, capfd)

    assert status == EXIT_BAD_INPUT and len(errors) == 1 and "not a folder global_stepN" in errors[0], errors


def test_a_genuine_deepspeed_checkpoint_resumes(run, tiny_args, capfd):
    """The allow-listed classes are enough for DeepSpeed's own files (and the run after another in this process)."""
    status, errors = resume(tiny_args, run, capfd)
    assert status == 0 and not errors
    assert json.loads((run / "results.json").read_text())["strategy"] == "deepspeed"


# ---------------------------------------------------------------------------- module-level state between runs

def test_two_deepspeed_runs_in_one_process(tiny_args, tmp_path):
    """DeepSpeed keeps process groups at module level; the second run must not find the first run's destroyed group."""
    for name in ("first", "second"):
        assert main(ds_args(tiny_args, tmp_path / name, "--epochs", "1")) == 0, name


def test_forgetting_the_groups_without_deepspeeds_own_release(monkeypatch):
    """DeepSpeed before 0.19 has no _release_process_group_references: the groups are cleared by name."""
    from deepspeed.utils import groups

    comm = importlib.import_module("deepspeed.comm.comm")
    monkeypatch.delattr(groups, "_release_process_group_references")
    monkeypatch.setattr(groups, "_WORLD_GROUP", object())
    monkeypatch.setattr(groups, "_DATA_PARALLEL_GROUP", object())
    monkeypatch.setattr(groups, "mesh_device", object())
    monkeypatch.setitem(groups._EXPERT_PARALLEL_GROUP, "ep_size_1", object())
    monkeypatch.setattr(comm, "cdb", object())

    fastpt_deepspeed.forget_process_groups()

    assert groups._WORLD_GROUP is None and groups._DATA_PARALLEL_GROUP is None and groups.mesh_device is None
    assert groups._EXPERT_PARALLEL_GROUP == {} and comm.cdb is None


# ---------------------------------------------------------------------------- float16, as the accelerator reports

class Accelerator:
    """A stand-in for DeepSpeed's accelerator: float16 as the test says, bfloat16 always."""

    def __init__(self, fp16: bool):
        self.fp16 = fp16

    def is_fp16_supported(self):
        return self.fp16

    def is_bf16_supported(self):
        return True

    def device_name(self):
        return "cpu"


@pytest.mark.parametrize("fp16", [False, True])
def test_float16_is_refused_exactly_when_the_accelerator_lacks_it(fp16, monkeypatch):
    import deepspeed.accelerator

    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: Accelerator(fp16))
    cfg = TrainConfig(strategy="deepspeed", amp=True, amp_dtype="float16")
    if fp16:
        deepspeed_config.check_supported(cfg, torch.device("cpu"))  # accepted: no refusal
    else:
        with pytest.raises(ValueError, match="DeepSpeed has no float16 on this device"):
            deepspeed_config.check_supported(cfg, torch.device("cpu"))


def test_float16_trains_where_the_cpu_has_it(tiny_args, tmp_path):
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    if not CPU_Accelerator().is_fp16_supported():
        pytest.skip("this CPU has no float16 kernels for DeepSpeed (oneDNN fp16: AVX512-FP16 or AVX-NE-CONVERT)")
    out = tmp_path / "run"
    assert main(ds_args(tiny_args, out, "--amp", "--amp-dtype", "float16", "--device", "cpu", "--epochs", "1")) == 0
    assert json.loads((out / "results.json").read_text())["strategy"] == "deepspeed"
