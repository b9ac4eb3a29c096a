"""A streaming safetensors writer: header first (known from the plan), then tensor bytes in order.

The safetensors library cannot write a file piece by piece, so this is the smallest correct
writer: the header lists tensors with contiguous data offsets in the order given, padded with
spaces to 8 bytes; bytes go to a temporary name, are flushed and fsynced, and the file is
renamed into place only when every byte was written. Each tensor is digested with BLAKE3 while
it streams; the file digest is BLAKE3 over the header and the tensor digests (so verifying a
file costs one pass over its data).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from blake3 import blake3

from .errors import OutputError
from .fsutil import fsync_dir
from .rules import DTYPE_SIZE


@dataclass(frozen=True)
class TensorHeader:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return DTYPE_SIZE[self.dtype] * int(np.prod(self.shape, dtype=np.int64))


def encode_header(tensors: list[TensorHeader], metadata: dict[str, str]) -> bytes:
    """The 8-byte length prefix and JSON header, deterministic for the same input."""
    header: dict = {"__metadata__": dict(sorted(metadata.items()))}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def file_digest(header: bytes, tensor_digests: list[str]) -> str:
    h = blake3(header)
    for d in tensor_digests:
        h.update(bytes.fromhex(d))
    return h.hexdigest()


def partial_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.partial")


@dataclass(frozen=True)
class WrittenFile:
    path: Path
    bytes: int
    digest: str
    tensor_digests: dict[str, str]


class StreamWriter:
    """Write one safetensors file tensor by tensor; `close()` publishes it atomically."""

    def __init__(self, path: Path, tensors: list[TensorHeader], metadata: dict[str, str]):
        self.path = Path(path)
        self.tensors = tensors
        self.header = encode_header(tensors, metadata)
        self.size = len(self.header) + sum(t.nbytes for t in tensors)
        self._tmp = partial_path(self.path)
        self._f = open(self._tmp, "wb")
        self._f.write(self.header)
        self._index = 0
        self._left = tensors[0].nbytes if tensors else 0
        self._hash = blake3(max_threads=blake3.AUTO)
        self.digests: dict[str, str] = {}

    def write(self, name: str, data: np.ndarray | bytes | memoryview) -> None:
        """Append bytes of tensor `name`, which must be the tensor being written."""
        view = memoryview(data).cast("B")
        current = self.tensors[self._index] if self._index < len(self.tensors) else None
        if current is None or current.name != name or len(view) > self._left:
            raise AssertionError(f"{self.path.name}: write of {len(view)} bytes for {name!r} out of order")
        try:
            self._f.write(view)
        except OSError as e:
            raise OutputError(f"{self._tmp}: write failed after {self._f.tell()} of {self.size} bytes "
                              f"({e.strerror}); free at least {self.size - self._f.tell()} bytes and run with --resume") from None
        self._hash.update(view)
        self._left -= len(view)
        while self._left == 0 and self._index < len(self.tensors):
            self.digests[current.name] = self._hash.hexdigest()
            self._hash = blake3(max_threads=blake3.AUTO)
            self._index += 1
            if self._index < len(self.tensors):
                current = self.tensors[self._index]
                self._left = current.nbytes

    def close(self) -> WrittenFile:
        if self._index != len(self.tensors):
            raise AssertionError(f"{self.path.name}: closed before {self.tensors[self._index].name} was written")
        try:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
        except OSError as e:
            raise OutputError(f"{self._tmp}: flush failed ({e.strerror}); free space and run with --resume") from None
        os.replace(self._tmp, self.path)
        fsync_dir(self.path.parent)
        digests = [self.digests[t.name] for t in self.tensors]
        return WrittenFile(self.path, self.size, file_digest(self.header, digests), dict(self.digests))

    def abort(self) -> None:
        if not self._f.closed:
            self._f.close()
        self._tmp.unlink(missing_ok=True)


def read_header(path: Path) -> tuple[bytes, dict]:
    """The raw header block (length prefix included) and its parsed JSON."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{path}: shorter than a safetensors header")
        n = int.from_bytes(prefix, "little")
        if n > 100 << 20:
            raise ValueError(f"{path}: header length {n} is not plausible")
        raw = f.read(n)
    if len(raw) != n:
        raise ValueError(f"{path}: truncated inside its header")
    return prefix + raw, json.loads(raw)


def hash_file(path: Path, block: int = 16 << 20) -> tuple[str, dict[str, str]]:
    """Recompute a file's digest and its tensors' digests exactly as StreamWriter records them."""
    header, doc = read_header(path)
    items = sorted(((v["data_offsets"], k) for k, v in doc.items() if k != "__metadata__"))
    digests: dict[str, str] = {}
    with open(path, "rb") as f:
        for (start, end), name in items:
            f.seek(len(header) + start)
            h = blake3(max_threads=blake3.AUTO)
            left = end - start
            while left:
                data = f.read(min(block, left))
                if not data:
                    raise ValueError(f"{path}: truncated inside tensor {name!r}")
                h.update(data)
                left -= len(data)
            digests[name] = h.hexdigest()
    return file_digest(header, [digests[k] for _, k in items]), digests
