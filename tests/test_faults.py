"""Faults during resume and repair (issue 36), as a hostile machine makes them: a source that answers
EIO, a full disk, a file-size, memory or thread limit, a kill at a journal point, a torn journal
line, a stale temporary or a user's file in a rank folder. Each failing case holds the contract:

* exit 2 with one `error:` line naming the path (or the limit) and the fault, of the kind
  `errors.ERROR_KINDS` gives that fault (`--json`'s error.kind), never an internal error;
* no COMPLETE once the run has changed OUT (a repair's first change comes after the first part's content
  check: a fault before it leaves OUT as it was, COMPLETE included), none of the tool's `.partial` files left;
* nothing of an earlier run lost: its rank files keep their inode, mtime and size, its journal
  lines stay the journal's start, its conversion record its bytes;
* the source untouched, nothing written outside OUT (no log in the temporary folder either);
* a following `--resume` finishes, and `verify` and `diff` pass.

EIO is injected in this process at the two system calls every reader of the tool goes through
(`os.pread`, `os.preadv`), for one file (found by its descriptor's /proc/self/fd link) from a byte
offset on; limits run the CLI in a subprocess with `setrlimit`; the full disk is a real tmpfs (the
suite runs as root, as CI does). With LUCIFER_RELIABILITY_LOG=path each case appends its row
(`tools/reliability_table.py` renders docs/evidence/reliability.md's table from it).
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import cli_argv, run, run_process
from lucifer_shard.engine import assemble, writeloop
from lucifer_shard.errors import ERROR_KINDS, SourceError, fault
from lucifer_shard.formats.stheader import read_header
from test_reliability import (_journal_lines, _start, _wait_for, everything, record, small_fs,  # noqa: F401
                              snapshot)  # small_fs: a fixture
from test_repair import flip

CONVERT = ("convert", "--tp", "3", "--arch", "sm120", "--max-file-size", "1MiB")  # _start's options
WHOLE = ("convert", "--tp", "3", "--arch", "sm120")  # one file per rank: the files the `converted` fixture has
SHARD4 = "model-00004-of-00005.safetensors"  # read by the later parts only (layer 3's last experts, norms)
JOURNAL = ".lucifer/journal.jsonl"
RECORD = ".lucifer/conversion.json"


def subprocess_cli(*args: object, limit: tuple[int, int] | None = None) -> subprocess.CompletedProcess:
    """The CLI in a subprocess, with `limit` = (resource, bytes) set in it before it starts."""
    def cap():
        resource.setrlimit(limit[0], (limit[1], limit[1]))

    return run_process(*args, preexec_fn=cap if limit else None)


@dataclass
class Ran:
    """A failing command as the contract reads it (CliRunner's result or a subprocess alike)."""

    code: int
    stdout: str
    stderr: str

    @classmethod
    def of(cls, r) -> "Ran":
        return cls(r.exit_code if hasattr(r, "exit_code") else r.returncode, r.stdout, r.stderr)


def rank_files(out: Path) -> dict[str, tuple[int, int, int]]:
    """rel -> (inode, mtime_ns, size) of every rank file under a final name."""
    return {str(p.relative_to(out)): (p.stat().st_ino, p.stat().st_mtime_ns, p.stat().st_size)
            for p in sorted(out.rglob("*.safetensors"))}


def read_or_none(path: Path) -> bytes | None:
    return path.read_bytes() if path.is_file() else None


class Scene:
    """OUT, its source and everything around it before the fault: what the contract compares with."""

    def __init__(self, src: Path, out: Path):
        self.src, self.out = src, out
        self.source = snapshot(src)
        journal = read_or_none(out / JOURNAL) or b""
        self.journal = journal[:journal.rfind(b"\n") + 1]  # its whole lines: what the run recorded
        journaled = {json.loads(line)["path"] for line in self.journal.splitlines()}
        self.files = {rel: st for rel, st in rank_files(out).items() if rel in journaled} if out.exists() else {}
        self.record = read_or_none(out / RECORD)
        self.whole = everything(out) if out.exists() else {}
        self.around = self._around()

    def _around(self) -> dict:
        """Everything beside OUT (its parent's other entries) and in the temporary folder (`private_tmp`)."""
        return {str(p): p.stat().st_mtime_ns for folder in (self.out.parent, Path(tempfile.gettempdir()))
                for p in sorted(folder.rglob("*")) if self.out not in (p, *p.parents)}

    def holds(self, ran: Ran, kind: str, *needles: str, case: str, outcome: str, untouched: bool = False) -> str:
        """The contract of a failed run (module docstring), up to the resume; its error line. `untouched`:
        OUT must be exactly as it was (a check, or a refusal before the first write)."""
        assert ran.code == ERROR_KINDS[kind][0] == 2, (ran.code, ran.stderr)
        assert "Traceback" not in ran.stderr and "internal error" not in ran.stderr, ran.stderr
        errors = [ln for ln in ran.stderr.splitlines() if ln.startswith("error: ")]
        assert len(errors) == 1 and len([ln for ln in ran.stderr.splitlines() if ln.strip()]) == 1, ran.stderr
        line = errors[0]
        for n in needles:
            assert n in line, (n, line)
        if ran.stdout.strip().startswith("{"):  # --json
            assert json.loads(ran.stdout)["error"]["kind"] == kind, ran.stdout
        out = self.out
        assert everything(out) == self.whole if untouched else not (out / "COMPLETE").exists()
        assert not list(out.rglob("*.partial")), list(out.rglob("*.partial"))
        now = rank_files(out)
        assert {rel: now.get(rel) for rel in self.files} == self.files, "a file of the earlier run was lost"
        journal = read_or_none(out / JOURNAL) or b""
        assert journal.startswith(self.journal), "the earlier run's journal lines were lost"
        if self.record is not None:
            assert read_or_none(out / RECORD) == self.record
        assert snapshot(self.src) == self.source
        assert self._around() == self.around, "something outside OUT was written"
        record(case, outcome, subprocess.CompletedProcess([], ran.code, "", ran.stderr),
               message=line.replace(str(self.out.parent), "…"))
        return line

    def resumes(self, *args: object) -> None:
        """A following --resume finishes, verify and diff pass, the source is still untouched."""
        r = run(*args, "--resume", self.src, self.out)
        assert r.exit_code == 0, r.output
        assert run("verify", self.out).exit_code == 0
        d = run("diff", self.out)
        assert d.exit_code == 0, d.output
        assert snapshot(self.src) == self.source


@pytest.fixture(autouse=True)
def private_tmp(tmp_path_factory):
    """A temporary folder of this case's own, here and in its subprocesses: an internal-error log the
    case causes is found there, and other programs' files in /tmp do not count. (Its own patch: a
    case's `monkeypatch.undo()` leaves it in place.)"""
    folder = tmp_path_factory.mktemp("tmpdir")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TMPDIR", str(folder))
        mp.setattr(tempfile, "tempdir", str(folder))
        yield


@contextlib.contextmanager
def eio(path: Path, from_byte: int = 0, after: int = 0):
    """Reads of the file `path` (through any descriptor of it) at offsets from `from_byte` on fail with
    EIO, after `after` such reads went through: a disk that stops reading a region of one file."""
    target = os.path.realpath(path)
    calls: list[int] = []
    real = {name: getattr(os, name) for name in ("pread", "preadv")}

    def failing(name):
        def read(fd, what, offset, *rest):
            try:
                here = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                here = None
            if here == target and offset >= from_byte:
                calls.append(offset)
                if len(calls) > after:
                    raise OSError(errno.EIO, os.strerror(errno.EIO))
            return real[name](fd, what, offset, *rest)
        return read

    with pytest.MonkeyPatch.context() as mp:
        for name in real:
            mp.setattr(os, name, failing(name))
        yield calls


def data_start(shard: Path) -> int:
    return read_header(shard).data_start


@pytest.fixture
def killed(tiny_pattern, tmp_path) -> Path:
    """OUT of a conversion SIGKILLed at a journal point: after 9 of its 72 rank files were journaled."""
    out = tmp_path / "out"
    proc = _start(tiny_pattern, out)
    _wait_for(lambda: _journal_lines(out) >= 9, proc)
    proc.kill()
    proc.wait()
    return out


@pytest.fixture
def finished(converted, tmp_path) -> Path:
    """A copy of a finished conversion (one file per rank), real copies: a byte flipped here stays here."""
    out = tmp_path / "out"
    shutil.copytree(converted(), out)
    return out


# ---------------------------------------------------------------- 1. the source fails during --resume


def test_source_eio_during_resume_keeps_the_earlier_run(tiny_pattern, killed):
    scene = Scene(tiny_pattern, killed)
    assert len(scene.files) >= 9
    shard = tiny_pattern / SHARD4
    with eio(shard, from_byte=data_start(shard)) as reads:
        r = Ran.of(run(*CONVERT, "--json", "--resume", tiny_pattern, killed))
    assert reads, "the injected fault was never reached"
    scene.holds(r, "environment", str(shard), "Input/output error", "--resume",
                case="source EIO during --resume (a run SIGKILLed after 9 journaled files)",
                outcome="earlier rank files, journal and record kept; --resume then finishes, verify and diff pass")
    scene.resumes(*CONVERT)


def test_bad_source_during_resume_removes_only_what_the_resume_wrote(tiny_pattern, killed, monkeypatch):
    """A source found bad mid-stream (an E8M0 0xFF scale) removes what this run wrote, never the
    earlier run's files, journal lines or record."""
    scene = Scene(tiny_pattern, killed)
    real = assemble._check_scales
    bad = "layers.3.ffn.experts.2.w2.scale"

    def nan_scale(data, key, entry, start):
        if key == bad:
            raise SourceError(f"{entry.file}: tensor {key!r} has E8M0 scale byte 0xFF (NaN) at [0, 5]; refusing "
                              f"to write a NaN scale")
        return real(data, key, entry, start)

    monkeypatch.setattr(assemble, "_check_scales", nan_scale)
    r = Ran.of(run(*CONVERT, "--json", "--resume", tiny_pattern, killed))
    scene.holds(r, "source", bad, "0xFF", case="bad source (E8M0 0xFF) found mid-stream during --resume",
                outcome="only this run's files removed; the earlier run's files, journal and record kept")
    assert rank_files(killed) == scene.files and (killed / JOURNAL).read_bytes() == scene.journal
    monkeypatch.undo()
    scene.resumes(*CONVERT)


# ---------------------------------------------------------------- 2. --resume and verify agree


def test_resume_removes_its_own_stale_temporary_file(tiny_pattern, finished):
    stale = finished / "target/rank-0/.part-00000.safetensors.partial"
    stale.write_bytes(b"half a rank file")
    assert run("verify", finished).exit_code == 1
    r = run(*WHOLE, "--resume", tiny_pattern, finished)
    assert r.exit_code == 0 and "removed 1 temporary file" in r.output, r.output
    assert not stale.exists() and run("verify", finished).exit_code == 0
    record("stale .partial of the tool's own in a rank folder, --resume", "removed (it is the tool's); "
           "nothing to repair, exit 0; verify passes", subprocess.CompletedProcess([], 0, "", ""),
           message=r.stdout.strip().splitlines()[-1].replace(str(finished.parent), "…"))


@pytest.mark.parametrize("state", ["finished", "unfinished"])
def test_resume_refuses_to_finish_beside_a_users_file(tiny_pattern, finished, state):
    if state == "unfinished":
        (finished / "COMPLETE").unlink()
        (finished / "lucifer-manifest.json").unlink()
    stray = finished / "target/rank-1/part-00003.safetensors.bak"
    stray.write_bytes(b"mine")
    scene = Scene(tiny_pattern, finished)
    r = Ran.of(run(*WHOLE, "--json", "--resume", tiny_pattern, finished))
    scene.holds(r, "refused", "target/rank-1/part-00003.safetensors.bak",
                       "unexpected file in a rank folder", case=f"a user's file in a rank folder, --resume ({state})",
                       untouched=True,
                       outcome="refused naming it and what verify says; nothing changed")
    assert stray.read_bytes() == b"mine"
    if state == "finished":
        v = run("verify", finished)
        assert v.exit_code == 1 and "unexpected file in a rank folder" in v.stderr, v.stderr
    stray.rename(finished.parent / stray.name)  # the user moves it out
    scene.resumes(*WHOLE)


# ---------------------------------------------------------------- 3. a tight disk with stale partials


def test_a_tight_disk_resumes_over_its_own_stale_partials(tiny_pattern, converted, small_fs):
    """SIGKILL mid-file on a filesystem sized output + 4 MiB: the stale partials are the room the
    resume needs; the room check counts them (they are removed before the writes)."""
    clean = converted()
    need = sum(p.stat().st_size for p in clean.rglob("*") if p.is_file())
    fs = small_fs(need + (4 << 20))
    out = fs / "out"
    proc = subprocess.Popen(cli_argv(*WHOLE, "-q", tiny_pattern, out),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _wait_for(lambda: sum(p.stat().st_size for p in out.rglob("*.partial")) >= 12 << 20, proc)
    proc.kill()
    proc.wait()
    stale = sum(p.stat().st_size for p in out.rglob("*.partial"))
    assert shutil.disk_usage(fs).free < need, "the disk is not tight: the case proves nothing"
    r = run(*WHOLE, "--resume", tiny_pattern, out)
    assert r.exit_code == 0, r.output
    assert not list(out.rglob("*.partial")) and run("verify", out).exit_code == 0
    assert run("diff", out).exit_code == 0
    record(f"--resume on a tight disk (tmpfs of output + 4 MiB) after SIGKILL mid-file, {stale >> 20} MiB of "
           f"stale .partial", "the room check counts the stale partials; resume finishes, verify and diff pass",
           subprocess.CompletedProcess([], 0, "", ""),
           message=next(ln for ln in r.stdout.splitlines() if ln.startswith("files")))


# ---------------------------------------------------------------- 4. limits of the process


def test_file_size_limit_during_a_repair(tiny_pattern, finished):
    flip(finished / "target/rank-1/part-00000.safetensors")
    scene = Scene(tiny_pattern, finished)
    damaged = "target/rank-1/part-00000.safetensors"
    scene.files.pop(damaged)  # the repair's to rewrite
    r = Ran.of(subprocess_cli(*WHOLE, "--json", "--resume", tiny_pattern, finished,
                              limit=(resource.RLIMIT_FSIZE, 4 << 20)))
    # the limit strikes while the first part to rewrite is written, before its content check: the repair
    # has changed nothing yet, so OUT stays as it was, COMPLETE included (issue 43: a repair's first
    # change comes after the check)
    scene.holds(r, "environment", "target/rank-1/.part-00000.safetensors.partial", "File too large",
                "4,194,304 bytes (ulimit -f)", "--resume", case="RLIMIT_FSIZE 4 MiB during a --resume repair",
                outcome="exit 2 naming the limit and the largest file; OUT as it was (COMPLETE kept: the repair "
                        "had changed nothing)", untouched=True)
    scene.resumes(*WHOLE)


def test_address_space_limit_in_convert(tiny_pattern, tmp_path):
    out = tmp_path / "out"
    scene = Scene(tiny_pattern, out)
    r = Ran.of(subprocess_cli(*CONVERT, "--json", tiny_pattern, out, limit=(resource.RLIMIT_AS, 400 << 20)))
    scene.holds(r, "environment", "ulimit -v", case="RLIMIT_AS 400 MiB on convert",
                outcome="exit 2 naming the limit and what convert needs")
    scene.resumes(*CONVERT)


def test_address_space_limit_in_diff_writes_nothing(tiny_pattern, finished):
    scene = Scene(tiny_pattern, finished)
    r = Ran.of(subprocess_cli("diff", "--json", finished, limit=(resource.RLIMIT_AS, 400 << 20)))
    scene.holds(r, "environment", "ulimit -v", case="RLIMIT_AS 400 MiB on diff", untouched=True,
                outcome="exit 2 naming the limit; nothing written into OUT (no internal-error log)")


def test_no_thread_for_the_writer(tiny_pattern, killed, monkeypatch):
    """`can't start new thread` (a process or address-space limit) is the environment's, not a bug."""
    scene = Scene(tiny_pattern, killed)

    class NoThreads(writeloop.ThreadPoolExecutor):
        def submit(self, *a, **k):
            raise RuntimeError("can't start new thread")

    monkeypatch.setattr(writeloop, "ThreadPoolExecutor", NoThreads)
    r = Ran.of(run(*CONVERT, "--json", "--resume", tiny_pattern, killed))
    scene.holds(r, "environment", "cannot start a thread", "ulimit -u", "ulimit -v",
                case="no thread can be started (--resume; RuntimeError injected at the writer's pool)", outcome="exit 2 naming the limits; earlier files kept")
    monkeypatch.undo()
    scene.resumes(*CONVERT)


# ---------------------------------------------------------------- 5. a torn journal line


def test_a_torn_journal_line_is_cut_before_the_next_append(tiny_pattern, tmp_path, monkeypatch):
    out = tmp_path / "out"
    scene = Scene(tiny_pattern, out)
    real, appends = writeloop.write_all, []

    def disk_fills(fd, data):  # the third part's journal append: half written, then ENOSPC
        appends.append(1)
        if len(appends) == 3:
            real(fd, data[:len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, data)

    monkeypatch.setattr(writeloop, "write_all", disk_fills)
    r = Ran.of(run(*CONVERT, "--json", tiny_pattern, out))
    monkeypatch.undo()
    assert not (out / JOURNAL).read_bytes().endswith(b"\n")  # torn
    scene.holds(r, "no_room", str(out / JOURNAL), "No space left on device", "--resume",
                case="ENOSPC in the middle of a journal append", outcome="exit 2 no_room; the torn line is cut "
                "by the next --resume, whose appended lines are whole")
    scene.resumes(*CONVERT)
    lines = (out / JOURNAL).read_bytes().splitlines(keepends=True)
    assert all(line.endswith(b"\n") and json.loads(line) for line in lines)
    (out / "COMPLETE").unlink()
    (out / "lucifer-manifest.json").unlink()
    again = run(*CONVERT, "--resume", tiny_pattern, out)  # the journal alone is the reference now
    assert again.exit_code == 0 and " 0 written" in again.output, again.output


# ---------------------------------------------------------------- one fault, one kind, everywhere


def _full_disk(monkeypatch) -> None:
    """Writes of the tool's temporary files fail with ENOSPC (a disk another program filled)."""
    real = os.write

    def write(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".partial"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)


@pytest.mark.parametrize("where", ["convert", "repair", "room check"])
def test_a_full_disk_is_no_room_everywhere(tiny_pattern, finished, tmp_path, monkeypatch, where):
    if where == "convert":
        out = tmp_path / "fresh"
        _full_disk(monkeypatch)
    elif where == "repair":
        out = finished
        flip(out / "draft/rank-2/part-00000.safetensors")
        _full_disk(monkeypatch)
    else:
        out = tmp_path / "fresh"
        real = os.statvfs
        monkeypatch.setattr(os, "statvfs", lambda p: os.statvfs_result((*real(p)[:4], 0, *real(p)[5:])))
    r = run(*WHOLE, "--json", "--resume" if where == "repair" else "--quiet", tiny_pattern, out)
    assert r.exit_code == 2 and json.loads(r.stdout)["error"]["kind"] == "no_room", r.output
    assert "No space left" in r.stderr or "not enough room" in r.stderr, r.stderr


@pytest.mark.parametrize("command", ["verify", "diff", "inspect", "check-numerics"])
def test_eio_reading_a_rank_file_is_the_environments(tiny_random, converted, tmp_path, command):
    out = tmp_path / "out"
    shutil.copytree(converted(source=tiny_random), out)
    scene = Scene(tiny_random, out)
    rank = out / "target/rank-1/part-00000.safetensors"
    with eio(rank) as reads:
        r = Ran.of(run(command, "--json", out))
    assert reads
    scene.holds(r, "environment", str(rank), "Input/output error", case=f"EIO reading a rank file in {command}",
                untouched=True,
                outcome="exit 2, kind environment naming the file (not a mismatch); OUT untouched")


def test_a_damaged_rank_file_points_to_resume_first(finished):
    flip(finished / "target/rank-0/part-00000.safetensors")
    for command in ("verify", "diff"):
        line = run(command, finished).stderr.strip().splitlines()[-1]
        assert line.index("--resume") < line.index("--force"), line


def test_a_newline_in_out_stays_one_line(tmp_path):
    r = run("verify", tmp_path / "o\nut")
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and "o\\nut" in r.stderr, r.stderr


def test_fault_kinds_are_the_table():
    """Each fault the machine makes has one kind, whichever command meets it."""
    cases = {OSError(errno.EIO, "Input/output error", "/x"): "environment",
             OSError(errno.EROFS, "Read-only file system", "/x"): "environment",
             OSError(errno.ENOSPC, "No space left on device", "/x"): "no_room",
             OSError(errno.EDQUOT, "Disk quota exceeded", "/x"): "no_room",
             MemoryError("Unable to allocate 16.0 MiB"): "environment",
             OSError(errno.ENOMEM, "Cannot allocate memory"): "environment",
             ImportError("libtorch_cpu.so: failed to map segment from shared object"): "environment",
             RuntimeError("can't start new thread"): "environment"}
    for e, kind in cases.items():
        for command in ("convert", "diff", "verify"):
            got = fault(e, command)
            assert got is not None and got.kind == kind and "\n" not in str(got), (e, command, got)
    assert fault(RuntimeError("a bug"), "convert") is None and fault(OSError(errno.EINVAL, "x"), "diff") is None


def test_a_read_only_out_is_the_machines_refusal(tiny_pattern, tmp_path, monkeypatch):
    """OUT where the lock cannot be created (a read-only filesystem; root ignores mode bits, so the
    filesystem's answer is injected): kind environment, exit 2, naming OUT, nothing written."""
    from lucifer_shard.guarded_io import Tree

    def read_only(self, rel, flags):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(Tree, "open_own", read_only)
    out = tmp_path / "out"
    r = run("convert", "--tp", "3", tiny_pattern, out, "--json")
    assert r.exit_code == 2, r.output
    envelope = json.loads(r.stdout)
    assert envelope["error"]["kind"] == "environment" and "Read-only file system" in envelope["error"]["message"]
    assert str(out) in envelope["error"]["message"] and not list(out.rglob("*"))
