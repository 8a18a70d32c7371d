"""Imbalanced classes through `train.py --data`: IMDB's star ratings with rare classes, with and without
`--class-weights balanced`, and the weighted export's `fastpt-predict` against `transformers.pipeline`.

The four rating classes of scripts/imdb_ratings.py (1-2, 3-4, 7-8, 9-10), written from the article's
split (its write_csvs), are subsampled per split with a fixed seed so that the rare classes (--rare,
default 3-4 and 7-8) hold --rare-share of the rows each in training, validation AND test, the rest
shared evenly by the others: a model can score well on accuracy while never predicting the rare
ones. The CSVs and runs go under --work (default data/imbalanced/, git-ignored: IMDB text is never
committed). The same `train.py` command runs twice, plain and with `--class-weights balanced`, each
with --export-dir; then `fastpt-predict` and `transformers.pipeline("text-classification",
top_k=None, truncation=True)` (the run's --max-length passed to both) label the test texts from the
weighted export, and the script writes the table (class counts, per-class precision / recall / F1
of both runs from results.json, the agreement of the two predictors, the CPU) to --table.

    python scripts/imbalanced.py --model minilm --max-length 128 --pack --epochs 2 --lr 1e-4

Flags this script does not know go to train.py. Cost: two trainings and two passes over the test set.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from imdb_ratings import CLASSES, ROOT, write_csvs  # noqa: E402  (it puts ROOT on sys.path)

ORDER = sorted(set(CLASSES.values()), key=lambda name: int(name.split("-")[0]))  # 1-2, 3-4, 7-8, 9-10
SPLITS = ("train", "validation", "test")


def quotas(n: int, rare: list, share: float) -> dict:
    """{class: rows} for a split of n rows: round(n x share) for each rare class, the rest shared evenly."""
    common = [c for c in ORDER if c not in rare]
    left = n - len(rare) * round(n * share)
    if left < len(common):
        raise SystemExit(f"error: --rare-share {share} leaves no rows for {', '.join(common)} in {n}")
    out = {c: round(n * share) for c in rare}
    out.update({c: left // len(common) + (i < left % len(common)) for i, c in enumerate(common)})
    return out


def subsample(full: Path, out: Path, n: int, rare: list, share: float, seed: int) -> Counter:
    """Write `n` rows of `full` to `out` (text, stars, rating) in the class quotas, shuffled; the class counts."""
    with open(full, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    rng = random.Random(seed)
    by_class = {c: [r for r in rows if r["stars"] == c] for c in ORDER}
    picked = []
    for c, k in quotas(n, rare, share).items():
        if k > len(by_class[c]):
            raise SystemExit(f"error: {full} has {len(by_class[c])} rows of class {c}, {k} wanted")
        picked += rng.sample(by_class[c], k)
    rng.shuffle(picked)
    with open(out, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["text", "stars", "rating"])
        w.writerows([r["text"], r["stars"], r["rating"]] for r in picked)
    return Counter(r["stars"] for r in picked)


def train(paths: dict, out: Path, export: Path, flags: list) -> tuple[dict, dict, float]:
    """One `train.py --data` run; (results.json, the run's config.json, wall seconds)."""
    cmd = [sys.executable, str(ROOT / "train.py"), "--data", str(paths["train"]), "--val-data",
           str(paths["validation"]), "--test-data", str(paths["test"]), "--text-column", "text",
           "--label-column", "stars", "--out", str(out), "--overwrite", "--no-progress",
           "--export-dir", str(export), *flags]
    print("+", " ".join(cmd), flush=True)
    start = time.perf_counter()
    subprocess.run(cmd, check=True)
    wall = time.perf_counter() - start
    return json.loads((out / "results.json").read_text()), json.loads((out / "config.json").read_text()), wall


def compare_predictors(export: Path, test_csv: Path, out: Path, max_length: int) -> dict:
    """fastpt-predict and transformers.pipeline on the test texts from one export: agreement and differences."""
    cmd = [sys.executable, "-m", "fastpt.cli.predict", "--model", str(export), "--data", str(test_csv),
           "--out", str(out), "--overwrite", "--label-column", "stars", "--max-length", str(max_length)]
    print("+", " ".join(cmd), flush=True)
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
    print(done.stdout, end="", flush=True)
    evaluation = next((line for line in done.stdout.splitlines() if line.startswith("evaluation:")), "")
    with open(out, newline="", encoding="utf-8") as f:
        fastpt_rows = {int(r["row"]): r for r in csv.DictReader(f)}
    with open(test_csv, newline="", encoding="utf-8") as f:
        texts = [r["text"] for r in csv.DictReader(f)]
    from transformers import pipeline

    classify = pipeline("text-classification", model=str(export), top_k=None, truncation=True,
                        max_length=max_length, device="cpu")
    start = time.perf_counter()
    outputs = classify(texts)
    seconds = time.perf_counter() - start
    agree, max_diff = 0, 0.0
    for i, scores in enumerate(outputs):
        probs = {s["label"]: s["score"] for s in scores}
        mine = fastpt_rows[i]
        agree += max(probs, key=probs.get) == mine["predicted"]
        max_diff = max(max_diff, *(abs(p - float(mine[f"prob_{name}"])) for name, p in probs.items()))
    return {"texts": len(texts), "agree": agree, "max_diff": max_diff, "rows": len(fastpt_rows),
            "evaluation": evaluation.removeprefix("evaluation: "), "pipeline_s": seconds}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    return f"{names[0] if names else 'unknown CPU'}, {os.cpu_count()} logical cores"


def table(argv: list, counts: dict, runs: dict, agreement: dict, share: float) -> list[str]:
    """The Markdown report, every figure from the runs."""
    lines = ["# Imbalanced classes: `--class-weights balanced` on IMDB star ratings (CPU)", "",
             f"`python scripts/imbalanced.py {' '.join(argv)}`", "",
             f"Classes {' / '.join(ORDER)} from IMDB's ratings (the article's split), subsampled so the rare "
             f"classes hold {share:.0%} of each split; both runs are the same command, the second with "
             f"`--class-weights balanced`.", "", "| split | " + " | ".join(ORDER) + " | rows |",
             "| --- |" + " ---: |" * (len(ORDER) + 1)]
    for split in SPLITS:
        lines.append(f"| {split} | " + " | ".join(str(counts[split][c]) for c in ORDER)
                     + f" | {sum(counts[split].values())} |")
    weights = runs["weighted"][1].get("class_weight_values")
    if weights:
        lines += ["", "Balanced weights (n / (classes x count) over the training split): "
                  + ", ".join(f"{c} {w:.3f}" for c, w in zip(ORDER, weights)) + "."]
    lines += ["", "Test set, per class (precision / recall / F1 from results.json's `test_per_class`):", "",
              "| class | support | plain P | plain R | plain F1 | weighted P | weighted R | weighted F1 |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    plain, weighted = runs["plain"][0], runs["weighted"][0]
    for c in ORDER:
        a, b = plain["test_per_class"][c], weighted["test_per_class"][c]
        lines.append(f"| {c} | {a['support']} | {a['precision']:.3f} | {a['recall']:.3f} | {a['f1']:.3f} "
                     f"| {b['precision']:.3f} | {b['recall']:.3f} | {b['f1']:.3f} |")
    lines += ["", "| run | test accuracy | test macro-F1 | predicted per class | train rows | epochs | wall s |",
              "| --- | ---: | ---: | --- | ---: | ---: | ---: |"]
    for name, (results, _, wall) in runs.items():
        predicted = ", ".join(f"{c} {results['test_per_class'][c]['predicted']}" for c in ORDER)
        lines.append(f"| {name} | {results['test_acc']:.4f} | {results['test_macro_f1']:.4f} | {predicted} "
                     f"| {results['train_examples']} | {results['epochs_run']} | {wall:.0f} |")
    a = agreement
    lines += ["", f"`fastpt-predict` vs `transformers.pipeline(\"text-classification\", top_k=None, truncation=True, "
              f"max_length={runs['weighted'][1]['max_length']})` on the weighted run's export, its {a['texts']} "
              f"test texts: labels agree on {a['agree']} / {a['texts']}, max probability difference "
              f"{a['max_diff']:.2e} (fastpt-predict writes 7 significant digits); fastpt-predict's "
              f"{a['evaluation'] or 'evaluation: (none printed)'}; the run's own test: accuracy "
              f"{weighted['test_acc']:.4f} macro-F1 {weighted['test_macro_f1']:.4f}.", "",
              f"CPU: {cpu_name()} (shared with other jobs: wall times are noisy); torch {weighted['torch']}."]
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", default=None, help="IMDB's tarball or folder (default: $FASTPT_DATA_DIR)")
    p.add_argument("--work", default="data/imbalanced", help="where the CSVs, runs and exports go (not committed)")
    p.add_argument("--table", default="scripts/results/imbalanced-cpu.md")
    p.add_argument("--train-size", type=int, default=640, help="training rows written")
    p.add_argument("--val-size", type=int, default=160, help="validation rows written")
    p.add_argument("--test-size", type=int, default=600, help="test rows written")
    p.add_argument("--rare", default="3-4,7-8", help="the rare classes, comma-separated")
    p.add_argument("--rare-share", type=float, default=0.07, help="each rare class's share of every split")
    p.add_argument("--sample-seed", type=int, default=0, help="the subsampling's seed")
    args, train_flags = p.parse_known_args()  # the rest goes to train.py (--model, --max-length, ...)
    rare = [c.strip() for c in args.rare.split(",")]
    if not set(rare) < set(ORDER) or not 0 < args.rare_share < 1:
        raise SystemExit(f"error: --rare takes some of {', '.join(ORDER)}; --rare-share is in (0, 1)")
    work = Path(args.work).resolve()
    full = write_csvs(args.data_dir, work / "all")
    sizes = {"train": args.train_size, "validation": args.val_size, "test": args.test_size}
    paths = {split: work / f"{split}.csv" for split in SPLITS}
    counts = {split: subsample(full[split], paths[split], sizes[split], rare, args.rare_share,
                               args.sample_seed + i) for i, split in enumerate(SPLITS)}
    runs = {"plain": train(paths, work / "run-plain", work / "export-plain", train_flags),
            "weighted": train(paths, work / "run-weighted", work / "export-weighted",
                              [*train_flags, "--class-weights", "balanced"])}
    agreement = compare_predictors(work / "export-weighted", paths["test"], work / "predict-weighted.csv",
                                   runs["weighted"][1]["max_length"])
    lines = table(sys.argv[1:], counts, runs, agreement, args.rare_share)
    Path(args.table).parent.mkdir(parents=True, exist_ok=True)
    Path(args.table).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
