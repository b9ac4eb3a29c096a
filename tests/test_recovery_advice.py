"""Every recovery message works when followed (issue 64 item 4): a share whose stage or fetch stopped is told to
run it again, a copy without `.lucifer/` to copy again (never `--resume`, which has no conversion record there),
stage's room check speaks convert's words before DEST changes, and plan says which route its room verdict is
for, checking the streamed route's room for a node's share. Each test follows the advice and asserts success."""
from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest

from helpers import one_error, run
from lucifer_shard.engine import diskspace, stage as stage_mod

NODE = ["--nnodes", 3, "--node-rank", 1]


def _stop_after(monkeypatch, calls: int) -> None:
    """stage's placing of files fails with ENOSPC after `calls` files: a stage stopped part-way (a full disk)."""
    real, placed = stage_mod._place, []

    def place(src, tree, want):
        if len(placed) == calls:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tree.path(want.rel)))
        placed.append(want.rel)
        return real(src, tree, want)

    monkeypatch.setattr(stage_mod, "_place", place)


def test_a_stopped_stage_says_stage_again_and_stage_again_finishes(converted, tmp_path, monkeypatch):
    """Before: verify and serve said "the conversion did not finish (run convert again with --resume)", and
    --resume was refused there (no conversion record)."""
    out, share = converted(expert_layout="model"), tmp_path / "share"
    _stop_after(monkeypatch, 4)
    assert run("stage", out, share, *NODE, "-q").exit_code != 0
    monkeypatch.undo()
    line = one_error(run("verify", share), 1, "the copy did not finish; run the same fetch or stage again")
    assert "convert again with --resume" not in line
    r = run("serve", share, *NODE, "--master-addr", "10.0.0.1", "--dry-run")
    assert "the copy did not finish; run the same fetch or stage again" in r.stdout and "--resume" not in r.stdout
    assert run("stage", out, share, *NODE, "-q").exit_code == 0  # the advice, followed
    assert run("verify", share, "-q").exit_code == 0


def test_a_stopped_fetch_says_fetch_again_and_fetch_again_finishes(converted, tmp_path):
    """A fetch writes lucifer-share.json and COMPLETE last (engine/fetch.py): a fetch stopped before them, with a
    rank file not yet placed, is the share below."""
    out, share = converted(expert_layout="model"), tmp_path / "share"
    assert run("fetch", out, share, *NODE, "-q").exit_code == 0
    for name in ("COMPLETE", "lucifer-share.json", "target/rank-1/part-00000.safetensors"):
        (share / name).unlink()
    r = run("serve", share, *NODE, "--master-addr", "10.0.0.1", "--dry-run")
    assert r.exit_code == 1 and "run the same fetch or stage again" in r.stdout and "--resume" not in r.stdout
    assert run("fetch", out, share, *NODE, "-q").exit_code == 0  # the advice, followed
    assert run("verify", share, "-q").exit_code == 0


def _copy_without_record(out: Path, dest: Path) -> None:
    """OUT copied the README's way: every file but .lucifer/."""
    shutil.copytree(out, dest, ignore=lambda folder, names: [".lucifer"] if Path(folder) == out else [])


def test_a_damaged_copy_is_told_to_copy_again_never_resume(converted, tmp_path):
    out, copy = converted(expert_layout="model"), tmp_path / "copy"
    _copy_without_record(out, copy)
    rel = "target/rank-1/part-00000.safetensors"
    (copy / rel).unlink()
    line = one_error(run("verify", copy), 1, "copy the damaged files again from the output they were copied from")
    assert "--resume" not in line
    shutil.copy2(out / rel, copy / rel)  # the advice, followed
    assert run("verify", copy, "-q").exit_code == 0


def test_a_copy_that_stopped_before_complete_is_told_to_copy_again(converted, tmp_path):
    out, copy = converted(expert_layout="model"), tmp_path / "copy"
    _copy_without_record(out, copy)
    (copy / "COMPLETE").unlink()
    line = one_error(run("verify", copy), 1, "the copy did not finish", "or copy the output again (everything but "
                     ".lucifer/, COMPLETE last)")
    assert "--resume" not in line
    shutil.copy2(out / "COMPLETE", copy / "COMPLETE")  # the advice, followed (COMPLETE last)
    assert run("verify", copy, "-q").exit_code == 0


def test_stage_checks_the_room_first_in_converts_words(converted, tmp_path, monkeypatch):
    """Before: stage wrote until the disk was full (a whole draft file, then "No space left on device")."""
    out = converted(expert_layout="model")
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(out).st_dev:
        pytest.skip("needs a DEST on another filesystem than OUT (/dev/shm), where stage copies")
    dest = Path(shm) / f"lucifer-stage-room-{os.getpid()}"
    try:
        monkeypatch.setattr(diskspace, "free_bytes", lambda path: 4096)
        line = one_error(run("stage", out, dest, *NODE), 2, f"{dest}: not enough room on ", "still to write (",
                         "the share's files stage copies), 4.00 KiB free; free ", "more, then run the same stage "
                         "again, or stage into a DEST on another filesystem")
        assert "No space left" not in line and list(dest.iterdir()) == []  # nothing written before the check
        monkeypatch.undo()  # the advice, followed: the room is there
        assert run("stage", out, dest, *NODE, "-q").exit_code == 0
        assert run("verify", dest, "-q").exit_code == 0
    finally:
        shutil.rmtree(dest, ignore_errors=True)


def test_stage_by_hard_links_needs_no_bytes(converted, tmp_path, monkeypatch):
    """On OUT's filesystem stage links each file: the room check asks for no bytes, only files."""
    monkeypatch.setattr(diskspace, "free_bytes", lambda path: 0)
    assert run("stage", converted(expert_layout="model"), tmp_path / "share", *NODE, "-q").exit_code == 0


def test_plan_says_which_route_its_room_is_for_and_checks_the_streamed_one(tiny_pattern, tmp_path, monkeypatch):
    """Before: plan with a config (no checkpoint, no repo) said "enough" for a node whose streamed share needs far
    more (the source's shards at once), judging the source on disk without saying so."""
    out = tmp_path / "dest"
    config = tiny_pattern / "config.json"
    base = ["plan", "--tp", 3, "--expert-layout", "model", config, out]
    doc = __import__("json").loads(run(*base, *NODE, "--json").stdout)["result"]
    on_disk, streamed = doc["footprint"]["room"]["needed_bytes"], doc["streamed_room"]["needed_bytes"]
    assert doc["room_route"].startswith("a checkpoint already on disk") and streamed > on_disk
    monkeypatch.setattr(diskspace, "free_bytes", lambda path: (on_disk + streamed) // 2)
    r = run(*base, *NODE)
    assert "(for a checkpoint already on disk, MODEL being a config: nothing downloaded): enough" in r.stdout
    line = one_error(r, 1, f"{out}: not enough room: ", "choose another OUT or --download-dir for the streamed route")
    assert "streams its own share from the repo" in r.stdout and "NOT enough: free " in r.stdout, line
    monkeypatch.setattr(diskspace, "free_bytes", lambda path: streamed)  # the advice, followed: that much freed
    r = run(*base, *NODE)
    assert r.exit_code == 0 and r.stdout.count(": enough") == 2, r.output
    # without a node's share, a config is judged as a checkpoint on disk alone; a checkpoint says so
    assert run(*base).exit_code == 0
    r = run("plan", "--tp", 3, "--expert-layout", "model", tiny_pattern, out)
    assert r.exit_code == 0 and "(for convert from the checkpoint on disk): enough" in r.stdout, r.output
