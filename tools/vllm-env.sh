#!/usr/bin/env bash
# Create (once) and use the CPU test environment for the runtime shim: the real vllm==0.33.0 from
# PyPI plus this project installed editable without its dependencies. The venv lives OUTSIDE the
# clone so repeated runs (and CI caches) reuse it.
#
#   bash tools/vllm-env.sh                      # create or reuse; print the venv path
#   bash tools/vllm-env.sh pytest -q tests/shim -m vllm
#   bash tools/vllm-env.sh python -c 'import vllm'
#
# Env: LUCIFER_VLLM_VENV (default ~/.cache/lucifer-shard/vllm-0.33.0), LUCIFER_VLLM_VERSION
# (default 0.33.0), PYTHON (interpreter for the venv, default python3; needs 3.11..3.14).
set -euo pipefail

VLLM_VERSION="${LUCIFER_VLLM_VERSION:-0.33.0}"
VENV="${LUCIFER_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/lucifer-shard/vllm-${VLLM_VERSION}}"
PY="${PYTHON:-python3}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BASE_STAMP="$VENV/.lucifer-base-ok"        # vllm + test deps installed
PROJ_STAMP="$VENV/.lucifer-project"        # which clone (and pyproject) is installed editable

log() { echo "vllm-env: $*" >&2; }
# pip's output goes to a log (this machine's pip.conf adds noisy find-links); shown on failure.
pip_q() {
  local logf="$VENV.pip.log"
  if ! "$VENV/bin/python" -m pip "$@" >>"$logf" 2>&1; then
    grep -v 'is ignored: it is neither a file nor a directory' "$logf" | tail -40 >&2
    log "pip $* failed (full log: $logf)"
    return 1
  fi
}

case "$ROOT" in
  "$VENV"|"$VENV"/*) log "refusing: the venv $VENV must live outside the clone $ROOT"; exit 2;;
esac
case "$VENV" in
  "$ROOT"/*) log "refusing: LUCIFER_VLLM_VENV=$VENV is inside the clone $ROOT; put it outside"; exit 2;;
esac

if [ ! -f "$BASE_STAMP" ] || [ "$(cat "$BASE_STAMP")" != "vllm==$VLLM_VERSION" ]; then
  start=$(date +%s)
  log "creating $VENV (vllm==$VLLM_VERSION, several GB, a few minutes)"
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  "$PY" -m venv "$VENV"
  : > "$VENV.pip.log"
  pip_q install -q --upgrade pip
  # vllm brings torch, safetensors, numpy, huggingface_hub and tqdm; the rest are this project's
  # and the tests' own needs.
  pip_q install -q "vllm==$VLLM_VERSION" "pytest>=8" "blake3>=0.4" "click>=8.1"
  echo "vllm==$VLLM_VERSION" > "$BASE_STAMP"
  rm -f "$PROJ_STAMP"
  log "created in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1) on disk"
fi

# The editable install records the clone path and the entry points of pyproject.toml: redo it when
# either changes (another clone, a new entry point).
want="$ROOT $(sha256sum "$ROOT/pyproject.toml" | cut -c1-16)"
if [ ! -f "$PROJ_STAMP" ] || [ "$(cat "$PROJ_STAMP")" != "$want" ]; then
  log "installing $ROOT editable (--no-deps)"
  pip_q install -q --no-deps --no-build-isolation -e "$ROOT" || pip_q install -q --no-deps -e "$ROOT"
  echo "$want" > "$PROJ_STAMP"
fi

if [ $# -eq 0 ]; then
  echo "$VENV"
  exit 0
fi
cd "$ROOT"
export PATH="$VENV/bin:$PATH" VIRTUAL_ENV="$VENV" LUCIFER_VLLM_ENV=1
exec "$@"
