"""The one reader of untrusted safetensors headers: source shards, rank files, the vLLM loader.

It accepts a subset of what the `safetensors` library accepts, so a file that passes here cannot
fail later in `safe_open` (tests/test_fuzz.py checks this against the library on corrupted
headers): UTF-8 JSON object; `__metadata__` absent, null or an object of strings; every other
key a tensor with exactly `dtype`, `shape` and `data_offsets`; shape and offsets non-negative
integers (not floats or booleans); offsets that hold exactly dtype x shape bytes; tensors that
tile the data section from byte 0 with no gap and no overlap; the data section ending at the end
of the file. Stricter than the library: duplicate keys (JSON keeps the last one silently),
unknown fields in an entry, and dtypes outside the V4-Flash set are refused.

Nothing is allocated from the header's claims: the length prefix is checked against the file's
real size before a byte is read, and sizes are computed with Python integers (no overflow).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..guarded_io import open_regular
from .dtypes import DTYPE_SIZE
from .schema import no_duplicate_keys, refuse_constant

MAX_HEADER_BYTES = 100_000_000  # the safetensors library's MAX_HEADER_SIZE
MAX_DIM = (1 << 63) - 1  # torch and numpy index with int64
MAX_ELEMENTS = (1 << 64) - 1  # safetensors multiplies shapes in u64 and refuses an overflow
ENTRY_FIELDS = ("data_offsets", "dtype", "shape")

# A rank file's identity stamp: its `__metadata__` keys (output/manifest.file_metadata writes them).
META_FORMAT = "lucifer.format"
META_CONVERSION_ID = "lucifer.conversion_id"
META_ROLE = "lucifer.role"
META_RANK = "lucifer.rank"
META_PART = "lucifer.part"
META_TP_SIZE = "lucifer.tp_size"
META_CONTENT = "lucifer.content"


class HeaderError(ValueError):
    """A safetensors file whose header cannot be trusted; one line naming the file (and tensor)."""

    def __init__(self, path: Path | str, reason: str, tensor: str | None = None):
        self.path = Path(path)
        self.reason = reason
        self.tensor = tensor
        super().__init__(f"{path}: {reason}")


@dataclass(frozen=True)
class HeaderEntry:
    """One tensor entry of a header; `start`/`end` are offsets in the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class Header:
    path: Path
    block: bytes  # the 8-byte length prefix and the JSON, as file digests cover them
    tensors: dict[str, HeaderEntry]  # in data order
    metadata: dict[str, str]
    file_size: int

    @property
    def data_start(self) -> int:
        return len(self.block)

    @property
    def data_end(self) -> int:
        """File offset where the last tensor ends (the data section's end)."""
        return self.data_start + max((t.end for t in self.tensors.values()), default=0)

    def size_problem(self) -> str | None:
        """Why the file's size disagrees with its header (truncated, or bytes after the data), or None."""
        if self.data_end > self.file_size:
            last = max(self.tensors.values(), key=lambda t: t.end)
            return (f"tensor {last.name!r} ends at byte {self.data_end} but the file has {self.file_size} bytes "
                    f"(truncated)")
        if self.data_end < self.file_size:
            return (f"{self.file_size - self.data_end} bytes follow the last tensor at byte {self.data_end} "
                    f"(trailing data; safetensors refuses such a file)")
        return None


def read_header(path: Path | str, whole: bool = True, fd: int | None = None) -> Header:
    """Read and validate the header of a safetensors file; with `whole`, its size must match too.
    `fd`: the file already opened through the guarded helpers (else `path` is opened, and must be
    a regular file: a link to one is followed, as in a Hugging Face cache).

    Raises HeaderError (a ValueError) for anything wrong in the file, OSError if it cannot be read,
    guarded_io.Refused if it is not a regular file."""
    path = Path(path)
    own = fd is None
    if own:
        fd = open_regular(path, follow=True)
    try:
        size = os.fstat(fd).st_size
        prefix = os.pread(fd, 8, 0)
        if len(prefix) < 8:
            raise HeaderError(path, f"{size} bytes, too short for a safetensors header")
        n = int.from_bytes(prefix, "little")
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise HeaderError(path, f"header length {n} exceeds the file ({size} bytes) or the safetensors limit "
                                    f"of {MAX_HEADER_BYTES} bytes")
        raw = b""
        while len(raw) < n and (more := os.pread(fd, n - len(raw), 8 + len(raw))):
            raw += more
    finally:
        if own:
            os.close(fd)
    if len(raw) != n:
        raise HeaderError(path, f"shrank to {8 + len(raw)} bytes while its header was read")
    return parse_header(path, prefix + raw, size, whole)


def parse_header(path: Path | str, block: bytes, size: int, whole: bool = True) -> Header:
    """Validate a header given as bytes (the 8-byte prefix and exactly the JSON it announces) of a file
    of `size` bytes: what `read_header` reads, or what ranged requests fetched of a file on the Hub."""
    path = Path(path)
    n = int.from_bytes(block[:8], "little") if len(block) >= 8 else -1
    if n < 0 or n > MAX_HEADER_BYTES or 8 + n > size or len(block) != 8 + n:
        raise HeaderError(path, f"header length {n} exceeds the file ({size} bytes) or the safetensors limit "
                                f"of {MAX_HEADER_BYTES} bytes")
    prefix, raw = block[:8], block[8:]
    doc = _parse(path, raw)
    meta = doc.pop("__metadata__", None)
    records = _records(path, doc)
    header = Header(path, prefix + raw, {t.name: t for t in records}, _metadata(path, meta), size)
    if whole and (problem := header.size_problem()):  # before the tiling: "truncated" says more than a gap
        raise HeaderError(path, problem)
    _check_tiling(path, records)
    return header


def _parse(path: Path, raw: bytes) -> dict:
    try:
        text = raw.decode("utf-8")  # strict: no BOM sniffing, no UTF-16 as json.loads(bytes) would allow
    except UnicodeDecodeError as e:
        raise HeaderError(path, f"header is not valid UTF-8 (byte {e.start})") from None
    try:
        doc = json.loads(text, object_pairs_hook=no_duplicate_keys, parse_constant=refuse_constant)
    except RecursionError:
        raise HeaderError(path, "header is not valid JSON (nested too deeply)") from None
    except ValueError as e:  # JSONDecodeError included
        raise HeaderError(path, f"header is not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise HeaderError(path, f"header is a JSON {type(doc).__name__}, not an object")
    return doc


def _is_uint(x: object, limit: int = MAX_DIM) -> bool:
    return type(x) is int and 0 <= x <= limit


def _utf8(path: Path, s: str, what: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate escape ("\ud800"): safetensors refuses it
        raise HeaderError(path, f"{what} {s!r} is not valid Unicode") from None


def _metadata(path: Path, meta: object) -> dict[str, str]:
    if meta is None:
        return {}
    if not isinstance(meta, dict):
        raise HeaderError(path, f"__metadata__ is a JSON {type(meta).__name__}, expected an object of strings")
    for k, v in meta.items():
        _utf8(path, k, "__metadata__ key")
        if not isinstance(v, str):
            raise HeaderError(path, f"__metadata__ {k!r} is a JSON {type(v).__name__}, expected a string")
        _utf8(path, v, f"__metadata__ {k!r} value")
    return meta


def _records(path: Path, doc: dict) -> list[HeaderEntry]:
    """Every tensor entry, validated on its own, in data order."""
    records = []
    for name, info in doc.items():
        _utf8(path, name, "tensor name")
        if not isinstance(info, dict) or sorted(info) != list(ENTRY_FIELDS):
            got = sorted(info) if isinstance(info, dict) else f"a JSON {type(info).__name__}"
            raise HeaderError(path, f"tensor {name!r}: entry must hold exactly dtype, shape and data_offsets "
                                    f"(found {got})", name)
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPE_SIZE:
            raise HeaderError(path, f"tensor {name!r} has dtype {dtype!r}, not one of {', '.join(DTYPE_SIZE)}", name)
        if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
            raise HeaderError(path, f"tensor {name!r} has shape {_short(shape)}, not a list of non-negative "
                                    f"integers", name)
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_uint(o) for o in offsets)
                and offsets[0] <= offsets[1]):
            raise HeaderError(path, f"tensor {name!r} has data_offsets {_short(offsets)}, not [start, end] with "
                                    f"0 <= start <= end", name)
        elements = _elements(shape)
        if elements is None:
            raise HeaderError(path, f"tensor {name!r} has shape {_short(shape)}, whose element count overflows "
                                    f"64 bits", name)
        nbytes = DTYPE_SIZE[dtype] * elements
        start, end = offsets
        if end - start != nbytes:
            raise HeaderError(path, f"tensor {name!r} data_offsets [{start}, {end}) hold {end - start} bytes, "
                                    f"{dtype}{_short(shape)} needs {nbytes}", name)
        records.append(HeaderEntry(name, dtype, tuple(shape), start, end))
    return sorted(records, key=lambda t: (t.start, t.end))


def _check_tiling(path: Path, records: list[HeaderEntry]) -> None:
    """Tensors cover the data section from byte 0 without gaps or overlaps, as safetensors requires."""
    at, prev = 0, None
    for t in records:
        if t.start < at:
            raise HeaderError(path, f"tensors {prev.name!r} and {t.name!r} overlap at bytes [{t.start}, "
                                    f"{min(at, t.end)}) of the data section", t.name)
        if t.start > at:
            where = (f"between tensors {prev.name!r} and {t.name!r}" if prev
                     else f"before tensor {t.name!r}, at the start of the data section,")
            raise HeaderError(path, f"bytes [{at}, {t.start}) {where} belong to no tensor (safetensors allows "
                                    f"no gaps)", t.name)
        at, prev = t.end, t


def _elements(shape: list[int]) -> int | None:
    """The product of the dims, or None once it passes MAX_ELEMENTS (as safetensors' checked
    multiply; stopping there also keeps a long list of huge dims from costing quadratic time)."""
    n = 1
    for d in shape:
        n *= d
        if n > MAX_ELEMENTS:
            return None
    return n


def _short(value: object, limit: int = 80) -> str:
    """A value from the header, shortened for a one-line message."""
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
