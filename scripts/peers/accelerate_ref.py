"""Hugging Face accelerate's `Accelerator` on fastpt's exact inputs: the accelerate side of the comparison.

scripts/compare_peers.py starts it; run it by hand only to look at this side alone.

    python scripts/peers/accelerate_ref.py --model minilm --precision bf16 --out runs/peers/accelerate
    accelerate launch --num_processes 2 scripts/peers/accelerate_ref.py ... --out runs/peers/accelerate-ddp

The loop is the one accelerate's documentation teaches: `accelerator.prepare(model, optimizer)`
(DDP wrapping and autocast for `mixed_precision`), `accelerator.backward(loss)`,
`accelerator.reduce` for the evaluation sums, `accelerator.save` of the unwrapped model at
each strict improvement of val_acc, and the test on that best checkpoint.

The DataLoaders are fastpt's, already sharded per rank (scripts/peers/common.py), so they are
not passed to `prepare` (which would shard them a second time); batches are moved to
`accelerator.device` by hand, as fastpt does.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator

import common

MIXED_PRECISION = {"32": "no", "bf16": "bf16", "16": "fp16"}


def evaluate(accelerator: Accelerator, model, loader) -> dict:
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=accelerator.device)
    with torch.no_grad():
        for batch in loader:
            batch = common.to_device(batch, accelerator.device)
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            sums += common.weighted_sums(logits, batch)
    model.train()
    return common.sums_to_metrics(accelerator.reduce(sums, reduction="sum"))


def main(argv=None) -> int:
    args = common.build_parser("accelerate_ref.py").parse_args(argv)
    rank, world_size = common.rank_and_world()
    model, loaders, train_sampler = common.build_inputs(args, rank, world_size)
    accelerator = Accelerator(mixed_precision=MIXED_PRECISION[args.precision], cpu=not common.use_cuda(args))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    model, optimizer = accelerator.prepare(model, optimizer)
    meter = common.make_meter(accelerator.unwrap_model(model), accelerator.device, args.precision)
    out = Path(args.out)
    best_path = out / "checkpoints" / "best.pt"
    best_val_acc, history, train_time_s, global_step = None, [], 0.0, 0

    for epoch in range(args.epochs):
        start = time.perf_counter()
        train_sampler.set_epoch(epoch)
        model.train()
        meter.start()
        for batch in loaders["train"]:
            batch = common.to_device(batch, accelerator.device)
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            loss = F.cross_entropy(logits.float(), batch["labels"])
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            global_step += 1
            common.record_batch(meter, batch)
            meter.end_step()
        meter.read()
        val = evaluate(accelerator, model, loaders["validation"])
        train_time_s += time.perf_counter() - start
        history.append({"epoch": epoch + 1, "step": global_step, "val_loss": val["loss"], "val_acc": val["acc"],
                        "train_time_s": train_time_s})
        accelerator.print(f"epoch {epoch + 1}: val acc {val['acc']:.4f} | {train_time_s:.1f} s")
        if best_val_acc is None or val["acc"] > best_val_acc:
            best_val_acc = val["acc"]
            best_path.parent.mkdir(parents=True, exist_ok=True)
            accelerator.wait_for_everyone()
            accelerator.save(accelerator.unwrap_model(model).state_dict(), best_path)

    accelerator.wait_for_everyone()
    accelerator.unwrap_model(model).load_state_dict(torch.load(best_path, map_location="cpu", weights_only=True))
    test = evaluate(accelerator, model, loaders["test"])
    if accelerator.is_main_process:
        results = common.write_results(
            out, "accelerate", args, test=test, history=history, train_time_s=train_time_s, meter=meter,
            world_size=world_size, global_steps=global_step, device=accelerator.device,
            extra={"accelerate": __import__("accelerate").__version__})
        print(f"accelerate: test acc {results['test_acc']:.4f} | train time {results['train_time_s']:.1f} s | "
              f"{results['samples_per_s']:.1f} samples/s")
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
