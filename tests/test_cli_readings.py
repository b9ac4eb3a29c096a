"""How the CLI reads what a user gives it and says what it found (issue 53, point 7): a local path is never
taken for a repo id and a missing owner/name is told both ways; the shipped configs by name from anywhere;
the help speaks of the draft (MTP or DSpark) and says what --tp 3 means; what an output serves on (diff, doctor),
a b12x route included; the fix a copy of an output needs (a serving copy, a share without its record); a
truncated file counted once; a wrong share's fix said once; --headless after `--`; synth's help."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import run, run_process
from lucifer_shard.outnames import STATE_DIR
from lucifer_shard.output.manifest import REPAIR
from lucifer_shard.output.share import SHARE_NAME
from lucifer_shard.source.checkpoint import SHIPPED_CONFIGS, is_repo_id


def offline(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """huggingface_hub reads its environment at import: a fresh process, offline, with an empty cache."""
    return run_process(*args, cwd=cwd, env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cwd / "hub")})


def copy_of(out: Path, dst: Path, keep_state: bool = False) -> Path:
    """OUT hard-linked into `dst` (without .lucifer/, as a serving host gets it, unless `keep_state`)."""
    shutil.copytree(out, dst, copy_function=os.link,
                    ignore=None if keep_state else shutil.ignore_patterns(STATE_DIR))
    return dst


def truncate(path: Path, size: int) -> None:
    """A truncated copy in place of a hard link (the original stays whole)."""
    data = path.read_bytes()[:size]
    path.unlink()
    path.write_bytes(data)


# ---------------------------------------------------------------- MODEL: a path, a repo id, a shipped config


@pytest.mark.parametrize("model,repo", [("demo/nope", True), ("x/config.json", False), ("./a/b", False),
                                        ("/a/b", False), ("~/b", False), ("a/b/c", False), ("deepseek-ai/X", True)])
def test_only_a_missing_owner_name_is_a_repo_id(model, repo):
    assert is_repo_id(model) is repo


def test_a_path_that_exists_is_never_a_repo_id(tmp_path, monkeypatch):
    (tmp_path / "demo" / "model").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert not is_repo_id("demo/model") and is_repo_id("demo/other")


def test_a_missing_owner_name_tells_both_readings_and_a_json_path_one(tmp_path):
    r = offline("plan", "--tp", "3", "demo/nope", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith(
        "error: demo/nope: no such directory here, and as a Hugging Face repo id: config.json of demo/nope at main "
        "is not in the local Hugging Face cache"), r.stderr
    r = offline("convert", "--tp", "3", "demo/nope", str(tmp_path / "out"), cwd=tmp_path)
    assert r.returncode == 2 and "demo/nope: no such directory here, and as a Hugging Face repo id: " in r.stderr
    r = offline("plan", "--tp", "3", "x/config.json", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("error: x/config.json: no such directory or file (") \
        and "hf download" not in r.stderr, r.stderr
    assert "deepseek-v4-flash-0731" in r.stderr  # the shipped configs, by name


@pytest.mark.parametrize("name", [*SHIPPED_CONFIGS, "deepseek-v4-flash-0731.json"])
def test_plan_takes_a_shipped_config_by_name_from_anywhere(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no clone here: the package's own configs
    r = run("plan", "--tp", 3, name)
    assert r.exit_code == 0, r.output
    assert "padded" in r.output or "V4.1" in r.output


def test_convert_refuses_a_shipped_config_and_the_help_names_them(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = run("convert", "--tp", 3, "deepseek-v4-flash", tmp_path / "out")
    assert r.exit_code == 2 and "is a shipped config.json; convert needs the checkpoint directory" in r.output
    assert not (tmp_path / "out").exists()
    text = " ".join(run("--help", terminal_width=100).output.split())
    assert "never taken for a repo id" in text and "plan --tp 3 deepseek-v4-flash-0731" in text
    assert all(name in text for name in SHIPPED_CONFIGS)


# ---------------------------------------------------------------- help: the draft, --tp, synth


def test_help_speaks_of_the_draft_not_mtp_only():
    group = " ".join(run("--help").output.split())
    assert "--mtp" not in group and "serve out/ --draft" in group and "(MTP or DSpark)" in group
    convert = " ".join(run("convert", "--help", terminal_width=200).output.split())
    assert "the draft: MTP layer or DSpark drafter (unless --no-mtp)" in convert
    assert "Leave the draft model (draft/: the MTP layer, or DeepSeek-V4-Flash-0731's DSpark drafter) out." in convert
    assert "mission" not in convert and "do not divide by it, so the rank files are padded" in convert


def test_synth_help_keeps_the_preset_names_whole():
    r = run("synth", "--help", terminal_width=60)
    assert r.exit_code == 0 and "PRESET OUT" in r.output.splitlines()[0], r.output
    assert not [line for line in r.output.splitlines() if line.rstrip().endswith("-") and "{" in line]


# ---------------------------------------------------------------- what an output serves on


def test_diff_and_doctor_say_what_the_output_serves_on(converted, tiny_pattern, tmp_path):
    cases = {converted(arch=None, expert_layout="model"): "arch any (converted without --arch)",
             converted(): "arch sm120",
             converted(arch=None, expert_layout="model", moe_backend="b12x"): "arch sm120/sm121 only (--moe-backend b12x)"}
    for out, words in cases.items():
        text = run("diff", out, tiny_pattern).output
        assert f"tp 3  {words}  experts" in text and "None" not in text, text
        assert f"tp 3, {words}, experts" in run("doctor", out).output


# ---------------------------------------------------------------- the fix a copy needs


def test_a_truncated_file_is_one_problem_with_the_fix_a_serving_copy_needs(converted, tiny_pattern, tmp_path):
    out = copy_of(converted(arch=None, expert_layout="model"), tmp_path / "copy")
    part = out / "target" / "rank-1" / "part-00000.safetensors"
    whole = part.stat().st_size
    for size in (1000, whole // 2):  # inside the header, then inside the tensors
        truncate(part, size)
        for command in (["verify", out], ["diff", out, tiny_pattern]):
            r = run(*command)
            assert r.exit_code == 1 and "FAILED: 1 " in r.output, r.output
            line = r.stderr.strip().splitlines()[-1]
            assert "(truncated)" in line and "copy the damaged files again" in line, line
            assert line.count("copy the damaged files again") == 1 and REPAIR not in line, line  # not convert's fix


def test_a_share_copied_without_its_record_is_told_to_bring_it_not_to_convert(converted, tmp_path):
    out = converted(arch=None, expert_layout="model")
    share = tmp_path / "node1"
    assert run("stage", out, share, "--nnodes", 3, "--node-rank", 1).exit_code == 0
    (share / SHARE_NAME).unlink()
    r = run("verify", share)
    assert r.exit_code == 1
    line = r.stderr.strip().splitlines()[-1]
    assert f"OUT holds rank(s) 1 of tp 3 only, as a node's share does, but no {SHARE_NAME}: copy {SHARE_NAME}" in line
    assert "lucifer-shard stage OUT DEST --ranks 1" in line and "same convert command" not in line, line


def test_diff_on_a_share_says_why_no_shard_digest_is_complete(converted, tiny_pattern, tmp_path):
    share = tmp_path / "node1"
    assert run("stage", converted(), share, "--nnodes", 3, "--node-rank", 1).exit_code == 0
    r = run("diff", share, tiny_pattern)
    assert r.exit_code == 0, r.output
    assert "a node's share reads only its ranks' slices" in r.output and "could not be read" not in r.output


def test_the_wrong_share_states_its_fix_once(converted, tmp_path):
    share = tmp_path / "node1"
    assert run("stage", converted(), share, "--nnodes", 3, "--node-rank", 1).exit_code == 0
    r = run("serve", share, "--nnodes", 3, "--node-rank", 0, "--master-addr", "h", "--dry-run")
    line = next(x for x in r.output.splitlines() if x.startswith("[FAIL] output node ranks"))
    assert line.count("lucifer-shard stage") == 1 and " -> start this node with the --node-rank its share was staged for" in line


def test_headless_after_the_double_dash_names_who_adds_it(converted):
    r = run("serve", converted(), "--dry-run", "--", "--headless")
    assert r.exit_code == 2 and "--headless is in the vLLM arguments but serve adds it itself on the nodes above 0" \
        in r.stderr and "pass it before" not in r.stderr, r.stderr
