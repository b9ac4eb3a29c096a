"""Render docs/evidence/reliability.md's tables from the JSON lines the suites log.

    LUCIFER_RELIABILITY_LOG=/tmp/rel.jsonl python3 -m pytest -q tests/test_reliability.py
    python3 tools/reliability_table.py /tmp/rel.jsonl            # the fault-injection case table

    LUCIFER_FUZZ_LOG=/tmp/fuzz.jsonl make fuzz
    python3 tools/reliability_table.py --fuzz /tmp/fuzz.jsonl    # the fuzzing figures
"""
import collections
import json
import re
import sys

TMP = re.compile(r"/tmp/pytest-of-[^/]+/pytest-\d+/[^/]+/")


def cases(rows: list[dict]) -> None:
    print("| case | exit | outcome | message |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        msg = TMP.sub("…/", r["message"]).replace("|", "\\|")
        print(f"| {r['case']} | {r['exit']} | {r['outcome']} | `{msg}` |")


def fuzz(rows: list[dict]) -> None:
    """Cases per kind of corruption (rows) and reader (columns): 'refused / accepted' counts."""
    targets = list(dict.fromkeys(r["target"] for r in rows))
    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    count = collections.Counter((r["target"], r["kind"], not r["outcome"].startswith(("accepted", "no difference")))
                                for r in rows)
    print("| corruption | " + " | ".join(targets) + " |")
    print("| --- |" + " --- |" * len(targets))
    for kind in kinds:
        cells = [f"{count[(t, kind, True)]} / {count[(t, kind, False)]}" if count[(t, kind, True)] + count[(t, kind, False)]
                 else "" for t in targets]
        print(f"| {kind} | " + " | ".join(cells) + " |")
    totals = [sum(v for (t, _, _), v in count.items() if t == target) for target in targets]
    print("| **cases** | " + " | ".join(f"**{n}**" for n in totals) + " |")
    print(f"\n{len(rows)} cases in all.")


def main(argv: list[str]) -> None:
    as_fuzz = argv[0] == "--fuzz"
    path = argv[1] if as_fuzz else argv[0]
    rows = [json.loads(line) for line in open(path) if line.strip()]
    (fuzz if as_fuzz else cases)(rows)


if __name__ == "__main__":
    main(sys.argv[1:])
