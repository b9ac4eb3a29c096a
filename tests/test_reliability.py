"""Faults and bad inputs, with real processes and real OS limits: nothing lost, nothing half-written.

Every case runs the real CLI in a subprocess and checks: a non-zero exit with one `error:` line
(no traceback) naming what is wrong; no incomplete file under a final name; and the source's
bytes and mtimes unchanged. With LUCIFER_RELIABILITY_LOG=path each case appends its outcome as a
JSON line (docs/evidence/reliability.md is rendered from it by tools/reliability_table.py).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import fcntl
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import save_file

from helpers import cli_argv, one_error, run_process

LOG = os.environ.get("LUCIFER_RELIABILITY_LOG")
COMPLETE = "COMPLETE"
SHARD = "model-00003-of-00005.safetensors"  # holds layer 3's attention and experts 0-4 (tiny preset)


def snapshot(root: Path) -> dict[str, tuple[str, int]]:
    return {p.name: (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(Path(root).iterdir()) if p.is_file()}


def record(case: str, outcome: str, proc: subprocess.CompletedProcess | None = None, message: str = "") -> None:
    if not LOG:
        return
    line = message or (proc.stderr.strip().splitlines() or [""])[-1] if proc else message
    with open(LOG, "a") as f:
        f.write(json.dumps({"case": case, "exit": proc.returncode if proc else None, "message": line,
                            "outcome": outcome}) + "\n")


def no_final_files(out: Path) -> None:
    if out.exists():
        assert not list(out.rglob("*.safetensors")) and not (out / "COMPLETE").exists()
        assert not (out / "lucifer-manifest.json").exists()


def whole_files(out: Path) -> None:
    """Every file under a final name reads back completely."""
    for path in out.rglob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            for k in f.keys():
                f.get_tensor(k)


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and ".lucifer" not in p.parts}


@pytest.fixture(scope="module")
def clean_out(converted) -> Path:
    """A clean run with CONVERT's options: the session's conversion (in process, the same bytes as the CLI's)."""
    return converted(arch="sm120", max_file_bytes=1 << 20)


# ---------------------------------------------------------------- crashes


def _wait_for(pred, proc, timeout=60.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None and not pred():
        time.sleep(0.001)
    assert proc.poll() is None, "the conversion ended before the fault point was reached"


CONVERT = ("convert", "--tp", "3", "--arch", "sm120", "--quiet", "--max-file-size", "1MiB")


def _start(src: Path, out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(cli_argv(*CONVERT, *extra, src, out),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_as_from_a_terminal)


def _as_from_a_terminal() -> None:
    """SIGINT as a terminal leaves it: a test run started in the background by a shell without job control (CI
    under nohup, say) inherits SIGINT ignored, Python keeps it so, and Ctrl-C would then never reach the
    conversion (exit 0 where 130 is due)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _journal_lines(out: Path) -> int:
    try:  # a --force writer deletes the old journal while this polls it
        return (out / ".lucifer" / "journal.jsonl").read_text().count("\n")
    except FileNotFoundError:
        return 0


@pytest.mark.parametrize("point", ["first-file", "between-files", "manifest"])
def test_sigkill_then_resume(tiny_pattern, clean_out, tmp_path, point):
    before = snapshot(tiny_pattern)
    out = tmp_path / "out"
    proc = _start(tiny_pattern, out)
    if point == "first-file":
        _wait_for(lambda: (out / "target/rank-0/.part-00000.safetensors.partial").exists(), proc)
    elif point == "between-files":
        _wait_for(lambda: _journal_lines(out) >= 9, proc)
    else:
        # A write lease on the source's config.json blocks the writer when it opens it to copy it,
        # right before the manifest (a FIFO in the manifest's place, as before, is now refused).
        _wait_for(lambda: _journal_lines(out) >= 1, proc)
        signal.signal(signal.SIGIO, signal.SIG_IGN)  # the kernel signals the lease's holder on a break
        lease = os.open(tiny_pattern / "config.json", os.O_RDONLY)
        try:
            fcntl.fcntl(lease, fcntl.F_SETLEASE, fcntl.F_WRLCK)
            _wait_for(lambda: _journal_lines(out) == _journal_lines(clean_out), proc)
            time.sleep(0.5)  # every rank file is journaled: the process now blocks opening config.json
            assert proc.poll() is None
            proc.kill()
        finally:
            os.close(lease)
    proc.kill()
    proc.wait()
    assert not (out / "COMPLETE").exists() and not (out / "lucifer-manifest.json").exists()
    whole_files(out)
    refused = run_process("verify", out)
    one_error(refused, None)
    resumed = run_process(*(a for a in CONVERT if a != "--quiet"), "--resume", tiny_pattern, out)  # its report: not -q
    assert resumed.returncode == 0, resumed.stderr
    # the kernel released the dead writer's lock; its record is recognised and taken over
    assert f"ended without releasing it (pid {proc.pid} on" in resumed.stdout, resumed.stdout
    assert tree(out) == tree(clean_out)
    assert snapshot(tiny_pattern) == before
    record(f"SIGKILL {point}", "verify refuses; --resume takes over the dead writer's lock and finishes "
           "byte-identical to a clean run", refused)


def test_sigint_is_clean_and_resumable(tiny_pattern, clean_out, tmp_path):
    out = tmp_path / "out"
    proc = _start(tiny_pattern, out)
    _wait_for(lambda: _journal_lines(out) >= 3, proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "--resume" in err
    assert not list(out.rglob("*.partial")), "temporary files were left behind"
    whole_files(out)
    resumed = run_process("convert", "--tp", 3, "--arch", "sm120", "--quiet", "--max-file-size", "1MiB", "--resume", tiny_pattern, out)
    assert resumed.returncode == 0 and tree(out) == tree(clean_out)
    record("SIGINT (Ctrl-C)", "exit 130, temporary files removed; --resume finishes",
           subprocess.CompletedProcess([], 130, "", err), message=err.strip().splitlines()[-1])


def test_file_size_limit(tiny_pattern, clean_out, tmp_path):
    """RLIMIT_FSIZE makes a real write fail with EFBIG, like a full disk."""
    before = snapshot(tiny_pattern)
    out = tmp_path / "out"
    limit = 2 << 20

    def cap():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = run_process("convert", "--tp", 3, "--arch", "sm120", "--quiet", tiny_pattern, out, preexec_fn=cap)
    msg = one_error(proc, None, ".part-00000.safetensors.partial", "bytes", "--resume")
    assert not list(out.rglob("*.partial")) and not list(out.rglob("*.safetensors"))
    assert snapshot(tiny_pattern) == before
    resumed = run_process("convert", "--tp", 3, "--arch", "sm120", "--quiet", "--resume", tiny_pattern, out)
    assert resumed.returncode == 0, resumed.stderr
    record("write fails (RLIMIT_FSIZE 2 MiB, the file size limit)", "nothing final written; source unchanged", proc, msg)


# ---------------------------------------------------------------- one writer per OUT


MODES = {"plain": (), "--force": ("--force",), "--resume": ("--resume",)}


def _holder(out: Path) -> int | None:
    try:
        return json.loads((out / ".lucifer" / "lock").read_text() or "null")["pid"]
    except (OSError, ValueError, TypeError):
        return None


def everything(root: Path) -> dict[str, bytes]:
    """Every file under OUT, state folder, lock and temporary files included."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("first", list(MODES))
def test_second_writer_is_refused(tiny_pattern, clean_out, tmp_path, first):
    """A writer stopped mid-conversion (SIGSTOP: it holds OUT's lock) makes every second writer,
    plain, --force or --resume, exit at once naming it and change nothing; verify and diff say OUT
    is being written. The first writer then finishes byte-identical to a clean run."""
    out = tmp_path / "out"
    if first == "--force":
        shutil.copytree(clean_out, out)
    elif first == "--resume":
        crashed = _start(tiny_pattern, out)
        _wait_for(lambda: _journal_lines(out) >= 3, crashed)
        crashed.kill()
        crashed.wait()
    lines = 0 if first == "--force" else _journal_lines(out)
    w1 = _start(tiny_pattern, out, *MODES[first])
    _wait_for(lambda: _holder(out) == w1.pid and not (out / COMPLETE).exists() and _journal_lines(out) > lines, w1)
    w1.send_signal(signal.SIGSTOP)
    try:
        before = everything(out)
        for second, extra in MODES.items():
            proc = run_process(*CONVERT, *extra, tiny_pattern, out)
            msg = one_error(proc, None, "locked by another writer", f"pid {w1.pid} on ", "started ")
            assert proc.returncode == 2 and everything(out) == before, second
        record(f"second convert (plain, --force, --resume) while a {first} convert writes OUT",
               "each refused at once, nothing changed; the first finishes byte-identical", proc, msg)
        if first == "plain":
            for command in (("verify", out), ("diff", out, tiny_pattern)):
                proc = run_process(*command)
                msg = one_error(proc, None, "is being written by lucifer-shard convert", f"pid {w1.pid} on ")
                assert proc.returncode == 2 and everything(out) == before
                record(f"{command[0]} while convert writes OUT", "refused (not reported as damage)", proc, msg)
    finally:
        w1.send_signal(signal.SIGCONT)
    _, err = w1.communicate(timeout=300)
    assert w1.returncode == 0, err
    assert tree(out) == tree(clean_out)
    assert (out / ".lucifer" / "lock").read_text() == ""  # released cleanly: no holder record left


# ---------------------------------------------------------------- internal errors


def cli_with_fault(target: str, after: int, *args) -> subprocess.CompletedProcess:
    """The CLI in a subprocess where `module.function` raises RuntimeError from its call number
    `after + 1` on: an unexpected exception, as a bug would raise one."""
    module, function = target.rsplit(".", 1)
    code = (f"import sys, {module} as m\n"
            f"real, calls = m.{function}, []\n"
            f"def failing(*a, **k):\n"
            f"    calls.append(1)\n"
            f"    if len(calls) > {after}:\n"
            f"        raise RuntimeError('injected fault: {function} call ' + str(len(calls)))\n"
            f"    return real(*a, **k)\n"
            f"m.{function} = failing\n"
            f"from lucifer_shard.cli import main\n"
            f"main()\n")
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True)


def internal_error(proc: subprocess.CompletedProcess, function: str) -> tuple[str, Path]:
    """The one `error: internal error:` line (exit 70), and the log it names, which holds the traceback."""
    assert proc.returncode == 70, proc.stderr
    msg = one_error(proc, 70, "internal error: RuntimeError: injected fault", "; details in ", internal=True)
    log = Path(msg.rsplit("; details in ", 1)[1])
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and f"injected fault: {function}" in text
    return msg, log


def test_internal_error_in_convert(tiny_pattern, clean_out, tmp_path):
    out = tmp_path / "out"
    proc = cli_with_fault("lucifer_shard.engine.writeloop._write_part", 3, *CONVERT, tiny_pattern, out)
    msg, log = internal_error(proc, "_write_part")
    assert log.parent == out / ".lucifer"
    assert not list(out.rglob("*.partial")) and not (out / COMPLETE).exists()
    whole_files(out)
    assert (out / ".lucifer" / "lock").read_text() == ""  # the lock was released
    resumed = run_process(*CONVERT, "--resume", tiny_pattern, out)
    assert resumed.returncode == 0 and tree(out) == tree(clean_out)
    record("internal error in convert (injected exception)", "exit 70, traceback in OUT/.lucifer/; "
           "--resume finishes byte-identical", proc, msg.replace(str(out), "…/out"))


def test_internal_error_in_verify(clean_out, tmp_path):
    """A check writes nothing into OUT, not even the log of its own bug: that goes to a temporary file."""
    out = tmp_path / "out"
    shutil.copytree(clean_out, out, copy_function=os.link)
    before = everything(out)
    proc = cli_with_fault("lucifer_shard.proof.verify._check_replicas", 0, "verify", out)
    msg, log = internal_error(proc, "_check_replicas")
    assert log.parent == Path(tempfile.gettempdir()) and everything(out) == before
    log.unlink()
    record("internal error in verify (injected exception)", "exit 70, traceback in a temporary file; nothing "
           "written into OUT", proc, re.sub(r"/tmp/\S+\.log", "/tmp/lucifer-shard-…-internal-error-….log", msg))


def test_internal_error_without_out(tiny_pattern):
    proc = cli_with_fault("lucifer_shard.cli.planview.plan_lines", 0, "plan", "--tp", 3, tiny_pattern)
    msg, log = internal_error(proc, "plan_lines")
    assert log.parent == Path(tempfile.gettempdir()) and log.name.startswith("lucifer-shard-")
    log.unlink()
    record("internal error in plan (injected exception, no OUT)", "exit 70, traceback in a temporary file", proc,
           re.sub(r"/tmp/\S+\.log", "/tmp/lucifer-shard-…-internal-error-….log", msg))


# ---------------------------------------------------------------- a full disk


@pytest.fixture
def small_fs(tmp_path):
    """make(bytes) -> the mount point of a fresh tmpfs of that size (needs root), unmounted after."""
    points = []

    def make(size: int) -> Path:
        point = tmp_path / f"fs{len(points)}"
        point.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)],
                              capture_output=True, text=True)
        if proc.returncode:
            pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip()}); the full-disk tests need root")
        points.append(point)
        return point

    yield make
    for point in points:
        subprocess.run(["umount", "-l", str(point)], check=True)


def _output_bytes(out: Path) -> int:
    """What a conversion writes: every file but the lock."""
    return sum(p.stat().st_size for p in out.rglob("*") if p.is_file() and p.name != "lock")


def _bytes_stated(msg: str) -> int:
    """The exact byte count an out-of-room error names: `... still to write (71,466,096 bytes...`."""
    return int(re.search(r"still to write \(([\d,]+) bytes", msg)[1].replace(",", ""))


def test_disk_too_small_is_refused_before_writing(tiny_pattern, clean_out, small_fs):
    fs = small_fs(16 << 20)
    proc = run_process(*CONVERT, tiny_pattern, fs / "out")
    msg = one_error(proc, None, str(fs), "(tmpfs)", "not enough room", " more, then run the same command")
    assert _bytes_stated(msg) == _output_bytes(clean_out)  # exact, from the plan
    assert not (fs / "out").exists()
    record("disk too small (tmpfs of 16 MiB)", "refused before writing, with the exact bytes needed; "
           "nothing created", proc, msg.replace(str(fs), "/mnt/small"))


def test_disk_fills_mid_write_then_resume(tiny_pattern, clean_out, small_fs):
    """The disk fills up under a running conversion (another file grows): the error says how many
    bytes are still to write, exactly, on which filesystem; nothing is half-written; after space
    is freed, --resume finishes byte-identical to a clean run."""
    before = snapshot(tiny_pattern)
    fs = small_fs(_output_bytes(clean_out) + (4 << 20))
    out = fs / "out"
    proc = _start(tiny_pattern, out)
    _wait_for(lambda: _journal_lines(out) >= 3, proc)
    proc.send_signal(signal.SIGSTOP)
    try:
        with open(fs / "filler", "wb", buffering=0) as f, contextlib.suppress(OSError):  # another program
            while True:                                                                    # fills the disk
                f.write(b"\0" * (1 << 20))
    finally:
        proc.send_signal(signal.SIGCONT)
    _, err = proc.communicate(timeout=300)
    failed = subprocess.CompletedProcess([], proc.returncode, "", err)
    msg = one_error(failed, None, "No space left on device", str(fs), "--resume")
    clean = {e["path"]: line for line in (clean_out / ".lucifer/journal.jsonl").read_text().splitlines(True)
             for e in [json.loads(line)]}
    done = {json.loads(line)["path"] for line in (out / ".lucifer/journal.jsonl").read_text().splitlines()}
    left = [p for p in clean if p not in done]
    expected = sum((clean_out / p).stat().st_size + len(clean[p]) for p in left) + sum(
        p.stat().st_size for p in clean_out.iterdir() if p.is_file() and not p.name.endswith(".safetensors"))
    assert left and _bytes_stated(msg) == expected
    assert not list(out.rglob("*.partial")) and not (out / COMPLETE).exists()
    whole_files(out)
    (fs / "filler").unlink()
    resumed = run_process(*CONVERT, "--resume", tiny_pattern, out)
    assert resumed.returncode == 0, resumed.stderr
    assert tree(out) == tree(clean_out) and snapshot(tiny_pattern) == before
    record("disk fills up mid-write (tmpfs, another file takes the rest)", "exact bytes still to write named; "
           "nothing half-written; --resume after freeing space finishes byte-identical", failed,
           msg.replace(str(fs), "/mnt/small"))


# ---------------------------------------------------------------- bad source checkpoints


def _rewrite(path: Path, edit) -> None:
    """Rewrite a shard with an edited header (the data section is kept as it is)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    edit(header)
    new = json.dumps(header, separators=(",", ":")).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(len(new).to_bytes(8, "little") + new + raw[8 + n:])


def _drop(path: Path, key: str) -> None:
    """Rewrite a shard without one tensor (a well-formed file that simply lacks it)."""
    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k != key}
        meta = f.metadata()
    save_file(tensors, str(path), metadata=meta)


def _first(header: dict, suffix: str) -> str:
    return next(k for k in header if k.endswith(suffix))


def _flip_ff(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    start, _ = header["layers.3.ffn.experts.2.w2.scale"]["data_offsets"]
    raw[8 + n + start + 5] = 0xFF
    path.write_bytes(bytes(raw))


def _move_tensor(src: Path, edit_index):
    index_path = src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    edit_index(index["weight_map"])
    index_path.write_text(json.dumps(index))


def _config(src: Path, **changes) -> None:
    """Edit config.json; a value of None removes the field."""
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(changes)
    (src / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))


BAD_SOURCES = {
    "truncated shard": (lambda s: os.truncate(s / SHARD, (s / SHARD).stat().st_size - 4096),
                        [SHARD, "truncated"]),
    "corrupt header JSON": (lambda s: (s / SHARD).write_bytes(
        (s / SHARD).read_bytes()[:8] + b"{\x00garbage" + (s / SHARD).read_bytes()[18:]), [SHARD, "JSON"]),
    "oversized header": (lambda s: (s / SHARD).write_bytes((1 << 40).to_bytes(8, "little") + (s / SHARD).read_bytes()[8:]),
                         [SHARD, "header length"]),
    "data offsets out of range": (lambda s: _rewrite(s / SHARD, lambda h: h[_first(h, "w2.scale")].update(
        data_offsets=[o + (1 << 30) for o in h[_first(h, "w2.scale")]["data_offsets"]])), [SHARD, "w2.scale", "truncated"]),
    "overlapping data offsets": (lambda s: _rewrite(s / SHARD, lambda h: h["layers.3.ffn.experts.1.w2.scale"].update(
        data_offsets=h["layers.3.ffn.experts.0.w2.scale"]["data_offsets"])), [SHARD, "overlap", "w2.scale"]),
    "wrong dtype": (lambda s: _rewrite(s / SHARD, lambda h: h["layers.3.ffn.experts.0.w1.weight"].update(dtype="U8")),
                    [SHARD, "layers.3.ffn.experts.0.w1.weight", "U8", "I8"]),
    "wrong shape": (lambda s: _rewrite(s / SHARD, lambda h: h["layers.3.ffn.experts.0.w1.weight"].update(
        shape=list(reversed(h["layers.3.ffn.experts.0.w1.weight"]["shape"])))), [SHARD, "layers.3.ffn.experts.0.w1.weight"]),
    "missing tensor": (lambda s: (_drop(s / SHARD, "layers.3.attn.wo_b.scale"),
                                  _move_tensor(s, lambda m: m.pop("layers.3.attn.wo_b.scale"))),
                       ["missing tensor", "layers.3.attn.wo_b.scale"]),
    "gap between tensors": (lambda s: _rewrite(s / SHARD, lambda h: h.pop("layers.3.attn.wo_b.scale")),
                            [SHARD, "belong to no tensor", "gaps"]),
    "tensor in a shard, not in the index": (lambda s: _move_tensor(s, lambda m: m.pop("layers.3.attn.wo_b.scale")),
                                            [SHARD, "layers.3.attn.wo_b.scale", "not listed in model.safetensors.index.json"]),
    "index entry its shard lacks": (lambda s: _drop(s / SHARD, "layers.3.attn.wo_b.scale"),
                                    ["model.safetensors.index.json", "layers.3.attn.wo_b.scale", SHARD, "does not hold it"]),
    "index entry names another shard": (lambda s: _move_tensor(s, lambda m: m.update(
        {"layers.3.attn.wo_b.scale": "model-00004-of-00005.safetensors"})),
        ["model.safetensors.index.json", "layers.3.attn.wo_b.scale", "model-00004-of-00005.safetensors", SHARD]),
    "index entry outside the model folder": (lambda s: _move_tensor(s, lambda m: m.update(
        {"norm.weight": "../model-00001-of-00005.safetensors"})), ["norm.weight", "outside the model directory"]),
    "same tensor in two shards": (lambda s: _rewrite(s / "model-00004-of-00005.safetensors", lambda h: h.update(
        {"layers.3.attn.wo_b.scale": h.pop(_first(h, "attn_norm.weight"))})), ["layers.3.attn.wo_b.scale", "stored twice"]),
    "index names a missing file": (lambda s: _move_tensor(s, lambda m: m.update({"norm.weight": "model-00009-of-00009.safetensors"})),
                                   ["model-00009-of-00009.safetensors", "missing"]),
    "E8M0 scale byte 0xFF": (lambda s: _flip_ff(s / SHARD), [SHARD, "layers.3.ffn.experts.2.w2.scale", "0xFF"]),
    "config of another model": (lambda s: _config(s, model_type="llama", architectures=["LlamaForCausalLM"]),
                                ["config.json", "llama"]),
    "config inconsistent with tensors": (lambda s: _config(s, n_routed_experts=16), ["missing tensor", "config.json", "experts.1"]),
    "config missing a field": (lambda s: _config(s, o_groups=None), ["config.json", "o_groups"]),
    "unknown tensor (schema variant)": (lambda s: (_rewrite(s / SHARD, lambda h: h.update(
        {"layers.3.dspark.proj.weight": h.pop("layers.3.attn.wo_b.scale")})), _move_tensor(s, lambda m: m.update(
            {"layers.3.dspark.proj.weight": m.pop("layers.3.attn.wo_b.scale")}))), [SHARD, "layers.3.dspark.proj.weight", "unknown"]),
}


@pytest.mark.parametrize("case", list(BAD_SOURCES))
def test_bad_source(tiny_pattern, tmp_path, case):
    corrupt, needles = BAD_SOURCES[case]
    src = tmp_path / "model"
    shutil.copytree(tiny_pattern, src)
    corrupt(src)
    before = snapshot(src)
    out = tmp_path / "out"
    proc = run_process("convert", "--tp", 3, "--arch", "sm120", "--quiet", src, out)
    msg = one_error(proc, None, *needles)
    no_final_files(out)
    assert snapshot(src) == before
    record(f"bad source: {case}", "refused before or while writing; nothing left under final names", proc, msg)


# ---------------------------------------------------------------- bad use


def test_out_inside_model(tiny_pattern, tmp_path):
    src = tmp_path / "model"
    shutil.copytree(tiny_pattern, src)
    before = snapshot(src)
    proc = run_process("convert", "--tp", 3, "--arch", "sm120", "--quiet", src, src / "out")
    msg = one_error(proc, None, "inside MODEL")
    assert not (src / "out").exists() and snapshot(src) == before
    record("OUT inside MODEL", "refused, nothing created", proc, msg)


def test_complete_out_needs_force(tiny_pattern, clean_out, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(clean_out, out)
    proc = run_process("convert", "--tp", 3, "--arch", "sm120", "--quiet", "--max-file-size", "1MiB", tiny_pattern, out)
    msg = one_error(proc, None, "complete conversion", "--force")
    assert tree(out) == tree(clean_out)
    forced = run_process("convert", "--tp", 3, "--arch", "sm120", "--quiet", "--max-file-size", "1MiB", "--force", tiny_pattern, out)
    assert forced.returncode == 0 and tree(out) == tree(clean_out)
    record("OUT already complete, no --force", "refused, output untouched; --force replaces it", proc, msg)


def test_foreign_nonempty_out(tiny_pattern, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    proc = run_process("convert", "--tp", 3, "--arch", "sm120", "--quiet", "--force", tiny_pattern, out)
    msg = one_error(proc, None, "not a lucifer-shard output")
    assert (out / "notes.txt").read_text() == "mine" and list(out.iterdir()) == [out / "notes.txt"]
    record("OUT holds other files (even with --force)", "refused, files untouched", proc, msg)


@pytest.mark.parametrize("case", ["missing", "a file", "no config"])
def test_unreadable_model(tmp_path, case):
    model = tmp_path / "model"
    if case == "a file":
        model.write_text("x")
    elif case == "no config":
        model.mkdir()
    proc = run_process("convert", "--tp", 3, "--arch", "sm120", "--quiet", model, tmp_path / "out")
    msg = one_error(proc, None, str(model))
    assert not (tmp_path / "out").exists()
    record(f"MODEL {case}", "refused", proc, msg)


@pytest.mark.parametrize("tp", [0, 9])
def test_tp_the_plan_cannot_serve(tiny_pattern, tmp_path, tp):
    proc = run_process("convert", "--tp", tp, "--arch", "sm120", "--quiet", tiny_pattern, tmp_path / "out")
    msg = one_error(proc, None, f"--tp {tp}")
    assert not (tmp_path / "out").exists()
    record(f"--tp {tp}", "refused before anything is written", proc, msg)


def test_resume_with_other_options_or_source(tiny_pattern, tmp_path):
    out = tmp_path / "out"
    proc = _start(tiny_pattern, out)
    _wait_for(lambda: _journal_lines(out) >= 3, proc)
    proc.kill()
    proc.wait()
    other = run_process("convert", "--tp", 3, "--arch", "sm90", "--quiet", "--max-file-size", "1MiB", "--resume",
                tiny_pattern, out)
    msg = one_error(other, None, "--resume", "other options", "--arch sm120 -> --arch sm90")
    record("--resume with other options", "refused, names what differs", other, msg)
    src = tmp_path / "model"
    shutil.copytree(tiny_pattern, src)
    _config(src, rms_norm_eps=1e-5)
    changed = run_process("convert", "--tp", 3, "--arch", "sm120", "--quiet", "--max-file-size", "1MiB", "--resume", src, out)
    msg = one_error(changed, None, "--resume", "source checkpoint changed")
    record("--resume against a changed source", "refused, names what differs", changed, msg)
    same_shapes = tmp_path / "retrained"  # same headers and sizes, other bytes: a fine-tune
    shutil.copytree(tiny_pattern, same_shapes)
    os.replace(out, tmp_path / "out2")
    proc = _start(same_shapes, out)
    _wait_for(lambda: _journal_lines(out) >= 3, proc)
    proc.kill()
    proc.wait()
    raw = bytearray((same_shapes / SHARD).read_bytes())
    raw[-1] ^= 0x01
    (same_shapes / SHARD).write_bytes(bytes(raw))
    stale = run_process("convert", "--tp", 3, "--arch", "sm120", "--quiet", "--max-file-size", "1MiB", "--resume", same_shapes, out)
    msg = one_error(stale, None, "--resume", "source checkpoint changed", SHARD)
    record("--resume after the source bytes changed (same shapes)", "refused, names the file", stale, msg)
