"""Render docs/reliability.md's case table from the JSON lines tests/test_reliability.py logs.

    LUCIFER_RELIABILITY_LOG=/tmp/rel.jsonl python3 -m pytest -q tests/test_reliability.py
    python3 tools/reliability_table.py /tmp/rel.jsonl
"""
import json
import re
import sys

TMP = re.compile(r"/tmp/pytest-of-[^/]+/pytest-\d+/[^/]+/")


def main(path: str) -> None:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    print("| case | exit | outcome | message |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        msg = TMP.sub("…/", r["message"]).replace("|", "\\|")
        print(f"| {r['case']} | {r['exit']} | {r['outcome']} | `{msg}` |")


if __name__ == "__main__":
    main(sys.argv[1])
