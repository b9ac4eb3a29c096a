#!/bin/bash
# Runs the GPU test suite (tests/gpu, marker `gpu`) on an SM90 machine, from the checkout root:
#
#   GPU_TEST_CMD='bash tests/gpu/run.sh' TEST_MIN_S=300 bash .gpu/prepare.sh    # repeat until GPU_TESTS_DONE
#   bash tests/gpu/run.sh [-k NAME] [-x] ...                                    # standalone, kit already built
#
# prepare.sh (../shared/gpu/README.md) installs FlashInfer 0.7.2.post1 + tvm-ffi + blake3 into .gpu/.venv
# and builds the trimmed SM90 W4A16 module; this script then
#   1. makes lucifer_shard importable (editable install without downloads, else a symlinked path root),
#   2. writes $OUT/machine.txt (GPU, driver, CUDA, torch, FlashInfer versions as `key: value` lines),
#   3. runs pytest -m gpu tests/gpu, output teed to $OUT/gpu-tests.log; every test appends its figures to
#      $OUT/gpu-results.json ($LUCIFER_GPU_RESULTS),
#   4. renders the report once (into a scratch dir, not $OUT) and prints its verdict and a final status line.
# It writes exactly three files under $OUT (default /tmp/gpu-out): machine.txt, gpu-tests.log,
# gpu-results.json. Extra arguments go to pytest. Exit status: pytest's.
# Then, on the development machine:
#   python3 tests/gpu/report.py gpu-results.json machine.txt --log gpu-tests.log \
#       --build-status build_status.json -o docs/evidence/gpu-validation.md
set -uo pipefail
export PYTHONUNBUFFERED=1
ROOT=$(pwd)
if [ ! -f "$ROOT/pyproject.toml" ] || [ ! -d "$ROOT/tests/gpu" ]; then
  echo "[gpu-run] run me from the lucifer-shard checkout root (no pyproject.toml / tests/gpu here: $ROOT)"
  echo "GPU_TESTS_RESULT: FAIL (wrong directory)"
  exit 2
fi
KIT=$ROOT/.gpu
RES=${OUT:-/tmp/gpu-out}
mkdir -p "$RES"
export LUCIFER_GPU_RESULTS=${LUCIFER_GPU_RESULTS:-$RES/gpu-results.json}
rm -f "$LUCIFER_GPU_RESULTS"
SCRATCH=$(mktemp -d /tmp/lucifer-gpu.XXXXXX)
T0=$(date +%s)
log() { echo "[gpu-run $(( $(date +%s) - T0 ))s] $*"; }

# Standalone use (not under prepare.sh): the kit's site dir and sitecustomize (trimmed FlashInfer module).
if [ -d "$KIT/.venv" ]; then
  case ":${PYTHONPATH:-}:" in
    *":$KIT/.venv:"*) ;;
    *) export PYTHONPATH=$KIT:$KIT/.venv${PYTHONPATH:+:$PYTHONPATH} ;;
  esac
  export FLASHINFER_W4A16_TRIM=${FLASHINFER_W4A16_TRIM:-1}
  [ -d "$KIT/.fi_ws" ] && export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-$KIT/.fi_ws}
fi
export NCCL_NVLS_ENABLE=0

# 1. lucifer_shard importable. FLASHINFER_W4A16_TRIM=0: pip and the checks need no FlashInfer.
if FLASHINFER_W4A16_TRIM=0 python3 -m pip install -q --no-deps --no-build-isolation -e . >"$SCRATCH/pip-editable.txt" 2>&1 \
   && (cd /tmp && FLASHINFER_W4A16_TRIM=0 python3 -c "import lucifer_shard.proof.outdir") 2>/dev/null; then
  log "editable install OK"
else
  log "editable install failed or not importable; using src/ on PYTHONPATH (its folders are the import names); pip said:"
  tail -20 "$SCRATCH/pip-editable.txt" || true
  export PYTHONPATH=$ROOT/src${PYTHONPATH:+:$PYTHONPATH}
  if ! (cd /tmp && FLASHINFER_W4A16_TRIM=0 python3 -c "import lucifer_shard.proof.outdir"); then
    log "lucifer_shard still not importable (blake3 missing? it must come as a wheel in .gpu/wheels)"
  fi
fi

# 2. The machine.
{
  python3 - <<'EOF' 2>&1
import importlib, os, platform, subprocess, sys, time
def sh(*cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout.strip()
    except Exception as e:
        return f"unavailable ({type(e).__name__})"
print("date:", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
q = sh("nvidia-smi", "--query-gpu=name,compute_cap,memory.total,driver_version", "--format=csv,noheader")
rows = [r.split(", ") for r in q.splitlines() if r.count(",") >= 3]
if rows:
    print("gpu:", rows[0][0], f"({rows[0][2]})")
    print("gpu_count:", len(rows))
    print("driver:", rows[0][3])
else:
    print("gpu:", q or "nvidia-smi gave nothing")
nv = sh(os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc"), "--version")
if "release" not in nv:
    nv = sh("nvcc", "--version")
print("nvcc:", next((l.strip() for l in nv.splitlines() if "release" in l), nv[-120:]))
print("python:", sys.version.split()[0], sys.executable)
print("cpu:", platform.processor() or platform.machine(), f"{os.cpu_count()} cores")
try:
    import torch
    print("torch:", torch.__version__)
    print("cuda_runtime_torch:", torch.version.cuda)
    if torch.cuda.is_available():
        print("compute_capability:", ".".join(map(str, torch.cuda.get_device_capability(0))))
except Exception as e:
    print("torch: IMPORT FAILED", repr(e))
for m in ("flashinfer", "tvm_ffi", "lucifer_shard", "blake3", "safetensors", "numpy", "pytest"):
    try:
        mod = importlib.import_module(m)
        print(f"{m}:", getattr(mod, "__version__", "?"), getattr(mod, "__file__", ""))
    except Exception as e:
        print(f"{m}: IMPORT FAILED {e!r}")
print("FLASHINFER_W4A16_TRIM:", os.environ.get("FLASHINFER_W4A16_TRIM"))
print("NCCL_NVLS_ENABLE:", os.environ.get("NCCL_NVLS_ENABLE"))
# the device copy's .git may be older than the tree it received: the caller names the commit it sent
print("sent_commit:", os.environ.get("LUCIFER_GPU_COMMIT", "n/a (set LUCIFER_GPU_COMMIT)"))
print("git_commit:", sh("git", "rev-parse", "HEAD") or "n/a")
print("git_dirty_files:", len(sh("git", "status", "--porcelain").splitlines()))
EOF
  echo "--- nvidia-smi"
  nvidia-smi 2>&1 | head -20 || true
} >"$RES/machine.txt" 2>&1
sed -n '1,20p' "$RES/machine.txt"

# 3. The GPU tests (pyproject's addopts deselects gpu tests, hence -o addopts='').
log "pytest -m gpu tests/gpu"
python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider -o addopts='' -rfEs --durations=15 "$@" 2>&1 \
  | tee "$RES/gpu-tests.log"
rc=${PIPESTATUS[0]}

# 4. Verdict (the full markdown is rendered on the development machine from the three files).
if [ -f "$LUCIFER_GPU_RESULTS" ]; then
  python3 tests/gpu/report.py "$LUCIFER_GPU_RESULTS" "$RES/machine.txt" --log "$RES/gpu-tests.log" \
    -o "$SCRATCH/gpu-validation.md" 2>&1 | tail -3
  sed -n '/^## Verdict/,/^## Machine/p' "$SCRATCH/gpu-validation.md" | grep -v '^## Machine' || true
else
  log "no results file $LUCIFER_GPU_RESULTS"
fi
log "files in $RES: $(cd "$RES" && ls | tr '\n' ' ')"
if [ "$rc" = 0 ]; then
  echo "GPU_TESTS_RESULT: PASS (pytest rc 0) results=$LUCIFER_GPU_RESULTS"
else
  echo "GPU_TESTS_RESULT: FAIL (pytest rc $rc) results=$LUCIFER_GPU_RESULTS log=$RES/gpu-tests.log"
fi
exit "$rc"
