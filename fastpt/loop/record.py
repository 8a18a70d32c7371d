"""The run's record beside the model: the epochs' history, the best epoch, early stopping, validation time.

`RunRecord` is what train.py updates after each validation and what last.pt keeps besides the
weights and the bookkeeping's position and sums (loop/checkpoints.py writes and restores it);
results.json is written from it.
"""

import math
from dataclasses import dataclass, field

from fastpt.loop.early_stopping import BestTracker, EarlyStopping
from fastpt.loop.evaluation import confusion_text, per_class
from fastpt.errors import NonFiniteLoss


@dataclass
class RunRecord:
    best: BestTracker  # ModelCheckpoint(save_top_k=1)'s rule: which epoch best.pt holds
    early_stopping: EarlyStopping
    history: list = field(default_factory=list)  # one row per epoch: train and validation metrics
    val_time_s: float = 0.0  # every validation, compilation included
    val_compile_s: float = 0.0  # the part of val_time_s spent compiling evaluation graphs
    epoch_offset: int = 0  # reviews of this epoch's order done before a resize (resize.py); 0 from the next epoch
    batch_size_flag: int = 0  # --batch-size as the run first started (resize.py)
    tested_on: str = ""  # the weights the test ran on: best, last, or last (no best checkpoint)
    label_names: list = field(default_factory=list)  # id i is label_names[i]: TensorBoard's per-class views

    def add_validation(self, val: dict, position) -> None:
        """Its time; a NaN loss stops the run (the model diverged): no best.pt, verdict or last.pt from it."""
        self.val_time_s += val["time_s"]
        # Host time of the batches that compiled (the clock's, as for train_time_no_compile_s): taking it
        # out leaves the steady rate over every review, with no sync added. Dropping whole first batches
        # instead would bias it: sorted evaluation batches start with the longest reviews.
        self.val_compile_s += val["compile_s"]
        if not math.isfinite(val["loss"]):
            raise NonFiniteLoss(f"validation loss is {val['loss']} after epoch {position.epoch + 1} "
                                f"(step {position.global_step}): the model diverged (no best.pt is saved from it; "
                                f"try a lower --lr or --max-grad-norm)")

    def end_epoch(self, train_metrics: dict, val: dict, improved: bool, position, clocks, tracker) -> None:
        """The epoch's line, TensorBoard and history; the epoch clock stops and the next epoch begins.

        TensorBoard also gets each class's validation F1, precision and recall (val_f1/<label>, ...:
        a class that fails hides behind a good accuracy) and the validation confusion as text."""
        clocks.stop_epoch()
        step = position.global_step
        row = {"epoch": position.epoch + 1, "step": step, **train_metrics,
               "val_loss": val["loss"], "val_acc": val["acc"], "val_macro_f1": val["macro_f1"],
               "train_time_s": clocks.train_time_s}
        self.history.append(row)
        tracker.scalars({k: v for k, v in row.items() if k not in ("epoch", "step")}, step, "epoch/")
        classes = per_class(val["confusion"], self.label_names)
        for metric in ("f1", "precision", "recall"):
            tracker.scalars({name: c[metric] for name, c in classes.items()}, step, f"val_{metric}/")
        tracker.text("val_confusion", f"epoch {row['epoch']}, step {step}\n"
                     f"{confusion_text(val['confusion'], self.label_names)}", step)
        tracker.print(f"epoch {row['epoch']}: train loss {row['train_loss']:.4f} acc {row['train_acc']:.4f} | "
                      f"val loss {val['loss']:.4f} acc {val['acc']:.4f} macro-F1 {val['macro_f1']:.4f}"
                      f"{' (best)' if improved else ''} | {clocks.train_time_s:.1f} s")
        if self.early_stopping.stopped:
            tracker.print(f"early stopping: {self.early_stopping.reason}")
        position.epoch, position.batch_in_epoch = position.epoch + 1, 0
        self.epoch_offset = 0  # only a resumed epoch starts off a global-batch boundary (resize.py)
