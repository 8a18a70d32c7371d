"""The training loop: what Lightning's `Trainer.fit` + `Trainer.test` do, written out.

    for epoch:                                   # resumable from any optimiser step
        for batch in train_loader:               # rank's shard, fixed order per (seed, epoch)
            forward under autocast -> loss / grad_accum -> backward
            every grad_accum batches: (unscale, clip) step, zero_grad
            every log_every steps: read the device-side sums, log
            every save_every steps: checkpoints/last.pt
        validate (no_grad, all ranks) -> best.pt on strict improvement -> early stopping
    test on best.pt (or the last weights) -> results.json

Which strategy runs (single device, DDP, FSDP, DeepSpeed) is hidden behind `Strategy`; which
speed-ups are on is decided by the config alone. Nothing in the hot loop reads a value back
from the GPU: losses and correct counts are summed on the device and read at log steps.
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from fastpt import checkpoint, data, distributed, metrics
from fastpt.config import TrainConfig
from fastpt.early_stopping import BestTracker, EarlyStopping
from fastpt.evaluation import evaluate, forward_logits
from fastpt.models import count_parameters, load_model, load_tokenizer
from fastpt.signals import GracefulStop, StopRequested
from fastpt.strategies import build_strategy
from fastpt.tracking import NullTracker, Tracker

WARMUP_STEPS = 3  # left out of throughput: allocator warm-up, compilation, autotuning


class NonFiniteLoss(RuntimeError):
    """The training loss became NaN or infinite (outside float16 AMP, where the scaler handles it)."""


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict:
    np_state = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict) -> None:
    random.setstate(_as_tuple(state["python"]))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy(), *rest))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuple(x):
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


class Trainer:
    def __init__(self, cfg: TrainConfig, dist: distributed.DistInfo, out_dir: Path):
        self.cfg, self.dist, self.out_dir = cfg, dist, out_dir
        self.device = dist.device
        self.ckpt_dir = out_dir / "checkpoints"
        self.non_blocking = self.device.type == "cuda"
        self.global_step = 0
        self.epoch = 0
        self.batch_in_epoch = 0
        self.train_time_s = 0.0
        self.history: list[dict] = []
        self.epoch_sums = None
        self.first_step_s = None
        self.early_stopping = (EarlyStopping(cfg.monitor_mode, cfg.early_stopping_patience, cfg.min_delta)
                               if cfg.early_stopping_patience else None)
        self.best = BestTracker(cfg.monitor_mode)
        self.stopper = GracefulStop()
        self._resumed_window = None

    # ------------------------------------------------------------------ building
    def load_inputs(self) -> None:
        """Tokenizer, model and data: everything bad input can break, read before the run folder
        is touched (run.py calls this first, so a bad --model or --data-dir writes nothing)."""
        cfg, dist = self.cfg, self.dist
        self._configure_backends()
        seed_everything(cfg.seed)  # identical initial weights on every rank (FSDP does not broadcast)
        tokenizer = load_tokenizer(cfg.model)
        self.initial_model = load_model(cfg.model, cfg.random_init, cfg.attn_implementation)
        splits, self.cache_path = data.prepare_splits(cfg.data_dir, cfg.cache_dir, tokenizer, cfg.max_length,
                                                      is_main=dist.is_main, share=distributed.broadcast_object)
        self.splits = {
            "train": splits["train"].head(cfg.train_size),
            "validation": splits["validation"].head(cfg.val_size),
            "test": splits["test"].head(cfg.test_size),
        }
        self._build_loaders(tokenizer.pad_token_id or 0)

    def build(self) -> None:
        cfg, dist = self.cfg, self.dist
        if not hasattr(self, "splits"):
            self.load_inputs()
        model, self.initial_model = self.initial_model, None  # the strategy holds it from here on
        self.tracker = (Tracker(self.out_dir, cfg.progress, cfg.tensorboard, purge_step=self._resume_step())
                        if dist.is_main else NullTracker())
        self.tracker.print(f"data: {self.cache_path} | train {len(self.splits['train'])}, "
                           f"validation {len(self.splits['validation'])}, test {len(self.splits['test'])}")
        n_params, n_matmul = count_parameters(model)
        layers, hidden = metrics.model_shape(model)
        self.strategy = build_strategy(cfg, dist)
        self.strategy.setup(model)
        torch.manual_seed(cfg.seed + dist.rank)  # different dropout masks per rank
        peak = metrics.device_peak_flops(self.device, cfg.amp, cfg.tf32)
        self.meter = metrics.Throughput(self.device, WARMUP_STEPS,
                                        lambda seq: metrics.flops_per_token(n_matmul, layers, hidden, seq), peak)
        self.tracker.print(f"model: {cfg.model} ({n_params / 1e6:.1f}M parameters) | strategy: {self.strategy.name} "
                           f"x{dist.world_size} on {self.device} | amp: {cfg.amp_dtype if cfg.amp else 'off'} | "
                           f"compile: {cfg.compile} | bucket: {cfg.bucket}")
        self.tracker.text("config", cfg.to_json())

    def _configure_backends(self) -> None:
        cfg = self.cfg
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
            torch.backends.cudnn.allow_tf32 = cfg.tf32
            torch.backends.cudnn.benchmark = not cfg.deterministic
        if cfg.deterministic:
            # The article measured this costs time; it buys bitwise-repeatable runs.
            torch.use_deterministic_algorithms(True)  # process-wide: fit() turns it back off

    def _build_loaders(self, pad_id: int) -> None:
        cfg, dist = self.cfg, self.dist
        on_cuda = self.device.type == "cuda"
        workers = cfg.num_workers if cfg.num_workers is not None else data.default_num_workers(on_cuda, dist.local_world_size)
        pin = cfg.pin_memory if cfg.pin_memory is not None else on_cuda
        collate = data.Collator(pad_id, cfg.pad_to, cfg.max_length)
        self.train_sampler = data.TrainBatchSampler(self.splits["train"], cfg.batch_size, dist.rank, dist.world_size,
                                                    cfg.seed, cfg.bucket, cfg.bucket_multiplier)
        if len(self.train_sampler) == 0:
            raise ValueError(f"{len(self.splits['train'])} training examples over {dist.world_size} process(es) "
                             f"make no full batch of {cfg.batch_size}")
        self.train_loader = data.make_loader(self.splits["train"], self.train_sampler, collate, workers, pin, cfg.seed)
        self.eval_loaders = {
            name: data.make_loader(self.splits[name],
                                   data.EvalBatchSampler(self.splits[name], cfg.batch_size, dist.rank,
                                                         dist.world_size, sort_by_length=cfg.pad_to == "longest"),
                                   collate, workers, pin, cfg.seed)
            for name in ("validation", "test")
        }
        self.num_workers, self.pin_memory = workers, pin

    # ------------------------------------------------------------------ training
    def fit(self) -> dict:
        cfg = self.cfg
        self.build()
        self.stopper.install()
        try:
            self._maybe_resume()
            stopped_early = self.early_stopping is not None and self.early_stopping.stopped
            while self.epoch < cfg.epochs and not stopped_early and not self._max_steps_reached():
                self.epoch_start = time.perf_counter()
                train_metrics = self._train_epoch()
                val = self._evaluate("validation")
                self.train_time_s += time.perf_counter() - self.epoch_start
                stopped_early = self._end_of_epoch(train_metrics, val)
            results = self._test_and_report(stopped_early)
        finally:
            if self.cfg.deterministic:
                torch.use_deterministic_algorithms(False)
            self.stopper.uninstall()
            self.strategy.close()
            self.tracker.close()
        return results

    def _max_steps_reached(self) -> bool:
        return self.cfg.max_steps is not None and self.global_step >= self.cfg.max_steps

    def _train_epoch(self) -> dict:
        cfg, strategy = self.cfg, self.strategy
        self.train_sampler.set_epoch(self.epoch, self.batch_in_epoch)
        n_batches = len(self.train_sampler) + self.batch_in_epoch
        if self.epoch_sums is None:
            self.epoch_sums = torch.zeros(3, dtype=torch.float64, device=self.device)  # loss sum, correct, seen
        strategy.train()
        bar = self.tracker.bar(n_batches, f"epoch {self.epoch + 1}/{cfg.epochs}", initial=self.batch_in_epoch)
        window_loss, window_count = (self._resumed_window  # losses since the last log line
                                     or (torch.zeros((), dtype=torch.float64, device=self.device), 0))
        self._resumed_window = None
        first_bad_step = torch.full((), -1, dtype=torch.long, device=self.device)
        self.meter.start()
        epoch_start = time.perf_counter()
        loader = iter(self.train_loader)
        while True:
            t0 = time.perf_counter()
            batch = next(loader, None)
            if batch is None:
                break
            data_s = time.perf_counter() - t0
            real_tokens = int(batch["attention_mask"].sum())  # counted on the host: no GPU sync
            batch = {k: v.to(self.device, non_blocking=self.non_blocking) for k, v in batch.items()}
            self.batch_in_epoch += 1
            last_micro = self.batch_in_epoch % cfg.grad_accum == 0 or self.batch_in_epoch == n_batches
            # The epoch's last accumulation group may be short: average over the batches it has.
            group_start = (self.batch_in_epoch - 1) // cfg.grad_accum * cfg.grad_accum
            group_size = min(cfg.grad_accum, n_batches - group_start)
            with strategy.no_sync(skip=not last_micro):
                logits = forward_logits(strategy, batch)
                loss = F.cross_entropy(logits.float(), batch["labels"])
                strategy.backward(loss / group_size)
            detached = loss.detach().double()
            size = batch["labels"].shape[0]
            # Python numbers enter as kernel arguments: torch.tensor(x, device="cuda") would copy
            # from the host and synchronise on every step.
            self.epoch_sums[:2] += torch.stack([detached * size, (logits.argmax(-1) == batch["labels"]).sum().double()])
            self.epoch_sums[2] += size
            window_loss += detached
            window_count += 1
            if not self.strategy.precision.scaler.is_enabled():
                first_bad_step = torch.where((first_bad_step < 0) & ~torch.isfinite(detached),
                                             self.global_step + 1, first_bad_step)
            self.meter.record(size, real_tokens, batch["input_ids"].numel(), batch["input_ids"].shape[1], data_s)
            bar.update(1)
            if not last_micro:
                continue
            strategy.step()
            self.global_step += 1
            if self.global_step == 1:  # includes compilation with --compile
                metrics.synchronize(self.device)
                self.first_step_s = time.perf_counter() - epoch_start
            self.meter.end_step()
            at_log = self.global_step % cfg.log_every == 0
            # Not on the epoch's last step: the end-of-epoch checkpoint follows, after validation
            # has logged at this same step (a resume from here would log those points twice).
            epoch_ends = self.batch_in_epoch == n_batches or self._max_steps_reached()
            at_save = cfg.save_every is not None and self.global_step % cfg.save_every == 0 and not epoch_ends
            if at_log or at_save:
                self._check_finite(first_bad_step)
            if at_log:
                self._log_step(window_loss, window_count, bar)
                window_loss.zero_()
                window_count = 0
            if at_save:
                self.save_last(window=(window_loss, window_count))
            if self.stopper.requested():
                # Finish the step, keep it, then leave: never lose more than the step in flight.
                if not at_save:
                    self._check_finite(first_bad_step)
                    self.save_last(window=(window_loss, window_count))
                raise StopRequested(f"{self.stopper.signal_name} at step {self.global_step}, checkpoint saved; "
                                    f"resume with --resume auto --out {self.out_dir}")
            if self._max_steps_reached():
                break
        bar.close()
        self._check_finite(first_bad_step)
        self.meter.read()
        sums = distributed.all_reduce_sum(self.epoch_sums.clone()).tolist()
        self.epoch_sums = None
        return {"train_loss": sums[0] / max(sums[2], 1), "train_acc": sums[1] / max(sums[2], 1)}

    def _check_finite(self, first_bad_step: torch.Tensor) -> None:
        step = int(first_bad_step.item())
        if distributed.any_rank(step >= 0, self.device):
            raise NonFiniteLoss(f"training loss became NaN/inf at step {step if step >= 0 else '(another rank)'}; "
                                f"no checkpoint was written after it (try --amp, a lower --lr or --max-grad-norm)")

    def _log_step(self, window_loss: torch.Tensor, window_count: int, bar) -> None:
        loss = distributed.all_reduce_sum(window_loss.clone()).item() / (max(window_count, 1) * self.dist.world_size)
        rates = self.meter.read()
        rates = {k: v * self.dist.world_size if k in ("samples_per_s", "tokens_per_s", "padded_tokens_per_s") else v
                 for k, v in rates.items()}  # rank 0's rate x ranks: all ranks run in lockstep
        self.tracker.scalars({"loss": loss, "lr": self.strategy.optimizer.param_groups[0]["lr"],
                              **rates}, self.global_step, prefix="train/")
        bar.set_postfix(loss=f"{loss:.4f}", **({"samples/s": f"{rates['samples_per_s']:.1f}"} if rates else {}))
        if not self.tracker.progress:  # no bar to show it: one line per log step instead
            self.tracker.print(f"step {self.global_step}: loss {loss:.4f}"
                               + (f" | {rates['samples_per_s']:.1f} samples/s" if rates else ""))

    def _evaluate(self, split: str) -> dict:
        loader = self.eval_loaders[split]
        bar = self.tracker.bar(len(loader), f"{split}")
        out = evaluate(self.strategy, loader, self.device, self.non_blocking, bar)
        bar.close()
        return out

    def _end_of_epoch(self, train_metrics: dict, val: dict) -> bool:
        cfg = self.cfg
        row = {"epoch": self.epoch + 1, "step": self.global_step, **train_metrics,
               "val_loss": val["loss"], "val_acc": val["acc"], "train_time_s": self.train_time_s}
        monitored = row[cfg.monitor]
        improved = self.best.update(monitored, self.epoch + 1)
        if improved:
            self.save_best(monitored)
        stop = self.early_stopping.update(monitored) if self.early_stopping else False
        self.history.append(row)
        self.tracker.scalars({k: v for k, v in row.items() if k not in ("epoch", "step")}, self.global_step, "epoch/")
        self.tracker.print(f"epoch {self.epoch + 1}: train loss {row['train_loss']:.4f} acc {row['train_acc']:.4f} | "
                           f"val loss {val['loss']:.4f} acc {val['acc']:.4f}{' (best)' if improved else ''} | "
                           f"{self.train_time_s:.1f} s")
        if stop:
            self.tracker.print(f"early stopping: {self.early_stopping.reason}")
        self.epoch += 1
        self.batch_in_epoch = 0
        if self.cfg.save_every is not None:
            self.save_last()
        return stop

    # ------------------------------------------------------------------ checkpoints
    def save_best(self, value: float) -> None:
        state = self.strategy.model_state_dict()  # a collective where the model is sharded
        if self.dist.is_main:
            checkpoint.save_atomic({"model": state, "config": self.cfg.to_dict(), "epoch": self.epoch + 1,
                                    "step": self.global_step, "monitor": self.cfg.monitor, "value": value},
                                   self.ckpt_dir / "best.pt")

    def save_last(self, window: tuple | None = None) -> None:
        """checkpoints/last.pt: everything needed to continue exactly from this step.

        Per rank: the RNG states (dropout masks), the running sums of the epoch's training
        metrics and the loss window since the last log line, so a resumed run logs, averages
        and draws exactly what the uninterrupted run would have.
        """
        training = self.strategy.training_state(self.ckpt_dir)
        window_loss, window_count = window if window is not None else (None, 0)
        mine = checkpoint.to_bytes({
            "rng": rng_state(),
            "epoch_sums": None if self.epoch_sums is None else self.epoch_sums.cpu(),
            "window": None if window_loss is None else (window_loss.cpu(), window_count),
        })
        per_rank = [checkpoint.from_bytes(b) for b in distributed.all_gather_object(mine)]
        if not self.dist.is_main:
            return
        # Mid-epoch, the epoch's time so far is not in train_time_s yet (fit adds it at the end).
        elapsed = self.train_time_s + (time.perf_counter() - self.epoch_start if self.batch_in_epoch else 0.0)
        state = {
            "config": self.cfg.to_dict(),
            "world_size": self.dist.world_size,
            "training": training,
            "progress": {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch, "global_step": self.global_step,
                         "train_time_s": elapsed, "first_step_s": self.first_step_s},
            "early_stopping": self.early_stopping.state_dict() if self.early_stopping else None,
            "best": self.best.state_dict(),
            "history": self.history,
            "per_rank": per_rank,
        }
        checkpoint.save_atomic(state, self.ckpt_dir / "last.pt")

    def _resume_step(self):
        """TensorBoard's purge_step: drop what a killed run logged after its checkpoint.

        Everything up to and including the checkpoint's step was logged before it was saved,
        so the resumed run's first new event is at step + 1.
        """
        return self.resume_state["progress"]["global_step"] + 1 if getattr(self, "resume_state", None) else None

    def _maybe_resume(self) -> None:
        state = getattr(self, "resume_state", None)
        if state is None:
            return
        self.strategy.load_training_state(state["training"], self.ckpt_dir)
        p = state["progress"]
        self.epoch, self.batch_in_epoch, self.global_step = p["epoch"], p["batch_in_epoch"], p["global_step"]
        self.train_time_s, self.first_step_s = p["train_time_s"], p["first_step_s"]
        if self.early_stopping and state["early_stopping"]:
            self.early_stopping.load_state_dict(state["early_stopping"])
        self.best.load_state_dict(state["best"])
        self.history = list(state["history"])
        mine = state["per_rank"][self.dist.rank]
        set_rng_state(mine["rng"])
        self.epoch_sums = None if mine["epoch_sums"] is None else mine["epoch_sums"].to(self.device)
        if mine.get("window") is not None:
            window_loss, window_count = mine["window"]
            self._resumed_window = (window_loss.to(self.device), window_count)
        self.tracker.print(f"resumed from step {self.global_step} (epoch {self.epoch + 1}, batch {self.batch_in_epoch})")

    # ------------------------------------------------------------------ test and results
    def _test_and_report(self, stopped_early: bool) -> dict:
        cfg = self.cfg
        tested_on = cfg.test_on
        best_path = self.ckpt_dir / "best.pt"
        if cfg.test_on == "best":
            if distributed.broadcast_object(best_path.exists()):
                self.strategy.load_model_state_dict(checkpoint.load_model_weights(best_path))
            else:
                tested_on = "last (no best checkpoint)"
        test = self._evaluate("test")
        totals = self.meter.rates()
        scale = self.dist.world_size
        results = {
            "test_acc": test["acc"], "test_loss": test["loss"], "test_examples": test["n"], "tested_on": tested_on,
            "best_val_acc": max((h["val_acc"] for h in self.history), default=None),
            "best_monitor": self.best.best, "monitor": cfg.monitor, "best_epoch": self.best.best_epoch,
            "epochs_run": len(self.history), "global_steps": self.global_step,
            "stopped_early": stopped_early,
            "stop_reason": self.early_stopping.reason if stopped_early and self.early_stopping else "",
            "train_time_s": self.train_time_s,
            "first_step_s": self.first_step_s,
            "samples_per_s": totals.get("samples_per_s", 0.0) * scale,
            "tokens_per_s": totals.get("tokens_per_s", 0.0) * scale,
            "padded_tokens_per_s": totals.get("padded_tokens_per_s", 0.0) * scale,
            "padding_efficiency": totals.get("padding_efficiency"),
            "data_wait_share": totals.get("data_wait_share"),
            "mfu": totals.get("mfu"),
            "peak_memory_bytes": metrics.peak_memory_bytes(self.device),
            "memory_per_rank": distributed.all_gather_object(self.strategy.memory_report()),  # list, by rank
            "strategy": self.strategy.name, "world_size": self.dist.world_size, "device": str(self.device),
            "device_name": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
            "num_workers": self.num_workers, "pin_memory": self.pin_memory,
            "history": self.history,
            "torch": torch.__version__,
        }
        self.tracker.print(f"test ({tested_on}): loss {test['loss']:.4f} acc {test['acc']:.4f} on {test['n']} reviews | "
                           f"train time {self.train_time_s / 60:.2f} min | {results['samples_per_s']:.1f} samples/s")
        self.tracker.scalars({"test_acc": test["acc"], "test_loss": test["loss"]}, self.global_step, "test/")
        self.tracker.scalars({f"rank{r}/{k}": v for r, m in enumerate(results["memory_per_rank"]) for k, v in m.items()},
                             self.global_step, "memory/")
        self.tracker.hparams(cfg.to_dict(), {k: results[k] for k in ("test_acc", "test_loss", "best_val_acc",
                                                                     "train_time_s", "samples_per_s")
                                             if results[k] is not None})
        self.tracker.write_json("results.json", results)
        return results
