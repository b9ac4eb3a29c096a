"""`lucifer-shard doctor`'s guide: which vLLM builds serve lucifer-shard outputs and how far each is proven,
where a server comes from (this environment's build first, where it is a vetted one), and how to put
lucifer-shard into it. Imports nothing of vLLM."""
from __future__ import annotations

from lucifer_shard.model import runtimes
from lucifer_shard.model.runtimes import REPOSITORY, STOCK

from .doctor import WHEEL, identify_build, vllm_identity


def installed_build() -> runtimes.Build | None:
    """The vetted build this environment holds (package metadata, no vLLM import); None without one."""
    return identify_build(*vllm_identity())


def builds() -> list[dict]:
    """The vetted builds: name, where from, FlashInfer pin, what lucifer_tp3 can load on each, how far proven (in
    one line, and per kind of output: `cells`)."""
    return [{"commit": b.commit, "label": b.label, "stock": b.stock,
             "repository": None if b.stock else REPOSITORY, "branches": list(b.branches),
             "install": b.install_line(), "flashinfer": b.flashinfer, "flashinfer_repin": b.flashinfer_repin or None,
             "wrappers": list(b.wrappers), "serves": b.serves(), "cells": b.cells(), "proven": b.proven,
             "image": b.image}
            for b in runtimes.SUPPORTED_BUILDS]


def routes(installed: runtimes.Build | None = None) -> list[tuple[str, str]]:
    """Where a vLLM that serves lucifer-shard outputs comes from, in the order to take them: (route, how). Inside
    a vetted build (`installed`) that build comes first: it serves here. docs/serving.md's "Where to get a
    server" says the same as a machine without vLLM prints, line for line (a test compares them)."""
    stock = (f"{STOCK.install_line()}, then lucifer-shard into it with pip install --no-deps (make wheel); the plugin "
             f"supplies virtual TP and loads kernel-layout experts verbatim, so TP3 serves from any output")
    fork = ("a fork build",
            f"from source only: git clone {REPOSITORY} && git -C vllm checkout <commit> && pip install -e vllm "
            f"(the CUDA toolchain of vLLM's build-from-source guide); {runtimes.FORK_TUPLE_KERNEL} layout and model "
            f"layout")
    if installed is None:
        return [(f"stock vLLM {STOCK.commit}, the route to take", stock), fork]
    here = (f"this environment's {installed.label}, a vetted build",
            f"serve with it here (the checks above say what this host still lacks); proven: {installed.proven}")
    return [here, *([(f"stock vLLM {STOCK.commit}, the newest vetted release", stock)] if installed is not STOCK else []),
            *([fork] if installed.stock else [])]


def guide_lines(installed: runtimes.Build | None = None) -> list[str]:
    """Which vLLM builds serve lucifer-shard outputs, how far each is proven, where they come from (`installed`:
    this environment's build, marked and named first), and how to put lucifer-shard in."""
    cols = list(runtimes.SUPPORTED_BUILDS[0].serves())
    head = f"  {'build':<10} {'FlashInfer':<11} " + "  ".join(cols) + "  proven"
    here = f" (this environment: {installed.commit}, marked *)" if installed else ""
    lines = [f"vetted vLLM builds for lucifer_tp3{here}:", head]
    ordered = sorted(runtimes.SUPPORTED_BUILDS, key=lambda b: not b.stock)
    for b in ordered:
        cells = "  ".join(f"{'yes' if ok else 'no':<{len(c)}}" for c, ok in b.serves().items())
        lines.append(f"{'*' if b is installed else ' '} {b.commit:<10} {b.flashinfer:<11} {cells}  {b.proven}")
    lines += ["how to get each:", *(f"  {b.commit:<10} {b.install}" + (" (without its FlashInfer pin: below)"
                                                                       if b.flashinfer_repin else "")
                                    + ("" if b.stock else f" (branches {', '.join(b.branches)})") for b in ordered)]
    return lines + ["where to get a server:",
                    *(f"  {i}. {route}: {how}" for i, (route, how) in enumerate(routes(installed), 1)),
                    "put lucifer-shard into that environment (it is on no package index):",
                    f"  here:     make wheel                      (writes dist/{WHEEL})",
                    f"  there:    pip install --no-deps {WHEEL}   (or: pip install --no-deps /path/to/lucifer-shard)",
                    "  vLLM already brings every dependency (torch, safetensors, numpy, huggingface_hub, tqdm, blake3,",
                    "  click); `pip check` confirms. Then: lucifer-shard doctor OUT; lucifer-shard serve OUT --dry-run"]
