"""Everything around the training step that is not the computation.

`step.train_epoch` is the textbook loop; this object keeps what a real run needs beside it:
- where the run is (epoch, batch in the epoch, optimiser step, training time), resumable;
- the epoch's metric sums and the loss window since the last log line, kept on the device
  and read only at log steps (a `.item()` per step would make the host wait for the device);
- the first step whose loss was not finite, or, under float16's GradScaler (which skips such
  steps), the start of a long run of skipped steps (both checked at log and save steps);
- the throughput meter, the compile clock and the progress bar;
- what each step makes due, as an answer to the loop (`after_step` returns a `Due`): a log line
  (at steps 1, 2, 4, ... until --log-every, then every --log-every steps), last.pt every
  --save-every steps and every --save-every-minutes (10 by default, so a kill -9 loses minutes,
  not the epoch), and a graceful stop after SIGTERM / SIGINT. It calls nothing back: the loop
  logs (`log`), and train.py writes last.pt and stops.

Saving by time: rank 0's clock decides, and its verdict rides on the stop check's collective (one
all-reduce of two integers on a gloo group, run at log and save steps under torchrun, at every
step on one process, where it is no collective at all), so every rank saves at the same step and
no step waits for anything more. Under torchrun a save falls due at the first log step after the
interval; a run shorter than the interval never saves by time.

It is built from a checkpoint's state when resuming, so a resumed run logs, averages and
times exactly what the uninterrupted run would have.
"""

from __future__ import annotations

import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from fastpt.cluster import distributed, slurm
from fastpt.monitoring import metrics
from fastpt.errors import NonFiniteLoss, Requeued, StopRequested


# float16 AMP hides a diverged run: the GradScaler skips every step whose gradients hold inf/NaN
# and halves its scale, so the loss is NaN, nothing trains, and nothing fails. Its scale starts at
# 2^16 and halves once per skipped step, so 16 skips in a row bring it to 1 (gradients no longer
# scaled up at all); a healthy run skips a few steps at the start and one now and then after the
# scale has grown. Twice that, 32 skips in a row, means gradients stayed inf/NaN while the scale fell
# 2^32-fold from wherever it stood (2^16 down to 2^-16 from the start): the run has diverged.
MAX_SKIPPED_STEPS_IN_A_ROW = 32


def is_log_step(step: int, log_every: int) -> bool:
    """Every log_every steps, and at 1, 2, 4, 8, ... before that, so short runs still draw a curve."""
    return step % log_every == 0 or (step < log_every and step & (step - 1) == 0)


@dataclass(frozen=True)
class Due:
    """What one optimiser step makes due, for the loop to do: a log line, last.pt, a stop."""
    log: bool = False
    save: bool = False  # last.pt now: --save-every, --save-every-minutes, or a stop (never lose more than the step)
    stop: str = ""  # why the run stops after this step ("" = it goes on): status 3, with how to resume


class Bookkeeping:
    def __init__(self, cfg, dist, out_dir, tracker, meter: metrics.Throughput, stopper, strategy,
                 resume: Optional[dict] = None):
        """`strategy` is read, never driven: the learning rate each step trained with (`step_lr`), and
        under float16 whether its scaler skipped the step (`skips_nonfinite_steps`, `step_was_skipped()`)."""
        self.cfg, self.dist, self.device, self.out_dir = cfg, dist, dist.device, out_dir
        self.tracker, self.meter, self.stopper = tracker, meter, stopper
        self.skips_nonfinite_steps = strategy.skips_nonfinite_steps
        self.lr = lambda: strategy.step_lr
        self.compile_clock = metrics.CompileClock()
        self.token_shapes: set[int] = set()  # distinct batch widths / packed lengths: CUDA graphs record one each
        progress = resume["progress"] if resume else {}
        self.epoch = progress.get("epoch", 0)
        self.batch_in_epoch = progress.get("batch_in_epoch", 0)
        self.global_step = progress.get("global_step", 0)
        self.train_time_s = progress.get("train_time_s", 0.0)
        self.first_step_s = progress.get("first_step_s")
        self.resumed_at_step = self.global_step if resume else None
        this_rank = resume["per_rank"][dist.rank] if resume else {}
        self.epoch_sums = self._on_device(this_rank.get("epoch_sums"))
        self.step_was_skipped = strategy.step_was_skipped  # float16's scaler: did it skip the step just taken?
        self.skipped_in_a_row = torch.zeros((), dtype=torch.long, device=self.device)
        window = this_rank.get("window")
        self.window_loss = self._on_device(window[0]) if window else None
        self.window_count = window[1] if window else 0
        self.epoch_clock = None
        self.step_start = None  # when the step's first batch was asked for
        self.last_save = time.monotonic()  # --save-every-minutes counts from here (rank 0's clock decides)

    def _on_device(self, t):
        return None if t is None else t.to(self.device)

    # ------------------------------------------------------------------ around the loop
    def start_epoch(self, batches_left: int) -> None:
        """Before the epoch's first batch (after a resume: the first one left): its clock, its metric
        sums, its progress bar and the throughput meter."""
        self.epoch_clock = time.perf_counter()
        self.n_batches = self.batch_in_epoch + batches_left
        if self.epoch_sums is None:
            self.epoch_sums = torch.zeros(3, dtype=torch.float64, device=self.device)  # loss sum, correct, seen
        if self.window_loss is None:
            self.window_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        self.first_bad_step = torch.full((), -1, dtype=torch.long, device=self.device)
        self.bar = self.tracker.bar(self.n_batches, f"epoch {self.epoch + 1}/{self.cfg.epochs}",
                                    initial=self.batch_in_epoch)
        self.meter.start()

    def timed_batches(self, loader):
        """The loader's batches, each counted and timed (the wait for data), recorded by the meter."""
        batches = iter(loader)
        while True:
            t0 = time.perf_counter()
            if self.step_start is None:  # a step starts when its first batch is asked for
                self.step_start = t0
            batch = next(batches, None)
            if batch is None:
                break
            self.batch_in_epoch += 1
            self.meter.record(batch["lengths"], batch["num_tokens"], time.perf_counter() - t0)
            self.token_shapes.add(batch["num_tokens"] // len(batch["lengths"]) if "cu_seqlens" not in batch
                                  else batch["num_tokens"])
            self.bar.update(1)
            yield batch

    def after_step(self, sums: torch.Tensor, micro_batches: int, ends_epoch: bool) -> Due:
        """Account for one optimiser step (the epoch's last if `ends_epoch`); what it makes due."""
        cfg = self.cfg
        self.epoch_sums += sums[:3]
        self.window_loss += sums[3]
        self.window_count += micro_batches
        if self.skips_nonfinite_steps:  # a NaN loss is a skipped step; only a long run of them is a failure
            skipped = self.step_was_skipped().to(self.device)
            self.skipped_in_a_row = torch.where(skipped, self.skipped_in_a_row + 1, 0)
            bad_from = torch.where(self.skipped_in_a_row >= MAX_SKIPPED_STEPS_IN_A_ROW,
                                   self.global_step + 2 - self.skipped_in_a_row, -1)  # the run's first step
        else:
            bad_from = torch.where(torch.isfinite(sums[3]), -1, self.global_step + 1)
        self.first_bad_step = torch.where(self.first_bad_step < 0, bad_from, self.first_bad_step)
        self.global_step += 1
        if self.first_step_s is None:  # includes compilation with --compile
            metrics.synchronize(self.device)
            self.first_step_s = time.perf_counter() - self.epoch_clock
        self.compile_clock.tick(since=self.step_start)
        self.step_start = None
        self.meter.end_step()
        at_log = is_log_step(self.global_step, cfg.log_every)
        # Not on the epoch's last step: the end-of-epoch checkpoint follows, after validation
        # has logged at this same step (a resume from here would log those points twice).
        at_save = cfg.save_every is not None and self.global_step % cfg.save_every == 0 and not ends_epoch
        # Under torchrun, asking all ranks is a collective: only where the host waits anyway.
        stop = at_time = False
        if at_log or at_save or self.dist.world_size == 1:
            stop, at_time = self.stopper.poll(save_due=self.save_by_time_due())
        at_save = at_save or (at_time and not ends_epoch)
        if at_save or stop:
            self.last_save = time.monotonic()
        if at_log or at_save or stop:
            self.check_finite()  # no log line, last.pt or stop after a NaN loss: it fails here
        if not stop:
            return Due(log=at_log, save=at_save)
        return Due(log=at_log, save=True,
                   stop=f"{self.stopper.signal_name} at step {self.global_step}, checkpoint saved; "
                        f"resume with --resume auto --out {shlex.quote(str(Path(self.out_dir).resolve()))}")

    def save_by_time_due(self) -> bool:
        """Rank 0's verdict on --save-every-minutes (the other ranks' clocks do not count: poll agrees it)."""
        minutes = self.cfg.save_every_minutes
        return self.dist.is_main and minutes > 0 and time.monotonic() - self.last_save >= minutes * 60

    def end_epoch(self) -> dict:
        """The epoch's training loss and accuracy over all ranks."""
        self.bar.close()
        self.check_finite()
        self.meter.read()
        sums = distributed.all_reduce_sum(self.epoch_sums.clone()).tolist()
        self.epoch_sums = None
        return {"train_loss": sums[0] / max(sums[2], 1), "train_acc": sums[1] / max(sums[2], 1)}

    # ------------------------------------------------------------------ the epoch clock
    def stop_epoch_clock(self) -> None:
        """Training and validation of the epoch, as the article times it."""
        self.train_time_s += time.perf_counter() - self.epoch_clock
        self.epoch_clock = None

    def elapsed_s(self) -> float:
        """train_time_s including the running epoch so far."""
        return self.train_time_s + (time.perf_counter() - self.epoch_clock if self.epoch_clock else 0.0)

    def next_epoch(self) -> None:
        self.epoch += 1
        self.batch_in_epoch = 0

    def stopped(self, due: Due) -> StopRequested:
        """After last.pt is written for a stop: what ends the run. Status 3 with how to resume, or, after
        SLURM's warning signal in a job that can be requeued, the job requeued and status 0 (slurm.py)."""
        requeued = slurm.requeue_after_stop(self.stopper, self.dist.is_main, distributed.broadcast_object)  # every rank: a collective
        if requeued:  # the job runs again and continues from last.pt
            return Requeued(f"signal {self.stopper.signal_name.removeprefix('SIG')}: saved step "
                            f"{self.global_step}, {requeued}")
        return StopRequested(due.stop)

    # ------------------------------------------------------------------ reading the device
    def check_finite(self) -> None:
        step = int(self.first_bad_step.item())
        if distributed.any_rank(step >= 0, self.device):
            at = f"step {step}" if step >= 0 else "step (another rank)"
            # No advice to change precision: float16 would only hide this (its scaler skips such steps).
            advice = "try a lower --lr or --max-grad-norm"
            if self.skips_nonfinite_steps:
                raise NonFiniteLoss(f"training diverged: the float16 loss scaler skipped {MAX_SKIPPED_STEPS_IN_A_ROW} "
                                    f"steps in a row from {at} (inf/NaN gradients at every scale it tried); {advice}")
            raise NonFiniteLoss(f"training loss became NaN/inf at {at}; no checkpoint was written after it ({advice})")

    def log(self) -> None:
        """The loss over the steps since the last log line (all ranks), the rates, peak memory."""
        loss = (distributed.all_reduce_sum(self.window_loss.clone()).item()
                / (max(self.window_count, 1) * self.dist.world_size))
        self.window_loss.zero_()
        self.window_count = 0
        rates = self.meter.read()
        rates = {k: v * self.dist.world_size if k in metrics.SUMMED_OVER_RANKS else v
                 for k, v in rates.items()}  # rank 0's rate x ranks: all ranks run in lockstep
        self.tracker.scalars({"loss": loss, "lr": self.lr(), **rates,
                              "peak_memory_gb": metrics.peak_memory_bytes(self.device) / 2**30},
                             self.global_step, prefix="train/")
        self.bar.set_postfix(loss=f"{loss:.4f}", **({"samples/s": f"{rates['samples_per_s']:.1f}"} if rates else {}))
        if not self.tracker.progress:  # no bar to show it: one line per log step instead
            self.tracker.print(f"step {self.global_step}: loss {loss:.4f}"
                               + (f" | {rates['samples_per_s']:.1f} samples/s" if rates else "")
                               + (f" | MFU {100 * rates['mfu']:.1f}%" if "mfu" in rates else ""))

    # ------------------------------------------------------------------ resume state
    def progress(self) -> dict:
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch, "global_step": self.global_step,
                "train_time_s": self.elapsed_s(), "first_step_s": self.first_step_s}

    def rank_state(self) -> dict:
        """This rank's running sums: in last.pt, so a resumed run averages and logs as the uninterrupted one."""
        return {
            "epoch_sums": None if self.epoch_sums is None else self.epoch_sums.cpu(),
            "window": None if self.window_loss is None else (self.window_loss.cpu(), self.window_count),
        }
