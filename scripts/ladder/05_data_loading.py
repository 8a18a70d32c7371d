"""05_data_loading.py: 04_compile.py + batches built in worker processes, copied asynchronously.

`num_workers` processes build batches while the model trains on the previous one; pinned
(page-locked) host memory lets the copy to the GPU run asynchronously (`non_blocking=True`), and
persistent workers survive from epoch to epoch. Replaces the DataLoader settings of the
article's Lightning scripts; train.py's `--num-workers`, `--pin-memory`.

    python scripts/ladder/05_data_loading.py --model tiny --data-dir ../shared/data --num-workers 4
"""

import argparse
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, RandomSampler

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
    model.train()
    return (sums[:2] / sums[2]).tolist()


def main():
    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)  # the same initial weights in every run
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model, args.random_init)
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

    shuffle = torch.Generator()  # reseeded every epoch: the order depends on (seed, epoch) alone
    train_loader = make_loader(train_set, sampler=RandomSampler(train_set, generator=shuffle), drop_last=True)
    val_loader, test_loader = make_loader(val_set), make_loader(test_set)

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
    torch.manual_seed(args.seed)  # the dropout masks start here, however many numbers building the model drew

    step, t0 = 0, time.perf_counter()
    best_val_acc, best_epoch, best_state = -1.0, None, None  # [02]
    for epoch in range(args.epochs):
        shuffle.manual_seed(args.seed + epoch)
        window_loss, window_start = torch.zeros((), dtype=torch.float64, device=device), step  # since the last print
        for batch in train_loader:
            input_ids, attention_mask, labels, _ = (t.to(device, non_blocking=True) for t in batch)  # [05]
            with autocast():  # [03]
                logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # [03]
            loss = F.cross_entropy(logits.float(), labels)
            scaler.scale(loss).backward()  # [03] loss x scale, so small float16 gradients do not underflow
            scaler.step(optimizer)  # [03] unscales the gradients; skips the step if any is inf or NaN
            scaler.update()  # [03] a smaller scale after an overflow, a larger one after many good steps
            optimizer.zero_grad(set_to_none=True)
            step += 1
            window_loss += loss.detach().double()  # on the device: .item() would wait for the GPU every step
            if step % args.log_every == 0:
                print(f"step {step} loss {window_loss.item() / (step - window_start)!r}", flush=True)
                window_loss, window_start = torch.zeros_like(window_loss), step
            if step == args.max_steps:
                break
        val_loss, val_acc = evaluate(model, val_loader, device, autocast)  # [03]
        print(f"epoch {epoch + 1}: val loss {val_loss:.4f} acc {val_acc:.4f}, {time.perf_counter() - t0:.1f} s")
        if val_acc > best_val_acc:  # [02] strictly better, so a tie keeps the earlier epoch
            best_val_acc, best_epoch = val_acc, epoch + 1  # [02]
            best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}  # [02] a copy, not a view
        if step == args.max_steps:
            break
    model.load_state_dict(best_state)  # [02]
    test_loss, test_acc = evaluate(model, test_loader, device, autocast)  # [03]
    print(f"test (best epoch {best_epoch}): loss {test_loss:.4f} acc {test_acc:.4f}")  # [02]


if __name__ == "__main__":
    main()
