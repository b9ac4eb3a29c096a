"""Issue 61, class C: the content identity the nodes compare is bound to the bytes verify checks.

The reproduction: a share of other weights (the same headers, so the same conversion id) whose manifest was
re-sealed with another conversion's `source.content` passed verify and the loader's cross-node check. The
identity is now the digest of the rank files' content stamps (`Manifest.content_identity`), which every
file's header carries and its digest covers; the manifest records it (`source.content.stamps`) and every
reader's output check refuses a record that does not follow from the files' stamps."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import run
from lucifer_shard.output.manifest import seal
from lucifer_shard.output.manifest_types import Manifest
from lucifer_shard.runtime_shim.load.crossnode import ShareIdentity, identity_problem
from lucifer_shard.runtime_shim.manifest import Output

MANIFEST = "lucifer-manifest.json"


def doc_of(out: Path) -> dict:
    return json.loads((out / MANIFEST).read_text())


def write_sealed(out: Path, doc: dict) -> None:
    doc.pop("manifest_digest", None)
    (out / MANIFEST).unlink()  # stage may have linked it to OUT's, which other tests share
    (out / MANIFEST).write_text(json.dumps(seal(doc), indent=1, sort_keys=True) + "\n")


@pytest.fixture
def shares(converted, tiny_random, tmp_path) -> tuple[Path, Path, dict]:
    """Node 0's share of the pattern weights, node 1's of the random ones (the same conversion id), and the
    pattern output's `source.content`."""
    pattern, random = converted(), converted(source=tiny_random)
    assert doc_of(pattern)["conversion_id"] == doc_of(random)["conversion_id"]
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    assert run("stage", pattern, node0, "--nnodes", 3, "--node-rank", 0).exit_code == 0
    assert run("stage", random, node1, "--nnodes", 3, "--node-rank", 1).exit_code == 0
    return node0, node1, doc_of(pattern)["source"]["content"]


def identities(node0: Path, node1: Path) -> list[ShareIdentity]:
    """Every TP rank's identity as the loader gathers it (rank 2 on node 0's share: any rank beside 1 will do)."""
    m0, m1 = Manifest.load(node0), Manifest.load(node1)
    return [ShareIdentity.of(Output(node0, m0), 0), ShareIdentity.of(Output(node1, m1), 1),
            ShareIdentity.of(Output(node0, m0), 2)]


def test_a_share_resealed_with_another_outputs_content_is_refused_by_verify_and_at_load(shares):
    node0, node1, pattern_content = shares
    doc = doc_of(node1)
    doc["source"]["content"] = pattern_content  # the claim: node 1 holds node 0's weights
    write_sealed(node1, doc)
    r = run("verify", node1)
    assert r.exit_code == 1, r.output
    assert "source.content.stamps" in r.output and "content stamps" in r.output, r.output
    problem = identity_problem(identities(node0, node1))
    assert problem is not None and "other source weights" in problem, problem


def test_a_claim_without_the_recorded_identity_still_differs_at_load(shares):
    """An output written before `stamps` was recorded verifies as it did (test below); a claim copied from
    such an output, or with the field dropped, is still told apart by the identity the nodes compute."""
    node0, node1, pattern_content = shares
    doc = doc_of(node1)
    doc["source"]["content"] = {k: v for k, v in pattern_content.items() if k != "stamps"}
    write_sealed(node1, doc)
    assert run("verify", node1).exit_code == 0  # nothing recorded to disagree with: the old format's reading
    problem = identity_problem(identities(node0, node1))
    assert problem is not None and "other source weights" in problem, problem
    shown = [json.loads(run("inspect", n, "--json").stdout)["result"]["identity"] for n in (node0, node1)]
    assert shown[0] != shown[1], shown  # what FIX tells the operator to compare on every node


def test_outputs_of_the_current_format_without_the_recorded_identity_still_verify(converted, tmp_path):
    out = tmp_path / "out"
    assert run("stage", converted(), out, "--ranks", "0,1,2").exit_code == 0
    doc = doc_of(out)
    assert doc["source"]["content"]["stamps"] == Manifest.load(out).content_identity
    del doc["source"]["content"]["stamps"]
    write_sealed(out, doc)
    r = run("verify", out)
    assert r.exit_code == 0, r.output


def test_shares_of_one_output_agree(converted, tmp_path):
    nodes = [tmp_path / f"node{r}" for r in range(3)]
    for r, node in enumerate(nodes):
        assert run("stage", converted(), node, "--nnodes", 3, "--node-rank", r).exit_code == 0
    ranks = [ShareIdentity.of(Output(node, Manifest.load(node)), r) for r, node in enumerate(nodes)]
    assert identity_problem(ranks) is None
