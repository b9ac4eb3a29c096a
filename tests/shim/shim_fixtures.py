"""Helpers for the runtime-shim tests: real converted `tiny` outputs and manifest-shaped torch modules.

No vLLM import at module level: in the main environment these tests are deselected (marker `vllm`),
but pytest still imports the modules while collecting.
"""
from __future__ import annotations

import importlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from lucifer_shard.formats.torch_dtypes import TORCH_DTYPE as TORCH_DTYPES
from lucifer_shard.model import runtimes

SINK_PARAM_LEN = 32  # DeepseekV4FlashInferSM120Attention pads 24 local heads to 32


TOOLS = Path(__file__).resolve().parents[2] / "tools"  # the maintainer tools (vet.py, vllm_hashes.py): not in the wheel


def tool(name: str):
    """A module of tools/ (the tools import each other by name, as run from there)."""
    if str(TOOLS) not in sys.path:
        sys.path.insert(0, str(TOOLS))
    return importlib.import_module(name)


def allow_vet_candidate() -> None:
    """Add `vet`'s candidate (LUCIFER_VET_CANDIDATE, set by tools/vet.py) to the vetted builds and its
    hashes to its wrappers' records, in this process only: the stock proofs run on a release before its row
    is committed. Tests only; the product reads nothing of it."""
    from lucifer_shard.runtime_shim.adapt import wrappers

    vet = tool("vet")
    text = os.environ.get(vet.CANDIDATE_ENV)
    if text:
        found = vet.candidate_from_json(text)
        runtimes.SUPPORTED_BUILDS = (*runtimes.SUPPORTED_BUILDS, found.build)
        wrappers.HASHES = {**wrappers.HASHES, found.build.commit: found.hashes}


def vllm_version() -> str:
    """The vLLM release this venv holds (the one the suite proves)."""
    from importlib.metadata import version

    return version("vllm")


def cli(*args: str) -> None:
    """Run `lucifer-shard ARGS` in this interpreter's environment."""
    r = subprocess.run([sys.executable, "-m", "lucifer_shard.cli", *args], capture_output=True, text=True)
    if r.returncode:
        raise AssertionError(f"lucifer-shard {' '.join(args)} failed ({r.returncode}): {r.stderr or r.stdout}")


def synth_tiny(path: Path, experts: int, preset: str = "tiny", fill: str = "pattern", seed: int = 0) -> None:
    """`synth tiny` (or another preset) with another routed-expert count: lucifer-shard's own synth, its
    preset changed in that process only. vLLM's CPU DeepSeek-V4 class asserts `n_routed_experts % tp_size
    == 0` (values it never uses); tiny's 8 experts do not divide by 3, 6 do."""
    code = ("import sys, lucifer_shard.engine.synth as s; base = s.preset_config; "
            "s.preset_config = lambda *a, **k: {**base(*a, **k), 'n_routed_experts': int(sys.argv[2])}; "
            "s.synth(sys.argv[3], sys.argv[1], fill=sys.argv[4], seed=int(sys.argv[5]), progress=False)")
    subprocess.run([sys.executable, "-c", code, str(path), str(experts), preset, fill, str(seed)], check=True,
                   capture_output=True)


def convert_tiny(base: Path, *options: str) -> Path:
    model = base / "model"
    if not model.exists():
        cli("synth", "tiny", str(model), "--fill", "pattern", "--quiet")
    out = base / ("out" + "".join(o.replace("-", "_") for o in options))
    if not (out / "COMPLETE").exists():
        cli("convert", "--tp", "3", "--arch", "sm120", str(model), str(out), "--quiet", *options)
    return out


def run_world(spec: dict, label: str, env: dict | None = None, timeout: int = 1800) -> list[dict]:
    """Run `vllm_cpu_model.py` on `spec` in a fresh interpreter (its ranks import vLLM with
    VLLM_TARGET_DEVICE=cpu, which this process must not); the per-rank reports, asserting none crashed.
    With LUCIFER_PROOF_OUT set, the reports are also kept there as <label>/rank-<r>.json, the
    figures docs/evidence/serving-proof.md is rendered from (tools/serving_proof_table.py)."""
    results = Path(spec["results"])
    results.mkdir(parents=True, exist_ok=True)
    (results / "spec.json").write_text(json.dumps(spec, indent=1))
    started = time.time()
    r = subprocess.run([sys.executable, str(Path(__file__).with_name("vllm_cpu_model.py")), str(results / "spec.json")],
                       capture_output=True, text=True, timeout=timeout, env=env)
    tp = int(spec["tp"])
    reports = [json.loads((results / f"rank-{k}.json").read_text()) for k in range(tp)
               if (results / f"rank-{k}.json").exists()]
    crashes = [f"rank {x['rank']}: {x['crash']}" for x in reports if "crash" in x]
    assert r.returncode == 0 and len(reports) == tp and not crashes, \
        f"{label}: world failed (rc {r.returncode}):\n" + "\n".join(crashes) + r.stderr[-3000:]
    keep = os.environ.get("LUCIFER_PROOF_OUT")
    if keep:
        dest = Path(keep) / label
        dest.mkdir(parents=True, exist_ok=True)
        for rep in reports:
            (dest / f"rank-{rep['rank']}.json").write_text(json.dumps({**rep, "world_s": time.time() - started}))
    return reports


def link_copy(src: Path, dst: Path) -> Path:
    """A cheap copy of an output (hard links): tests replace or delete files, never edit them in place."""
    shutil.copytree(src, dst, copy_function=_link)
    return dst


def _link(s, d):
    import os

    os.link(s, d)


def real_copy(path: Path) -> None:
    """Replace a hard link by a private copy so it can be edited in place."""
    data = path.read_bytes()
    path.unlink()
    path.write_bytes(data)


def manifest(out: Path) -> dict:
    return json.loads((out / "lucifer-manifest.json").read_text())


# ----------------------------------------------------------------------------- fake models

class DeepseekV4ForCausalLM(nn.Module):
    """Stands in for vLLM's class (the loader checks the class name); records replayed hooks."""


class DeepSeekV4MTP(nn.Module):
    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def finalize_mega_moe_weights(self):
        self.calls.append("finalize_mega_moe_weights")


class _Inner(nn.Module):
    def __init__(self, calls):
        super().__init__()
        self.__dict__["calls"] = calls

    def finalize_mega_moe_weights(self):
        self.calls.append("finalize_mega_moe_weights")

    def finalize_mhc_broadcast_weights(self):
        self.calls.append("finalize_mhc_broadcast_weights")

    def setup_b12x_wo_projection(self):
        self.calls.append("setup_b12x_wo_projection")


class _Layer(nn.Module):
    def __init__(self, calls, i):
        super().__init__()
        self.__dict__["calls"] = calls
        self.__dict__["index"] = i

    def refresh_b12x_mhc_bf16_weights(self):
        self.calls.append(f"refresh.{self.index}")


class _Layers(nn.Module):
    def __iter__(self):
        return iter(self._modules.values())


def build_model(man: dict, role: str, rank: int = 0, sink_len: int = SINK_PARAM_LEN,
                extra_params: dict | None = None, drop: tuple[str, ...] = (),
                overrides: dict | None = None) -> nn.Module:
    """A module whose parameters carry the manifest's names, shapes and dtypes (zeros; attn_sink a
    padded -inf vector), nested like vLLM's model so the loader's hook replay finds its methods."""
    tensors = man["roles"][role]["ranks"][rank]["tensors"]
    specs = {n: (tuple(t["shape"]), TORCH_DTYPES[t["dtype"]]) for n, t in tensors.items()}
    if role == "draft":
        layer = next(n.split(".")[2] for n in specs)
        specs[f"model.layers.{layer}.shared_head.head.weight"] = ((8, 8), torch.bfloat16)  # runtime owned
        specs["model.embed_tokens.weight"] = ((8, 8), torch.bfloat16)  # runtime owned
    for n in drop:
        specs.pop(n)
    specs.update(extra_params or {})
    specs.update(overrides or {})
    calls: list[str] = []
    root = DeepseekV4ForCausalLM() if role == "target" else DeepSeekV4MTP()
    if role == "target":
        root.calls = calls
    for name in sorted(specs):
        shape, dtype = specs[name]
        *path, leaf = name.split(".")
        mod = root
        for i, part in enumerate(path):
            child = mod._modules.get(part)
            if child is None:
                where = ".".join(path[: i + 1])
                if role == "target" and where == "model":
                    child = _Inner(calls)
                elif role == "target" and where == "model.layers":
                    child = _Layers()
                elif role == "target" and len(path) > i and ".".join(path[:i]) == "model.layers":
                    child = _Layer(calls, int(part))
                else:
                    child = nn.Module()
                mod.add_module(part, child)
            mod = child
        if leaf == "attn_sink" and shape[0] < sink_len:
            data = torch.full((sink_len,), float("-inf"), dtype=dtype)
        else:
            data = torch.zeros(shape, dtype=dtype)
        mod.register_parameter(leaf, nn.Parameter(data, requires_grad=False))
    return root


# ------------------------------------------------------------------- vLLM-shaped configs

def fork_plan(cfg: dict, tp: int, moe_align: int = 32) -> dict:
    """The DeepSeek-V4 plan dict the fork stores in hf_text_config.vllm_virtual_tp_plan, written from
    its documented arithmetic (docs/design/tensor-plan.md §3.1), independent of the converter."""
    def axis(orig, a=1):
        local = math.ceil(math.ceil(orig / tp) / a) * a
        return {"original_size": orig, "padded_size": local * tp, "tp_size": tp, "local_size": local}

    heads = axis(cfg["num_attention_heads"], 8)
    per_group = cfg["num_attention_heads"] // cfg["o_groups"]
    groups_padded = heads["padded_size"] // per_group
    pad = math.lcm(64, tp)
    vocab_padded = math.ceil(cfg["vocab_size"] / pad) * pad
    return {
        "sharding": "b12x-padded",
        "attention_heads": heads,
        "moe_intermediate_size": axis(cfg["moe_intermediate_size"], moe_align),
        "vocab_size": {"original_size": cfg["vocab_size"], "padded_size": vocab_padded, "tp_size": tp,
                       "local_size": vocab_padded // tp, "padding_size": pad},
        "output_groups": {"original_size": cfg["o_groups"], "padded_size": groups_padded, "tp_size": tp,
                          "local_size": groups_padded // tp, "heads_per_group": per_group},
        "shared_expert_intermediate_size": axis(cfg["moe_intermediate_size"] * cfg["n_shared_experts"], 128),
    }


def model_config(out: Path, plan: dict | None = "auto") -> SimpleNamespace:
    """What the loader reads from vLLM's ModelConfig: the model path and the live virtual-TP plan."""
    cfg = json.loads((out / "config.json").read_text())
    if plan == "auto":
        plan = fork_plan(cfg, 3)
    text = SimpleNamespace(model_type="deepseek_v4", **{k: v for k, v in cfg.items() if k != "model_type"})
    if plan is not None:
        text.vllm_virtual_tp_plan = plan
    return SimpleNamespace(model=str(out), model_weights="", hf_config=text, hf_text_config=text)


def file_tensors(out: Path, man: dict, role: str, rank: int) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    res = {}
    for f in man["roles"][role]["ranks"][rank]["files"]:
        with safe_open(str(out / f["path"]), framework="pt") as fh:
            for k in fh.keys():
                res[k] = fh.get_tensor(k)
    return res


def assert_byte_exact(model: nn.Module, files: dict[str, torch.Tensor]) -> int:
    params = dict(model.named_parameters())
    n = 0
    for name, t in files.items():
        p = params[name].data
        if name.endswith("attn_sink") and p.shape != t.shape:
            assert torch.equal(p[: t.shape[0]].view(torch.uint8), t.view(torch.uint8)), name
            assert bool(torch.all(p[t.shape[0]:] == float("-inf"))), name
        else:
            assert p.dtype == t.dtype and p.shape == t.shape, name
            assert torch.equal(p.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name
        n += 1
    return n
