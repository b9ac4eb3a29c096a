"""`convert --resume` on a finished output (issue 27, repair): every file is re-checked against the
manifest and only the damaged or missing ones are written again, from the source; a source or
option set that is not the converted one is refused by name; a repair stopped part-way is finished
by the next --resume."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from helpers import run
from lucifer_shard.engine import convert as engine, writeloop
from lucifer_shard.formats.stheader import read_header
from lucifer_shard.model.options import Options

ARGS = ("convert", "--tp", "3", "--arch", "sm120")
DAMAGED = "target/rank-1/part-00000.safetensors"  # a byte flipped inside its data
GONE = "draft/rank-2/part-00000.safetensors"  # deleted


def stamps(out: Path) -> dict[str, tuple[int, int, int]]:
    """rel -> (inode, mtime_ns, size) of every file of OUT but the lock (each run takes it)."""
    return {str(p.relative_to(out)): (p.stat().st_ino, p.stat().st_mtime_ns, p.stat().st_size)
            for p in sorted(out.rglob("*")) if p.is_file() and p.name != "lock"}


def flip(path: Path, at: int = -1000) -> None:
    with open(path, "r+b") as f:
        f.seek(at, os.SEEK_END)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x10]))


@pytest.fixture
def finished(converted, tiny_pattern, tmp_path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(converted(), out)  # real copies: a byte flipped here stays here
    return out


def test_resume_rewrites_exactly_the_damaged_and_missing_files(finished, tiny_pattern):
    flip(finished / DAMAGED)
    (finished / GONE).unlink()
    before = stamps(finished)
    r = run(*ARGS, tiny_pattern, finished, "--resume")
    assert r.exit_code == 0, r.output
    assert "2 written, 4 kept" in r.output and DAMAGED in r.output and GONE in r.output, r.output
    after = stamps(finished)
    changed = {rel for rel in after if before.get(rel) != after[rel]}
    assert changed == {DAMAGED, GONE, ".lucifer/journal.jsonl", "COMPLETE"}, changed
    assert not list(finished.rglob("*.partial"))
    d = run("diff", finished)
    assert d.exit_code == 0, d.output
    assert run("verify", finished).exit_code == 0


def test_resume_of_a_sound_output_writes_nothing(finished, tiny_pattern):
    before = stamps(finished)
    r = run(*ARGS, tiny_pattern, finished, "--resume")
    assert r.exit_code == 0, r.output
    assert "nothing to repair" in r.output and "0 written, 6 kept" in r.output, r.output
    assert stamps(finished) == before


def test_resume_restores_a_damaged_copy_of_config(finished, tiny_pattern):
    (finished / "config.json").write_text("{}\n")
    before = stamps(finished)
    r = run(*ARGS, tiny_pattern, finished, "--resume")
    assert r.exit_code == 0, r.output
    assert (finished / "config.json").read_bytes() == (tiny_pattern / "config.json").read_bytes()
    assert all(stamps(finished)[rel] == before[rel] for rel in before if rel.endswith(".safetensors"))
    assert run("verify", finished).exit_code == 0


def test_resume_restores_a_deleted_conversion_record(finished, tiny_pattern):
    record = (finished / ".lucifer/conversion.json").read_bytes()
    (finished / ".lucifer/conversion.json").unlink()
    r = run(*ARGS, tiny_pattern, finished, "--resume")
    assert r.exit_code == 0 and "0 written, 6 kept" in r.output, r.output
    assert json.loads((finished / ".lucifer/conversion.json").read_bytes())["files"] == json.loads(record)["files"]
    assert (finished / "COMPLETE").is_file()


def test_resume_refuses_a_source_with_other_weights_and_names_the_tensor(finished, tiny_pattern, tmp_path):
    """Same headers and sizes (same fingerprint), one tensor's bytes changed: the rewritten file's
    content stamp would differ, so it is not published; the refusal leaves OUT as it was: the damaged file
    and COMPLETE stay (issue 43: COMPLETE went first, before the check)."""
    other = tmp_path / "other"
    shutil.copytree(tiny_pattern, other)
    index = json.loads((other / "model.safetensors.index.json").read_text())
    key = "layers.0.attn.wo_a.weight"
    shard = other / index["weight_map"][key]
    h = read_header(shard)
    t = h.tensors[key]
    with open(shard, "r+b") as f:
        f.seek(h.data_start + t.start)
        b = f.read(1)
        f.seek(h.data_start + t.start)
        f.write(bytes([b[0] ^ 0x01]))
    flip(finished / "target/rank-0/part-00000.safetensors")
    damaged = (finished / "target/rank-0/part-00000.safetensors").read_bytes()
    r = run(*ARGS, other, finished, "--resume")
    assert r.exit_code == 2, r.output
    line = r.output.strip().splitlines()[-1]
    assert line.startswith("error: --resume:") and key in line and "--force" in line, line
    assert (finished / "target/rank-0/part-00000.safetensors").read_bytes() == damaged
    assert not list(finished.rglob("*.partial")) and (finished / "COMPLETE").exists()
    done = run(*ARGS, tiny_pattern, finished, "--resume")  # the converted source finishes it
    assert done.exit_code == 0, done.output
    assert run("diff", finished).exit_code == 0


@pytest.mark.parametrize("extra, named", [(("--align", "4096"), "--align 8 -> --align 4096"),
                                          (("--no-mtp",), "without --no-mtp -> --no-mtp")])
def test_resume_refuses_other_options_naming_them(finished, tiny_pattern, extra, named):
    flip(finished / DAMAGED)
    before = stamps(finished)
    r = run(*ARGS, *extra, tiny_pattern, finished, "--resume")
    assert r.exit_code == 2 and named in r.output, r.output
    assert stamps(finished) == before


def test_a_repair_stopped_part_way_is_finished_by_the_next_resume(finished, tiny_pattern, monkeypatch):
    flip(finished / DAMAGED)
    (finished / GONE).unlink()
    write_part = writeloop._write_part
    calls = []

    def stopped(*a, **kw):  # Ctrl-C while the second part is written
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return write_part(*a, **kw)

    monkeypatch.setattr(writeloop, "_write_part", stopped)
    with pytest.raises(KeyboardInterrupt):
        engine.convert(str(tiny_pattern), finished, Options(tp=3), resume=True, progress=False)
    assert not (finished / "COMPLETE").exists() and not list(finished.rglob("*.partial"))
    assert run("verify", finished).exit_code != 0
    monkeypatch.undo()
    r = run(*ARGS, tiny_pattern, finished, "--resume")
    assert r.exit_code == 0 and "1 written, 5 kept" in r.output, r.output
    assert run("diff", finished).exit_code == 0


def test_convert_help_says_resume_repairs():
    assert "damaged" in " ".join(run("convert", "--help").output.split())
