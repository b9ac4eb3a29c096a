#!/usr/bin/env bash
# A CPU overlay of the mlow/vllm fork (the vLLM line lucifer-shard targets) at each COMMIT, for the
# fork tests (tests/shim/test_fork_model.py) and nothing else: the fork's Python source (`vllm/`)
# extracted OUTSIDE the clone, with the two files its build would generate (`vllm/_version.py`
# and a `vllm-<version>.dist-info`) declaring a CPU build, so that the fork's own platform detection
# picks its CPU platform. Put on PYTHONPATH in front of the vllm==0.33.0 venv, whose packages it
# reuses, it builds and loads the fork's models; no compiled op is present, so nothing runs a kernel.
#
#   bash tools/fork-overlay.sh [--git DIR] COMMIT...     # prints one overlay directory per commit
#
# DIR is a clone (bare or not) of https://github.com/mlow/vllm holding the commits
# (default $LUCIFER_FORK_GIT; without either, the fork is cloned into the cache, which needs
# network access). Overlays go to ${LUCIFER_FORK_CACHE:-~/.cache/lucifer-shard}/fork-<commit>/;
# the tests find them there. The fork's code is never copied into this repository.
set -euo pipefail

CACHE="${LUCIFER_FORK_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/lucifer-shard}"
GIT="${LUCIFER_FORK_GIT:-}"
if [ "${1:-}" = "--git" ]; then GIT="$2"; shift 2; fi
[ $# -gt 0 ] || { echo "usage: $0 [--git DIR] COMMIT..." >&2; exit 2; }
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

if [ -z "$GIT" ]; then
  GIT="$CACHE/mlow-vllm.git"
  if [ ! -d "$GIT" ]; then
    echo "fork-overlay: cloning https://github.com/mlow/vllm into $GIT (blobs on demand)" >&2
    git clone -q --bare --filter=blob:none https://github.com/mlow/vllm "$GIT"
  fi
fi

for commit in "$@"; do
  full=$(git -C "$GIT" rev-parse --verify -q "$commit^{commit}") \
    || { echo "fork-overlay: $commit is not a commit of $GIT" >&2; exit 2; }
  short=${full:0:9}
  dest="$CACHE/fork-$short"
  case "$dest/" in "$ROOT"/*) echo "fork-overlay: $dest is inside the clone $ROOT; set LUCIFER_FORK_CACHE" >&2; exit 2;; esac
  if [ ! -f "$dest/.complete" ]; then
    rm -rf "$dest" "$dest.tmp"
    mkdir -p "$dest.tmp"
    # Only vllm/: the package the tests import (the repository's other folders are not needed).
    git -C "$GIT" archive "$full" vllm | tar -x -C "$dest.tmp"
    version="0.0.0+g$short.cpu"
    printf '__version__ = version = "%s"\n__version_tuple__ = version_tuple = (0, 0, 0, "g%s", "cpu")\n' \
      "$version" "$short" > "$dest.tmp/vllm/_version.py"
    mkdir -p "$dest.tmp/vllm-$version.dist-info"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\n' "$version" > "$dest.tmp/vllm-$version.dist-info/METADATA"
    echo "$full" > "$dest.tmp/.complete"
    mv "$dest.tmp" "$dest"
  fi
  echo "$dest"
done
