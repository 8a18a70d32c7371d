"""Length-grouped batching with dynamic padding (`--bucket`).

What it does: each epoch, take the shuffled indices, cut them into mega-batches of
`multiplier * batch_size` reviews (the global batch: all processes' together), sort each
mega-batch by token length, cut it into batches, and shuffle the batches; each process then
takes its share of each batch. Each batch is padded only to its own longest review.

Why it is faster: IMDB reviews average 263 tokens (training split, `<br />` removed, uncased
BERT vocabulary) but run up to 512. Padding every review to 512 (the article) leaves 51.4% of
the computed tokens real; padding random batches of 12 to their longest, 53.1%; grouped
batches, 98.4% (`scripts/bench_single.py` prints these), so each epoch does about half the work.

What it costs: batches are no longer i.i.d. samples of the data: neighbours in length share
a batch. A one-off measurement (docs/results.md) took 2,000 real reviews (MiniLM,
256 tokens, 2 epochs, three seeds; scripts/results/bucket-accuracy-cpu.md). After two epochs
the test accuracy is within noise of random batches (-0.07 +- 0.55 points). The first epoch,
though, learns more slowly: validation accuracy was lower for every seed, once by 20 points.
So a one-epoch run on a small dataset can come out worse. A smaller mega-batch
(`--bucket-multiplier 10`) removed the slow start there. It costs padding: on the full
training split at 512 tokens, 0.927 of computed tokens are real instead of 0.984. Shapes vary
per batch; `torch.compile` marks the token dimension dynamic from the first batch, so one
graph serves every length (compile.py). `--pack` removes padding without reordering the data.

Lightning has no flag for this; it is what Hugging Face's `group_by_length=True` does.
"""

import torch


def group_by_length(indices: list[int], lengths, batch_size: int, multiplier: int,
                    generator: torch.Generator) -> list[list[int]]:
    """Batches of similar-length indices, in shuffled order. Every index appears once."""
    mega = batch_size * multiplier
    batches: list[list[int]] = []
    for start in range(0, len(indices), mega):
        chunk = sorted(indices[start:start + mega], key=lambda i: lengths[i], reverse=True)
        batches += [chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size)]
    return [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]


def padding_efficiency(lengths, batches: list[list[int]], pad_to: int | None = None) -> float:
    """Real tokens / computed tokens when each batch is padded to `pad_to`, or to its own longest."""
    per_batch = [[int(lengths[i]) for i in batch] for batch in batches]
    padded = sum(len(b) * (pad_to if pad_to is not None else max(b)) for b in per_batch)
    return sum(map(sum, per_batch)) / max(1, padded)
