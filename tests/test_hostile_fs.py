"""Hostile filesystems (issue 26, classes 1, 2, 8, 9, 10 and parts of 7 and 11): links, foreign
files, FIFOs and devices, mounts and hard links inside OUT, a journal and state files of any shape,
a clearing that stops half-way, SIGTERM, a source that changes under a running convert.

Every case runs the real command on a copy of a tiny conversion. Files outside OUT stand in for
files another user owns: they must be byte-identical, with the same mtime, afterwards. Open-ended
classes are property tests (hypothesis, derandomized): where a link goes and what it points at,
where a foreign entry goes, what a journal line or state file holds, at which deletion a clearing
stops.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import helpers
from helpers import cli_argv, one_error

CONVERT = ("convert", "--tp", "3", "--arch", "sm120", "-q")
PROPERTY = settings(derandomize=True, database=None, deadline=None, max_examples=24,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
HANG_S = 20  # a command blocked on a FIFO is stopped after this long (and the case fails)


class Hung(Exception):
    pass


@contextlib.contextmanager
def bounded_memory(extra: int = 1 << 30):
    """At most `extra` more bytes of address space: a reader of /dev/zero fails with MemoryError
    (exit 70, the case fails) instead of taking the machine's memory."""
    size = next(int(line.split()[1]) * 1024 for line in Path("/proc/self/status").read_text().splitlines()
                if line.startswith("VmSize:"))
    old = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (size + extra, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, old)


def run(*args: object):
    """The CLI in this process; a command that blocks (a FIFO opened for reading) fails the case,
    and so does one that reads without end (a device), within bounded memory."""
    def alarm(signum, frame):
        raise Hung(f"{' '.join(map(str, args))} blocked for {HANG_S} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(HANG_S)
    try:
        with bounded_memory():
            return helpers.run(*args)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def files_of(root: Path) -> dict[str, tuple]:
    """rel -> (kind, bytes or link target, mtime_ns) of everything under `root` (links not followed;
    OUT's lock aside: every run writes and empties it)."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.relative_to(root) == Path(".lucifer/lock"):
            continue
        st_ = p.lstat()
        if stat.S_ISLNK(st_.st_mode):
            out[str(p.relative_to(root))] = ("link", os.readlink(p), None)
        elif stat.S_ISREG(st_.st_mode):
            out[str(p.relative_to(root))] = ("file", p.read_bytes(), st_.st_mtime_ns)
        else:
            out[str(p.relative_to(root))] = (stat.S_IFMT(st_.st_mode), None, None)
    return out


def contents(root: Path) -> dict[str, bytes]:
    """rel -> bytes of the regular files an output holds (the lock aside: its record is the holder's)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.is_symlink() and p.name != "lock"}


@pytest.fixture(scope="module")
def clean(converted) -> Path:
    return converted()


@pytest.fixture(scope="module")
def clean_contents(clean) -> dict[str, bytes]:
    """contents(clean), read once for the property tests that compare each case's output with it."""
    return contents(clean)


@pytest.fixture
def work(tmp_path_factory):
    """work() -> a fresh folder for one case (hypothesis runs many cases in one test); the previous
    case's folder is removed then, the last one after the test."""
    made: list[Path] = []

    def make() -> Path:
        while made:
            shutil.rmtree(made.pop(), ignore_errors=True)
        made.append(tmp_path_factory.mktemp("case"))
        return made[-1]

    yield make
    for p in made:
        shutil.rmtree(p, ignore_errors=True)


def _copy(src: str, dst: str) -> None:
    """Rank files as hard links (no case writes into one: convert replaces them by name), the rest copied."""
    if src.endswith(".safetensors"):
        os.link(src, dst)
    else:
        shutil.copy2(src, dst)


def finished_copy(clean: Path, where: Path) -> Path:
    out = where / "out"
    shutil.copytree(clean, out, symlinks=True, copy_function=_copy)
    return out


def unfinished_copy(clean: Path, where: Path) -> Path:
    """A conversion stopped after its last rank file: journal complete, no manifest, no COMPLETE."""
    out = finished_copy(clean, where)
    (out / "COMPLETE").unlink()
    (out / "lucifer-manifest.json").unlink()
    return out


def victims(where: Path) -> tuple[Path, Path]:
    """A file and a folder outside OUT that stand for another user's (a root-owned 0600 file, MODEL)."""
    secret = where / "victim" / "secret"
    secret.parent.mkdir()
    secret.write_bytes(b"root-owned 0600 content\n")
    secret.chmod(0o600)
    folder = where / "victim-dir"
    folder.mkdir()
    for name in ("part-00000.safetensors", "conversion.json", "lock", "journal.jsonl", "keep.txt"):
        (folder / name).write_bytes(f"not yours: {name}\n".encode())
    return secret, folder


# ---------------------------------------------------------------- class 1: links inside OUT

LINK_PLACES = [".lucifer", ".lucifer/lock", ".lucifer/conversion.json", ".lucifer/journal.jsonl",
               ".lucifer/.conversion.json.partial", "target", "target/rank-0", "draft/rank-2",
               "target/rank-1/part-00000.safetensors", "target/rank-0/.part-00001.safetensors.partial",
               "lucifer-manifest.json", "COMPLETE", "config.json", ".lucifer-manifest.json.partial"]
MODES = {"resume": ("--resume",), "force": ("--force",), "plain": ()}


@PROPERTY
@given(place=st.sampled_from(LINK_PLACES), mode=st.sampled_from(sorted(MODES)), to_dir=st.booleans())
@example(place=".lucifer/lock", mode="plain", to_dir=False)  # the root-owned 0600 file
@example(place=".lucifer", mode="force", to_dir=True)
@example(place="target/rank-0", mode="resume", to_dir=True)
def test_a_link_inside_out_is_refused_by_name_and_its_target_untouched(clean, tiny_pattern, work, place, mode,
                                                                          to_dir):
    where = work()
    out = (unfinished_copy if mode == "resume" else finished_copy)(clean, where)
    secret, folder = victims(where)
    before = files_of(where / "victim"), files_of(folder), files_of(tiny_pattern)
    target = out / place
    is_dir = target.is_dir()
    if is_dir:
        shutil.rmtree(target)
    else:
        target.unlink(missing_ok=True)
    target.symlink_to(folder if to_dir or is_dir else secret)
    line = one_error(run(*CONVERT, *MODES[mode], tiny_pattern, out), alone=True)
    assert place in line, line  # the link is named
    assert (files_of(where / "victim"), files_of(folder), files_of(tiny_pattern)) == before
    assert target.is_symlink()  # not replaced either: a person decides what it was


def test_an_out_that_is_itself_a_link_is_followed_as_named(clean, tiny_pattern, tmp_path):
    """OUT itself may be a link the user made (a bigger disk): only what is inside OUT is guarded."""
    real = tmp_path / "big-disk" / "out"
    real.mkdir(parents=True)
    (tmp_path / "out").symlink_to(real, target_is_directory=True)
    assert run(*CONVERT, tiny_pattern, tmp_path / "out").exit_code == 0
    assert contents(real) == contents(clean)


# ---------------------------------------------------------------- class 2: --force deletes only what it wrote

FOREIGN = ["notes.txt", ".lucifer/notes.txt", "target/rank-1/part-00099.safetensors", "target/rank-0/mine/x.bin",
           "draft/README", "target/rank-3/part-00000.safetensors", "model.safetensors", ".hidden"]


@PROPERTY
@given(places=st.lists(st.sampled_from(FOREIGN), min_size=1, max_size=3, unique=True),
       kind=st.sampled_from(["file", "fifo", "dir"]), finished=st.booleans())
def test_force_refuses_while_out_holds_what_it_did_not_write(clean, tiny_pattern, work, places, kind, finished):
    where = work()
    out = (finished_copy if finished else unfinished_copy)(clean, where)
    for rel in places:
        p = out / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        {"file": lambda: p.write_bytes(b"user data\n"), "fifo": lambda: os.mkfifo(p),
         "dir": lambda: p.mkdir()}[kind]()
    before = files_of(out)
    line = one_error(run(*CONVERT, "--force", tiny_pattern, out), alone=True)
    shown = {rel if not rel.startswith("target/rank-0/mine") else "target/rank-0/mine" for rel in places}
    assert all(s in line for s in shown), line
    assert files_of(out) == before  # nothing deleted, nothing written


def test_force_refuses_a_folder_holding_a_copy_of_the_manifest(clean, tiny_pattern, tmp_path):
    """The issue's case: a folder with a copy of lucifer-manifest.json (or anything in .lucifer/) and
    user files is not emptied."""
    user = tmp_path / "user"
    user.mkdir()
    (user / "thesis.tex").write_bytes(b"years of work\n")
    (user / "lucifer-manifest.json").write_bytes((clean / "lucifer-manifest.json").read_bytes())
    (user / ".lucifer").mkdir()
    (user / ".lucifer" / "todo").write_bytes(b"x\n")
    before = files_of(user)
    line = one_error(run(*CONVERT, "--force", tiny_pattern, user), alone=True)
    assert "thesis.tex" in line and ".lucifer/todo" in line, line
    (user / "lucifer-manifest.json").unlink()
    line = one_error(run(*CONVERT, "--force", tiny_pattern, user), alone=True)
    assert "not a lucifer-shard output" in line, line
    assert files_of(user) == {k: v for k, v in before.items() if k != "lucifer-manifest.json"}


@pytest.mark.parametrize("at", ["model", "target/rank-0"])
def test_force_never_crosses_a_mount(clean, tiny_pattern, tmp_path, at):
    """MODEL bind-mounted inside OUT (the issue saw it deleted, exit 70): refused, named, untouched."""
    out = finished_copy(clean, tmp_path)
    point = out / at
    if point.exists():
        shutil.rmtree(point)
    point.mkdir(parents=True)
    model = tmp_path / "model-copy"
    shutil.copytree(tiny_pattern, model)
    before = files_of(model)
    mounted = subprocess.run(["mount", "--bind", str(model), str(point)], capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"cannot bind-mount here ({mounted.stderr.strip()}); the mount case needs root")
    try:
        line = one_error(run(*CONVERT, "--force", tiny_pattern, out), alone=True)
        assert at in line and "another filesystem" in line, line
        assert files_of(point) == before
    finally:
        subprocess.run(["umount", "-l", str(point)], check=True)
    assert files_of(model) == before


def test_force_replaces_its_own_output_exactly(clean, tiny_pattern, tmp_path):
    """Positive: what --force deletes is what the conversion wrote, and the new output is whole."""
    out = finished_copy(clean, tmp_path)
    (out / "target" / "rank-0" / ".part-00000.safetensors.partial").write_bytes(b"torn")  # a stopped run's
    (out / ".lucifer" / "internal-error-20250101-000000-1.log").write_bytes(b"log")
    assert run(*CONVERT, "--force", tiny_pattern, out).exit_code == 0
    assert contents(out) == contents(clean)


# ---------------------------------------------------------------- class 8: FIFOs and devices


def _fifo(p: Path) -> None:
    os.mkfifo(p)


def _device(p: Path) -> None:
    try:
        os.mknod(p, stat.S_IFCHR | 0o600, os.makedev(1, 5))  # /dev/zero: reads never end
    except PermissionError:
        p.symlink_to("/dev/zero")  # without CAP_MKNOD: a link to one (refused the same way)


SOURCE_FILES = ["config.json", "model.safetensors.index.json", "model-00001-of-00005.safetensors",
                "tokenizer_config.json"]
OUT_FILES = [".lucifer/conversion.json", ".lucifer/journal.jsonl", ".lucifer/lock", "lucifer-manifest.json"]


@pytest.mark.parametrize("make", [_fifo, _device], ids=["fifo", "device"])
@pytest.mark.parametrize("name", SOURCE_FILES)
def test_a_fifo_or_device_in_the_source_is_refused_not_read(tiny_pattern, tmp_path, name, make):
    model = tmp_path / "model"
    shutil.copytree(tiny_pattern, model)
    (model / name).unlink()
    make(model / name)
    line = one_error(run(*CONVERT, model, tmp_path / "out"), alone=True)
    assert name in line and ("is a FIFO" in line or "is a character device" in line), line


@pytest.mark.parametrize("make", [_fifo, _device], ids=["fifo", "device"])
@pytest.mark.parametrize("name", OUT_FILES)
@pytest.mark.parametrize("mode", ["--resume", "--force"])
def test_a_fifo_or_device_in_out_is_refused_not_read(clean, tiny_pattern, tmp_path, name, make, mode):
    out = unfinished_copy(clean, tmp_path) if mode == "--resume" else finished_copy(clean, tmp_path)
    (out / name).unlink(missing_ok=True)
    make(out / name)
    line = one_error(run(*CONVERT, mode, tiny_pattern, out), alone=True)
    assert name in line, line
    assert not (out / name).is_file()  # left as it was


def test_guarded_reads_refuse_what_is_not_a_regular_file(tmp_path):
    from lucifer_shard.guarded_io import Refused, Tree, read_regular

    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "big").write_bytes(b"x" * 101)
    (tmp_path / "link").symlink_to(tmp_path / "big")
    for path, follow, word in [("fifo", True, "FIFO"), ("link", False, "symlink"), ("big", False, "more than")]:
        with pytest.raises(Refused, match=word):
            read_regular(tmp_path / path, limit=100, follow=follow)
    with pytest.raises(Refused, match="character device"):
        read_regular("/dev/zero", follow=True)
    assert read_regular(tmp_path / "link", limit=101, follow=True) == b"x" * 101
    tree = Tree(tmp_path)
    os.link(tmp_path / "big", tmp_path / "hard")
    with pytest.raises(Refused, match="2 hard links"):
        tree.open_own("hard", os.O_RDWR)
    with pytest.raises(Refused, match="symlink"):
        tree.write_bytes("link/x", b"")
    assert (tmp_path / "big").read_bytes() == b"x" * 101


# ---------------------------------------------------------------- class 9: the journal is checked


def _journal(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / ".lucifer/journal.jsonl").read_text().splitlines()]


@PROPERTY
@given(data=st.data())
def test_resume_does_not_copy_an_edited_journal_digest(clean, clean_contents, tiny_pattern, work, data):
    """One changed hex digit anywhere in a journal line (file, tensor or source digest): --resume
    still finishes byte-identical to a clean run (the edited part is checked and redone)."""
    out = unfinished_copy(clean, work())
    lines = _journal(out)
    i = data.draw(st.integers(0, len(lines) - 1), label="line")
    fields = [("digest",)] + [("tensors", k) for k in lines[i]["tensors"]] + [("sources", k) for k in
                                                                               lines[i].get("sources", {})]
    field = data.draw(st.sampled_from(fields), label="field")
    holder = lines[i] if len(field) == 1 else lines[i][field[0]]
    key = field[-1]
    pos = data.draw(st.integers(0, 63), label="digit")
    digit = holder[key][pos]
    holder[key] = holder[key][:pos] + ("0" if digit != "0" else "1") + holder[key][pos + 1:]
    (out / ".lucifer/journal.jsonl").write_text("".join(json.dumps(e, sort_keys=True) + "\n" for e in lines))
    r = run(*CONVERT, "--resume", tiny_pattern, out)
    assert r.exit_code == 0, r.output
    assert {k: v for k, v in contents(out).items() if k != ".lucifer/journal.jsonl"} == \
        {k: v for k, v in clean_contents.items() if k != ".lucifer/journal.jsonl"}
    assert run("verify", out).exit_code == 0


# ---------------------------------------------------------------- class 10: room and a stopped clearing


def _small_disk(monkeypatch, free: int | None = None, inodes: int | None = None) -> None:
    real = os.statvfs

    class View:
        def __init__(self, st_):
            self._st = st_

        def __getattr__(self, name):
            if name == "f_bavail" and free is not None:
                return free // self._st.f_frsize
            if name in ("f_favail", "f_ffree") and inodes is not None:
                return inodes
            return getattr(self._st, name)

    monkeypatch.setattr(os, "statvfs", lambda path: View(real(path)))


def test_force_does_not_count_hard_linked_files_as_freed(clean, tiny_pattern, tmp_path, monkeypatch):
    """Rank files hard-linked elsewhere free nothing when --force deletes them: the room check
    refuses before deleting anything, instead of deleting the old output and hitting ENOSPC."""
    out = finished_copy(clean, tmp_path)
    elsewhere = tmp_path / "backup"
    elsewhere.mkdir()
    for i, p in enumerate(sorted(out.rglob("*.safetensors"))):
        os.link(p, elsewhere / f"{i}.safetensors")
    need = sum(p.stat().st_size for p in clean.rglob("*") if p.is_file())
    _small_disk(monkeypatch, free=need // 3)  # enough only if the old rank files counted as freed
    before = files_of(out)
    line = one_error(run(*CONVERT, "--force", tiny_pattern, out), alone=True)
    assert "not enough room" in line, line
    assert files_of(out) == before


def test_free_inodes_are_counted(tiny_pattern, tmp_path, monkeypatch):
    _small_disk(monkeypatch, inodes=5)
    line = one_error(run(*CONVERT, tiny_pattern, tmp_path / "out"), alone=True)
    assert "inodes" in line and "5 more files" in line, line


def test_a_write_that_fails_for_room_never_says_there_is_room_now(tmp_path):
    """ENOSPC although the bytes fit by our count (reserved blocks, a quota, another writer): the
    advice must not claim there is room now."""
    from lucifer_shard.engine.diskspace import write_failed

    err = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x"))
    msg = str(write_failed(err, tmp_path, [1000], 1000))
    assert "there is room now" not in msg and "--resume" in msg, msg


@PROPERTY
@given(stop_after=st.integers(0, 16), how=st.sampled_from(["EPERM", "killed"]))
@example(stop_after=5, how="killed")
def test_a_force_stopped_while_clearing_is_finished_by_force(clean, clean_contents, tiny_pattern, work, monkeypatch,
                                                              stop_after, how):
    """EPERM on an immutable file or SIGKILL after `stop_after` deletions: OUT is left for the same
    --force to finish (the record, deleted last, still lists what is left)."""
    out = finished_copy(clean, work())
    real_unlink = os.unlink
    count = [0]

    class Killed(BaseException):
        pass

    def unlink(path, *a, dir_fd=None, **kw):
        if count[0] >= stop_after:
            if how == "EPERM":
                raise PermissionError(errno.EPERM, "Operation not permitted", str(path))
            raise Killed()
        count[0] += 1
        return real_unlink(path, *a, dir_fd=dir_fd, **kw)

    with monkeypatch.context() as m:
        m.setattr(os, "unlink", unlink)
        m.setattr(os, "remove", unlink)
        if how == "EPERM":
            r = run(*CONVERT, "--force", tiny_pattern, out)
            if r.exit_code:  # stopped while clearing (a later stop_after lets it finish)
                assert "cannot delete" in one_error(r, alone=True)
        else:
            with contextlib.suppress(Killed):
                run(*CONVERT, "--force", tiny_pattern, out)
    r = run(*CONVERT, "--force", tiny_pattern, out)
    assert r.exit_code == 0, r.output
    assert contents(out) == clean_contents


# ---------------------------------------------------------------- class 11: SIGTERM, a changing source, links


def test_sigterm_is_clean_and_resumable(clean, tiny_pattern, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen(cli_argv(*CONVERT, "--max-file-size", "1MiB", tiny_pattern, out), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    journal = out / ".lucifer" / "journal.jsonl"
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None and not (
            journal.exists() and journal.read_text().count("\n") >= 3):
        time.sleep(0.002)
    assert proc.poll() is None, "the conversion ended before it could be stopped"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert "Traceback" not in err and "--resume" in err, err
    assert not list(out.rglob("*.partial")) and not (out / "COMPLETE").exists()
    r = run(*CONVERT, "--max-file-size", "1MiB", "--resume", tiny_pattern, out)
    assert r.exit_code == 0, r.output


def test_a_stop_just_after_a_rank_file_is_closed_does_not_close_it_again(tiny_pattern, tmp_path, monkeypatch):
    """The window CI's SIGTERM run above hit once (exit 70, EBADF): the stop lands as the writer's
    close(2) returns, before the writer forgets the descriptor; abort must not close it a second time
    (by then the number may be another thread's file)."""
    from lucifer_shard.engine import stwriter

    real_close, stopped = os.close, []

    def close(fd):
        real_close(fd)
        if not stopped and sys._getframe(1).f_code is stwriter.StreamWriter.close.__code__:
            stopped.append(fd)
            raise KeyboardInterrupt

    monkeypatch.setattr(os, "close", close)
    out = tmp_path / "out"
    r = run(*CONVERT, "--max-file-size", "1MiB", tiny_pattern, out)
    monkeypatch.undo()
    assert stopped and r.exit_code == 130, r.output
    assert not list(out.rglob("*.partial"))
    assert run(*CONVERT, "--max-file-size", "1MiB", "--resume", tiny_pattern, out).exit_code == 0


def _stopped_at_the_first_writer(first, tiny_pattern, out: Path, monkeypatch):
    """Convert, calling `first()` where the first rank file's writer is made (a stop it sends is recorded and
    raised at the next chunk, stops.check); the run must end as a SIGTERM stop: exit 143 and the --resume
    line. What `first()` returned (empty if it raised), and the run."""
    from lucifer_shard.engine import writeloop

    real, got = writeloop._open_writer, []

    def opened(*args, **kwargs):
        if not got:
            got.append(first())
        return real(*args, **kwargs)

    monkeypatch.setattr(writeloop, "_open_writer", opened)
    r = run(*CONVERT, "--max-file-size", "1MiB", tiny_pattern, out)
    assert r.exit_code == 143 and "--resume" in r.output, r.output
    return got, r


def test_a_stop_wrapped_by_python_is_still_the_stop(tiny_pattern, tmp_path, monkeypatch):
    """A SIGTERM that lands inside an import comes out as the RuntimeError of the class being built
    (seen once in torch's import, SIGTERM at a random time): exit 143 and the --resume line, not an internal error."""
    from lucifer_shard.stops import Terminated

    def wrapped():
        raise RuntimeError("Error calling __set_name__ on 'Field' instance") from Terminated()

    _, r = _stopped_at_the_first_writer(wrapped, tiny_pattern, tmp_path / "out", monkeypatch)
    assert "Traceback" not in r.output, r.output


def test_a_stop_inside_an_import_waits_for_the_import(tiny_pattern, tmp_path, monkeypatch):
    """A SIGTERM that lands inside an import is recorded, and the import runs to its end (raised there it is
    wrapped, or under torch's pybind11 import aborts the process: seen at random stop times); then it is
    the usual clean stop, raised at the next chunk."""
    (tmp_path / "slow_import.py").write_text(
        "import os, signal, time\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "end = time.monotonic() + 0.3\n"
        "while time.monotonic() < end:  # Python code runs here, where a raising handler would land\n"
        "    pass\n"
        "FINISHED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def slow_import():
        import slow_import
        return slow_import.FINISHED

    got, _ = _stopped_at_the_first_writer(slow_import, tiny_pattern, tmp_path / "out", monkeypatch)
    assert got == [True]


def test_a_stop_while_a_writer_is_made_leaves_no_temporary_file(tiny_pattern, tmp_path, monkeypatch):
    """The window the SIGTERM test above hit about one run in two: the stop lands after a rank file's
    temporary file is created but before its writer is kept (here: rank 1's sink of part 1)."""
    from lucifer_shard.engine import writeloop

    made = []

    class Sink(writeloop._RankSink):
        def __init__(self, writer, *args, **kwargs):
            made.append(writer.rel)
            if writer.rel == "target/rank-1/part-00001.safetensors":
                raise KeyboardInterrupt
            super().__init__(writer, *args, **kwargs)

    monkeypatch.setattr(writeloop, "_RankSink", Sink)
    out = tmp_path / "out"
    r = run(*CONVERT, "--max-file-size", "1MiB", tiny_pattern, out)
    assert r.exit_code == 130 and "target/rank-1/part-00001.safetensors" in made
    assert not list(out.rglob("*.partial"))
    monkeypatch.undo()
    assert run(*CONVERT, "--max-file-size", "1MiB", "--resume", tiny_pattern, out).exit_code == 0


@pytest.mark.parametrize("what", ["model-00003-of-00005.safetensors", "config.json", "tokenizer_config.json"])
def test_a_source_that_changes_while_converting_is_noticed(tiny_pattern, tmp_path, monkeypatch, what):
    """A shard, config.json or a tokenizer file rewritten (here: touched) while convert runs: refused
    before COMPLETE, exit 2, naming the file."""
    from lucifer_shard.engine import writeloop

    model = tmp_path / "model"
    shutil.copytree(tiny_pattern, model)
    real = writeloop._write_part
    calls = [0]

    def write_part(*a, **kw):
        calls[0] += 1
        if calls[0] == 2:
            st_ = (model / what).stat()
            os.utime(model / what, ns=(st_.st_atime_ns, st_.st_mtime_ns + 1_000_000_000))
        return real(*a, **kw)

    monkeypatch.setattr(writeloop, "_write_part", write_part)
    line = one_error(run(*CONVERT, model, tmp_path / "out"), alone=True)
    assert what in line and "changed while" in line, line
    assert not (tmp_path / "out" / "COMPLETE").exists()


def test_a_dangling_tokenizer_link_is_refused_by_name(tiny_pattern, tmp_path):
    """A broken Hugging Face blob link: the model would be served without its tokenizer."""
    model = tmp_path / "model"
    shutil.copytree(tiny_pattern, model)
    (model / "tokenizer.json").symlink_to("../blobs/0123abcd")
    line = one_error(run(*CONVERT, model, tmp_path / "out"), alone=True)
    assert "tokenizer.json" in line and "does not exist" in line, line


# ---------------------------------------------------------------- class 7: state of any shape


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=8),
                    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                    max_leaves=8)
DEEP = "[" * 5000 + "]" * 5000


def _shapes(keys: list[str]):
    """A JSON value, an object whose known keys hold anything, deep nesting, or bytes that are not UTF-8."""
    return st.one_of(JSON.map(json.dumps), st.fixed_dictionaries({k: JSON for k in keys}).map(json.dumps),
                     st.just(DEEP), st.just("\udcff\udcfe{"))


@PROPERTY
@given(text=_shapes(["pid", "host", "started"]))
@example(text=DEEP)
def test_a_lock_record_of_any_shape_is_not_a_crash(clean, tiny_pattern, work, text):
    out = unfinished_copy(clean, work())
    (out / ".lucifer" / "lock").write_bytes(text.encode("utf-8", "surrogateescape"))
    r = run(*CONVERT, "--resume", tiny_pattern, out)
    assert r.exit_code == 0, r.output


@PROPERTY
@given(line=_shapes(["path", "bytes", "digest", "tensors", "sources"]), at=st.integers(0, 60))
@example(line=DEEP, at=0)
def test_journal_lines_of_any_shape_are_redone_not_a_crash(clean, clean_contents, tiny_pattern, work, line, at):
    out = unfinished_copy(clean, work())
    journal = out / ".lucifer" / "journal.jsonl"
    lines = journal.read_text().splitlines(True)
    lines[at % len(lines)] = line.replace("\n", " ") + "\n"
    journal.write_bytes("".join(lines).encode("utf-8", "surrogateescape"))
    r = run(*CONVERT, "--resume", tiny_pattern, out)
    assert r.exit_code == 0, r.output
    assert contents(out)["lucifer-manifest.json"] == clean_contents["lucifer-manifest.json"]


@PROPERTY
@given(text=_shapes(["conversion_id", "source_fingerprint", "options", "tool_version", "source_files",
                     "side_files", "files"]))
def test_a_conversion_record_of_any_shape_is_one_line(clean, tiny_pattern, work, text):
    out = unfinished_copy(clean, work())
    (out / ".lucifer" / "conversion.json").write_bytes(text.encode("utf-8", "surrogateescape"))
    one_error(run(*CONVERT, "--resume", tiny_pattern, out), alone=True)


@pytest.mark.parametrize("rel,make", [
    ("target/rank-0", "file"), ("target/rank-1/part-00000.safetensors", "dir"), ("draft", "file"),
    (".lucifer/journal.jsonl", "dir"), (".lucifer/conversion.json", "dir"), ("config.json", "dir"),
])
def test_out_entries_of_the_wrong_type_on_resume_are_one_line(clean, tiny_pattern, tmp_path, rel, make):
    out = unfinished_copy(clean, tmp_path)
    p = out / rel
    shutil.rmtree(p) if p.is_dir() else p.unlink()
    p.mkdir() if make == "dir" else p.write_bytes(b"x")
    line = one_error(run(*CONVERT, "--resume", tiny_pattern, out), alone=True)
    assert rel in line, line
