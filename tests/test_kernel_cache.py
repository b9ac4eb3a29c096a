"""Kernel caches that travel with the share (issue 65, item 4), on CPU: the key and what changes it, `cache record`
then verify, every refusal (a file changed, added or removed, a key of another host, a record this tool did not
write), the restore into a fresh cache root, stage and fetch carrying the record, serve's one line and the
variables it sets. The host's facts are injected (`HOST`): this box has no GPU; the real reading of them runs in
`test_host_facts_are_read_without_torch_or_vllm`."""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from lucifer_shard.output import kernel_cache as okc
from lucifer_shard.output.manifest_types import Manifest
from lucifer_shard.runtime_shim.serving import doctor, kernel_cache as kc, serve
from lucifer_shard.runtime_shim.serving.doctor import OK, Check

from helpers import one_error, own_copy, run

HOST = {"gpu": "NVIDIA H100 80GB HBM3", "capability": "9.0", "driver": "580.95.05", "cuda": "13.0", "vllm": "0.34.0",
        "vllm_commit": "0123abcd", "torch": "2.14.0+cu130", "flashinfer": "0.7.4", "triton": "3.8.0"}
COMPILED = {"triton/ab12/kernel.cubin": b"\x7fELF triton", "vllm/torch_compile_cache/h1/rank_0_0/model": b"graph",
            "deep_gemm/cache/kernel.so": b"dg" * 1000, "flashinfer/.cache/flashinfer/0.7.4/90/cached_ops/x.so": b"fi"}
VARIABLES = {"VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "DG_JIT_CACHE_DIR", "TILELANG_CACHE_DIR", "CUTE_DSL_CACHE_DIR",
             "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", "FLASHINFER_WORKSPACE_BASE"}


@pytest.fixture
def share(converted, tmp_path) -> Path:
    """A converted output of this test's own (hard links: the session's output is never written)."""
    return own_copy(converted(), tmp_path / "share")


@pytest.fixture
def here(monkeypatch):
    """This host is HOST, and a vetted serving environment as far as the preflight goes (tests/test_serve_cli.py)."""
    monkeypatch.setattr(kc, "host_facts", lambda: dict(HOST))
    passed = [Check("vllm", OK, "vetted build")]
    monkeypatch.setattr(doctor, "doctor_report", lambda out=None, mtp=False, node_ranks=None: passed)
    monkeypatch.setattr(doctor, "quick_checks", lambda out, mtp=False, node_ranks=None, manifest=None: passed)


def key_of(out: Path, host: dict = HOST, args: tuple[str, ...] = (), draft: str | None = None,
           tokens: int | None = None) -> dict:
    manifest = Manifest.load(out)
    return kc.cache_key(host, kc.model_geometry(manifest), kc.serve_options(manifest.tp_size, draft, tokens, args))


def start(out: Path, host: dict = HOST, **kw) -> kc.Start:
    """A real start's kernel-cache step (what serve does just before exec)."""
    return kc.prepare_start(out, key_of(out, host, **kw))


def compile_into(out: Path, files: dict[str, bytes] = COMPILED) -> None:
    """What vLLM's compilers would write into the run root during a start."""
    for rel, data in files.items():
        path = out / "kernel-cache" / "run" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def recorded(out: Path, files: dict[str, bytes] = COMPILED) -> Path:
    """OUT after a cold start that compiled `files`, recorded: its record's files/ folder."""
    assert not start(out).warm
    compile_into(out, files)
    doc, _ = kc.cache_command("record", out, HOST)
    assert doc["files"] == len(files)
    return out / "kernel-cache" / "files"


def tree_of(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------- the key


def test_every_field_changes_the_key(converted, share):
    base = key_of(share)
    digests = {okc.key_digest(base)}
    for name in HOST:
        digests.add(okc.key_digest(key_of(share, {**HOST, name: HOST[name] + "x"})))
    for args in (["--kv-cache-dtype", "fp8"], ["--max-num-batched-tokens", "8192"], ["--enforce-eager"],
                 ["--cudagraph-capture-sizes", "1", "2", "4"], ["--max-cudagraph-capture-size", "64"],
                 ["-O3"], ["-cc.mode=3"], ["--compilation-config", '{"mode":3}'], ["--max-num-seqs", "8"]):
        digests.add(okc.key_digest(key_of(share, args=tuple(args))))
    digests.add(okc.key_digest(key_of(share, draft="mtp", tokens=1)))
    digests.add(okc.key_digest(key_of(share, draft="mtp", tokens=2)))
    other = Manifest.load(converted(arch=None, expert_layout="model"))  # another geometry: the output's side
    tp1 = Manifest.load(converted(tp=1))
    for manifest in (other, tp1):
        digests.add(okc.key_digest(kc.cache_key(HOST, kc.model_geometry(manifest),
                                                kc.serve_options(manifest.tp_size, None, None, ()))))
    assert len(digests) == 1 + len(HOST) + 9 + 2 + 2
    # what changes no kernel leaves it alone; a flag's spelling is vLLM's (underscores, =value)
    assert key_of(share, args=("--port", "8000", "--max-model-len", "4096")) == \
        key_of(share, args=("--max_model_len=4096", "--port", "9000"))
    assert okc.key_digest(key_of(share)) == okc.key_digest(json.loads(json.dumps(key_of(share))))


def test_the_first_differing_field_is_named():
    a = {"host": HOST, "model": {"arch": "sm90"}, "serve": {"tp": 3}}
    assert kc.key_problem(a, a) is None
    assert kc.key_problem(a, {**a, "serve": {"tp": 1}}) == "recorded for serve tp 3, this start has 1"
    assert kc.key_problem(a, {**a, "host": {**HOST, "driver": "590.1"}}) == \
        'recorded for host driver "580.95.05", this start has "590.1"'


def test_host_facts_are_read_without_torch_or_vllm():
    before = set(sys.modules)
    facts = kc.host_facts()
    assert set(facts) == set(HOST)
    assert not {m for m in set(sys.modules) - before if m.split(".")[0] in ("vllm", "triton", "flashinfer")}
    assert facts["torch"] is not None  # this environment's torch, from its metadata


def test_every_cache_variable_is_one_folder_of_the_run_root(share):
    env = kc.cache_environment(share)
    assert set(env) == VARIABLES
    run_root = share / "kernel-cache" / "run"
    assert {Path(v).parent for v in env.values()} == {run_root} and len(set(env.values())) == len(env)


# ---------------------------------------------------------------- record, verify, restore


def test_record_then_a_start_restores_it_into_a_fresh_cache_root(share):
    files = recorded(share)
    assert tree_of(files) == COMPILED
    assert kc.cache_command("verify", share, HOST)[0]["files"] == len(COMPILED)
    shutil.rmtree(share / "kernel-cache" / "run")  # a fresh machine: the share came, its run root did not
    s = start(share)
    assert s.warm and s.line.startswith("kernel caches: warm start from the record (4 files") and "verified" in s.line
    assert tree_of(share / "kernel-cache" / "run") == COMPILED
    assert start(share).warm and tree_of(share / "kernel-cache" / "run") == COMPILED  # again: in place, nothing moved
    assert [p.name for p in (share / "kernel-cache").iterdir() if p.name.startswith("run.")] == []


def test_a_run_root_holding_more_than_the_record_is_moved_aside_never_deleted(share):
    recorded(share)
    compile_into(share, {"triton/new/kernel.cubin": b"compiled after the record"})
    s = start(share)
    assert s.warm and "the previous run/ kept as run." in s.line
    aside = [p for p in (share / "kernel-cache").iterdir() if p.name.startswith("run.")]
    assert len(aside) == 1 and tree_of(aside[0]) == {**COMPILED, "triton/new/kernel.cubin": b"compiled after the record"}
    assert tree_of(share / "kernel-cache" / "run") == COMPILED


def test_a_cold_start_never_runs_what_a_previous_start_left_unrecorded(share):
    assert not start(share).warm
    compile_into(share)
    s = start(share)  # not recorded: compiled code no record vouches for
    assert not s.warm and "no record" in s.line and "kept as run." in s.line
    assert tree_of(share / "kernel-cache" / "run") == {}


@pytest.mark.parametrize("damage,needle", [
    (lambda f: (f / "triton/ab12/kernel.cubin").write_bytes(b"\x7fELF trojan!"), "not the bytes the record lists"),
    (lambda f: (f / "triton/ab12/extra.cubin").write_bytes(b"added"), "extra.cubin: not in the record"),
    (lambda f: (f / "deep_gemm/cache/kernel.so").unlink(), "kernel.so: in the record but missing"),
    (lambda f: (f.parent / "record.json").write_text(json.dumps({"key": {}, "files": {}})),
     "not a kernel-cache record lucifer-shard wrote"),
    (lambda f: (f.parent / "record.json").write_text((f.parent / "record.json").read_text().replace("0.34.0", "0.35.0")),
     "edited after lucifer-shard wrote it"),
])
def test_a_record_that_does_not_verify_is_refused_and_the_start_is_cold(share, damage, needle):
    files = recorded(share)
    damage(files)
    shutil.rmtree(share / "kernel-cache" / "run")
    s = start(share)
    assert not s.warm and s.line.startswith("kernel caches: cold start: ") and needle in s.line, s.line
    assert tree_of(share / "kernel-cache" / "run") == {}  # nothing of the record runs
    r = run("cache", "verify", share)
    assert needle in one_error(r, 1) and "serve starts cold" in r.stderr


@pytest.mark.parametrize("fact", sorted(HOST))
def test_a_record_of_another_host_is_refused_by_the_fact_that_differs(share, fact):
    recorded(share)
    other = {**HOST, fact: "other"}
    s = start(share, other)
    assert not s.warm and f"recorded for host {fact} " in s.line and '"other"' in s.line, s.line
    with pytest.raises(Exception, match=f"recorded for host {fact} "):
        kc.cache_command("verify", share, other)


def test_a_record_of_other_serve_options_is_refused(share):
    recorded(share)
    s = start(share, args=("--kv-cache-dtype", "fp8"))
    assert not s.warm and "recorded for serve --kv-cache-dtype null, this start has [\"fp8\"]" in s.line


def test_record_refusals(share):
    with pytest.raises(Exception, match="no start filled it"):
        kc.cache_command("record", share, HOST)
    start(share)
    with pytest.raises(Exception, match="empty: the start compiled nothing yet"):
        kc.cache_command("record", share, HOST)
    compile_into(share)
    r = run("cache", "record", share)  # this box's own facts: not the host that ran the start
    assert "filled on another host or install (recorded for host" in one_error(r, 2)
    assert not (share / "kernel-cache" / "record.json").exists()
    kc.cache_command("record", share, HOST)
    (share / "kernel-cache" / "files" / "stranger.so").write_bytes(b"not ours")
    with pytest.raises(Exception, match="stranger.so: in the kernel cache but in no record"):
        kc.cache_command("record", share, HOST)
    assert (share / "kernel-cache" / "record.json").exists()  # refused before the old record was touched


def test_a_new_record_replaces_the_old_files_it_no_longer_lists(share):
    recorded(share)
    (share / "kernel-cache" / "run" / "triton/ab12/kernel.cubin").unlink()
    compile_into(share, {"tilelang/k.so": b"tl"})
    kc.cache_command("record", share, HOST)
    want = {**{k: v for k, v in COMPILED.items() if k != "triton/ab12/kernel.cubin"}, "tilelang/k.so": b"tl"}
    assert tree_of(share / "kernel-cache" / "files") == want
    assert kc.cache_command("verify", share, HOST)[0]["files"] == len(want)


def test_a_link_in_the_run_root_is_refused_not_followed(share, tmp_path):
    start(share)
    compile_into(share)
    (tmp_path / "elsewhere").write_bytes(b"outside")
    (share / "kernel-cache" / "run" / "triton" / "link.so").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(Exception, match="link.so: is a symlink in a kernel cache"):
        kc.cache_command("record", share, HOST)


# ---------------------------------------------------------------- carried by stage and fetch


def test_stage_and_fetch_carry_the_record_and_it_verifies_there(share, tmp_path, here):
    recorded(share)
    r = run("stage", share, tmp_path / "node1", "--ranks", "1", "--kernel-cache")
    assert r.exit_code == 0, r.output
    assert "kernels    4 files" in r.stdout
    assert tree_of(tmp_path / "node1" / "kernel-cache" / "files") == COMPILED
    assert okc.read_record(okc.cache_tree(tmp_path / "node1")) == okc.read_record(okc.cache_tree(share))
    assert run("cache", "verify", tmp_path / "node1").exit_code == 0
    assert start(tmp_path / "node1").warm  # the other box, same kind: warm from the carried record
    r = run("fetch", tmp_path / "node1", tmp_path / "node1b", "--ranks", "1", "--kernel-cache")
    assert r.exit_code == 0, r.output
    assert tree_of(tmp_path / "node1b" / "kernel-cache" / "files") == COMPILED
    assert run("cache", "verify", tmp_path / "node1b").exit_code == 0
    assert run("verify", tmp_path / "node1b").exit_code == 0  # the share itself is untouched by its cache


def test_stage_refuses_to_carry_what_is_not_recorded_or_does_not_verify(share, tmp_path):
    r = run("stage", share, tmp_path / "a", "--ranks", "0", "--kernel-cache")
    assert "holds no recorded kernel cache" in one_error(r, 2) and not (tmp_path / "a").exists()
    r = run("fetch", share, tmp_path / "b", "--ranks", "0", "--kernel-cache")
    assert "holds no recorded kernel cache" in one_error(r, 2) and not (tmp_path / "b").exists()
    files = recorded(share)
    (files / "vllm/torch_compile_cache/h1/rank_0_0/model").write_bytes(b"grapH")
    r = run("stage", share, tmp_path / "c", "--ranks", "0", "--kernel-cache")
    assert "model: the bytes read are not the record's" in one_error(r, 1)
    assert not (tmp_path / "c" / "kernel-cache" / "record.json").exists()
    assert not (tmp_path / "c" / "kernel-cache" / "files" / "vllm/torch_compile_cache/h1/rank_0_0/model").exists()


def test_fetch_from_the_hub_carries_the_record(share, tmp_path):
    from test_fetch import REPO_ID, fetch_hub
    from hubserver import HubServer

    # the stand-in Hub serves no hidden path (tests/hubserver.py `_describe`), so FlashInfer's `.cache/` is left out here
    shown = {rel: data for rel, data in COMPILED.items() if "/." not in rel}
    recorded(share, shown)
    shutil.rmtree(share / "kernel-cache" / "run")
    (share / "kernel-cache" / "run-key.json").unlink()
    hub_root = tmp_path / "published"
    shutil.copytree(share, hub_root, ignore=shutil.ignore_patterns(".lucifer"))
    with HubServer({REPO_ID: hub_root}) as hub:
        r = fetch_hub(hub, tmp_path / "home", REPO_ID, tmp_path / "node0", "--ranks", "0", "--kernel-cache")
    assert r.returncode == 0, r.stderr
    assert tree_of(tmp_path / "node0" / "kernel-cache" / "files") == shown
    assert okc.record_problem(okc.cache_tree(tmp_path / "node0"))[1] is None


# ---------------------------------------------------------------- serve


def test_serve_dry_run_says_the_line_and_prints_the_variables_it_would_set(share, here):
    r = run("serve", share, "--dry-run")
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("kernel caches: "))
    assert lines[at].startswith("kernel caches: would start cold: no kernel cache in ")
    assert {line.strip().split("=")[0] for line in lines[at + 1:at + 1 + len(VARIABLES)]} == VARIABLES
    assert lines[-1].startswith("vllm serve ")  # the command stays the last line
    assert not (share / "kernel-cache").exists()  # the dry run writes nothing
    recorded(share)
    doc = json.loads(run("serve", share, "--dry-run", "--json").stdout)["result"]["kernel_caches"]
    assert doc["warm"] and doc["line"].startswith("kernel caches: would start warm from the record (4 files")
    assert set(doc["env"]) == VARIABLES
    assert "--no-kernel-cache" in run("serve", share, "--dry-run", "--no-kernel-cache").stdout
    assert json.loads(run("serve", share, "--dry-run", "--json", "--no-kernel-cache").stdout
                      )["result"]["kernel_caches"]["env"] == {}


def test_serve_starts_warm_only_from_a_record_of_this_start(share, here, monkeypatch):
    ran = []
    monkeypatch.setattr(serve, "exec_vllm", lambda argv, env: ran.append(env))
    r = run("serve", share)
    assert r.exit_code == 0 and "kernel caches: cold start: no record in " in r.stderr
    assert {k: ran[0][k] for k in VARIABLES} == kc.cache_environment(share)
    compile_into(share)
    assert run("cache", "record", share).exit_code == 0
    r = run("serve", share)
    assert r.exit_code == 0 and "kernel caches: warm start from the record (4 files" in r.stderr
    r = run("serve", share, "--", "--enforce-eager")  # another start: other kernels
    assert "kernel caches: cold start: recorded for serve --enforce-eager null, this start has []" in r.stderr
    r = run("serve", share, "--no-kernel-cache")
    assert "left where vLLM's defaults put them" in r.stderr and not VARIABLES & (ran[-1].keys() - os.environ.keys())


def test_cache_show(share, here):
    recorded(share)
    r = run("cache", "show", share)
    assert r.exit_code == 0 and "4 files, 1.97 KiB (deep_gemm, flashinfer, triton, vllm)" in r.stdout
    assert "NVIDIA H100 80GB HBM3" in r.stdout
    shutil.rmtree(share / "kernel-cache")
    r = run("cache", "show", share)
    assert r.exit_code == 0 and r.stdout.startswith("no recorded kernel cache in ")
    assert "no record" in one_error(run("cache", "verify", share), 2)


def test_a_link_in_the_run_root_at_a_start_is_moved_aside_with_the_rest(share, tmp_path):
    (tmp_path / "elsewhere").write_bytes(b"outside")
    start(share)
    (share / "kernel-cache" / "run" / "link.so").symlink_to(tmp_path / "elsewhere")
    s = start(share)  # no record: cold, the link moved aside with its folder (not "cannot be written")
    assert not s.warm and "no record in" in s.line and "the previous run/ kept as run." in s.line, s.line
    recorded(share)
    (share / "kernel-cache" / "run" / "triton" / "link.so").symlink_to(tmp_path / "elsewhere")
    s = start(share)
    assert s.warm and "the previous run/ kept as run." in s.line, s.line
    assert tree_of(share / "kernel-cache" / "run") == COMPILED and (tmp_path / "elsewhere").read_bytes() == b"outside"


def test_convert_force_keeps_the_kernel_caches_and_verify_passes_beside_them(converted, tiny_pattern, tmp_path):
    """kernel-cache/ is serve's, recorded apart from the conversion: `convert --force` neither refuses it as
    foreign nor deletes it (a start whose key no longer matches starts cold), and verify passes beside it."""
    out = Path(shutil.copytree(converted(arch="sm120"), tmp_path / "out"))
    compile_into(out)
    cached = sorted(p.relative_to(out) for p in (out / okc.CACHE_DIR).rglob("*"))
    r = run("convert", "--tp", 3, "--arch", "sm120", tiny_pattern, out, "--force")
    assert r.exit_code == 0, r.output
    assert sorted(p.relative_to(out) for p in (out / okc.CACHE_DIR).rglob("*")) == cached
    r = run("verify", out)
    assert r.exit_code == 0, r.output
