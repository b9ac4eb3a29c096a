"""serve's kernel caches: every cache vLLM's start fills pointed at `OUT/kernel-cache/run/` (output/kernel_cache.py
has the layout and the record), the key that says where a recorded cache is valid, and the one decision: warm
from a record whose key is this start's and whose every file verifies, else cold into an empty run/, each said
in one line. Imports nothing of vLLM or torch (serve's start must not: issue 34); the host's facts are read at
the edge (`host_facts`: nvidia-smi and package metadata) and passed in, so the key itself is pure.
"""
from __future__ import annotations

import ast
import importlib.util
import json
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from lucifer_shard import __version__
from lucifer_shard.errors import CACHE_RECORD, MismatchError, OutputError, UsageRefused
from lucifer_shard.formats.records import to_doc
from lucifer_shard.guarded_io import Refused, Tree, read_regular
from lucifer_shard.output.kernel_cache import (CACHE_DIR, RECORD_FIX, RECORD_NAME, RUN_DIR, RUN_KEY, Record, cache_tree,
                                               key_digest, publish_record, read_record, record_problem,
                                               restore, tree_problem, walk)
from lucifer_shard.output.manifest_types import Manifest

from ..adapt import settings
from ..adapt.versions import dist_version
from .doctor import vllm_identity

# Each compiler's cache, the variable it reads and where the installed code reads it (vLLM 0.34.0's venv:
# triton 3.8.0, flashinfer-python 0.7.4, tilelang 0.1.12, nvidia-cutlass-dsl 4.8.0, DeepGEMM vendored in vLLM).
CACHES = (
    # vllm/envs.py:757; torch.compile's artefacts under it (vllm/compilation/backends.py:1091), as is
    # FlashInfer's autotune cache unless VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR is set
    # (vllm/model_executor/warmup/flashinfer_autotune_cache.py:42)
    ("vLLM", "VLLM_CACHE_ROOT", "vllm"),
    ("Triton", "TRITON_CACHE_DIR", "triton"),  # triton/knobs.py:348
    # vllm/utils/deep_gemm.py:340 sets it for the DeepGEMM vendored at vllm/third_party/deep_gemm (no separate
    # deep_gemm package is installed); DeepGEMM reads it as DG_ + JIT_CACHE_DIR (its _C_extension's deep_jit)
    ("DeepGEMM", "DG_JIT_CACHE_DIR", "deep_gemm"),
    ("TileLang", "TILELANG_CACHE_DIR", "tilelang"),  # tilelang/env.py:337
    ("CuTe-DSL", "CUTE_DSL_CACHE_DIR", "cute_dsl"),  # nvidia_cutlass_dsl/.../base_dsl/cache_helpers.py:71
    # vLLM's CuTe-DSL flash attention keeps its own: vllm/vllm_flash_attn/cute/cache_utils.py:39
    ("FlashAttention CuTe-DSL", "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", "flash_attn_cute"),
    # flashinfer/jit/env.py:66-70: FLASHINFER_CACHE_DIR is BASE/.cache/flashinfer, a module constant, not a
    # variable; its JIT ops (FLASHINFER_JIT_DIR, :396) and downloaded cubins (:125) live under it
    ("FlashInfer JIT", "FLASHINFER_WORKSPACE_BASE", "flashinfer"),
)
# vLLM's options (after `--`) that change which kernels a start compiles, as vLLM 0.34.0 spells them
# (vllm/engine/arg_utils.py: --enforce-eager :1007, --kv-cache-dtype :1416, --max-num-batched-tokens :1759,
# --cudagraph-capture-sizes :1855, --compilation-config/-cc :1922, --optimization-level/-O :1942).
KERNEL_FLAGS = ("--enforce-eager", "--kv-cache-dtype", "--kv-cache-dtype-skip-layers", "--max-num-batched-tokens",
                "--max-num-seqs", "--cudagraph-capture-sizes", "--max-cudagraph-capture-size", "--compilation-config",
                "--optimization-level", "--performance-mode", "--dtype", "--max-model-len")
SHORT = {"-cc": "--compilation-config", "-O": "--optimization-level"}
OFF_FLAG = "--no-kernel-cache"


def host_facts() -> dict:
    """What makes a compiled kernel valid on this host, read without importing torch or vLLM: the first GPU's
    name, capability and driver (nvidia-smi; None without one), the CUDA runtime torch was built for, and the
    releases of vLLM (and its commit), torch, FlashInfer and Triton."""
    gpu = cap = driver = None
    if shutil.which("nvidia-smi"):
        try:
            query = ["nvidia-smi", "--query-gpu=name,compute_cap,driver_version", "--format=csv,noheader"]
            line = subprocess.run(query, capture_output=True, text=True, timeout=10).stdout.splitlines()[0]
            gpu, cap, driver = (x.strip() for x in line.rsplit(",", 2))
        except (OSError, subprocess.SubprocessError, IndexError, ValueError):
            pass
    vllm, commit = vllm_identity()
    return {"gpu": gpu, "capability": cap, "driver": driver, "cuda": torch_cuda(), "vllm": vllm,
            "vllm_commit": commit, "torch": dist_version("torch"),
            "flashinfer": dist_version("flashinfer-python"), "triton": dist_version("triton")}


def torch_cuda() -> str | None:
    """The CUDA release torch was built for (`torch.version.cuda`), read from torch/version.py's literals
    (importing torch takes seconds)."""
    spec = importlib.util.find_spec("torch")
    where = next(iter(spec.submodule_search_locations or ()), None) if spec else None
    path = Path(where) / "version.py" if where else None
    if path is None or not path.is_file():
        return None
    for node in ast.parse(read_regular(path, follow=True).decode()).body:
        target = node.target if isinstance(node, ast.AnnAssign) else (node.targets[0] if isinstance(node, ast.Assign)
                                                                      else None)
        if isinstance(target, ast.Name) and target.id == "cuda" and isinstance(node.value, ast.Constant):
            return node.value.value
    return None


def model_geometry(manifest: Manifest) -> dict:
    """The output's side of a kernel: arch, expert layout and MoE route, and the digest of its plan and every
    rank tensor's dtype and shape (a conversion of other weights with the same geometry shares the kernels)."""
    shapes = {role: [{name: [t.dtype, list(t.shape)] for name, t in sorted(r.tensors.items())} for r in ranks]
              for role, ranks in sorted(manifest.roles.items())}
    return {"arch": manifest.arch, "expert_layout": manifest.expert_layout, "moe_variant": manifest.moe_variant,
            "moe_backend": manifest.options.moe_backend, "flashinfer_layout": manifest.flashinfer_layout,
            "shapes": key_digest({"plan": to_doc(manifest.plan), "tensors": shapes})}


def serve_options(tp: int, draft: str | None, draft_tokens: int | None, vllm_args: list[str] | tuple[str, ...]
                  ) -> dict:
    """The serve options that change kernels: TP size, the draft and its k, and each of KERNEL_FLAGS among the
    vLLM arguments with the words given after it (None where it is left to vLLM)."""
    given: dict[str, list[str] | None] = {flag: None for flag in KERNEL_FLAGS}
    current = None
    for word in vllm_args:
        if not word.startswith("-") or word.lstrip("-").replace(".", "", 1).isdigit():  # a value (-1 included)
            if current is not None:
                given[current].append(word)
            continue
        flag, value = settings.spelling(word)
        head, dot, tail = flag.partition(".")
        if head in SHORT:
            flag = SHORT[head] + dot + tail
        elif flag.startswith("-O") and not flag.startswith("--"):  # -O3: the level joined to the flag
            flag, value = SHORT["-O"], flag[2:]
        current = flag if flag.partition(".")[0] in KERNEL_FLAGS else None
        if current is not None:
            given[current] = (given.get(current) or []) + ([value] if value is not None else [])
    return {"tp": tp, "draft": draft, "draft_tokens": draft_tokens if draft else None, **given}


def cache_key(host: dict, geometry: dict, options: dict) -> dict:
    """The key a recorded cache is valid for: this host's facts, the model's geometry, the serve options."""
    return {"host": dict(host), "model": dict(geometry), "serve": dict(options)}


def key_problem(recorded: dict, key: dict, here: str = "this start") -> str | None:
    """The first field in which a record's key differs from `here`'s, in words; None when they are one."""
    for part in ("host", "model", "serve"):
        a, b = recorded.get(part) or {}, key.get(part) or {}
        for name in sorted(a.keys() | b.keys()):
            if a.get(name) != b.get(name):
                return f"recorded for {part} {name} {_shown(a.get(name))}, {here} has {_shown(b.get(name))}"
    return None if key_digest(recorded) == key_digest(key) else "recorded for another key"


def _shown(value: object) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def cache_environment(out: Path | str) -> dict[str, str]:
    """The variables serve sets: each cache in its own folder of OUT/kernel-cache/run/ (an absolute path)."""
    run = Path(out).resolve() / CACHE_DIR / RUN_DIR
    return {var: str(run / sub) for _, var, sub in CACHES}


@dataclass(frozen=True)
class Start:
    """What serve does with the kernel caches: `warm` (the record restored), the one line it says, the
    variables it sets."""

    warm: bool
    line: str
    env: dict[str, str] = field(default_factory=dict)
    key: dict | None = None

    def to_dict(self) -> dict:
        return {"warm": self.warm, "line": self.line, "env": self.env}

    def lines(self) -> list[str]:
        """The line, then each variable as the start sets it (the dry run prints them)."""
        return [self.line, *(f"  {var}={value}" for var, value in self.env.items())]


def serve_start(out: Path | str, manifest: Manifest | None, draft: str | None, tokens: int | None,
                vllm_args: list[str] | tuple[str, ...], enabled: bool = True, dry_run: bool = False,
                host: dict | None = None) -> Start:
    """serve's kernel caches for this start (`dry_run`: what it would do, doing nothing); `host`: this host's
    facts (read here when None)."""
    if manifest is None:
        return Start(False, "kernel caches: no key: OUT's manifest is refused (the output check says why)")
    options = serve_options(manifest.tp_size, draft, tokens, vllm_args)
    key = cache_key(host_facts() if host is None else host, model_geometry(manifest), options)
    return (plan_start if dry_run else prepare_start)(out, key, enabled)


def decide(out: Path | str, key: dict) -> tuple[Record | None, str | None]:
    """(the record, None) when OUT's recorded cache may run in this start: a record this tool wrote, of this
    start's key, every file the one it lists; else (None, why not). Reads every recorded file; writes nothing."""
    tree = cache_tree(out)
    if Tree(out).lstat(CACHE_DIR) is None:
        return None, f"no kernel cache in {out} yet ({RECORD_FIX})"
    record, problem = record_problem(tree)
    if record is not None and problem is None:
        problem = key_problem(record.key, key)
    return (record, None) if problem is None else (None, problem)


def plan_start(out: Path | str, key: dict | None, enabled: bool = True) -> Start:
    """The dry run's answer: what a start would do, doing nothing."""
    if not enabled:
        return Start(False, f"kernel caches: left where vLLM's defaults put them ({OFF_FLAG})")
    record, why = decide(out, key)
    env = cache_environment(out)
    if record is None:
        return Start(False, f"kernel caches: would start cold: {why}; the compilers write into "
                            f"{Path(out).resolve() / CACHE_DIR / RUN_DIR}", env, key)
    return Start(True, f"kernel caches: would start warm from the record ({_files(record)}, key "
                       f"{key_digest(key)[7:19]}, every file verified)", env, key)


def prepare_start(out: Path | str, key: dict, enabled: bool = True) -> Start:
    """serve's act before exec: run/ made exactly the verified record (warm) or empty (cold), the key of this start
    written beside it; a run/ holding anything else is moved aside to run.<time>, never deleted (it may hold code
    no record vouches for). Where OUT/kernel-cache cannot be written, the caches stay at vLLM's defaults."""
    if not enabled:
        return plan_start(out, key, enabled)
    tree = cache_tree(out)
    try:
        cache_tree(out, create=True)
        record, why = decide(out, key)
        moved = _clear_run(tree, record)
        if record is not None and tree.lstat(RUN_DIR) is None:
            try:
                restore(tree, record)
            except MismatchError as e:  # changed since it was verified: this start runs none of it
                record, why = None, str(e)
                moved = _clear_run(tree, None) or moved
        tree.make_dirs(RUN_DIR)
        tree.write_bytes(RUN_KEY, (json.dumps(key, indent=1, sort_keys=True) + "\n").encode())
    except (OSError, Refused) as e:
        return Start(False, f"kernel caches: left where vLLM's defaults put them: {tree.root} cannot be written here "
                            f"({e})")
    aside = f"; the previous {RUN_DIR}/ kept as {moved}" if moved else ""
    if record is None:
        return Start(False, f"kernel caches: cold start: {why}; compiling into {tree.path(RUN_DIR)}{aside}",
                     cache_environment(out), key)
    return Start(True, f"kernel caches: warm start from the record ({_files(record)}, key {key_digest(key)[7:19]}, "
                       f"every file verified) in {tree.path(RUN_DIR)}{aside}", cache_environment(out), key)


def _files(record: Record) -> str:
    from lucifer_shard.units import size

    return f"{len(record.files)} files, {size(record.bytes)}"


def _clear_run(tree: Tree, record: Record | None) -> str | None:
    """Leave run/ absent unless it is already exactly `record`'s files; a run/ holding anything (other) is renamed
    to run.<UTC time> (its name returned)."""
    if tree.lstat(RUN_DIR) is None:
        return None
    try:
        same = record is not None and tree_problem(tree, RUN_DIR, record) is None
    except Refused:
        same = False
    if same:
        return None
    if record is None and not tree.entries(RUN_DIR):
        return None  # empty: this start compiles into it
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    name = next(n for n in (f"{RUN_DIR}.{stamp}", *(f"{RUN_DIR}.{stamp}-{i}" for i in range(1, 1000)))
                if tree.lstat(n) is None)
    tree.rename(RUN_DIR, name)
    return name


def record_run(out: Path | str, host: dict) -> Record:
    """`lucifer-shard cache record OUT`: what the last start compiled into OUT/kernel-cache/run/, recorded under
    the key that start wrote beside it, once this host is the one that start ran on."""
    tree = cache_tree(out)
    if tree.lstat(RUN_KEY) is None or tree.lstat(RUN_DIR) is None:
        raise OutputError(f"{tree.root}: no start filled it (no {RUN_DIR}/ and {RUN_KEY})",
                          remedy=CACHE_RECORD.at(out=str(out)).after("start serve on it once"))
    try:
        key = json.loads(tree.read(RUN_KEY))
    except (ValueError, UnicodeDecodeError):
        key = None
    if not isinstance(key, dict) or not {"host", "model", "serve"} <= key.keys():
        raise OutputError(f"{tree.path(RUN_KEY)}: not the key serve writes",
                          remedy=CACHE_RECORD.at(out=str(out)).after("start serve on it again"))
    if (problem := key_problem(key, {**key, "host": host}, "this host")) is not None:
        raise UsageRefused(f"{tree.path(RUN_DIR)}: filled on another host or install ({problem}); record it on the "
                           f"host that ran the start")
    files = list(walk(tree, RUN_DIR))
    if not files:
        raise OutputError(f"{tree.path(RUN_DIR)}: empty: the start compiled nothing yet; record once vLLM is up")
    return publish_record(tree, key, {rel: (lambda rel=rel: tree.open_read(f"{RUN_DIR}/{rel}"), None)
                                      for rel in files}, __version__)


def verify_cache(out: Path | str, key: dict | None = None) -> tuple[Record | None, str | None]:
    """`cache verify`: the record and every file (and, given `key`, that it is this host's)."""
    record, problem = record_problem(cache_tree(out))
    if record is not None and problem is None and key is not None:
        problem = key_problem(record.key, key)
    return record, problem


def describe(out: Path | str) -> tuple[dict, list[str]]:
    """`cache show`: the record's key and files as it lists them (nothing hashed); none recorded is said, not
    refused."""
    tree = cache_tree(out)
    record = read_record(tree)
    if record is None:
        return {"recorded": False}, [f"no recorded kernel cache in {tree.root} ({RECORD_FIX})"]
    caches = sorted({rel.split("/")[0] for rel in record.files})
    doc = {"recorded": True, "key": record.key, "key_digest": key_digest(record.key), "files": len(record.files),
           "bytes": record.bytes, "caches": caches}
    return doc, [f"kernel cache {tree.root}: {_files(record)} ({', '.join(caches)}), key {doc['key_digest'][7:19]}",
                 *(f"  {part}: {json.dumps(record.key.get(part), sort_keys=True)}"
                   for part in ("host", "model", "serve"))]


ACTIONS = ("record", "verify", "show")


def cache_command(action: str, out: Path | str, host: dict | None = None) -> tuple[dict, list[str]]:
    """`lucifer-shard cache ACTION OUT`'s result and lines (`host`: this host's facts, read here when None).
    verify: MismatchError naming the first problem (a file added, missing or changed, a record this tool did
    not write, a key of another host)."""
    if action == "show":
        return describe(out)
    host = host_facts() if host is None else host
    if action == "record":
        record = record_run(out, host)
        return ({"files": len(record.files), "bytes": record.bytes, "key_digest": key_digest(record.key)},
                [f"recorded {_files(record)} of {cache_tree(out).path(RUN_DIR)}, key {key_digest(record.key)[7:19]}; "
                 f"serve uses it when the key is the start's and every file verifies; stage and fetch carry it with "
                 f"--kernel-cache"])
    if cache_tree(out).lstat(RECORD_NAME) is None:
        raise OutputError(f"{cache_tree(out).root}: no record ({RECORD_FIX})")
    record, problem = record_problem(cache_tree(out))
    if problem is None:
        problem = key_problem({"host": record.key.get("host")}, {"host": host}, "this host")
    if problem is not None:
        raise MismatchError(f"kernel cache refused: {problem}; serve starts cold ({RECORD_FIX} again)")
    return ({"files": len(record.files), "bytes": record.bytes, "key_digest": key_digest(record.key)},
            [f"kernel cache {cache_tree(out).root}: {_files(record)}, every file the record's, recorded on this host's "
             f"GPU, driver and releases"])
