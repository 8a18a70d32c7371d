#!/usr/bin/env bash
# The prepared GPU check: fastpt's best, its full run and its steady-state probe, then the articles'
# configurations by fastpt and by Lightning, on one CUDA GPU, in under 8 minutes (rows that would not
# finish in the time left are skipped for time, most valuable first). Run it when a CUDA GPU is at hand;
# `--dry` proves it on the CPU first.
#
#   bash scripts/gpu_check.sh --out DIR                  # any machine with one CUDA GPU and fastpt's requirements
#   bash scripts/gpu_check.sh --stage .stage --out DIR   # the offline GPU machine, after scripts/device_stage.sh
#   bash scripts/gpu_check.sh --dry [--offline]          # here, on the CPU: stages, then runs it all (tiny model)
#
# Steps: (1) --dry only: scripts/device_stage.sh into --stage (default .stage); (2) the staged
# wheels go into a target folder on PYTHONPATH (pip --no-index --no-deps; in --dry, those this
# Python can install: the cp312 ones are left to the GPU machine); (3) the staged tokenizer
# becomes the Hugging Face cache (HF_HUB_CACHE) and the staged tarball the data; (4)
# python scripts/gpu_check run: token cache with every core, then every row within the budget.
# Writes to --out (default scripts/results/gpu_check-<gpu|dry>): gpu_check.md, gpu_check.json,
# gpu_check.png, profile.txt and this script's log, gpu_check.log. Other arguments
# (--rows, --budget, --best-flags, --no-compile, --data-dir) go to `python scripts/gpu_check run`.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STARTED_AT="$(date +%s.%N)"
DRY=0
STAGE=""
OUT=""
STAGE_ARGS=()
DRIVER_ARGS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry) DRY=1; shift ;;
    --stage) STAGE="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --no-wheels|--offline) STAGE_ARGS+=("$1"); shift ;;
    --wheel-cache) STAGE_ARGS+=(--wheel-cache "$2"); shift 2 ;;
    --data-dir) STAGE_ARGS+=(--data-dir "$2"); DRIVER_ARGS+=(--data-dir "$2"); shift 2 ;;
    --rows|--budget|--best-flags|--cache-dir|--runs-dir) DRIVER_ARGS+=("$1" "$2"); shift 2 ;;
    --no-compile) DRIVER_ARGS+=("$1"); shift ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "error: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
MODE=$([[ $DRY -eq 1 ]] && echo dry || echo gpu)
OUT="$(mkdir -p "${OUT:-$ROOT/scripts/results/gpu_check-$MODE}" && cd "${OUT:-$ROOT/scripts/results/gpu_check-$MODE}" && pwd)"
if [[ $DRY -eq 1 ]]; then
  STAGE="${STAGE:-$ROOT/.stage}"
  if [[ -n "${PYTHON:-}" ]]; then PY="$PYTHON"; elif [[ -x "$ROOT/.venv/bin/python" ]]; then PY="$ROOT/.venv/bin/python"; else PY=python3; fi
else
  PY="${PYTHON:-python3}"
fi
export PYTHON="$PY"

check() {
  cd "$ROOT"
  echo "== gpu_check ($MODE), $(date -u +%Y-%m-%dT%H:%M:%SZ), python: $PY"
  if [[ $DRY -eq 1 ]]; then
    echo "== staging, as for the GPU machine: scripts/device_stage.sh --stage $STAGE ${STAGE_ARGS[*]}"
    bash scripts/device_stage.sh --stage "$STAGE" "${STAGE_ARGS[@]}"
  fi
  if [[ -n "$STAGE" ]]; then
    STAGE="$(cd "$STAGE" && pwd)"
    local wheels=()
    if compgen -G "$STAGE/wheels/*.whl" >/dev/null; then
      mapfile -t wheels < <("$PY" scripts/gpu_check wheels --installable "$STAGE/wheels")
    fi
    if [[ ${#wheels[@]} -gt 0 ]]; then
      SITE="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check-site.XXXXXX")"
      trap 'rm -rf "$SITE"' EXIT
      echo "== installing ${#wheels[@]} staged wheels into $SITE"
      "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}"
      export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    fi
    if [[ -d "$STAGE/hf/hub" ]]; then export HF_HUB_CACHE="$STAGE/hf/hub"; fi
    if compgen -G "$STAGE/data/*.tar.gz" >/dev/null; then DRIVER_ARGS=(--data-dir "$STAGE/data" "${DRIVER_ARGS[@]}"); fi
    DRIVER_ARGS+=(--stage "$STAGE")
  fi
  if [[ -n "$STAGE" || $DRY -eq 1 ]]; then export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1; fi
  export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 HF_DATASETS_DISABLE_PROGRESS_BARS=1
  if [[ $DRY -eq 0 ]]; then
    export FASTPT_CACHE_DIR="${FASTPT_CACHE_DIR:-$ROOT/.cache/fastpt}"
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv || true
  fi
  "$PY" scripts/gpu_check run $([[ $DRY -eq 1 ]] && echo --dry) --out "$OUT" --started-at "$STARTED_AT" "${DRIVER_ARGS[@]}"
}

set -o pipefail
check 2>&1 | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
