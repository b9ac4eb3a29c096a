"""`lucifer-shard stage`: a node's share of an output (issue 35). The share holds exactly its ranks'
files; verify, inspect, diff, doctor and serve check exactly those ranks; a share without a rank is
refused for a node that runs it, naming node, rank and fix; nothing outside DEST is written; a stage
stopped part-way is finished by running it again; a copy across filesystems is read back."""
from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch

from helpers import run
from lucifer_shard.engine import stage as stage_mod
from lucifer_shard.guarded_io import Tree
from lucifer_shard.output.share import SHARE_NAME, missing_rank, node_ranks, read_share, share_problem


def listing(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_ino, p.stat().st_size) for p in sorted(root.rglob("*"))
            if p.is_file()}


@pytest.mark.parametrize("tp,nnodes,expected", [(3, 3, [[0], [1], [2]]), (4, 2, [[0, 1], [2, 3]]), (2, 1, [[0, 1]])])
def test_node_ranks_are_vllms(tp, nnodes, expected):
    """vLLM 0.33.0 (arg_utils.py, --nnodes/--node-rank with the mp executor): node R runs the global ranks
    R*W/N .. (R+1)*W/N - 1, and W must divide by N."""
    assert [node_ranks(tp, nnodes, r) for r in range(nnodes)] == expected


def test_a_share_holds_its_ranks_and_verifies(converted, tmp_path):
    out = converted()
    before = listing(out)
    dest = tmp_path / "node1"
    r = run("stage", out, dest, "--nnodes", 3, "--node-rank", 1)
    assert r.exit_code == 0, r.output
    assert "3 hard-linked" not in r.stdout and "hard-linked" in r.stdout
    assert r.stdout.strip().splitlines()[-1].startswith(f"next: lucifer-shard verify {dest}")
    ranks = {p.parent.name for p in dest.rglob("*.safetensors")}
    assert ranks == {"rank-1"} and {p.parent.parent.name for p in dest.rglob("*.safetensors")} == {"target", "draft"}
    assert (dest / "COMPLETE").read_bytes() == (out / "COMPLETE").read_bytes()
    assert (dest / "lucifer-manifest.json").read_bytes() == (out / "lucifer-manifest.json").read_bytes()
    assert not (dest / ".lucifer").exists()
    share = read_share(dest)
    assert (share.ranks, share.nnodes, share.node_rank, share.tp_size) == ((1,), 3, 1, 3)
    for rel in (p for p in listing(dest) if p.endswith(".safetensors")):  # linked: the same inode
        assert (dest / rel).stat().st_ino == (out / rel).stat().st_ino
    assert listing(out) == before  # nothing of OUT changed
    r = run("verify", dest)
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("share of rank(s) 1 of tp 3 (node 1 of 3): only its ranks are here and checked "
                               "(rank(s) 0, 2 are on other nodes)")
    doc = json.loads(run("verify", "--json", dest).stdout)
    assert doc["ok"] and doc["result"]["summary"]["files"] == 2 and doc["result"]["share"]["ranks"] == [1]
    r = run("inspect", dest)
    assert r.exit_code == 0 and [line.split()[:2] for line in r.stdout.splitlines()
                                 if line.startswith(("target ", "draft "))] == [["target", "1"], ["draft", "1"]]
    assert run("diff", dest).exit_code == 0  # the ranks present, byte for byte against the source
    assert run("stage", "-q", out, tmp_path / "ranks02", "--ranks", "2,0").stdout == f"{tmp_path / 'ranks02'}\n"
    assert read_share(tmp_path / "ranks02").ranks == (0, 2)


def test_a_damaged_file_in_a_share_is_found_and_a_missing_one_named(converted, tmp_path):
    dest = tmp_path / "node2"
    assert run("stage", converted(), dest, "--ranks", 2).exit_code == 0
    part = next(dest.glob("target/rank-2/*.safetensors"))
    part.unlink()  # the link: OUT's file stays
    r = run("verify", dest)
    assert r.exit_code == 1 and "target/rank-2/part-00000.safetensors" in r.stderr and "rank-0" not in r.stderr


def test_stopped_part_way_the_same_stage_finishes_it(converted, tmp_path, monkeypatch):
    out, dest = converted(), tmp_path / "node0"
    real = stage_mod._place
    calls = []

    def flaky(src, tree, rel):
        calls.append(rel)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(src, tree, rel)

    monkeypatch.setattr(stage_mod, "_place", flaky)
    r = run("stage", out, dest, "--nnodes", 3, "--node-rank", 0)
    assert r.exit_code == 130 and r.output.strip() == (f"interrupted: {out} is untouched; run the same stage again "
                                                       f"to finish the share")
    assert not (dest / "COMPLETE").exists() and run("verify", dest).exit_code != 0
    monkeypatch.setattr(stage_mod, "_place", real)
    r = run("stage", out, dest, "--nnodes", 3, "--node-rank", 0)
    assert r.exit_code == 0 and "3 already there" in r.stdout, r.output
    assert run("verify", dest).exit_code == 0


def test_across_filesystems_files_are_copied_and_read_back(converted, tmp_path, monkeypatch):
    """Where a hard link cannot be made (EXDEV: DEST on another filesystem) every file is copied, hashed as
    written and read back; a copy that reads back other bytes is removed and named."""
    out, dest = converted(), tmp_path / "remote"

    def cross_device(self, src, rel):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(Tree, "link_in", cross_device)
    r = run("stage", out, dest, "--ranks", 1)
    assert r.exit_code == 0 and "0 hard-linked, 7 copied and read back" in r.stdout, r.output
    part = next(dest.glob("target/rank-1/*.safetensors"))
    assert part.stat().st_ino != (out / part.relative_to(dest)).stat().st_ino
    assert run("verify", dest).exit_code == 0
    real_digest = stage_mod._digest
    bad = tmp_path / "bad"
    monkeypatch.setattr(stage_mod, "_digest", lambda tree, rel: "0" * 64 if Path(tree.root) == bad else
                        real_digest(tree, rel))
    r = run("stage", out, bad, "--ranks", 1)
    assert r.exit_code == 2 and "the copy reads back other bytes than" in r.stderr, r.output
    assert not list(bad.rglob("*.safetensors")) and not (bad / "COMPLETE").exists()


@pytest.mark.parametrize("args,needle", [
    (["--ranks", "3"], "--ranks '3': the output has TP ranks 0..2"),
    (["--ranks", "x"], "expected TP ranks separated by commas"),
    (["--nnodes", "2", "--node-rank", "0"], "--nnodes 2: vLLM needs the world size (tp 3) to divide by the number"),
    (["--nnodes", "3"], "--nnodes and --node-rank go together"),
    ([], "pass the ranks the node runs"),
    (["--ranks", "1", "--nnodes", "3", "--node-rank", "1"], "pass the ranks the node runs"),
])
def test_stage_refusals(converted, tmp_path, args, needle):
    r = run("stage", converted(), tmp_path / "d", *args)
    assert r.exit_code == 2 and needle in r.stderr and not (tmp_path / "d").exists(), r.output


def test_dest_must_be_new_empty_or_this_share(converted, tmp_path):
    out = converted()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "mine.txt").write_text("x")
    r = run("stage", out, tmp_path / "full", "--ranks", 0)
    assert r.exit_code == 2 and "not empty and not a share of this output" in r.stderr
    assert (tmp_path / "full" / "mine.txt").read_text() == "x"
    assert run("stage", out, tmp_path / "s", "--ranks", 0).exit_code == 0
    r = run("stage", out, tmp_path / "s", "--ranks", 1)
    assert r.exit_code == 2 and "already a share of rank(s) 0 of tp 3" in r.stderr
    r = run("stage", out, out / "inside", "--ranks", 0)
    assert r.exit_code == 2 and "inside the output" in r.stderr and not (out / "inside").exists()
    r = run("stage", tmp_path / "s", tmp_path / "t", "--ranks", 0)
    assert r.exit_code == 2 and "is itself a node's share" in r.stderr


def test_a_worker_whose_rank_is_not_in_the_share_gets_one_line(converted, tmp_path):
    out, dest = converted(), tmp_path / "node1"
    assert run("stage", out, dest, "--nnodes", 3, "--node-rank", 1).exit_code == 0
    cid = json.loads((out / "lucifer-manifest.json").read_text())["conversion_id"]
    assert share_problem(dest, cid, 1) is None and share_problem(out, cid, 0) is None
    line = share_problem(dest, cid, 2)
    assert line == missing_rank(read_share(dest), 2, dest) and "\n" not in line
    assert line.startswith(f"{dest} is node 1's share (rank(s) 1 of tp 3 (node 1 of 3)) but this worker runs TP "
                           f"rank 2, node 2's") and "lucifer-shard stage OUT DEST --nnodes 3 --node-rank 2" in line
    assert "files of two conversions" in share_problem(dest, "0" * 64, 1)  # a share of another conversion
    (dest / SHARE_NAME).unlink()
    (dest / SHARE_NAME).write_text("{}")
    assert "not a lucifer-shard share record" in share_problem(dest, cid, 1)


def test_serve_across_nodes_preflights_this_nodes_ranks_and_prints_every_nodes_command(converted, tmp_path):
    out, dest = converted(), tmp_path / "node1"
    assert run("stage", out, dest, "--nnodes", 3, "--node-rank", 1).exit_code == 0
    r = run("serve", dest, "--nnodes", 3, "--node-rank", 1, "--master-addr", "10.0.0.1", "--dry-run", "--",
            "--port", "8000")
    assert r.exit_code == 0, r.output
    assert "[  ok] output node ranks: holds this node's TP rank(s) 1" in r.stdout
    assert "[info] output share: a node's share: rank(s) 1 of tp 3 (node 1 of 3); lacks rank(s) 0, 2" in r.stdout
    nodes = [line for line in r.stdout.splitlines() if line.startswith("  node ")]
    assert len(nodes) == 3 and "(this one)" in nodes[1]
    for i, line in enumerate(nodes):
        tail = f"--nnodes 3 --node-rank {i} --master-addr 10.0.0.1" + (" --headless" if i else "") + " --port 8000"
        assert line.endswith(tail) and "--tensor-parallel-size 3 --load-format lucifer_tp3" in line, line
    for rank in (0, 2):
        r = run("serve", dest, "--nnodes", 3, "--node-rank", rank, "--master-addr", "h", "--dry-run")
        assert r.exit_code == 1 and f"but this worker runs TP rank {rank}" in r.stderr, r.output
    r = run("serve", dest, "--dry-run")  # one node runs every rank: the share lacks two
    assert r.exit_code == 1 and "[FAIL] output node ranks" in r.stdout
    for bad, needle in ((["--nnodes", "3"], "go together"), (["--nnodes", "2", "--node-rank", "1", "--master-addr",
                                                             "h"], "to divide by the number of nodes"),
                        (["--", "--nnodes", "3"], "--nnodes is in the vLLM arguments but it is serve's own option")):
        r = run("serve", out, "--dry-run", *bad)
        assert r.exit_code == 2 and needle in r.stderr, r.output


def test_plan_shows_the_bytes_per_node(tiny_pattern, converted):
    """plan's per-node bytes are what stage puts on each node: that rank's files, target and draft."""
    doc = json.loads(run("plan", "--tp", 3, "--arch", "sm120", "--json", tiny_pattern).stdout)["result"]
    out = converted(source=tiny_pattern, arch="sm120")
    assert [n["ranks"] for n in doc["per_node"]] == [[0], [1], [2]]
    for n in doc["per_node"]:
        files = list(out.glob(f"*/rank-{n['node']}/*.safetensors"))
        assert n["bytes"] == sum(f.stat().st_size for f in files) > 0, n
    text = run("plan", "--tp", 3, "--arch", "sm121", tiny_pattern).stdout
    assert ("per node, one rank each (lucifer-shard stage OUT DEST --nnodes 3 --node-rank R, or on each node convert "
            "... --nnodes 3 --node-rank R)") in text


def test_sm121_is_the_sm120_familys_layout(converted, tmp_path):
    """GB10 (12.1): vLLM 0.33.0 and FlashInfer choose the SM120 family's kernels, so sm121 files are sm120's
    byte for byte (the manifest names the arch it was converted for)."""
    from lucifer_shard.model.arches import arch_of_capability

    assert [arch_of_capability(*c) for c in ((12, 0), (12, 1), (10, 0), (10, 3), (9, 0), (8, 0), (12, 2))] == [
        "sm120", "sm121", "sm100", "sm100", "sm90", None, None]
    from safetensors import safe_open

    a, b = converted(arch="sm120"), converted(arch="sm121")
    doc = json.loads((b / "lucifer-manifest.json").read_text())
    assert (doc["arch"], doc["moe_variant"]) == ("sm121", "FLASHINFER_CUTLASS_MXFP4_MXFP8")
    parts = sorted(p.relative_to(a) for p in a.rglob("*.safetensors"))
    assert parts == sorted(p.relative_to(b) for p in b.rglob("*.safetensors"))
    for rel in parts:  # the same tensors, byte for byte (only the identity stamps differ)
        with safe_open(str(a / rel), "pt") as fa, safe_open(str(b / rel), "pt") as fb:
            assert list(fa.keys()) == list(fb.keys())
            for k in fa.keys():
                assert fa.get_tensor(k).view(-1).view(dtype=torch.uint8).equal(
                    fb.get_tensor(k).view(-1).view(dtype=torch.uint8)), (rel, k)
    assert run("diff", b).exit_code == 0 and run("verify", b).exit_code == 0


def test_doctor_takes_sm120_files_on_a_gb10_and_refuses_other_families():
    """The doctor's arch check on a GB10 (12.1): sm120 kernel-layout files are its files; sm90's are not."""
    from types import SimpleNamespace

    from lucifer_shard.runtime_shim.serving.doctor import FAIL, _arch_checks

    def out(arch):
        return SimpleNamespace(arch=arch, expert_layout="kernel")

    assert _arch_checks(out("sm120"), "sm121", "12.1", False) == []
    assert _arch_checks(out("sm121"), "sm120", "12.0", False) == []
    (check,) = _arch_checks(out("sm90"), "sm121", "12.1", False)
    assert check.status == FAIL and "re-convert with --arch sm121" in check.fix
    (check,) = _arch_checks(out("sm100"), "sm121", "12.1", False)  # another major: re-convert, as before
    assert check.status == FAIL


# ---------------------------------------------------------------- issue 52, T and U


def _kind(r) -> str:
    return json.loads(r.stdout)["error"]["kind"]


def test_dest_inside_out_through_a_bind_mount_is_refused(converted, tmp_path):
    """T: the guard compared paths only, so through `mount --bind OUT BIND` a share was written inside
    OUT (after which convert --force refused OUT). DEST's folders are compared with OUT by identity."""
    import subprocess

    out = tmp_path / "out"
    out.mkdir()
    bind = tmp_path / "bind"
    bind.mkdir()
    for p in converted().iterdir():  # a private OUT to mount (links: nothing of the fixture is written)
        if p.is_dir():
            subprocess.run(["cp", "-al", str(p), str(out / p.name)], check=True)
        else:
            os.link(p, out / p.name)
    if subprocess.run(["mount", "--bind", str(out), str(bind)], capture_output=True).returncode:
        pytest.skip("mount --bind is not permitted here")
    try:
        r = run("stage", out, bind / "n0", "--ranks", "0", "--json")
        assert r.exit_code == 2 and _kind(r) == "usage" and "inside the output" in r.stderr, r.output
        assert not (out / "n0").exists()
    finally:
        subprocess.run(["umount", str(bind)], check=True)


@pytest.mark.parametrize("link", ["target", "target/rank-0"])
def test_a_symlinked_folder_in_dest_is_refused_as_a_link(converted, tmp_path, link):
    """U: a symlinked target/ or target/rank-0 in an unfinished share was kind `output`; a link is kind
    `refused`, as a symlinked config.json already was (docs/cli.md)."""
    out, dest, aside = converted(), tmp_path / "node0", tmp_path / "aside"
    assert run("stage", out, dest, "--ranks", "0", "-q").exit_code == 0
    (dest / "COMPLETE").unlink()
    aside.mkdir()
    (dest / link).rename(aside / "moved")
    (dest / link).symlink_to(aside / "moved")
    r = run("stage", out, dest, "--ranks", "0", "--json")
    assert r.exit_code == 2 and _kind(r) == "refused" and "is a symlink" in r.stderr, r.output
    assert (dest / link).is_symlink() and not (dest / "COMPLETE").exists()
