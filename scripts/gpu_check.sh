#!/usr/bin/env bash
# One prepared GPU check: the article's configurations on the full-size architecture, timed.
#
#   scripts/gpu_check.sh --data-dir DIR          # on a CUDA machine (no internet needed), < 8 min
#   scripts/gpu_check.sh --dry --data-dir DIR    # tiny model, few steps, CPU: proves the script end to end
#
# What it runs (each a real train.py run for a bounded number of steps, via bench_single.py):
#   distilbert-base-uncased architecture (--random-init: speed does not depend on the weights),
#   sequence 512, batch 12: the article's fp32 baseline, --amp (16-mixed), --amp --compile, and
#   fastpt's best (--amp --compile --bucket --tf32); then --ddp, --fsdp and --deepspeed under
#   torchrun on every GPU of the machine (skipped, with a note, on a single GPU).
# What it writes: a Markdown table per part under --out (default scripts/results/gpu_check-<mode>/),
#   with samples/s, MFU, peak memory and the time-to-train extrapolated to the article's
#   3 epochs of 35,000 reviews (training steps only), plus the padding efficiency at 512 tokens.
# Assumes: the repository's venv / requirements installed (python on PATH is that venv's), and the
#   IMDB data at --data-dir or $FASTPT_DATA_DIR (the token cache is built on first use, ~1 min).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DATA_DIR="${FASTPT_DATA_DIR:-}"
DRY=0
STEPS=""
OUT=""
PYTHON="${PYTHON:-python}"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry) DRY=1; shift ;;
    --data-dir) DATA_DIR="$2"; shift 2 ;;
    --steps) STEPS="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "error: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
if [[ -z "$DATA_DIR" ]]; then
  echo "error: pass --data-dir DIR or set FASTPT_DATA_DIR (the folder with the IMDB tarball)" >&2
  exit 2
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
cd "$ROOT"
START=$SECONDS
BUDGET=450  # seconds for the single-device part; the whole check stays under 8 minutes

if [[ $DRY -eq 1 ]]; then
  MODE=dry
  BUDGET=3600  # the 8-minute bound is the GPU's; a loaded CPU may need longer to compile
  MODEL=(--model tiny --max-length 64 --device cpu)
  STEPS="${STEPS:-6}"
  SINGLE="fp32,fp16,bf16-compile-bucket"
  NGPU=0
  NPROC=2  # two gloo processes on the CPU prove the torchrun path
else
  MODE=gpu
  MODEL=(--model distilbert-base-uncased --random-init --max-length 512 --device cuda)
  STEPS="${STEPS:-40}"
  SINGLE="fp32,fp16,fp16-compile,best"
  NGPU="$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')"
  if [[ "$NGPU" -lt 1 ]]; then
    echo "error: no CUDA GPU visible; use --dry for the CPU run" >&2
    exit 2
  fi
  NPROC="$NGPU"
  "$PYTHON" -c 'import torch; [print(f"gpu {i}: {torch.cuda.get_device_name(i)}") for i in range(torch.cuda.device_count())]; print("torch", torch.__version__, "cuda", torch.version.cuda)'
fi
OUT="${OUT:-$ROOT/scripts/results/gpu_check-$MODE}"
mkdir -p "$OUT"
COMMON=("${MODEL[@]}" --batch-size 12 --steps "$STEPS" --data-dir "$DATA_DIR" --runs-dir "$ROOT/runs/gpu_check-$MODE")

echo "== single device: the article's configurations and fastpt's best ($STEPS steps each)"
"$PYTHON" scripts/bench_single.py "${COMMON[@]}" --configs "$SINGLE" --deadline "$BUDGET" \
  --out "$OUT/single" --title "Single device ($MODE)" || echo "note: a single-device configuration failed (see above)"

MULTI_NOTE=""
if [[ $DRY -eq 1 || "$NGPU" -gt 1 ]]; then
  LEFT=$(( BUDGET + 10 - (SECONDS - START) ))
  echo "== multi-process: --ddp, --fsdp, --deepspeed under torchrun on $NPROC processes (${LEFT}s left)"
  "$PYTHON" scripts/bench_single.py "${COMMON[@]}" --configs ddp-fp16,fsdp-fp16,deepspeed-fp16 --nproc "$NPROC" \
    --deadline "$LEFT" --run-timeout 150 --no-padding-report --out "$OUT/multi" --title "Multi-process ($MODE, $NPROC processes)" \
    || echo "note: a multi-process configuration failed (see above)"
else
  MULTI_NOTE="Multi-process (--ddp, --fsdp, --deepspeed): skipped, this machine has one GPU."
  echo "== $MULTI_NOTE"
fi

{
  echo "# GPU check ($MODE)"
  echo
  echo "Command: \`scripts/gpu_check.sh $([[ $DRY -eq 1 ]] && echo '--dry ')--data-dir $DATA_DIR\`, $(date -u +%Y-%m-%dT%H:%MZ), $((SECONDS - START)) s."
  echo "Article (A100): fp32 22.63 min, 16-mixed 8.75 min, DDP 4xA100 3.52 min, DeepSpeed ZeRO-2 3.15 min, FSDP 3.62 min (3 epochs incl. validation)."
  echo
  cat "$OUT/single/bench.md"
  echo
  if [[ -n "$MULTI_NOTE" ]]; then echo "$MULTI_NOTE"; else cat "$OUT/multi/bench.md"; fi
} > "$OUT/gpu_check.md"
echo "written: $OUT/gpu_check.md ($((SECONDS - START)) s)"
