"""A real multi-class check of --data: IMDB's star ratings as a 4-class task, against the binary one.

IMDB's file names carry each review's rating (`<id>_<rating>.txt`: 1-4 negative, 7-10 positive).
This script writes the article's split (imdb.split_indices, the same rows as the default run) as
three CSVs with a 4-class label (1-2, 3-4, 7-8, 9-10) and the binary one (neg, pos) under
--work (default data/imdb-ratings/, git-ignored: IMDB text is never committed), then trains the
same model on the same rows twice through `train.py --data`, once per label column, and
writes the table (accuracy, macro-F1, the majority class's) to --table.

    python scripts/imdb_ratings.py --model minilm --train-size 2000 --max-length 128 --pack
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fastpt.inputs import imdb  # noqa: E402

CLASSES = {1: "1-2", 2: "1-2", 3: "3-4", 4: "3-4", 7: "7-8", 8: "7-8", 9: "9-10", 10: "9-10"}


def write_csvs(data_dir, work: Path) -> dict:
    """{split: csv path}: the article's split, each review with its rating class and sentiment."""
    reviews = imdb.read_reviews(imdb.find_source(data_dir))
    work.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, idx in imdb.split_indices(len(reviews.keys)).items():
        paths[split] = work / f"{split}.csv"
        with open(paths[split], "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(["text", "rating", "stars", "sentiment"])
            for i in idx:
                rating = int(reviews.keys[i].rsplit("_", 1)[1].removesuffix(".txt"))
                w.writerow([reviews.texts[i].replace("<br />", " "), rating, CLASSES[rating],
                            "pos" if reviews.labels[i] else "neg"])
    return paths


def head_labels(path: Path, column: str, n) -> list:
    with open(path, newline="", encoding="utf-8") as f:
        labels = [row[column] for row in csv.DictReader(f)]
    return labels[:n] if n else labels


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", default=None, help="IMDB's tarball or folder (default: $FASTPT_DATA_DIR)")
    p.add_argument("--work", default="data/imdb-ratings", help="where the CSVs and runs go (not committed)")
    p.add_argument("--table", default="scripts/results/imdb-ratings-cpu.md")
    p.add_argument("--train-size", type=int, default=None)
    p.add_argument("--val-size", type=int, default=None)
    p.add_argument("--test-size", type=int, default=None)
    args, train_flags = p.parse_known_args()  # the rest goes to train.py (--model, --max-length, ...)
    work = Path(args.work)
    paths = write_csvs(args.data_dir, work)
    sizes = [f"--{k}-size={v}" for k, v in (("train", args.train_size), ("val", args.val_size),
                                            ("test", args.test_size)) if v]
    rows = []
    for column in ("stars", "sentiment"):
        out = work / f"run-{column}"
        cmd = [sys.executable, str(ROOT / "train.py"), "--data", str(paths["train"]), "--val-data",
               str(paths["validation"]), "--test-data", str(paths["test"]), "--text-column", "text",
               "--label-column", column, "--out", str(out), "--overwrite", "--no-progress", *sizes, *train_flags]
        start = time.perf_counter()
        subprocess.run(cmd, check=True)
        wall = time.perf_counter() - start
        results = json.loads((out / "results.json").read_text())
        test = head_labels(paths["test"], column, args.test_size)
        majority, count = Counter(test).most_common(1)[0]
        k = len(set(test))
        rows.append((column, k, results["test_acc"], results["test_macro_f1"], count / len(test),
                     (1 / k) * (2 * (count / len(test)) / (1 + count / len(test))), results["test_examples"],
                     results["train_examples"], wall))
    lines = ["# IMDB star ratings (4 classes) vs sentiment (2), through `train.py --data`",
             "", f"`python scripts/imdb_ratings.py {' '.join(sys.argv[1:])}` on {len(rows)} runs; "
             "the same training, validation and test rows for both tasks (the article's split, first N of each).",
             "", "| task | classes | test acc | test macro-F1 | majority-class acc | majority-class macro-F1 "
             "| test rows | train rows | wall s |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for task, k, acc, f1, maj, maj_f1, n_test, n_train, wall in rows:
        name = "stars: 1-2 / 3-4 / 7-8 / 9-10" if task == "stars" else "sentiment: neg / pos"
        lines.append(f"| {name} | {k} | {acc:.4f} | {f1:.4f} | {maj:.4f} | {maj_f1:.4f} | {n_test} | {n_train} "
                     f"| {wall:.0f} |")
    Path(args.table).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
