"""The README's first screen and the proof table (docs/evidence/proof-status.md since issue 60 item 7) say the
same thing (issue 53, item 6): the first screen names what ran on a GPU (the machine, the vLLM and FlashInfer
releases, the synthetic checkpoints) and lists what never ran; the table says it row by row. Both are read
here, so neither can change alone:
a GPU row of another machine or release, a "**not proven**" row added or dropped, or a first screen that
claims more, fails a test. The figures the README quotes from `plan` are `plan`'s."""
from __future__ import annotations

import json
import re
from pathlib import Path


from lucifer_shard.engine.presets import PRESETS
from lucifer_shard.units import size

from helpers import CONFIGS, run

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
PROOF_PAGE = (REPO / "docs" / "evidence" / "proof-status.md").read_text()  # the proof table, moved from the README
FIRST_SCREEN = "\n".join(README.splitlines()[:60])
RAN = FIRST_SCREEN.split("**What ran.**", 1)[1].split("**Never run:**", 1)[0]
NEVER = FIRST_SCREEN.split("**Never run:**", 1)[1].split("\n", 1)[0]

MACHINE = re.compile(r"\bone NVIDIA [A-Z][\w ]*?\d+\b")  # "one NVIDIA H200"
VLLM = re.compile(r"\bvLLM (\d+\.\d+\.\d+)")
FLASHINFER = re.compile(r"\bFlashInfer (\d+\.\d+\.\d+(?:\.post\d+)?)")


def proof_rows() -> list[tuple[str, str]]:
    """(claim, status) of each row of the proof table (docs/evidence/proof-status.md)."""
    table = PROOF_PAGE.split("## Proof status", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[3:] if line.startswith("|")]
    return [(claim, status) for claim, status, _ in rows]


def gpu_rows() -> list[tuple[str, str]]:
    """The proven rows that did not run on CPU: what ran on a GPU."""
    return [(claim, status) for claim, status in proof_rows() if status.startswith("proven") and "CPU" not in status]


def presets(text: str) -> set[str]:
    return {p for p in PRESETS if f"`{p}`" in text or f"synth {p}" in text}


def test_the_never_run_list_is_the_tables_not_proven_rows():
    """Each "**not proven**" row's claim starts with the first screen's item, in the same order."""
    items = [item.strip() for item in NEVER.strip().rstrip(".").split(", ")]
    rows = [claim.split(":", 1)[0] for claim, status in proof_rows() if status.startswith("**not proven**")]
    assert items == rows, (items, rows)
    assert len(items) >= 5  # three GPUs, SM12x, three boxes, vLLM 0.34.0 with graphs or a draft, the real checkpoint


def test_what_ran_on_a_gpu_is_every_gpu_rows():
    """The machine, the vLLM and FlashInfer releases and the synthetic checkpoints the first screen names are
    those of the table's GPU rows, no more and no fewer."""
    rows = gpu_rows()
    assert rows
    machines = {m for _, status in rows for m in MACHINE.findall(status)}
    assert machines == set(MACHINE.findall(RAN)), (machines, RAN)
    assert all(MACHINE.search(status) for _, status in rows), "a GPU row names no machine"
    assert {v for _, s in rows for v in VLLM.findall(s)} == set(VLLM.findall(RAN))
    assert {v for _, s in rows for v in FLASHINFER.findall(s)} == set(FLASHINFER.findall(RAN))
    assert set().union(*(presets(c + s) for c, s in rows)) == presets(RAN)


def test_tp3_on_a_gpu_is_said_to_be_ranks_sharing_one_gpu():
    """TP3 on a GPU ran only as three ranks on the one GPU: every GPU row claiming TP3 says so, and the first
    screen says it, with gloo; a three-GPU run is in the never-run list until a row proves it."""
    tp3 = [claim for claim, _ in gpu_rows() if "TP3" in claim]
    assert tp3 and all(re.search(r"sharing (one|that one|the one) (H200|GPU)", claim) for claim in tp3), tp3
    assert "TP3 on a" in RAN and "sharing that one GPU over gloo" in RAN
    assert "three GPUs" in NEVER


def test_no_test_counts_in_the_readme():
    """How many tests pass is what each suite prints; a count written into the README goes stale."""
    assert not re.search(r"\b\d{2,5} (passed|tests?)\b", README), re.search(r"\b\d{2,5} (passed|tests?)\b", README)


def test_the_b12x_saving_quoted_for_0731_is_plans():
    r = run("plan", "--tp", "3", "--moe-backend", "b12x", "--json", CONFIGS / "deepseek-v4-flash-0731.json")
    assert r.exit_code == 0, r.output
    saving = json.loads(r.output)["result"]["route_saving"]
    less = size(saving["default_rank_bytes"][0] - saving["rank_bytes"][0])
    assert f"{less} less per GPU at TP3 for 0731" in README, less


def test_the_readme_is_a_guide_under_12_kb():
    """Issue 60 item 7: the README guides (what it is, the quickstart, the routes, the checklist, a one-line proof
    summary); the proof table and the measured figures live under docs/evidence/."""
    size_bytes = (REPO / "README.md").stat().st_size
    assert size_bytes < 12 * 1024, size_bytes
