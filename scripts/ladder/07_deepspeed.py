"""07_deepspeed.py: 06_ddp.py + DeepSpeed ZeRO stage 2 in place of DDP.

The DeepSpeed engine owns backward and the step, and shards the optimiser state and the gradients
over the ranks: each keeps Adam's moments and the reduced gradients of its slice of the parameters
only. With 16-bit precision the engine casts the model itself (no autocast) and keeps float32
master weights. Replaces Lightning's `strategy="deepspeed_stage_2"`; train.py's `--deepspeed`.

    torchrun --nproc_per_node=2 scripts/ladder/07_deepspeed.py --model tiny --data-dir ../shared/data
"""

import argparse
import contextlib  # NEW
import os
import sys
import time
from functools import partial
from pathlib import Path

import deepspeed  # NEW
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for fastpt's utilities
from fastpt.data import prepare_splits  # noqa: E402  tokenised, cached 35k/5k/10k IMDB splits
from fastpt.models import load_model, load_tokenizer  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="distilbert-base-uncased", help="hub id, local folder, 'minilm' or 'tiny'")
    p.add_argument("--random-init", action="store_true", help="random weights (offline)")
    p.add_argument("--data-dir", help="aclImdb_v1.tar.gz's folder")
    p.add_argument("--cache-dir", help="tokenised-split cache")
    for flag, default in {"--max-length": 512, "--batch-size": 12, "--epochs": 3, "--lr": 5e-5, "--seed": 123,
                          "--log-every": 50}.items():
        p.add_argument(flag, type=type(default), default=default)
    for flag in ("--train-size", "--val-size", "--test-size"):
        p.add_argument(flag, type=int, help="use the first N reviews of the split")
    p.add_argument("--max-steps", type=int, help="stop after N steps")
    p.add_argument("--precision", default="16-mixed", choices=("32-true", "16-mixed", "bf16-mixed"))
    p.add_argument("--num-workers", type=int, default=4, help="batch-building processes")
    return p.parse_args()


def collate(items, pad_id, max_length):
    """(tokens, label, weight) items -> tensors, every row padded to max_length."""
    input_ids = torch.full((len(items), max_length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, (tokens, _, _) in enumerate(items):
        input_ids[row, :len(tokens)] = torch.from_numpy(tokens).long()
        attention_mask[row, :len(tokens)] = 1
    labels = torch.tensor([label for _, label, _ in items])
    weights = torch.tensor([weight for _, _, weight in items], dtype=torch.float64)
    return input_ids, attention_mask, labels, weights


@torch.no_grad()  # no graph and no stored activations: less memory and work
def evaluate(model, loader, device, autocast):
    """(loss, accuracy) over a split, summed on the device and read once."""
    model.eval()  # dropout off
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, reviews; a weight 0 counts none
    for batch in loader:
        input_ids, attention_mask, labels, weights = (t.to(device, non_blocking=True) for t in batch)
        with autocast():  # evaluate the model as it trains
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        losses = F.cross_entropy(logits.float(), labels, reduction="none").double()
        correct = (logits.argmax(-1) == labels).double()
        sums += torch.stack([(losses * weights).sum(), (correct * weights).sum(), weights.sum()])
    dist.all_reduce(sums)  # every rank gets the sums over the whole split
    model.train()
    return (sums[:2] / sums[2]).tolist()


def main():
    args = parse_args()
    rank, local_rank, world_size = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before the group exists, so that NCCL binds each rank to its GPU
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")  # rendezvous from torchrun's env
    print0 = partial(print, flush=True) if rank == 0 else lambda *args, **kwargs: None
    torch.manual_seed(args.seed)  # the same initial weights in every run
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model, args.random_init)
    if rank == 0:  # rank 0 tokenises and caches the splits first; the others read its cache
        prepare_splits(args.data_dir, args.cache_dir, tokenizer, args.max_length)
    dist.barrier()
    splits, _ = prepare_splits(args.data_dir, args.cache_dir, tokenizer, args.max_length)
    train_set, val_set, test_set = (splits[name].head(size) for name, size in (
        ("train", args.train_size), ("validation", args.val_size), ("test", args.test_size)))
    collate_fn = partial(collate, pad_id=tokenizer.pad_token_id or 0, max_length=args.max_length)

    def make_loader(split, **kwargs):
        # Its own generator: iter(loader) draws a seed, which from the global one would shift dropout masks.
        return DataLoader(split, batch_size=args.batch_size, collate_fn=collate_fn,
                          num_workers=args.num_workers, persistent_workers=args.num_workers > 0,
                          pin_memory=device.type == "cuda",  # page-locked, so that the copy can be async
                          generator=torch.Generator().manual_seed(args.seed), **kwargs)

    def rank_share(split):  # every review on one rank; weight-0 repeats give all ranks as many batches
        padded = -(-len(split) // world_size) * world_size
        return [(i % len(split), float(i < len(split))) for i in range(rank, padded, world_size)]

    train_loader = make_loader(train_set, sampler=DistributedSampler(train_set, seed=args.seed), drop_last=True)
    val_loader, test_loader = (make_loader(s, sampler=rank_share(s)) for s in (val_set, test_set))

    model.to(device)
    amp_dtype = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}.get(args.precision)
    autocast = contextlib.nullcontext  # NEW: the engine casts the model to float16 or bfloat16 itself
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, fused=device.type == "cuda")
    ds_config = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": args.batch_size,  # NEW
                 "train_batch_size": args.batch_size * world_size,  # NEW: micro batch x ranks, no accumulation
                 "fp16": {"enabled": amp_dtype == torch.float16},  # NEW: with dynamic loss scaling
                 "bf16": {"enabled": amp_dtype == torch.bfloat16}}  # NEW
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)  # NEW
    torch.manual_seed(args.seed + rank)  # different dropout masks on each rank

    step, t0 = 0, time.perf_counter()
    best_val_acc, best_epoch, best_state = -1.0, None, None
    for epoch in range(args.epochs):
        train_loader.sampler.set_epoch(epoch)  # reshuffled by (seed, epoch), then split over the ranks
        window_loss, window_start = torch.zeros((), dtype=torch.float64, device=device), step  # since the last print
        for batch in train_loader:
            input_ids, attention_mask, labels, _ = (t.to(device, non_blocking=True) for t in batch)
            with autocast():
                logits = engine(input_ids=input_ids, attention_mask=attention_mask).logits  # NEW
            loss = F.cross_entropy(logits.float(), labels)
            engine.backward(loss)  # NEW: scales the float16 loss; reduce-scatters the gradients
            engine.step()  # NEW: unscales (float16), steps on this rank's slice, gathers the weights, zeroes grads
            step += 1
            window_loss += loss.detach().double()  # on the device: .item() would wait for the GPU every step
            if step % args.log_every == 0:
                dist.all_reduce(window_loss)  # every rank joins; rank 0 prints the mean over ranks
                print0(f"step {step} loss {window_loss.item() / ((step - window_start) * world_size)!r}")
                window_loss, window_start = torch.zeros_like(window_loss), step
            if step == args.max_steps:
                break
        val_loss, val_acc = evaluate(model, val_loader, device, autocast)
        print0(f"epoch {epoch + 1}: val loss {val_loss:.4f} acc {val_acc:.4f}, {time.perf_counter() - t0:.1f} s")
        if val_acc > best_val_acc:  # strictly better, so a tie keeps the earlier epoch
            best_val_acc, best_epoch = val_acc, epoch + 1
            best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}  # a copy, not a view
        if step == args.max_steps:
            break
    model.load_state_dict(best_state)
    test_loss, test_acc = evaluate(model, test_loader, device, autocast)
    print0(f"test (best epoch {best_epoch}): loss {test_loss:.4f} acc {test_acc:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
