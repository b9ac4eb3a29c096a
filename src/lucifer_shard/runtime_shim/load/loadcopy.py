"""The torch side of the load plan (loadplan.py decides): the model vLLM built, described for the plan; the plan
carried out, each rank file's tensors read straight into their parameters; and what only the loaded bytes can
show: `attn_sink`'s -inf tail, verify=full's digests and pad regions. Needs torch, not vLLM."""
from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from lucifer_shard.formats.torch_dtypes import TORCH_DTYPE
from lucifer_shard.output.manifest import file_digest
from lucifer_shard.output.manifest_types import RankRecord

from . import reader
from ..adapt.configview import backend_name
from lucifer_shard.errors import COMMAND_AGAIN, CONVERT_AGAIN

from ..errors import ShimError
from ..manifest import open_rank_file
from .loadfiles import CheckedRankFile
from .loadplan import FilePlan, ModelView, MoeModule, Param, Read, is_sink

DTYPE_NAMES = {v: k for k, v in TORCH_DTYPE.items()}
NEG_INF = float("-inf")


def describe(t: torch.Tensor, buffer: bool = False) -> Param:
    """A parameter as the load plan checks it, its dtype spelled as the files spell it."""
    return Param(tuple(int(x) for x in t.shape), DTYPE_NAMES.get(t.dtype, str(t.dtype).replace("torch.", "")),
                 buffer, t.is_contiguous())


def model_view(model: nn.Module, rank: int, tp: int) -> ModelView:
    """The model as the load plan checks it: parameters, persistent buffers, and the MoE modules' backends and
    parallel places (an attribute vLLM does not set: this rank's, as vLLM then uses it)."""
    non_persistent = {f"{m}.{b}" if m else b for m, mod in model.named_modules()
                      for b in getattr(mod, "_non_persistent_buffers_set", ())}
    params = {n: describe(b, buffer=True) for n, b in model.named_buffers() if n not in non_persistent}
    params.update({n: describe(p) for n, p in model.named_parameters()})
    moe = {}
    for prefix, mod in model.named_modules():
        qm = getattr(mod, "quant_method", None)
        if qm is None:
            continue
        mpc = getattr(getattr(qm, "moe", None), "moe_parallel_config", None)
        moe[prefix] = MoeModule(backend_name(getattr(qm, "mxfp4_backend", None)), None if mpc is None else
                                         (int(getattr(mpc, "tp_rank", rank)), int(getattr(mpc, "tp_size", tp)),
                                          int(getattr(mpc, "ep_size", 1))))
    return ModelView(type(model).__name__, params, moe)


def destination(r: Read, p: torch.Tensor) -> torch.Tensor:
    if r.prefix is not None:
        return p[: r.prefix]
    return p if r.view is None else p.view(r.view)


def copy_file(out: Path, role: str, rank: int, plan: FilePlan, targets: dict[str, torch.Tensor],
              digests: bool) -> dict[str, str]:
    """Read every tensor of the file straight into its parameter (`attn_sink`: into the prefix, whose
    backend-padded rest must be -inf), from the very file whose header was checked; the tensors'
    BLAKE3 digests when `digests`."""
    f = plan.file
    # the span is dtype x shape (stheader), = the manifest's (loadfiles), = the parameter's (loadplan)
    reads = [reader.TensorRead(r.name, r.offset, destination(r, targets[r.param].data)) for r in plan.reads]
    fd = open_rank_file(out, f.declared.path, role, rank)
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != f.identity:
            raise ShimError(f"{f.path} was replaced while vLLM loaded it (a lucifer-shard convert ran meanwhile?)",
                            COMMAND_AGAIN.at(command="vLLM").after("wait until nothing writes the output directory"))
        got = reader.read_tensors(f.path, reads, digests=digests, fd=fd)
    finally:
        os.close(fd)
    for r in plan.reads:
        if r.prefix is None:
            continue
        p = targets[r.param].data
        tail = p[r.prefix:]
        if tail.numel() and not bool(torch.all(tail == NEG_INF)):
            raise ShimError(f"{r.name}: param entries [{r.prefix}:{p.shape[0]}) are not -inf after loading the "
                            f"{r.prefix} logical heads; the attention backend initialised the padded heads "
                            f"differently, this vLLM build is not supported")
    return got


def check_digests(f: CheckedRankFile, entry: RankRecord, digests: dict[str, str]) -> None:
    """verify=full: each tensor's BLAKE3 (computed while reading, a GPU parameter's on its GPU) and the
    file's digest over its header and those (`lucifer_shard.output.manifest.file_digest`, as lucifer-shard
    writes them) against the manifest."""
    for name, got in digests.items():
        want = entry.tensors[name].digest.removeprefix("blake3:")
        if got != want:
            raise ShimError(f"verify=full: loaded {name} digest {got[:16]}... != manifest {want[:16]}...; "
                            f"the rank file {f.path} is corrupt or tampered with", CONVERT_AGAIN)
    got_file = file_digest(f.header.block, [digests[name] for name in f.header.tensors])  # data order
    want_file = f.declared.digest.removeprefix("blake3:")
    if got_file != want_file:
        raise ShimError(f"verify=full: {f.path} digest {got_file[:16]}... != manifest {want_file[:16]}...; "
                        f"the file header differs from the conversion", CONVERT_AGAIN.after("", "re-copy it"))


def check_zero_regions(entry: RankRecord, targets: dict[str, torch.Tensor]) -> None:
    """verify=full: every pad region of a model-layout tensor is zero (-inf for `attn_sink`)."""
    for name, t in entry.tensors.items():
        if not t.zero_regions or t.kernel:
            continue  # kernel-layout tensors: covered by their digests
        p = targets[name].data
        if is_sink(name, t):
            p = p[: t.shape[0]]
        offset = 1 if t.stacked else 0
        want_inf = t.pad == "-inf"
        for dim, start, end in t.zero_regions:
            region = p.narrow(dim + offset, start, end - start)
            ok = bool(torch.all(region == NEG_INF)) if want_inf else not bool(torch.any(_u8(region)))
            if not ok:
                raise ShimError(f"verify=full: {name} pad region dim {dim} [{start}:{end}) is not "
                                f"{'-inf' if want_inf else 'zero'}; the rank file was tampered with", CONVERT_AGAIN)


def _u8(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)
