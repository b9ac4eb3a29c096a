"""The shim's view of a lucifer-shard output directory: manifest, rank files, plan comparison.

Pure Python (reads JSON and safetensors headers); imports neither vLLM nor torch.
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ShimError

MANIFEST_NAME = "lucifer-manifest.json"
COMPLETE_NAME = "COMPLETE"
FORMAT = "lucifer-shard/manifest"
FORMAT_VERSION = 1
ROLES = ("target", "draft")
EXPERT_TENSORS = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")
ARCH_CAPABILITY_MAJOR = {"sm120": 12, "sm100": 10, "sm90": 9}
MOE_VARIANTS = ("FLASHINFER_CUTLASS_MXFP4_MXFP8", "FLASHINFER_CUTLASS_MXFP4_BF16")
# manifest plan axis -> key of vLLM's `hf_text_config.vllm_virtual_tp_plan`
PLAN_AXES = {
    "heads": "attention_heads",
    "groups": "output_groups",
    "routed": "moe_intermediate_size",
    "shared": "shared_expert_intermediate_size",
    "vocab": "vocab_size",
}
# Parameters vLLM builds itself and the files never carry (the draft borrows the target's
# embedding and head after loading, vllm-runtime.md §5 / dsv4-flash-tp3.md §5).
DRAFT_RUNTIME_OWNED_SUFFIXES = ("shared_head.head.weight",)
DRAFT_RUNTIME_OWNED = ("model.embed_tokens.weight",)


def arch_of_capability(major: int) -> str | None:
    for arch, m in ARCH_CAPABILITY_MAJOR.items():
        if m == major:
            return arch
    return None


@dataclass
class Manifest:
    out: Path
    doc: dict[str, Any]

    @property
    def path(self) -> Path:
        return self.out / MANIFEST_NAME

    @property
    def conversion_id(self) -> str:
        return str(self.doc["conversion_id"])

    @property
    def tp_size(self) -> int:
        return int(self.doc["tp_size"])

    @property
    def plan(self) -> dict:
        return self.doc["plan"]

    @property
    def arch(self) -> str:
        return str(self.doc.get("arch"))

    @property
    def moe_variant(self) -> str:
        return str(self.doc.get("moe_variant"))

    @property
    def expert_layout(self) -> str:
        return str(self.doc.get("expert_layout", "model"))

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(r for r in ROLES if r in self.doc.get("roles", {}))

    def needs_virtual_tp(self) -> bool:
        return any(int(a["padded"]) != int(a["original"]) for a in self.plan["axes"].values())

    def rank_entry(self, role: str, rank: int) -> dict:
        roles = self.doc.get("roles", {})
        if role not in roles:
            have = ", ".join(roles) or "none"
            hint = " (converted with --no-mtp: start vLLM without a speculative config)" if role == "draft" else ""
            raise ShimError(f"{self.path} has no {role!r} role (roles: {have}){hint}")
        for entry in roles[role].get("ranks", []):
            if int(entry["rank"]) == rank:
                return entry
        raise ShimError(f"rank files missing: {self.path} lists no {role} files for rank {rank} of tp_size "
                        f"{self.tp_size}; re-run lucifer-shard convert (or verify) on {self.out}")

    def kernel_tensors(self, entry: dict) -> dict[str, dict]:
        return {n: t for n, t in entry["tensors"].items() if t.get("layout", "model") != "model"}


def load_manifest(out: str | Path, require_complete: bool = True) -> Manifest:
    """Read and sanity-check OUT/lucifer-manifest.json (and OUT/COMPLETE)."""
    out = Path(out)
    path = out / MANIFEST_NAME
    if not out.is_dir():
        raise ShimError(f"model path {out} is not a local directory; --load-format lucifer_tp3 needs the output "
                        f"directory of lucifer-shard convert")
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise ShimError(f"{path} not found: {out} is not a lucifer-shard output; run lucifer-shard convert, or "
                        f"drop --load-format lucifer_tp3") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ShimError(f"{path} unreadable ({e}); re-run lucifer-shard convert --force") from None
    if doc.get("format") != FORMAT or doc.get("format_version") != FORMAT_VERSION:
        raise ShimError(f"{path}: format {doc.get('format')!r} v{doc.get('format_version')!r}, this shim reads "
                        f"{FORMAT!r} v{FORMAT_VERSION}; use the lucifer-shard version that wrote it")
    _check_digest(path, doc)
    for key in ("conversion_id", "tp_size", "plan", "roles"):
        if key not in doc:
            raise ShimError(f"{path}: key {key!r} missing; re-run lucifer-shard convert --force")
    if require_complete and not (out / COMPLETE_NAME).exists():
        raise ShimError(f"{out / COMPLETE_NAME} missing: the conversion did not finish; re-run lucifer-shard "
                        f"convert --resume")
    m = Manifest(out, doc)
    if m.expert_layout != "model" and m.moe_variant not in MOE_VARIANTS:
        raise ShimError(f"{path}: moe_variant {m.moe_variant!r} is not one of {', '.join(MOE_VARIANTS)}")
    return m


def _check_digest(path: Path, doc: dict) -> None:
    """The manifest's self-digest (blake3 of the canonical JSON without `manifest_digest`), when present."""
    want = doc.get("manifest_digest")
    if want is None:
        return
    try:
        from blake3 import blake3
    except ImportError:  # pragma: no cover - blake3 is a dependency of lucifer-shard
        return
    body = {k: v for k, v in doc.items() if k != "manifest_digest"}
    got = "blake3:" + blake3(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    if got != want:
        raise ShimError(f"{path}: manifest_digest {want[:20]}... does not match its content ({got[:20]}...): the "
                        f"manifest was edited after conversion; re-run lucifer-shard convert --force")


def read_header(path: Path) -> tuple[dict[str, dict], dict[str, str]]:
    """(tensors {name: {dtype, shape, data_offsets}}, __metadata__) of a safetensors file."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ShimError(f"{path}: not a safetensors file (shorter than 8 bytes); re-run lucifer-shard convert")
        (n,) = struct.unpack("<Q", raw)
        if n > 1 << 30:
            raise ShimError(f"{path}: header length {n} is not plausible; the file is corrupt")
        try:
            header = json.loads(f.read(n))
        except json.JSONDecodeError as e:
            raise ShimError(f"{path}: header is not JSON ({e}); the file is corrupt") from None
    meta = header.pop("__metadata__", None) or {}
    return header, meta


# ---------------------------------------------------------------------------- virtual-TP plan


def compare_plan(runtime_plan: dict | None, manifest_plan: dict) -> str | None:
    """None when vLLM's live plan equals the manifest's; otherwise a one-line difference."""
    axes = manifest_plan["axes"]
    tp = int(manifest_plan["tp"])
    if runtime_plan is None:
        padded = [n for n in PLAN_AXES if n in axes and int(axes[n]["padded"]) != int(axes[n]["original"])]
        if padded:
            a = axes[padded[0]]
            return (f"virtual-TP plan missing at runtime, but the files pad axis {PLAN_AXES.get(padded[0], padded[0])} "
                    f"{a['original']} -> {a['padded']}")
        return None
    for name, key in PLAN_AXES.items():
        if name not in axes:
            continue
        want = axes[name]
        got = runtime_plan.get(key)
        if got is None:
            if name in ("groups", "shared") and int(want["padded"]) == int(want["original"]):
                continue
            return f"virtual-TP plan mismatch: runtime plan has no axis {key} (manifest {want['original']} -> {want['padded']})"
        for mk, rk in (("original", "original_size"), ("padded", "padded_size"), ("local", "local_size")):
            if int(got.get(rk, -1)) != int(want[mk]):
                return (f"virtual-TP plan mismatch on axis {key} (runtime {rk} {got.get(rk)}, manifest {want[mk]})")
        if "tp_size" in got and int(got["tp_size"]) != tp:
            return f"virtual-TP plan mismatch on axis {key} (runtime tp_size {got['tp_size']}, manifest {tp})"
    return None


def _align_up(x: int, a: int) -> int:
    return -(-x // a) * a


def virtual_tp_needed(heads: int, moe: int, n_shared: int, vocab: int, tp: int) -> bool:
    """Whether vLLM's DeepSeek-V4 plan at `tp` pads any axis (heads 8, routed 32, shared 128, vocab lcm(64, tp))."""
    if tp <= 0:
        return False
    for orig, a in ((heads, 8), (moe, 32), (moe * max(n_shared, 0), 128)):
        if orig and _align_up(-(-orig // tp), a) * tp != orig:
            return True
    return bool(vocab) and _align_up(vocab, math.lcm(64, tp)) != vocab
