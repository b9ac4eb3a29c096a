"""The command line as a user meets it: plan's report and footprint, convert's option rules, swapped
arguments, and the conventions every command shares (-q/-v, --json envelope, progress only on a
terminal, binary units, interrupt messages, exit codes)."""
from __future__ import annotations

import fcntl
import json
import math
import os
import pty
import re
import shutil
import struct
import subprocess
import sys
import termios
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers import CONFIGS, cli_argv, run, run_process
from lucifer_shard.cli import cli
from lucifer_shard.cli.console import Console
from lucifer_shard.units import size

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def flash_dir(tmp_path_factory):
    """A directory holding only the shipped config.json: enough to plan."""
    d = tmp_path_factory.mktemp("flash")
    shutil.copy(CONFIGS / "deepseek-v4-flash.json", d / "config.json")
    return d


def envelope(r) -> dict:
    def refuse(constant):  # the envelope is strict JSON: no NaN or Infinity
        raise ValueError(f"not JSON: {constant}")

    doc = json.loads(r.stdout, parse_constant=refuse)
    assert set(doc) == {"schema_version", "command", "ok", "error", "result"}, doc.keys()
    assert doc["schema_version"] == 2
    return doc


def small_disk(monkeypatch, free: int) -> None:
    """Make every filesystem report `free` bytes available (the real statvfs otherwise)."""
    real = os.statvfs

    def statvfs(path):
        st = real(path)
        return SimpleNamespace(f_bavail=free // st.f_frsize, f_frsize=st.f_frsize, f_files=st.f_files, f_favail=st.f_favail)

    monkeypatch.setattr(os, "statvfs", statvfs)


# ---------------------------------------------------------------- plan


def test_plan_prints_the_audit_table_and_the_footprint(flash_dir):
    r = run("plan", "--tp", 3, "--arch", "sm120", flash_dir)
    assert r.exit_code == 0, r.output
    rows = {line.split()[0]: line.split()[1:] for line in r.output.splitlines()[3:8]}
    assert rows["heads"][:4] == ["64", "72", "24", "24"]
    assert rows["groups"][:4] == ["8", "9", "3", "3"]
    assert rows["routed"][:4] == ["2048", "2112", "704", "768"]
    assert rows["shared"][:4] == ["2048", "2304", "768", "768"]
    assert rows["vocab"][:4] == ["129280", "129408", "43136", "43136"]
    assert "ffn.experts.{e}.w2.weight dim 1: r0 [0,352)+32  r1 [352,704)+32  r2 [704,1024)+64" in r.output
    assert "ffn.experts.{e}.w2.scale dim 1: r0 [0,22)+2  r1 [22,44)+2  r2 [44,64)+4" in r.output
    # per rank: tensors, files of at most 4 GiB, exact bytes on disk (data 59,232,049,084 + 15 headers; the parts
    # grouped by the shards that hold their sources, so the headers' order and padding differ from by-name grouping)
    assert re.search(r"target +0 +1502 +15 +59,232,229,684 +55\.16 GiB", r.output)
    assert re.search(r"draft +2 +39 +1 +1,376,049,540 +1\.28 GiB", r.output)
    assert re.search(r"read +148\.65 GiB", r.output) and re.search(r"write +169\.34 GiB +48 rank files", r.output)
    assert "room   not checked" in r.output
    assert re.search(r"time +\d+ min \d\d s +at 0\.60 GiB/s read \+ written", r.output)
    assert "bench/results.json" in r.output


def test_plan_json_carries_byte_counts(flash_dir, flash_cfg):
    from lucifer_shard.formats.dtypes import DTYPE_SIZE
    from lucifer_shard.model.tensorspecs import expected_sources

    doc = envelope(run("plan", "--tp", 3, "--arch", "sm90", "--json", flash_dir))
    assert doc["ok"] and doc["command"] == "plan" and doc["error"] is None
    res = doc["result"]
    assert res["moe_variant"] == "FLASHINFER_CUTLASS_MXFP4_BF16" and res["arch"] == "sm90"
    t = {x["name"]: x for x in res["roles"]["target"][2]["tensors"]}
    w2 = t["model.layers.5.ffn.experts.routed_experts.w2_weight"]
    assert w2["sources"] == [{"key": "layers.5.ffn.experts.{e}.w2.weight", "dim": 1, "start": 704, "length": 320,
                              "dst_offset": 0, "segment": 384}]
    assert t["model.layers.5.ffn.experts.routed_experts.w13_weight_scale"]["shape"] == [256, 24, 32, 16, 16]
    assert len(res["roles"]["draft"]) == 3
    fp = res["footprint"]
    source = sum(DTYPE_SIZE[s.dtype] * math.prod(s.shape) for s in expected_sources(flash_cfg).values())
    assert fp["read_bytes"] == source  # every source tensor is converted (MTP included)
    assert fp["write_bytes"] == sum(r["bytes"] for r in fp["ranks"]) and fp["files"] == 48
    assert [(r["role"], r["rank"], r["files"]) for r in fp["ranks"]] == [
        ("target", 0, 15), ("target", 1, 15), ("target", 2, 15), ("draft", 0, 1), ("draft", 1, 1), ("draft", 2, 1)]
    assert fp["room"] is None and fp["estimate"]["seconds"] > 0
    more = envelope(run("plan", "--tp", 3, "--arch", "sm90", "--json", "--max-file-size", "1GiB", flash_dir))
    assert more["result"]["footprint"]["files"] > 48  # files per rank follow --max-file-size


def test_plan_any_tp(flash_dir):
    for tp in range(1, 9):
        assert run("plan", "--tp", tp, "--arch", "sm120", flash_dir).exit_code == 0


def test_plan_without_arch_says_so(flash_dir):
    r = run("plan", "--tp", 3, flash_dir)  # model layout, convert's default without --arch
    assert r.exit_code == 0 and "any arch (model layout: vLLM lays the experts out at load" in r.output
    assert envelope(run("plan", "--tp", 3, "--json", flash_dir))["result"]["arch"] is None
    assert envelope(run("plan", "--tp", 3, "--arch", "sm90", "--json", flash_dir))["result"]["arch"] == "sm90"


def test_plan_refuses_kernel_layout_without_arch_as_convert_does(tiny_pattern, tmp_path):
    """plan refuses what convert refuses: the same command line, the same line, exit 2 (issue 34)."""
    planned = run("plan", "--tp", 3, "--expert-layout", "kernel", tiny_pattern, tmp_path / "out")
    converting = run("convert", "--tp", 3, "--expert-layout", "kernel", tiny_pattern, tmp_path / "out")
    assert planned.exit_code == converting.exit_code == 2 and planned.output == converting.output
    assert planned.output.startswith("error: --arch is required with --expert-layout kernel")


def test_plan_checks_the_room_on_outs_filesystem(flash_dir, tmp_path, monkeypatch):
    out = tmp_path / "deeper" / "out"  # not there yet: its nearest existing parent's filesystem counts
    r = run("plan", "--tp", 3, "--arch", "sm120", flash_dir, out)
    free = shutil.disk_usage(tmp_path).free
    if free > 170 << 30:
        assert r.exit_code == 0 and ": enough" in r.output
    small_disk(monkeypatch, 100 << 30)
    r = run("plan", "--tp", 3, "--arch", "sm120", flash_dir, out)
    assert r.exit_code == 1, r.output
    assert re.search(r"100\.00 GiB +free on \S+ \(\w+.*\), the filesystem of", r.output)
    assert "NOT enough: free 69.35 GiB more" in r.output
    assert r.output.strip().splitlines()[-1].startswith(f"error: {out}: not enough room: 169.35 GiB to write, "
                                                         "100.00 GiB free on ")
    doc = envelope(run("plan", "--tp", 3, "--arch", "sm120", "--json", flash_dir, out))
    room = doc["result"]["footprint"]["room"]
    assert not doc["ok"] and doc["error"]["exit_code"] == 1 and room["free_bytes"] == 100 << 30
    assert not room["enough"] and room["needed_bytes"] > doc["result"]["footprint"]["write_bytes"]


def test_the_time_estimate_is_the_measured_benchmark():
    """The throughput the estimate uses is the one `make bench` recorded (bench/results.json)."""
    from lucifer_shard.model.footprint import MEASURED_BYTES_PER_S

    run_ = json.loads((REPO / "bench" / "results.json").read_text())["summary"]["L1 convert w1"]
    assert MEASURED_BYTES_PER_S == pytest.approx(run_["moved"] / run_["wall"], rel=1e-9)


def test_plan_predicts_convert_exactly(tiny_pattern, tmp_path):
    """plan's files, their exact sizes and the bytes read are what convert then writes and reads."""
    args = ["--tp", 3, "--arch", "sm120", "--max-file-size", "1MiB"]
    fp = envelope(run("plan", *args, "--json", tiny_pattern))["result"]["footprint"]
    out = tmp_path / "out"
    done = envelope(run("convert", *args, "--json", tiny_pattern, out))["result"]
    written = sorted(p for p in out.rglob("*.safetensors"))
    per_rank = {}
    for p in written:
        role, rank = p.relative_to(out).parts[:2]
        files, n = per_rank.get((role, int(rank[5:])), (0, 0))
        per_rank[(role, int(rank[5:]))] = (files + 1, n + p.stat().st_size)
    assert [(r["role"], r["rank"], r["files"], r["bytes"]) for r in fp["ranks"]] == [
        (role, rank, files, n) for (role, rank), (files, n) in sorted(per_rank.items(), key=lambda kv: (
            kv[0][0] != "target", kv[0]))]
    assert done["bytes_read"] == fp["read_bytes"] and done["files_written"] == fp["files"] == len(written)
    meta = sum(p.stat().st_size for p in (out / "lucifer-manifest.json", out / ".lucifer" / "journal.jsonl"))
    assert meta <= fp["metadata_bytes"]


# ---------------------------------------------------------------- convert: options and room


def test_kernel_layout_requires_arch(tiny_pattern, tmp_path):
    r = run("convert", "--tp", 3, "--expert-layout", "kernel", tiny_pattern, tmp_path / "out")
    assert r.exit_code == 2 and not (tmp_path / "out").exists()
    assert r.output.startswith("error: --arch is required") and "sm120|sm121|sm100|sm90" in r.output
    assert r.output.count("\n") == 1


@pytest.mark.parametrize("arch,layout", [(None, "model"), ("sm90", "kernel"), ("sm120", "kernel")])
def test_default_expert_layout_is_what_stock_vllm_serves(tiny_pattern, tmp_path, arch, layout):
    """A plain `convert --tp 3 MODEL OUT` writes model layout for any GPU family; with --arch, that family's
    kernel layout (stock vLLM 0.33.0 with the plugin loads both)."""
    out = tmp_path / "out"
    r = run("convert", "--tp", 3, *(["--arch", arch] if arch else []), tiny_pattern, out)
    assert r.exit_code == 0, r.output
    man = json.loads((out / "lucifer-manifest.json").read_text())
    assert (man["arch"], man["expert_layout"]) == (arch, layout)


@pytest.mark.parametrize("args,needle", [
    (["--arch", "sm120", "--flashinfer-layout", "legacy"], "--flashinfer-layout applies only to --arch sm90"),
    (["--arch", "sm90", "--expert-layout", "model", "--flashinfer-layout", "folded"], "--flashinfer-layout applies"),
    (["--arch", "sm120", "--resume", "--force"], "--resume keeps the finished files of OUT and --force deletes them"),
    (["--arch", "sm120", "--align", "24"], "--align 24 is not a power of two"),
    (["--arch", "sm120", "--max-file-size", "4 potatoes"], "--max-file-size '4 potatoes': expected a size"),
    (["--arch", "sm120", "-q", "-v"], "-q and -v exclude each other"),
])
def test_options_that_do_not_apply_are_refused(tiny_pattern, tmp_path, args, needle):
    r = run("convert", "--tp", 3, *args, tiny_pattern, tmp_path / "out")
    assert r.exit_code == 2 and r.output.startswith("error: ") and needle in r.output, r.output
    assert not (tmp_path / "out").exists()


def test_sm90_kernel_layout_is_warned_about(tiny_pattern, tmp_path):
    r = run("convert", "--tp", 3, "--arch", "sm90", "--flashinfer-layout", "legacy", tiny_pattern, tmp_path / "out")
    assert r.exit_code == 0, r.output
    assert "warning: no vetted vLLM build serves sm90 kernel layout of FlashInfer's legacy generation" in r.stderr
    r = run("convert", "--tp", 3, "--arch", "sm90", tiny_pattern, tmp_path / "out2")
    assert r.exit_code == 0 and "warning" not in r.stderr, r.output
    assert "FlashInfer's SM90 CUTLASS MoE module" in r.stderr and "--expert-layout model" in r.stderr


def test_convert_refuses_to_start_without_room(tiny_pattern, tmp_path, monkeypatch):
    out = tmp_path / "out"
    small_disk(monkeypatch, 10 << 20)
    r = run("convert", "--tp", 3, "--arch", "sm120", tiny_pattern, out)
    assert r.exit_code == 2 and not out.exists(), r.output
    (line,) = r.output.splitlines()
    assert re.fullmatch(rf"error: {out}: not enough room on \S+ \(.+\): 6\d\.\d\d MiB still to write \([\d,]+ "
                        r"bytes: rank files, journal, manifest, config and tokenizer copies\), 10\.00 MiB free; free "
                        r"5\d\.\d\d MiB more, then run the same command again, or choose an OUT on another filesystem", line), line


def test_force_counts_the_output_it_replaces(converted, tiny_pattern, tmp_path, monkeypatch):
    """--force removes the old output first: its bytes count as room (and nothing is removed on refusal).
    The old output is the smaller --no-mtp conversion, so the new one needs more than it gives back."""
    out = tmp_path / "out"
    shutil.copytree(converted(mtp=False), out)
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    old = sum(p.stat().st_blocks * 512 for p in out.rglob("*") if p.is_file())  # the blocks deleting frees
    small_disk(monkeypatch, 1 << 20)
    r = run("convert", "--tp", 3, "--arch", "sm120", "--force", tiny_pattern, out)
    assert r.exit_code == 2 and f"(+{size(old)} this run removes)" in r.output, r.output
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before
    small_disk(monkeypatch, 32 << 20)
    assert old + (32 << 20) > 72 << 20  # the old output plus 32 MiB hold the new one
    assert run("convert", "--tp", 3, "--arch", "sm120", "--force", "-q", tiny_pattern, out).exit_code == 0


# ---------------------------------------------------------------- swapped arguments


def test_swapped_arguments_are_named(converted, tiny_pattern, tmp_path):
    out = converted()
    r = run("convert", "--tp", 3, "--arch", "sm120", out, tiny_pattern)
    assert r.exit_code == 2 and "convert takes MODEL OUT" in r.output and "the arguments are swapped" in r.output
    assert f"lucifer-shard convert ... {tiny_pattern} {out}" in r.output
    r = run("diff", tiny_pattern, out)
    assert r.exit_code == 2 and "diff takes OUT MODEL" in r.output and f"diff ... {out} {tiny_pattern}" in r.output
    r = run("check-numerics", tiny_pattern, out)
    assert r.exit_code == 2 and "check-numerics takes OUT MODEL" in r.output
    r = run("plan", "--tp", 3, "--arch", "sm120", out, tiny_pattern)
    assert r.exit_code == 2 and "plan takes MODEL OUT" in r.output


# ---------------------------------------------------------------- conventions


def test_every_command_has_quiet_verbose_and_json():
    for name, command in cli.commands.items():
        text = run(name, "--help").output
        for option in ("-q, --quiet", "-v, --verbose", "--json"):
            assert option in text, (name, option)


def test_help_teaches_the_flow_and_the_exit_codes():
    out = run("--help").output
    for cmd in ("plan", "convert", "synth", "diff", "doctor", "serve"):
        assert cmd in out
    assert "serve out/ --draft -- --max-model-len 65536" in out
    for code in ("0  ok", "1  a check found a problem", "2  refused: the command line", "70  a bug",
                 "130  Ctrl-C  [interrupted]", "141  stdout was closed"):
        assert code in out
    assert "--resume" in run("convert", "--help").output


@pytest.mark.parametrize("edit,needle", [
    ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, "model_type='llama'"),
    ({"o_groups": None}, "missing field(s) o_groups"),
    ({"dspark_config": {}}, "dspark_config"),
    ({"compress_ratios": [0, 4]}, "compress_ratios has 2 entries"),
])
def test_bad_config_is_one_line_also_in_json(tmp_path, edit, needle):
    cfg = json.loads((CONFIGS / "deepseek-v4-flash.json").read_text())
    cfg.update(edit)
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    r = run("plan", "--tp", "3", "--arch", "sm120", tmp_path)
    assert r.exit_code == 2 and needle in r.output
    assert r.output.startswith("error: ") and r.output.count("\n") == 1
    r = run("plan", "--tp", "3", "--arch", "sm120", "--json", tmp_path)
    doc = envelope(r)
    assert r.exit_code == 2 and not doc["ok"] and doc["result"] is None
    assert doc["error"]["exit_code"] == 2 and doc["error"]["kind"] == "source" and needle in doc["error"]["message"]


def test_verify_json_on_failure(converted, tmp_path):
    r = run("verify", "--json", tmp_path)  # no output at all
    doc = envelope(r)
    assert r.exit_code == 2 and doc["command"] == "verify" and not doc["ok"] and doc["error"]["kind"] == "output"
    out = tmp_path / "out"
    shutil.copytree(converted(), out)
    (out / "COMPLETE").unlink()
    r = run("verify", "--json", "-q", out)
    doc = envelope(r)
    assert r.exit_code == 1 and not doc["ok"] and doc["error"]["exit_code"] == 1
    assert doc["result"]["problem_count"] >= 1 and "COMPLETE" in doc["result"]["problems"][0]["message"]


INTERRUPTED = {
    "convert": ("lucifer_shard.engine.convert.convert", ["--tp", "3", "--arch", "sm120", "{model}", "{tmp}/out"],
                "interrupted: finished files are kept; run the same command with --resume to continue"),
    "diff": ("lucifer_shard.proof.diff.diff", ["{out}"], "interrupted: diff stopped before checking everything (it "
                                                         "writes nothing); run it again"),
    "verify": ("lucifer_shard.proof.verify.verify", ["{out}"],
               "interrupted: verify stopped before checking everything (it writes nothing); run it again"),
    "check-numerics": ("lucifer_shard.proof.check_numerics.check_numerics", ["{out}"],
                       "interrupted: check-numerics stopped before checking everything (it writes nothing); run it "
                       "again"),
    "synth": ("lucifer_shard.engine.synth.synth", ["tiny", "{tmp}/synth"],
              "interrupted: {tmp}/synth holds a partial checkpoint; remove it and run synth again"),
    "plan": ("lucifer_shard.cli.planview.plan_footprint_of", ["--tp", "3", "--arch", "sm120", "{model}"],
             "interrupted: plan writes nothing"),
}


@pytest.mark.parametrize("command", sorted(INTERRUPTED))
def test_ctrl_c_message_per_command(command, converted, tiny_pattern, tmp_path, monkeypatch):
    target, args, message = INTERRUPTED[command]
    module, name = target.rsplit(".", 1)

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(__import__(module, fromlist=[name]), name, interrupted)
    fill = {"model": tiny_pattern, "tmp": tmp_path, "out": converted()}
    argv = [command, *(a.format(**fill) for a in args)]
    r = run(*argv)
    message = message.format(**fill)
    assert r.exit_code == 130 and r.output.strip() == message, r.output
    doc = envelope(run(*argv, "--json"))
    assert doc["error"] == {"kind": "interrupted", "message": message, "exit_code": 130, "remedy": None}


def test_verbose_logs_and_quiet_silences(tiny_pattern, tmp_path):
    r = run("convert", "--tp", 3, "--arch", "sm120", "-v", "--max-file-size", "1MiB", tiny_pattern, tmp_path / "a")
    assert r.exit_code == 0
    assert re.search(r"lucifer_shard\.convert: room: [\d.]+ MiB to write, [\d.]+ \w+ free on ", r.stderr)
    assert re.search(r"lucifer_shard\.convert: target part 0: 3 file\(s\), [\d.]+ MiB", r.stderr)
    r = run("convert", "--tp", 3, "--arch", "sm90", "--flashinfer-layout", "legacy", "-q", tiny_pattern, tmp_path / "b")
    assert r.exit_code == 0 and r.stderr.startswith("warning: ")  # warnings survive -q, nothing else is said
    assert r.stderr.count("\n") == 1
    assert r.stdout == f"{tmp_path / 'b'}\n"  # -q: only OUT, for $(...)


def test_units_are_binary_everywhere(converted, tiny_pattern, flash_dir):
    out = converted()
    texts = [run("diff", out).output, run("verify", out).output, run("inspect", out).output,
             run("plan", "--tp", 3, "--arch", "sm120", flash_dir).output]
    for text in texts:
        assert re.search(r"\d (KiB|MiB|GiB)", text), text
        assert not re.search(r"\d (kB|KB|MB|GB|TB)\b|MB/s|GB/s", text), text


def test_progress_only_on_a_terminal(monkeypatch):
    class Tty:
        def __init__(self, tty):
            self.tty = tty

        def isatty(self):
            return self.tty

    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    monkeypatch.setattr(sys, "stderr", Tty(True))
    assert Console().progress and not Console(verbosity=-1).progress
    monkeypatch.setenv("TQDM_DISABLE", "1")
    assert not Console().progress
    monkeypatch.setenv("TQDM_DISABLE", "0")
    assert Console().progress
    monkeypatch.setattr(sys, "stderr", Tty(False))
    assert not Console().progress


def _on_a_terminal(args: list[str], env: dict) -> tuple[int, str]:
    """Run the CLI with stderr on a pseudo-terminal; (exit code, what the terminal showed)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))  # a terminal 100 columns wide
    proc = subprocess.Popen(cli_argv(*args), stdout=subprocess.DEVNULL,
                            stderr=slave, env={**os.environ, **env})
    os.close(slave)
    shown = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        shown += chunk
    os.close(master)
    return proc.wait(), shown.decode(errors="replace")


def test_progress_bar_on_a_real_terminal_and_tqdm_disable(tmp_path):
    rc, shown = _on_a_terminal(["synth", "tiny", str(tmp_path / "a")], {"TQDM_DISABLE": ""})
    assert rc == 0 and "synth tiny: 100%" in shown and "MiB/s" in shown  # tqdm's bar, binary units
    rc, shown = _on_a_terminal(["synth", "tiny", str(tmp_path / "b")], {"TQDM_DISABLE": "1"})
    assert rc == 0 and shown == ""


# ---------------------------------------------------------------- Hugging Face repo ids


def _plan_subprocess(env: dict) -> subprocess.CompletedProcess:
    """huggingface_hub reads its environment at import: run in a fresh process."""
    return run_process("plan", "--tp", "3", "--arch", "sm120", "deepseek-ai/DeepSeek-V4-Flash",
                       env={**os.environ, "HF_HUB_OFFLINE": "1", **env})


def test_repo_id_offline_without_cache(tmp_path):
    r = _plan_subprocess({"HF_HUB_CACHE": str(tmp_path / "hub")})
    assert r.returncode == 2 and "not in the local Hugging Face cache" in r.stderr


def test_repo_id_from_the_cache(tmp_path):
    """A repo id resolves through huggingface_hub's cache layout (models--org--name/snapshots/<rev>), offline."""
    repo = tmp_path / "hub" / "models--deepseek-ai--DeepSeek-V4-Flash"
    snap = repo / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    shutil.copy(CONFIGS / "deepseek-v4-flash.json", snap / "config.json")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    r = _plan_subprocess({"HF_HUB_CACHE": str(tmp_path / "hub")})
    assert r.returncode == 0, r.stderr
    assert "routed        2048      2112       704           768" in r.stdout


@pytest.mark.parametrize("lead", [["--json"], ["-q", "--json"], ["-v"]])
def test_conventions_before_the_command_are_the_commands(lead, converted):
    """Issue 43 finding 16: `lucifer-shard --json inspect OUT` was refused ("No such option"); the flags every
    command takes are taken before its name as after it."""
    out = converted()
    before = run(*lead, "inspect", out)
    after = run("inspect", out, *lead)
    assert before.exit_code == after.exit_code == 0 and before.stdout == after.stdout, before.output
