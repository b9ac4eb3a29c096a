"""`convert --ranks` / `--nnodes N --node-rank R` (issue 51, part 3): each node converts only its own
share. Its OUT is, but for `.lucifer/`, exactly what `stage` of the whole conversion writes for those
ranks (the full manifest byte for byte, the share record, the copies, COMPLETE), so verify, diff,
inspect and serve treat it as a staged share; a run killed part-way resumes to the same bytes; only
the same node's convert may resume or replace it."""
from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from helpers import cli_argv, run
from lucifer_shard.cli import cli
from lucifer_shard.engine import stwriter, writeloop
from lucifer_shard.engine.convert import convert
from lucifer_shard.model.options import Options
from lucifer_shard.output.share import NodeShare, read_share

MIB = 1 << 20
# The CLI flags of each layout and the Options the session's `converted` fixture takes for them.
LAYOUTS = {"model": ([], dict(arch=None, expert_layout="model", max_file_bytes=MIB)),
           "sm90": (["--arch", "sm90"], dict(arch="sm90", max_file_bytes=MIB))}
NODE1 = ["--nnodes", "3", "--node-rank", "1"]


def listing(root: Path) -> dict[str, bytes | None]:
    """Every folder (None) and file (its bytes) under `root`, but the conversion's state `.lucifer/`."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))
            if ".lucifer" not in p.relative_to(root).parts}


def node_convert(model: Path, out: Path, layout: str, flags: list[str], *extra: str):
    return run("convert", "--tp", 3, "--max-file-size", "1M", *LAYOUTS[layout][0], *flags, *extra, model, out)


def staged(converted, tmp_path: Path, layout: str, flags: list[str]) -> Path:
    """`stage` of the whole conversion (the session's, with the layout's options) for `flags`' ranks."""
    dest = tmp_path / "staged"
    r = run("stage", converted(**LAYOUTS[layout][1]), dest, *flags)
    assert r.exit_code == 0, r.output
    return dest


@pytest.mark.parametrize("layout,flags", [("model", NODE1), ("sm90", NODE1), ("model", ["--ranks", "0,2"])])
def test_a_nodes_convert_is_stage_of_the_whole(converted, tiny_pattern, tmp_path, layout, flags):
    want = staged(converted, tmp_path, layout, flags)
    out = tmp_path / "node"
    r = node_convert(tiny_pattern, out, layout, flags)
    assert r.exit_code == 0, r.output
    got = listing(out)
    assert got == listing(want)
    ranks = sorted({p.split("/")[1] for p in got if p.endswith(".safetensors")})
    assert ranks == (["rank-1"] if flags == NODE1 else ["rank-0", "rank-2"])
    assert sum(p.startswith("target/rank-") and p.endswith(".safetensors") for p in got) > 2 * len(ranks)  # parts
    assert (out / ".lucifer" / "conversion.json").is_file()  # state, as in every conversion's OUT
    written = sum(len(b) for p, b in got.items() if p.endswith(".safetensors"))
    assert f"{len([p for p in got if p.endswith('.safetensors')])} written" in r.stdout
    assert json.loads(run("inspect", "--json", out).stdout)["ok"]
    if flags == NODE1:
        assert r.stdout.strip().splitlines()[-1] == (f"next: lucifer-shard diff {out} (its ranks, against MODEL); "
                                                     f"lucifer-shard serve {out} --nnodes 3 --node-rank 1 "
                                                     f"--master-addr HOST")
    assert written > 0


def test_verify_diff_and_serve_take_it_as_a_share(tiny_pattern, tmp_path):
    out = tmp_path / "node1"
    assert node_convert(tiny_pattern, out, "model", NODE1).exit_code == 0
    r = run("verify", out)
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("share of rank(s) 1 of tp 3 (node 1 of 3): only its ranks are here and checked")
    assert json.loads(run("verify", "--json", out).stdout)["result"]["share"]["ranks"] == [1]
    r = run("diff", out)
    assert r.exit_code == 0 and "share of rank(s) 1 of tp 3" in r.stdout, r.output
    r = run("serve", out, "--nnodes", 3, "--node-rank", 1, "--master-addr", "127.0.0.1", "--dry-run")
    assert r.exit_code == 0, r.output
    assert "node 1 (this one): vllm serve" in r.stdout
    r = run("serve", out, "--nnodes", 3, "--node-rank", 2, "--master-addr", "127.0.0.1", "--dry-run")
    assert r.exit_code != 0 and "TP rank 2" in r.output  # another node's rank: named, as for a staged share


def test_plan_shows_what_the_nodes_convert_writes(tiny_pattern, tmp_path):
    """plan's per-node figure, its footprint with the same flags and convert's bytes written agree."""
    args = ["--tp", 3, "--max-file-size", "1M", *NODE1, tiny_pattern]
    doc = json.loads(run("plan", "--json", *args).stdout)["result"]
    fp = doc["footprint"]
    assert {(r["role"], r["rank"]) for r in fp["ranks"]} == {("target", 1), ("draft", 1)}
    wrote = json.loads(run("convert", "--json", *args, tmp_path / "node1").stdout)["result"]["bytes_written"]
    assert fp["write_bytes"] == doc["per_node"][1]["bytes"] == wrote
    whole = json.loads(run("plan", "--json", *args[:4], tiny_pattern).stdout)["result"]["footprint"]
    assert whole["write_bytes"] > 2 * fp["write_bytes"] and whole["read_bytes"] == fp["read_bytes"]


def _journal_lines(out: Path) -> int:
    try:
        return (out / ".lucifer" / "journal.jsonl").read_text().count("\n")
    except FileNotFoundError:
        return 0


def test_killed_part_way_then_resumed_is_the_same_share(converted, tiny_pattern, tmp_path):
    """SIGKILL between parts (as tests/test_reliability.py stops a conversion), then --resume."""
    want = staged(converted, tmp_path, "model", NODE1)
    out = tmp_path / "node1"
    cmd = cli_argv("convert", "--tp", "3", "--max-file-size", "1M", "-q", *NODE1, tiny_pattern, out)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None and _journal_lines(out) < 9:  # 3 parts, every rank's
        time.sleep(0.001)
    assert proc.poll() is None, "the conversion ended before it was killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "COMPLETE").exists() and not (out / "lucifer-share.json").exists()
    r = node_convert(tiny_pattern, out, "model", NODE1, "--resume")
    assert r.exit_code == 0, r.output
    assert " 0 kept from an earlier run" not in r.stdout
    assert listing(out) == listing(want)


def test_resume_keeps_the_other_ranks_digests_from_the_journal(converted, tiny_pattern, tmp_path, monkeypatch):
    """A stopped node's convert, resumed, hashes the other ranks only of the parts it redoes: a kept part's
    other-rank digests come from the journal (its source tensors are re-read for their digests anyway)."""
    options = Options(**{"tp": 3, **LAYOUTS["model"][1]})
    node = NodeShare((1,), 3, 1)
    out = tmp_path / "node1"
    real, calls = writeloop._write_part, []

    def stop_after_three(*a, **kw):
        if len(calls) == 3:
            raise KeyboardInterrupt
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(writeloop, "_write_part", stop_after_three)
    with pytest.raises(KeyboardInterrupt):
        convert(str(tiny_pattern), out, options, progress=False, node=node)
    monkeypatch.setattr(writeloop, "_write_part", real)
    hashed = []
    monkeypatch.setattr(stwriter.StreamHasher, "close",
                        lambda self, content=None, _c=stwriter.StreamHasher.close: hashed.append(self.path) or
                        _c(self, content))
    summary = convert(str(tiny_pattern), out, options, resume=True, progress=False, node=node)
    parts = len(list(out.rglob("*.safetensors")))
    assert summary.files_resumed == 3 and summary.files_written == parts - 3
    assert len(hashed) == 2 * (parts - 3)  # ranks 0 and 2 of each redone part, none of the kept ones
    assert listing(out) == listing(staged(converted, tmp_path, "model", NODE1))


@pytest.mark.parametrize("args,needle", [
    (["--ranks", "1", *NODE1], "pass the ranks the node runs: --ranks K[,K...] or --nnodes N --node-rank R"),
    (["--node-rank", "1"], "--nnodes and --node-rank go together"),
    (["--nnodes", "3"], "--nnodes and --node-rank go together"),
    (["--ranks", "3"], "--ranks '3': the output has TP ranks 0..2"),
    (["--ranks", "0,0"], "--ranks '0,0': rank 0 is named twice"),  # issue 61 G: accepted before, as --ranks 0
    (["--nnodes", "2", "--node-rank", "0"], "--nnodes 2: vLLM needs the world size (tp 3) to divide by the number"),
])
@pytest.mark.parametrize("command", ["convert", "plan"])
def test_flag_refusals_are_stages(tiny_pattern, tmp_path, args, needle, command):
    r = run(command, "--tp", 3, *args, tiny_pattern, tmp_path / "d")
    assert r.exit_code == 2 and needle in r.stderr and not (tmp_path / "d").exists(), r.output


def test_only_the_same_node_resumes_or_replaces_its_share(converted, tiny_pattern, tmp_path):
    out = tmp_path / "node1"
    assert node_convert(tiny_pattern, out, "model", NODE1).exit_code == 0
    before = listing(out)
    node2 = ("holds a conversion of rank(s) 1 of tp 3 (node 1 of 3), this command converts rank(s) 2 of tp 3 "
             "(node 2 of 3)")
    for extra in ([], ["--resume"], ["--force"]):
        for command in ("convert", "plan"):
            r = run(command, "--tp", 3, "--max-file-size", "1M", "--nnodes", 3, "--node-rank", 2, *extra, tiny_pattern,
                    out)
            assert r.exit_code != 0 and node2 in r.stderr, (command, extra, r.output)
        r = node_convert(tiny_pattern, out, "model", [], *extra)  # the whole conversion
        assert r.exit_code != 0 and "this command converts every rank" in r.stderr, r.output
    assert listing(out) == before
    r = node_convert(tiny_pattern, out, "model", NODE1, "--force")  # the same node may replace it
    assert r.exit_code == 0 and listing(out) == before, r.output
    (out / "lucifer-share.json").unlink()
    r = node_convert(tiny_pattern, out, "model", NODE1, "--resume")  # and repair it
    assert r.exit_code == 0 and "lucifer-share.json" in r.stdout and listing(out) == before, r.output
    assert read_share(out).ranks == (1,)


def test_a_share_stage_made_is_never_converted_into(converted, tiny_pattern, tmp_path):
    dest = staged(converted, tmp_path, "model", NODE1)
    before = listing(dest)
    for extra in (["--resume"], ["--force"]):
        r = node_convert(tiny_pattern, dest, "model", NODE1, *extra)
        assert r.exit_code != 0 and "written by stage" in r.stderr, r.output
    assert listing(dest) == before


def test_a_whole_output_is_not_resumed_as_a_node(converted, tiny_pattern, tmp_path):
    out = tmp_path / "whole"
    assert node_convert(tiny_pattern, out, "model", []).exit_code == 0
    r = node_convert(tiny_pattern, out, "model", NODE1, "--resume")
    assert r.exit_code != 0 and "holds a conversion of every rank, this command converts rank(s) 1" in r.stderr


def test_a_damaged_file_is_repaired_by_the_nodes_convert(tiny_pattern, tmp_path):
    """verify names the fix of a share convert wrote (its convert with --resume, not stage), and it works."""
    out = tmp_path / "node1"
    assert node_convert(tiny_pattern, out, "model", NODE1).exit_code == 0
    before = listing(out)
    part = out / "target/rank-1/part-00003.safetensors"
    data = bytearray(part.read_bytes())
    data[-5] ^= 1
    part.write_bytes(bytes(data))
    r = run("verify", out)
    assert r.exit_code == 1 and "run the node's convert again with --resume" in r.stderr and "stage" not in r.stderr
    r = node_convert(tiny_pattern, out, "model", NODE1, "--resume")
    assert r.exit_code == 0 and "rewrote target/rank-1/part-00003.safetensors, COMPLETE" in r.stdout, r.output
    assert listing(out) == before and run("verify", out).exit_code == 0


def test_help_teaches_a_nodes_convert():
    text = run("convert", "--help").stdout
    assert "--nnodes N --node-rank R    as vLLM computes them: node R of N runs ranks R*TP/N .. (R+1)*TP/N - 1" in text
    assert ("lucifer-shard convert --tp 3 --nnodes 3 --node-rank 1 deepseek-ai/DeepSeek-V4-Flash-0731 /data/share"
            in text)
    for command in ("convert", "plan", "stage"):  # one set of option texts (cli/group.node_options)
        assert re.search(r"--ranks K\[,K\.\.\.\] +The TP ranks the node runs, e\.g\. --ranks 1\.",
                         run(command, "--help").stdout), command


def test_the_room_convert_checks_is_the_nodes_and_within_plans(tiny_pattern, tmp_path):
    """convert's room check counts this node's files (and every rank's journal lines and the manifest),
    within what plan with the same flags asks for, and below a whole conversion's files."""
    from dataclasses import replace

    from lucifer_shard.engine.job import prepare
    from lucifer_shard.engine.outstate import conversion_record, planned_files, sizes_to_write

    options = Options(**{"tp": 3, **LAYOUTS["model"][1]})
    job = replace(prepare(str(tiny_pattern), options), node=NodeShare((1,), 3, 1))
    try:
        planned = planned_files(job)
        left = sum(sizes_to_write(job, planned, set(), conversion_record(job)))
    finally:
        job.ckpt.close()
    files = sum(e.bytes for rel, e in planned.items() if "/rank-1/" in rel)
    doc = json.loads(run("plan", "--json", "--tp", 3, "--max-file-size", "1M", *NODE1, tiny_pattern,
                         tmp_path / "node1").stdout)["result"]["footprint"]
    assert files < left <= doc["room"]["needed_bytes"] < sum(e.bytes for e in planned.values())
    assert doc["write_bytes"] == files
