"""The vLLM settings lucifer_tp3 refuses, one table read at both ends: where vLLM is configured (the
engine-config checks and the loader, from a VllmConfig) and by `lucifer-shard serve` before it starts
vLLM (from the command line, in vLLM's own spellings), so that a refusal comes before a multi-GPU
start and not after it.

Imports nothing of vLLM.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import ShimError

# `lucifer-shard serve` hands the checks that need vLLM their OUT through the environment of the vLLM it
# execs ({"out", "mtp"} as JSON); the plugin's register() runs them in vLLM's first process.
SERVE_ENV = "LUCIFER_SHARD_SERVE"
LOADER_CONFIG_FLAG = "--model-loader-extra-config"
# The --model-loader-extra-config keys the loader accepts, with their values. verify: what is checked
# beyond the key set, every tensor's dtype and shape (file header = manifest = parameter) and its
# bytes lying inside its file, which every mode checks. none: nothing more, the files are trusted to
# be the manifest's. headers: the manifest's self-digest, each file's size and identity stamp
# (conversion id, role, rank, TP size). full: also the BLAKE3 of every tensor and file, computed
# while reading, and every zero region. role: which model the files are for (auto: detected).
LOADER_OPTIONS: dict[str, tuple[str, ...]] = {
    "verify": ("none", "headers", "full"),
    "role": ("auto", "target", "draft"),
}
LOADER_DEFAULTS = {"verify": "headers", "role": "auto"}


def extra_config_problem(extra: Any) -> str | None:
    """Why the loader refuses a --model-loader-extra-config value (None: it accepts it)."""
    if not isinstance(extra, dict):
        return (f"{LOADER_CONFIG_FLAG} {json.dumps(extra)[:80]} is not a JSON object; lucifer_tp3 takes an object "
                f"with the keys {', '.join(sorted(LOADER_OPTIONS))}, e.g. '{{\"verify\": \"full\"}}'")
    unknown = sorted(set(extra) - set(LOADER_OPTIONS))
    if unknown:
        return (f"unknown {LOADER_CONFIG_FLAG} key(s) {', '.join(map(repr, unknown))}; lucifer_tp3 accepts "
                f"{', '.join(sorted(LOADER_OPTIONS))}")
    for k, v in extra.items():
        if v not in LOADER_OPTIONS[k]:
            return f"{LOADER_CONFIG_FLAG} {k}={v!r}; expected one of {', '.join(map(repr, LOADER_OPTIONS[k]))}"
    return None


def parse_extra_config(extra: Any) -> dict:
    """The loader's options from vLLM's `model_loader_extra_config` (None or {}: the defaults)."""
    extra = dict(extra or {})
    problem = extra_config_problem(extra)
    if problem:
        raise ShimError(problem)
    return {**LOADER_DEFAULTS, **extra}


@dataclass(frozen=True)
class Required:
    """A vLLM setting that per-TP-rank files need off (a switch) or at 1 (a size)."""

    name: str  # how messages name it: the config attribute, or the feature
    flags: tuple[str, ...]  # vLLM's spellings of the flag, the long one first
    read: Callable[[Any], Any]  # its value in a VllmConfig
    why: str
    switch: bool = False

    def problem(self, value: Any) -> str | None:
        if self.switch:
            return f"{self.name} on ({self.why}: drop {self.flags[0]})" if value else None
        if value is None or _int(value) in (1, None):  # not an integer: vLLM's own parser refuses it
            return None
        return f"{self.name}={value} ({self.why}: start with {self.flags[0]} 1)"


def _parallel(attr: str) -> Callable[[Any], Any]:
    return lambda vllm_config: getattr(vllm_config.parallel_config, attr, None)


# vLLM 0.33.0's spellings (vllm/engine/arg_utils.py); the fork builds have the same ones.
REQUIRED: tuple[Required, ...] = (
    Required("pipeline_parallel_size", ("--pipeline-parallel-size", "-pp"), _parallel("pipeline_parallel_size"),
             "rank files are per TP rank"),
    Required("data_parallel_size", ("--data-parallel-size", "-dp"), _parallel("data_parallel_size"),
             "the MoE shard index flattens dp into TP, rank files are per TP rank"),
    Required("prefill_context_parallel_size", ("--prefill-context-parallel-size", "-pcp"),
             _parallel("prefill_context_parallel_size"), "rank files are per TP rank"),
    Required("expert parallel", ("--enable-expert-parallel", "-ep"), _parallel("enable_expert_parallel"),
             "the files shard the experts by TP", switch=True),
    Required("EPLB", ("--enable-eplb",), _parallel("enable_eplb"), "the files place each expert on its TP rank",
             switch=True),
    Required("LoRA", ("--enable-lora",), lambda c: getattr(c, "lora_config", None) is not None,
             "not supported with lucifer_tp3", switch=True),
)


def config_problems(vllm_config: Any) -> list[str]:
    """Each REQUIRED setting a VllmConfig has otherwise (empty: none)."""
    return [p for r in REQUIRED if (p := r.problem(r.read(vllm_config)))]


# ------------------------------------------------------------------------------- command line


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def spelling(word: str) -> tuple[str, str | None]:
    """(flag, inline value) of a command-line word as vLLM's FlexibleArgumentParser reads it:
    `--a_b.c=v` is the flag `--a-b.c` with the value `v` (underscores before the first dot are
    dashes); a word that is not an option is itself, with no value."""
    if not word.startswith("-"):
        return word, None
    key, eq, value = word.partition("=")
    if key.startswith("--"):
        head, dot, tail = key[2:].partition(".")
        key = "--" + head.replace("_", "-") + dot + tail
    return key, (value if eq else None)


def _negations(r: Required) -> tuple[str, ...]:
    """`--no-enable-x` (argparse's BooleanOptionalAction) and `--disable-x` (vLLM's EnableDisableAction)."""
    long = r.flags[0]
    return ("--no-" + long[2:], "--disable-" + long.removeprefix("--enable-")) if r.switch else ()


def _dotted_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def argument_problems(args: list[str] | tuple[str, ...]) -> list[str]:
    """Each vLLM argument among `args` that lucifer_tp3 refuses at load: a REQUIRED setting, or a
    --model-loader-extra-config the loader does not accept. Read as vLLM reads them: `--flag value`
    and `--flag=value`, the short flags, underscores for dashes, `--no-`/`--disable-` negations, the
    last of a repeated flag, `--model-loader-extra-config.KEY VALUE` (which replaces the whole JSON).
    Not read: abbreviated flags and `--config FILE` (the load-time checks still refuse those)."""
    setting = {f: r for r in REQUIRED for f in r.flags}
    negated = {f: r for r in REQUIRED for f in _negations(r)}
    found: dict[Required, Any] = {}
    extra: Any = None
    dotted: dict[str, Any] = {}
    words = list(args)
    i = 0
    while i < len(words):
        flag, value = spelling(words[i])
        takes = (flag in setting and not setting[flag].switch) or flag.partition(".")[0] == LOADER_CONFIG_FLAG
        if takes and value is None:
            value = words[i + 1] if i + 1 < len(words) else None
            i += 1
        i += 1
        if flag in negated:
            found[negated[flag]] = False
        elif flag in setting:
            found[setting[flag]] = True if setting[flag].switch else value
        elif flag == LOADER_CONFIG_FLAG and value is not None:
            try:
                extra = json.loads(value)
            except json.JSONDecodeError:
                extra = value
        elif flag.startswith(LOADER_CONFIG_FLAG + ".") and value is not None:
            node = dotted
            *path, last = flag[len(LOADER_CONFIG_FLAG) + 1:].split(".")
            for key in path:
                node = node.setdefault(key, {})
            node[last] = _dotted_value(value)
    problems = [p for r, v in found.items() if (p := r.problem(v))]
    extra = dotted or extra  # vLLM appends the dotted keys as one JSON after everything else
    if extra is not None:
        problem = extra_config_problem(extra)
        if problem:
            problems.append(problem)
    return problems
