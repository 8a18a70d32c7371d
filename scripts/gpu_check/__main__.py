"""The GPU check's command line, `python scripts/gpu_check SUBCOMMAND`; scripts/gpu_check.sh and
scripts/device_stage.sh call it, a user runs those.

    run               every row within the budget, then the report (see __init__.py)
    stage-tokenizer   write distilbert-base-uncased's tokenizer as an offline Hugging Face cache entry
    wheels            the staged wheels: which install here (--installable), their requirements
                      against the GPU machine's packages (--check-gpu-machine)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent
# `python scripts/gpu_check` puts this folder first on the path: import it as the package it is instead,
# beside bench_single.py, with the repository's fastpt and train.py.
sys.path[0:1] = [str(SCRIPTS), str(SCRIPTS.parent)]

from gpu_check import stage  # noqa: E402
from gpu_check.run import run  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/gpu_check", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="every row, within the budget; the report")
    r.add_argument("--out", required=True)
    r.add_argument("--dry", action="store_true", help="CPU, tiny model, few steps")
    r.add_argument("--data-dir", default=os.environ.get("FASTPT_DATA_DIR"))
    r.add_argument("--cache-dir", default=None)
    r.add_argument("--runs-dir", default=None, help="the runs' own folders (default runs/gpu_check-<mode>)")
    r.add_argument("--stage", default=None, help="the staged folder, for the wheels' requirement check")
    r.add_argument("--budget", type=float, default=None, help="seconds for the whole check (default 470; dry 1800)")
    r.add_argument("--started-at", type=float, default=None, help="epoch seconds the check started (the wrapper's)")
    r.add_argument("--rows", default=None, help="comma-separated subset of the rows, in run order")
    r.add_argument("--best-flags", default=None, help="train.py flags of the best row (default plan.BEST_FLAGS)")
    r.add_argument("--no-compile", action="store_true", help="leave --compile out of every row (a quick dry run)")
    t = sub.add_parser("stage-tokenizer", help="write the tokenizer as an offline Hugging Face cache entry")
    t.add_argument("hub_cache")
    w = sub.add_parser("wheels", help="the staged wheels: which install here, and their requirements")
    w.add_argument("wheels_dir")
    w.add_argument("--installable", action="store_true", help="print the wheels this interpreter can install")
    w.add_argument("--check-gpu-machine", action="store_true",
                   help="check the requirements against the GPU machine's packages (Python 3.12); exit 1 if unmet")
    args = p.parse_args(argv)
    if args.command == "run":
        return run(args)
    if args.command == "stage-tokenizer":
        print(stage.stage_tokenizer(Path(args.hub_cache)))
        return 0
    wheels_dir = Path(args.wheels_dir)
    if args.installable:
        fits, others = stage.installable_wheels(wheels_dir)
        print("\n".join(map(str, fits)))
        if others:
            print(f"note: left to the GPU machine's Python 3.12: {' '.join(w.name for w in others)}", file=sys.stderr)
        return 0
    problems, unverified = stage.check_requirements(wheels_dir, stage.gpu_machine_version, stage.GPU_MACHINE_MARKERS)
    for line in problems:
        print(f"error: {line}", file=sys.stderr)
    if not problems:
        print(f"requirements: every requirement of the {len(list(wheels_dir.glob('*.whl')))} staged wheels is "
              f"staged or on the GPU machine (versions known for {', '.join(sorted(stage.GPU_MACHINE_VERSIONS))})")
    if unverified:
        print(f"versions checked on the GPU machine after the install: {'; '.join(unverified)}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
