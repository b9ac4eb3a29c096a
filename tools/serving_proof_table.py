"""Render the figures of docs/evidence/serving-proof.md from the reports the real-model tests keep.

    LUCIFER_PROOF_OUT=/tmp/proof make test-shim            # or pytest tests/shim/test_{real,fork}_model.py
    python3 tools/serving_proof_table.py /tmp/proof          # markdown on stdout

Each world (`<label>/rank-<r>.json`, written by tests/shim/shim_fixtures.run_world) gives one row per
compared pair of runs: which vLLM built which class at which TP size, how many parameters and bytes
were compared over all ranks, which parameters differ, and the time of the world.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

PAIRS = (  # (run, the run it was compared with, what the row shows)
    ("lucifer", "default", "target: lucifer_tp3 vs DefaultModelLoader"),
    ("lucifer", "fork", "target: lucifer_tp3 vs the fork's DefaultModelLoader"),
    ("draft_lucifer", "draft_default", "draft: lucifer_tp3 vs DefaultModelLoader"),
    ("draft_lucifer", "draft_fork", "draft: lucifer_tp3 vs the fork's DefaultModelLoader"),
    ("tampered_header", "default", "target, one byte flipped in the last rank's file"),
)


FILE_RUNS = (  # (run, what the row shows): stock vLLM with the plugin's virtual TP, tests/shim/test_stock_tp3.py
    ("lucifer", "target: lucifer_tp3 vs its rank files, CPU class"),
    ("draft", "draft: lucifer_tp3 vs its rank files"),
    ("nvidia_sm120", "target: lucifer_tp3 vs its rank files, capability 12.0"),
    ("nvidia_sm90", "target: lucifer_tp3 vs its rank files, capability 9.0"),
)
REFUSED_RUNS = (
    ("default", "DefaultModelLoader on the checkpoint"),
    ("kernel_layout", "lucifer_tp3, experts in kernel layout"),
    ("hf_overrides", "lucifer_tp3 with --hf-overrides"),
)


def one_line(err: str) -> str:
    """An error on one table line; of pydantic's multi-line messages, the validator's own sentence."""
    err = " ".join(err.split())
    return err.split("Value error, ", 1)[1].split(" [type=")[0] if "Value error, " in err else err


def leaf(name: str) -> str:
    """`model.layers.3.ffn.experts.routed_experts.w2_weight: byte ...` -> `ffn.experts.routed_experts.w2_weight`."""
    return re.sub(r"^model\.(layers\.\d+\.)?(mtp_block\.)?", "", name.split(":")[0])


def rows(world: Path) -> list[list[str]]:
    reports = [json.loads(p.read_text()) for p in sorted(world.glob("rank-*.json"))]
    first = reports[0]
    out = []
    for run, ref, what in PAIRS:
        recs = [r["runs"].get(run) for r in reports]
        if not all(recs) or not all(ref in r["runs"] for r in reports):
            continue
        if not any("vs_reference" in x or "error" in x for x in recs):
            continue  # not compared with `ref` (a world that checks each run against the rank files)
        if any("error" in x for x in recs) or any("error" in r["runs"][ref] for r in reports):
            err = next(x.get("error") or r["runs"][ref].get("error") for x, r in zip(recs, reports)
                       if "error" in x or "error" in r["runs"][ref])
            err = one_line(err)
            out.append([world.name, first["vllm"], str(len(reports)), what, "-", "-", f"not built: {err[:150]}",
                        f"{first.get('world_s', 0):.0f}"])
            continue
        params = sum(len(x["params"]) for x in recs)
        nbytes = sum(x["vs_reference"]["bytes_compared"] for x in recs)
        differ = sorted({leaf(d) for x in recs for d in x["vs_reference"]["differ"]})
        n_differ = sum(len(x["vs_reference"]["differ"]) for x in recs)
        cls = recs[0]["model_class"].rsplit(".", 1)[-1]
        out.append([world.name, first["vllm"], str(len(reports)), f"{what} ({cls})", str(params),
                    f"{nbytes / 1e6:.1f} MB", f"{n_differ}: {', '.join(differ)}" if differ else "0",
                    f"{first.get('world_s', 0):.0f}"])
    for run, what in FILE_RUNS:  # loaded by lucifer_tp3 and compared with the rank files only (stock TP3)
        recs = [r["runs"].get(run) for r in reports]
        if not all(recs) or any("vs_reference" in x or "file_problems" not in x for x in recs):
            continue
        cls = recs[0]["model_class"].rsplit(".", 1)[-1]
        problems = sum(len(x["file_problems"]) for x in recs)
        out.append([world.name, first["vllm"], str(len(reports)), f"{what} ({cls})",
                    str(sum(len(x["params"]) for x in recs)), f"{sum(x['file_tensors'] for x in recs)} tensors",
                    str(problems), f"{first.get('world_s', 0):.0f}"])
    for run, what in REFUSED_RUNS:
        err = next((r["runs"].get(run, {}).get("error") for r in reports if "error" in r["runs"].get(run, {})), None)
        if err:
            err = re.sub(r"/\S*/(out[\w-]*)", r"\1", one_line(err))
            out.append([world.name, first["vllm"], str(len(reports)), what, "-", "-", f"refused: {err[:220]}", ""])
    tamper = [r["runs"].get("tampered_full", {}).get("error") for r in reports]
    if any(tamper):
        line = re.sub(r"/\S*/(target|draft)/", r"OUT/\1/", next(t for t in tamper if t).split(": ", 1)[-1])
        out.append([world.name, first["vllm"], str(len(reports)), "tampered file, verify=full", "-", "-",
                    f"refused: {line}", ""])
    return out


def main(root: str) -> None:
    head = ["world", "vLLM", "TP", "comparison (model class)", "params (all ranks)", "bytes compared",
            "differing params", "world s"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for world in sorted(p for p in Path(root).iterdir() if p.is_dir()):
        for row in rows(world):
            print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main(sys.argv[1])
