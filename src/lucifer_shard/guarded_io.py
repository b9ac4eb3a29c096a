"""The few guarded doors through which lucifer-shard opens, writes, renames and deletes files.

Every other module reaches the filesystem through these (tests/test_architecture.py checks that no
other module calls `open`, `os.open`, `unlink`, `rmtree`, `rename` or `replace` itself). The rules:

* Reading: only a regular file is opened (a FIFO would block the reader forever, a device would
  feed it until MemoryError), it is checked with `stat` before it is opened and with `fstat` after
  (so a swap in between is seen), and whole-file reads are bounded (`read_regular(limit=...)`).
  Inputs the user names (MODEL and its files, which in a Hugging Face cache are symlinks to blobs)
  may be links (`follow=True`); files of an output never are.
* Writing under a root (OUT): the root is the directory the user named; every path below it is
  walked one component at a time with `O_NOFOLLOW | O_DIRECTORY` and `dir_fd`, so no symlink is
  followed and no filesystem boundary (another `st_dev`, a mount) is crossed; files are created
  with `O_EXCL | O_NOFOLLOW` under a temporary name and renamed into place in the same directory
  (`publish`), and an existing file is reused (the journal, the lock) only when it is a regular
  file with one link (a hard link to a file elsewhere would otherwise be truncated through OUT).
* Deleting: only a regular file, or an empty real directory, reached the same way (`remove`,
  `remove_dir`); what to delete is the caller's list, never "everything in a folder".

A refusal is `Refused` (exit 2): one line naming the path, what it is and what to do.
"""
from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath

from .errors import SAME_COMMAND, LuciferError

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC
# Bounds of whole-file reads: JSON documents of a checkpoint or an output, and our own state.
# Every file the tool writes is created like an ordinary file (0666 & ~umask, as `open` and `cp`
# make them), whatever it holds: an output is read by a serving user, often not its writer.
FILE_MODE = 0o666
JSON_LIMIT = 64 << 20  # config.json, index, manifest, tokenizer files are far below this
STATE_LIMIT = 256 << 20  # the journal of a full-size conversion, with room to spare


class Refused(LuciferError):
    """A path the guarded helpers will not open, write or delete; the message says why."""

    kind = "refused"


def kind(mode: int) -> str:
    """What a file mode is, in words ('a symlink', 'a FIFO', ...)."""
    for test, word in ((stat.S_ISLNK, "a symlink"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISREG, "a regular file")):
        if test(mode):
            return word
    return "not a regular file"


def _not_regular(path: Path | str, mode: int) -> Refused:
    return Refused(f"{path}: is {kind(mode)}, not a regular file; replace it with the file itself")


# ---------------------------------------------------------------- reading


def open_regular(path: Path | str, follow: bool = False, flags: int = 0, dir_fd: int | None = None,
                 shown: Path | str | None = None) -> int:
    """A read-only descriptor of the regular file at `path` (`flags` added, e.g. O_DIRECT; `path`
    relative to `dir_fd` if given; `shown`: the name errors use). With `follow=False` a symlink at
    `path` itself is refused. Raises Refused for anything but a regular file, FileNotFoundError
    when nothing is there (a dangling link included)."""
    shown = path if shown is None else shown
    st = os.stat(path, dir_fd=dir_fd, follow_symlinks=follow)
    if not stat.S_ISREG(st.st_mode):
        raise _not_regular(shown, st.st_mode)
    # O_NONBLOCK: should a FIFO be swapped in after the stat, opening it does not wait for a writer.
    # A regular file under a lease (Samba, NFS servers, a test) answers EAGAIN to that: wait for it.
    flags |= os.O_RDONLY | _CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags | os.O_NONBLOCK, dir_fd=dir_fd)
    except BlockingIOError:
        fd = os.open(path, flags, dir_fd=dir_fd)
    try:
        now = os.fstat(fd)
        if not stat.S_ISREG(now.st_mode) or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            raise Refused(f"{shown}: was replaced while being opened",
                          remedy=SAME_COMMAND.after("wait until nothing else writes it"))
        os.set_blocking(fd, True)
        return fd
    except BaseException:
        os.close(fd)
        raise


def read_fd(fd: int, limit: int, name: Path | str) -> bytes:
    """All bytes of the open regular file `fd`, at most `limit` (a larger or growing file is refused)."""
    with naming(name):
        return _read_fd(fd, limit, name)


def _read_fd(fd: int, limit: int, name: Path | str) -> bytes:
    size = os.fstat(fd).st_size
    if size > limit:
        raise Refused(f"{name}: {size:,} bytes, more than the {limit:,} this file may have; it is not the "
                      f"file it should be")
    chunks, got = [], 0
    while True:
        data = os.pread(fd, min(1 << 20, limit + 1 - got), got)
        if not data:
            return b"".join(chunks)
        chunks.append(data)
        got += len(data)
        if got > limit:
            raise Refused(f"{name}: grew past {limit:,} bytes while being read",
                          remedy=SAME_COMMAND.after("wait until nothing writes it"))


def read_regular(path: Path | str, limit: int = JSON_LIMIT, follow: bool = False) -> bytes:
    """The bytes of the regular file `path`, at most `limit` of them (see `open_regular`)."""
    fd = open_regular(path, follow)
    try:
        return read_fd(fd, limit, path)
    finally:
        os.close(fd)


@contextmanager
def reading(path: Path | str, follow: bool = False) -> Iterator:
    """A binary file object over the regular file `path` (for streaming reads: hashing, headers)."""
    with os.fdopen(open_regular(path, follow), "rb") as f:
        yield f


def probe(path: Path | str) -> os.stat_result | None:
    """`lstat` of `path`, None when nothing is there (links are not followed)."""
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


# ---------------------------------------------------------------- a real tree under a root


def _parts(rel: str | PurePosixPath) -> tuple[str, ...]:
    parts = PurePosixPath(rel).parts
    if PurePosixPath(rel).is_absolute() or any(p in ("..", ".") for p in parts):
        raise ValueError(f"{rel!r}: not a plain relative path")  # a caller's bug, not an input
    return parts


class Tree:
    """A directory the user named (`root`, which may itself be reached through a link), and the
    real directories below it on the same filesystem. Paths are relative to the root, '/'-joined."""

    def __init__(self, root: Path | str):
        self.root = Path(root)

    def path(self, rel: str | PurePosixPath) -> Path:
        return self.root.joinpath(*_parts(rel))

    # -- walking

    @contextmanager
    def directory(self, rel: str | PurePosixPath = "", create: bool = False) -> Iterator[int]:
        """A descriptor of the real directory `rel` under the root (made, with its parents, when
        `create`). Refused: a component that is a symlink or not a directory, or on another filesystem."""
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
        try:
            dev = os.fstat(fd).st_dev
            done: list[str] = []
            for name in _parts(rel):
                done.append(name)
                try:
                    sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    try:
                        os.mkdir(name, 0o777, dir_fd=fd)
                    except FileExistsError:
                        pass  # made by someone else meanwhile: checked by the open below
                    sub = self._open_dir(name, fd, done)
                except OSError as e:
                    if e.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise self._refuse_entry(fd, name, done) from None
                    raise
                fd, parent = sub, fd  # swapped before the close: a stop landing after it closes `sub` only
                os.close(parent)
                if os.fstat(fd).st_dev != dev:
                    raise Refused(f"{self.path('/'.join(done))}: is another filesystem mounted inside "
                                  f"{self.root}; lucifer-shard does not write or delete across it, unmount it "
                                  f"or choose another OUT")
            yield fd
        finally:
            os.close(fd)

    def _open_dir(self, name: str, parent: int, done: list[str]) -> int:
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=parent)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                raise self._refuse_entry(parent, name, done) from None
            raise

    def _refuse_entry(self, parent: int, name: str, done: list[str]) -> Refused:
        mode = os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode
        return Refused(f"{self.path('/'.join(done))}: is {kind(mode)} where lucifer-shard keeps a directory; "
                       f"it does not follow links or replace what it did not make, move it away")

    def make_dirs(self, rel: str | PurePosixPath) -> None:
        """Make the real directory `rel` and its parents (see `directory`)."""
        with self.directory(rel, create=True):
            pass

    @contextmanager
    def _in_parent(self, rel: str | PurePosixPath, create: bool = False) -> Iterator[tuple[int, str]]:
        parts = _parts(rel)
        with self.directory("/".join(parts[:-1]), create) as fd:
            yield fd, parts[-1]

    def entries(self, rel: str | PurePosixPath = "") -> dict[str, os.stat_result]:
        """name -> lstat of every entry of the real directory `rel` (empty when it does not exist)."""
        try:
            with self.directory(rel) as fd:
                return {e.name: e.stat(follow_symlinks=False) for e in os.scandir(fd)}
        except FileNotFoundError:
            return {}

    def lstat(self, rel: str | PurePosixPath) -> os.stat_result | None:
        """lstat of `rel` reached through real directories, None when it (or a parent) is missing."""
        try:
            with self._in_parent(rel) as (fd, name):
                return os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    # -- reading

    def read(self, rel: str | PurePosixPath, limit: int = STATE_LIMIT) -> bytes:
        """The bytes of the regular file `rel` (no link followed), at most `limit`."""
        with self._in_parent(rel) as (fd, name):
            f = open_regular(name, dir_fd=fd, shown=self.path(rel))
        try:
            return read_fd(f, limit, self.path(rel))
        finally:
            os.close(f)

    def open_read(self, rel: str | PurePosixPath, flags: int = 0) -> int:
        """A read-only descriptor of the regular file `rel` (`flags` added, e.g. O_DIRECT)."""
        with self._in_parent(rel) as (fd, name):
            return open_regular(name, dir_fd=fd, flags=flags, shown=self.path(rel))

    # -- writing

    def open_new(self, rel: str | PurePosixPath, flags: int = 0) -> int:
        """A write-only descriptor of a new regular file `rel` (an existing one is an error:
        FileExistsError), parents made. For files published later by `rename` (StreamWriter)."""
        with self._in_parent(rel, create=True) as (fd, name):
            return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC | flags, FILE_MODE,
                           dir_fd=fd)

    def open_own(self, rel: str | PurePosixPath, flags: int) -> int:
        """A descriptor of the regular file `rel`, created when missing (`flags`: O_RDWR, O_APPEND...).
        An existing one is used only when it is a regular file with a single link (never a symlink,
        a FIFO, or a hard link to a file elsewhere)."""
        with self._in_parent(rel, create=True) as (fd, name):
            there = _lstat_at(name, fd)
            if there is not None and not stat.S_ISREG(there.st_mode):  # not even opened: a device may act on it
                raise _not_regular(self.path(rel), there.st_mode)
            try:
                f = os.open(name, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC, FILE_MODE, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
                    raise _not_regular(self.path(rel), os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode) \
                        from None
                raise
        try:
            st = os.fstat(f)
            if not stat.S_ISREG(st.st_mode):
                raise _not_regular(self.path(rel), st.st_mode)
            if st.st_nlink != 1:
                raise Refused(f"{self.path(rel)}: has {st.st_nlink} hard links; lucifer-shard does not write a "
                              f"file that is also elsewhere, remove it")
            os.set_blocking(f, True)
            return f
        except BaseException:
            os.close(f)
            raise

    def rename(self, src: str | PurePosixPath, dst: str | PurePosixPath) -> None:
        """Rename `src` to `dst` in the same real directory, atomically replacing a regular file
        (never a directory, a link is replaced as a name, not followed)."""
        s, d = PurePosixPath(src), PurePosixPath(dst)
        if s.parent != d.parent:
            raise ValueError(f"{src} -> {dst}: renames stay in one directory")
        with self.directory(s.parent if s.parent.parts else "") as fd:
            there = _lstat_at(d.name, fd)
            if there is not None and stat.S_ISDIR(there.st_mode):
                raise Refused(f"{self.path(dst)}: is a directory where lucifer-shard writes a file; move it away")
            os.replace(s.name, d.name, src_dir_fd=fd, dst_dir_fd=fd)
            os.fsync(fd)

    def publish(self, rel: str | PurePosixPath, write: Callable[[int], None]) -> None:
        """Make `rel` hold what `write(fd)` writes, all or nothing: into a new hidden temporary file,
        fsynced, renamed over `rel`, the directory fsynced. A failure leaves no temporary file."""
        tmp = partial_name(rel)
        self.remove(tmp)  # left by a crash of an earlier run
        fd = self.open_new(tmp)
        try:
            try:
                with naming(self.path(tmp)):
                    write(fd)
                    os.fsync(fd)
            finally:
                os.close(fd)
        except BaseException:
            self.remove(tmp)
            raise
        self.rename(tmp, rel)

    def write_bytes(self, rel: str | PurePosixPath, data: bytes) -> None:
        """`publish` these bytes."""
        self.publish(rel, lambda fd: write_all(fd, data))

    def copy_in(self, src: Path | str, rel: str | PurePosixPath, limit: int = JSON_LIMIT) -> None:
        """`publish` a copy of the regular file `src` (which may be reached through links: an input)."""
        self.write_bytes(rel, read_regular(src, limit, follow=True))

    def link_in(self, src: "Tree", rel: str | PurePosixPath) -> None:
        """Make `rel` a hard link to the regular file `rel` of `src` (both reached through real
        directories, no link followed; parents made here). FileExistsError when `rel` exists; OSError
        EXDEV when the two are on different filesystems (the caller copies then)."""
        with src._in_parent(rel) as (sfd, name):
            st = _lstat_at(name, sfd)
            if st is None:
                raise FileNotFoundError(errno.ENOENT, "no such file", str(src.path(rel)))
            if not stat.S_ISREG(st.st_mode):
                raise _not_regular(src.path(rel), st.st_mode)
            with self._in_parent(rel, create=True) as (dfd, _):
                os.link(name, name, src_dir_fd=sfd, dst_dir_fd=dfd, follow_symlinks=False)
                os.fsync(dfd)

    # -- deleting

    def remove(self, rel: str | PurePosixPath) -> bool:
        """Delete the regular file `rel` if it is there (True when it was); anything else there
        (a symlink, a directory, a FIFO) is refused, not deleted."""
        try:
            with self._in_parent(rel) as (fd, name):
                st = _lstat_at(name, fd)
                if st is None:
                    return False
                if not stat.S_ISREG(st.st_mode):
                    raise Refused(f"{self.path(rel)}: is {kind(st.st_mode)} where lucifer-shard wrote a file; it "
                                  f"does not delete what it did not write, move it away")
                os.unlink(name, dir_fd=fd)
                return True
        except FileNotFoundError:
            return False

    def remove_dir(self, rel: str | PurePosixPath) -> bool:
        """Remove the real directory `rel` if it is there and empty (True when it was removed)."""
        try:
            with self._in_parent(rel) as (fd, name):
                st = _lstat_at(name, fd)
                if st is None or not stat.S_ISDIR(st.st_mode):
                    return False
                os.rmdir(name, dir_fd=fd)
                return True
        except FileNotFoundError:
            return False
        except OSError as e:
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
                return False
            raise


def _lstat_at(name: str, dir_fd: int) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def partial_name(rel: str | PurePosixPath) -> str:
    """The hidden temporary name a file is written under before it is renamed into place."""
    p = PurePosixPath(rel)
    return str(p.with_name(f".{p.name}.partial"))


def write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


@contextmanager
def naming(path: Path | str) -> Iterator[None]:
    """An OSError raised inside without a file name (os.read, write, fsync on a descriptor) gets
    `path`: every error line names the file it is about."""
    try:
        yield
    except OSError as e:
        if e.filename is not None or e.errno is None:
            raise
        raise OSError(e.errno, e.strerror, str(path)) from None  # the subclass of the errno (FileNotFoundError...)


def mount_points() -> set[str]:
    """Every mount point of this process's mount namespace (/proc/self/mountinfo; empty without /proc)."""
    try:
        text = read_regular("/proc/self/mountinfo", limit=STATE_LIMIT, follow=True).decode(errors="replace")
    except (OSError, Refused):
        return set()
    points = set()
    for line in text.splitlines():
        fields = line.split(" ")
        if len(fields) > 4:  # the 5th field, with spaces and the like as octal escapes
            points.add(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[4]))
    return points


def remove_empty_dir(path: Path | str) -> None:
    """Remove the directory `path` this process made, if it is still an empty real directory."""
    try:
        os.rmdir(path)  # refuses a link (ENOTDIR) and a non-empty directory
    except OSError:
        pass
