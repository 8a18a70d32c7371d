"""The floor: a bare PyTorch training loop on the same inputs, to measure each framework's per-step overhead.

scripts/compare_peers.py starts it; run it by hand only to look at this side alone.

    python scripts/peers/bare_loop.py --model tiny --precision bf16 --out runs/peers/bare

No validation, no checkpoints, no logging: only what every training step must do. One
epoch (or --epochs) of fastpt's batches, timed with fastpt's throughput meter (same warm-up,
same window), so `samples_per_s` here is directly comparable with fastpt's and the peers'.
Single process only.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import common


def main(argv=None) -> int:
    args = common.build_parser("bare_loop.py").parse_args(argv)
    model, loaders, sampler = common.build_inputs(args, 0, 1)
    device = torch.device("cuda" if common.use_cuda(args) else "cpu")
    model, meter = model.to(device), common.make_meter(model, device, args.precision)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    dtype = {"bf16": torch.bfloat16, "16": torch.float16}.get(args.precision)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    autocast = (lambda: torch.autocast(device.type, dtype=dtype)) if dtype else contextlib.nullcontext
    start, steps = time.perf_counter(), 0
    # ---- the loop: 15 lines -------------------------------------------------------------
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        meter.start()
        for batch in loaders["train"]:
            batch = common.to_device(batch, device)
            with autocast():
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            loss = F.cross_entropy(logits.float(), batch["labels"])
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            common.record_batch(meter, batch)
            meter.end_step()
            steps += 1
        meter.read()
    # --------------------------------------------------------------------------------------
    results = common.write_results(Path(args.out), "bare", args, test={"acc": None, "loss": None, "n": 0},
                                   history=[], train_time_s=time.perf_counter() - start, meter=meter,
                                   world_size=1, global_steps=steps, device=device)
    print(f"bare loop: {steps} steps | {results['samples_per_s']:.1f} samples/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
