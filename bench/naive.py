"""The naive baseline `make bench` races `convert` against.

What most offline converters do: load every source tensor into memory with safetensors, build each
rank's tensors with torch slicing (the same `build_specs` pieces, pads and expert layouts as
`convert`, so the output bytes are the same), then save each rank with
`safetensors.torch.save_file` and fsync. One file per rank and role.

    python3 bench/naive.py MODEL OUT [--tp 3] [--no-mtp]
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from lucifer_shard.engine.job import stored_shape, tensor_layouts
from lucifer_shard.formats.dtypes import DTYPE_SIZE
from lucifer_shard.formats.torch_dtypes import TORCH_DTYPE
from lucifer_shard.model.options import Options
from lucifer_shard.model.plan import make_plan
from lucifer_shard.model.tensorspecs import build_specs
from lucifer_shard.source.checkpoint import open_checkpoint


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, last dim scaled by the item size (so packed and 8-bit dtypes slice alike)."""
    t = t.contiguous()
    if t.dim() == 0:
        t = t.reshape(1)
    return t.view(torch.uint8)


def build_rank(tensors: dict[str, torch.Tensor], specs, layouts) -> dict[str, torch.Tensor]:
    out = {}
    for spec in specs:
        item = DTYPE_SIZE[spec.dtype]
        shape = list(spec.shape)
        shape[-1] *= item
        buf = torch.empty(shape, dtype=torch.uint8)
        buf.view(-1, len(spec.pad))[:] = torch.frombuffer(bytearray(spec.pad), dtype=torch.uint8)
        for p in spec.pieces:
            def src_of(key: str) -> torch.Tensor:
                t = tensors[key]
                if spec.src_dtype == "I64" and spec.dtype == "I32":
                    t = t.to(torch.int32)
                return byte_view(t)
            dim = p.dim + (1 if spec.experts else 0)
            last = len(shape) - 1
            scale = item if dim == last else 1
            s0, d0, n = p.src_start * scale, p.dst_start * scale, p.length * scale
            if spec.experts:
                for e in range(spec.experts):
                    src = src_of(p.source.format(e=e))
                    buf[e].narrow(dim - 1, d0, n).copy_(src.narrow(dim - 1, s0, n))
            else:
                buf.narrow(dim, d0, n).copy_(src_of(p.source).narrow(dim, s0, n))
        if spec.expert_tensor:
            arr = layouts[spec.expert_tensor].forward(buf.numpy())
            buf = torch.from_numpy(np.ascontiguousarray(arr))
        final = stored_shape(spec, layouts)
        out[spec.name] = buf.view(TORCH_DTYPE[spec.dtype]).reshape(final)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--tp", type=int, default=3)
    ap.add_argument("--no-mtp", action="store_true")
    args = ap.parse_args()
    t0 = time.perf_counter()
    options = Options(tp=args.tp, mtp=not args.no_mtp)
    roles = ("target", "draft") if options.mtp else ("target",)
    ckpt = open_checkpoint(args.model, roles)
    plan = make_plan(ckpt.config, args.tp)
    layouts = tensor_layouts(options)
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(ckpt.files):
        tensors.update(load_file(str(args.model / name)))
    read = sum(t.numel() * t.element_size() for t in tensors.values())
    written = 0
    for role in roles:
        if role == "draft" and not ckpt.config.num_mtp:
            continue
        for rank, specs in enumerate(build_specs(ckpt.config, plan, role)):
            rank_tensors = build_rank(tensors, specs, layouts)
            path = args.out / role / f"rank-{rank}.safetensors"
            path.parent.mkdir(parents=True, exist_ok=True)
            save_file(rank_tensors, str(path), metadata={"format": "pt"})
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
            written += path.stat().st_size
            del rank_tensors
            gc.collect()
    print(f"naive: read {read / 1e9:.3f} GB, wrote {written / 1e9:.3f} GB in {time.perf_counter() - t0:.1f} s",
          file=sys.stderr)


if __name__ == "__main__":
    main()
