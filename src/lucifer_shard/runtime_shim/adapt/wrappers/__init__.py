"""The shim's wrappers around vLLM, one file each: what it wraps and why, the upstream code, what to read in a new
release's diff, its factory and its installer (each file's `WRAPPER`, a `compat.Wrapper`). Which builds get which
wrapper is `model/runtimes.SUPPORTED_BUILDS`; the source hashes that vet each build are the data file `hashes.json`
beside this one (`HASHES`), written by tools/vet.py.

The fork builds get `policy` and `relayout`; stock releases get `stock_config` and `stock_vocab`
(virtual TP supplied by the plugin), and `relayout` where they have FlashInfer's CUTLASS MoE.
"""
from __future__ import annotations

import logging

from lucifer_shard.model import runtimes

from . import policy, relayout, stock_config, stock_vocab
from .. import compat

logger = logging.getLogger("lucifer_shard.runtime_shim")

WRAPPERS: dict[str, compat.Wrapper] = {w.name: w for w in (policy.WRAPPER, relayout.WRAPPER, stock_config.WRAPPER,
                                                            stock_vocab.WRAPPER)}
SYMBOLS: dict[str, compat.Symbol] = {s.key: s for w in WRAPPERS.values() for s in w.symbols}
HASHES: dict[str, dict[str, str]] = compat.read_hashes()  # build -> symbol key -> vetted source hash


def vetted_hash(commit: str, key: str) -> str | None:
    """The source hash a build's wrappers were vetted with for symbol `key` (None: none of them relies on it there)."""
    return HASHES.get(commit, {}).get(key)


def install(builds: tuple[runtimes.Build, ...] | None = None) -> dict[str, compat.WrapperVerdict]:
    """Install each wrapper whose symbols match a build vetted for it, recording the verdicts in
    `compat.VERDICTS`; idempotent; never raises."""
    builds = runtimes.SUPPORTED_BUILDS if builds is None else builds
    for name, wrapper in WRAPPERS.items():
        try:
            verdict = compat.judge_wrapper(wrapper, builds, HASHES)
            if verdict.ok:
                wrapper.install()
            compat.VERDICTS[name] = verdict
        except Exception as e:  # noqa: BLE001 - register() must never raise
            compat.VERDICTS[name] = compat.WrapperVerdict(name, False, None, (), f"install failed: {e!r}")
        v = compat.VERDICTS[name]
        if v.ok:
            logger.debug("lucifer_tp3: %s wrapper installed (build %s)", name, v.build.commit)
        else:
            logger.debug("lucifer_tp3: %s wrapper not installed: %s", name, v.reason)
    return dict(compat.VERDICTS)
