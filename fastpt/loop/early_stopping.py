"""Early stopping and best-checkpoint selection, with Lightning's semantics.

`EarlyStopping` replaces `lightning.pytorch.callbacks.EarlyStopping(monitor, mode, patience,
min_delta)`: after each validation check, a value improves on the best so far if it beats it
by more than `min_delta` (`current - min_delta > best` for mode max, `current + min_delta <
best` for min); otherwise a counter grows, and training stops once it reaches `patience`.
A NaN or infinite monitored value stops at once (Lightning's `check_finite=True`). With
`patience=None` (no --early-stopping-patience) it never stops, so the loop needs no special case.

`BestTracker` replaces `ModelCheckpoint(monitor, mode, save_top_k=1)`: it keeps one
checkpoint and replaces it only on a strict improvement, so a tie keeps the earlier epoch.

Why it is faster: early stopping ends runs that stopped improving; the best checkpoint lets
a run that trained a little past its best still test on the best weights.
"""

import math
from dataclasses import asdict, dataclass


def _better(current: float, best: float, mode: str, min_delta: float = 0.0) -> bool:
    return current - min_delta > best if mode == "max" else current + min_delta < best


class _Saved:
    """last.pt keeps a dataclass's fields as a plain dict (weights_only-safe)."""

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        vars(self).update(state)


@dataclass
class EarlyStopping(_Saved):
    mode: str = "max"
    patience: int | None = 3  # None: never stop
    min_delta: float = 0.0
    best: float = -math.inf
    wait_count: int = 0
    stopped: bool = False
    reason: str = ""

    def __post_init__(self):
        if self.best == -math.inf and self.mode == "min":
            self.best = math.inf

    def update(self, current: float) -> bool:
        """Record one validation check; True when training should stop."""
        if self.patience is None:
            return False
        if not math.isfinite(current):
            self.stopped, self.reason = True, f"monitored value is {current}"
        elif _better(current, self.best, self.mode, self.min_delta):
            self.best, self.wait_count = current, 0
        else:
            self.wait_count += 1
            if self.wait_count >= self.patience:
                self.stopped = True
                self.reason = f"no improvement in {self.wait_count} validation checks (best {self.best:.4f})"
        return self.stopped


@dataclass
class BestTracker(_Saved):
    mode: str = "max"
    best: float | None = None
    best_epoch: int | None = None

    def update(self, current: float, epoch: int) -> bool:
        """True if `current` strictly improves on the best so far (then it is the new best)."""
        improved = math.isfinite(current) and (self.best is None or _better(current, self.best, self.mode))
        if improved:
            self.best, self.best_epoch = current, epoch
        return improved
