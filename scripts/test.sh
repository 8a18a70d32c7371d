#!/usr/bin/env bash
# Run it after a change: set up .venv if needed (runtime, then what the tests need), then run the test
# suite on the CPU, offline (arguments go to pytest: -m slow for the longer end-to-end tests).
# Uses the real IMDB data for the opt-in checks when ../shared/data (or FASTPT_DATA_DIR) has it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
venv="${FASTPT_VENV:-.venv}"
stamp="$venv/.fastpt-test-installed"
want="$(cat requirements-dev.txt requirements-peers.txt)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  # pytest, matplotlib and Lightning (the peer comparison the tests run); the ranges keep the installed torch.
  "$venv/bin/python" -m pip install -q -r requirements-dev.txt
  printf '%s' "$want" > "$stamp"
fi
if [ -z "${FASTPT_DATA_DIR:-}" ] && [ -d ../shared/data ]; then
  export FASTPT_DATA_DIR="$(cd ../shared/data && pwd)"
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export FASTPT_CACHE_DIR="${FASTPT_CACHE_DIR:-$PWD/.cache/fastpt}"
exec "$venv/bin/python" -m pytest "$@"
