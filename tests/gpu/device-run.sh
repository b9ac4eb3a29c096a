#!/bin/bash
# Run the GPU suite on a lent device machine, from a checkout that carries the FlashInfer kit in
# .gpu/ (see docs/evidence/gpu-validation.md). With the kit's prebuilt modules one call does it (~2.5 min);
# with FI_PREBUILT=0, call it again at once until it prints GPU_TESTS_DONE. Set LUCIFER_GPU_COMMIT
# to the commit sent: the device copy's .git may be older than its tree.
#
# The kit is staged ONCE outside the checkout: every call that names .gpu in `carry` replaces that
# folder, and with it a FlashInfer build in progress (2026-11-30: the second call restarted the
# build, two builds then raced in one directory and the build failed). Staged copies are kept with
# `cp -n`, so the build and its workspace survive between calls whatever is carried.
set -u
KIT=${LUCIFER_FI_KIT:-/root/lucifer-fi-kit}
mkdir -p "$KIT" && cp -rn .gpu/. "$KIT"/
export GPU_TEST_CMD=${GPU_TEST_CMD:-bash tests/gpu/run.sh} TEST_MIN_S=${TEST_MIN_S:-300}
TOOLS="$KIT" exec bash "$KIT/prepare.sh"
