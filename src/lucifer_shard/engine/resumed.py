"""The source digests of the parts `--resume` keeps, computed again from the source.

The journal records each part's source tensor digests, and the manifest's content digest is built
from them; copying them unchecked would let one edited hex digit in the journal give a COMPLETE
output whose content digest blames an unchanged source. So the kept parts' source tensors are
read once more (sequential reads, no rank file written) and hashed as convert hashes them."""
from __future__ import annotations

import os

from pathlib import Path

from ..errors import SourceError
from ..formats.stheader import META_CONTENT, HeaderError, read_header
from ..guarded_io import open_regular
from ..output.manifest import part_content
from ..source.checkpoint import Checkpoint
from ..source.content import ContentDigests
from .assemble import read_failed
from .journal import JournalEntry

BLOCK = 16 << 20


def resumed_sources(ckpt: Checkpoint, keys: list[str]) -> dict[str, str]:
    """key -> content digest (`source.content`) of these source tensors, read from their shards."""
    entries = [ckpt.tensors[k] for k in dict.fromkeys(keys)]
    digests = ContentDigests({e.key: e.offsets[1] - e.offsets[0] for e in entries})
    by_file: dict[str, list] = {}
    for e in entries:
        by_file.setdefault(e.file, []).append(e)
    for file, group in by_file.items():
        fd = open_regular(ckpt.root / file, follow=True)
        try:
            for e in sorted(group, key=lambda e: e.offsets[0]):
                base = ckpt.data_start[file] + e.offsets[0]
                done = 0
                while done < e.offsets[1] - e.offsets[0]:
                    try:
                        data = os.pread(fd, min(BLOCK, e.offsets[1] - e.offsets[0] - done), base + done)
                    except OSError as err:
                        raise read_failed(ckpt.root / file, e.key, err) from None
                    if not data:
                        raise SourceError(f"{file}: truncated inside tensor {e.key!r}; re-download this shard")
                    digests.feed(e.key, done, memoryview(data))
                    done += len(data)
        finally:
            os.close(fd)
    return digests.finished()


def stamped_sources(out: Path, journaled: dict[str, JournalEntry], candidates: list) -> dict[str, str]:
    """The journaled source digests of the `candidates` (part, its rank file paths) whose first rank
    file carries the content stamp those digests give (`part_content`): a journal edited elsewhere
    keeps no part, since a stamp is BLAKE3 over the digests and the file's own digest covers its
    stamp. For a source that is not read again (on the Hub, pinned by its SHA-256s)."""
    sources: dict[str, str] = {}
    for _, paths in candidates:
        entry = journaled[paths[0]]
        try:
            stamp = read_header(Path(out) / paths[0]).metadata.get(META_CONTENT)
        except (OSError, HeaderError):
            continue
        if stamp == part_content(entry.sources):
            sources.update(entry.sources)
    return sources
