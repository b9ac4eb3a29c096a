#!/usr/bin/env bash
# Build the vLLM kit for the lent H200 (docs/gpu-validation.md, "Served on a GPU"), on this machine:
# vLLM 0.33.0 and the packages of tests/gpu/vllm-kit.txt, unpacked for CPython 3.12 into one
# site-packages tree, slimmed, xz-packed and split into pieces of PIECE_MIB under ignored folders
# .vllmkit1/ .vllmkit2/ ... of this checkout. Each device call carries ONE of them; the device side
# is tests/gpu/vllm-kit-install.sh. Downloads are cached in LUCIFER_GPU_KIT_CACHE.
#
#   bash tools/gpu-vllm-kit.sh            # download (cached), build, split; prints the pieces
#   bash tools/gpu-vllm-kit.sh --resolve  # re-pin tests/gpu/vllm-kit.txt first (needs uv)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${LUCIFER_GPU_KIT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/lucifer-shard/gpu-kit}"
LOCK="$ROOT/tests/gpu/vllm-kit.txt"
PIECE_MIB="${PIECE_MIB:-59}"     # a device call carries 64 MiB with the checkout (~3.5 MiB)
XZ_LEVEL="${XZ_LEVEL:-6}"        # -1 packs in minutes on a busy 2-core machine, at about a piece more
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64
           manylinux2014_x86_64 manylinux1_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux_2_35_x86_64)
TARGET=(--python-version 3.12 --implementation cp --only-binary=:all:)
for p in "${PLATFORMS[@]}"; do TARGET+=(--platform "$p"); done
# Never needed for DeepSeek-V4 on SM90: FlashAttention 2 (FA3 stays: vllm/vllm_flash_attn/__init__.py
# raises ImportError when neither is there, and vLLM's model loader imports it; seen on the H200,
# 2026-12-02), the opt-in Rust front end, SM100-only and unused kernels.
SLIM=(vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/vllm-rs
      vllm/_qutlass_C.abi3.so vllm/_flashkda_C.abi3.so vllm/_deepselect_C.abi3.so
      vllm/third_party/fmha_sm100 vllm/third_party/tml_fa4 bin)
LEFT_OUT=(torch torchvision torchaudio flashinfer-python nvidia-cudnn-frontend humming-kernels tokenspeed-mla
          nvidia-cutlass-dsl-libs-cu12 pynvvideocodec torchcodec instanttensor fastsafetensors)
log() { echo "gpu-vllm-kit: $*" >&2; }

if [ "${1:-}" = --resolve ]; then
  # Every package of the device image and the ones left out on purpose (the lock's header says
  # why) are overridden away, so the pins are exactly what must travel.
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  { printf "%s\n" "${LEFT_OUT[@]}"; grep -v "^#" "$ROOT/tests/gpu/device-image-packages.txt"; } \
    | sed "s/\$/; sys_platform == 'never'/" > "$tmp/overrides"
  echo "vllm==0.33.0" > "$tmp/req.in"
  uv pip compile "$tmp/req.in" --override "$tmp/overrides" --python-version 3.12 \
     --python-platform x86_64-manylinux_2_28 --no-header --no-annotate -o "$tmp/pins"
  { grep '^#' "$LOCK"; grep -v '^ *#' "$tmp/pins" | sed 's/ *$//'; } > "$tmp/lock" && mv "$tmp/lock" "$LOCK"
  log "re-pinned $LOCK ($(grep -vc '^#' "$LOCK") packages)"
fi

mkdir -p "$CACHE/wheels"
log "downloading the pinned wheels into $CACHE/wheels (cached)"
grep -v '^#' "$LOCK" > "$CACHE/pins.txt"
python3 -m pip download -q --no-deps "${TARGET[@]}" -d "$CACHE/wheels" -r "$CACHE/pins.txt" 2>&1 \
  | grep -v 'is ignored: it is neither a file nor a directory' >&2 || true
[ "$(ls "$CACHE/wheels" | wc -l)" -ge "$(grep -c . "$CACHE/pins.txt")" ] || { log "a download failed"; exit 1; }

log "unpacking for CPython 3.12 into $CACHE/site"
rm -rf "$CACHE/site"
python3 -m pip install -q --no-deps --no-compile --target "$CACHE/site" "${TARGET[@]}" \
  $(sed 's/==.*//; s/[-_.]\+/[-_.]/g' "$CACHE/pins.txt" | while read -r pat; do
      ls "$CACHE/wheels" | grep -i "^${pat}-[0-9]" | head -1 | sed "s|^|$CACHE/wheels/|"; done) 2>&1 \
  | grep -v 'is ignored\|Running pip as' >&2 || true
[ -f "$CACHE/site/vllm/__init__.py" ] || { log "vllm did not unpack"; exit 1; }
for p in "${SLIM[@]}"; do rm -rf "${CACHE:?}/site/$p"; done

log "packing ($(du -sh "$CACHE/site" | cut -f1) unpacked; xz takes a few minutes)"
tar -C "$CACHE/site" --sort=name --owner=0 --group=0 -cf - . | xz -T0 "-$XZ_LEVEL" > "$CACHE/site.tar.xz.partial"
mv "$CACHE/site.tar.xz.partial" "$CACHE/site.tar.xz"
rm -rf "$ROOT"/.vllmkit[0-9]*
split -b "${PIECE_MIB}M" -d -a 1 "$CACHE/site.tar.xz" "$CACHE/piece."
n=0
for piece in "$CACHE"/piece.*; do
  n=$((n + 1)); mkdir -p "$ROOT/.vllmkit$n"; mv "$piece" "$ROOT/.vllmkit$n/site.tar.xz.$((n - 1))"
done
( cd "$CACHE" && sha256sum site.tar.xz | sed 's/  site.tar.xz$//' ) > "$ROOT/.vllmkit$n/SHA256"
echo "$n" > "$ROOT/.vllmkit$n/PIECES"
for i in $(seq 1 "$n"); do echo ".vllmkit$i $(du -sh "$ROOT/.vllmkit$i" | cut -f1)"; done
