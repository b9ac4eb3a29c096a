"""Read a converted output directory back: its manifest, files and tensors in model layout."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from ..errors import VERIFY, OutputError
from ..formats.dtypes import DTYPE_SIZE
from ..formats.stheader import Header, HeaderError, read_header
from ..formats.torch_dtypes import TORCH_DTYPE
from ..guarded_io import Refused, Tree, naming
from ..model.layouts import layout_by_name
from ..output.manifest_types import RankRecord, TensorRecord
from ..output.output_check import check_output
from ..output.share import describe

logger = logging.getLogger("lucifer_shard.output")


class Output:
    """A lucifer-shard output directory, opened through its manifest."""

    def __init__(self, root: Path):
        self.root = Path(root)
        if not self.root.is_dir():
            raise OutputError(f"{root}: no such output directory")
        checked = check_output(self.root)
        self.manifest = checked.refuse()  # what verify refuses without hashing is refused here
        share = checked.share
        if share is not None:  # every rank's output is summed: a node's share cannot be checked alone
            raise OutputError(f"{root} is a node's share ({describe(share)}): check-numerics sums every rank's "
                              f"output, so it needs the whole output: run it where convert wrote OUT",
                              remedy=VERIFY.at(out=str(root)))
        self._handles: dict[str, object] = {}
        self._headers: dict[str, Header] = {}

    @property
    def tp(self) -> int:
        return self.manifest.tp_size

    @property
    def roles(self) -> list[str]:
        return list(self.manifest.roles)

    def rank(self, role: str, rank: int) -> RankRecord:
        return self.manifest.rank(role, rank)

    def info(self, role: str, rank: int, name: str) -> TensorRecord:
        return self.rank(role, rank).tensors[name]

    def _open(self, rel: str, name: str, info: TensorRecord):
        """The safetensors handle of `rel`, once its header was validated and shows `name` as `info` says."""
        path = self.root / rel
        h = self._handles.get(rel)
        if h is None:
            try:
                fd = Tree(self.root).open_read(rel)  # through real directories: no link is followed
            except FileNotFoundError:
                raise OutputError(f"{path}: rank file listed in the manifest is missing") from None
            except Refused as e:
                raise OutputError(f"{e}", remedy=VERIFY.at(out=str(self.root))) from None
            try:
                with naming(path):
                    self._headers[rel] = read_header(path, fd=fd)  # a damaged file is named here, not mid-read
                # the library maps the very file the header was read from (its descriptor's name)
                h = self._handles[rel] = safe_open(f"/proc/self/fd/{fd}", framework="pt")
            except HeaderError as e:
                raise OutputError(f"{e}", remedy=VERIFY.at(out=str(self.root))) from None
            finally:
                os.close(fd)
        t = self._headers[rel].tensors.get(name)
        if t is None or t.dtype != info.dtype or tuple(t.shape) != info.shape:
            found = "no such tensor" if t is None else f"{t.dtype}{list(t.shape)}"
            raise OutputError(f"{path}: tensor {name!r} is {found}, the manifest says {info.dtype}{list(info.shape)}",
                              remedy=VERIFY.at(out=str(self.root)))
        return h

    def stored(self, role: str, rank: int, name: str, index: slice | None = None) -> np.ndarray:
        """Stored bytes (uint8, last dim in bytes) of a tensor, or of `index` of its first dim."""
        info = self.info(role, rank, name)
        sl = self._open(info.file, name, info).get_slice(name)
        t = sl[index] if index is not None else sl[:]
        t = t.contiguous()
        return t.view(torch.uint8).numpy().reshape(*t.shape[:-1], t.shape[-1] * DTYPE_SIZE[info.dtype])

    def model_bytes(self, role: str, rank: int, name: str, index: slice | None = None) -> np.ndarray:
        """Bytes in model layout: the declared layout's inverse applied (per expert for stacked tensors)."""
        info = self.info(role, rank, name)
        data = self.stored(role, rank, name, index)
        if not info.kernel:
            return data
        return layout_by_name(info.layout).inverse(data)

    def model_tensor(self, role: str, rank: int, name: str, index: slice | None = None) -> torch.Tensor:
        """Model-layout tensor in its file dtype (U8 for MXFP4 weights and scales)."""
        info = self.info(role, rank, name)
        raw = np.ascontiguousarray(self.model_bytes(role, rank, name, index))
        t = torch.from_numpy(raw).view(TORCH_DTYPE[info.dtype])
        logger.debug("%s rank %d %s: %s %s from %s", role, rank, name, info.dtype, list(t.shape), info.file)
        return t

    def close(self) -> None:
        self._handles.clear()
        self._headers.clear()
