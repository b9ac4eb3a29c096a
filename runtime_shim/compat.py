"""Which vLLM builds the shim's two wrappers are vetted for: symbols, signatures, source hashes.

A wrapper is installed only when every symbol it depends on is present, has the expected
parameter names, and its source hash equals the hash recorded for one supported build. The hash
is defined as

    "sha256:" + sha256(inspect.getsource(obj).encode("utf-8")).hexdigest()

`source_from_module_text` reproduces `inspect.getsource` from a module's text (the same
`inspect.getblock` on the lines starting at the first decorator or `def`), so the allow-list can be
computed offline from `git show <commit>:<path>` of the supported builds:

    python -m lucifer_shard.runtime_shim.compat <git-dir> <commit>...

This module imports nothing from vLLM at import time.
"""
from __future__ import annotations

import ast
import hashlib
import importlib
import inspect
import io
import subprocess
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Symbol:
    key: str  # short name used in the allow-list and in messages
    module: str  # importable module
    qualname: str  # attribute path inside the module ("Class.method" allowed)
    params: tuple[str, ...]  # expected parameter names, in order

    @property
    def path(self) -> str:
        return self.module.replace(".", "/") + ".py"

    @property
    def dotted(self) -> str:
        return f"{self.module}.{self.qualname}"


SYMBOLS: dict[str, Symbol] = {s.key: s for s in (
    Symbol("maybe_apply_b12x_virtual_tp_padding", "vllm.config.virtual_tp",
           "maybe_apply_b12x_virtual_tp_padding", ("vllm_config",)),
    Symbol("apply_b12x_virtual_tp_padding_to_model_config", "vllm.config.virtual_tp",
           "apply_b12x_virtual_tp_padding_to_model_config", ("model_config", "parallel_config")),
    Symbol("convert_weight_to_mxfp4_moe_kernel_format", "vllm.model_executor.layers.fused_moe.oracle.mxfp4",
           "convert_weight_to_mxfp4_moe_kernel_format",
           ("mxfp4_backend", "layer", "w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale",
            "w13_bias", "w2_bias", "_cache_permute_indices")),
    Symbol("Mxfp4MoEMethod._setup_kernel", "vllm.model_executor.layers.quantization.mxfp4",
           "Mxfp4MoEMethod._setup_kernel",
           ("self", "layer", "w13", "w2", "w13_scale", "w2_scale", "w13_bias", "w2_bias")),
)}

# The two wrappers and the symbols each one relies on (the first is the one it replaces).
POLICY = "virtual_tp_policy"
RELAYOUT = "expert_relayout"
WRAPPER_SYMBOLS: dict[str, tuple[str, ...]] = {
    POLICY: ("maybe_apply_b12x_virtual_tp_padding", "apply_b12x_virtual_tp_padding_to_model_config"),
    RELAYOUT: ("convert_weight_to_mxfp4_moe_kernel_format", "Mxfp4MoEMethod._setup_kernel"),
}
# Where the relayout wrapper is installed: the name `_setup_kernel` looks up at call time.
RELAYOUT_PATCH_MODULE = "vllm.model_executor.layers.quantization.mxfp4"
RELAYOUT_PATCH_ATTR = "convert_weight_to_mxfp4_moe_kernel_format"


REPOSITORY = "https://github.com/mlow/vllm"  # the vLLM fork with virtual TP (vllm-runtime.md)


@dataclass(frozen=True)
class Build:
    commit: str
    label: str
    hashes: dict[str, str]
    draft_virtual_tp: bool  # the MTP draft config gets the virtual-TP plan too
    flashinfer: str  # flashinfer-python pinned by the build's requirements/cuda.txt
    branches: tuple[str, ...]  # branches of REPOSITORY that hold the commit

    def serves(self) -> dict[str, bool]:
        """What lucifer_tp3 can load on this build, per kind of output (the README's table)."""
        return {"sm120/sm100 kernel": True,  # the re-layout wrapper is vetted for every build
                "model layout": True,
                "sm90 kernel": False,  # needs the SM90 "c-full" load path, not built
                "MTP draft (--mtp)": self.draft_virtual_tp}


# Computed with `python -m lucifer_shard.runtime_shim.compat /work/.mirror/mlow+vllm/repo 45c1582e9
# cece381c4 81564374e` from the public repository mlow/vllm (see README "Serving").
SUPPORTED_BUILDS: tuple[Build, ...] = (
    Build(
        commit="45c1582e9",
        label="mlow/vllm v9 (audited image; branches mlow/dsv4-dspark-v8, mlow/vllm-b12x-ee)",
        hashes={
            "maybe_apply_b12x_virtual_tp_padding": "sha256:d2b413ba3ed7f38fd1fbecfe0109b730458552e37972b26d4b35b12f1174893a",
            "apply_b12x_virtual_tp_padding_to_model_config": "sha256:277638f6c6527fee272792f44abc5f4d216d221da9c16b397a6fb8d3f64166a3",
            "convert_weight_to_mxfp4_moe_kernel_format": "sha256:ee8705dcabd3eec6a0b27b9a3f721de8b496a7c9bcd75a045477f2abc58c3acd",
            "Mxfp4MoEMethod._setup_kernel": "sha256:c0affd064e176be46068a4bf65c8a9a72da33bae8faab50fae29f23c5ba47a86",
        },
        draft_virtual_tp=True,
        flashinfer="0.6.12",
        branches=("mlow/dsv4-dspark-v8", "mlow/vllm-b12x-ee"),
    ),
    Build(
        commit="cece381c4",
        label="mlow/vllm branch mlow/vllm-gb10-b12x-ff",
        hashes={
            "maybe_apply_b12x_virtual_tp_padding": "sha256:d2b413ba3ed7f38fd1fbecfe0109b730458552e37972b26d4b35b12f1174893a",
            "apply_b12x_virtual_tp_padding_to_model_config": "sha256:277638f6c6527fee272792f44abc5f4d216d221da9c16b397a6fb8d3f64166a3",
            "convert_weight_to_mxfp4_moe_kernel_format": "sha256:450a446ab3afb7d3626aa9870434b54f318e01984b3ceede81a87f4abc63b4f0",
            "Mxfp4MoEMethod._setup_kernel": "sha256:c0affd064e176be46068a4bf65c8a9a72da33bae8faab50fae29f23c5ba47a86",
        },
        draft_virtual_tp=False,
        flashinfer="0.6.13",
        branches=("mlow/vllm-gb10-b12x-ff",),
    ),
    Build(
        commit="81564374e",
        label="mlow/vllm branch gg-fix",
        hashes={
            "maybe_apply_b12x_virtual_tp_padding": "sha256:d2b413ba3ed7f38fd1fbecfe0109b730458552e37972b26d4b35b12f1174893a",
            "apply_b12x_virtual_tp_padding_to_model_config": "sha256:277638f6c6527fee272792f44abc5f4d216d221da9c16b397a6fb8d3f64166a3",
            "convert_weight_to_mxfp4_moe_kernel_format": "sha256:450a446ab3afb7d3626aa9870434b54f318e01984b3ceede81a87f4abc63b4f0",
            "Mxfp4MoEMethod._setup_kernel": "sha256:c0affd064e176be46068a4bf65c8a9a72da33bae8faab50fae29f23c5ba47a86",
        },
        draft_virtual_tp=True,
        flashinfer="0.6.14",
        branches=("gg-fix",),
    ),
)

HASH_PREFIX = "sha256:"


def source_hash(text: str) -> str:
    return HASH_PREFIX + hashlib.sha256(text.encode("utf-8")).hexdigest()


def _resolve_node(tree: ast.Module, qualname: str) -> ast.AST:
    body: list[ast.stmt] = tree.body
    node: ast.AST | None = None
    for part in qualname.split("."):
        node = None
        for stmt in body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and stmt.name == part:
                node = stmt  # the last definition wins, as at import time
        if node is None:
            raise KeyError(f"{qualname}: {part!r} is not defined")
        body = getattr(node, "body", [])
    assert node is not None
    return node


def source_from_module_text(text: str, qualname: str) -> str:
    """`inspect.getsource` of `qualname`, computed from the module text without importing it."""
    node = _resolve_node(ast.parse(text), qualname)
    first = min([d.lineno for d in getattr(node, "decorator_list", [])] + [node.lineno])
    lines = io.StringIO(text).readlines()
    return "".join(inspect.getblock(lines[first - 1:]))


def resolve(symbol: Symbol):
    """Import the module and return the object (ImportError/AttributeError propagate)."""
    obj = importlib.import_module(symbol.module)
    for part in symbol.qualname.split("."):
        obj = getattr(obj, part)
    return obj


def unwrap(obj):
    """The original function behind a shim wrapper (so re-registration hashes the real source)."""
    while getattr(obj, "__lucifer_wrapped__", None) is not None:
        obj = obj.__lucifer_wrapped__
    return obj


def param_names(obj) -> tuple[str, ...]:
    return tuple(inspect.signature(obj).parameters)


@dataclass(frozen=True)
class SymbolState:
    symbol: Symbol
    present: bool
    detail: str  # why not present / signature difference; "" when fine
    hash: str | None = None
    signature_ok: bool = False


def inspect_symbol(symbol: Symbol) -> SymbolState:
    try:
        obj = unwrap(resolve(symbol))
    except ImportError as e:
        return SymbolState(symbol, False, f"module {symbol.module} not importable ({e.__class__.__name__}: {e})")
    except AttributeError:
        return SymbolState(symbol, False, f"{symbol.dotted} not found")
    try:
        names = param_names(obj)
    except (TypeError, ValueError) as e:
        return SymbolState(symbol, True, f"no signature ({e})")
    try:
        h = source_hash(inspect.getsource(obj))
    except (OSError, TypeError) as e:
        return SymbolState(symbol, True, f"source unavailable ({e})", None, names == symbol.params)
    if names != symbol.params:
        return SymbolState(symbol, True, f"signature ({', '.join(names)}) != expected ({', '.join(symbol.params)})",
                           h, False)
    return SymbolState(symbol, True, "", h, True)


@dataclass(frozen=True)
class WrapperVerdict:
    wrapper: str
    ok: bool
    build: Build | None
    states: tuple[SymbolState, ...]
    reason: str  # one line: why it cannot be installed ("" when ok)


def judge_wrapper(wrapper: str, builds: tuple[Build, ...] = SUPPORTED_BUILDS) -> WrapperVerdict:
    states = tuple(inspect_symbol(SYMBOLS[k]) for k in WRAPPER_SYMBOLS[wrapper])
    for s in states:
        if not s.present:
            return WrapperVerdict(wrapper, False, None, states, s.detail)
        if not s.signature_ok:
            return WrapperVerdict(wrapper, False, None, states, f"{s.symbol.dotted}: {s.detail}")
    for b in builds:
        if all(b.hashes.get(s.symbol.key) == s.hash for s in states):
            return WrapperVerdict(wrapper, True, b, states, "")
    found = ", ".join(f"{s.symbol.key}={s.hash[:19] if s.hash else None}" for s in states)
    return WrapperVerdict(wrapper, False, None, states,
                          f"source hashes ({found}) match no supported build "
                          f"({', '.join(b.commit for b in builds) or 'none'})")


# ------------------------------------------------------------------------------ offline tool


def hashes_at_commit(git_dir: str, commit: str) -> dict[str, str]:
    """Allow-list hashes of every symbol at `commit` of a vLLM git repository."""
    out = {}
    for s in SYMBOLS.values():
        text = subprocess.run(["git", "--git-dir", git_dir, "show", f"{commit}:{s.path}"], check=True,
                              capture_output=True, text=True).stdout
        out[s.key] = source_hash(source_from_module_text(text, s.qualname))
    return out


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: python -m lucifer_shard.runtime_shim.compat GIT_DIR COMMIT...", file=sys.stderr)
        return 2
    git_dir, commits = argv[0], argv[1:]
    for c in commits:
        print(c)
        for k, h in hashes_at_commit(git_dir, c).items():
            print(f"    {k!r}: {h!r},")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
