"""The shim's wrappers around vLLM, one file each: what it wraps and why, the upstream code, the
source hashes per vetted build, what to read in a new release's diff, its factory and its installer
(each file's `WRAPPER`, a `compat.Wrapper`). Which builds get which wrapper is `compat.SUPPORTED_BUILDS`.

The fork builds get `policy` and `relayout`; stock releases get `stock_config` and `stock_vocab`
(virtual TP supplied by the plugin), and `relayout` where they have FlashInfer's CUTLASS MoE.
"""
from __future__ import annotations

from .. import compat, patches
from . import policy, relayout, stock_config, stock_vocab

WRAPPERS: dict[str, compat.Wrapper] = {w.name: w for w in (policy.WRAPPER, relayout.WRAPPER, stock_config.WRAPPER,
                                                            stock_vocab.WRAPPER)}
SYMBOLS: dict[str, compat.Symbol] = {s.key: s for w in WRAPPERS.values() for s in w.symbols}


def vetted_hash(commit: str, key: str) -> str | None:
    """The source hash a build's wrappers record for symbol `key` (None: none of them relies on it there)."""
    return next((w.hashes[commit][key] for w in WRAPPERS.values() if key in w.hashes.get(commit, {})), None)


def install(builds: tuple[compat.Build, ...] | None = None) -> dict[str, compat.WrapperVerdict]:
    """Install each wrapper whose symbols match a build vetted for it, recording the verdicts in
    `patches.VERDICTS`; idempotent; never raises."""
    builds = compat.SUPPORTED_BUILDS if builds is None else builds
    for name, wrapper in WRAPPERS.items():
        try:
            verdict = compat.judge_wrapper(wrapper, builds)
            if verdict.ok:
                wrapper.install()
            patches.VERDICTS[name] = verdict
        except Exception as e:  # noqa: BLE001 - register() must never raise
            patches.VERDICTS[name] = compat.WrapperVerdict(name, False, None, (), f"install failed: {e!r}")
        v = patches.VERDICTS[name]
        if v.ok:
            patches.logger.debug("lucifer_tp3: %s wrapper installed (build %s)", name, v.build.commit)
        else:
            patches.logger.debug("lucifer_tp3: %s wrapper not installed: %s", name, v.reason)
    return dict(patches.VERDICTS)
