"""Faults and bad inputs, with real processes and real OS limits: nothing lost, nothing half-written.

Every case runs the real CLI in a subprocess and checks: a non-zero exit with one `error:` line
(no traceback) naming what is wrong; no incomplete file under a final name; and the source's
bytes and mtimes unchanged. With LUCIFER_RELIABILITY_LOG=path each case appends its outcome as a
JSON line (docs/reliability.md is rendered from it by tools/reliability_table.py).
"""
from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors import safe_open

LOG = os.environ.get("LUCIFER_RELIABILITY_LOG")
SHARD = "model-00003-of-00005.safetensors"  # holds layer 3's attention and experts 0-4 (tiny preset)


def cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lucifer_shard.cli", *map(str, args)],
                          capture_output=True, text=True, **kw)


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


def one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode not in (0, None), proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error: ")]
    assert len(errors) == 1, proc.stderr
    for n in needles:
        assert n in errors[0], (n, errors[0])
    return errors[0]


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
def clean_out(tiny_pattern, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("clean") / "out"
    proc = cli("convert", "--tp", 3, "--arch", "sm120", "--quiet", "--max-file-size", "1MiB", tiny_pattern, out)
    assert proc.returncode == 0, proc.stderr
    return out


# ---------------------------------------------------------------- crashes


def _wait_for(pred, proc, timeout=60.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None and not pred():
        time.sleep(0.001)
    assert proc.poll() is None, "the conversion ended before the fault point was reached"


def _start(src: Path, out: Path) -> subprocess.Popen:
    args = ["convert", "--tp", "3", "--arch", "sm120", "--quiet", "--max-file-size", "1MiB", str(src), str(out)]
    return subprocess.Popen([sys.executable, "-m", "lucifer_shard.cli", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _journal_lines(out: Path) -> int:
    j = out / ".lucifer" / "journal.jsonl"
    return j.read_text().count("\n") if j.exists() else 0


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
        # A FIFO in place of the manifest's temporary file blocks the writer exactly there.
        _wait_for(lambda: _journal_lines(out) >= 1, proc)
        os.mkfifo(out / ".lucifer-manifest.json.partial")
        _wait_for(lambda: _journal_lines(out) == _journal_lines(clean_out), proc)
        time.sleep(0.5)  # every rank file is journaled: the process now blocks opening the FIFO
        assert proc.poll() is None
    proc.kill()
    proc.wait()
    assert not (out / "COMPLETE").exists() and not (out / "lucifer-manifest.json").exists()
    whole_files(out)
    refused = cli("verify", out)
    one_line_error(refused)
    if point == "manifest":
        (out / ".lucifer-manifest.json.partial").unlink()
    resumed = cli("convert", "--tp", 3, "--arch", "sm120", "--quiet", "--max-file-size", "1MiB", "--resume", tiny_pattern, out)
    assert resumed.returncode == 0, resumed.stderr
    assert tree(out) == tree(clean_out)
    assert snapshot(tiny_pattern) == before
    record(f"SIGKILL {point}", "verify refuses; --resume finishes byte-identical to a clean run", refused)


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
    resumed = cli("convert", "--tp", 3, "--arch", "sm120", "--quiet", "--max-file-size", "1MiB", "--resume", tiny_pattern, out)
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

    proc = cli("convert", "--tp", 3, "--arch", "sm120", "--quiet", tiny_pattern, out, preexec_fn=cap)
    msg = one_line_error(proc, ".part-00000.safetensors.partial", "bytes", "--resume")
    assert not list(out.rglob("*.partial")) and not list(out.rglob("*.safetensors"))
    assert snapshot(tiny_pattern) == before
    resumed = cli("convert", "--tp", 3, "--arch", "sm120", "--quiet", "--resume", tiny_pattern, out)
    assert resumed.returncode == 0, resumed.stderr
    record("write fails (RLIMIT_FSIZE 2 MiB, as a full disk)", "nothing final written; source unchanged", proc, msg)


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
    "missing tensor": (lambda s: (_rewrite(s / SHARD, lambda h: h.pop("layers.3.attn.wo_b.scale")),
                                  _move_tensor(s, lambda m: m.pop("layers.3.attn.wo_b.scale"))),
                       ["missing tensor", "layers.3.attn.wo_b.scale"]),
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
    proc = cli("convert", "--tp", 3, "--arch", "sm120", "--quiet", src, out)
    msg = one_line_error(proc, *needles)
    no_final_files(out)
    assert snapshot(src) == before
    record(f"bad source: {case}", "refused before or while writing; nothing left under final names", proc, msg)


# ---------------------------------------------------------------- bad use


def test_out_inside_model(tiny_pattern, tmp_path):
    src = tmp_path / "model"
    shutil.copytree(tiny_pattern, src)
    before = snapshot(src)
    proc = cli("convert", "--tp", 3, "--arch", "sm120", "--quiet", src, src / "out")
    msg = one_line_error(proc, "inside MODEL")
    assert not (src / "out").exists() and snapshot(src) == before
    record("OUT inside MODEL", "refused, nothing created", proc, msg)


def test_complete_out_needs_force(tiny_pattern, clean_out, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(clean_out, out)
    proc = cli("convert", "--tp", 3, "--arch", "sm120", "--quiet", "--max-file-size", "1MiB", tiny_pattern, out)
    msg = one_line_error(proc, "complete conversion", "--force")
    assert tree(out) == tree(clean_out)
    forced = cli("convert", "--tp", 3, "--arch", "sm120", "--quiet", "--max-file-size", "1MiB", "--force", tiny_pattern, out)
    assert forced.returncode == 0 and tree(out) == tree(clean_out)
    record("OUT already complete, no --force", "refused, output untouched; --force replaces it", proc, msg)


def test_foreign_nonempty_out(tiny_pattern, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    proc = cli("convert", "--tp", 3, "--arch", "sm120", "--quiet", "--force", tiny_pattern, out)
    msg = one_line_error(proc, "not a lucifer-shard output")
    assert (out / "notes.txt").read_text() == "mine"
    record("OUT holds other files (even with --force)", "refused, files untouched", proc, msg)


@pytest.mark.parametrize("case", ["missing", "a file", "no config"])
def test_unreadable_model(tmp_path, case):
    model = tmp_path / "model"
    if case == "a file":
        model.write_text("x")
    elif case == "no config":
        model.mkdir()
    proc = cli("convert", "--tp", 3, "--arch", "sm120", "--quiet", model, tmp_path / "out")
    msg = one_line_error(proc, str(model))
    assert not (tmp_path / "out").exists()
    record(f"MODEL {case}", "refused", proc, msg)


@pytest.mark.parametrize("tp", [0, 9])
def test_tp_the_plan_cannot_serve(tiny_pattern, tmp_path, tp):
    proc = cli("convert", "--tp", tp, "--arch", "sm120", "--quiet", tiny_pattern, tmp_path / "out")
    msg = one_line_error(proc, f"--tp {tp}")
    assert not (tmp_path / "out").exists()
    record(f"--tp {tp}", "refused before anything is written", proc, msg)


def test_resume_with_other_options_or_source(tiny_pattern, tmp_path):
    out = tmp_path / "out"
    proc = _start(tiny_pattern, out)
    _wait_for(lambda: _journal_lines(out) >= 3, proc)
    proc.kill()
    proc.wait()
    other = cli("convert", "--tp", 3, "--arch", "sm90", "--quiet", "--max-file-size", "1MiB", "--resume",
                tiny_pattern, out)
    msg = one_line_error(other, "--resume", "other options", "arch: 'sm120' -> 'sm90'")
    record("--resume with other options", "refused, names what differs", other, msg)
    src = tmp_path / "model"
    shutil.copytree(tiny_pattern, src)
    _config(src, rms_norm_eps=1e-5)
    changed = cli("convert", "--tp", 3, "--arch", "sm120", "--quiet", "--max-file-size", "1MiB", "--resume", src, out)
    msg = one_line_error(changed, "--resume", "source checkpoint changed")
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
    stale = cli("convert", "--tp", 3, "--arch", "sm120", "--quiet", "--max-file-size", "1MiB", "--resume", same_shapes, out)
    msg = one_line_error(stale, "--resume", "source checkpoint changed", SHARD)
    record("--resume after the source bytes changed (same shapes)", "refused, names the file", stale, msg)
