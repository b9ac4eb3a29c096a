"""convert from a Hugging Face repo id, against a stand-in Hub on 127.0.0.1 (tests/hubserver.py) that
huggingface_hub's own client talks to: refusals before any weight is asked for, a streamed conversion
byte-identical to one from disk, resume after a kill mid-download, a tampered shard refused by name,
the kept and cached routes, and plan's download figures."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import CONFIGS, cli_argv, one_error, run_process, scratch
from hubserver import HubServer
from lucifer_shard.engine.feed import job_files, part_files
from lucifer_shard.engine.job import prepare
from lucifer_shard.model.options import Options
from lucifer_shard.source.streaming import peak_bytes, stream_order

REPO_ID = "deepseek-ai/DeepSeek-V4-Flash-0731"
SMALL_PARTS = ["--max-file-size", "1M"]  # many parts, so a streamed run holds a few shards at a time


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """A DSpark checkpoint in 10+ shards, its derivative (other weights, same schema), and their
    conversions from disk: the reference every streamed run must equal byte for byte."""
    with scratch(tmp_path_factory, "hub") as d:
        for name, seed in (("model", 0), ("derivative", 1)):
            cli("synth", "dspark", d / name, "--shards", "10", "--seed", seed, "--fill", "random")
        cli("convert", "--tp", "3", d / "model", d / "disk", *SMALL_PARTS)
        yield d


@pytest.fixture
def hub(ckpts, tmp_path):
    with HubServer({REPO_ID: ckpts / "model", "someone/V4-Flash-0731-abliterated": ckpts / "derivative"}) as server:
        server.home = tmp_path / "hf-home"
        yield server


def cli(*args, hub: HubServer | None = None, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_DISABLE_TELEMETRY": "1", "PYTHONUNBUFFERED": "1"}
    if hub is not None:
        env.update(HF_ENDPOINT=hub.url, HF_HOME=str(hub.home))
    return run_process(*args, env=env, check=check)


def weight_requests(hub: HubServer) -> list:
    """Every request for a shard's bytes beyond a header read (a ranged GET from byte 0 of at most 256 KiB)."""
    def header_read(r) -> bool:
        return r.range is not None and r.range.startswith("bytes=0-") and r.sent <= 1 << 18
    return [r for r in hub.requests if r.path.endswith(".safetensors") and r.method == "GET" and not header_read(r)]


def files_of(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and ".lucifer" not in p.parts}


def same_conversion(a: Path, b: Path) -> None:
    """Every rank file and copy byte-identical; the manifests equal but for where the source was (which
    the model card names too)."""
    fa, fb = files_of(a), files_of(b)
    assert sorted(fa) == sorted(fb)
    for rel in fa:
        if rel not in ("lucifer-manifest.json", "README.md"):
            assert fa[rel] == fb[rel], rel
    ma, mb = (json.loads(f["lucifer-manifest.json"]) for f in (fa, fb))
    for m in (ma, mb):
        m.pop("manifest_digest")
        m["source"].update(path=None, repo=None, revision=None)
        m["copies"].pop("README.md")
    assert ma == mb


# ---------------------------------------------------------------- refusals before any weight


def _repo_with_config(root: Path, raw: dict, like: Path) -> Path:
    """A repo of `like`'s files with another config.json (the shards are never asked for)."""
    shutil.copytree(like, root)
    (root / "config.json").write_text(json.dumps(raw))
    return root


def test_v41_repo_is_refused_from_config_json_alone(ckpts, tmp_path):
    raw = json.loads((CONFIGS / "deepseek-v4.1-flash.json").read_text())
    with HubServer({"deepseek-ai/DeepSeek-V4.1-Flash": _repo_with_config(tmp_path / "v41", raw, ckpts / "model")}) as h:
        h.home = tmp_path / "hf-home"
        line = one_error(cli("convert", "--tp", "3", "deepseek-ai/DeepSeek-V4.1-Flash", tmp_path / "out", hub=h,
                                  check=False), alone=True)
        assert "V4.1" in line or "deepseek_v41" in line
        # issue 64: the refusal names the repo, not config.json's path in the Hugging Face cache
        assert line.startswith("error: deepseek-ai/DeepSeek-V4.1-Flash: config.json: ") and "hf-home" not in line, line
        assert [r.path for r in h.requests if r.method == "GET"] == ["config.json"]
        assert not (tmp_path / "out").exists()


def test_vision_exp_repo_is_refused_before_any_weight(ckpts, tmp_path):
    raw = json.loads((ckpts / "model" / "config.json").read_text())
    raw.update({f"vision_{k}": 1 for k in ("hidden_size", "layers", "heads", "patch_size", "image_size",
                                           "mlp_ratio", "depth", "token_id", "merge_size", "start_token")})
    raw["num_nextn_predict_layers"] = 3
    with HubServer({"deepseek-ai/DeepSeek-V4-Flash-Vision-Exp": _repo_with_config(tmp_path / "vx", raw,
                                                                                  ckpts / "model")}) as h:
        h.home = tmp_path / "hf-home"
        line = one_error(cli("convert", "--tp", "3", "deepseek-ai/DeepSeek-V4-Flash-Vision-Exp",
                                  tmp_path / "out", hub=h, check=False), alone=True)
        assert "vision" in line and "3-layer drafter" in line
        assert not any(r.path.endswith(".safetensors") for r in h.requests)


def test_finished_out_is_refused_before_any_header_or_weight(ckpts, hub, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(ckpts / "disk", out)
    line = one_error(cli("convert", "--tp", "3", REPO_ID, out, *SMALL_PARTS, hub=hub, check=False), alone=True)
    assert "already holds a complete conversion" in line
    assert not any(r.path.endswith(".safetensors") for r in hub.requests)
    assert files_of(out) == files_of(ckpts / "disk")


def test_a_foreign_download_dir_is_refused_before_any_weight(hub, tmp_path):
    (tmp_path / "dl").mkdir()
    (tmp_path / "dl" / "notes.txt").write_text("mine")
    line = one_error(cli("convert", "--tp", "3", REPO_ID, tmp_path / "out", "--download-dir", tmp_path / "dl",
                              *SMALL_PARTS, hub=hub, check=False), alone=True)
    assert "not a lucifer-shard download folder" in line
    assert weight_requests(hub) == [] and (tmp_path / "dl" / "notes.txt").read_text() == "mine"


def test_download_options_need_a_repo_id(ckpts, tmp_path):
    line = one_error(cli("convert", "--tp", "3", ckpts / "model", tmp_path / "out", "--keep-source",
                              check=False), alone=True)
    assert "local path" in line


# ---------------------------------------------------------------- streamed conversion


def test_streamed_conversion_equals_the_one_from_disk(ckpts, hub, tmp_path):
    out = tmp_path / "out"
    r = cli("convert", "--tp", "3", REPO_ID, out, *SMALL_PARTS, hub=hub)
    same_conversion(out, ckpts / "disk")
    shards = sorted(p.name for p in (ckpts / "model").glob("*.safetensors"))
    assert len(shards) >= 8
    assert sorted(r.path for r in weight_requests(hub)) == shards  # each shard downloaded once, whole
    assert not (out / ".lucifer" / "download").exists()  # every downloaded file removed
    manifest = json.loads((out / "lucifer-manifest.json").read_text())["source"]
    assert manifest["repo"] == REPO_ID and manifest["revision"] == hub.repos[REPO_ID].commit
    assert manifest["path"] == f"hf://{REPO_ID}@{hub.repos[REPO_ID].commit}"
    assert "downloaded" in r.stdout and "at most" in r.stdout
    assert cli("verify", out).returncode == 0


def test_a_derivative_converts_as_its_base_and_records_its_repo(ckpts, hub, tmp_path):
    out = tmp_path / "out"
    cli("convert", "--tp", "3", "someone/V4-Flash-0731-abliterated", out, *SMALL_PARTS, hub=hub)
    ours, base = (json.loads((d / "lucifer-manifest.json").read_text()) for d in (out, ckpts / "disk"))
    assert ours["source"]["repo"] == "someone/V4-Flash-0731-abliterated"
    # same config and headers (so the same conversion id), other weights: the content digest tells them apart
    assert ours["source"]["fingerprint"] == base["source"]["fingerprint"]
    assert ours["source"]["content"]["digest"] != base["source"]["content"]["digest"]
    shown = cli("inspect", out).stdout
    assert "someone/V4-Flash-0731-abliterated" in shown and hub.repos["someone/V4-Flash-0731-abliterated"].commit[:12] in shown


def test_a_tampered_shard_is_refused_by_name(ckpts, hub, tmp_path):
    shard = sorted(p.name for p in (ckpts / "model").glob("*.safetensors"))[3]
    data = bytearray((ckpts / "model" / shard).read_bytes())
    data[-1] ^= 0xFF
    hub.tamper[(REPO_ID, shard)] = bytes(data)
    out = tmp_path / "out"
    line = one_error(cli("convert", "--tp", "3", REPO_ID, out, *SMALL_PARTS, hub=hub, check=False), alone=True)
    assert shard in line and "SHA-256" in line
    assert not (out / "COMPLETE").exists() and not (out / ".lucifer" / "download" / shard).exists()


# ---------------------------------------------------------------- issue 61, class D: the Hub changes under a conversion


def same_size_edit(data: bytes, old: bytes, new: bytes) -> bytes:
    assert len(old) == len(new) and data.count(old) == 1
    return data.replace(old, new)


def test_a_config_changed_on_a_later_request_is_refused(ckpts, hub, tmp_path):
    """The plan reads config.json first; the Hub then answers the copy's download with other bytes (the same
    commit, the same size): that download is checked against the git blob id the Hub published."""
    config = (ckpts / "model" / "config.json").read_bytes()
    hub.tamper[(REPO_ID, "config.json")] = same_size_edit(config, b'"rope_theta": 10000', b'"rope_theta": 90000')
    hub.lie_on[(REPO_ID, "config.json")] = range(2, 100)  # the plan's read honest, every later one not
    out = tmp_path / "out"
    line = one_error(cli("convert", "--tp", "3", REPO_ID, out, *SMALL_PARTS, hub=hub, check=False), alone=True)
    assert "config.json" in line and "git blob" in line, line
    assert hub.files_requested().count("config.json") == 2  # the plan's read honest, the second the lie
    assert not (out / "COMPLETE").exists() and not (out / "config.json").exists()


def test_a_config_the_plan_would_read_with_other_bytes_is_refused_before_any_weight(ckpts, hub, tmp_path):
    config = (ckpts / "model" / "config.json").read_bytes()
    hub.tamper[(REPO_ID, "config.json")] = same_size_edit(config, b'"rope_theta": 10000', b'"rope_theta": 90000')
    line = one_error(cli("convert", "--tp", "3", REPO_ID, tmp_path / "out", hub=hub, check=False), alone=True)
    assert "config.json" in line and "git blob" in line, line
    assert not weight_requests(hub) and not [r for r in hub.requests if r.path.endswith(".safetensors")]


@pytest.mark.parametrize("keep", [False, True], ids=["streamed", "keep-source"])
def test_a_git_file_with_other_bytes_of_the_same_size_is_refused(ckpts, hub, tmp_path, keep):
    name = "tokenizer_config.json"
    data = (ckpts / "model" / name).read_bytes()
    hub.tamper[(REPO_ID, name)] = same_size_edit(data, b"1048576", b"9048576")
    out = tmp_path / "out"
    # alone only when streamed: --keep-source shows huggingface_hub's own snapshot progress
    line = one_error(cli("convert", "--tp", "3", REPO_ID, out, *SMALL_PARTS, *(["--keep-source"] if keep else []),
                         hub=hub, check=False), alone=not keep)
    assert name in line and "git blob" in line, line
    assert not (out / "COMPLETE").exists() and not (out / name).exists()


def test_a_shard_header_the_plan_read_is_the_downloaded_shards(ckpts, hub, tmp_path):
    """The plan reads each shard's header by a ranged request; the shard comes whole later, checked against
    its SHA-256. A Hub answering the ranged read with two tensors' offsets swapped (the same length) would
    have the plan read each from the other's bytes: the downloaded shard's header must be the plan's."""
    shard = sorted(p.name for p in (ckpts / "model").glob("*.safetensors"))[3]
    data = (ckpts / "model" / shard).read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    like: dict[tuple, list[str]] = {}
    for k, v in header.items():
        if k != "__metadata__":
            like.setdefault((v["dtype"], tuple(v["shape"])), []).append(k)
    a, b = next(keys for keys in like.values() if len(keys) > 1)[:2]
    at = {k: json.dumps(header[k]["data_offsets"], separators=(",", ":")).encode() for k in (a, b)}
    block = data[8:8 + n]
    assert block.count(at[a]) == block.count(at[b]) == 1
    swapped = block.replace(at[a], b"\0").replace(at[b], at[a]).replace(b"\0", at[b])
    hub.tamper[(REPO_ID, shard)] = data[:8] + swapped + data[8 + n:]
    assert len(hub.tamper[(REPO_ID, shard)]) == len(data)
    hub.lie_on[(REPO_ID, shard)] = {1}  # the ranged header read; the download is honest
    out = tmp_path / "out"
    line = one_error(cli("convert", "--tp", "3", REPO_ID, out, *SMALL_PARTS, hub=hub, check=False), alone=True)
    assert shard in line and "header" in line, line
    assert not (out / "COMPLETE").exists()


def test_killed_mid_download_then_resumed(ckpts, hub, tmp_path):
    out = tmp_path / "out"
    total = sum(p.stat().st_size for p in (ckpts / "model").glob("*.safetensors"))
    hub.stall_after = total * 2 // 3
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(hub.home), "HF_HUB_DISABLE_TELEMETRY": "1"}
    proc = subprocess.Popen(cli_argv("convert", "--tp", "3", REPO_ID, out, *SMALL_PARTS, "-q"), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert hub.stalled.wait(120), "the conversion never reached the stall"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    hub.release()
    journal = (out / ".lucifer" / "journal.jsonl").read_text().splitlines()
    assert journal, "no part was finished before the kill: the stall came too early to test a resume"
    before = len(hub.requests)
    cli("convert", "--tp", "3", REPO_ID, out, *SMALL_PARTS, "--resume", hub=hub)
    same_conversion(out, ckpts / "disk")
    # the resume fetched only shards that unfinished parts read, each once: none read by kept parts alone
    job = prepare(str(ckpts / "model"), Options(tp=3, max_file_bytes=1 << 20))
    kept = {json.loads(line)["path"] for line in journal}
    done = [p for p in job.parts if f"{p.role}/rank-0/part-{p.index:05d}.safetensors" in kept]
    left = [p for p in job.parts if p not in done]
    fetched = [r.path for r in weight_requests(hub)[len(weight_requests(_until(hub, before))):]]
    assert len(fetched) == len(set(fetched))
    needed = {f for p in left for f in part_files(job, p)}
    assert set(fetched) <= needed
    assert not set(fetched) & ({f for p in done for f in part_files(job, p)} - needed)


def _until(hub: HubServer, n: int) -> HubServer:
    view = HubServer.__new__(HubServer)
    view.requests = hub.requests[:n]
    return view


# ---------------------------------------------------------------- the other routes


def test_keep_source_then_cached_read_in_place(ckpts, hub, tmp_path):
    cli("convert", "--tp", "3", REPO_ID, tmp_path / "a", *SMALL_PARTS, "--keep-source", hub=hub)
    same_conversion(tmp_path / "a", ckpts / "disk")
    assert not (tmp_path / "a" / ".lucifer" / "download").exists()
    n = len(weight_requests(hub))
    cli("convert", "--tp", "3", REPO_ID, tmp_path / "b", *SMALL_PARTS, hub=hub)
    same_conversion(tmp_path / "b", ckpts / "disk")
    assert len(weight_requests(hub)) == n  # read in place from the cache


# ---------------------------------------------------------------- the plan of a streamed run


def test_stream_order_keeps_few_shards_and_peak_is_a_walk(ckpts):
    job = prepare(str(ckpts / "model"), Options(tp=3, max_file_bytes=1 << 20))
    files, sizes = job_files(job, job.parts), job.ckpt.files
    order = stream_order(job.parts, files, sizes)
    assert sorted((p.role, p.index) for p in order) == sorted((p.role, p.index) for p in job.parts)
    on_disk: set[str] = set()
    peak = 0
    last = {f: i for i, p in enumerate(order) for f in files[id(p)]}
    for i, part in enumerate(order):  # while part i is written, part i + 1's shards download
        on_disk |= set(files[id(part)]) | set(files[id(order[i + 1])] if i + 1 < len(order) else [])
        peak = max(peak, sum(sizes[f] for f in on_disk))
        on_disk -= {f for f in on_disk if last[f] == i}
    assert peak_bytes(order, files, sizes) == peak
    assert peak <= peak_bytes(job.parts, files, sizes)  # never worse than the planned order
    assert peak < sum(sizes.values()) * 0.6  # streaming holds a part of the checkpoint, not all of it


def test_parts_are_grouped_by_the_shards_that_hold_them(ckpts):
    """A conversion's parts take its tensors in the order of the shards that hold their sources (issue 63
    item 2): the same tensors as grouped by name, each role's parts in the order their last shard arrives,
    fewer shard reads in all, and fewer source bytes on disk at once when streamed."""
    from lucifer_shard.engine.feed import shards_read
    from lucifer_shard.engine.job import plan_parts

    job = prepare(str(ckpts / "model"), Options(tp=3, max_file_bytes=1 << 20))
    shard_of = {k: e.file for k, e in job.ckpt.tensors.items()}
    index = {f: i for i, f in enumerate(sorted(job.ckpt.files))}
    by_name = [p for role in job.specs for p in plan_parts(role, job.specs[role][0], 1 << 20)]

    def reads(parts: list) -> list[list[int]]:
        return [[index[f] for f in shards_read(job.specs, p, shard_of)] for p in parts]
    assert sorted(n for p in job.parts for n in p.names) == sorted(n for p in by_name for n in p.names)
    for role in job.specs:
        lasts = [max(r) for p, r in zip(job.parts, reads(job.parts)) if p.role == role]
        assert lasts == sorted(lasts)
    assert sum(map(len, reads(job.parts))) < sum(map(len, reads(by_name)))

    def peak(parts: list) -> int:
        files = {id(p): shards_read(job.specs, p, shard_of) for p in parts}
        return peak_bytes(stream_order(parts, files, job.ckpt.files), files, job.ckpt.files)
    assert peak(job.parts) < peak(by_name)


def test_an_output_grouped_by_name_verifies_and_is_repaired_with_its_own_parts(ckpts, tmp_path, monkeypatch):
    """An output written before parts were grouped by shards (by name) still verifies, and convert --resume
    rewrites a damaged file of it with the tensors its manifest lists there, byte for byte as it was. The
    harness writes such an output by putting the grouping by name back (the tool before issue 63)."""
    from helpers import run
    from lucifer_shard.engine import job as jobmod
    from lucifer_shard.output.manifest import part_path
    from lucifer_shard.output.manifest_types import Manifest

    out = tmp_path / "old"
    with monkeypatch.context() as m:
        m.setattr(jobmod, "by_shards", lambda groups, shard_of: groups)  # the grouping by name of older outputs
        assert run("convert", "--tp", "3", ckpts / "model", out, *SMALL_PARTS).exit_code == 0
    manifest = Manifest.parse((out / "lucifer-manifest.json").read_bytes(), "lucifer-manifest.json")
    job = prepare(str(ckpts / "model"), Options(tp=3, max_file_bytes=1 << 20))
    rank0 = manifest.rank("target", 0)
    moved = [p for p in job.parts if p.role == "target"
             and rank0.held(part_path("target", 0, p.index)) != sorted(p.names)]
    assert moved, "the grouping by shards changes no part of this checkpoint: nothing to test"
    rel = part_path("target", 1, moved[0].index)
    before = (out / rel).read_bytes()
    (out / rel).write_bytes(before[:-1] + bytes([before[-1] ^ 1]))
    assert run("verify", out).exit_code == 1
    r = run("convert", "--tp", "3", ckpts / "model", out, *SMALL_PARTS, "--resume")
    assert r.exit_code == 0, r.output
    assert (out / rel).read_bytes() == before
    assert run("verify", out).exit_code == 0


def test_readme_routes_are_plans():
    """The README's routes table is what `plan` prints for DeepSeek-V4-Flash-0731 at TP3 (so they cannot drift)."""
    from lucifer_shard.units import size

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    table = readme[readme.index("| route | download per node |"):readme.index("A repo id is read config first")]

    def routes(*extra: str) -> dict:
        r = cli("plan", "--tp", "3", CONFIGS / "deepseek-v4-flash-0731.json", "--json", *extra)
        return json.loads(r.stdout)["result"]["routes"]

    doc, small = routes(), routes("--max-file-size", "2G")
    staged, streamed, fetched = doc["routes"]
    assert f"the source is {size(doc['source_bytes'])})" in readme
    assert f"| 0 ({size(staged['disk_per_node'])} copied to it) | {size(staged['disk_per_node'])} |" in table
    assert f"a conversion box with {size(staged['conversion_box'])}" in table
    assert (f"| {size(streamed['download_per_node'])} | {size(streamed['disk_per_node'])} (share + at most "
            f"{size(doc['stream_peak_bytes'])} of shards at once; {size(small['routes'][1]['disk_per_node'])} with "
            f"`--max-file-size 2G`)") in table
    assert f"| {size(fetched['download_per_node'])} | {size(fetched['disk_per_node'])} |" in table
    shards = f"at most\n{size(doc['stream_peak_bytes'])} of shards at once, {size(small['stream_peak_bytes'])} with"
    assert shards in readme  # the three-boxes section
    from lucifer_shard.units import duration  # each route's time at the link plan states (issue 63 item 5)

    fast = routes("--link", "10Gbit/s")["routes"]
    times = " ".join(readme[readme.index("`plan` also gives each route's time"):].split("A repo id is read")[0].split())
    assert (f"at the default 1 Gbit/s the streamed route's download takes {duration(streamed['download_seconds'])} per "
            f"node and a published share's {duration(fetched['download_seconds'])} (`--link 10Gbit/s`: "
            f"{duration(fast[1]['download_seconds'])} and {duration(fast[2]['download_seconds'])})") in times
    assert f"come to {duration(staged['download_seconds'] + staged['convert_seconds'])} before" in times


# ---------------------------------------------------------------- diff from the Hub


def test_diff_streams_the_recorded_source(ckpts, hub, tmp_path):
    out = tmp_path / "out"
    cli("convert", "--tp", "3", REPO_ID, out, *SMALL_PARTS, hub=hub)
    shutil.rmtree(hub.home)  # nothing cached: diff must read the Hub
    n = len(weight_requests(hub))
    r = cli("diff", out, "--download-source", "--download-dir", tmp_path / "dl", hub=hub)
    assert "OK: every rank tensor is its source slices" in r.stdout and f"{REPO_ID}@" in r.stdout
    fetched = [q.path for q in weight_requests(hub)[n:]]
    assert sorted(fetched) == sorted(p.name for p in (ckpts / "model").glob("*.safetensors"))  # each once
    assert not (tmp_path / "dl").exists()


def test_after_a_streamed_convert_verify_comes_next_and_diff_downloads_only_when_asked(ckpts, hub, tmp_path):
    """Issue 63 item 4: the source is never downloaded twice by advice. convert's `next:` line names verify and
    what a diff costs (the source's bytes, with its flag); diff without the flag refuses in one line naming
    the bytes, the flag and verify, after the fingerprint and before any weight; a node's share the same."""
    from lucifer_shard.units import size

    shards = size(weight_bytes(ckpts))
    for out, node in ((tmp_path / "out", ()), (tmp_path / "node1", ("--nnodes", "3", "--node-rank", "1"))):
        r = cli("convert", "--tp", "3", REPO_ID, out, *SMALL_PARTS, *node, hub=hub)
        assert r.stdout.strip().splitlines()[-1].startswith(
            f"next: lucifer-shard verify {out} (a diff downloads the source again, {shards} from the Hub: "
            f"lucifer-shard diff {out} --download-source); "), r.stdout
        n = len(weight_requests(hub))
        line = one_error(cli("diff", out, hub=hub, check=False), 2, shards, "--download-source",
                         f"lucifer-shard verify {out}", alone=True)
        assert f"downloads its {len(list((ckpts / 'model').glob('*.safetensors')))} shards again" in line
        assert len(weight_requests(hub)) == n  # headers only: no shard asked for
    cli("convert", "--tp", "3", REPO_ID, tmp_path / "kept", *SMALL_PARTS, "--keep-source", hub=hub)
    r = cli("convert", "--tp", "3", REPO_ID, tmp_path / "cached", *SMALL_PARTS, hub=hub)
    assert f"next: lucifer-shard diff {tmp_path / 'cached'}; copy" in r.stdout  # in the cache: diff reads it there
    assert "OK: every rank tensor is its source slices" in cli("diff", tmp_path / "kept", hub=hub).stdout


def test_diff_against_other_weights_stops_at_their_content(ckpts, hub, tmp_path):
    """A derivative has the base's headers (same fingerprint): diff downloads until a shard's content differs."""
    r = cli("diff", ckpts / "disk", "someone/V4-Flash-0731-abliterated", "--download-source", "--download-dir",
            tmp_path / "dl", hub=hub, check=False)
    assert r.returncode == 1 and "content differs from the shard converted" in r.stderr + r.stdout
    assert not (tmp_path / "dl").exists()


def test_diff_against_another_checkpoint_is_refused_before_any_weight(ckpts, tmp_path):
    cli("synth", "tiny", tmp_path / "tiny")
    with HubServer({"acme/tiny": tmp_path / "tiny"}) as h:
        h.home = tmp_path / "hf-home"
        r = cli("diff", ckpts / "disk", "acme/tiny", hub=h, check=False)
        assert r.returncode == 1 and "not the checkpoint" in r.stderr + r.stdout
        assert weight_requests(h) == []


def test_a_node_streams_its_own_share(ckpts, hub, tmp_path):
    """Each node converts its share straight from the Hub: the same files as `stage` of the whole conversion
    (the manifest but for where the source was), and it verifies and passes serve's preflight."""
    staged = tmp_path / "staged"
    cli("stage", ckpts / "disk", staged, "--nnodes", 3, "--node-rank", 1)
    share = tmp_path / "node1"
    cli("convert", "--tp", "3", REPO_ID, share, *SMALL_PARTS, "--nnodes", 3, "--node-rank", 1, hub=hub)
    same_conversion(share, staged)
    assert not (share / "target" / "rank-0").exists() and not (share / ".lucifer" / "download").exists()
    cli("verify", share)
    cli("serve", share, "--nnodes", 3, "--node-rank", 1, "--master-addr", "127.0.0.1", "--dry-run")


def test_the_card_carries_the_hub_license(ckpts, tmp_path):
    """A repo's license, as the Hub's repo info publishes its card data, reaches OUT's model card (no
    README downloaded)."""
    repo = tmp_path / "licensed"
    shutil.copytree(ckpts / "model", repo)
    (repo / "README.md").write_text("---\nlicense: mit\n---\n\n# a model\n")
    with HubServer({REPO_ID: repo}) as h:
        h.home = tmp_path / "hf-home"
        cli("convert", "--tp", "3", REPO_ID, tmp_path / "out", hub=h)
        assert "README.md" not in h.files_requested()
    card = (tmp_path / "out" / "README.md").read_text()
    assert "license: mit" in card and f"base_model: {REPO_ID}" in card


def test_plan_counts_the_download_where_it_lands(ckpts, hub, tmp_path):
    """plan with a repo id: the streamed peak on OUT's filesystem joins OUT's room; --download-dir on another
    filesystem (tmpfs here) is a room of its own; --keep-source counts the whole checkpoint in the HF cache."""
    def plan(*extra):
        r = cli("plan", "--tp", "3", REPO_ID, tmp_path / "out", *SMALL_PARTS, "--json", *extra, hub=hub)
        return json.loads(r.stdout)["result"]

    doc = plan()
    peak = doc["routes"]["stream_peak_bytes"]
    assert doc["footprint"]["room"]["download_bytes"] == peak and doc["download_room"] is None
    assert weight_requests(hub) == []  # plan downloads no weight
    shm = Path("/dev/shm")
    if shm.is_dir() and os.stat(shm).st_dev != os.stat(tmp_path).st_dev:
        elsewhere = plan("--download-dir", shm / f"lucifer-test-{os.getpid()}")
        assert elsewhere["download_room"]["needed_bytes"] == peak
        assert elsewhere["footprint"]["room"]["download_bytes"] == 0
    kept = plan("--keep-source")
    whole = sum(p.stat().st_size for p in (ckpts / "model").glob("*.safetensors"))
    room = kept["download_room"] or kept["footprint"]["room"]
    assert room["download_bytes"] >= whole


def test_resume_repairs_a_streamed_output_from_the_hub(ckpts, hub, tmp_path):
    """convert --resume on a finished output read from the Hub: the damaged rank file and copy are written
    again from the shards that part reads (streamed again), every other file kept."""
    out = tmp_path / "out"
    cli("convert", "--tp", "3", REPO_ID, out, *SMALL_PARTS, hub=hub)
    manifest = json.loads((out / "lucifer-manifest.json").read_text())
    entry = manifest["roles"]["target"]["ranks"][1]["files"][-1]
    damaged = out / entry["path"]
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(bytes(data))
    (out / "generation_config.json").write_text("{}")
    n = len(weight_requests(hub))
    r = cli("convert", "--tp", "3", REPO_ID, out, *SMALL_PARTS, "--resume", hub=hub)
    assert "repaired" in r.stdout and entry["path"] in r.stdout
    same_conversion(out, ckpts / "disk")
    fetched = {q.path for q in weight_requests(hub)[n:]}
    assert fetched and len(fetched) < len(list((ckpts / "model").glob("*.safetensors")))
    assert not (out / ".lucifer" / "download").exists()


@pytest.mark.parametrize("inside", ["", "dl", "target/rank-0/dl", ".lucifer/download"])
@pytest.mark.parametrize("command", ["convert", "plan"])
def test_a_download_dir_inside_out_is_refused_before_anything_is_written(tmp_path, inside, command):
    """Issue 61 G: --download-dir inside OUT's rank folder was accepted and left a shard in the output (after a
    kill the same --resume refused the tool's own downloads there): refused now before the Hub is asked for
    anything and before OUT or the folder exists."""
    out = tmp_path / "out"
    with HubServer({}) as server:
        server.home = tmp_path / "hf-home"
        r = cli(command, "--tp", "3", REPO_ID, out, "--download-dir", out / inside, hub=server, check=False)
        assert server.requests == []
    one_error(r, 2, "--download-dir", f"inside OUT {out}; choose a folder outside OUT", alone=True)
    assert not out.exists()


# ---------------------------------------------------------------- a failing link (issue 61 E, issue 63 item 3)

FAST_RETRY = Path(__file__).resolve().parent / "fastretry"  # the harness that cuts huggingface_hub's retry waits


def link_cli(*args, hub: HubServer, timeout: float = 300) -> subprocess.CompletedProcess:
    """`cli` with --json, huggingface_hub's retry waits cut short (tests/fastretry) and a 1 s read timeout:
    a link that stays down ends the command within seconds, after all of huggingface_hub's retries."""
    env = {**os.environ, "HF_HUB_DISABLE_TELEMETRY": "1", "PYTHONUNBUFFERED": "1", "HF_ENDPOINT": hub.url,
           "HF_HOME": str(hub.home), "HF_HUB_DOWNLOAD_TIMEOUT": "1", "HF_HUB_ETAG_TIMEOUT": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, (str(FAST_RETRY), os.environ.get("PYTHONPATH"))))}
    return run_process(*args, "--json", env=env, timeout=timeout)


def link_error(r: subprocess.CompletedProcess, *needles: str) -> str:
    """The run ended in one line of kind environment (exit 2), holding each of `needles`."""
    line = one_error(r, 2, *needles)
    assert json.loads(r.stdout)["error"]["kind"] == "environment", r.stdout
    return line


def weight_bytes(ckpts: Path) -> int:
    return sum(p.stat().st_size for p in (ckpts / "model").glob("*.safetensors"))


FAULTS = ["reset", "refuse", "status:503", "status:402", "timeout"]


def fail_midway(hub: HubServer, how: str, after: int) -> None:
    """The link fails once `after` body bytes went out: `how` as HubServer.fail, or "timeout" (the server
    stops sending, and huggingface_hub's reads time out)."""
    if how == "timeout":
        hub.stall_after = after
    else:
        hub.fail, hub.fail_after = how, after


@pytest.mark.parametrize("how", FAULTS)
def test_a_link_failing_mid_shard_ends_convert_in_one_line_with_resume(ckpts, hub, tmp_path, how):
    out = tmp_path / "out"
    fail_midway(hub, how, weight_bytes(ckpts) // 2)
    r = link_cli("convert", "--tp", "3", REPO_ID, out, *SMALL_PARTS, hub=hub)
    line = link_error(r, "--resume", ".safetensors")
    if how == "status:402":
        assert "quota" in line and "a third" in line and "fetch" in line
    elif how in ("reset", "timeout"):  # cut inside a shard: its bytes are on disk and named
        assert "bytes are kept in" in line
    if how in ("reset", "status:503"):  # the link is back: --resume finishes it, nothing was lost
        hub.fail_after = None
        hub.failed.clear()
        cli("convert", "--tp", "3", REPO_ID, out, *SMALL_PARTS, "--resume", hub=hub)
        same_conversion(out, ckpts / "disk")
    hub.release()


def test_a_link_failing_in_a_kept_download_ends_in_one_line(ckpts, hub, tmp_path):
    fail_midway(hub, "reset", weight_bytes(ckpts) // 2)
    r = link_cli("convert", "--tp", "3", REPO_ID, tmp_path / "out", *SMALL_PARTS, "--keep-source", hub=hub)
    link_error(r, "--resume", "Hugging Face cache")


def test_a_hub_gone_before_anything_ends_plan_and_convert_in_one_line(ckpts, hub, tmp_path):
    hub.stop()
    for args in (("plan", "--tp", "3", REPO_ID), ("convert", "--tp", "3", REPO_ID, tmp_path / "out")):
        link_error(link_cli(*args, hub=hub), "config.json", "cannot connect")
    assert not (tmp_path / "out").exists()


def test_a_link_failing_mid_diff_keeps_its_bytes_and_the_same_diff_finishes(ckpts, hub, tmp_path):
    out = tmp_path / "out"
    cli("convert", "--tp", "3", REPO_ID, out, *SMALL_PARTS, hub=hub)
    shutil.rmtree(hub.home)  # nothing cached: diff reads the Hub
    hub.fail, hub.fail_after = "reset", hub.bytes_sent() + weight_bytes(ckpts) // 2
    dl = tmp_path / "dl"
    link_error(link_cli("diff", out, "--download-source", "--download-dir", dl, hub=hub), "bytes are kept in",
               str(dl), "run the same command again")
    hub.fail_after = None
    hub.failed.clear()
    r = cli("diff", out, "--download-source", "--download-dir", dl, hub=hub)
    assert "OK: every rank tensor is its source slices" in r.stdout and not dl.exists()


def test_a_link_failing_in_check_numerics_ends_in_one_line(ckpts, hub, tmp_path):
    out = tmp_path / "out"
    cli("convert", "--tp", "3", REPO_ID, out, *SMALL_PARTS, hub=hub)
    shutil.rmtree(hub.home)
    before = hub.bytes_sent()
    cli("check-numerics", out, hub=hub)  # what a whole run takes: it reads only the tensors it checks
    tensors = hub.bytes_sent() - before
    shutil.rmtree(hub.home)
    weights = sum(q.sent for q in weight_requests(hub))
    hub.fail, hub.fail_after = "reset", hub.bytes_sent() + tensors - weights // 2  # mid-way through its tensors
    link_error(link_cli("check-numerics", out, hub=hub), "run the same command again")
    assert hub.failed.is_set()


def test_check_numerics_streams_only_the_tensors_it_checks(ckpts, hub, tmp_path):
    """Issue 63 item 4: check-numerics of a streamed output, its source on the Hub and not in the cache, takes
    each tensor it checks by a ranged request (the bytes of those tensors, not the checkpoint) and computes
    what it computes from the checkpoint on disk."""
    out = tmp_path / "out"
    cli("convert", "--tp", "3", REPO_ID, out, *SMALL_PARTS, hub=hub)
    shutil.rmtree(hub.home)  # nothing cached: the Hub serves it
    n = len(hub.requests)
    remote = json.loads(cli("check-numerics", out, "--layers", "1", "--json", hub=hub).stdout)["result"]
    local = json.loads(cli("check-numerics", out, ckpts / "model", "--layers", "1", "--json").stdout)["result"]
    assert remote["ok"] and remote["results"] == local["results"]
    spans = {}  # each tensor's bytes in its shard, from the shard's own header
    for shard in (ckpts / "model").glob("*.safetensors"):
        data = shard.read_bytes()
        size = int.from_bytes(data[:8], "little")
        for key, t in json.loads(data[8:8 + size]).items():
            if key != "__metadata__":
                spans[(shard.name, 8 + size + t["data_offsets"][0], 8 + size + t["data_offsets"][1] - 1)] = key
    reads = [q for q in hub.requests[n:] if q.path.endswith(".safetensors") and q.method == "GET"
             and not (q.range.startswith("bytes=0-") and q.sent <= 1 << 18)]
    got = [spans.get((q.path, *map(int, q.range.removeprefix("bytes=").split("-")))) for q in reads]
    assert got and None not in got, [q.range for q in reads]  # every weight read is one tensor's bytes, exactly
    assert {k.split(".")[1] for k in got} == {"1"}  # of layer 1 alone
    assert sum(q.sent for q in reads) < weight_bytes(ckpts) // 4


# ---------------------------------------------------------------- the download folder (issue 61 E)


def test_a_download_dir_that_is_a_file_is_refused_before_anything_is_written(hub, tmp_path):
    (tmp_path / "dl").write_text("mine")
    line = one_error(cli("convert", "--tp", "3", REPO_ID, tmp_path / "out", "--download-dir", tmp_path / "dl",
                         *SMALL_PARTS, hub=hub, check=False), 2, "not a folder", alone=True)
    assert str(tmp_path / "dl") in line
    assert not (tmp_path / "out").exists() and (tmp_path / "dl").read_text() == "mine"


def test_a_download_dir_the_user_made_is_left_in_place(ckpts, hub, tmp_path):
    """The end of a conversion removes only what the tool made: an empty folder of the user's (or a mount
    point, where removing it failed with EBUSY) stays."""
    (tmp_path / "dl").mkdir()
    cli("convert", "--tp", "3", REPO_ID, tmp_path / "out", "--download-dir", tmp_path / "dl", *SMALL_PARTS, hub=hub)
    same_conversion(tmp_path / "out", ckpts / "disk")
    assert (tmp_path / "dl").is_dir() and not list((tmp_path / "dl").iterdir())


def test_two_conversions_sharing_a_download_dir_do_not_break_each_other(ckpts, hub, tmp_path):
    """The folder is held by the first: the second is refused in one line (kind locked) before it writes
    anything there, and the first, let go on, ends byte-identical to the conversion from disk."""
    dl = tmp_path / "dl"
    hub.stall_after, hub.stall_min_body = weight_bytes(ckpts) // 2, 1 << 18  # the second's header reads go on
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(hub.home), "HF_HUB_DISABLE_TELEMETRY": "1"}
    first = subprocess.Popen(cli_argv("convert", "--tp", "3", REPO_ID, tmp_path / "a", *SMALL_PARTS, "-q",
                                      "--download-dir", dl), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        assert hub.stalled.wait(120), "the first conversion never reached the stall"
        r = run_process("convert", "--tp", "3", REPO_ID, tmp_path / "b", *SMALL_PARTS, "--download-dir", dl,
                        "--json", env=env, timeout=120)
        one_error(r, 2, str(dl), "another lucifer-shard command")
        assert json.loads(r.stdout)["error"]["kind"] == "locked"
    finally:
        hub.release()
        _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    same_conversion(tmp_path / "a", ckpts / "disk")


# ---------------------------------------------------------------- bounded reads (issue 61 E)


@pytest.fixture
def huge_header_repo(ckpts, tmp_path):
    """The checkpoint with its first shard replaced by a sparse 1.5 GiB file whose header declares 1.4 GiB."""
    repo = tmp_path / "huge"
    shutil.copytree(ckpts / "model", repo)
    first = sorted(repo.glob("*.safetensors"))[0]
    with open(first, "wb") as f:
        f.write((1400 << 20).to_bytes(8, "little") + b"{")
        f.truncate(1536 << 20)
    return repo, first.name


@pytest.mark.parametrize("ignore_range", [False, True], ids=["declared-1.4GiB", "range-ignored"])
def test_an_oversized_answer_is_refused_while_reading(huge_header_repo, tmp_path, ignore_range):
    repo, shard = huge_header_repo
    with HubServer({REPO_ID: repo}) as h:
        h.home = tmp_path / "hf-home"
        h.ignore_range = ignore_range
        r = cli("convert", "--tp", "3", REPO_ID, tmp_path / "out", hub=h, check=False)
        one_error(r, 2, shard)
        sent = h.bytes_sent(shard)
    assert sent < 64 << 20, f"{sent:,} bytes of {shard} were sent to the client"  # not the 1.4 GiB


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_stop_during_a_read_timeout_ends_convert_as_the_stop(ckpts, hub, tmp_path, sig, code):
    """The Hub stops sending mid-shard; the stop lands while the download thread waits out its read timeout
    or huggingface_hub's retry: convert ends as the stop, one line, no internal error."""
    hub.stall_after = weight_bytes(ckpts) // 2
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(hub.home), "HF_HUB_DISABLE_TELEMETRY": "1",
           "HF_HUB_DOWNLOAD_TIMEOUT": "1"}
    proc = subprocess.Popen(cli_argv("convert", "--tp", "3", REPO_ID, tmp_path / "out", *SMALL_PARTS), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert hub.stalled.wait(120)
        time.sleep(1.5)  # past the first read timeout: in huggingface_hub's retry
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        hub.release()
    assert proc.returncode == code, err
    # huggingface_hub's own retry warnings come first; the command's last word is its stop message
    assert "Traceback" not in err and "internal error" not in err, err
    assert err.strip().splitlines()[-1].startswith("interrupted"), err


@pytest.mark.parametrize("flag", ["-q", "--json"])
def test_plan_quiet_or_json_on_a_repo_id_shows_no_hub_bar(ckpts, hub, tmp_path, flag):
    """Issue 64: plan -q / --json on a repo id printed huggingface_hub's "Fetching 1 files" bar; a plain plan
    still may (stderr here is no terminal: the bar is huggingface_hub's to show)."""
    r = cli("plan", "--tp", "3", REPO_ID, tmp_path / "out", *SMALL_PARTS, flag, hub=hub)
    assert "Fetching" not in r.stderr and "it/s" not in r.stderr, r.stderr


# The harness wraps (never replaces) two engine functions to count their calls in a real convert from the
# stand-in Hub: the count is what issue 60 item 2 asks of the repo-id route.
COUNTED_CONVERT = """
import collections, json, sys
from lucifer_shard.engine import convert, job
calls = collections.Counter()
def counted(module, name):
    real = getattr(module, name)
    def wrapper(*args, **kw):
        calls[name] += 1
        return real(*args, **kw)
    setattr(module, name, wrapper)
counted(job, "layout_of")
counted(convert, "refuse_target")
from lucifer_shard.cli.group import cli
try:
    cli(sys.argv[1:], standalone_mode=False)
finally:
    print("CALLS " + json.dumps(calls))
"""


def test_the_repo_id_route_plans_and_refuses_out_once(ckpts, hub, tmp_path):
    """config.json is planned once and OUT's refusals made once, before a header; the job keeps that plan."""
    env = {**os.environ, "HF_HUB_DISABLE_TELEMETRY": "1", "HF_ENDPOINT": hub.url, "HF_HOME": str(hub.home)}
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-c", COUNTED_CONVERT, "convert", "--tp", "3", REPO_ID, str(out),
                        *SMALL_PARTS, "-q"], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    calls = json.loads(r.stdout.rsplit("CALLS ", 1)[1])
    assert calls == {"layout_of": 1, "refuse_target": 1}
    same_conversion(out, ckpts / "disk")
