"""Whether a run folder's earlier run may be continued by this one: the same settings (a resize
excepted), the same data, the same model; and config.json read back (fastpt's, or not).

Every check runs before anything is written; each failure is one line (CheckpointError or
ValueError) naming the first thing that differs. run_folder.py calls these while it plans.
"""

from __future__ import annotations

from pathlib import Path

from fastpt.config import LATER_SETTINGS, RESUME_SENSITIVE, TrainConfig


def a_few(names: list[str], shown: int = 3) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def saved_config(out: Path) -> dict | None:
    """The run folder's config.json; None if missing, unreadable or not a JSON object."""
    from fastpt.files import trust

    try:
        saved = trust.read_json(out / "config.json")
    except (OSError, ValueError):
        return None
    return saved if isinstance(saved, dict) else None


def is_fastpt_config(saved: dict | None) -> bool:
    """A config.json that fastpt wrote: every setting a resume compares, and the number of processes."""
    return saved is not None and {*RESUME_SENSITIVE, "world_size"} - {*LATER_SETTINGS} <= saved.keys()


def nothing_left(cfg: TrainConfig, state: dict) -> bool:
    """Whether the checkpointed run has already done all these flags ask for."""
    progress, early = state["progress"], state.get("early_stopping") or {}
    return (bool(early.get("stopped")) or progress["epoch"] >= cfg.epochs
            or (cfg.max_steps is not None and progress["global_step"] >= cfg.max_steps))


def check_resume_compatible(cfg: TrainConfig, state: dict, world_size: int, path: Path) -> None:
    from fastpt.cluster import resize
    from fastpt.errors import CheckpointError

    if not isinstance(state, dict) or not {"progress", "config", "training", "per_rank"} <= state.keys():
        raise CheckpointError(f"{path} is not a fastpt last.pt checkpoint")
    compare_settings(cfg, {**state["config"], "world_size": state.get("world_size")}, world_size,
                     f"cannot resume from {path}", batch_size_flag=resize.batch_size_flag(state))
    if cfg.strategy == "deepspeed":  # last.pt names a folder of DeepSpeed pickles: checked before any work
        from fastpt.strategies.deepspeed_checkpoint import check_resume
        check_resume(state["training"], path.parent)


def compare_settings(cfg: TrainConfig, saved: dict, world_size: int, context: str,
                     batch_size_flag: int | None = None) -> None:
    """CheckpointError naming the first setting that differs from the saved run's.

    With a checkpoint (batch_size_flag given) the number of processes may change (resize.py), and
    --batch-size may then be the one the run was started with or one that keeps the global batch.
    """
    from fastpt.cluster import resize
    from fastpt.errors import CheckpointError

    resuming = batch_size_flag is not None
    for name in RESUME_SENSITIVE:
        if name == "batch_size" and resuming and resize.accepts_batch_size(
                cfg.batch_size, saved["batch_size"], batch_size_flag, saved.get("world_size"), world_size):
            continue
        was = saved.get(name, getattr(TrainConfig, name)) if name in LATER_SETTINGS else saved.get(name)
        if was != getattr(cfg, name):
            raise CheckpointError(f"{context}: --{name.replace('_', '-')} was {shown(was)}, "
                                  f"now {shown(getattr(cfg, name))}")
    if saved.get("world_size") != world_size and not resuming:
        raise CheckpointError(f"{context}: it was written by {saved.get('world_size')} process(es), "
                              f"this run has {world_size}")


def shown(value) -> str:
    """A setting's value in a message: "unset" for a flag not given (None), else as Python writes it."""
    return "unset" if value is None else repr(value)


def data_key(inputs) -> str:
    """The data's identity: the name of its token cache, keyed by the data's content (token_cache.py, own_data.py)."""
    return Path(inputs.cache_path).name


def check_same_data(plan, cfg: TrainConfig, inputs) -> None:
    """A resume (run_folder.OutPlan) continues on the data it started on, into the model it started with;
    CheckpointError
    otherwise, before anything is written (config.json included).

    The same path with other rows, or a new class, is other data: its content key differs from the
    one config.json recorded. Runs from before the key still have their labels and weights compared.
    """
    import torch

    from fastpt.errors import CheckpointError

    where = f"cannot continue the run in {plan.out}"
    if plan.data_key is not None and plan.data_key != data_key(inputs):
        raise CheckpointError(f"{where}: its data changed since it started (content key {plan.data_key}, now "
                              f"{data_key(inputs)}); a resume trains on the same data: choose another --out")
    state = plan.resume_state
    if not state:
        return
    saved_labels = state["config"].get("label_names")
    if saved_labels is not None and list(saved_labels) != list(inputs.label_names):
        raise CheckpointError(f"{where}: it was trained on the labels {saved_labels}, now they are "
                              f"{inputs.label_names} (the data's, or --label-names); resume with the same, or choose "
                              f"another --out")
    weights = state["training"].get("model") if isinstance(state["training"], dict) else None
    if weights is None:
        return  # DeepSpeed keeps the weights in its own files (checkpoints/deepspeed)
    model = inputs.model.state_dict()
    if not isinstance(weights, dict) or weights.keys() != model.keys():
        missing = sorted(model.keys() - (weights.keys() if isinstance(weights, dict) else set()))
        raise CheckpointError(f"{where}: its last.pt does not hold this model's weights "
                              f"({a_few(missing) or 'other names'} missing)")
    for name, tensor in model.items():
        saved = weights[name]
        if not torch.is_tensor(saved) or saved.shape != tensor.shape:
            shape = list(saved.shape) if torch.is_tensor(saved) else type(saved).__name__
            raise CheckpointError(f"{where}: its last.pt's {name} is {shape}, this model's is {list(tensor.shape)} "
                                  f"(a last.pt of another model or data); choose another --out")
