"""The GPU check's run: the set-up checks, each row as its own process, then the report.

`run` checks the environment and the staged tokenizer, builds the token cache once with every core,
and hands the rows to the planner (plan.run_rows) with `launch_process` as the way to run one.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import sys
import time
from pathlib import Path

from bench_single import run_once

from .plan import DRY, GPU, ROOT, Budget, Mode, Row, choose_best_flags, plan_rows, row_command, run_rows
from .report import fmt, write_report
from .stage import TOKENIZER_PROBE, check_requirements_here


def launch_process(row: Row, timeout: float, mode: Mode, args) -> None:
    """One row as its own process (train.py, the probe or lightning_ref.py), with a timeout."""
    out = Path(args.runs_dir) / row.name
    (out / "probe.json").unlink(missing_ok=True)
    r = run_once(row.name, row_command(row, mode, args, out), out, timeout, env={"TOKENIZERS_PARALLELISM": "false"})
    row.wall_s = r.pop("process_wall_s")
    if row.kind == "probe" and (out / "probe.json").exists():
        row.probe = json.loads((out / "probe.json").read_text())
    if "failed" in r:
        row.status = f"failed: {r['failed']} after {row.wall_s:.0f} s"
        return
    row.result, row.status = r, "ok"
    sps = row.result.get("samples_per_s")
    print(f"[{row.name}] {f'{sps:.1f} samples/s, ' if sps else ''}{row.wall_s:.0f} s in all "
          f"(estimated {fmt(row.estimate_s, '.0f', ' s')})", flush=True)


def mark_missing_imports(rows: list[Row]) -> None:
    """Rows whose framework does not import here: skipped before the planner sees them."""
    for row in rows:
        needs = "lightning" if row.framework == "lightning" else "deepspeed" if "--deepspeed" in row.flags else None
        error = row.status == "pending" and needs and importable(needs)
        if error:
            row.status = f"skipped: {needs} does not import ({error})"


def build_token_cache(args, model: str, max_length: int) -> tuple[str, float]:
    """The tokenised splits, built before any row with every core (the fast tokenizer's threads)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    from fastpt.inputs import token_cache
    from fastpt.inputs.models import load_tokenizer

    start = time.perf_counter()
    _, path = token_cache.prepare_splits(args.data_dir, args.cache_dir, load_tokenizer(model), max_length)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    return str(path), time.perf_counter() - start


def check_tokenizer() -> str:
    """distilbert-base-uncased's tokenizer through Hugging Face alone (the staged cache offline)."""
    from transformers import AutoTokenizer

    text, expected = TOKENIZER_PROBE
    try:
        ids = AutoTokenizer.from_pretrained("distilbert-base-uncased")(text)["input_ids"]
    except Exception as e:  # noqa: BLE001 - reported, and the rows then fail on their own
        return f"FAILED: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return "ok (uncased BERT ids)" if ids == expected else f"FAILED: ids {ids}, expected {expected}"


def environment() -> dict:
    import platform

    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
           "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    for package in ("transformers", "lightning", "datasets", "deepspeed", "pyarrow", "huggingface_hub"):
        try:
            env[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            env[package] = None
    return env


@functools.cache
def importable(module: str) -> str | None:
    """None where `import module` works in a fresh interpreter, else the error's last line."""
    import subprocess

    done = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True)
    return None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["?"])[-1]


def run(args) -> int:
    mode = DRY if args.dry else GPU
    started = args.started_at or time.time()
    budget = Budget(started, args.budget or mode.budget_s)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.runs_dir = args.runs_dir or str(ROOT / "runs" / f"gpu_check-{mode.name}")
    notes = []
    env = environment()
    print("environment: " + ", ".join(f"{k} {v}" for k, v in env.items()), flush=True)
    if mode is GPU and env["device"] == "cpu":
        print("error: no CUDA GPU visible; use --dry for the CPU run", file=sys.stderr)
        return 2

    setup = {"tokenizer": check_tokenizer()}
    if args.stage and (Path(args.stage) / "wheels").is_dir():
        setup["staged_wheels"] = check_requirements_here(Path(args.stage) / "wheels")
    best_flags, best_note = choose_best_flags(args)
    notes.append(best_note)
    if mode is DRY:
        notes.append("dry run: a few steps of the tiny model on a CPU prove the script end to end; its speeds "
                     "(on a shared CPU, with warm compile caches) say nothing about a GPU")
        notes.append("dry run: the fp16 pairs run bfloat16 on both sides, since Lightning replaces 16-mixed "
                     "with bf16-mixed on a CPU")
        notes.append(f"dry run: --pack-multiple at most --max-length {DRY.max_length} (train.py requires it)")
    if args.no_compile:
        notes.append("--no-compile: every --compile / --compile-mode flag was left out")
    rows = plan_rows(args, best_flags)
    for step, result in setup.items():
        print(f"{step}: {result}", flush=True)

    try:
        cache_path, seconds = build_token_cache(args, mode.model[1], mode.max_length)
        setup["token_cache"] = f"{Path(cache_path).name}, ready in {seconds:.0f} s"
    except Exception as e:  # noqa: BLE001 - e.g. datasets missing: the report still says why
        setup["token_cache"] = f"FAILED: {type(e).__name__}: {' '.join(str(e).split())[:300]}"
        for row in rows:
            row.status = row.status if row.status != "pending" else "skipped: no token cache"
    print(f"token cache: {setup['token_cache']}", flush=True)
    mark_missing_imports(rows)
    run_rows(rows, mode, budget, functools.partial(launch_process, mode=mode, args=args))
    profile = next((r.probe.get("profile_table") for r in rows if r.probe.get("profile_table")), None)
    if profile:
        (out / "profile.txt").write_text(profile + "\n")
    write_report(out, mode, args, env, setup, notes, rows, time.time() - started)
    failed = [r.name for r in rows if r.status.startswith("failed")]
    probe = next((r for r in rows if r.kind == "probe" and r.status == "ok"), None)
    if probe is not None and not probe.probe.get("passed"):
        failed.append("best-probe (sync check)")
    print("\n" + (out / "gpu_check.md").read_text(), flush=True)  # the end of the output is what a remote call shows
    late = [r.name for r in rows if r.status.startswith("skipped for time")]  # not failures: the budget ran out
    print(f"written: {out}/gpu_check.md, gpu_check.json, gpu_check.png{', profile.txt' if profile else ''}"
          + (f"; failed: {', '.join(failed)}" if failed else "")
          + (f"; skipped for time: {', '.join(late)}" if late else ""), flush=True)
    return 1 if failed or any(str(v).startswith("FAILED") for v in setup.values()) else 0
