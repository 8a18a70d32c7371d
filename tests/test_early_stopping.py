"""Early stopping and best-checkpoint selection follow Lightning's rules, case by case."""

from __future__ import annotations

import math

import pytest

from fastpt.loop.early_stopping import BestTracker, EarlyStopping


# (mode, patience, min_delta, monitored values per validation check, check at which it stops or None)
CASES = [
    ("max", 2, 0.0, [0.80, 0.82, 0.81, 0.81], 4),           # two checks without improvement
    ("max", 2, 0.0, [0.80, 0.79, 0.83, 0.82, 0.84], None),  # improvement resets the counter
    ("max", 1, 0.0, [0.80, 0.80], 2),                       # a tie is no improvement
    ("max", 2, 0.05, [0.80, 0.84, 0.845, 0.87], 3),         # 0.84 and 0.845 are within min_delta of 0.80
    ("max", 3, 0.0, [0.5, 0.6, 0.7, 0.8, 0.9], None),
    ("min", 2, 0.0, [0.50, 0.40, 0.45, 0.41], 4),
    ("min", 1, 0.1, [0.50, 0.45], 2),                       # 0.45 is not 0.1 below 0.50
    ("min", 5, 0.0, [0.50, math.nan], 2),                   # non-finite stops at once
    ("max", 5, 0.0, [0.50, math.inf], 2),
]


@pytest.mark.parametrize("mode,patience,min_delta,values,stop_at", CASES)
def test_early_stopping_stops_where_lightning_does(mode, patience, min_delta, values, stop_at):
    es = EarlyStopping(mode=mode, patience=patience, min_delta=min_delta)
    stopped = None
    for check, value in enumerate(values, start=1):
        if es.update(value):
            stopped = check
            break
    assert stopped == stop_at


def test_early_stopping_state_round_trips():
    es = EarlyStopping(mode="max", patience=3)
    for v in (0.7, 0.6):
        es.update(v)
    copy = EarlyStopping(mode="max", patience=3)
    copy.load_state_dict(es.state_dict())
    assert copy.update(0.65) == es.update(0.65) and copy.wait_count == es.wait_count == 2


@pytest.mark.parametrize("mode,values,best_epoch", [
    ("max", [0.80, 0.85, 0.85, 0.84], 2),  # strict improvement: the tie at epoch 3 keeps epoch 2
    ("max", [0.90, 0.85, 0.80], 1),
    ("min", [0.5, 0.3, 0.3, 0.2], 4),
    ("max", [math.nan, 0.6], 2),           # a NaN is never the best
])
def test_best_tracker_keeps_the_first_strictly_best(mode, values, best_epoch):
    tracker = BestTracker(mode)
    saved = [epoch for epoch, v in enumerate(values, start=1) if tracker.update(v, epoch)]
    assert tracker.best_epoch == best_epoch and saved[-1] == best_epoch
