"""The source checkpoint: model resolution, header validation, fingerprint and region reads.

Every shard header is validated by `stheader` (the reader that verify, diff and the vLLM loader
share), and the index against the shards, before any data is read, so that a damaged shard is
named precisely (truncated, overlapping or out-of-range offsets, oversized header, a tensor the
index does not list); tensor data is then read at the validated offsets, read-only.
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from .. import stops
from ..errors import INSPECT, READ_AGAIN, SAME_COMMAND, SourceError, UsageRefused
from ..formats.stheader import Header, HeaderError, read_header
from ..guarded_io import JSON_LIMIT, kind, open_regular, read_regular
from ..model.config import ModelConfig, load_config
from ..model.rules import ROLES
from ..model.tensorspecs import check_source_keys
from ..outnames import MANIFEST_NAME, SIDE_FILES, STATE_DIR
from .hub import (NOT_HERE, HubRepo, _ranged, cached_snapshot, guarded, link_fault, remote_header, repo_at,
                  small_file)

if TYPE_CHECKING:  # torch is loaded by safetensors' "pt" framework when data is read
    import torch


INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def _refuse_output(path: Path) -> None:
    """A lucifer-shard output where MODEL belongs is named (it is not a checkpoint)."""
    if (path / MANIFEST_NAME).is_file() or (path / STATE_DIR).is_dir():
        raise SourceError(f"MODEL {path} is a lucifer-shard output, not a checkpoint; pass the checkpoint it was "
                          f"converted from", remedy=INSPECT.at(out=str(path)))


# The configs shipped in the package (lucifer_shard.configs), which plan takes by name from anywhere (no
# clone needed): `lucifer-shard plan --tp 3 deepseek-v4-flash-0731`
SHIPPED_CONFIGS = ("deepseek-v4-flash", "deepseek-v4-flash-0731", "deepseek-v4.1-flash")


def shipped_config(model: str) -> Path | None:
    """The shipped config.json MODEL names (with or without .json) where no such local path exists; else None."""
    from importlib import resources

    name = model.removesuffix(".json")
    if name not in SHIPPED_CONFIGS or Path(model).exists():
        return None
    return Path(str(resources.files("lucifer_shard.configs").joinpath(f"{name}.json")))


def _local(model: str) -> Path | None:
    """MODEL as a local path, or None when it has the shape of a repo id (owner/name) and is not there: what
    exists here, ends in .json, or starts with . / or ~ is a path."""
    path = Path(model)
    if path.exists() or path.is_symlink() or model.startswith((".", "/", "~")) or model.endswith(".json") \
            or model.count("/") != 1:
        return path
    return None


# Both readings of a MODEL of the shape owner/name that is not a path here: the path's, then the repo id's


def _no_revision(model: str, revision: str | None) -> None:
    if revision is not None:
        raise UsageRefused(f"--revision applies only to a Hugging Face repo id, and {model} is a local path; "
                           f"drop --revision")


def _from_hub(repo: str, revision: str | None, what: str, fetch: str, patterns: list[str], instead: str,
              cached_only: bool = False) -> Path:
    """A snapshot of `repo` at `revision` holding `patterns`, through huggingface_hub's cache; a
    failure says which file is missing, where it was looked for and the command that fetches it."""
    import httpx2
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    at = revision or "main"
    flag = f" --revision {revision}" if revision else ""
    try:
        try:
            return Path(snapshot_download(repo, revision=revision, allow_patterns=patterns,
                                          local_files_only=cached_only))
        except (HfHubHTTPError, LocalEntryNotFoundError, httpx2.TransportError) as e:
            link = link_fault(e, f"{what} of {repo} at {at}")  # the link failed: not a missing repo or file
            if link is not None:
                raise link from None
            raise
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the hub is unreachable"
        raise SourceError(f"{repo}: {NOT_HERE}: {what} of {repo} at {at} is not in the local Hugging Face cache "
                          f"({constants.HF_HUB_CACHE}) and {why}; run `hf download {repo}{fetch}{flag}` where the "
                          f"hub is reachable, or {instead}") from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise SourceError(f"{repo}: {NOT_HERE}: cannot resolve {repo} at {at} on the Hugging Face hub "
                          f"({type(e).__name__}: {e})") from None


def resolve_model(model: str, revision: str | None = None, cached_only: bool = False) -> Path:
    """The checkpoint directory of MODEL: a local directory, or a Hugging Face repo id at `revision`
    resolved through huggingface_hub's cache (its location and HF_HUB_OFFLINE are honoured;
    `cached_only`: nothing is downloaded)."""
    path = _local(model)
    if path is None:
        return _from_hub(model, revision, "the checkpoint", "", ["*.json", "*.safetensors", "tokenizer*", "*.jinja"],
                         "pass a local checkpoint directory", cached_only)
    _no_revision(model, revision)
    if path.is_dir():
        _refuse_output(path)
        return path
    if path.is_file() or shipped_config(model):
        raise SourceError(f"MODEL {model} is a {'file' if path.is_file() else 'shipped config.json'}; convert needs "
                          f"the checkpoint directory (config.json with its safetensors shards); a config.json alone "
                          f"is enough for plan")
    raise SourceError(f"{model}: no such directory or file (MODEL is a checkpoint directory, a config.json file "
                      f"for plan, a repo id owner/name, or for plan a shipped config by name: "
                      f"{', '.join(SHIPPED_CONFIGS)})")


def resolve_config(model: str, revision: str | None = None) -> Path:
    """The config.json of MODEL, which may also be the path of a config.json file; for a repo id only
    that file is fetched, so a plan is made before any weight is downloaded."""
    path = _local(model)
    if path is None:
        return _from_hub(model, revision, "config.json", " config.json", ["config.json"],
                         "pass the path of a config.json") / "config.json"
    _no_revision(model, revision)
    if path.is_file():
        return path
    return shipped_config(model) or resolve_model(model) / "config.json"


def config_root(model: str, config: Path) -> Path | None:
    """The checkpoint directory a config.json belongs to (None for a config file given alone, or shipped)."""
    return None if Path(model).is_file() or shipped_config(model) else config.parent


def is_repo_id(model: str) -> bool:
    """Whether MODEL names a Hugging Face repo (owner/name, not a path here)."""
    return _local(model) is None


@dataclass(frozen=True)
class TensorEntry:
    key: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    offsets: tuple[int, int]


@dataclass
class Checkpoint:
    """A validated source checkpoint. Reads are positional, at the validated offsets, one
    descriptor per shard (opened through `guarded_io.open_regular`)."""

    root: Path
    config: ModelConfig
    tensors: dict[str, TensorEntry]
    files: dict[str, int]  # shard name -> size in bytes
    data_start: dict[str, int]  # shard name -> file offset of its data section
    fingerprint: str
    side: dict[str, int] = field(default_factory=dict)  # config/tokenizer files present: name -> size
    config_bytes: bytes = b""  # config.json as read (the fingerprint's first input)
    headers: dict[str, str] = field(default_factory=dict)  # shard name -> SHA-256 of its header as the plan read it
    hub: HubRepo | None = None  # on the Hub, not on disk: `root` is where its files are downloaded to
    # on the Hub: each read a ranged request for its rows (`hub._ranged`), nothing downloaded whole, so a
    # command that reads a few tensors (check-numerics) takes their bytes and not every shard's. The
    # fingerprint pins each header (the offsets read from); a range cannot be checked against the shard's
    # SHA-256, which covers the whole file: `diff` is the byte proof.
    ranged: bool = False
    _fds: dict = field(default_factory=dict, repr=False)

    def stats(self, names: list[str]) -> dict[str, list]:
        """name -> what changes when a source file changes: [size, mtime_ns] on disk; [size, the
        published SHA-256 or git blob id] on the Hub (the commit pins the bytes, wherever they land)."""
        if self.hub is not None:
            return {n: [self.hub.get(n).size, self.hub.get(n).identity] for n in names}
        stats = {}
        for n in names:
            st = (self.root / n).stat()
            stats[n] = [st.st_size, st.st_mtime_ns]
        return stats

    def check_header(self, name: str) -> None:
        """Shard `name`, now on disk, starts with the header the plan was made from. On the Hub that header
        came by a ranged request and the shard by a download checked against its SHA-256: two reads."""
        if hashlib.sha256(_read_shard(self.root / name).block).hexdigest() != self.headers[name]:
            where = f" of {self.hub.repo} at {self.hub.commit[:12]}" if self.hub is not None else ""
            raise SourceError(f"{name}{where}: its header is not the one the plan was made from (read before by a "
                              f"ranged request): the endpoint answered the two requests with other bytes",
                              remedy=READ_AGAIN)

    def read(self, key: str, box: tuple[slice, ...]) -> torch.Tensor:
        """The region `box` of tensor `key` (element indices), as stored: the rows of its first dim
        are read, the rest sliced in memory."""
        import torch

        from ..formats.torch_dtypes import TORCH_DTYPE  # torch only where data is read

        entry = self.tensors[key]
        shape = entry.shape or (1,)
        rows = range(shape[0])[box[0]] if box else range(shape[0])
        row = (entry.offsets[1] - entry.offsets[0]) // max(1, shape[0])
        first, count = (rows.start, len(rows)) if rows.step == 1 else (0, shape[0])
        at = self.data_start[entry.file] + entry.offsets[0] + first * row
        data = self._bytes(entry, at, count * row)
        dtype = TORCH_DTYPE[entry.dtype]
        t = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
        t = t.reshape(count, *shape[1:])[(slice(None) if rows.step == 1 else box[0], *box[1:])]
        return t.reshape(()) if not entry.shape else t

    def _bytes(self, entry: TensorEntry, at: int, n: int) -> bytearray:
        """Bytes [at, at + n) of the shard holding `entry`: a ranged request to the Hub (`ranged`), else
        positional reads of the shard on disk."""
        if self.ranged:
            return bytearray(_ranged(self.hub, entry.file, at, at + n)) if n else bytearray()
        fd = self._fds.get(entry.file)
        if fd is None:
            fd = self._fds[entry.file] = open_regular(self.root / entry.file, follow=True)
        data = bytearray(n)
        view, got = memoryview(data), 0
        while got < n:
            k = os.preadv(fd, [view[got:]], at + got)
            if k == 0:
                raise SourceError(f"{entry.file}: truncated inside tensor {entry.key!r}; re-download this shard",
                                  key=entry.key)
            got += k
        return data

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _read_shard(path: Path) -> Header:
    try:
        return read_header(path)
    except HeaderError as e:
        raise SourceError(f"{path.name}: {e.reason}; re-download this shard", key=e.tensor) from None


def _weight_map(index_path: Path) -> dict[str, str]:
    """The index's key -> shard map; every shard a relative path inside the model directory."""
    try:
        weight_map = json.loads(read_regular(index_path, JSON_LIMIT, follow=True))["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SourceError(f"{index_path}: unreadable index ({type(e).__name__}: {e}); re-download it") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise SourceError(f"{index_path}: weight_map is not an object of tensor name -> shard file; re-download it")
    for key, name in weight_map.items():
        parts = PurePosixPath(name).parts
        if not name or "\0" in name or PurePosixPath(name).is_absolute() or ".." in parts:
            raise SourceError(f"{INDEX_NAME} maps {key!r} to {name!r}, outside the model directory; shard names "
                              f"must be relative paths inside it (a tampered or hand-made index)", key=key)
    return weight_map


def _check_index(weight_map: dict[str, str], tensors: dict[str, TensorEntry]) -> None:
    """The index and the shards must agree on every tensor: vLLM loads every tensor of the listed
    shards while transformers loads by the index, so a disagreement makes two different models."""
    for key, name in weight_map.items():
        if key in tensors and tensors[key].file != name:
            raise SourceError(f"{INDEX_NAME} maps {key!r} to {name} but it is stored in {tensors[key].file}; "
                              f"re-download the index", key=key)
    orphans = sorted(set(weight_map) - set(tensors))
    if orphans:
        more = f" (and {len(orphans) - 1} more)" if len(orphans) > 1 else ""
        raise SourceError(f"{INDEX_NAME} lists {orphans[0]!r}{more} in {weight_map[orphans[0]]} but that shard does "
                          f"not hold it; the index and the shards disagree, re-download them", key=orphans[0])
    unlisted = sorted(set(tensors) - set(weight_map))
    if unlisted:
        more = f" (and {len(unlisted) - 1} more)" if len(unlisted) > 1 else ""
        raise SourceError(f"{tensors[unlisted[0]].file}: tensor {unlisted[0]!r}{more} is not listed in {INDEX_NAME}; "
                          f"loaders that read by the index would drop it while vLLM loads it, re-download the index",
                          key=unlisted[0])


def open_checkpoint(root: Path, roles: tuple[str, ...] = ROLES) -> Checkpoint:
    """Validate config, index and every shard header against the schema; no tensor data is read."""
    root = Path(root)
    if not os.access(root, os.R_OK | os.X_OK):
        raise SourceError(f"{root}: directory is not readable")
    cfg = load_config(root / "config.json")
    index_path = root / INDEX_NAME
    if index_path.exists():
        weight_map = _weight_map(index_path)
    elif (root / SINGLE_NAME).exists():
        weight_map = None
    else:
        raise SourceError(f"{root}: no {INDEX_NAME} or {SINGLE_NAME}; not a safetensors checkpoint")

    def header(name: str) -> Header:
        if not (root / name).exists():  # anything else there is refused by the reader, by name
            raise SourceError(f"{INDEX_NAME} maps tensors to {name}, which is missing from {root}")
        return _read_shard(root / name)
    side = {n: (root / n).stat().st_size for n in side_files(root)}
    return _checkpoint(root, cfg, read_regular(root / "config.json", JSON_LIMIT, follow=True), weight_map, header,
                       roles, side)


@dataclass(frozen=True)
class RemoteConfig:
    """A repo id's config.json, fetched alone (`remote_config`): what the plan and OUT's refusals are
    made from before any other file of the repo is asked for."""

    repo: str
    path: Path  # in huggingface_hub's cache, in the folder named for the commit the revision resolved to
    config: ModelConfig


def remote_config(repo: str, revision: str | None) -> RemoteConfig:
    """config.json of `repo` at `revision`, with its refusals (`load_config`)."""
    path = small_file(repo, "config.json", revision)
    return RemoteConfig(repo, path, load_config(path, where=f"{repo}{f' at {revision}' if revision else ''}: config.json"))


def open_remote(opened: RemoteConfig, download_to: Path | None = None, roles: tuple[str, ...] = ROLES) -> Checkpoint:
    """A checkpoint on the Hub, validated as a local one is without downloading a weight: from its
    config.json (`remote_config`), the file list and index, then every shard's header by ranged requests
    (`source.hub`). Its files are to be downloaded into `download_to` (the checkpoint's `root`; None:
    nowhere yet). Where the Hugging Face cache holds every file at that commit (or the Hub cannot be
    reached), the cached snapshot is returned, read in place (`hub` None)."""
    repo, config_path, cfg = opened.repo, opened.path, opened.config
    hub = repo_at(repo, config_path.parent.name)  # the commit `revision` resolved to: every later file is its
    if hub is None:  # offline: what the Hugging Face cache holds of that commit, as before
        return open_checkpoint(resolve_model(repo, config_path.parent.name, cached_only=True), roles)
    config_bytes = read_regular(config_path, JSON_LIMIT, follow=True)
    hub.check("config.json", config_bytes)  # the bytes the plan is made from are the commit's
    cached = cached_snapshot(hub, [INDEX_NAME if INDEX_NAME in hub.files else SINGLE_NAME,
                                   *(n for n in SIDE_FILES if n in hub.files)])
    if cached is not None and (cached / INDEX_NAME).is_file():  # the cache may hold all of it: read in place
        names = set(_weight_map(cached / INDEX_NAME).values())
        if cached_snapshot(hub, sorted(names)) is not None:
            local = open_checkpoint(cached, roles)
            _check_snapshot(hub, local)
            return local
    if INDEX_NAME in hub.files:
        index_path = small_file(repo, INDEX_NAME, hub.commit)
        hub.check(INDEX_NAME, read_regular(index_path, JSON_LIMIT, follow=True))
        weight_map = _weight_map(index_path)
    elif SINGLE_NAME in hub.files:
        weight_map = None
    else:
        raise SourceError(f"{repo} at {hub.commit[:12]}: no {INDEX_NAME} or {SINGLE_NAME}; not a safetensors "
                          f"checkpoint")
    side = {n: hub.files[n].size for n in SIDE_FILES if n in hub.files}
    ckpt = _checkpoint(Path(download_to or "."), cfg, config_bytes, weight_map, lambda name: remote_header(hub, name),
                       roles, side)
    ckpt.hub = hub
    return ckpt


def open_source(model: str, revision: str | None = None, roles: tuple[str, ...] = ROLES,
                download_to: Path | None = None) -> Checkpoint:
    """MODEL opened without a weight read or downloaded: a local directory, or a repo id (`open_remote`:
    read in place from the Hugging Face cache where it holds all of it, else to be downloaded)."""
    if is_repo_id(model):  # its requests on a thread joined in slices: a slow or stalled Hub never holds a stop
        return stops.joined(lambda: open_remote(remote_config(model, revision), download_to, roles),
                            "lucifer-hub-open")
    return open_checkpoint(resolve_model(model, revision), roles)


def download_whole(ckpt: Checkpoint, roles: tuple[str, ...] = ROLES) -> Checkpoint:
    """A checkpoint on the Hub downloaded whole into the Hugging Face cache (huggingface_hub's location
    and settings) and opened there; its headers must be the ones read by ranged requests (the commit
    pins them), and its identity stays the Hub's (`stats`)."""
    from huggingface_hub import constants, snapshot_download

    hub = ckpt.hub
    names = [*ckpt.files, *ckpt.side, *([INDEX_NAME] if INDEX_NAME in hub.files else [])]
    # off the main thread, joined in slices: a stop never waits for huggingface_hub's thread map (the files it
    # finished stay in the cache, and it continues the others)
    root = Path(guarded(hub.repo, hub.commit, "the checkpoint", lambda: stops.joined(lambda: snapshot_download(
        hub.repo, revision=hub.commit, allow_patterns=names), "lucifer-snapshot"),
        lambda: f"the files it finished are kept in the Hugging Face cache ({constants.HF_HUB_CACHE})"))
    local = open_checkpoint(root, roles)
    _check_snapshot(hub, local)
    if local.fingerprint != ckpt.fingerprint:
        raise SourceError(f"{hub.repo} at {hub.commit[:12]}: the downloaded checkpoint's headers differ from the "
                          f"Hub's ({root})", remedy=SAME_COMMAND.after("remove that snapshot from the Hugging Face "
                                                                        "cache"))
    local.hub = hub
    return local


def _check_snapshot(hub: HubRepo, local: Checkpoint) -> None:
    """The config and tokenizer files of a Hugging Face cache snapshot against the git blob ids the Hub
    publishes (huggingface_hub checks their size only; convert copies them into OUT). The shards are not
    hashed here: the fingerprint binds their headers, and a snapshot of 170 GB is the user's cache."""
    for name in local.side:
        hub.check(name, read_regular(local.root / name, hub.get(name).size, follow=True),
                  SAME_COMMAND.after(f"{local.root / name} is in the Hugging Face cache: remove that revision from "
                                     f"the cache (`hf cache rm`)"))


def _checkpoint(root: Path, cfg: ModelConfig, config_bytes: bytes, weight_map: dict[str, str] | None,
                header_of: Callable[[str], Header], roles: tuple[str, ...], side: dict[str, int]) -> Checkpoint:
    """The checkpoint from its config and its shards' headers (however they were read): the index and
    the headers checked against each other and the schema, and the fingerprint over them."""
    names = sorted(set(weight_map.values())) if weight_map is not None else [SINGLE_NAME]
    digest = hashlib.sha256()
    digest.update(config_bytes)
    tensors: dict[str, TensorEntry] = {}
    files: dict[str, int] = {}
    data_start: dict[str, int] = {}
    headers: dict[str, str] = {}
    for name in names:
        header = header_of(name)
        headers[name] = hashlib.sha256(header.block).hexdigest()
        files[name] = header.file_size
        data_start[name] = header.data_start
        digest.update(f"\0{name}\0{header.file_size}\0".encode())
        digest.update(header.block[8:])
        for key, t in header.tensors.items():
            if key in tensors:
                raise SourceError(f"tensor {key!r} is stored twice: in {tensors[key].file} and {name}", key=key)
            tensors[key] = TensorEntry(key, name, t.dtype, t.shape, (t.start, t.end))
    if weight_map is not None:
        _check_index(weight_map, tensors)
    try:
        check_source_keys(cfg, {k: (e.shape, e.dtype) for k, e in tensors.items()}, roles)
    except SourceError as e:
        if e.key in tensors:
            raise SourceError(f"{tensors[e.key].file}: {e}", key=e.key) from None
        raise
    return Checkpoint(root, cfg, tensors, files, data_start, digest.hexdigest(), side, config_bytes, headers)


def side_files(root: Path) -> list[str]:
    """Config, tokenizer and generation files present in the model directory. One that is there but
    not a readable regular file (a dangling link to a Hugging Face blob never downloaded, a FIFO, a
    folder) is refused by name: skipping it would serve the model without it."""
    found = []
    for n in SIDE_FILES:
        path = Path(root) / n
        try:
            st = path.lstat()
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(st.st_mode) and not path.exists():
            raise SourceError(f"{path}: is a symlink to {os.readlink(path)}, which does not exist (a download that "
                              f"did not finish); download it again, or remove the link to convert without it")
        if not path.is_file():
            raise SourceError(f"{path}: is {kind(path.stat().st_mode)}, not a regular file; replace it with the "
                              f"file, or remove it to convert without it")
        found.append(n)
    return found
