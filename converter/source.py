"""The source checkpoint: model resolution, header validation, fingerprint and region reads.

Headers are parsed directly (8-byte length + JSON) so that a damaged shard is named precisely
(truncated, overlapping or out-of-range offsets, oversized header) before any data is read;
tensor data is then read through `safetensors.safe_open`, opened read-only.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from safetensors import safe_open

from .config import ModelConfig, load_config
from .errors import SourceError
from .rules import DTYPE_SIZE, ROLES, check_source_keys

if TYPE_CHECKING:  # torch is loaded by safetensors' "pt" framework when data is read
    import torch

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit
# Files copied byte-identical into the output next to config.json.
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "tokenizer.model", "chat_template.jinja")


def resolve_model(model: str, weights: bool = True) -> Path:
    """A local directory, or a Hugging Face repo id resolved through huggingface_hub's cache.

    With `weights=False` only config.json is fetched, so a plan can be made before downloading.
    HF_HUB_OFFLINE and the cache location are honoured by huggingface_hub itself.
    """
    path = Path(model)
    if path.is_dir():
        return path
    if path.exists() or model.startswith((".", "/")) or model.count("/") != 1:
        raise SourceError(f"{model}: not a model directory (expected a directory with config.json, or a repo id owner/name)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    patterns = ["config.json"] if not weights else ["*.json", "*.safetensors", "tokenizer*", "*.jinja"]
    try:
        return Path(snapshot_download(model, allow_patterns=patterns))
    except LocalEntryNotFoundError:
        raise SourceError(f"{model}: not in the local Hugging Face cache and the hub is unreachable or offline "
                          f"(HF_HUB_OFFLINE); download it first or pass a local directory") from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise SourceError(f"{model}: cannot resolve on the Hugging Face hub ({type(e).__name__}: {e})") from None


@dataclass(frozen=True)
class TensorEntry:
    key: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    offsets: tuple[int, int]


@dataclass
class Checkpoint:
    """A validated source checkpoint. Reads go through safetensors, one handle per shard."""

    root: Path
    config: ModelConfig
    tensors: dict[str, TensorEntry]
    files: dict[str, int]  # shard name -> size in bytes
    fingerprint: str
    _handles: dict = field(default_factory=dict, repr=False)

    def handle(self, file: str):
        h = self._handles.get(file)
        if h is None:
            h = self._handles[file] = safe_open(str(self.root / file), framework="pt")
        return h

    def read(self, key: str, box: tuple[slice, ...]) -> torch.Tensor:
        """The region `box` of tensor `key` (element indices), as stored."""
        entry = self.tensors[key]
        t = self.handle(entry.file).get_slice(key)[box]
        return t

    def close(self) -> None:
        self._handles.clear()


def _read_header(path: Path) -> tuple[dict, bytes, int]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SourceError(f"{path.name}: truncated ({size} bytes): no safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or n + 8 > size:
            raise SourceError(f"{path.name}: header length {n} exceeds the file ({size} bytes) or the 100 MiB "
                              f"limit; the shard is truncated or not safetensors")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SourceError(f"{path.name}: header is not valid JSON ({e}); re-download this shard") from None
    if not isinstance(header, dict):
        raise SourceError(f"{path.name}: header is not a JSON object; re-download this shard")
    return header, raw, size


def _entries(path: Path, header: dict, size: int, data_start: int) -> dict[str, TensorEntry]:
    out = {}
    spans = []
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise SourceError(f"{path.name}: tensor {key!r} has a malformed header entry {info!r}") from None
        if dtype not in DTYPE_SIZE:
            raise SourceError(f"{path.name}: tensor {key!r} has dtype {dtype}, not one the V4-Flash schema uses")
        nbytes = DTYPE_SIZE[dtype] * int(np.prod(shape, dtype=np.int64))
        if not 0 <= start <= end or end - start != nbytes:
            raise SourceError(f"{path.name}: tensor {key!r} data_offsets [{start}, {end}) do not hold "
                              f"{dtype}{list(shape)} ({nbytes} bytes)")
        if data_start + end > size:
            raise SourceError(f"{path.name}: tensor {key!r} ends at byte {data_start + end} but the file has "
                              f"{size} bytes; the shard is truncated, re-download it")
        spans.append((start, end, key))
        out[key] = TensorEntry(key, path.name, dtype, shape, (start, end))
    spans.sort()
    for (s0, e0, k0), (s1, e1, k1) in zip(spans, spans[1:]):
        if s1 < e0:
            raise SourceError(f"{path.name}: tensors {k0!r} and {k1!r} overlap at bytes [{s1}, {min(e0, e1)})")
    return out


def open_checkpoint(root: Path, roles: tuple[str, ...] = ROLES) -> Checkpoint:
    """Validate config, index and every shard header against the schema; no tensor data is read."""
    root = Path(root)
    if not os.access(root, os.R_OK | os.X_OK):
        raise SourceError(f"{root}: directory is not readable")
    cfg = load_config(root / "config.json")
    index_path = root / INDEX_NAME
    if index_path.exists():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise SourceError(f"{index_path}: unreadable index ({e}); re-download it") from None
        names = sorted(set(weight_map.values()))
    elif (root / SINGLE_NAME).exists():
        weight_map, names = None, [SINGLE_NAME]
    else:
        raise SourceError(f"{root}: no {INDEX_NAME} or {SINGLE_NAME}; not a safetensors checkpoint")
    digest = hashlib.sha256()
    digest.update((root / "config.json").read_bytes())
    tensors: dict[str, TensorEntry] = {}
    files: dict[str, int] = {}
    for name in names:
        path = root / name
        if not path.is_file():
            raise SourceError(f"{INDEX_NAME} maps tensors to {name}, which is missing from {root}")
        header, raw, size = _read_header(path)
        files[name] = size
        digest.update(f"\0{name}\0{size}\0".encode())
        digest.update(raw)
        for key, entry in _entries(path, header, size, 8 + len(raw)).items():
            if key in tensors:
                raise SourceError(f"tensor {key!r} is stored twice: in {tensors[key].file} and {name}")
            tensors[key] = entry
    if weight_map is not None:
        for key, name in weight_map.items():
            if key in tensors and tensors[key].file != name:
                raise SourceError(f"{INDEX_NAME} maps {key!r} to {name} but it is stored in {tensors[key].file}")
        orphans = sorted(set(weight_map) - set(tensors))
        if orphans:
            raise SourceError(f"{INDEX_NAME} lists {orphans[0]!r} in {weight_map[orphans[0]]} but no shard holds it")
    try:
        check_source_keys(cfg, {k: (e.shape, e.dtype) for k, e in tensors.items()}, roles)
    except SourceError as e:
        key = str(e).split("'")[1] if "'" in str(e) else ""
        where = f"{tensors[key].file}: " if key in tensors else ""
        raise SourceError(where + str(e)) from None
    return Checkpoint(root, cfg, tensors, files, digest.hexdigest())


def side_files(root: Path) -> list[str]:
    """Config, tokenizer and generation files present in the model directory."""
    return [n for n in SIDE_FILES if (Path(root) / n).is_file()]
