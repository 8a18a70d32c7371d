"""The GPU check's report: gpu_check.md (the table, the probe, the full run, the notes), gpu_check.json and
gpu_check.png, from the rows the run filled in."""

from __future__ import annotations

import json
import time
from pathlib import Path

from bench_single import bar_chart

from .plan import ARTICLE, ARTICLE_MINUTES, DRY, Mode, Row, measured_val_rate


def figures(row: Row, rows: list[Row], mode: Mode) -> dict:
    """What one row's table line shows; None where results.json lacks the figure."""
    r = row.result
    sps = r.get("samples_per_s") or None
    real_tps = r.get("real_tokens_per_s", r.get("tokens_per_s")) or None
    # MFU on real tokens: results.json's `mfu` counts real tokens where it has `real_tokens_per_s`;
    # before that it counted every computed token, padding included.
    mfu = r.get("mfu")
    if mfu is not None and "real_tokens_per_s" not in r:
        mfu = mfu * r["padding_efficiency"] if r.get("padding_efficiency") else None
    paired = next((p for p in rows if p.name == row.pair and p.status == "ok"), None)
    fp32 = next((p for p in rows if p.name == "fp32" and p.status == "ok"), None)
    val_rate = measured_val_rate(r, mode)
    return {
        "samples_per_s": sps, "real_tokens_per_s": real_tps, "mfu_real": mfu,
        "peak_memory_gib": r["peak_memory_bytes"] / 2**30 if r.get("peak_memory_bytes") else None,
        "first_step_s": r.get("first_step_s"), "compile_time_s": r.get("compile_time_s"),
        "article_train_min": ARTICLE["epochs"] * ARTICLE["train"] / sps / 60 if sps else None,
        "article_val_min": ARTICLE["epochs"] * ARTICLE["validation"] / val_rate / 60 if val_rate else None,
        "fastpt_over_lightning": (paired.result["samples_per_s"] / sps
                                  if paired and sps and paired.result.get("samples_per_s") else None),
        "over_fp32": sps / fp32.result["samples_per_s"] if fp32 and sps and fp32.result.get("samples_per_s") else None,
        "samples_per_s_note": r.get("samples_per_s_note"),
    }


def fmt(value, spec: str, suffix: str = "") -> str:
    return "–" if value is None else f"{format(value, spec)}{suffix}"


def write_report(out: Path, mode: Mode, args, env: dict, setup: dict, notes: list[str], rows: list[Row],
                 wall_s: float) -> None:
    table = {r.name: figures(r, rows, mode) for r in rows if r.status == "ok" and r.kind == "measure"}
    lines = [f"# GPU check ({mode.name})", "",
             f"`bash scripts/gpu_check.sh{' --dry' if mode is DRY else ''}`, "
             f"{time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())}, {wall_s:.0f} s of a "
             f"{args.budget or mode.budget_s:.0f} s "
             f"budget. Machine: {env['device']}, Python {env['python']}, torch {env['torch']}, transformers "
             f"{env['transformers']}, Lightning {env['lightning']}, datasets {env['datasets']}, "
             f"DeepSpeed {env['deepspeed']}.", "",
             f"Model: `{' '.join(mode.model)}`, {mode.max_length} tokens, batch {ARTICLE['batch_size']}, "
             f"{mode.steps} training steps per row (3 warm-up steps left out of the rates), "
             f"{mode.val_size} validation reviews. Articles: {ARTICLE_MINUTES}.", "",
             "Set-up: " + "; ".join(f"{k.replace('_', ' ')}: {v}" for k, v in setup.items()) + ".", ""]
    lines += ["| row | framework | flags | samples/s | real tokens/s | MFU (real tokens) | peak memory | "
              "first step (compile) | article train, 3 x 35k | article validation, 3 x 5k | fastpt / Lightning | "
              "vs fp32 |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.kind != "measure":
            continue
        flags = f"`{' '.join(r.flags) or '(none)'}`"
        if r.name not in table:
            lines.append(f"| {r.name} | {r.framework} | {flags} | {r.status} | | | | | | | | |")
            continue
        f = table[r.name]
        first = fmt(f["first_step_s"], ".1f", " s") + (f" ({f['compile_time_s']:.1f} s)" if f["compile_time_s"] else "")
        lines.append(f"| {r.name} | {r.framework} | {flags} | {fmt(f['samples_per_s'], '.1f')} | "
                     f"{fmt(f['real_tokens_per_s'], '.0f')} | "
                     f"{fmt(f['mfu_real'] and 100 * f['mfu_real'], '.1f', '%')} | "
                     f"{fmt(f['peak_memory_gib'], '.2f', ' GiB')} | {first} | "
                     f"{fmt(f['article_train_min'], '.2f', ' min')} | "
                     f"{fmt(f['article_val_min'], '.2f', ' min')} | {fmt(f['fastpt_over_lightning'], '.2f', 'x')} | "
                     f"{fmt(f['over_fp32'], '.2f', 'x')} |")
    lines += ["", "Rates are over the steps after warm-up; article times extrapolate them to the articles' run "
              "(training and validation apart; compile, start-up and test excluded). fastpt / Lightning: samples/s "
              "of the pair run back to back, on the Lightning row. MFU counts real (non-padding) tokens against the "
              "GPU's dense peak for the precision; – where a figure is not in results.json."]
    lines += probe_section(rows) + full_run_section(rows, mode)
    statuses = [f"{r.name}: {r.status}" for r in rows if r.status != "ok"]
    lines += ["", "## Notes", ""] + [f"- {n}" for n in notes + statuses]
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")
    (out / "gpu_check.json").write_text(json.dumps({
        "mode": mode.name, "wall_s": wall_s, "environment": env, "setup": setup, "notes": notes,
        "rows": [{"name": r.name, "framework": r.framework, "flags": r.flags, "kind": r.kind, "status": r.status,
                  "wall_s": r.wall_s, "estimate_s": r.estimate_s, "figures": table.get(r.name),
                  "probe": {k: v for k, v in r.probe.items() if k != "profile_table"},
                  "results": {k: v for k, v in r.result.items() if k not in ("history", "config", "memory_per_rank")}}
                 for r in rows]}, indent=2, default=str) + "\n")
    chart = [{"name": r.name, "samples_per_s": table[r.name]["samples_per_s"]} if r.name in table
             and table[r.name]["samples_per_s"] else {"name": r.name, "failed": r.status}
             for r in rows if r.kind == "measure"]
    bar_chart(chart, out / "gpu_check.png", f"{' '.join(mode.model)}, batch 12, {mode.max_length} tokens ({mode.name})")


def probe_section(rows: list[Row]) -> list[str]:
    row = next((r for r in rows if r.kind == "probe"), None)
    if row is None:
        return []
    lines = ["", "## Steady state of the best configuration", ""]
    p = row.probe
    if not p:
        return lines + [f"Probe: {row.status}."]
    verdict = ("passed: no synchronising call" if p.get("passed") else
               f"FAILED: {p.get('error') or 'the window did not complete'}")
    lines.append(f"Sync debug mode `{p.get('sync_debug')}` over optimiser steps {p.get('sync_window')}: {verdict}. "
                 f"Profiled steps {p.get('profile_window')}, top entries by {p.get('profile_sort')} "
                 f"(all of them in profile.txt):")
    table = (p.get("profile_table") or "").splitlines()
    return lines + ["", "```", *table[:16], "```"] if table else lines


def full_run_section(rows: list[Row], mode: Mode) -> list[str]:
    row = next((r for r in rows if r.kind == "full"), None)
    if row is None:
        return []
    lines = ["", "## The best configuration's full run", ""]
    if row.status != "ok":
        return lines + [f"{row.status}."]
    r = row.result
    epochs, n = ARTICLE["epochs"], mode.full
    return lines + [
        f"{epochs} epochs of {n['train']:,} reviews, validation on {n['validation']:,} after each, test on "
        f"{n['test']:,}: {row.wall_s:.1f} s end to end (process start to exit; estimated "
        f"{fmt(row.estimate_s, '.0f', ' s')}); training with validation "
        f"(train_time_s) {fmt(r.get('train_time_s'), '.1f', ' s')}, of which compile "
        f"{fmt(r.get('compile_time_s'), '.1f', ' s')} "
        f"(first step {fmt(r.get('first_step_s'), '.1f', ' s')}); without compile "
        f"{fmt(r.get('train_time_no_compile_s'), '.1f', ' s')}; validation {fmt(r.get('val_time_s'), '.1f', ' s')} "
        f"({fmt(r.get('val_time_no_compile_s'), '.1f', ' s')} without compile); "
        f"{fmt(r.get('samples_per_s'), '.1f')} samples/s; test accuracy {fmt(r.get('test_acc'), '.4f')} "
        f"(random weights: not the article's accuracy). Goal: under 30 s on one H200."]
