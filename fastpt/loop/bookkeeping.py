"""Everything around the training step that is not the computation, one part per concern.

`step.train_epoch` is the textbook loop; a real run needs these beside it, each its own object:
- `Position`: where the run is (epoch, batch in the epoch, optimiser step), resumable;
- `DeviceSums`: the epoch's metric sums, the loss window since the last log line and the first step
  whose loss was not finite (or, under float16's GradScaler, which skips such steps, the start of
  a long run of skipped steps), kept on the device and read only at log and save steps (a `.item()`
  per step would make the host wait for the device);
- `Clocks`: the epoch clock and training time, the first step's time, the compile clock and the
  throughput meter;
- `DueCheck`: what each step makes due, as an answer to the loop (a `Due`): a log line (at steps
  1, 2, 4, ... until --log-every, then every --log-every steps), last.pt every --save-every steps
  and every --save-every-minutes (10 by default, so a kill -9 loses minutes, not the epoch), and a
  graceful stop after SIGTERM / SIGINT (the stopper, cluster/signals.py);
- the epoch's progress bar (tqdm's, from the tracker: rank 0 draws it).
`Bookkeeping` holds them for the loop and asks them in order after each step; it keeps no count,
sum or clock of its own and calls nothing back: the loop logs (`log`), and train.py writes last.pt
and stops.

Saving by time: rank 0's clock decides, and its verdict rides on the stop check's collective (one
all-reduce of two integers on a gloo group, run at log and save steps under torchrun, at every
step on one process, where it is no collective at all), so every rank saves at the same step and
no step waits for anything more. Under torchrun a save falls due at the first log step after the
interval; a run shorter than the interval never saves by time.

The parts are built from a checkpoint's state when resuming, so a resumed run logs, averages and
times exactly what the uninterrupted run would have.
"""

import shlex
import time
from dataclasses import dataclass
from pathlib import Path

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


@dataclass
class Position:
    """Where the run is, the same on every rank; last.pt's "progress" keeps it."""
    epoch: int = 0
    batch_in_epoch: int = 0  # batches of this epoch's order done (on this number of processes)
    global_step: int = 0  # optimiser steps
    resumed_at_step: int | None = None  # the step a resumed run continued from: its rates leave out the ones before

    @classmethod
    def resumed(cls, progress: dict) -> "Position":
        return cls(progress["epoch"], progress["batch_in_epoch"], progress["global_step"], progress["global_step"])

    def state(self) -> dict:
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch, "global_step": self.global_step}


class DeviceSums:
    """What the loop adds up on the device: read at log and save steps, never once per step."""

    def __init__(self, device: torch.device, rank_state: dict | None = None):
        """`rank_state`: this rank's part of last.pt (`rank_state()`), so a resumed run averages as the first."""
        self.device = device
        epoch, window = (rank_state or {}).get("epoch_sums"), (rank_state or {}).get("window")
        # loss x examples, correct, examples (an older last.pt saved between epochs holds None: zeros)
        self.epoch = torch.zeros(3, dtype=torch.float64, device=device) if epoch is None else epoch.to(device)
        # the steps' losses since the last log, and how many
        self.window_loss, self.window_count = ((window[0].to(device), window[1]) if window
                                               else (torch.zeros((), dtype=torch.float64, device=device), 0))
        self.skipped_in_a_row = torch.zeros((), dtype=torch.long, device=device)
        # -1, or the first step (from 1) whose loss was not finite; a run never goes on past one (check_finite)
        self.first_bad_step = torch.full((), -1, dtype=torch.long, device=device)
        self.scaler_skips = False  # float16's GradScaler skips inf/NaN steps: only a long run of them fails

    def add(self, sums: torch.Tensor, micro_batches: int, step: int, skipped: torch.Tensor | None = None) -> None:
        """One optimiser step's sums (step.metric_sums'); `skipped`: whether float16's scaler skipped the step."""
        self.epoch += sums[:3]
        self.window_loss += sums[3]
        self.window_count += micro_batches
        self.scaler_skips = skipped is not None
        if self.scaler_skips:  # a NaN loss is a skipped step; only a long run of them is a failure
            self.skipped_in_a_row = torch.where(skipped.to(self.device), self.skipped_in_a_row + 1, 0)
            bad_from = torch.where(self.skipped_in_a_row >= MAX_SKIPPED_STEPS_IN_A_ROW,
                                   step + 1 - self.skipped_in_a_row, -1)  # the run's first step
        else:
            bad_from = torch.where(torch.isfinite(sums[3]), -1, step)
        self.first_bad_step = torch.where(self.first_bad_step < 0, bad_from, self.first_bad_step)

    def check_finite(self) -> None:
        """NonFiniteLoss on every rank if any rank's loss was not finite: a host read, and a collective."""
        step = int(self.first_bad_step.item())
        if distributed.any_rank(step >= 0, self.device):
            at = f"step {step}" if step >= 0 else "step (another rank)"
            # No advice to change precision: float16 would only hide this (its scaler skips such steps).
            advice = "try a lower --lr or --max-grad-norm"
            if self.scaler_skips:
                raise NonFiniteLoss(f"training diverged: the float16 loss scaler skipped {MAX_SKIPPED_STEPS_IN_A_ROW} "
                                    f"steps in a row from {at} (inf/NaN gradients at every scale it tried); {advice}")
            raise NonFiniteLoss(f"training loss became NaN/inf at {at}; no checkpoint was written after it ({advice})")

    def read_window(self, world_size: int) -> float:
        """The mean loss over the steps since the last read, over all ranks; the window starts again."""
        loss = distributed.all_reduce_sum(self.window_loss.clone()).item() / (max(self.window_count, 1) * world_size)
        self.window_loss.zero_()
        self.window_count = 0
        return loss

    def read_epoch(self) -> dict:
        """The epoch's training loss and accuracy over all ranks; the next epoch starts from zero."""
        sums = distributed.all_reduce_sum(self.epoch.clone()).tolist()
        self.epoch.zero_()
        return {"train_loss": sums[0] / max(sums[2], 1), "train_acc": sums[1] / max(sums[2], 1)}

    def rank_state(self) -> dict:
        """This rank's running sums: in last.pt, so a resumed run averages and logs as the uninterrupted one."""
        return {"epoch_sums": self.epoch.cpu(), "window": (self.window_loss.cpu(), self.window_count)}


class Clocks:
    """Time: the epoch clock and the training time, the first step's, the compile clock, the throughput meter."""

    def __init__(self, device: torch.device, meter: metrics.Throughput, progress: dict | None = None):
        """`progress`: last.pt's, so a resumed run's training time goes on from the checkpoint's."""
        progress = progress or {}
        self.device, self.meter, self.compile_clock = device, meter, metrics.CompileClock()
        self.token_shapes: set[int] = set()  # distinct batch widths / packed lengths: CUDA graphs record one each
        self.train_time_s = progress.get("train_time_s", 0.0)  # training and validation, as the article times it
        self.first_step_s = progress.get("first_step_s")  # compilation included with --compile
        self.epoch_clock = self.step_start = None  # step_start: when the step's first batch was asked for
        self.peak_reset = False

    def start_epoch(self) -> None:
        if not self.peak_reset:  # the reported peak memory is training's, not model loading's
            metrics.reset_peak_memory(self.device)
            self.peak_reset = True
        self.epoch_clock = time.perf_counter()
        self.meter.start()

    def timed(self, loader):
        """The loader's batches, the wait for each recorded by the meter."""
        batches = iter(loader)
        t0 = time.perf_counter()
        for batch in batches:
            if self.step_start is None:  # a step starts when its first batch is asked for
                self.step_start = t0
            self.meter.record(batch["lengths"], batch["num_tokens"], time.perf_counter() - t0)
            self.token_shapes.add(batch["num_tokens"] // len(batch["lengths"]) if "cu_seqlens" not in batch
                                  else batch["num_tokens"])
            yield batch
            t0 = time.perf_counter()

    def end_step(self) -> None:
        if self.first_step_s is None:
            metrics.synchronize(self.device)
            self.first_step_s = time.perf_counter() - self.epoch_clock
        self.compile_clock.tick(since=self.step_start)
        self.step_start = None
        self.meter.end_step()

    def stop_epoch(self) -> None:
        """Training and validation of the epoch, as the article times it."""
        self.train_time_s += time.perf_counter() - self.epoch_clock
        self.epoch_clock = None

    def elapsed_s(self) -> float:
        """train_time_s including the running epoch so far."""
        return self.train_time_s + (time.perf_counter() - self.epoch_clock if self.epoch_clock else 0.0)

    def state(self) -> dict:
        return {"train_time_s": self.elapsed_s(), "first_step_s": self.first_step_s}


class DueCheck:
    """What a step makes due: a log line, last.pt, a stop. The stopper (cluster/signals.py) is asked here."""

    def __init__(self, cfg, dist, stopper, out_dir: Path):
        self.log_every, self.save_every, self.save_every_minutes = cfg.log_every, cfg.save_every, cfg.save_every_minutes
        self.dist, self.stopper, self.out_dir = dist, stopper, out_dir
        self.last_save = time.monotonic()  # --save-every-minutes counts from here (rank 0's clock decides)

    def after_step(self, step: int, ends_epoch: bool) -> Due:
        at_log = is_log_step(step, self.log_every)
        # Not on the epoch's last step: the end-of-epoch checkpoint follows, after validation
        # has logged at this same step (a resume from here would log those points twice).
        at_save = self.save_every is not None and step % self.save_every == 0 and not ends_epoch
        # Under torchrun, asking all ranks is a collective: only where the host waits anyway.
        stop = at_time = False
        if at_log or at_save or self.dist.world_size == 1:
            stop, at_time = self.stopper.poll(save_due=self.save_by_time_due())
        at_save = at_save or (at_time and not ends_epoch)
        if at_save or stop:
            self.last_save = time.monotonic()
        why = (f"{self.stopper.signal_name} at step {step}, checkpoint saved; resume with --resume auto "
               f"--out {shlex.quote(str(Path(self.out_dir).resolve()))}") if stop else ""
        return Due(log=at_log, save=at_save or stop, stop=why)

    def save_by_time_due(self) -> bool:
        """Rank 0's verdict on --save-every-minutes (the other ranks' clocks do not count: poll agrees it)."""
        minutes = self.save_every_minutes
        return self.dist.is_main and minutes > 0 and time.monotonic() - self.last_save >= minutes * 60

    def stopped(self, due: Due, step: int) -> StopRequested:
        """After last.pt is written for a stop: what ends the run. Status 3 with how to resume, or, after
        SLURM's warning signal in a job that can be requeued, the job requeued and status 0 (slurm.py)."""
        # every rank: a collective
        requeued = slurm.requeue_after_stop(self.stopper, self.dist.is_main, distributed.broadcast_object)
        if requeued:  # the job runs again and continues from last.pt
            return Requeued(f"signal {self.stopper.signal_name.removeprefix('SIG')}: saved step {step}, {requeued}")
        return StopRequested(due.stop)


@dataclass
class Bookkeeping:
    """The parts, for the loop: it asks them through these methods, in the order of a step."""
    position: Position
    sums: DeviceSums
    clocks: Clocks
    due: DueCheck
    tracker: object  # the epoch's bar; TensorBoard's train/ scalars at log steps
    strategy: object  # read, never driven: the step's learning rate, whether float16's scaler skipped it
    epochs: int
    world_size: int
    bar: object = None  # the epoch's progress bar (start_epoch makes it)

    def start_epoch(self, batches_left: int) -> None:
        """Before the epoch's first batch (after a resume: the first one left)."""
        self.clocks.start_epoch()
        done = self.position.batch_in_epoch
        self.bar = self.tracker.bar(done + batches_left, f"epoch {self.position.epoch + 1}/{self.epochs}", initial=done)

    def timed_batches(self, loader):
        """The loader's batches, each counted, timed (the wait for data) and shown on the bar."""
        for batch in self.clocks.timed(loader):
            self.position.batch_in_epoch += 1
            self.bar.update(1)
            yield batch

    def after_step(self, sums: torch.Tensor, micro_batches: int, ends_epoch: bool) -> Due:
        """Account for one optimiser step (the epoch's last if `ends_epoch`); what it makes due."""
        skipped = self.strategy.step_was_skipped() if self.strategy.skips_nonfinite_steps else None
        self.position.global_step += 1
        self.sums.add(sums, micro_batches, self.position.global_step, skipped)
        self.clocks.end_step()
        due = self.due.after_step(self.position.global_step, ends_epoch)
        if due.log or due.save:
            self.sums.check_finite()  # no log line, last.pt or stop after a NaN loss: it fails here
        return due

    def log(self) -> None:
        """The loss over the steps since the last log line (all ranks), the rates, peak memory."""
        loss = self.sums.read_window(self.world_size)
        rates = {k: v * self.world_size if k in metrics.SUMMED_OVER_RANKS else v
                 for k, v in self.clocks.meter.read().items()}  # rank 0's rate x ranks: all ranks run in lockstep
        step, peak_gb = self.position.global_step, metrics.peak_memory_bytes(self.clocks.device) / 2**30
        self.tracker.scalars({"loss": loss, "lr": self.strategy.step_lr, **rates, "peak_memory_gb": peak_gb}, step,
                             "train/")
        self.bar.set_postfix(loss=f"{loss:.4f}", **({"samples/s": f"{rates['samples_per_s']:.1f}"} if rates else {}))
        if not self.tracker.progress:  # no bar to show it: one line per log step instead
            rate = f" | {rates['samples_per_s']:.1f} samples/s" if rates else ""
            mfu = f" | MFU {100 * rates['mfu']:.1f}%" if "mfu" in rates else ""
            self.tracker.print(f"step {step}: loss {loss:.4f}{rate}{mfu}")

    def end_epoch(self) -> dict:
        """The epoch's training loss and accuracy over all ranks."""
        self.bar.close()
        self.sums.check_finite()
        self.clocks.meter.read()
        return self.sums.read_epoch()
