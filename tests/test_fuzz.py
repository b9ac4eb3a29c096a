"""Header fuzzing of every reader (hypothesis, seeded): corrupted safetensors files and indexes.

For every corrupted input each reader must either refuse it with one clear line naming the file
(and the tensor, when one is at fault) as a LuciferError (the CLI prints it as one `error:` line,
exit 2; see test_reliability.py) or accept it, and then read exactly what the `safetensors`
library reads from it. Nothing else may happen: no other exception (a traceback), no allocation
sized by the header's claims (tracemalloc peak under a fixed cap), no hang (a deadline per case).
The readers, from the inside out:

* `stheader.read_header`, the one parser of untrusted headers, differentially against the
  `safetensors` library, and the vLLM loader's `runtime_shim.manifest.read_header` over it;
* `source.open_checkpoint`, the checkpoint reader of convert, diff and check-numerics (one shard,
  or the index, corrupted);
* `verify.open_files`, the rank-file reader of verify and diff, and on a sample the whole
  `verify` and `diff`;
* the CLI end to end (`convert`, `verify`, `diff` in a subprocess under RLIMIT_AS and a timeout):
  exit code, one `error:` line, no traceback, nothing written, the source unchanged.

The default suite runs a sample of each (`sample`); `make fuzz` runs the thousands (marker
`fuzz`). With LUCIFER_FUZZ_LOG=path every case appends {target, kind, outcome} as a JSON line
(docs/evidence/reliability.md's figures come from it through tools/reliability_table.py).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import resource
import shutil
import subprocess
import tracemalloc
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from lucifer_shard.errors import LuciferError, SourceError
from lucifer_shard.formats.stheader import HeaderError, read_header
from lucifer_shard.output.manifest_types import Manifest
from lucifer_shard.proof.diff import diff
from lucifer_shard.proof.report import Report
from lucifer_shard.proof.structure import open_files
from lucifer_shard.proof.verify import verify
from lucifer_shard.runtime_shim.errors import ShimError
from lucifer_shard.runtime_shim.manifest import read_header as shim_read_header
from lucifer_shard.source.checkpoint import INDEX_NAME, open_checkpoint

from corruptions import INDEX_KINDS, KINDS, corrupted, corrupted_index
from helpers import one_error, run_process, scratch

LOG = os.environ.get("LUCIFER_FUZZ_LOG")
MEMORY_CAP = 64 << 20  # bytes a reader may allocate (tracemalloc peak): the headers are kilobytes
SHARD = "model-00005-of-00005.safetensors"  # the smallest shard of the tiny preset
# cases per kind of corruption (sample, fuzz), for each target
SIZES = {"reader": (10, 200), "checkpoint": (3, 40), "rank files": (3, 40), "verify and diff": (1, 2), "cli": (1, 1)}
SAMPLE_KINDS = {"verify and diff": 3, "cli": 2}  # the sample of a slow target covers this many kinds
DEADLINE_S = 60.0  # per case: "no hang" (the slowest, a CLI case, takes seconds)
SIZE = pytest.mark.parametrize("fuzz", [False, pytest.param(True, marks=pytest.mark.fuzz)], ids=["sample", "fuzz"])


def each_kind(target: str, fuzz: bool, kinds: tuple[str, ...], prop) -> None:
    """Run `prop(data, kind)` as a seeded hypothesis test, SIZES[target] cases per kind."""
    n = SIZES[target][fuzz]
    if not fuzz and target in SAMPLE_KINDS:
        kinds = kinds[::len(kinds) // SAMPLE_KINDS[target]][:SAMPLE_KINDS[target]]
    for kind in kinds:
        settings(max_examples=n, derandomize=True, database=None, deadline=DEADLINE_S * 1000,
                 suppress_health_check=list(HealthCheck))(given(st.data())(lambda data: prop(data, kind)))()


def log(target: str, kind: str, outcome: str) -> None:
    if LOG:
        with open(LOG, "a") as f:
            f.write(json.dumps({"target": target, "kind": kind, "outcome": outcome}) + "\n")


def one_line(e: Exception, *names: str) -> str:
    text = str(e)
    assert "\n" not in text and "\r" not in text, text
    for n in names:
        assert n in text, (n, text)
    return text


def bounded(fn, *args):
    """fn(*args) with tracemalloc watching: no allocation sized by what a header claims."""
    tracemalloc.start()
    try:
        return fn(*args)
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < MEMORY_CAP, f"{fn.__name__} allocated {peak} bytes"


def replace_file(path: Path, data: bytes) -> None:
    """Write `data` under `path` as a new file (a hard-linked original elsewhere stays intact)."""
    tmp = path.with_name(path.name + ".fuzz")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def library_view(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """What the safetensors library reads: {name: (dtype, shape, bytes)}."""
    with safe_open(str(path), "pt") as f:
        out = {}
        for k in f.keys():
            sl = f.get_slice(k)
            t = f.get_tensor(k)
            out[k] = (sl.get_dtype(), list(sl.get_shape()), t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        return out


def agrees_with_library(path: Path, header) -> None:
    """An accepted file reads in the library exactly as the header says (nothing fails later)."""
    raw = path.read_bytes()
    seen = library_view(path)
    assert set(seen) == set(header.tensors)
    for name, t in header.tensors.items():
        dtype, shape, data = seen[name]
        assert (dtype, shape) == (t.dtype, list(t.shape))
        assert data == raw[header.data_start + t.start:header.data_start + t.end]


# ---------------------------------------------------------------- the header reader, vs the library


@functools.cache
def small_files(root: Path) -> list[bytes]:
    """Valid files written by the safetensors library: every dtype, a zero-size tensor, metadata."""
    rng = np.random.default_rng(0)
    files = []
    for i, tensors in enumerate([
        {"a": torch.tensor(rng.integers(0, 255, (4, 6)), dtype=torch.uint8),
         "b": torch.zeros((2, 3), dtype=torch.bfloat16), "c": torch.ones(5, dtype=torch.float32)},
        {"w": torch.tensor(rng.integers(0, 127, (3, 8)), dtype=torch.int8).view(torch.float8_e4m3fn),
         "s": torch.full((3, 1), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu),
         "ids": torch.arange(6, dtype=torch.int64).reshape(2, 3), "i32": torch.arange(4, dtype=torch.int32),
         "empty": torch.zeros((0, 4), dtype=torch.uint8)},
    ]):
        path = root / f"base{i}.safetensors"
        save_file(tensors, str(path), metadata={"lucifer.rank": "1"} if i else None)
        files.append(path.read_bytes())
    return files


def check_reader(path: Path, kind: str) -> None:
    try:
        header = bounded(read_header, path)
    except HeaderError as e:
        one_line(e, str(path), *([repr(e.tensor)] if e.tensor is not None else []))
        with pytest.raises(ShimError) as shim:  # the vLLM loader refuses it too, in one line
            shim_read_header(path)
        one_line(shim.value, str(path))
        log("reader", kind, "refused")
        return
    agrees_with_library(path, header)
    assert shim_read_header(path).tensors == header.tensors
    log("reader", kind, "accepted, reads as the library reads it")


def _reader_case(tmp_path, fuzz):
    def prop(data, kind):
        raw = data.draw(st.sampled_from(small_files(tmp_path)))
        path = tmp_path / "case.safetensors"
        replace_file(path, data.draw(corrupted(raw, kind)))
        check_reader(path, kind)

    each_kind("reader", fuzz, KINDS, prop)


@SIZE
def test_header_reader(tmp_path, fuzz):
    _reader_case(tmp_path, fuzz)


# ---------------------------------------------------------------- the checkpoint reader


@pytest.fixture(scope="module")
def model(tiny_pattern, tmp_path_factory) -> Iterator[Path]:
    """A hard-linked copy of `synth tiny`: a case replaces one file, then puts the original back."""
    with scratch(tmp_path_factory, "fuzz") as root:
        shutil.copytree(tiny_pattern, root / "model", copy_function=os.link)
        yield root / "model"


def digests(root: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.iterdir())}


def check_checkpoint(root: Path, name: str, kind: str) -> None:
    before = (root / name).read_bytes()
    try:
        ckpt = bounded(open_checkpoint, root)
    except SourceError as e:
        one_line(e, name)
        log("checkpoint", kind, "refused")
    else:
        for key, entry in ckpt.tensors.items():  # accepted: every tensor reads where the header says
            if entry.file == name:
                got = ckpt.read(key, tuple(slice(None) for _ in entry.shape)).reshape(-1).view(torch.uint8)
                start = ckpt.data_start[name] + entry.offsets[0]
                assert got.numpy().tobytes() == before[start:start + entry.offsets[1] - entry.offsets[0]]
        ckpt.close()
        log("checkpoint", kind, "accepted, reads as the header says")
    assert (root / name).read_bytes() == before  # read-only


def _checkpoint_case(model, fuzz):
    originals = {n: (model / n).read_bytes() for n in (SHARD, INDEX_NAME)}
    pristine = digests(model)

    def prop(data, kind):
        if kind in INDEX_KINDS:
            name, bad = INDEX_NAME, data.draw(corrupted_index(originals[INDEX_NAME], SHARD, kind))
        else:
            name, bad = SHARD, data.draw(corrupted(originals[SHARD], kind))
        replace_file(model / name, bad)
        try:
            check_checkpoint(model, name, kind)
        finally:
            replace_file(model / name, originals[name])

    each_kind("checkpoint", fuzz, KINDS + INDEX_KINDS, prop)
    assert digests(model) == pristine


@SIZE
def test_checkpoint_reader(model, fuzz):
    _checkpoint_case(model, fuzz)


# ---------------------------------------------------------------- the rank-file readers (verify, diff)


@pytest.fixture(scope="module")
def out_copy(tiny_pattern, tmp_path_factory) -> Iterator[Path]:
    from lucifer_shard.engine.convert import convert
    from lucifer_shard.model.options import Options

    with scratch(tmp_path_factory, "fuzz-out") as root:
        convert(str(tiny_pattern), root / "out", Options(tp=3, max_file_bytes=1 << 20), progress=False)
        yield root / "out"


def rank_files(out: Path) -> list[str]:
    """The smaller rank files (cheap to rewrite per case)."""
    files = sorted(out.rglob("part-*.safetensors"), key=lambda p: p.stat().st_size)
    return [str(p.relative_to(out)) for p in files[:6]]


def check_rank_file(out: Path, manifest: Manifest, rel: str, kind: str) -> None:
    report = Report("verify", 100)
    files = bounded(open_files, report, out, manifest, None)
    for rf in files.values():
        rf.close()
    if report.ok:  # accepted: the library reads it exactly as the reader does
        agrees_with_library(out / rel, read_header(out / rel))
        log("rank files", kind, "accepted, reads as the library reads it")
        return
    for p in report.problems:
        assert p.file == rel and "\n" not in p.line(), p.line()
    log("rank files", kind, "reported")


def _rank_case(out_copy, tmp_path, fuzz, full: bool):
    out = tmp_path / "out"
    shutil.copytree(out_copy, out, copy_function=os.link)
    manifest = Manifest.load(out)
    names = rank_files(out)
    originals = {n: (out / n).read_bytes() for n in names}

    def prop(data, kind):
        rel = data.draw(st.sampled_from(names))
        bad = data.draw(corrupted(originals[rel], kind))
        replace_file(out / rel, bad)
        try:
            if full:
                check_whole(out, rel, kind, bad != originals[rel])
            else:
                check_rank_file(out, manifest, rel, kind)
        finally:
            replace_file(out / rel, originals[rel])

    each_kind("verify and diff" if full else "rank files", fuzz, KINDS, prop)


def check_whole(out: Path, rel: str, kind: str, changed: bool) -> None:
    """verify must find any change; diff must name the file when it finds one (a header-only change
    that keeps every tensor's bytes is no difference to diff)."""
    for command, run in (("verify", lambda: verify(out, progress=False)),
                         ("diff", lambda: diff(out, str(out_source(out)), progress=False))):
        try:
            report = run()
        except LuciferError as e:
            one_line(e)
            log(f"{command} (whole)", kind, "refused")
            continue
        if command == "verify":
            assert report.ok != changed, report.problem_lines()
        assert all(p.file in (rel, None) or rel in p.message for p in report.problems[:1]), report.problem_lines()
        log(f"{command} (whole)", kind, "reported" if not report.ok else "no difference")


def out_source(out: Path) -> Path:
    return Path(Manifest.load(out).source.path)


@SIZE
def test_rank_file_reader(out_copy, tmp_path, fuzz):
    _rank_case(out_copy, tmp_path, fuzz, full=False)


@SIZE
def test_verify_and_diff(out_copy, tmp_path, fuzz):
    _rank_case(out_copy, tmp_path, fuzz, full=True)


# ---------------------------------------------------------------- the CLI, end to end


CLI_MEMORY = 4 << 30  # address space for one CLI process (torch maps a lot; the data needs little)


def run_cli(*args) -> subprocess.CompletedProcess:
    """The CLI in a fresh interpreter with at most CLI_MEMORY of address space."""
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (CLI_MEMORY, CLI_MEMORY))

    return run_process(*args, timeout=300, preexec_fn=limit)


def refused(model: Path) -> bool:
    try:
        open_checkpoint(model).close()
    except SourceError:
        return True
    return False


def _cli_case(model, out_copy, tmp_path, fuzz):
    shard = model / SHARD
    original = shard.read_bytes()
    out = tmp_path / "out"
    shutil.copytree(out_copy, out, copy_function=os.link)
    rel = rank_files(out)[0]
    rank_original = (out / rel).read_bytes()

    def prop(data, kind):
        replace_file(shard, data.draw(corrupted(original, kind)))
        try:
            if refused(model):  # an accepted (harmless) change has nothing to refuse
                before = digests(model)
                target = tmp_path / "converted"
                one_error(run_cli("convert", "--tp", 3, "--arch", "sm120", "--quiet", model, target), (2,), SHARD)
                assert not target.exists() and digests(model) == before
                log("cli convert", kind, "refused, nothing written")
        finally:
            replace_file(shard, original)
        bad = data.draw(corrupted(rank_original, kind))
        if bad == rank_original:
            return
        replace_file(out / rel, bad)
        try:
            before = digests(out / Path(rel).parent)
            one_error(run_cli("verify", "--quiet", out), (1,), rel)
            diffed = run_cli("diff", "--quiet", out, model)
            if diffed.returncode:  # a header-only change that keeps every tensor is no difference to diff
                one_error(diffed, (1, 2), rel)
            assert digests(out / Path(rel).parent) == before
            log("cli verify and diff", kind, "refused, nothing written")
        finally:
            replace_file(out / rel, rank_original)

    each_kind("cli", fuzz, KINDS, prop)


@SIZE
def test_cli(model, out_copy, tmp_path, fuzz):
    _cli_case(model, out_copy, tmp_path, fuzz)
