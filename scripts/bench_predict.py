"""fastpt-predict's inference path against `transformers.pipeline("text-classification")`, side by side.

    python scripts/bench_predict.py --data-dir ../shared/data                  # MiniLM, 1,000 reviews, 512 tokens
    python scripts/bench_predict.py --model distilbert-base-uncased --random-init --n 200

The texts: the first --n reviews of IMDB's test split (the project's loader, fastpt/inputs/imdb.py).
The model (--model minilm by default, or --random-init for the architecture with random weights:
speed does not depend on the weights) is saved as a Hugging Face model folder, as --export-dir
saves one; both sides load that folder. Each side runs at every batch size of its list after a
short warm-up, and its best is compared:
- pipeline: `pipeline(texts, batch_size=B, truncation=True, max_length=--max-length)`, top_k=None
  (every label's probability, as fastpt-predict writes);
- fastpt: what fastpt-predict runs (loop/inference.py): one tokenizer call, length-sorted
  batches padded to their own longest, inference_mode; float32 like the pipeline.
Both times include tokenising and exclude loading the model. Printed and written to --table: a
Markdown table of texts/s per batch size, the ratio of the bests, the CPU's name and the thread count.

The numbers are only as quiet as the machine: measure on an otherwise idle one.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def imdb_texts(data_dir: str | None, n: int) -> list[str]:
    """The first n reviews of the article's test split; exits with one line where there is no IMDB data."""
    from fastpt.inputs import imdb
    from fastpt.machinery.errors import DataError

    if not (data_dir or os.environ.get("FASTPT_DATA_DIR")):
        sys.exit("error: no IMDB data given: pass --data-dir DIR (aclImdb/ or aclImdb_v1*.tar.gz) or set "
                 "FASTPT_DATA_DIR (this script never downloads)")
    try:
        reviews = imdb.read_reviews(imdb.find_source(data_dir))
    except DataError as e:
        sys.exit(f"error: {e}")
    test = imdb.split_indices(len(reviews.texts))["test"][:n]
    return [reviews.texts[i].replace("<br />", " ") for i in test]


def save_model(name: str, random_init: bool, folder: Path) -> None:
    """The model (2 labels) and tokenizer as a Hugging Face model folder, as --export-dir writes one."""
    from fastpt.inputs.models import load_model, load_tokenizer

    model = load_model(name, random_init, label_names=["neg", "pos"])
    model.save_pretrained(folder)
    load_tokenizer(name).save_pretrained(folder)


def time_pipeline(folder: Path, texts: list, batch_size: int, max_length: int) -> float:
    from transformers import pipeline

    classify = pipeline("text-classification", model=str(folder), device="cpu", top_k=None)
    kwargs = dict(batch_size=batch_size, truncation=True, max_length=max_length)
    classify(texts[:4], **kwargs)  # warm-up
    start = time.perf_counter()
    classify(texts, **kwargs)
    return len(texts) / (time.perf_counter() - start)


def time_fastpt(folder: Path, texts: list, batch_size: int, max_length: int) -> float:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from fastpt.loop.inference import predict, prediction_loader, tokenize

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForSequenceClassification.from_pretrained(str(folder), attn_implementation="sdpa")
    device = torch.device("cpu")

    def run(some: list) -> None:
        split = tokenize(tokenizer, some, None, max_length)
        predict(model, prediction_loader(split, batch_size, tokenizer.pad_token_id or 0, max_length), device)

    run(texts[:4])  # warm-up
    start = time.perf_counter()
    run(texts)
    return len(texts) / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", default=None, help="IMDB: aclImdb/ or a tarball (default: $FASTPT_DATA_DIR)")
    p.add_argument("--model", default="minilm")
    p.add_argument("--random-init", action="store_true")
    p.add_argument("--n", type=int, default=1000, help="reviews")
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--pipeline-batch-sizes", default="1,8,32")
    p.add_argument("--fastpt-batch-sizes", default="16,64,256")
    p.add_argument("--table", default=str(ROOT / "scripts" / "results" / "predict-cpu.md"))
    args = p.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    texts = imdb_texts(args.data_dir, args.n)
    header = (f"{len(texts)} IMDB test reviews, --max-length {args.max_length}, model {args.model}"
              f"{' (random init)' if args.random_init else ''}, float32 | {cpu_name()}, "
              f"{torch.get_num_threads()} threads | torch {torch.__version__}, transformers {transformers.__version__}")
    print(header, flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "export"
        save_model(args.model, args.random_init, folder)
        for side, sizes, timer in (("pipeline", args.pipeline_batch_sizes, time_pipeline),
                                   ("fastpt-predict", args.fastpt_batch_sizes, time_fastpt)):
            for size in map(int, sizes.split(",")):
                rate = timer(folder, texts, size, args.max_length)
                rows.append((side, size, rate))
                print(f"{side:15s} batch {size:4d}: {rate:8.2f} texts/s", flush=True)
    best = {side: max(r for s, _, r in rows if s == side) for side in ("pipeline", "fastpt-predict")}
    ratio = best["fastpt-predict"] / best["pipeline"]
    lines = ["# fastpt-predict vs transformers.pipeline", "", header, "", "| side | batch size | texts/s |",
             "| --- | ---: | ---: |", *(f"| {s} | {b} | {r:.2f} |" for s, b, r in rows), "",
             f"Best against best: fastpt-predict {best['fastpt-predict']:.2f} texts/s, pipeline "
             f"{best['pipeline']:.2f} texts/s: **{ratio:.2f}x**.", "",
             f"Written by `python scripts/bench_predict.py {' '.join(sys.argv[1:])}`."]
    print(f"best against best: {ratio:.2f}x")
    Path(args.table).parent.mkdir(parents=True, exist_ok=True)
    Path(args.table).write_text("\n".join(lines) + "\n")
    print(f"wrote: {args.table}")


if __name__ == "__main__":
    main()
