"""`lucifer-shard serve`: the vllm command it execs, the refusals before vLLM starts, its reading of the
checks, and the exec. Imports nothing of vLLM (serve's start must not: issue 34).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

from lucifer_shard.model.config import MTP
from lucifer_shard.model.drafts import DRAFT_KINDS, speculative_config
from lucifer_shard.model.runtimes import ATTENTION_BACKEND, LOAD_FORMAT, MOE_BACKEND, STOCK_BACKENDS

from ..adapt import settings
from ..checks import ENVIRONMENT, FAIL, OUTPUT, SKIP, Check
from ..errors import ShimError
from .doctor import vllm_identity

SERVE_FLAGS = ("--tensor-parallel-size", "--load-format", "--attention-backend", "--moe-backend")
# vLLM's multi-node flags: serve's own options (before `--`), passed on; node 1.. run headless (no API
# server: node 0 serves it), as vLLM's multi-node mp launch does: serve adds --headless itself.
NODE_FLAGS = ("--nnodes", "--node-rank", "--master-addr", "--master-port")
HEADLESS_FLAG = "--headless"
# --hf-overrides: the plugin gives vLLM the manifest's padded sizes through it, and refuses a user's at
# load (the model must be the config that was converted); refused here before vLLM starts, like the rest.
HF_OVERRIDES_FLAG = "--hf-overrides"
SHORT_FLAGS = {"-tp": "--tensor-parallel-size"}  # vLLM's short spellings of the flags serve sets
SPECULATIVE_FLAG = "--speculative-config"


def speculative_problem(extra: list[str], kind: str | None) -> str | None:
    """Why a --speculative-config among the vLLM arguments cannot draft from OUT's own draft of `kind`
    (None: it can, or names a draft model of its own): a method of another kind builds that kind's class,
    which finds none of its weights in OUT/draft (vLLM 0.34.0 only logs the count it loaded)."""
    for i, word in enumerate(extra):
        flag, value = settings.spelling(word)
        if flag != SPECULATIVE_FLAG:
            continue
        value = value if value is not None else (extra[i + 1] if i + 1 < len(extra) else "")
        try:
            doc = json.loads(value)
        except ValueError:
            return None  # vLLM parses it and says what is wrong
        if not isinstance(doc, dict) or doc.get("model") or doc.get("method") not in {k.method for k in DRAFT_KINDS.values()}:
            return None
        want = DRAFT_KINDS[kind].method if kind else None
        if doc["method"] != want:
            has = f"a {DRAFT_KINDS[kind].label} (method {want!r})" if kind else "no draft (converted with --no-mtp)"
            return (f"{SPECULATIVE_FLAG} asks for method {doc['method']!r} but OUT/draft holds {has}; use serve "
                    f"--draft (it sets the method from the manifest)" if kind else
                    f"{SPECULATIVE_FLAG} asks for method {doc['method']!r} but OUT holds {has}; convert without "
                    f"--no-mtp, or drop {SPECULATIVE_FLAG}")
    return None


def backends_remark() -> str:
    """What the dry run says when it cannot know the serving GPU (an output converted without --arch)."""
    table = "; ".join(f"{', '.join(a for a, b in STOCK_BACKENDS.items() if b == pair)}: {' + '.join(pair)}"
                      for pair in dict.fromkeys(STOCK_BACKENDS.values()))
    return (f"backends: OUT was converted without --arch (any GPU family) and no GPU is visible here, so the command "
            f"leaves --attention-backend and --moe-backend to vLLM; serve on a GPU host adds its family's ({table})")


def serve_environment(out_dir: str | Path, mtp: bool) -> dict[str, str]:
    """The environment serve execs vLLM with: this one, plus SERVE_ENV for the in-vLLM checks."""
    return {**os.environ, settings.SERVE_ENV: json.dumps({"out": str(out_dir), "mtp": bool(mtp)})}



def serve_argv(out_dir: str | Path, tp: int, extra_args: list[str] | tuple[str, ...] = (),
               mtp_tokens: int | None = None, vllm: str = "vllm",
               backends: tuple[str, str] | None = (ATTENTION_BACKEND, MOE_BACKEND),
               node: dict | None = None, expert_layout: str = "kernel", draft_kind: str | None = MTP,
               moe_route: str | None = None) -> list[str]:
    """The `vllm serve` command for OUT (`tp` from its manifest) with the given backends, its draft (of
    `draft_kind`, `mtp_tokens` per step) when `mtp_tokens`
    (`serve_backends`; None leaves them to vLLM) and, for one node of several, vLLM's multi-node
    flags (`node`: nnodes, node_rank, master_addr, master_port). Raises ShimError when the extra
    arguments set a flag lucifer-shard sets, or one the plugin refuses at load (`settings.REQUIRED`,
    the loader's --model-loader-extra-config). A model-layout output may take another --moe-backend
    there (vLLM lays its experts out for whichever MoE kernel it runs), unless it is of a MoE route
    (`moe_route`: b12x), whose width only that backend takes."""
    extra = list(extra_args)
    owned = {flag: "lucifer-shard serve sets it from the manifest" for flag in SERVE_FLAGS}
    # a model-layout output of the default route may take another 128-rounding backend; the b12x route's width
    # is its backend's alone (`moe_route`)
    user_moe = expert_layout == "model" and moe_route is None and "--moe-backend" in {settings.spelling(a)[0] for a in extra}
    if user_moe:
        del owned["--moe-backend"]
    owned.update({flag: "it is serve's own option: pass it before `--`" for flag in NODE_FLAGS})
    owned[HEADLESS_FLAG] = "serve adds it itself on the nodes above 0 (serve --nnodes N --node-rank R --master-addr H)"
    owned[HF_OVERRIDES_FLAG] = ("the plugin sets it from the manifest (the model must be the config that was "
                                "converted)")
    if mtp_tokens:
        owned[SPECULATIVE_FLAG] = "--draft sets it"
    given = {SHORT_FLAGS.get(flag, flag).partition(".")[0] for flag, _ in map(settings.spelling, extra)}
    for flag, why in owned.items():
        if flag in given:
            raise ShimError(f"{flag} is in the vLLM arguments but {why}; remove it from them")
    refused = settings.argument_problems(extra) + [p for p in [speculative_problem(extra, draft_kind)] if p]
    if refused:
        raise ShimError(f"refused before vLLM starts, as the loader would refuse it at load: {'; '.join(refused)}")
    argv = [vllm, "serve", str(Path(out_dir)), "--tensor-parallel-size", str(tp),
            "--load-format", LOAD_FORMAT]
    if backends is not None:
        argv += ["--attention-backend", backends[0]] + ([] if user_moe else ["--moe-backend", backends[1]])
    if mtp_tokens:
        argv += [SPECULATIVE_FLAG, speculative_config(draft_kind or MTP, mtp_tokens)]
    if node is not None:
        argv += ["--nnodes", str(node["nnodes"]), "--node-rank", str(node["node_rank"]), "--master-addr",
                 node["master_addr"], *(["--master-port", str(node["master_port"])] if node.get("master_port") else []),
                 *([HEADLESS_FLAG] if node["node_rank"] > 0 else [])]
    return argv + extra


@dataclass(frozen=True)
class Preflight:
    """serve's reading of the checks. A dry run on a machine without vLLM (the conversion box) cannot
    check the environment: its failures are shown as skipped and only OUT's decide. serve itself never
    skips one (it is about to exec vLLM here)."""

    failed: tuple[Check, ...]  # of the shown checks: the output's first, then the environment's
    environment_checked: bool
    shown: tuple[Check, ...] = ()  # the checks as the report prints them (skipped ones as SKIP)

    @property
    def ok(self) -> bool:
        return not self.failed

    @property
    def output_ok(self) -> bool:
        return not any(c.scope == OUTPUT for c in self.failed)

    @property
    def damaged(self) -> bool:
        """A failure that finds OUT damaged or edited (kind mismatch, as every reader of OUT says it)."""
        return any(c.damage for c in self.failed)

    def note(self) -> str | None:
        if self.environment_checked:
            return None
        return ("environment checks skipped: vLLM is not installed here, so vLLM, the plugin and the GPU were not "
                "checked; run lucifer-shard doctor OUT (or this dry run) again on the serving host")


def preflight(checks: list[Check], dry_run: bool) -> Preflight:
    skip = dry_run and vllm_identity()[0] is None
    shown = [replace(c, status=SKIP, fix="") if skip and c.scope == ENVIRONMENT and c.status == FAIL else c
             for c in checks]
    failed = sorted((c for c in shown if c.status == FAIL), key=lambda c: c.scope != OUTPUT)
    return Preflight(tuple(failed), not skip, tuple(shown))


def exec_vllm(argv: list[str], env: dict[str, str] | None = None) -> None:
    """Replace this process by vLLM (never returns); `env`: serve_environment's."""
    if env is None:
        os.execvp(argv[0], argv)
    os.execvpe(argv[0], argv, env)
