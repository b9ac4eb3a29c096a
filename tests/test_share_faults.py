"""Issue 43, findings 1-9: a node's share (`stage`) attacked as a hostile filesystem and a careless
operator would. Each test is one class of the issue with its reproduction: stage places only what the
manifest records and never replaces a good file with a bad one; every reader of a share says to stage it
again, convert never writes into one; diff never says OK having compared nothing; the share record is
validated; DEST and OUT are locked while a stage runs; faults name OUT's or DEST's file in full."""
from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
from pathlib import Path

import pytest

from helpers import run
from lucifer_shard.engine import stage as stage_mod
from lucifer_shard.errors import Locked, OutputError
from lucifer_shard.guarded_io import Tree
from lucifer_shard.output.outlock import OutLock, reading
from lucifer_shard.output.share import SHARE_NAME, read_share, record_problem

PART1 = "target/rank-1/part-00000.safetensors"


def error_kind(*args) -> str:
    r = run(*args[:1], "--json", *args[1:])
    return json.loads(r.stdout)["error"]["kind"]


def listing(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def out(converted, tmp_path) -> Path:
    """A private copy of the tiny TP3 output (the session's is shared by every test)."""
    return Path(shutil.copytree(converted(), tmp_path / "out"))


@pytest.fixture
def copying(monkeypatch):
    """DEST on another filesystem: no hard link can be made, every file is copied."""
    def cross_device(self, src, rel):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(Tree, "link_in", cross_device)


def flip(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    at = len(data) // 2 if offset is None else offset
    data[at] ^= 0x5A
    path.write_bytes(bytes(data))


# ---------------------------------------------------------------- 1 and 4: what stage places


def test_1_stage_again_keeps_a_good_copy_when_outs_file_was_damaged(out, tmp_path, copying):
    """Old: the copy was compared with OUT's bytes only, so the good copy was deleted and the damaged
    bytes copied in, exit 0. Now a copy in DEST that verifies against the manifest is kept."""
    dest = tmp_path / "node1"
    assert run("stage", out, dest, "--ranks", 1).exit_code == 0
    good = (dest / PART1).read_bytes()
    flip(out / PART1)
    r = run("stage", out, dest, "--ranks", 1)
    assert r.exit_code == 0 and "7 already there" in r.stdout, r.output  # the manifest, 4 copies (the card one), 2 rank files
    assert (dest / PART1).read_bytes() == good
    assert run("verify", dest).exit_code == 0


def test_1_a_damaged_copy_is_not_replaced_by_outs_damaged_bytes(out, tmp_path, copying):
    dest = tmp_path / "node1"
    assert run("stage", out, dest, "--ranks", 1).exit_code == 0
    flip(out / PART1)
    flip(dest / PART1, 100)
    r = run("stage", out, dest, "--ranks", 1)
    assert r.exit_code == 1 and error_kind("stage", out, dest, "--ranks", 1) == "mismatch", r.output
    assert f"{out / PART1}: not the bytes the manifest records" in r.stderr and "--resume" in r.stderr
    assert not (dest / "COMPLETE").exists() and not (dest / PART1).exists()  # nothing damaged published
    assert not list(dest.rglob("*.partial"))


@pytest.mark.parametrize("damage,needle,mode", [
    ("flip", "not the bytes the manifest records", "copy"),
    # issue 52 D: a hard link is OUT's inode; it was checked by size only, so a damaged OUT (or one a
    # --resume was about to repair) published a damaged share. Now each link is hashed before COMPLETE.
    ("flip", "not the bytes the manifest records", "link"),
    ("truncate", "bytes, the manifest records", "link"),
    ("config", "not the copy convert made", "link"),  # the one output check's words (issue 52)
])
def test_4_stage_refuses_a_damaged_out_naming_the_file_and_its_repair(out, tmp_path, request, damage, needle, mode):
    """Old: a flipped byte, a file truncated to half or an edited config.json in OUT were staged, exit 0
    and COMPLETE written. Now: kind mismatch, OUT's file named with verify/convert --resume on OUT."""
    if mode == "copy":
        request.getfixturevalue("copying")
    if damage == "flip":
        flip(out / PART1)
    elif damage == "truncate":
        os.truncate(out / PART1, (out / PART1).stat().st_size // 2)
    else:
        cfg = out / "config.json"
        cfg.write_bytes(cfg.read_bytes().replace(b"1", b"2", 1))
    dest = tmp_path / "node1"
    r = run("stage", out, dest, "--ranks", 1)
    assert r.exit_code == 1, r.output
    assert needle in r.stderr and f"lucifer-shard verify {out}" in r.stderr and "--resume" in r.stderr
    assert not (dest / "COMPLETE").exists()
    if mode == "link" and damage != "flip":  # found before DEST is made
        assert not dest.exists()
    assert not (dest / PART1).exists()  # no damaged link or copy left in DEST


# ---------------------------------------------------------------- 2: convert never writes into a share


@pytest.mark.parametrize("flag", [[], ["--resume"], ["--force"]])
def test_2_convert_refuses_a_share(converted, tiny_pattern, tmp_path, flag):
    """Old: convert --resume on a damaged share rewrote every rank into it (exit 0, verify still failed)."""
    dest = tmp_path / "node1"
    assert run("stage", converted(), dest, "--ranks", 1).exit_code == 0
    (dest / PART1).unlink()
    before = listing(dest)
    r = run("convert", "--tp", 3, "--arch", "sm120", tiny_pattern, dest, *flag)  # the options of `converted()`
    assert r.exit_code == 2 and "is a node's share" in r.stderr and "lucifer-shard stage OUT DEST" in r.stderr, r.output
    assert listing(dest) == before and not (dest / ".lucifer").exists()


@pytest.mark.parametrize("command", ["verify", "inspect", "diff"])
def test_2_every_reader_of_a_damaged_share_says_stage_it_again(converted, tmp_path, command):
    dest = tmp_path / "node1"
    assert run("stage", converted(), dest, "--ranks", 1).exit_code == 0
    (dest / PART1).unlink()
    r = run(command, dest)
    assert r.exit_code == 1, r.output
    assert "stage the share again" in r.stderr and "--resume" not in r.stderr and "--force" not in r.stderr


def test_2_an_edited_copy_in_a_share_names_the_share_fix(converted, tmp_path):
    dest = tmp_path / "node1"
    assert run("stage", converted(), dest, "--ranks", 1).exit_code == 0
    cfg = dest / "config.json"
    data = cfg.read_bytes()
    cfg.unlink()  # the link: OUT's copy stays
    cfg.write_bytes(data.replace(b"1", b"2", 1))
    r = run("verify", dest)
    assert r.exit_code == 1 and "config.json" in r.stderr and "stage the share again" in r.stderr, r.output
    assert "convert --force" not in r.stderr and "--resume" not in r.stderr


# ---------------------------------------------------------------- 3: diff never OK having compared nothing


def test_3_diff_on_a_share_record_of_no_ranks_fails(converted, tmp_path):
    dest = tmp_path / "node1"
    assert run("stage", converted(), dest, "--ranks", 1).exit_code == 0
    doc = json.loads((dest / SHARE_NAME).read_text())
    (dest / SHARE_NAME).write_text(json.dumps({**doc, "ranks": []}))
    r = run("diff", dest)
    assert r.exit_code == 1 and "OK" not in r.stdout and SHARE_NAME in r.stderr, r.output
    assert run("verify", dest).exit_code == 1


def test_3_diff_finds_ranks_the_share_record_leaves_out(converted, tmp_path):
    out, dest = converted(), tmp_path / "node1"
    assert run("stage", out, dest, "--ranks", 1).exit_code == 0
    shutil.copytree(out / "target/rank-0", dest / "target/rank-0")
    r = run("diff", dest)
    assert r.exit_code == 1 and "target/rank-0/part-00000.safetensors: unexpected file" in r.stderr, r.output


# ---------------------------------------------------------------- 5: DEST's strays, locks


def test_5_stage_refuses_other_ranks_and_foreign_files_in_dest(out, tmp_path):
    dest = tmp_path / "node1"
    assert run("stage", out, dest, "--ranks", 1).exit_code == 0
    shutil.copytree(out / "target/rank-0", dest / "target/rank-0")
    r = run("stage", out, dest, "--ranks", 1)
    assert r.exit_code == 2 and f"{dest / 'target/rank-0/part-00000.safetensors'}" in r.stderr, r.output
    shutil.rmtree(dest / "target/rank-0")
    (dest / "target/rank-1/notes.txt").write_text("mine")
    r = run("stage", out, dest, "--ranks", 1)
    assert r.exit_code == 2 and "notes.txt" in r.stderr and (dest / "target/rank-1/notes.txt").exists(), r.output


def test_5_one_stage_at_a_time_into_a_dest(converted, tmp_path):
    dest = tmp_path / "node"
    dest.mkdir()
    fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what another stage into DEST holds
        r = run("stage", converted(), dest, "--ranks", 0)
        assert r.exit_code == 2 and "being staged by another lucifer-shard stage" in r.stderr, r.output
        assert error_kind("stage", converted(), dest, "--ranks", 0) == "locked" and not list(dest.iterdir())
    finally:
        os.close(fd)


def test_5_stage_waits_for_no_convert_and_holds_outs_lock(out, tmp_path):
    with OutLock(out):  # a convert --resume re-hashing OUT
        r = run("stage", out, tmp_path / "node1", "--ranks", 1)
        assert r.exit_code == 2 and "being written by lucifer-shard convert" in r.stderr, r.output
        assert not (tmp_path / "node1").exists()
    with reading(out, "stage"):  # a stage running: a convert cannot take OUT
        with pytest.raises(Locked, match="is being read by lucifer-shard stage"):
            OutLock(out).acquire()


# ---------------------------------------------------------------- 6: the share record is validated


@pytest.mark.parametrize("edit,needle", [
    ({"ranks": ["1"]}, "ranks"), ({"ranks": [-3]}, "ranks"), ({"ranks": []}, "ranks"), ({"ranks": [2, 1]}, "ranks"),
    ({"tp_size": 4}, "tp_size 4 is not the output's TP size (3)"), ({"nnodes": 3, "node_rank": 0}, "node 0 of 3"),
    ({"format_version": 9}, "format_version 9"),
])
def test_6_an_invalid_share_record_is_a_finding_of_every_reader(converted, tmp_path, edit, needle):
    dest = tmp_path / "node1"
    assert run("stage", converted(), dest, "--ranks", 1).exit_code == 0
    doc = json.loads((dest / SHARE_NAME).read_text())
    (dest / SHARE_NAME).write_text(json.dumps({**doc, **edit}))
    for command in ("verify", "inspect"):
        r = run(command, dest)
        assert r.exit_code == 1 and needle in r.stderr and "stage the share again" in r.stderr, (command, r.output)
    with pytest.raises(OutputError, match="share record|ranks|tp_size|node|format_version"):
        read_share(dest, doc["conversion_id"], 3)


def test_6_the_record_stage_writes_is_valid():
    doc = {"format": "lucifer-shard-share", "format_version": 1, "conversion_id": "c", "tp_size": 4,
           "ranks": [2, 3], "nnodes": 2, "node_rank": 1}
    assert record_problem(doc, 4) is None
    assert record_problem({**doc, "ranks": [True]}, 4) is not None


# ---------------------------------------------------------------- 7: another checkpoint's share


def test_7_a_share_of_other_weights_with_the_same_headers_is_not_replaced(converted, tiny_random, tmp_path):
    pattern, random = converted(), converted(source=tiny_random)
    ids = [json.loads((o / "lucifer-manifest.json").read_text())["conversion_id"] for o in (pattern, random)]
    assert ids[0] == ids[1]  # the same headers and options: only the content digest tells them apart
    dest = tmp_path / "node1"
    assert run("stage", pattern, dest, "--ranks", 1).exit_code == 0
    before = listing(dest)
    r = run("stage", random, dest, "--ranks", 1)
    assert r.exit_code == 2 and "a share of other weights" in r.stderr, r.output
    assert listing(dest) == before


# ---------------------------------------------------------------- 8: faults name OUT's or DEST's file


def test_8_an_io_error_reading_out_names_outs_file(out, tmp_path, copying, monkeypatch):
    real = os.read
    victim = str((out / PART1).resolve())

    def failing(fd, n):
        if os.readlink(f"/proc/self/fd/{fd}") == victim:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, n)

    monkeypatch.setattr(stage_mod.os, "read", failing)
    dest = tmp_path / "node1"
    r = run("stage", out, dest, "--ranks", 1)
    assert r.exit_code == 2 and f"{out / PART1}: Input/output error" in r.stderr, r.output
    assert ".partial" not in r.stderr and not list(dest.rglob("*.partial"))


def test_8_a_link_refused_names_both_files_in_full(out, tmp_path, monkeypatch):
    def read_only(self, src, rel):
        raise OSError(errno.EROFS, "Read-only file system", rel, None, rel)

    monkeypatch.setattr(Tree, "link_in", read_only)
    dest = tmp_path / "node1"
    r = run("stage", out, dest, "--ranks", 1)
    assert r.exit_code == 2, r.output
    assert f"{out / 'lucifer-manifest.json'} -> {dest / 'lucifer-manifest.json'}: Read-only file system" in r.stderr


# ---------------------------------------------------------------- 9: check-numerics on a share


def test_9_check_numerics_on_a_sound_share_says_it_needs_the_whole_output(converted, tmp_path):
    dest = tmp_path / "node1"
    assert run("stage", converted(), dest, "--ranks", 1).exit_code == 0
    r = run("check-numerics", dest)
    assert r.exit_code == 2 and "is a node's share" in r.stderr and "is missing" not in r.stderr, r.output


# ---------------------------------------------------------------- 10 and 16: inspect, --dry-run


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_10_inspect_of_a_share_with_a_rank_file_missing_or_truncated_fails_like_verify(converted, tmp_path, damage):
    dest = tmp_path / "node1"
    assert run("stage", converted(), dest, "--ranks", 1).exit_code == 0
    part = dest / PART1
    data = part.read_bytes()
    part.unlink()  # the link: OUT's file stays whole
    if damage == "truncated":
        part.write_bytes(data[: len(data) // 2])
    r = run("inspect", dest)
    assert r.exit_code == 1 and PART1 in r.stderr and error_kind("inspect", dest) == "mismatch", r.output


@pytest.mark.parametrize("args", [["convert", "--tp", "3", "m", "o"], ["stage", "o", "d", "--ranks", "1"]])
def test_16_dry_run_points_to_plan(args, tmp_path):
    r = run(*args, "--dry-run")
    assert r.exit_code == 2 and "No such option: --dry-run (lucifer-shard plan" in r.stderr, r.output
