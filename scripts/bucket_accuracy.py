"""Do `--bucket` or `--pack` cost accuracy? Random padded batches against length-grouped or
packed batches, trained side by side over several seeds.

    python scripts/bucket_accuracy.py                          # MiniLM, 2000/500/1000 reviews, 256 tokens,
                                                               # 2 epochs, bf16, 3 seeds: ~75 min on 2 cores
    python scripts/bucket_accuracy.py --multipliers 50 10      # also a smaller mega-batch
    python scripts/bucket_accuracy.py --multipliers --pack     # random batches against --pack only
    python scripts/bucket_accuracy.py --preset smoke --data-dir DIR --seeds 1 2   # tiny model (tests)

A single pair of runs cannot answer the question: on a few thousand reviews, one seed's batch
order moves the test accuracy by several points on its own. So every seed trains the same
model on the same reviews once with random batches, once per bucketing multiplier and, with
--pack, once with packed batches; the seed fixes the classifier's initialisation, dropout and
the shuffle, and bucketing then regroups that same shuffle (packing keeps it: the same reviews
in the same batches, without padding and without attention dropout). The report gives each run's
test accuracy (best checkpoint on
validation, as the articles test), the mean and standard deviation per configuration, and the
per-seed difference from plain batching with its mean and standard deviation: bucketing is
within noise when that mean difference is small next to the spread between seeds.

Each run is a real `train.py` process; a run whose results.json exists from the same command is
reused unless --force, so an interrupted grid resumes where it stopped.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reproduce import ROOT, Run, Rung, data_args, default_data_dir, execute, machine  # noqa: E402

PRESETS = {
    "cpu": ("pretrained MiniLM-L6, the first 2000/500/1000 reviews of the article split, 256 tokens, batch 12, "
            "2 epochs, bf16 autocast",
            ("--model", "minilm", "--max-length", "256", "--epochs", "2", "--train-size", "2000",
             "--val-size", "500", "--test-size", "1000", "--amp", "--amp-dtype", "bfloat16")),
    "smoke": ("2-layer 64-wide DistilBERT (random init), 32 tokens, batch 8, 2 epochs (tests only)",
              ("--model", "tiny", "--max-length", "32", "--batch-size", "8", "--epochs", "2",
               "--train-size", "64", "--val-size", "16", "--test-size", "32")),
}


def configurations(multipliers: list, pack: bool = False) -> list:
    """(key, label, flags): random batches first, then one bucketed configuration per multiplier, then --pack."""
    configs = [("plain", "random batches (as the article)", ())]
    for m in multipliers:
        configs.append((f"bucket-m{m}", f"`--bucket --bucket-multiplier {m}`",
                        ("--bucket", "--bucket-multiplier", str(m))))
    if pack:
        configs.append(("pack", "`--pack` (random batches, padding-free)", ("--pack",)))
    return configs


def plan(preset: str, seeds: list, multipliers: list, data_args: list, runs_dir: Path, pack: bool = False) -> list:
    """(seed, config key, Run), seed by seed, so a grid stopped early still holds complete pairs."""
    grid = []
    for seed in seeds:
        for key, label, flags in configurations(multipliers, pack):
            out = runs_dir / key / f"seed{seed}"
            command = [sys.executable, "train.py", *PRESETS[preset][1], *data_args, *flags, "--seed", str(seed),
                       "--out", str(out), "--overwrite", "--no-progress"]
            grid.append((seed, key, Run(Rung(f"{key} seed {seed}", label, flags), command, out, 1)))
    return grid


def _mean_sd(values: list, digits: int = 2) -> str:
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def report(grid: list, multipliers: list, preset: str, argv: list, padding: list = (), pack: bool = False) -> str:
    configs = configurations(multipliers, pack)
    seeds = sorted({seed for seed, _, _ in grid}, key=[s for s, _, _ in grid].index)
    res = {(seed, key): run.results for seed, key, run in grid if run.results}
    acc = {pair: 100 * results["test_acc"] for pair, results in res.items()}

    head = "| seed | " + " | ".join(f"{key} test acc (%)" for key, _, _ in configs) + " |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for seed in seeds:
        cells = [f"{acc[(seed, key)]:.2f}" if (seed, key) in acc else "failed / not run" for key, _, _ in configs]
        lines.append(f"| {seed} | " + " | ".join(cells) + " |")
    means = [_mean_sd([acc[(s, key)] for s in seeds if (s, key) in acc]) for key, _, _ in configs]
    lines.append("| mean ± sd | " + " | ".join(means) + " |")

    summary = ["| configuration | runs | test acc (%) | difference from plain, per seed (points) "
               "| best val acc (%) | padding efficiency | train time (min) |", "|---|---:|---:|---|---:|---:|---:|"]
    for key, label, _ in configs:
        done = [s for s in seeds if (s, key) in res]
        diffs = [acc[(s, key)] - acc[(s, "plain")] for s in done if (s, "plain") in acc]
        diff = "–" if key == "plain" else (
            _mean_sd(diffs) + " (" + ", ".join(f"{d:+.2f}" for d in diffs) + ")" if diffs else "–")
        summary.append(" | ".join([
            f"| {label}", str(len(done)), _mean_sd([acc[(s, key)] for s in done]), diff,
            _mean_sd([100 * res[(s, key)]["best_val_acc"] for s in done if res[(s, key)].get("best_val_acc")]),
            _mean_sd([res[(s, key)]["padding_efficiency"] for s in done if res[(s, key)].get("padding_efficiency")], 3),
            _mean_sd([res[(s, key)]["train_time_s"] / 60 for s in done])]) + " |")

    curves = ["| seed | configuration | " + " | ".join(f"val acc epoch {e}" for e in range(1, _epochs(res) + 1)) + " |"]
    curves.append("|" + "---|" * (curves[0].count("|") - 1))
    for seed in seeds:
        for key, _, _ in configs:
            if (seed, key) in res:
                vals = [f"{100 * h['val_acc']:.2f}" for h in res[(seed, key)].get("history", [])]
                curves.append(f"| {seed} | {key} | " + " | ".join(vals) + " |")

    return "\n".join([
        f"# Batching and accuracy, preset `{preset}`",
        "",
        f"- date: {time.strftime('%Y-%m-%d %H:%M %Z')}",
        f"- machine: {machine()}",
        f"- command: `python scripts/bucket_accuracy.py {shlex.join(argv)}`",
        f"- workload: {PRESETS[preset][0]}; every run: `{' '.join(PRESETS[preset][1])}`",
        "- test accuracy: the checkpoint with the best validation accuracy, on the test reviews; "
        "train time: training + validation (machine load varies, so compare it loosely)",
        "",
        "\n".join(lines),
        "",
        "\n".join(summary),
        "",
        "Validation accuracy after each epoch:",
        "",
        "\n".join(curves),
        "",
        *([f"Padding efficiency (real / computed tokens) on the whole training split ({padding[0][2]} reviews), "
           "512 tokens, batch of the preset:", "", "| batching | real / computed tokens |", "|---|---:|",
           *(f"| {label} | {value:.3f} |" for label, value, _ in padding), ""] if padding else []),
    ])


def _flag(preset: str, name: str, default: str) -> str:
    """The value the preset passes for a train.py flag, or train.py's default."""
    flags = PRESETS[preset][1]
    return flags[flags.index(name) + 1] if name in flags else default


def full_split_padding(preset: str, data_dir, cache_dir, multipliers: list) -> list:
    """(label, real / computed tokens, reviews) on the whole training split at 512 tokens, per batching.

    The runs above train on a subset at a shorter length; this is what each multiplier pads on
    the articles' full workload, so that the accuracy and the padding can be weighed together.
    """
    from bench_single import split_padding

    r = split_padding(data_dir, cache_dir, _flag(preset, "--model", ""), int(_flag(preset, "--batch-size", "12")),
                      multipliers)
    rows = [("random batches, padded to 512", r["pad_to_512"]),
            ("random batches, padded to their longest", r["random_batches_to_longest"])]
    rows += [(f"`--bucket --bucket-multiplier {m}`", value) for m, value in r["bucket_by_multiplier"].items()]
    return [(label, value, r["examples"]) for label, value in rows]


def load_existing(run: Run) -> None:
    """The results of a run this script finished earlier with the same command, if any."""
    stamp, results = run.out / "reproduce.json", run.out / "results.json"
    if stamp.exists() and results.exists() and json.loads(stamp.read_text()).get("command") == run.command[1:]:
        run.results = json.loads(results.read_text())


def _epochs(res: dict) -> int:
    return max((len(r.get("history", [])) for r in res.values()), default=0)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="cpu", choices=sorted(PRESETS))
    p.add_argument("--seeds", type=int, nargs="+", default=[123, 7, 1])
    p.add_argument("--multipliers", type=int, nargs="*", default=[50],
                   help="--bucket-multiplier values to compare with random batches (default: 50, fastpt's default; "
                        "none: no bucketed runs)")
    p.add_argument("--pack", action="store_true", help="also train with --pack (padding-free batches)")
    p.add_argument("--data-dir", default=None, help="IMDB data (default: $FASTPT_DATA_DIR, ./data or ../shared/data)")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--runs-dir", default=None, help="run folders (default: runs/bucket-accuracy-<preset>)")
    p.add_argument("--report", default=None,
                   help="Markdown report (default: scripts/results/bucket-accuracy-<preset>.md)")
    p.add_argument("--force", action="store_true", help="rerun configurations whose results exist")
    p.add_argument("--only", default=None,
                   help="comma-separated configuration keys to run (plain, bucket-mN, pack); the others are "
                        "reported where their results exist")
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if len(set(args.seeds)) != len(args.seeds) or any(m < 1 for m in args.multipliers):
        print("error: --seeds must be distinct and --multipliers at least 1", file=sys.stderr)
        return 2
    data_dir = args.data_dir or default_data_dir()
    data_flags = data_args(data_dir, args.cache_dir)
    runs_dir = Path(args.runs_dir or ROOT / "runs" / f"bucket-accuracy-{args.preset}").resolve()
    multipliers = list(dict.fromkeys(args.multipliers))
    grid = plan(args.preset, args.seeds, multipliers, data_flags, runs_dir, args.pack)
    report_path = Path(args.report or ROOT / "scripts" / "results" / f"bucket-accuracy-{args.preset}.md")
    report_path.parent.mkdir(parents=True, exist_ok=True)
    only = set(args.only.split(",")) if args.only else None
    for _, key, run in grid:
        if only is None or key in only:
            execute(run, args.force)
        else:
            load_existing(run)
        report_path.write_text(report(grid, multipliers, args.preset, argv, pack=args.pack))  # partial: readable
    padding = full_split_padding(args.preset, data_dir, args.cache_dir, multipliers)
    md = report(grid, multipliers, args.preset, argv, padding, args.pack)
    report_path.write_text(md)
    print(md)
    print(f"written: {report_path}")
    return 0 if all(run.results for _, key, run in grid if only is None or key in only) else 1


if __name__ == "__main__":
    sys.exit(main())
