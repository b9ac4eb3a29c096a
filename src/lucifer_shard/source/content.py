"""The content fingerprint of a source checkpoint: a BLAKE3 digest of every converted tensor's bytes,
computed from the reads convert and diff make anyway (no extra read).

A tensor's digest is BLAKE3 over its length and the BLAKE3 digests of its 1 MiB blocks, in order:

    blake3(le64(nbytes) || blake3(block 0) || blake3(block 1) || ...)

Blocks make it computable from reads that arrive in any order (convert reads a column-parallel
tensor as TP interleaved runs, diff in chunks of the sharded dim, both on several threads) while
holding only the blocks a read boundary cuts in two. A shard's digest is BLAKE3 over its converted
tensors' keys and digests in key order; the checkpoint's over the shards' names and digests.
"""
from __future__ import annotations

import threading
from collections import deque

import numpy as np
from blake3 import blake3

BLOCK = 1 << 20
ALGORITHM = "blake3 of 1 MiB block digests per tensor; per shard over (key, digest) in key order"


class TensorDigest:
    """One tensor's blocked digest, fed byte ranges in any order (each byte exactly once)."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.blocks: list[bytes | None] = [None] * -(-nbytes // BLOCK)
        self.missing = len(self.blocks)
        self._partial: dict[int, tuple[bytearray, int]] = {}  # block -> (bytes so far, how many)
        self._lock = threading.Lock()

    def feed(self, offset: int, data: np.ndarray) -> bool:
        """Bytes [offset, offset + len(data)) of the tensor (a uint8 array or buffer); True when they
        were the last bytes missing (for exactly one of the calls that complete the tensor)."""
        view = memoryview(data).cast("B")
        end = offset + len(view)
        if offset < 0 or end > self.nbytes:
            raise ValueError(f"bytes [{offset}, {end}) fed to a tensor of {self.nbytes}")
        last = False
        i = offset // BLOCK
        while i * BLOCK < end:
            lo, hi = max(offset, i * BLOCK), min(end, (i + 1) * BLOCK, self.nbytes)
            part = view[lo - offset:hi - offset]
            whole = min(BLOCK, self.nbytes - i * BLOCK)
            if len(part) == whole:
                last |= self._finish(i, blake3(part).digest())
            else:
                last |= self._add(i, lo - i * BLOCK, part, whole)
            i += 1
        return last

    def _add(self, i: int, at: int, part: memoryview, whole: int) -> bool:
        with self._lock:
            buf, have = self._partial.get(i) or (bytearray(whole), 0)
            buf[at:at + len(part)] = part
            have += len(part)
            if have < whole:
                self._partial[i] = (buf, have)
                return False
            self._partial.pop(i, None)
        if have > whole:
            raise ValueError(f"block {i} fed {have} bytes of {whole}: a byte range was read twice")
        return self._finish(i, blake3(buf).digest())

    def _finish(self, i: int, digest: bytes) -> bool:
        with self._lock:
            if self.blocks[i] is not None:
                raise ValueError(f"block {i} fed twice")
            self.blocks[i] = digest
            self.missing -= 1
            return self.missing == 0

    @property
    def done(self) -> bool:
        return self.missing == 0

    def hexdigest(self) -> str:
        if not self.done:
            raise ValueError(f"{self.missing} of {len(self.blocks)} block(s) not fed")
        h = blake3(self.nbytes.to_bytes(8, "little"))
        for b in self.blocks:
            h.update(b)
        return h.hexdigest()


class ContentDigests:
    """The digests of a set of tensors being read; thread-safe."""

    def __init__(self, sizes: dict[str, int]):
        self._tensors = {k: TensorDigest(n) for k, n in sizes.items()}
        self._completed: deque[str] = deque(k for k, n in sizes.items() if n == 0)

    def feed(self, key: str, offset: int, data: np.ndarray) -> None:
        if self._tensors[key].feed(offset, data):
            self._completed.append(key)

    def completed(self) -> list[str]:
        """The tensors completed since the last call."""
        out = []
        while self._completed:
            out.append(self._completed.popleft())
        return out

    def finished(self, keys=None) -> dict[str, str]:
        """key -> hex digest of the tensors (of `keys`, default all) every byte of which was fed."""
        keys = self._tensors if keys is None else keys
        return {k: self._tensors[k].hexdigest() for k in keys if self._tensors[k].done}


def shard_digests(digests: dict[str, str], shard_of: dict[str, str]) -> dict[str, str]:
    """shard -> digest over its tensors' (key, digest) in key order."""
    per: dict[str, blake3] = {}
    for key in sorted(digests):
        h = per.setdefault(shard_of[key], blake3())
        h.update(key.encode() + b"\0" + bytes.fromhex(digests[key]))
    return {shard: "blake3:" + h.hexdigest() for shard, h in sorted(per.items())}


def checkpoint_digest(shards: dict[str, str]) -> str:
    h = blake3()
    for name in sorted(shards):
        h.update(name.encode() + b"\0" + shards[name].encode() + b"\0")
    return "blake3:" + h.hexdigest()
