"""DeepSpeed ZeRO (`--deepspeed`): Lightning's `strategy="deepspeed_stage_2"` (and stages 1 and 3).

What it does: data parallel training in which the DeepSpeed engine owns backward and the
optimiser step, and shards the training state over the processes (ZeRO, "zero redundancy"):
- stage 1 shards the optimiser state (Adam's two moments and the float32 master weights);
- stage 2 also shards the gradients: they are reduce-scattered, each rank keeping its part;
- stage 3 also shards the parameters, gathered layer by layer in forward and backward (FSDP's idea).

Why it helps: training with Adam holds 16 bytes per parameter before activations. In float32: 4
for the weight, 4 for its gradient, 8 for Adam's two moments (optimiser state = 2x the weights).
With 16-bit weights and float32 masters (--amp): 2 for the weight, 2 for the gradient, and 12 of
optimiser state (4 for the float32 master, 4 + 4 for the moments) = 6x the 16-bit weights. DDP
keeps 16 on every rank (4 + 4 + 8 under autocast); on N ranks ZeRO-1 keeps 2 + 2 + 12/N, ZeRO-2 2 + 14/N, ZeRO-3
16/N. (DeepSpeed's stages 1-2 also keep a float32 copy of each rank's slice without --amp: 4/N
more.) Stage 2 communicates as much as DDP (reduce-scatter + all-gather = one all-reduce), so it
is about as fast: the article measured 3.15 min on 4 A100s vs DDP's 3.52.

What it costs: a dependency (optional here: fastpt runs without deepspeed installed, and this
module is imported only for --deepspeed), a model wrapped in an engine that decides precision
itself (with --amp it casts the whole model to float16 or bfloat16 and keeps float32 masters in
the optimiser, instead of autocast), and checkpoints in DeepSpeed's own sharded format.

The config is generated from fastpt's flags (`deepspeed_config`): --zero-stage, fp16/bf16 from
--amp/--amp-dtype, micro batch, accumulation, clipping, and the ZeRO settings Lightning's
`DeepSpeedStrategy` writes for `deepspeed_stage_N` (`LIGHTNING_ZERO`), so that the article's row
is compared with the same engine: gradients reduced in 2e8-element buckets while the backward
still runs (`overlap_comm`, which DeepSpeed by itself turns on only for stage 3), into one
contiguous buffer. `--deepspeed-config FILE` replaces it with the user's JSON; settings the data
loader and the loop depend on are checked against the flags. The optimiser (Adam or AdamW with
Trainer's groups) and the learning-rate schedule are fastpt's (optimizer.py), handed to
`deepspeed.initialize` as the client optimiser and `lr_scheduler`: the engine steps the schedule
after each step without an fp16 overflow and keeps it in its checkpoints. A JSON that names its
own `optimizer` or `scheduler` replaces them, and --optimizer / --lr-schedule are then refused.

Checkpoints: resume state goes through `engine.save_checkpoint` (every rank writes its shard;
last.pt records the tag); a run on another number of processes loads it through DeepSpeed's
universal checkpoint (`load_training_state`, ZeRO-1/2). `best.pt` holds the consolidated float32
weights under their plain names, so it loads into a model without DeepSpeed. DeepSpeed reads its
files with a full unpickler (`torch.load(weights_only=False)`), which runs whatever a crafted file
asks; fastpt makes every one of those loads `weights_only=True`, admitting only the few DeepSpeed
classes its checkpoints hold (`trusted_classes`), and takes last.pt's tag only as `global_stepN`
(deepspeed_checkpoint.py). The config and its checks are in deepspeed_config.py.
"""

import argparse
import contextlib
import functools
import io
import logging
import os
import shutil
import warnings
from pathlib import Path

import torch

from fastpt.config import TrainConfig
from fastpt.cluster import distributed
from fastpt.errors import CheckpointError
from fastpt.speedups.amp import MixedPrecision
from fastpt.strategies.base import Strategy, local_bytes, optimizer_state_bytes
from fastpt.strategies.deepspeed_checkpoint import checked_tag, weights_only_loads, written_by
from fastpt.strategies.deepspeed_config import deepspeed_config
from fastpt.strategies.optimizer import build_lr_scheduler, has_schedule


@contextlib.contextmanager
def _silenced():
    """ds_to_universal prints its arguments, steps and progress bars."""
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        yield


class DeepSpeedStrategy(Strategy):
    name = "deepspeed"
    skips_nonfinite_steps = False  # True under fp16: the engine's own dynamic scaler skips inf steps (setup)

    def __init__(self, cfg: TrainConfig, dist):
        super().__init__(cfg, dist)
        # No autocast and no GradScaler: the engine casts the model itself (its fp16 / bf16 config)
        # and scales the float16 loss inside its backward.
        self.precision = MixedPrecision(False, cfg.amp_dtype, dist.device)

    def setup(self, model: torch.nn.Module, training_steps: int | None = None) -> None:
        """Build the engine: it moves the model to the device, casts it (--amp), wraps the optimiser and
        steps the schedule (after every step without an fp16 overflow) and saves it with its checkpoints."""
        import deepspeed

        forget_process_groups()  # an earlier run in this process that stopped before close() left them
        logging.getLogger("DeepSpeed").setLevel(logging.INFO if self.cfg.verbose else logging.ERROR)
        # DeepSpeed's own noise, once per rank: a print ("... shm_comm_op built successfully", on the CPU)
        # and torch's FutureWarning on the deprecated collectives it calls. Rank 0 shows them with --verbose.
        talk = self.cfg.verbose and self.dist.is_main
        if not talk:
            warnings.filterwarnings("ignore", r"`torch\.distributed\.\w+` is deprecated", FutureWarning)
        self.ds_config = deepspeed_config(self.cfg, self.dist.world_size)
        # Our Adam, unless the user's JSON names DeepSpeed's own optimiser.
        client_optimizer = None if "optimizer" in self.ds_config else self.build_optimizer(model)
        # Ours, built on the optimiser the engine steps, unless the JSON names DeepSpeed's own (or none is asked).
        schedule = (None if "scheduler" in self.ds_config or not has_schedule(self.cfg)
                    else functools.partial(build_lr_scheduler, cfg=self.cfg, training_steps=training_steps))
        with contextlib.nullcontext() if talk else contextlib.redirect_stdout(io.StringIO()):
            self.model, _, _, self.lr_scheduler = deepspeed.initialize(
                model=model, optimizer=client_optimizer, lr_scheduler=schedule, config=self.ds_config)
        self.module = self.model.module
        self.optimizer = self.model.optimizer  # the ZeRO wrapper; param_groups reach the inner Adam
        self.zero_stage = self.model.zero_optimization_stage()
        self.skips_nonfinite_steps = self.ds_config.get("fp16", {}).get("enabled", False)
        self._previous_tag: str | None = None
        self._skipped_before = self.model.skipped_steps  # step_was_skipped compares with it

    # ------------------------------------------------------------------ the step
    def grad_sync(self, enabled: bool):
        """Tell the engine whether this micro-step ends an accumulation window.

        At the boundary ZeRO reduces (stage 1) or reduce-scatters (stages 2-3) the gradients;
        before it, they accumulate locally. The loop decides the boundary, also for a short last
        window at the end of an epoch, so the engine's own micro-step counter is overridden.
        """
        self.model.set_gradient_accumulation_boundary(enabled)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        # The loop has already divided the loss by --grad-accum; the engine must not do it again.
        self.model.backward(loss, scale_wrt_gas=False)

    def optimizer_step(self) -> None:
        """Unscale (fp16), clip to gradient_clipping, step, zero the gradients, the schedule: all inside the engine."""
        self.step_lr = self.optimizer.param_groups[0]["lr"]
        self.model.step()

    def step_was_skipped(self) -> torch.Tensor:
        """The engine's fp16 scaler counts its skipped steps (`skipped_steps`, a host int: the engine has
        already read the overflow flag). Its scale is no guide: it halves only after `hysteresis` overflows
        and stops at `min_loss_scale`."""
        skipped = self.model.skipped_steps > self._skipped_before
        self._skipped_before = self.model.skipped_steps
        return torch.tensor(skipped)

    # ------------------------------------------------------------------ state
    def model_state_dict(self) -> dict:
        """The consolidated float32 weights under plain names (a collective: every rank calls it).

        The float32 master weights are the trained values (with --amp the module holds 16-bit
        copies); under ZeRO they are sharded, and `safe_get_full_fp32_param` gathers each one.
        """
        from deepspeed.utils import safe_get_full_fp32_param

        state = {}
        for name, value in self.module.state_dict(keep_vars=True).items():
            full = safe_get_full_fp32_param(value) if isinstance(value, torch.nn.Parameter) else None
            state[name] = (full if full is not None else value).detach().float().cpu().clone()
        return state

    def load_model_state_dict(self, state: dict) -> None:
        """Full weights -> the module (gathered while loading under ZeRO-3) and the float32 masters."""
        import deepspeed
        from deepspeed.utils import safe_set_full_fp32_param

        params = dict(self.module.named_parameters())
        with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=0):
            self.module.load_state_dict(state)
        for name, param in params.items():
            safe_set_full_fp32_param(param, state[name].to(self.device, torch.float32))

    def training_state(self, ckpt_dir: Path) -> dict:
        """Every rank writes its shard with engine.save_checkpoint; last.pt keeps the tag.

        Tags older than the one the current last.pt names are removed first, so a crash while
        writing the new one still leaves last.pt pointing at a complete checkpoint.
        """
        folder, tag = ckpt_dir / "deepspeed", f"global_step{self.model.global_steps}"
        distributed.barrier()
        if self.dist.is_main and folder.is_dir():
            for old in folder.iterdir():
                if old.is_dir() and old.name not in (tag, self._previous_tag):
                    shutil.rmtree(old)
        self.model.save_checkpoint(str(folder), tag=tag)
        self._previous_tag = tag
        return {"deepspeed_tag": tag, "world_size": self.dist.world_size}

    def load_training_state(self, state: dict, ckpt_dir: Path) -> None:
        """engine.load_checkpoint; one written by another number of processes goes through a universal checkpoint.

        A ZeRO checkpoint holds one optimiser shard per process, cut for that number of processes;
        DeepSpeed refuses to load it on another ("Automatic adjustment of ZeRO's optimizer state
        partitioning with a new world size is not currently supported"). Its universal format
        stores every parameter's float32 weights and Adam moments whole, one folder each, and any
        number of processes loads it (`checkpoint.load_universal`).
        """
        tag, folder = checked_tag(state, ckpt_dir), ckpt_dir / "deepspeed"
        # Every rank reads its own shard from disk: all must see the folder (a shared --out), or all
        # stop together with one line (a rank that raised alone would leave the others waiting).
        sees = any((folder / tag).glob("*model_states.pt"))  # the engine's state: node 0 alone writes it
        unseen = [rank for rank, seen in enumerate(distributed.all_gather_object(sees)) if not seen]
        if unseen:
            raise CheckpointError(f"DeepSpeed checkpoint {folder / tag} is missing or incomplete on rank(s) "
                                  f"{', '.join(map(str, unseen))}: --deepspeed resumes from every rank's shard, so "
                                  f"every node must see the same --out (a shared file system)")
        universal = state.get("world_size", written_by(folder / tag)) != self.dist.world_size
        with weights_only_loads(folder / tag):
            load_tag = self._to_universal(folder, tag) if universal else tag
            self.model._config.load_universal_checkpoint = universal  # read by load_checkpoint only
            try:
                path, _ = self.model.load_checkpoint(str(folder), tag=load_tag)
            finally:
                self.model._config.load_universal_checkpoint = False
        if path is None:
            raise CheckpointError(f"DeepSpeed checkpoint {folder / load_tag} is missing")
        self._previous_tag = tag
        self._skipped_before = self.model.skipped_steps  # the checkpoint's count: not skips of this run

    def _to_universal(self, folder: Path, tag: str) -> str:
        """Rank 0 converts `tag` with DeepSpeed's ds_to_universal (once: the result is kept); the others wait.

        Rank 0 reads every rank's shard, so the checkpoint folder must be on a file system it sees.
        """
        universal = f"{tag}-universal"
        if self.dist.is_main and not (folder / universal).is_dir():
            from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

            tmp = folder / f".tmp-{universal}"
            shutil.rmtree(tmp, ignore_errors=True)
            args = argparse.Namespace(input_folder=str(folder / tag), output_folder=str(tmp), num_extract_workers=1,
                                      num_merge_workers=1, keep_temp_folder=False, strict=True,
                                      inject_missing_state=True)  # fastpt's engine stores no universal metadata
            with contextlib.nullcontext() if self.cfg.verbose else _silenced():
                ds_to_universal(args)
            os.rename(tmp, folder / universal)
        distributed.barrier()
        return universal

    def memory_report(self) -> dict:
        """Bytes this rank holds. Gradients are counted at the size ZeRO keeps between steps.

        `master_param_bytes` is ZeRO's float32 copy of this rank's partition (stages 1-2 keep one even without
        --amp); `optimizer_bytes` is Adam's moments alone, comparable with the other strategies.
        """
        params = list(self.module.parameters())
        if self.zero_stage == 3:
            param_bytes = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in params)
            masters = self.optimizer.fp32_partitioned_groups_flat
            # Without --amp the float32 partition is the parameter partition itself: no copy.
            shared = {t.data_ptr() for t in self.optimizer.fp16_partitioned_groups_flat}
        else:
            param_bytes = sum(local_bytes(p) for p in params)
            masters, shared = self.optimizer.single_partition_of_fp32_groups, set()
        grad_numel = sum(t.numel() for t in masters) if self.zero_stage >= 2 else sum(p.numel() for p in params)
        return {"param_bytes": param_bytes, "grad_bytes": grad_numel * params[0].element_size(),
                "optimizer_bytes": optimizer_state_bytes(self.optimizer.optimizer),  # the inner Adam's
                "master_param_bytes": sum(local_bytes(t) for t in masters if t.data_ptr() not in shared)}

    def close(self) -> None:
        if self.model is not None:  # an engine was built (setup may have failed before)
            self.model.destroy()  # release the engine's hooks and buffers
        forget_process_groups()


def forget_process_groups() -> None:
    """Drop the process groups DeepSpeed keeps at module level, past the engine's destroy.

    deepspeed.utils.groups holds a clone of the world group (and expert, model and data parallel
    groups, a device mesh), and deepspeed.comm its backend (`cdb`) built on the world group. fastpt
    destroys its process group at the end of every run, so a second run in the same process (a test,
    a notebook) would find them pointing at a destroyed group: "Group ... is not registered" inside
    deepspeed.initialize. Forgotten, the next deepspeed.initialize builds them again on the new group.
    """
    import importlib

    from deepspeed.utils import groups

    if hasattr(groups, "_release_process_group_references"):  # DeepSpeed >= 0.19: what its own teardown calls
        groups._release_process_group_references(None)
    else:
        for name, value in list(vars(groups).items()):
            if name.endswith("_GROUP") or name.endswith("_GROUP_RANKS") or name in ("mpu", "mesh_device"):
                if isinstance(value, dict):
                    value.clear()
                else:
                    setattr(groups, name, None)
    importlib.import_module("deepspeed.comm.comm").cdb = None  # by path: the package re-exports other names
