#!/bin/bash
# The serving run on a lent H200 (docs/evidence/gpu-validation.md §8), one device call at a time, from the checkout
# root. Each call carries one piece of the vLLM kit (.vllmkitN/, tools/gpu-vllm-kit.sh) and one of them the
# FlashInfer kit too (.gpu/, built per ../shared/gpu/README.md: FlashInfer 0.7.2.post1 with its prebuilt SM90
# MoE module); both are staged in /tmp, which survives between calls while the machine stays warm. Exit 3:
# a piece is still missing (carry the next one); otherwise serve_run.py's phases run, or LUCIFER_RUN's (arguments
# go to it). LUCIFER_FLASHINFER=none is the vLLM 0.34.0 route (tests/gpu/flash_run.py, docs/evidence/gpu-validation.md §10):
# no FlashInfer at all, so vLLM takes its own SM90 kernels (Marlin MoE for model layout) and .gpu is not needed.
set -u
FI=${LUCIFER_FI_KIT:-/tmp/lucifer-fi-kit}
if [ -d .gpu ]; then mkdir -p "$FI" && cp -rn .gpu/. "$FI"/; fi
KIT_ENV=$(bash tests/gpu/vllm-kit-install.sh) || exit $?
RUN=${LUCIFER_RUN:-tests/gpu/serve_run.py}
if [ "${LUCIFER_FLASHINFER:-kit}" = none ]; then
  eval "$KIT_ENV"
  export PYTHONPATH=$PWD/tests/gpu/hooks:$PYTHONPATH
  exec python3 "$RUN" --work "/tmp/$(basename "$RUN" .py)" --out "${OUT:-/tmp/serve-out}" "$@"
fi
[ -f "$FI/prepare.sh" ] || { echo "serve-run: the FlashInfer kit (.gpu) was never carried" >&2; exit 3; }
# installs the FlashInfer wheels and the prebuilt modules (nothing compiles) and says GPU_READY
# (its exit status is that of its last copy into $OUT: GPU_READY says it worked)
TOOLS="$FI" bash "$FI/prepare.sh" > /tmp/fi-prepare.log 2>&1
grep -q GPU_READY /tmp/fi-prepare.log || { cat /tmp/fi-prepare.log; exit 4; }
# vLLM's site before FlashInfer's: vLLM's tvm-ffi pin 0.1.11 over the FlashInfer kit's 0.1.15.post2 (with that
# one first, importing tilelang aborts: "TypeAttr `__ffi_repr__` is already registered", H200, 2026-12-03); the
# hooks' sitecustomize (the post-load timer, and the kit's trimmed-module switch) before the kit's own.
export PYTHONPATH=$FI/.venv${PYTHONPATH:+:$PYTHONPATH}
eval "$KIT_ENV"
export PYTHONPATH=$PWD/tests/gpu/hooks:$FI:$PYTHONPATH FLASHINFER_W4A16_TRIM=1 FLASHINFER_DISABLE_JIT=1 \
       FLASHINFER_WORKSPACE_BASE=$FI/.fi_ws
# LUCIFER_RUN picks the run: the serving run (default) or TP on one GPU (tests/gpu/tp_run.py, its own work folder)
exec python3 "$RUN" --work "/tmp/$(basename "$RUN" .py)" --out "${OUT:-/tmp/serve-out}" "$@"
