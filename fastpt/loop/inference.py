"""Inference: a trained classifier's probabilities on new texts, by the fastest path plain PyTorch has.

    split = tokenize(tokenizer, texts, None, max_length)     # one call: the fast tokenizer's batch
    loader = prediction_loader(split, batch_size, ...)       # length-sorted batches, padded to their longest
    out = predict(model.to(device, dtype), loader, device)   # inference_mode; out["probabilities"][i] is text i's

    loader = packed_prediction_loader(split, token_budget(split, batch_size), ...)   # or: no padding at all
    out = predict(PackedClassifier(model, kernel).to(device, dtype), loader, device, max_length)

What makes it faster than `transformers.pipeline("text-classification")` on the same texts and
model (scripts/bench_predict.py measures both):
- Length-sorted batches. The sampler orders the texts longest first (data.EvalBatchSampler with
  `sort_by_length`) and each batch pads only to its own longest (Collator, pad_to="longest"), so
  a batch's texts have about the same length and almost no computation goes to padding. The
  pipeline batches texts in the order given and pads each batch to its longest: IMDB reviews
  vary from a few dozen tokens to 512, so a random batch of 32 is mostly padding.
- The batch size that suits the device (--batch-size): on a GPU large batches (64 by default; with
  no activations kept for a backward pass, many times a training batch) give fewer, fuller matrix
  products and kernel launches. On a CPU smaller ones (16 by default) measured faster (why is not
  settled: a small batch's activations stay in the caches more, and a larger one takes more fresh
  pages from the kernel, which the VM measured on zeroes at a high cost). On a 2-core
  AVX512-BF16 EPYC, 400 reviews at 512 tokens (scripts/results/predict-cpu-bf16.md, 2026-12-03 14:50 UTC):
  bf16 padded batches of 16 made 49.8 texts/s, of 64 39.0; float32 batches of 4 20.7, of 64 14.5.
- One tokenizer call for all texts (Rust, in parallel), not one call per text.
- `torch.inference_mode()`: no autograd recording and no version counters on the tensors
  (evaluation.py uses `no_grad`, which compiled and sharded training modules need; this is a
  plain model that never trains).
- Optional 16-bit weights (--amp bfloat16): the model cast to that dtype once, as
  `pipeline(dtype=torch.bfloat16)` loads it, rather than autocast around a float32 model. A model
  that never trains needs no float32 master weights, and autocast would cast every weight at every
  call and keep the residual stream, layer norms and GELU in float32, with a cast before each matrix
  product (scripts/bench_predict.py's "padded, bf16 autocast" row measures that design beside this
  one). Layer norm still accumulates in float32 (its kernels' accumulate type), and the logits'
  softmax is float32. Worth it on GPUs, and on CPUs with 16-bit matrix units (AMX, AVX-512 BF16);
  on a CPU without them it is slower than float32.
- bfloat16 weights prepacked on a CPU (speedups/prepacked.py): each nn.Linear's weight reordered
  once into oneDNN's blocked layout, not handed to it in the plain layout at every call; the same
  results bit for bit.
- Optional packing (--pack, speedups/packing.py): the sorted texts laid end to end in token streams
  of about `token_budget` tokens (--pack-tokens; by default --batch-size x the texts' mean length,
  so about as many batches as padded ones), no padding token at all. A stream of short texts holds
  more of them than --batch-size: fewer, fuller calls. Attention stays inside each text, with the
  kernel training would use (packed_attention_kernel: on a CPU the "loop", one flash call per text
  and layer; on a GPU under --amp FlashAttention's varlen), so on a CPU many very short texts pay a
  per-call overhead that one padded batch does not: measure both (scripts/bench_predict.py). Only
  the models PackedClassifier knows (DistilBERT, BERT, RoBERTa), and not sentence pairs on BERT
  (token_type_ids), as in training.

Several processes (torchrun) each take their share of the sorted order, rank r every r-th text,
and one all-gather puts the results back in the input's order (evaluation.gather_per_example).
Cost: every text is tokenised and held in memory at once (4 bytes a token). Lightning: `Trainer.predict`.
"""

import numpy as np
import torch

from fastpt.inputs import data
from fastpt.loop.evaluation import gather_per_example
from fastpt.loop.step import classify
from fastpt.speedups.packing import PackedCollator


def tokenize(tokenizer, texts: list, pairs: list | None, max_length: int, labels=None) -> data.TokenizedSplit:
    """The texts (and second texts of pairs) tokenised in one call, cut at max_length as training's are."""
    encoded = tokenizer(texts, pairs, truncation=True, max_length=max_length, return_attention_mask=False,
                        return_token_type_ids=False)
    return data.TokenizedSplit.from_token_lists(encoded["input_ids"], labels)


def token_budget(split: data.TokenizedSplit, batch_size: int) -> int:
    """--pack's default tokens per stream: --batch-size texts of the mean length (at least one token)."""
    return max(1, round(batch_size * float(split.lengths.mean()))) if len(split) else batch_size


def packed_batches(split: data.TokenizedSplit, tokens: int, rank: int = 0, world_size: int = 1) -> list:
    """This rank's batches of (index, weight) items: its share of the texts sorted longest first (every
    world_size-th, as EvalBatchSampler gives them), cut greedily into streams of at most `tokens` tokens;
    a text longer than that is a stream of its own. Ranks may run different numbers of batches: prediction
    has no collective before the final gather. A rank without texts computes one weight-0 filler, so that
    every rank has results of the same width to gather."""
    order = np.argsort(-split.lengths, kind="stable")[rank::world_size]
    if len(order) == 0:
        return [[(int(np.argmin(split.lengths)), 0.0)]] if len(split) else []
    batches, current, used = [], [], 0
    for i in order.tolist():
        length = int(split.lengths[i])
        if current and used + length > tokens:
            batches.append(current)
            current, used = [], 0
        current.append((i, 1.0))
        used += length
    return batches + [current]


def packed_prediction_loader(split: data.TokenizedSplit, tokens: int, pad_id: int, max_length: int, rank: int = 0,
                             world_size: int = 1, num_workers: int = 0, pin_memory: bool = False):
    """Streams of about `tokens` tokens of length-sorted texts (packed_batches), no padding; this rank's share."""
    return data.make_loader(split, packed_batches(split, tokens, rank, world_size),
                            PackedCollator(pad_id, max_length=max_length), num_workers, pin_memory, seed=0)


def prediction_loader(split: data.TokenizedSplit, batch_size: int, pad_id: int, max_length: int, rank: int = 0,
                      world_size: int = 1, sep_id: int | None = None, num_workers: int = 0, pin_memory: bool = False):
    """Batches of texts of about one length (longest first), each padded to its own longest; this rank's share."""
    sampler = data.EvalBatchSampler(split, batch_size, rank, world_size, sort_by_length=True)
    collate = data.Collator(pad_id, "longest", max_length, sep_id)
    return data.make_loader(split, sampler, collate, num_workers, pin_memory, seed=0)


@torch.inference_mode()
def predict(model: torch.nn.Module, loader, device: torch.device, max_length: int = 0) -> dict:
    """{'probabilities' [n, K] float32, 'predicted' [n] int64} in the split's order, on every rank.

    `model` is a PackedClassifier for packed batches, with `max_length` the longest text (the kernels'
    max_seqlen). Results stay on the device until the loop ends: no host read per batch."""
    model.eval()
    kept = []
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
        logits = classify(model, batch, max_length).float()  # max_length: for packed batches only
        kept.append((torch.softmax(logits, dim=-1), logits.argmax(dim=-1)))
    return gather_per_example(loader.batch_sampler, kept)
