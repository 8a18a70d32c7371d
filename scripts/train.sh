#!/usr/bin/env bash
# The first command a newcomer runs: set up .venv if needed, then run train.py with the given flags
# (none: the article's baseline).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${FASTPT_VENV:-.venv}/bin/python" train.py "$@"
