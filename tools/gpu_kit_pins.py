"""The GPU kit's pins from a pip resolution (tools/gpu-vllm-kit.sh --resolve where uv is missing).

pip has no overrides, so the kit's rule (what `uv pip compile --override` gives) is applied to pip's
`install --dry-run --report` of vLLM's requirements: walk the requirement graph from the roots and stop at
every package the device image holds or the lock leaves out on purpose, except those the image holds at a
version vLLM rejects (CARRY, with the reason in the lock's header). Prints `name==version`, sorted.

    python3 tools/gpu_kit_pins.py REPORT_JSON ROOTS_TXT EXCLUDED_TXT [--carry NAME ...]
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

# the device: CPython 3.12 on x86-64 Linux
ENV = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.3",
       "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "extra": ""}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def applies(req: Requirement, extras: set[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**ENV, "extra": e}) for e in extras | {""})


def closure(report: dict, roots: list[Requirement], excluded: set[str]) -> dict[str, str]:
    """name -> version of every package reached from ROOTS, not descending into EXCLUDED names."""
    meta = {norm(i["metadata"]["name"]): i["metadata"] for i in report["install"]}
    todo = [(norm(r.name), set(r.extras)) for r in roots if applies(r, set())]
    seen: dict[str, set[str]] = {}
    while todo:
        name, extras = todo.pop()
        if name in excluded or (name in seen and extras <= seen[name]):
            continue
        if name not in meta:
            raise SystemExit(f"gpu_kit_pins: {name} is required but not in pip's report; resolve again")
        seen[name] = seen.get(name, set()) | extras
        for text in meta[name].get("requires_dist", []):
            req = Requirement(text)
            if applies(req, seen[name]):
                todo.append((norm(req.name), set(req.extras)))
    return {n: meta[n]["version"] for n in seen}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("report", type=Path)
    ap.add_argument("roots", type=Path, help="the requirements pip resolved, one a line")
    ap.add_argument("excluded", type=Path, help="names never carried (the image's and the left-out), one a line")
    ap.add_argument("--carry", nargs="*", default=[], help="image packages carried anyway")
    a = ap.parse_args()
    roots = [Requirement(line) for line in a.roots.read_text().splitlines() if line.strip()]
    excluded = {norm(line.strip()) for line in a.excluded.read_text().splitlines()
                if line.strip() and not line.startswith("#")}
    excluded -= {norm(c) for c in a.carry}
    pins = closure(json.loads(a.report.read_text()), roots, excluded)
    print("\n".join(f"{n}=={v}" for n, v in sorted(pins.items())))


if __name__ == "__main__":
    main()
