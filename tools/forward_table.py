"""Render the "Tokens out" figures of docs/evidence/serving-proof.md from one forward-suite run kept with
LUCIFER_FORWARD_OUT=DIR (its DIR/summary.json):

    LUCIFER_FORWARD_OUT=/tmp/fwd make test-forward && python3 tools/forward_table.py /tmp/fwd
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "forward"))
import compare  # noqa: E402

RUN_ROWS = [("ref1", "TP1, checkpoint, vLLM's default loader (reference)"),
            ("lu1", "TP1, rank files (`--tp 1`), lucifer_tp3"),
            ("ck2", "TP2, checkpoint, vLLM's default loader"),
            ("lu2", "TP2, rank files (`--tp 2`), lucifer_tp3"),
            ("flip1", "TP1, rank files with one routed-expert byte flipped, verify=headers"),
            ("full1", "the same, verify=full"),
            ("mtp1", "TP1, rank files, MTP draft (`num_speculative_tokens` 1)"),
            ("ref384", "TP1, 384-expert variant's checkpoint, vLLM's default loader (the TP3 reference)"),
            ("lu3", "TP3, the variant's rank files (`--tp 3`), lucifer_tp3, the plugin's stock virtual TP"),
            ("ck4", "TP4, the variant's checkpoint, vLLM's default loader")]
PAIRS = (("ref1", "ck2", "model"), ("ref1", "lu2", "model"), ("lu1", "lu2", "model"), ("ref384", "lu3", "model384"),
         ("ref384", "ck4", "model384"))


def main(out: Path) -> None:
    runs = json.loads((out / "summary.json").read_text())
    for model in dict.fromkeys(m for *_, m in PAIRS):
        if (out / model).is_dir():
            print(f"{model}: S = {compare.logit_scale(out / model):.4f} nats, first-order bound "
                  f"{compare.tolerance(out / model, gain=1.0):.4f}, tau = {compare.tolerance(out / model):.4f} nats\n")
    print("| run | engine build s | short: 3 prompts x 8 tokens, 1st / 2nd generate s | long: 2300 + 4 tokens s "
          "| sparse indexer ops called | result |")
    print("|---|---|---|---|---|---|")
    for name, what in RUN_ROWS:
        r = runs.get(name)
        if r is None:
            continue
        gens = r.get("generates", {})
        short = " / ".join(f"{x['seconds']:.2f}" for x in gens.get("short", [])) or "-"
        long_ = " / ".join(f"{x['seconds']:.1f}" for x in gens.get("long", [])) or "-"
        build = f"{r['build_s']:.1f}" if "build_s" in r else "-"
        result = r.get("error", "generated").replace("|", "\\|")
        ops = ", ".join(r.get("indexer_ops", [])) or "none"
        print(f"| `{name}` {what} | {build} | {short} | {long_} | {ops} | {result} |")
    print("\nTokens (greedy), rep 0:\n")
    print("| run | short prompt 0 | short prompt 1 | short prompt 2 | long prompt |")
    print("|---|---|---|---|---|")
    for name, _ in RUN_ROWS:
        gens = runs.get(name, {}).get("generates", {})
        if not gens:
            continue
        cells = [str(o["tokens"]) for o in gens["short"][0]["outputs"]]
        cells.append(str(gens["long"][0]["outputs"][0]["tokens"]) if "long" in gens else "-")
        print(f"| `{name}` | " + " | ".join(cells) + " |")
    print("\nAcross TP sizes (rep 0): steps compared (until the first differing token, inclusive), the first "
          "differing step and the reference's top-2 margin there, the largest |logprob difference| over tokens "
          "in both top-20 lists, and that over the first-order bound (the gain):\n")
    print("| pair | prompt | steps compared | tokens first differ at | margin there | max abs logprob diff | gain |")
    print("|---|---|---|---|---|---|---|")
    for a, b, model in PAIRS:
        if a not in runs or b not in runs:
            continue
        base = compare.tolerance(out / model, gain=1.0)
        for gen in ("short", "long"):
            for p, (x, y) in enumerate(zip(runs[a]["generates"][gen][0]["outputs"],
                                           runs[b]["generates"][gen][0]["outputs"])):
                c = compare.compare_output(x, y)
                first = "-" if c.first_difference is None else str(c.first_difference)
                m = "-" if c.margin_there is None else f"{c.margin_there:.4f}"
                print(f"| {a} vs {b} | {gen} {p} | {c.steps} | {first} | {m} | {c.max_abs_diff:.4f} | "
                      f"{c.max_abs_diff / base:.2f} |")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
