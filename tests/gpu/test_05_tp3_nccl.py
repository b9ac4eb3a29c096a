"""TP3 across three processes with a real BF16 all-reduce (issue 10), through tp3_nccl.py.

With >= 3 GPUs: one process per GPU and NCCL (NCCL_NVLS_ENABLE=0). With fewer: the same three
processes all on cuda:0 with gloo, labelled "single-GPU fallback, gloo" in the results.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import gpu_harness as H

pytestmark = pytest.mark.gpu

TIMEOUT_S = 300


def test_tp3_processes_allreduce_matches_reference(fi, ckpt, tmp_path):
    res_path = tmp_path / "tp3.json"
    cmd = [sys.executable, str(Path(__file__).resolve().parent / "tp3_nccl.py"), "--src", str(ckpt.src),
           "--out", str(ckpt.out), "--work", str(tmp_path / "work"), "--ms", "1,8,64", "--json", str(res_path),
           "--timeout", str(TIMEOUT_S)]
    env = dict(os.environ, NCCL_NVLS_ENABLE="0")
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S + 60)
        log, rc = (p.stdout + p.stderr), p.returncode
    except subprocess.TimeoutExpired as e:
        log, rc = f"{e.stdout or ''}{e.stderr or ''}\n[timeout after {TIMEOUT_S + 60}s]", -9
    print(log[-6000:])
    result = json.loads(res_path.read_text()) if res_path.exists() else {"ok": False, "error": "no result file"}
    H.record("tp3_nccl", rc=rc, log_tail=log[-1500:] if rc else "", **result)
    assert rc == 0 and result.get("ok"), f"tp3_nccl.py rc {rc}: {result.get('error', '')}\n{log[-4000:]}"
