"""What a run shows and writes: console lines, tqdm bars, TensorBoard, JSON files.

Only rank 0 talks. Other ranks get a `NullTracker`, an object with the same methods that does
nothing, so the training loop never needs `if rank == 0` around a log call.

TensorBoard gets, besides the scalars, a custom-scalars layout (the CUSTOM SCALARS tab: training
and validation loss on one chart, accuracy on another, validation macro-F1, and every class's
validation F1 / precision / recall on one chart each) and the run's settings in the HPARAMS tab,
each only where it applies (no amp_dtype for a run without --amp). The TEXT tab holds the config
and the validation confusion of each epoch.
"""

import contextlib
import json
import sys
import threading
from pathlib import Path

from tqdm.auto import tqdm

from fastpt.config import NEEDS


# Tags the run logs: train/loss per log step, epoch/<metric> and val_<f1|precision|recall>/<label> per
# epoch. A multiline chart's tags are regular expressions: one per-class chart holds every label.
CUSTOM_SCALARS = {
    "training vs validation": {
        "loss": ["Multiline", ["train/loss", "epoch/train_loss", "epoch/val_loss"]],
        "accuracy": ["Multiline", ["epoch/train_acc", "epoch/val_acc"]],
        "macro-F1": ["Multiline", ["epoch/val_macro_f1"]],
    },
    "validation per class": {metric: ["Multiline", [f"val_{metric}/.*"]] for metric in ("f1", "precision", "recall")},
}


def applicable_hparams(config: dict) -> dict:
    """The config without settings its switches leave unused, and without unset (None) values."""
    return {k: v for k, v in config.items() if v is not None and (k not in NEEDS or NEEDS[k][1](config))}


class Tracker:
    def __init__(self, out_dir: Path, progress: bool, tensorboard: bool, purge_step: int | None = None):
        self.out_dir, self.progress, self.writer = out_dir, progress, None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step drops events a crashed run wrote after its last checkpoint, so a
            # resumed run continues the same curves without duplicate steps.
            if purge_step is not None:
                _after_existing_event_files(out_dir / "tb")
            _quiet_event_writer_threads()
            with _event_file_errors(out_dir / "tb"):
                self.writer = SummaryWriter(str(out_dir / "tb"), purge_step=purge_step)
                self.writer.add_custom_scalars(CUSTOM_SCALARS)

    def print(self, message: str) -> None:
        tqdm.write(message, file=sys.stdout)

    def bar(self, total: int, desc: str, initial: int = 0, leave: bool = False):
        return tqdm(total=total, desc=desc, initial=initial, leave=leave, dynamic_ncols=True,
                    disable=not self.progress, file=sys.stderr)

    def _write(self, method: str, *args, **kwargs) -> None:
        """One call of the TensorBoard writer's `method`, where there is a writer (a full disk: DiskFull)."""
        if self.writer:
            with _event_file_errors(self.out_dir / "tb"):
                getattr(self.writer, method)(*args, **kwargs)

    def scalars(self, values: dict, step: int, prefix: str = "") -> None:
        for k, v in values.items():
            if isinstance(v, (int, float)):
                self._write("add_scalar", f"{prefix}{k}", v, step)

    def text(self, tag: str, text: str, step: int | None = None) -> None:
        self._write("add_text", tag, f"```\n{text}\n```", step)

    def hparams(self, hparams: dict, metrics: dict) -> None:
        clean = {k: v if isinstance(v, (int, float, str, bool)) else str(v)
                 for k, v in applicable_hparams(hparams).items()}
        scores = {f"hparam/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))}
        self._write("add_hparams", clean, scores, run_name="hparams")

    def write_json(self, name: str, data: dict) -> None:
        write_json_atomic(self.out_dir / name, data)

    def close(self) -> None:
        if self.writer:
            writer, self.writer = self.writer, None
            with _event_file_errors(self.out_dir / "tb"):
                writer.close()


class NullTracker(Tracker):
    """The tracker of every rank but 0: same methods, no output."""

    def __init__(self):
        self.writer, self.progress, self.out_dir = None, False, None

    def print(self, message: str) -> None:
        pass

    def write_json(self, name: str, data: dict) -> None:
        pass


@contextlib.contextmanager
def _event_file_errors(folder: Path):
    """A full disk under TensorBoard's writer becomes fastpt's one-line DiskFull (exit status 1)."""
    from fastpt.files.checkpoint import disk_full
    from fastpt.errors import DiskFull

    try:
        yield
    except OSError as e:
        if not disk_full(e):
            raise
        raise DiskFull(f"no space left in {folder} for TensorBoard's event file: free some space, or "
                       f"pass --no-tensorboard") from None


def _quiet_event_writer_threads() -> None:
    """TensorBoard writes from a thread of its own; a write that fails there is raised again in the
    main thread at the next call (and reported there, in one line): the thread's own traceback is noise."""
    previous = threading.excepthook
    if getattr(previous, "fastpt_quiet", False):
        return

    def hook(args):
        if type(args.thread).__name__ == "_AsyncWriterThread" and isinstance(args.exc_value, OSError):
            return
        previous(args)

    hook.fastpt_quiet = True
    threading.excepthook = hook


def _after_existing_event_files(folder: Path) -> None:
    """Wait (under a second) until a new event file would sort after every existing one.

    TensorBoard reads a folder's event files in name order, and a name starts with the second
    it was created in, then host and pid. A purge only hides events read before it, so the
    resumed run's file must come after the crashed run's, even when both fall in one second.
    """
    import time
    stamps = [int(p.name.split(".")[3]) for p in folder.glob("events.out.tfevents.*") if p.name.split(".")[3].isdigit()]
    while stamps and int(time.time()) <= max(stamps):
        time.sleep(0.05)


def write_json_atomic(path: Path, data: dict) -> None:
    from fastpt.files.checkpoint import write_atomic

    text = json.dumps(data, indent=2, sort_keys=True, default=str) + "\n"
    write_atomic(path, lambda f: f.write(text.encode()))
