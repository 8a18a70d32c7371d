"""fastpt-predict's inference path against `transformers.pipeline("text-classification")`, side by side.

Run it before labelling many texts, to choose fastpt-predict's batch size and `--pack` on your machine.

    python scripts/bench_predict.py --data-dir ../shared/data                  # MiniLM, 1,000 reviews, 512 tokens
    python scripts/bench_predict.py --model distilbert-base-uncased --random-init --n 200
    python scripts/bench_predict.py --data-dir ../shared/data --n 400 --prepack-pairs 6   # one speed-up, A/B

The texts: the first --n reviews of IMDB's test split (the project's loader, fastpt/inputs/imdb.py).
The model (--model minilm by default, or --random-init for the architecture with random weights:
speed does not depend on the weights) is saved as a Hugging Face model folder, as --export-dir
saves one; both sides load that folder. Each side runs each of its settings at every batch size of
its list after a short warm-up:
- pipeline: `pipeline(texts, batch_size=B, truncation=True, max_length=--max-length)`, top_k=None
  (every label's probability, as fastpt-predict writes), float32;
- fastpt "padded": what fastpt-predict runs (loop/inference.py): one tokenizer call, length-sorted
  batches padded to their own longest, inference_mode; float32 like the pipeline;
- fastpt "pack": what `fastpt-predict --pack` runs: the same sorted texts end to end in streams of
  B x the texts' mean length tokens (its default --pack-tokens), no padding; float32;
- "bf16" settings (fastpt's `--amp bfloat16`: the model cast to bfloat16 once, its linear weights
  prepacked for oneDNN; the pipeline's model loaded with dtype=bfloat16) only where the CPU has
  native bfloat16 (AVX512-BF16 or AMX): elsewhere it is emulated and slower than float32, and the
  script says it skips them;
- the designs fastpt-predict --amp replaced, beside it and never counted as its best: fastpt
  "padded, bf16 autocast", the same padded batches with the float32 model under bfloat16 autocast,
  as training evaluates (loop/inference.py); "padded, bf16, weights not prepacked", the bfloat16
  model on `F.linear` (speedups/prepacked.py).
Each setting at each batch size runs in a fresh process of its own: fastpt's with freed memory
kept for reuse, as fastpt-predict's is on a CPU (speedups/backends.py), the pipeline's with glibc's
defaults, as a user's script runs it. Both times include tokenising and exclude loading the model (and, for
fastpt, wrapping it for packing and measuring attention's precision, as fastpt-predict does at its
start: well under a second). Printed
and written to --table: a Markdown table of texts/s per setting and batch size, each fastpt row
against the pipeline's best, the precision attention ran in, the share of this CPU's measured
matmul peak the row reached (the texts' forward FLOPs on their real tokens per second: what bounds
any side on the same tokens), the ratio of the bests with the settings that made them, the CPU's
name, flags and thread count, and the date.

The numbers are only as quiet as the machine: measure on an otherwise idle one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def imdb_texts(data_dir: str | None, n: int) -> list[str]:
    """The first n reviews of the article's test split; exits with one line where there is no IMDB data."""
    from fastpt.inputs import imdb
    from fastpt.errors import DataError

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


def time_pipeline(folder: Path, texts: list, batch_size: int, max_length: int,
                  amp: str | None = None) -> tuple[float, str]:
    """(texts/s, attention's precision: the model's dtype) of `pipeline`, the model loaded in `amp`'s dtype."""
    import torch
    from transformers import pipeline

    classify = pipeline("text-classification", model=str(folder), device="cpu", top_k=None,
                        dtype=getattr(torch, amp or "float32"))
    kwargs = dict(batch_size=batch_size, truncation=True, max_length=max_length)
    classify(texts[:4], **kwargs)  # warm-up
    start = time.perf_counter()
    classify(texts, **kwargs)
    return len(texts) / (time.perf_counter() - start), amp or "float32"


def fastpt_setup(folder: Path, texts: list, batch_size: int, max_length: int, amp: str | None = None,
                 pack: bool = False, design: str = "", choice: dict | None = None) -> tuple:
    """(model, loader(texts), attention's choice) as fastpt-predict prepares them: its model (cast to `amp`'s
    dtype, bfloat16 linear weights prepacked; a `design` it replaced instead: "autocast", float32 to run
    under autocast, or "not prepacked", bfloat16 on `F.linear`), its batches, and attention in the
    precision its measurement picks (speedups/attention_precision.py; `choice`: one made already)."""
    from types import SimpleNamespace

    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from fastpt.loop.inference import packed_prediction_loader, prediction_loader, token_budget, tokenize
    from fastpt.speedups import attention_precision
    from fastpt.speedups.amp import DTYPES
    from fastpt.speedups.packed_attention import packed_attention_kernel
    from fastpt.speedups.packing import PackedClassifier
    from fastpt.speedups.prepacked import prepack_linears

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForSequenceClassification.from_pretrained(str(folder), attn_implementation="sdpa")
    device = torch.device("cpu")
    pad_id = tokenizer.pad_token_id or 0
    if pack:  # as fastpt-predict --pack wraps it
        model = PackedClassifier(model, packed_attention_kernel(device.type, False, bool(amp)))

    def loader(some: list):
        split = tokenize(tokenizer, some, None, max_length)
        if pack:
            return packed_prediction_loader(split, token_budget(split, batch_size), pad_id, max_length)
        return prediction_loader(split, batch_size, pad_id, max_length)

    choice = choice or attention_precision.for_predictions(amp, SimpleNamespace(device=device, is_main=True), model,
                                                           loader(texts))  # on the first batch, as fastpt-predict
    model = attention_precision.apply(model, choice).to(device, None if design == "autocast" else DTYPES.get(amp))
    if not design:
        prepack_linears(model)  # as fastpt-predict: bfloat16 weights only
    return model, loader, choice


def time_fastpt(folder: Path, texts: list, batch_size: int, max_length: int, amp: str | None = None,
                pack: bool = False, design: str = "") -> tuple[float, str]:
    """(texts/s, attention's precision) of what fastpt-predict runs (fastpt_setup), set up before the clock
    starts, as the packing wrapper and attention's measurement are."""
    import contextlib

    import torch

    from fastpt.loop.inference import predict
    from fastpt.speedups.amp import DTYPES

    model, loader, choice = fastpt_setup(folder, texts, batch_size, max_length, amp, pack, design)
    with torch.autocast("cpu", DTYPES[amp]) if design == "autocast" else contextlib.nullcontext():
        predict(model, loader(texts[:4]), torch.device("cpu"), max_length)  # warm-up
        start = time.perf_counter()
        predict(model, loader(texts), torch.device("cpu"), max_length)
    return len(texts) / (time.perf_counter() - start), choice["precision"]


def prepack_pairs(folder: Path, texts: list, batch_size: int, max_length: int, pairs: int) -> list[float]:
    """fastpt-predict's bfloat16 padded path with its linear weights prepacked against the same model on
    `F.linear`, in this one process and alternating (ABBA), so that the machine's drift, which a table's
    rows minutes apart cannot tell from a few percent, weighs on both alike: each pair's texts/s ratio,
    prepacked over not. Attention in the one precision measured for both."""
    import torch

    from fastpt.loop.inference import predict

    fast = fastpt_setup(folder, texts, batch_size, max_length, "bfloat16")
    built = {"": fast, "not prepacked": fastpt_setup(folder, texts, batch_size, max_length, "bfloat16", False,
                                                     "not prepacked", choice=fast[2])}
    for model, loader, _ in built.values():
        predict(model, loader(texts[:4]), torch.device("cpu"), max_length)  # warm-up
    ratios = []
    for i in range(pairs):
        seconds = {}
        for design in ("", "not prepacked") if i % 2 == 0 else ("not prepacked", ""):
            model, loader, _ = built[design]
            start = time.perf_counter()
            predict(model, loader(texts), torch.device("cpu"), max_length)
            seconds[design] = time.perf_counter() - start
        ratios.append(seconds["not prepacked"] / seconds[""])
    return ratios


def forward_flops(folder: Path, texts: list, max_length: int) -> tuple[float, int]:
    """(the FLOPs of one forward pass over the texts' real tokens, each text over its own length, the
    model's width). The FLOPs are a third of training's count (monitoring/metrics.py), the same for
    both sides (the pipeline, at batch 1, computes no padding either)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from fastpt.inputs.models import count_parameters
    from fastpt.loop.inference import tokenize
    from fastpt.monitoring import metrics

    model = AutoModelForSequenceClassification.from_pretrained(str(folder))
    lengths = tokenize(AutoTokenizer.from_pretrained(str(folder)), texts, None, max_length).lengths.tolist()
    layers, hidden = metrics.model_shape(model)
    return metrics.review_flops(lengths, count_parameters(model)[1], layers, hidden) / 3, hidden


def matmul_peak(amp: str | None, hidden: int) -> float:
    """This CPU's measured matmul peak at the setting's precision (monitoring/peak.py, not cached)."""
    import torch

    from fastpt.monitoring import peak

    return peak.measured_peak(torch.device("cpu"), getattr(torch, amp or "float32"), hidden, None)["flops_per_s"]


def measure_alone(folder: str, texts_file: str, side: str, amp: str | None, pack: bool, batch_size: int,
                  max_length: int, design: str = "") -> dict:
    """One setting at one batch size, in this fresh process: fastpt's side with freed memory kept, as
    fastpt-predict runs on a CPU (speedups/backends.py); the pipeline's with glibc's defaults, as it runs."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    if side == "fastpt-predict":
        from fastpt.speedups.backends import keep_freed_memory
        keep_freed_memory()
    texts = json.loads(Path(texts_file).read_text())
    if side == "pipeline":
        rate, attention = time_pipeline(Path(folder), texts, batch_size, max_length, amp)
    else:
        rate, attention = time_fastpt(Path(folder), texts, batch_size, max_length, amp, pack, design)
    return {"rate": rate, "attention": attention}


def in_own_process(folder: Path, texts_file: Path, side: str, amp: str | None, pack: bool, batch_size: int,
                   max_length: int, design: str = "") -> tuple[float, str]:
    """measure_alone's (texts/s, attention) from a process of its own: what one setting leaves behind (its
    heap, the pipeline's threads) never weighs on the next, and each side runs with its own allocator."""
    import subprocess

    spec = json.dumps([str(folder), str(texts_file), side, amp, pack, batch_size, max_length, design])
    done = subprocess.run([sys.executable, __file__, "--measure-alone", spec], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"error: {side} {amp or 'float32'} batch {batch_size} failed: {done.stderr.strip()[-500:]}")
    found = json.loads(done.stdout.strip().splitlines()[-1])
    return found["rate"], found["attention"]


def main() -> None:
    if sys.argv[1:2] == ["--measure-alone"]:  # in_own_process's child
        print(json.dumps(measure_alone(*json.loads(sys.argv[2]))))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", default=None, help="IMDB: aclImdb/ or a tarball (default: $FASTPT_DATA_DIR)")
    p.add_argument("--model", default="minilm")
    p.add_argument("--random-init", action="store_true")
    p.add_argument("--n", type=int, default=1000, help="reviews")
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--pipeline-batch-sizes", default="1,8,32")
    p.add_argument("--fastpt-batch-sizes", default="4,16,64")
    p.add_argument("--table", default=str(ROOT / "scripts" / "results" / "predict-cpu.md"))
    p.add_argument("--prepack-pairs", type=int, default=0, metavar="N",
                   help="instead of the table: N alternating pairs, in one process, of fastpt-predict's bf16 "
                        "padded path with and without prepacked linear weights, at each --fastpt-batch-sizes")
    args = p.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    from fastpt.cli.preflight import cpu_has_native_bfloat16
    from reproduce import machine  # the CPU, its flags and torch's CPU capability

    texts = imdb_texts(args.data_dir, args.n)
    if args.prepack_pairs:
        return print_prepack_pairs(args, texts)
    header = (f"{len(texts)} IMDB test reviews, --max-length {args.max_length}, model {args.model}"
              f"{' (random init)' if args.random_init else ''}, float32 unless the setting says bf16 | "
              f"{time.strftime('%Y-%m-%d %H:%M %Z')}, {machine()} | transformers {transformers.__version__} | "
              f"each setting in a process of its own; fastpt's with freed memory kept (fastpt-predict's), the "
              f"pipeline's with glibc's defaults")
    print(header, flush=True)
    precisions = [None]
    if cpu_has_native_bfloat16():
        precisions.append("bfloat16")
    else:
        print(f"bf16 settings skipped: this CPU ({torch.backends.cpu.get_cpu_capability()}) has no native bfloat16 "
              f"(AVX512-BF16 or AMX); it is emulated here and slower than float32", flush=True)
    # (side, setting, batch sizes, precision, pack, design); a setting is how it batches, and its precision
    settings = [("pipeline", "float32" if amp is None else "bf16", args.pipeline_batch_sizes, amp, False, "")
                for amp in precisions]
    settings += [("fastpt-predict", ("pack" if pack else "padded") + (", bf16" if amp else ""),
                  args.fastpt_batch_sizes, amp, pack, "") for amp in precisions for pack in (False, True)]
    if "bfloat16" in precisions:  # what --amp's cast, prepacked weights replaced, to compare
        settings += [("fastpt-predict", f"padded, bf16{name}", args.fastpt_batch_sizes, "bfloat16", False, design)
                     for name, design in ((" autocast", "autocast"), (", weights not prepacked", "not prepacked"))]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "export"
        save_model(args.model, args.random_init, folder)
        texts_file = Path(tmp) / "texts.json"
        texts_file.write_text(json.dumps(texts))
        flops, hidden = forward_flops(folder, texts, args.max_length)
        peaks = {amp: matmul_peak(amp, hidden) for amp in precisions}
        per_text = f"{flops / len(texts) / 1e9:.2f} GFLOP per text"
        peak_rates = ", ".join(f"{amp or 'float32'} {peaks[amp] / 1e12:.3f} TFLOP/s" for amp in precisions)
        print(f"{per_text} (forward, real tokens); matmul peak {peak_rates}", flush=True)
        for side, setting, sizes, amp, pack, design in settings:
            for size in map(int, sizes.split(",")):
                rate, attention = in_own_process(folder, texts_file, side, amp, pack, size, args.max_length, design)
                share = rate * flops / len(texts) / peaks[amp]
                rows.append((side, setting, size, rate, attention, share, design))
                print(f"{side:15s} {setting:12s} batch {size:4d}: {rate:8.2f} texts/s, attention {attention}, "
                      f"{100 * share:.3g}% of the matmul peak", flush=True)
    best = {side: max((r for r in rows if r[0] == side and not r[6]), key=lambda r: r[3])
            for side in ("pipeline", "fastpt-predict")}  # designs replaced: fastpt-predict never runs them
    theirs = best["pipeline"][3]
    ratio = best["fastpt-predict"][3] / theirs
    named = {side: f"{r[1]}, batch {r[2]}" for side, r in best.items()}
    lines = ["# fastpt-predict vs transformers.pipeline", "", header, "",
             "pack: streams of batch size x the texts' mean length tokens (fastpt-predict --pack's default). "
             "attention: the precision attention ran in (fastpt-predict measures it under --amp). of peak: the "
             f"texts' forward FLOPs on their real tokens ({per_text}) per second, against this CPU's measured matmul "
             f"peak at the setting's precision ({peak_rates}).", "",
             "| side | setting | batch size | attention | texts/s | of peak | vs pipeline's best |",
             "| --- | --- | ---: | --- | ---: | ---: | ---: |",
             *(f"| {s} | {setting} | {b} | {a} | {r:.2f} | {100 * f:.3g}% | {r / theirs:.2f}x |"
               for s, setting, b, r, a, f, _ in rows), "",
             f"Best against best: fastpt-predict ({named['fastpt-predict']}) {best['fastpt-predict'][3]:.2f} texts/s, "
             f"pipeline ({named['pipeline']}) {theirs:.2f} texts/s: **{ratio:.2f}x**.", "",
             f"Written by `python scripts/bench_predict.py {' '.join(sys.argv[1:])}`."]
    print(f"best against best: fastpt-predict ({named['fastpt-predict']}) / pipeline ({named['pipeline']}) = "
          f"{ratio:.2f}x")
    Path(args.table).parent.mkdir(parents=True, exist_ok=True)
    Path(args.table).write_text("\n".join(lines) + "\n")
    print(f"wrote: {args.table}")


def print_prepack_pairs(args, texts: list) -> None:
    """--prepack-pairs: prepack_pairs at each fastpt batch size, with freed memory kept as fastpt-predict's."""
    import statistics

    import torch

    from fastpt.speedups.backends import keep_freed_memory
    from fastpt.speedups.prepacked import prepacking_pays
    from reproduce import machine

    if not prepacking_pays(torch.device("cpu"), torch.bfloat16):
        sys.exit("error: --prepack-pairs: oneDNN has no bfloat16 kernels on this CPU, so nothing is prepacked")
    keep_freed_memory()
    print(f"{len(texts)} IMDB test reviews, --max-length {args.max_length}, model {args.model} | "
          f"{time.strftime('%Y-%m-%d %H:%M %Z')}, {machine()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "export"
        save_model(args.model, args.random_init, folder)
        for size in map(int, args.fastpt_batch_sizes.split(",")):
            ratios = prepack_pairs(folder, texts, size, args.max_length, args.prepack_pairs)
            print(f"batch {size}: prepacked / not prepacked texts/s, {len(ratios)} alternating pairs: "
                  f"{', '.join(f'{r:.3f}' for r in ratios)} (median {statistics.median(ratios):.3f})", flush=True)


if __name__ == "__main__":
    main()
