"""The one table of what runs where (model/runtimes.py) and the data file of vetted source hashes that tools/vet.py
writes (src/lucifer_shard/runtime_shim/adapt/wrappers/hashes.json) say the same builds: each row has the hash of every symbol its wrappers
rely on, and each hashed build has a row. The cells' proof levels agree with the proof table
(docs/evidence/proof-status.md, moved from the README). No vLLM
needed: the table, the data file and the wrappers' records import none."""
from __future__ import annotations

import json
import re
from pathlib import Path

from lucifer_shard.model import runtimes
from lucifer_shard.runtime_shim.adapt import compat, wrappers

PROOF_PAGE = (Path(__file__).resolve().parent.parent / "docs" / "evidence" / "proof-status.md").read_text()
HASH = re.compile(r"sha256:[0-9a-f]{64}")


def table_problems(builds: tuple[runtimes.Build, ...], hashes: dict[str, dict[str, str]]) -> list[str]:
    """Where the rows and the data file disagree, one line each."""
    problems = [f"{commit}: hashed, but no row of the table names it" for commit in hashes
                if commit not in {b.commit for b in builds}]
    for b in builds:
        want = {s.key for w in b.wrappers for s in wrappers.WRAPPERS[w].symbols}
        got = hashes.get(b.commit, {})
        if set(got) != want:
            problems.append(f"{b.commit}: hashes of {sorted(got)}, its wrappers rely on {sorted(want)}")
        problems += [f"{b.commit}: {key} {h!r} is not a sha256" for key, h in got.items() if not HASH.fullmatch(h)]
    return problems


def test_every_row_has_its_hashes_and_every_hashed_build_a_row():
    assert table_problems(runtimes.SUPPORTED_BUILDS, compat.read_hashes()) == []
    assert set(compat.read_hashes()) == {b.commit for b in runtimes.SUPPORTED_BUILDS} and len(runtimes.SUPPORTED_BUILDS) > 5


def test_the_check_finds_a_row_without_hashes_and_hashes_without_a_row():
    hashes = compat.read_hashes()
    vetted = {**hashes, "9.9.9": hashes["0.34.0"]}  # vet ran, the row was not added
    assert table_problems(runtimes.SUPPORTED_BUILDS, vetted) == ["9.9.9: hashed, but no row of the table names it"]
    missing = {k: v for k, v in hashes.items() if k != "0.33.0"}
    assert [p.split(":")[0] for p in table_problems(runtimes.SUPPORTED_BUILDS, missing)] == ["0.33.0"]
    short = {**hashes, "0.32.0": {"EngineArgs.create_engine_config": "sha256:" + "0" * 64}}
    assert "0.32.0: hashes of ['EngineArgs.create_engine_config']" in table_problems(runtimes.SUPPORTED_BUILDS,
                                                                                      short)[0]


def test_the_data_file_is_in_vets_form_and_the_shims():
    """What vet writes (compat.hashes_text) is the committed text, so re-vetting a vetted release leaves no diff; the
    wrappers read that file, and no wrapper file keeps a hash of its own."""
    text = compat.HASHES_FILE.read_text()
    assert compat.hashes_text(json.loads(text)) == text
    assert wrappers.HASHES == json.loads(text)
    shim = Path(compat.__file__).parent
    assert [p.name for p in shim.rglob("*.py") if HASH.search(p.read_text())] == []


def test_each_cell_says_how_far_it_is_proven_where_the_build_serves_it():
    for b in runtimes.SUPPORTED_BUILDS:
        cells = b.cells()
        assert tuple(cells) == runtimes.COLUMNS == tuple(b.serves())
        assert {c for c, level in cells.items() if level is None} == {c for c, ok in b.serves().items() if not ok}
        assert set(cells.values()) - {None} <= {runtimes.GPU, runtimes.CPU_TOKENS, runtimes.CPU_LOAD, runtimes.SOURCE}
        # the one-line proof level doctor prints says GPU exactly where a cell was served on one
        assert (runtimes.GPU in cells.values()) == b.proven.startswith("GPU"), b.commit
    assert not (set(runtimes.PROVEN_CELLS) | set(runtimes.PROVEN_LEVEL)) - {b.commit for b in runtimes.SUPPORTED_BUILDS}


def test_the_readmes_gpu_rows_name_exactly_the_releases_with_a_gpu_cell():
    """A release served on a GPU in the proof table (docs/evidence/proof-status.md) has GPU cells in the table, and
    no other has."""
    table = PROOF_PAGE.split("## Proof status", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[3:] if line.startswith("|")]
    gpu = {v for _, status, _ in rows if status.startswith("proven") and "CPU" not in status
           for v in re.findall(r"\bvLLM (\d+\.\d+\.\d+)", status)}
    assert gpu == {b.commit for b in runtimes.SUPPORTED_BUILDS if runtimes.GPU in b.cells().values()}, gpu
