"""Synthetic checkpoints with the exact DeepSeek-V4-Flash schema (names, dtypes, packing, index json).

`random` fill (the default) writes valid values (FP4 codes, E8M0 scales in a realistic range,
finite FP8 and BF16), so every proof runs on it, check-numerics included; `pattern` fill makes
every byte a hash of its tensor and position, so a misplaced byte is identifiable (scale bytes
never 0xFF), but its BF16 and FP8 bytes are not all finite numbers. Shards are serialized by
`safetensors.torch.save` so the converter's input is produced by the reference library, not by
our own writer. OUT is a new checkpoint: absent or an empty directory, nothing else.
"""
from __future__ import annotations

import hashlib
import json
import logging
import stat
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save

from ..errors import COMMAND_AGAIN, LuciferError, OutputError
from ..formats.dtypes import DTYPE_SIZE
from ..formats.torch_dtypes import TORCH_DTYPE
from ..guarded_io import Tree, kind, probe
from ..model.config import ModelConfig, parse_config
from ..model.tensorspecs import ExpectedTensor
from ..outnames import MANIFEST_NAME, STATE_DIR
from ..units import byte_bar
from .diskspace import check_room
from .fills import DEFAULT_FILL, FILLS
from .presets import (MIN_SHARDS, PRESETS, file_sizes, nbytes, ordered_sources, preset_config, shards)  # noqa: F401 (PRESETS)

logger = logging.getLogger("lucifer_shard.synth")  # -v prints "lucifer_shard.synth: ..."


def _seed(seed: int, key: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{key}".encode()).digest()[:8], "little")


def pattern_bytes(key: str, nbytes: int) -> np.ndarray:
    """Position-and-tensor hash per byte, never 0xFF (a valid E8M0 scale everywhere)."""
    tid = _seed(0, key) & 0xFFFFFFFF
    i = np.arange(nbytes, dtype=np.uint64)
    v = (i * np.uint64(2654435761) + np.uint64(tid)) & np.uint64(0xFFFFFFFF)
    v ^= v >> np.uint64(15)
    v = (v * np.uint64(0x2C1B3C6D)) & np.uint64(0xFFFFFFFF)
    v ^= v >> np.uint64(12)
    return (v % np.uint64(255)).astype(np.uint8)


def _random_tensor(src: ExpectedTensor, cfg: ModelConfig, rng: np.random.Generator) -> torch.Tensor:
    shape, dtype = src.shape, src.dtype
    n = int(np.prod(shape))
    if dtype == "I8":  # two random E2M1 codes per byte
        return torch.from_numpy(rng.integers(0, 256, n, dtype=np.uint8).reshape(shape)).view(torch.int8)
    if dtype == "F8_E8M0":  # 2^-8 .. 2^-4: realistic MXFP4 / FP8-block scales, never 0xFF
        return torch.from_numpy(rng.integers(119, 124, n, dtype=np.uint8).reshape(shape)).view(torch.float8_e8m0fnu)
    if dtype == "F8_E4M3":
        vals = rng.standard_normal(n, dtype=np.float32).reshape(shape) * 2.0
        return torch.from_numpy(vals).to(torch.float8_e4m3fn)
    vals = rng.standard_normal(n, dtype=np.float32).reshape(shape)
    if "norm" in src.key:
        vals = 1.0 + 0.1 * vals
    elif dtype == "BF16":
        vals = vals * 0.02
    return torch.from_numpy(vals).to(TORCH_DTYPE[dtype])


def make_tensor(src: ExpectedTensor, cfg: ModelConfig, fill: str, seed: int) -> torch.Tensor:
    """One synthetic tensor, deterministic in (key, fill, seed) alone."""
    if src.dtype == "I64":  # tid2eid: always valid expert ids, distinct within a row
        rng = np.random.default_rng(_seed(seed, src.key))
        rows = src.shape[0]
        ids = np.argsort(rng.random((rows, cfg.n_experts)), axis=1)[:, : src.shape[1]]
        return torch.from_numpy(ids.astype(np.int64))
    if fill == "pattern":
        raw = pattern_bytes(f"{seed}:{src.key}", int(np.prod(src.shape)) * DTYPE_SIZE[src.dtype])
        t = torch.from_numpy(raw)
        return t.view(TORCH_DTYPE[src.dtype]).reshape(src.shape)
    return _random_tensor(src, cfg, np.random.default_rng(_seed(seed, src.key)))


def refuse_out(out: Path) -> None:
    """OUT must be absent or an empty directory: synth writes a whole checkpoint, config.json included,
    so anything already there (a finished output, another checkpoint, a user's files) would be mixed
    with it or overwritten. The refusal names what is there."""
    there = probe(out)
    if there is None:
        return
    try:
        st = out.stat()  # OUT may be reached through a link to a directory, as for convert
    except FileNotFoundError:
        raise OutputError(f"OUT {out}: is a symlink to nothing; synth writes a new checkpoint directory, choose a "
                          f"path that does not exist or an empty directory") from None
    if not stat.S_ISDIR(st.st_mode):
        raise OutputError(f"OUT {out}: is {kind(st.st_mode)}; synth writes a new checkpoint directory, choose a "
                          f"path that does not exist or an empty directory")
    names = sorted(Tree(out).entries())
    if names:
        what = next((label for marker, label in OUT_KINDS if marker in names), "not empty")
        shown = ", ".join(names[:SHOWN]) + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")
        raise OutputError(f"OUT {out}: {what} ({shown}); synth writes only into a new or empty directory (it would "
                          f"rewrite config.json among what is there): choose another OUT or empty this one")


# the first marker found in OUT says what OUT is, in the refusal
OUT_KINDS = ((MANIFEST_NAME, "holds a lucifer-shard output"), (STATE_DIR, "holds a lucifer-shard output"),
             ("model.safetensors.index.json", "holds a checkpoint"), ("config.json", "holds a checkpoint"))
SHOWN = 5


def synth(preset: str, out: Path, layers: int | None = None, fill: str = DEFAULT_FILL, seed: int = 0,
          mtp: bool = True, progress: bool = True, shard_count: int = MIN_SHARDS) -> Path:
    """Write a synthetic checkpoint directory; returns its path."""
    if fill not in FILLS:
        raise LuciferError(f"--fill {fill!r}: choose one of {', '.join(FILLS)}")
    raw = preset_config(preset, layers, mtp)
    cfg = parse_config(raw, f"preset {preset}")
    out = Path(out)
    refuse_out(out)
    check_room(out, file_sizes(raw, shard_count), 0, COMMAND_AGAIN.at(command=f"synth {preset}"), what="checkpoint shards and JSON files")
    out.mkdir(parents=True, exist_ok=True)
    tree = Tree(out)
    sources = ordered_sources(raw, f"preset {preset}")
    groups = list(shards(sources, shard_count))
    total = sum(map(nbytes, sources))
    weight_map: dict[str, str] = {}
    bar = byte_bar(total, f"synth {preset}", progress)
    for n, group in enumerate(groups, 1):
        name = f"model-{n:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for src in group:
            tensors[src.key] = make_tensor(src, cfg, fill, seed)
            weight_map[src.key] = name
            logger.debug("%s: %s %s", src.key, tensors[src.key].dtype, list(tensors[src.key].shape))
        tree.write_bytes(name, save(tensors, metadata={"format": "pt"}))
        bar.update(sum(t.numel() * t.element_size() for t in tensors.values()))
        logger.info("%s: %d tensor(s), %d bytes", name, len(tensors), sum(map(nbytes, group)))
        del tensors
    bar.close()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    docs = {"model.safetensors.index.json": index, "config.json": raw,
            "generation_config.json": {"bos_token_id": 0, "eos_token_id": 1},
            "tokenizer_config.json": {"model_max_length": 1048576}}
    for name, doc in docs.items():
        tree.write_bytes(name, (json.dumps(doc, indent=2) + "\n").encode())
    return out
