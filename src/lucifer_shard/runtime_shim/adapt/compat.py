"""How a live vLLM is judged against the build table (lucifer_shard.model.runtimes): the record a wrapper is,
the vetted source hashes (src/lucifer_shard/runtime_shim/adapt/wrappers/hashes.json, a data file tools/vet.py writes), the judge that
matches the installed vLLM's symbols against both, and the verdicts of the last install in this process.

A wrapper (one file each in src/lucifer_shard/runtime_shim/adapt/wrappers/, its `Wrapper` record) is installed only when
every symbol it depends on is present, has the expected parameter names, and its source hash equals
the hash the data file keeps for one supported build that lists the wrapper. The hash is defined as

    "sha256:" + sha256(inspect.getsource(obj).encode("utf-8")).hexdigest()

`source_from_module_text` reproduces `inspect.getsource` from a module's text (the same
`inspect.getblock` on the lines starting at the first decorator or `def`), so the hashes can be
computed offline from `git show <commit>:<path>` of the fork's builds or from a stock release's wheel
(tools/vllm_hashes.py); a stock release is vetted by tools/vet.py (docs/vllm-releases.md).

Imports nothing from vLLM at import time, and no other shim module (the wrapper files import it).
"""
from __future__ import annotations

import ast
import hashlib
import importlib
import inspect
import io
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lucifer_shard.guarded_io import read_regular
from lucifer_shard.model.runtimes import POLICY, STOCK_WRAPPERS, Build

# The vetted source hashes: build (model/runtimes.SUPPORTED_BUILDS) -> symbol key -> hash. tools/vet.py writes it.
HASHES_FILE = Path(__file__).resolve().parent / "wrappers" / "hashes.json"


def read_hashes(path: Path = HASHES_FILE) -> dict[str, dict[str, str]]:
    """The vetted source hashes of the data file (shipped inside the package)."""
    return json.loads(read_regular(path))


def hashes_text(hashes: dict[str, dict[str, str]]) -> str:
    """The data file's text: sorted, one hash a line, so that vet's rewrite of a vetted release changes no byte."""
    return json.dumps(hashes, indent=1, sort_keys=True) + "\n"


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
    """One wrapper the shim installs: what it replaces, why, where, what would let it go, and what to read in a
    new release's diff (the source hashes of its symbols per vetted build are in HASHES_FILE)."""

    name: str
    symbols: tuple[Symbol, ...]  # the symbols it relies on; the first is the one it replaces
    process: str  # "engine" (the front end / engine core, where configs are made) or "worker"
    does: str
    why: str
    remove_when: str
    upstream: str  # a link to the upstream file it wraps
    read_in_diff: str  # what a maintainer checks in a new release's diff of its symbols before accepting their hashes
    install: Callable[[], None]  # puts the wrapper in place, once (only after judge_wrapper accepted the build)


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


def judge_wrapper(wrapper: Wrapper, builds: tuple[Build, ...], hashes: dict[str, dict[str, str]]) -> WrapperVerdict:
    """Whether `wrapper` may be installed on this vLLM: each symbol present with its parameters, and its source
    hash the one `hashes` keeps for one of `builds` that lists the wrapper."""
    states = tuple(inspect_symbol(s) for s in wrapper.symbols)
    for s in states:
        if not s.present:
            return WrapperVerdict(wrapper.name, False, None, states, s.detail)
        if not s.signature_ok:
            return WrapperVerdict(wrapper.name, False, None, states, f"{s.symbol.dotted}: {s.detail}")
    vetted = [b for b in builds if wrapper.name in b.wrappers]
    for b in vetted:
        if all(hashes.get(b.commit, {}).get(s.symbol.key) == s.hash for s in states):
            return WrapperVerdict(wrapper.name, True, b, states, "")
    found = ", ".join(f"{s.symbol.dotted} {s.hash[:19] if s.hash else None}" for s in states)
    return WrapperVerdict(wrapper.name, False, None, states,
                          f"source hash of {found} matches no build vetted for it "
                          f"({', '.join(b.commit for b in vetted) or 'none'})")


# wrapper name -> WrapperVerdict of the last install attempt in this process (wrappers.install)
VERDICTS: dict[str, WrapperVerdict] = {}


def installed(wrapper: str) -> bool:
    v = VERDICTS.get(wrapper)
    return bool(v and v.ok)


def why_not_installed(wrapper: str) -> str:
    v = VERDICTS.get(wrapper)
    if v is None:
        return "the shim's register() has not run in this process (plugin not loaded?)"
    return v.reason


def virtual_tp_missing() -> str | None:
    """Why this vLLM gets no virtual TP, neither the fork's (policy wrapper) nor the plugin's (the stock
    wrappers); None when it has one."""
    if installed(POLICY) or all(installed(w) for w in STOCK_WRAPPERS):
        return None
    return next(why_not_installed(w) for w in STOCK_WRAPPERS if not installed(w))


def replace(symbol: Symbol, make) -> None:
    """Put `make(original)` where the symbol lives (a module function or a class attribute), once."""
    owner = importlib.import_module(symbol.module)
    *path, name = symbol.qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    current = getattr(owner, name)
    if getattr(current, "__lucifer_wrapped__", None) is not None:
        return
    setattr(owner, name, make(current))
