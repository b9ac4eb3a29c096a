#!/usr/bin/env bash
# Build the vLLM kit for the lent H100/H200 (docs/evidence/gpu-validation.md §8, §10), on this machine:
# vLLM VLLM_VERSION (0.33.0: tests/gpu/vllm-kit.txt; 0.34.0: tests/gpu/vllm-kit-0.34.0.txt) and the
# packages of its lock, unpacked for CPython 3.12 into one site-packages tree, slimmed, xz-packed and
# split into pieces of PIECE_MIB under ignored folders .vllmkit1/ .vllmkit2/ ... (0.34.0:
# .vllmkit-0.34.0-1/ ...) of this checkout. Each device call carries ONE of them; the device side is
# tests/gpu/vllm-kit-install.sh. Downloads are cached in LUCIFER_GPU_KIT_CACHE.
#
#   bash tools/gpu-vllm-kit.sh                        # download (cached), build, split; prints the pieces
#   VLLM_VERSION=0.34.0 bash tools/gpu-vllm-kit.sh    # the 0.34.0 kit
#   bash tools/gpu-vllm-kit.sh --resolve              # re-pin the lock first (uv; pip's resolver without it)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VLLM_VERSION="${VLLM_VERSION:-0.33.0}"
CACHE="${LUCIFER_GPU_KIT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/lucifer-shard/gpu-kit}"
case "$VLLM_VERSION" in
  0.33.0) LOCK="$ROOT/tests/gpu/vllm-kit.txt" PIECES=.vllmkit ;;
  *) LOCK="$ROOT/tests/gpu/vllm-kit-$VLLM_VERSION.txt" PIECES=".vllmkit-$VLLM_VERSION-" CACHE="$CACHE-$VLLM_VERSION" ;;
esac
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
# image packages below the floors vLLM raised (the 0.34.0 lock's header says which)
CARRY_FROM_IMAGE=(filelock huggingface-hub hf-xet tokenizers transformers)
log() { echo "gpu-vllm-kit: $*" >&2; }

if [ "${1:-}" = --resolve ]; then
  # Every package of the device image and the ones left out on purpose (the lock's header says
  # why) are overridden away, so the pins are exactly what must travel; for 0.34.0 the image
  # packages below its floors (CARRY_FROM_IMAGE) travel too.
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  excluded="$tmp/excluded"
  { printf "%s\n" "${LEFT_OUT[@]}"; grep -v "^#" "$ROOT/tests/gpu/device-image-packages.txt"; } > "$excluded"
  [ "$VLLM_VERSION" = 0.33.0 ] || grep -v -x -i -F -f <(printf "%s\n" "${CARRY_FROM_IMAGE[@]}") "$excluded" > "$tmp/e2" \
    && mv "$tmp/e2" "$excluded"
  if command -v uv >/dev/null; then
    sed "s/\$/; sys_platform == 'never'/" "$excluded" > "$tmp/overrides"
    echo "vllm==$VLLM_VERSION" > "$tmp/req.in"
    uv pip compile "$tmp/req.in" --override "$tmp/overrides" --python-version 3.12 \
       --python-platform x86_64-manylinux_2_28 --no-header --no-annotate -o "$tmp/pins"
  else  # pip has no overrides: resolve vLLM's own requirements less the left-out, then walk the graph
    python3 -m pip download -q --no-deps "${TARGET[@]}" -d "$tmp" "vllm==$VLLM_VERSION"
    unzip -p "$tmp"/vllm-*.whl "vllm-$VLLM_VERSION.dist-info/METADATA" | sed -n 's/^Requires-Dist: //p' \
      | grep -v 'extra ==' | grep -v -i -E "^($(IFS='|'; echo "${LEFT_OUT[*]}"))( |[][<>=!;~]|$)" > "$tmp/req.in"
    python3 -m pip install -q --dry-run --ignore-installed --report "$tmp/report.json" "${TARGET[@]}" \
      --target "$tmp/t" -r "$tmp/req.in"
    { python3 "$ROOT/tools/gpu_kit_pins.py" "$tmp/report.json" "$tmp/req.in" "$excluded"; echo "vllm==$VLLM_VERSION"; } > "$tmp/pins"
  fi
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
  $(while IFS= read -r pin; do name=${pin%%==*} ver=${pin#*==}
      ls "$CACHE/wheels" | grep -i "^$(sed 's/[-_.]\+/[-_.]/g' <<< "$name")-${ver//./\\.}-" | head -1 \
        | sed "s|^|$CACHE/wheels/|"; done < "$CACHE/pins.txt") 2>&1 \
  | grep -v 'is ignored\|Running pip as' >&2 || true
[ -f "$CACHE/site/vllm/__init__.py" ] || { log "vllm did not unpack"; exit 1; }
for p in "${SLIM[@]}"; do rm -rf "${CACHE:?}/site/$p"; done

log "packing ($(du -sh "$CACHE/site" | cut -f1) unpacked; xz takes a few minutes)"
tar -C "$CACHE/site" --sort=name --owner=0 --group=0 -cf - . | xz -T0 "-$XZ_LEVEL" > "$CACHE/site.tar.xz.partial"
mv "$CACHE/site.tar.xz.partial" "$CACHE/site.tar.xz"
rm -rf "$ROOT/$PIECES"[0-9]*
split -b "${PIECE_MIB}M" -d -a 1 "$CACHE/site.tar.xz" "$CACHE/piece."
n=0
for piece in "$CACHE"/piece.*; do
  n=$((n + 1)); mkdir -p "$ROOT/$PIECES$n"; mv "$piece" "$ROOT/$PIECES$n/site.tar.xz.$((n - 1))"
done
( cd "$CACHE" && sha256sum site.tar.xz | sed 's/  site.tar.xz$//' ) > "$ROOT/$PIECES$n/SHA256"
echo "$n" > "$ROOT/$PIECES$n/PIECES"
for i in $(seq 1 "$n"); do echo "$PIECES$i $(du -sh "$ROOT/$PIECES$i" | cut -f1)"; done
