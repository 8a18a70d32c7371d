#!/usr/bin/env bash
# Set up .venv if needed, then run the test suite on the CPU, offline.
# Uses the real IMDB data for the opt-in checks when ../shared/data (or FASTPT_DATA_DIR) has it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ -z "${FASTPT_DATA_DIR:-}" ] && [ -d ../shared/data ]; then
  export FASTPT_DATA_DIR="$(cd ../shared/data && pwd)"
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export FASTPT_CACHE_DIR="${FASTPT_CACHE_DIR:-$PWD/.cache/fastpt}"
exec "${FASTPT_VENV:-.venv}/bin/python" -m pytest "$@"
