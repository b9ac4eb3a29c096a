"""lucifer-shard runtime shim: the vLLM plugin that loads lucifer-shard rank files verbatim.

Entry point (pyproject): `[project.entry-points."vllm.general_plugins"] lucifer_tp3 =
"lucifer_shard.runtime_shim:register"`. vLLM calls `register()` in every process (front end,
engine core, each worker). It is idempotent, imports vLLM only when called, and never raises:
vLLM merely logs plugin exceptions, so a failure here is logged and surfaces later as
"Load format `lucifer_tp3` is not supported" — run `lucifer-shard doctor` to see why. The one
exception is asked for: a vLLM started by `lucifer-shard serve` (its environment holds
`settings.SERVE_ENV`) runs there the preflight checks that need vLLM imported, and a failed one stops
it (SystemExit, exit 1, one line per failed check) before any GPU work, as serve's preflight did
before it moved into vLLM's process (so that serve adds no second vLLM import to the start).

Importing this package imports neither vLLM nor torch (nor numpy): everything, the converter
modules included, is imported inside `register()`.
"""
from __future__ import annotations

import logging

logger = logging.getLogger("lucifer_shard.runtime_shim")

_state = {"registered": False, "error": None}


def register() -> None:
    """Register `--load-format lucifer_tp3` and install the vetted wrappers; safe to call repeatedly."""
    if _state["registered"]:
        return
    try:
        from vllm.model_executor.model_loader import register_model_loader

        from lucifer_shard.model.runtimes import LOAD_FORMAT, STOCK

        from .adapt import compat, wrappers
        from .load.loader import LuciferTP3Loader

        wrappers.install()
        why = compat.virtual_tp_missing()
        if why:
            logger.warning("lucifer_tp3: no virtual TP on this vLLM (%s): outputs whose plan pads (TP3) cannot be "
                           "served; pip install vllm==%s or run lucifer-shard doctor", why, STOCK.commit)
        from vllm.model_executor import model_loader as ml

        registry = getattr(ml, "_LOAD_FORMAT_TO_MODEL_LOADER", {})
        if registry.get(LOAD_FORMAT) is not LuciferTP3Loader:
            register_model_loader(LOAD_FORMAT)(LuciferTP3Loader)
        _state["registered"] = True
        _state["error"] = None
    except Exception as e:  # noqa: BLE001 - a plugin must never raise into vLLM
        _state["error"] = f"{e.__class__.__name__}: {e}"
        logger.exception("lucifer_tp3: plugin registration failed (run `lucifer-shard doctor`)")
    _serve_preflight()


def _serve_preflight() -> None:
    """In the first vLLM process of a `lucifer-shard serve` (SERVE_ENV set; taken out of the environment
    so that vLLM's child processes do not run it again): the checks that need vLLM; SystemExit on a failure."""
    import json
    import os

    from lucifer_shard.errors import DOCTOR

    from .adapt.settings import SERVE_ENV

    raw = os.environ.pop(SERVE_ENV, None)
    if raw is None:
        return
    try:
        from .serving.doctor import in_vllm_failures

        asked = json.loads(raw)
        failed = in_vllm_failures(asked["out"], bool(asked.get("mtp")))
    except Exception:  # noqa: BLE001 - the preflight must not break a start it cannot judge
        logger.exception("lucifer_tp3: serve's in-vLLM preflight could not run (run `lucifer-shard doctor OUT`)")
        return
    if failed:
        lines = "\n".join(f"lucifer-shard serve: preflight failed in vLLM: {c}" for c in failed)
        raise SystemExit(f"{lines}\n{DOCTOR.at(out=asked['out'])}")
    logger.info("lucifer_tp3: serve's in-vLLM preflight passed")


def registration_error() -> str | None:
    """Why the last register() failed, or None."""
    return _state["error"]
