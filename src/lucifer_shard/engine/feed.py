"""How the source's files reach the disk while convert writes: the three routes of a conversion.

* On disk already (a local checkpoint, or a repo whose files are all in the Hugging Face cache at
  the commit): read in place, nothing downloaded, nothing removed.
* Streamed (a repo id, the default): each shard is downloaded into the tool's download folder
  (`source.hub.DownloadFolder`: OUT/.lucifer/download, or --download-dir) just before the first part
  that reads it (over several ranged connections at once, or hf_xet: `source.hub.download_resumed`),
  checked against the Hub's SHA-256 and against the header the plan read by a ranged
  request (`Checkpoint.check_header`), and removed once no later part reads it; the
  parts are written in the order that holds fewest shards at once (`source.streaming`), and one
  downloader thread runs ahead of the conversion as far as that many bytes allow, so the folder
  holds a few shards at a time (`peak_bytes`, which the room check counts), not the checkpoint.
* Kept (--keep-source): the whole checkpoint is downloaded into the Hugging Face cache first
  (huggingface_hub's own location and settings) and read in place; it stays there.

Every route starts under OUT's lock, after every refusal and room check: nothing is downloaded
before convert knows it will write.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from .. import stops
from ..errors import Remedy
from ..outnames import STATE_DIR
from ..source.checkpoint import download_whole
from ..source.streaming import peak_bytes, stream_order
from ..units import rate, size
from .diskspace import check_room, existing, filesystem
from .job import Job, Part, part_keys

logger = logging.getLogger("lucifer_shard.convert")
DOWNLOAD_REL = f"{STATE_DIR}/download"  # the default download folder, inside OUT's state folder
WAIT_POLL_S = 0.05  # how often the conversion looks whether the shards it waits for are in


def part_files(job: Job, part: Part) -> list[str]:
    """The source shards a part reads, in shard order."""
    return shards_read(job.specs, part, {k: e.file for k, e in job.ckpt.tensors.items()})


def shards_read(specs: dict, part: Part, shard_of: dict[str, str]) -> list[str]:
    """The shards (`shard_of`: source key -> shard file) whose tensors `part` reads, in shard order."""
    by_name = {s.name: s for s in specs[part.role][0]}
    return sorted({shard_of[k] for k in part_keys(by_name, part)})


def job_files(job: Job, parts: list[Part]) -> dict[int, list[str]]:
    return {id(p): part_files(job, p) for p in parts}


class SourceFeed:
    """The route of `job`'s source (module docstring) over `parts`, which it writes in `order` (streamed:
    the one that holds fewest shards at once; else as given)."""

    def __init__(self, job: Job, out: Path, parts: list[Part], download_dir: Path | None, keep: bool):
        self.job, self.out = job, Path(out)
        self.keep = keep and job.ckpt.hub is not None
        self.stream = job.ckpt.hub is not None and not keep
        self.order = stream_order(parts, job_files(job, parts), job.ckpt.files) if self.stream else list(parts)
        self.root = Path(download_dir) if download_dir is not None else self.out / DOWNLOAD_REL
        self.folder = None
        self.bar = None
        self._downloads: _Downloads | None = None
        self.started = time.perf_counter()
        self._done = 0  # bytes downloaded, for the progress line
        self._needed = {f: i for i, p in enumerate(self.order) for f in part_files(job, p)} if self.stream else {}
        self.peak = (peak_bytes(self.order, job_files(job, self.order), job.ckpt.files) + sum(job.ckpt.side.values())
                     if self.stream else 0)

    def to_download(self) -> int:
        """Bytes this run downloads."""
        if self.keep:
            return sum(self.job.ckpt.files.values()) + sum(self.job.ckpt.side.values())
        return sum(self.job.ckpt.files[f] for f in self._needed) + sum(self.job.ckpt.side.values()) if self.stream else 0

    def check_room(self, out_left: list[int], given_back: int, then: Remedy) -> None:
        """The download's room: on OUT's filesystem together with what convert writes there, else on
        its own; the error names the filesystem and the bytes each needs."""
        if not (self.stream or self.keep):
            return
        if self.stream:  # the folder held for this run before OUT changes: a second run naming it is refused now
            from ..source.hub import DownloadFolder

            self.folder = DownloadFolder(self.job.ckpt.hub, self.root, self._report)
            self.folder.lock()
        if self.keep:
            from huggingface_hub import constants

            where, need = Path(constants.HF_HUB_CACHE), self.to_download()
            what = "the whole checkpoint, kept in the Hugging Face cache (--keep-source)"
        else:
            where, need = self.root, self.peak
            what = "source shards on disk at once while streaming"
        logger.info("download: %s to %s, at most %s on disk at once (%s)", size(self.to_download()), where,
                    size(need), filesystem(where))
        if os.stat(existing(where)).st_dev == os.stat(existing(self.out)).st_dev:
            check_room(self.out, [*out_left, need], given_back, then,
                       what=f"rank files, manifest and copies, and {size(need)} of {what}")
        else:
            check_room(where, [need], 0, then, what=what,
                       instead=f"choose another {'HF_HUB_CACHE' if self.keep else '--download-dir'}")

    def start(self, bar) -> None:
        """Before the first part: the kept checkpoint downloaded (then read in place), or the download
        folder opened and the config/tokenizer files fetched (they are copied into OUT at the end)."""
        self.bar = bar
        if self.keep:
            self._keep()
        elif self.stream:
            self.folder.claim()
            for name in self.job.ckpt.side:  # joined in slices: a stalled link never holds a stop
                stops.joined(lambda name=name: self.folder.fetch(name), "lucifer-download")
            first: dict[str, int] = {}
            for i, part in enumerate(self.order):
                for f in part_files(self.job, part):
                    first.setdefault(f, i)
            for name in set(self.job.ckpt.files) - set(first):  # a stopped run's shards only kept parts read
                self.folder.remove(name)
            self._downloads = _Downloads(self.folder, first, self.job.ckpt.files, self.peak,
                                         self.job.ckpt.check_header)

    def before(self, index: int) -> None:
        """Part `index` of the order is next: wait until the downloader has brought its shards (its
        error, a tampered shard or the Hub gone, is this run's)."""
        if self._downloads is not None:
            self._downloads.wait_for(index, part_files(self.job, self.order[index]))

    def after(self, index: int) -> None:
        """Part `index` of the order is written: remove each shard no later part reads."""
        if self._downloads is not None:
            self._downloads.release([f for f, last in self._needed.items() if last == index])

    def finish(self) -> None:
        """The conversion is complete: remove what is left of the download, and the folder."""
        if self.folder is not None:
            self.folder.close([*self.job.ckpt.files, *self.job.ckpt.side])

    def close(self, wait: bool = True) -> None:
        """The downloader stopped: its shard in flight finished (or removed by `fetch`), so that nothing
        writes into the folder after this; not on Ctrl-C (`wait` False): the process is leaving, and
        its daemon thread with it (the next run continues the file where it stopped)."""
        if self._downloads is not None:
            self._downloads.stop(wait)
            self._downloads = None
        if self.folder is not None:
            self.folder.release()

    def summary(self) -> str | None:
        if self.folder is None or not self.folder.downloaded:
            return None
        return (f"downloaded {size(self.folder.downloaded)} in {self.folder.seconds:.1f} s "
                f"({rate(self.folder.downloaded / max(self.folder.seconds, 1e-9))}); at most "
                f"{size(self.peak)} of the source on disk at once")

    def _report(self, n: int) -> None:
        """One progress line: the conversion's bar, with the download's bytes, rate and what is left."""
        if self.bar is None or self.folder is None:
            return
        self._done += n
        took = max(time.perf_counter() - self.started, 1e-9)
        self.bar.set_postfix_str(f"download {size(self._done)}/{size(self.to_download())} at "
                                 f"{rate(self._done / took)}", refresh=False)
        self.bar.refresh()

    def _keep(self) -> None:
        """Download the whole checkpoint into the Hugging Face cache, then read it in place."""
        self.job.ckpt = download_whole(self.job.ckpt, tuple(self.job.specs))


class _Downloads:
    """The shards downloaded one after the other on a daemon thread, in the order the parts first read
    them, as far ahead of the conversion as `budget` bytes on disk allow (a shard the part being
    written needs goes regardless): the network never waits for the disk or the other way round
    while there is room. A daemon thread: a pool's would hold Ctrl-C until a shard finished."""

    def __init__(self, folder, first: dict[str, int], sizes: dict[str, int], budget: int,
                 check: Callable[[str], None]):
        self.folder, self.first, self.sizes, self.budget = folder, first, sizes, budget
        self.check = check  # a downloaded shard's header is the plan's (Checkpoint.check_header)
        self.ready: set[str] = set()
        self.on_disk = 0
        self.current = 0  # the part being written
        self.error: BaseException | None = None
        self.stopped = False
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="lucifer-download", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for name in sorted(self.first, key=lambda f: (self.first[f], f)):
                with self.cond:
                    while (not self.stopped and self.first[name] > self.current
                           and self.on_disk + self.sizes[name] > self.budget):
                        self.cond.wait()
                    if self.stopped:
                        return
                self.folder.fetch(name)
                self.check(name)
                with self.cond:
                    self.ready.add(name)
                    self.on_disk += self.sizes[name]
                    self.cond.notify_all()
        except BaseException as e:  # handed to the converting thread by `wait_for`
            with self.cond:
                self.error = e
                self.cond.notify_all()

    def wait_for(self, index: int, names: list[str]) -> None:
        with self.cond:
            self.current = index
            self.cond.notify_all()
        # polled in slices, the stop flag checked after each: a download stalled on the network, or waiting out
        # a read timeout, never holds a stop (the daemon thread ends with the process; its bytes are resumed)
        while True:
            stops.check()
            with self.cond:
                if self.error is not None:
                    raise self.error
                if set(names) <= self.ready:
                    return
            time.sleep(WAIT_POLL_S)

    def release(self, names: list[str]) -> None:
        for name in names:
            self.folder.remove(name)
            with self.cond:
                self.ready.discard(name)
                self.on_disk -= self.sizes[name]
                self.cond.notify_all()

    def stop(self, wait: bool) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
        if wait:
            self.thread.join()
