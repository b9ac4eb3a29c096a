#!/usr/bin/env bash
# Device side of tools/gpu-vllm-kit.sh. Each call that carries a .vllmkit*/ folder runs this first:
# its piece is kept in KIT (/tmp survives between calls while the machine stays warm, ~30 s). When
# every piece is there and the whole matches SHA256, the site-packages tree is unpacked into SITE
# once, this checkout is installed into it (--no-deps; nothing is downloaded) and a `vllm` command
# is written beside it. Source the printed line (or `eval "$(bash tests/gpu/vllm-kit-install.sh)"`).
# Exit 3: pieces still missing (carry the next one); 0: ready.
set -euo pipefail
KIT=${LUCIFER_VLLM_KIT:-/tmp/vllmkit}
SITE=${LUCIFER_VLLM_SITE:-/tmp/vllm-site}
mkdir -p "$KIT"
# .vllmkitN/ (0.33.0) or .vllmkit-<version>-N/
for d in .vllmkit*/; do [ -d "$d" ] && cp -n "$d"* "$KIT"/ 2>/dev/null || true; done
if [ ! -f "$SITE/.ready" ]; then
  [ -f "$KIT/PIECES" ] || { echo "vllm-kit: have $(ls "$KIT" | tr '\n' ' '); the last piece (PIECES, SHA256) is missing" >&2; exit 3; }
  n=$(cat "$KIT/PIECES")
  for i in $(seq 0 $((n - 1))); do
    [ -f "$KIT/site.tar.xz.$i" ] || { echo "vllm-kit: piece $i of $n is missing; carry the kit's folder $((i + 1))" >&2; exit 3; }
  done
  got=$(cat $(seq -f "$KIT/site.tar.xz.%g" 0 $((n - 1))) | sha256sum | cut -d' ' -f1)
  [ "$got" = "$(cat "$KIT/SHA256")" ] || { echo "vllm-kit: sha256 $got != $(cat "$KIT/SHA256"): rebuild the kit" >&2; exit 1; }
  start=$(date +%s.%N)
  rm -rf "$SITE" && mkdir -p "$SITE/proj" "$SITE/bin"
  cat $(seq -f "$KIT/site.tar.xz.%g" 0 $((n - 1))) | xz -d -T0 | tar -C "$SITE" -xf -
  python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target "$SITE/proj" . >&2
  printf '#!/usr/bin/env python3\nfrom vllm.entrypoints.cli.main import main\n\n# vLLM spawns its engine core, which imports this file again: main() only when run\nif __name__ == "__main__":\n    main()\n' > "$SITE/bin/vllm"
  chmod +x "$SITE/bin/vllm"
  touch "$SITE/.ready"
  echo "vllm-kit: unpacked and installed in $(python3 -c "import time;print(f'{time.time()-$start:.1f}')") s" >&2
fi
# CuTe-DSL puts its `cutlass` package on sys.path through a .pth file, which Python reads only in site
# directories, never in PYTHONPATH entries: name that folder too.
echo "export PYTHONPATH=$SITE/proj:$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages\${PYTHONPATH:+:\$PYTHONPATH} PATH=$SITE/proj/bin:$SITE/bin:\$PATH"
