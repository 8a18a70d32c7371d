"""The articles' LightningModule + Trainer, on fastpt's exact inputs: the Lightning side of the comparison.

scripts/compare_peers.py and the GPU check start it; run it by hand only to look at this side alone.

    python scripts/peers/lightning_ref.py --model minilm --precision bf16 --out runs/peers/lightning
    torchrun --nproc_per_node=2 scripts/peers/lightning_ref.py ... --out runs/peers/lightning-ddp

The training loop is Lightning's: `Trainer.fit` with a best-checkpoint `ModelCheckpoint`
(monitor val_acc), `precision` ("32-true", "bf16-mixed", "16-mixed"), `strategy="ddp"` with
`devices=N` under torchrun, then `Trainer.test(ckpt_path="best")`. What the articles' script
did differently, and why it is changed here so that only the framework differs:
- the data, tokeniser, model, padding and batches are fastpt's (scripts/peers/common.py);
  Lightning's own DistributedSampler is switched off (`use_distributed_sampler=False`) so
  each rank gets exactly fastpt's shard and evaluation counts every review once;
- accuracy is a weighted count reduced over ranks instead of torchmetrics (same numbers);
- no sanity-check validation (`num_sanity_val_steps=0`): fastpt runs none.

`--compile` compiles the model as the articles did, `model = torch.compile(model)` before
`Trainer.fit` (fastpt's `--compile`).

Lightning is needed by this script only: `pip install -r requirements-peers.txt`.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


try:
    import lightning as L
except ModuleNotFoundError:
    print("lightning_ref.py needs Lightning, an extra: pip install -r requirements-peers.txt", file=sys.stderr)
    sys.exit(2)
import common
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from fastpt.monitoring import metrics


PRECISION = {"32": "32-true", "bf16": "bf16-mixed", "16": "16-mixed"}


class LightningModel(L.LightningModule):
    def __init__(self, model, lr: float):
        super().__init__()
        self.model, self.lr = model, lr
        self.eval_sums = None
        self.history: list[dict] = []
        self.test_metrics: dict = {}

    def forward(self, batch):
        return self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self(batch).float(), batch["labels"])
        self.log("train_loss", loss)
        return loss

    def _eval_start(self):
        self.eval_sums = torch.zeros(3, dtype=torch.float64, device=self.device)

    def _eval_step(self, batch):
        self.eval_sums += common.weighted_sums(self(batch), batch)

    def _eval_end(self) -> dict:
        return common.sums_to_metrics(self.trainer.strategy.reduce(self.eval_sums, reduce_op="sum"))

    on_validation_epoch_start = _eval_start
    on_test_epoch_start = _eval_start

    def validation_step(self, batch, batch_idx):
        self._eval_step(batch)

    def test_step(self, batch, batch_idx):
        self._eval_step(batch)

    def on_validation_epoch_end(self):
        val = self._eval_end()
        self.log("val_acc", val["acc"], prog_bar=True)
        self.log("val_loss", val["loss"])
        self.history.append({"epoch": self.current_epoch + 1, "step": self.global_step,
                             "val_loss": val["loss"], "val_acc": val["acc"]})

    def on_test_epoch_end(self):
        self.test_metrics = self._eval_end()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


class TrainTimer(Callback):
    """fastpt's timing window: epoch start -> end of its validation; throughput over training batches."""

    def __init__(self, meter):
        self.meter = meter
        self.train_time_s = 0.0
        self.epoch_start = None
        self.first_step_s = None  # as fastpt's: the first optimiser step, compilation included

    def on_train_epoch_start(self, trainer, pl_module):
        self.epoch_start = time.perf_counter()
        self.meter.start()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        common.record_batch(self.meter, batch)
        self.meter.end_step()
        if self.first_step_s is None:
            metrics.synchronize(self.meter.device)
            self.first_step_s = time.perf_counter() - self.epoch_start

    def on_validation_start(self, trainer, pl_module):
        self.meter.read()  # the training part of the epoch ends here

    def on_validation_end(self, trainer, pl_module):
        # Runs before ModelCheckpoint saves (Lightning moves checkpoint callbacks last),
        # so checkpoint writing is outside the window, as in fastpt.
        self.train_time_s += time.perf_counter() - self.epoch_start
        pl_module.history[-1]["train_time_s"] = self.train_time_s


def main(argv=None) -> int:
    parser = common.build_parser("lightning_ref.py")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model before Trainer.fit")
    args = parser.parse_args(argv)
    rank, world_size = common.rank_and_world()
    model, loaders, _ = common.build_inputs(args, rank, world_size)
    on_cuda = common.use_cuda(args)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if on_cuda else torch.device("cpu")
    meter = common.make_meter(model, device, args.precision)
    timer = TrainTimer(meter)
    out = Path(args.out)
    module = LightningModel(torch.compile(model) if args.compile else model, args.lr)
    trainer = L.Trainer(
        max_epochs=args.epochs,
        accelerator="gpu" if on_cuda else "cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", world_size)),  # per node, as torchrun set it
        num_nodes=world_size // int(os.environ.get("LOCAL_WORLD_SIZE", world_size)),
        strategy="ddp" if world_size > 1 else "auto",
        precision=PRECISION[args.precision],
        callbacks=[ModelCheckpoint(dirpath=out / "checkpoints", monitor="val_acc", mode="max", save_top_k=1),
                   timer],
        logger=CSVLogger(save_dir=out, name="lightning_logs"),
        default_root_dir=out,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, train_dataloaders=loaders["train"], val_dataloaders=loaders["validation"])
    trainer.test(module, dataloaders=loaders["test"], ckpt_path="best", verbose=False)
    if trainer.is_global_zero:
        results = common.write_results(
            out, "lightning", args, test=module.test_metrics, history=module.history,
            train_time_s=timer.train_time_s, meter=meter, world_size=world_size,
            global_steps=trainer.global_step, device=device,
            extra={"lightning": L.__version__, "first_step_s": timer.first_step_s})
        print(f"lightning: test acc {results['test_acc']:.4f} | train time {results['train_time_s']:.1f} s | "
              f"{results['samples_per_s']:.1f} samples/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
