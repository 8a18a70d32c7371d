"""06_ddp.py: 05_data_loading.py + DistributedDataParallel over the processes torchrun starts.

Each process trains a full copy of the model on its own shard of every epoch; in backward, DDP
all-reduces (averages) the gradients bucket by bucket, overlapping the rest of backward, so all
copies take the same step. Replaces Lightning's `strategy="ddp"`; train.py's `--ddp`.

    torchrun --nproc_per_node=2 scripts/ladder/06_ddp.py --model tiny --data-dir ../shared/data
"""

import argparse
import os  # [06]
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist  # [06]
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel  # [06]
from torch.utils.data import DataLoader, Dataset, DistributedSampler  # [06]

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for fastpt's utilities
from fastpt.inputs.token_cache import prepare_splits  # noqa: E402  tokenised, cached 35k/5k/10k IMDB splits
from fastpt.inputs.models import load_model, load_tokenizer  # noqa: E402


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
    p.add_argument("--precision", default="16-mixed", choices=("32-true", "16-mixed", "bf16-mixed"))  # [03]
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)  # [04]
    p.add_argument("--num-workers", type=int, default=4, help="batch-building processes")  # [05]
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


class RankShare(Dataset):  # [06] one rank's share of a split: reviews rank, rank + N, rank + 2N, ...
    def __init__(self, split, rank, world_size):  # [06] places up to a multiple of N: all ranks run as many batches
        self.split, self.places = split, range(rank, -(-len(split) // world_size) * world_size, world_size)  # [06]

    def __len__(self):  # [06]
        return len(self.places)  # [06]

    def __getitem__(self, i):  # [06]
        tokens, label, _ = self.split[self.places[i] % len(self.split)]  # [06]
        return tokens, label, float(self.places[i] < len(self.split))  # [06] past the end: a repeat, weight 0


@torch.no_grad()  # no graph and no stored activations: less memory and work
def evaluate(model, loader, device, autocast):  # [03]
    """(loss, accuracy) over a split, summed on the device and read once."""
    model.eval()  # dropout off
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, reviews; a weight 0 counts none
    for batch in loader:
        input_ids, attention_mask, labels, weights = (t.to(device, non_blocking=True) for t in batch)  # [05]
        with autocast():  # [03] evaluate the model as it trains
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # [03]
        losses = F.cross_entropy(logits.float(), labels, reduction="none").double()
        correct = (logits.argmax(-1) == labels).double()
        sums += torch.stack([(losses * weights).sum(), (correct * weights).sum(), weights.sum()])
    dist.all_reduce(sums)  # [06] every rank gets the sums over the whole split
    model.train()
    return (sums[:2] / sums[2]).tolist()


def main():
    args = parse_args()
    if "RANK" not in os.environ:  # [06] torchrun sets RANK, LOCAL_RANK and WORLD_SIZE in each process it starts
        print(f"start it with torchrun: torchrun --nproc_per_node=2 {' '.join(sys.argv)}", file=sys.stderr)  # [06]
        sys.exit(2)  # [06]
    rank, local_rank, world_size = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))  # [06]
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")  # [06]
    if device.type == "cuda":  # [06]
        torch.cuda.set_device(device)  # [06] before the group exists, so that NCCL binds each rank to its GPU
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")  # [06] rendezvous from torchrun's env
    print0 = partial(print, flush=True) if rank == 0 else lambda *args, **kwargs: None  # [06]
    torch.manual_seed(args.seed)  # the same initial weights in every run
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model, args.random_init)
    if rank == 0:  # [06] rank 0 tokenises and caches the splits first; the others read its cache
        prepare_splits(args.data_dir, args.cache_dir, tokenizer, args.max_length)  # [06]
    dist.barrier()  # [06]
    splits, _ = prepare_splits(args.data_dir, args.cache_dir, tokenizer, args.max_length)
    train_set, val_set, test_set = (splits[name].head(size) for name, size in (
        ("train", args.train_size), ("validation", args.val_size), ("test", args.test_size)))
    collate_fn = partial(collate, pad_id=tokenizer.pad_token_id or 0, max_length=args.max_length)

    def make_loader(split, **kwargs):
        # Its own generator: iter(loader) draws a seed, which from the global one would shift dropout masks.
        return DataLoader(split, batch_size=args.batch_size, collate_fn=collate_fn,
                          num_workers=args.num_workers, persistent_workers=args.num_workers > 0,  # [05]
                          pin_memory=device.type == "cuda",  # [05] page-locked, so that the copy can be async
                          generator=torch.Generator().manual_seed(args.seed), **kwargs)

    train_sampler = DistributedSampler(train_set, seed=args.seed, drop_last=True)  # [06] no padding: train.py's steps
    train_loader = make_loader(train_set, sampler=train_sampler, drop_last=True)  # [06]
    val_loader, test_loader = (make_loader(RankShare(s, rank, world_size)) for s in (val_set, test_set))  # [06]

    model.to(device)
    amp_dtype = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}.get(args.precision)  # [03]
    autocast = partial(torch.autocast, device.type, dtype=amp_dtype, enabled=amp_dtype is not None)  # [03]
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)  # [03] off, it passes through
    if args.compile:  # [04]
        # [04] On a CPU, Inductor draws dropout masks with eager's bernoulli_ (faster there than its own
        # [04] in-kernel random numbers), so the compiled model draws the masks the eager one would.
        torch._inductor.config.fallback_random = device.type == "cpu"  # [04]
        model.compile()  # [04] in place: the same module and state_dict keys, its forward compiled
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, fused=device.type == "cuda")
    ddp_model = DistributedDataParallel(model, device_ids=[local_rank] if device.type == "cuda" else None)  # [06]
    torch.manual_seed(args.seed + rank)  # [06] different dropout masks on each rank

    step, t0 = 0, time.perf_counter()
    best_val_acc, best_epoch, best_state = -1.0, None, None  # [02]
    for epoch in range(args.epochs):
        train_loader.sampler.set_epoch(epoch)  # [06] reshuffled by (seed, epoch), then split over the ranks
        window_loss, window_start = torch.zeros((), dtype=torch.float64, device=device), step  # since the last print
        for batch in train_loader:
            input_ids, attention_mask, labels, _ = (t.to(device, non_blocking=True) for t in batch)  # [05]
            with autocast():  # [03]
                logits = ddp_model(input_ids=input_ids, attention_mask=attention_mask).logits  # [06]
            loss = F.cross_entropy(logits.float(), labels)
            scaler.scale(loss).backward()  # [03] loss x scale, so small float16 gradients do not underflow
            scaler.step(optimizer)  # [03] unscales the gradients; skips the step if any is inf or NaN
            scaler.update()  # [03] a smaller scale after an overflow, a larger one after many good steps
            optimizer.zero_grad(set_to_none=True)
            step += 1
            window_loss += loss.detach().double()  # on the device: .item() would wait for the GPU every step
            if step % args.log_every == 0:
                dist.all_reduce(window_loss)  # [06] every rank joins; rank 0 prints the mean over ranks
                print0(f"step {step} loss {window_loss.item() / ((step - window_start) * world_size)!r}")  # [06]
                window_loss, window_start = torch.zeros_like(window_loss), step
            if step == args.max_steps:
                break
        val_loss, val_acc = evaluate(model, val_loader, device, autocast)  # [03]
        print0(f"epoch {epoch + 1}: val loss {val_loss:.4f} acc {val_acc:.4f},"  # [06]
               f" {time.perf_counter() - t0:.1f} s")  # [06]
        if val_acc > best_val_acc:  # [02] strictly better, so a tie keeps the earlier epoch
            best_val_acc, best_epoch = val_acc, epoch + 1  # [02]
            best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}  # [02] a copy, not a view
        if step == args.max_steps:
            break
    model.load_state_dict(best_state)  # [02]
    test_loss, test_acc = evaluate(model, test_loader, device, autocast)  # [03]
    print0(f"test (best epoch {best_epoch}): loss {test_loss:.4f} acc {test_acc:.4f}")  # [06]
    dist.destroy_process_group()  # [06]


if __name__ == "__main__":
    main()
