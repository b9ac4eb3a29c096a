"""`lucifer-shard fetch` (issue 51, part 4): one node's share of a published output, from the Hub (stood in
for by tests/hubserver.py, so huggingface_hub's own client code runs) or from a directory. It brings exactly
that node's files, manifest first, and DEST is what `stage` writes for the node, byte for byte; a tampered
file is refused by name and never gets its name in DEST; --dry-run reads only the manifest; a fetch killed
mid-download is finished by the same command, which asks only for what was not finished."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lucifer_shard.errors import CONVERT_RESUME

from hubserver import HubServer
from helpers import cli_argv, one_error, run, run_process

REPO_ID = "someone/flash-tp3"
MiB = 1 << 20


def hub_env(hub: HubServer, home: Path) -> dict[str, str]:
    """huggingface_hub reads HF_ENDPOINT at import: a subprocess gets the stand-in from its first line."""
    return {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(home), "HF_HUB_DISABLE_TELEMETRY": "1",
            "TQDM_DISABLE": "1"}


def fetch_hub(hub: HubServer, home: Path, *args) -> subprocess.CompletedProcess:
    return run_process("fetch", *args, env=hub_env(hub, home), timeout=300)


def contents(root: Path) -> dict[str, bytes]:
    """Every file below `root` (hidden ones too) and its bytes."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def published_copy(out: Path, where: Path) -> Path:
    """OUT as it is published: without .lucifer/."""
    shutil.copytree(out, where, ignore=shutil.ignore_patterns(".lucifer"))
    return where


def node_files(out: Path, rank: int) -> set[str]:
    """What a node's share holds from OUT: every top-level file and its rank's files."""
    return {rel for rel in contents(out) if "/" not in rel} | {
        p.relative_to(out).as_posix() for p in out.glob(f"*/rank-{rank}/*.safetensors")}


@pytest.fixture(scope="module")
def published(tmp_path_factory, converted) -> Path:
    """tiny at TP3 in 1 MiB parts (about 20 files per rank and role), published without .lucifer/."""
    out = converted(max_file_bytes=MiB)
    assert len(list(out.glob("target/rank-1/*.safetensors"))) > 5
    return published_copy(out, tmp_path_factory.mktemp("published") / "out")


@pytest.fixture(scope="module")
def staged(tmp_path_factory, published) -> Path:
    dest = tmp_path_factory.mktemp("staged") / "node1"
    r = run("stage", published, dest, "--nnodes", 3, "--node-rank", 1)
    assert r.exit_code == 0, r.output
    return dest


def test_from_the_hub_exactly_the_nodes_files_manifest_first_and_stages_bytes(published, staged, tmp_path):
    dest = tmp_path / "node1"
    with HubServer({REPO_ID: published}) as hub:
        r = fetch_hub(hub, tmp_path / "hf", REPO_ID, dest, "--nnodes", 3, "--node-rank", 1)
        assert r.returncode == 0, r.stderr
        got = hub.files_requested()
        heads = hub.files_requested("HEAD")
    assert got[0] == "lucifer-manifest.json" and heads[0] == "lucifer-manifest.json"
    want = node_files(published, 1)
    assert set(got) == set(heads) == want and len(got) == len(want)  # each once, nothing of ranks 0 and 2
    assert not [p for p in got if "rank-0" in p or "rank-2" in p]
    assert contents(dest) == contents(staged)  # no download area left, no other byte
    assert f"{len(want) - 1} downloaded" in r.stdout  # COMPLETE is written, not counted
    assert r.stdout.strip().splitlines()[-1] == (
        f"next: lucifer-shard verify {dest}; lucifer-shard serve {dest} --nnodes 3 --node-rank 1 --master-addr HOST")
    r = run("verify", dest)
    assert r.exit_code == 0, r.output
    r = run("serve", dest, "--nnodes", 3, "--node-rank", 1, "--master-addr", "127.0.0.1", "--dry-run")
    assert r.exit_code == 0 and "[  ok] output node ranks: holds this node's TP rank(s) 1" in r.stdout, r.output


def test_from_a_directory_it_is_stage_byte_for_byte(published, staged, tmp_path):
    dest = tmp_path / "node1"
    r = run("fetch", published, dest, "--nnodes", 3, "--node-rank", 1)
    assert r.exit_code == 0, r.output
    assert contents(dest) == contents(staged)
    assert all((dest / rel).stat().st_ino != (published / rel).stat().st_ino for rel in contents(dest)
               if (published / rel).exists())  # copies, each checked: a link would publish unread bytes
    assert run("verify", dest).exit_code == 0
    r = run("fetch", published, dest, "--nnodes", 3, "--node-rank", 1)  # again: every file kept
    assert r.exit_code == 0 and f"0 copied, {len(node_files(published, 1)) - 1} already there" in r.stdout, r.output
    r = run("fetch", published, dest, "--ranks", 2)
    assert r.exit_code == 2 and "already a share of rank(s) 1 of tp 3" in r.stderr


def flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1:]


def refused_and_unpublished(dest: Path, rel: str) -> None:
    assert not (dest / "COMPLETE").exists() and not (dest / rel).exists()
    assert not [p for p in dest.rglob("*") if p.as_posix().endswith(rel)]  # not even in the download area


def test_a_file_the_hub_serves_changed_is_refused_by_name(published, tmp_path):
    """The Hub's SHA-256 is the original's, the bytes are not: huggingface_hub checks only the size."""
    rel = sorted(p for p in node_files(published, 1) if p.startswith("target/"))[3]
    dest = tmp_path / "node1"
    with HubServer({REPO_ID: published}) as hub:
        data = (published / rel).read_bytes()
        hub.tamper[(REPO_ID, rel)] = flip(data, len(data) // 2)
        r = fetch_hub(hub, tmp_path / "hf", REPO_ID, dest, "--nnodes", 3, "--node-rank", 1)
        commit = hub.repos[REPO_ID].commit
    assert r.returncode == 1, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: {REPO_ID}@{commit}:{rel}: SHA-256 ") and "the Hub publishes for it" in line
    assert line.endswith("run the same fetch again (it resumes: files already checked are kept, a cut file continues)")
    refused_and_unpublished(dest, rel)


def test_a_published_file_that_is_not_the_manifests_is_refused_by_name(published, tmp_path):
    """From a directory, and from the Hub serving that directory (the Hub's SHA-256 is then the changed file's:
    the manifest's digest is what refuses it)."""
    bad = published_copy(published, tmp_path / "bad")
    rel = sorted(p for p in node_files(published, 1) if p.startswith("target/"))[3]
    data = (bad / rel).read_bytes()
    (bad / rel).write_bytes(flip(data, len(data) - 7))
    dest = tmp_path / "from-dir"
    r = run("fetch", bad, dest, "--nnodes", 3, "--node-rank", 1)
    assert r.exit_code == 1 and r.stderr.startswith(f"error: {bad / rel}: not the bytes the manifest records"), r.output
    assert f"{bad} is damaged; run lucifer-shard verify {bad} (it names every problem" in r.stderr
    refused_and_unpublished(dest, rel)
    dest = tmp_path / "from-hub"
    with HubServer({REPO_ID: bad}) as hub:
        r = fetch_hub(hub, tmp_path / "hf", REPO_ID, dest, "--nnodes", 3, "--node-rank", 1)
    assert r.returncode == 1 and f":{rel}: not the bytes the manifest records" in r.stderr, r.stderr
    assert "republish it from an OUT that verify passes" in r.stderr
    refused_and_unpublished(dest, rel)


def test_dry_run_prints_the_bytes_and_the_hf_download_line_and_reads_only_the_manifest(published, tmp_path):
    from huggingface_hub.utils import filter_repo_objects

    dest = tmp_path / "node1"
    want = node_files(published, 1)
    with HubServer({REPO_ID: published}) as hub:
        r = fetch_hub(hub, tmp_path / "hf", REPO_ID, dest, "--nnodes", 3, "--node-rank", 1, "--dry-run")
        assert r.returncode == 0, r.stderr
        assert hub.files_requested() == ["lucifer-manifest.json"]
        commit, everything = hub.repos[REPO_ID].commit, list(hub.repos[REPO_ID].files)
    assert not dest.exists()
    total = sum((published / rel).stat().st_size for rel in want - {"COMPLETE"})
    assert f"({total} bytes)" in r.stdout.splitlines()[0]
    line = r.stdout.strip().splitlines()[-1]
    hf = line[line.index("hf download "):]
    assert hf.startswith(f"hf download {REPO_ID} --revision {commit} --include ") and hf.endswith(f"--local-dir {dest}")
    argv = shlex.split(hf)
    patterns = [argv[i + 1] for i, a in enumerate(argv) if a == "--include"]
    assert set(filter_repo_objects(everything, allow_patterns=patterns)) == want  # exactly the node's files
    with HubServer({REPO_ID: published}) as hub:  # and huggingface_hub's own CLI, given the line, brings them
        cli_dest = tmp_path / "by-hf"
        argv[argv.index("--local-dir") + 1] = str(cli_dest)
        hf_cli = [sys.executable, "-c", "import sys; from huggingface_hub.cli.hf import main; sys.exit(main())"]
        done = subprocess.run([*hf_cli, *argv[1:]], env=hub_env(hub, tmp_path / "hf"), capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr
    assert {rel for rel in contents(cli_dest) if not rel.startswith(".cache/")} == want


def test_a_fetch_killed_mid_download_is_finished_by_the_same_command(converted, tmp_path):
    """One file per rank and role (about 18 MiB for target rank 1: more than huggingface_hub's 10 MiB read
    chunk, so part of it is on disk when the download stalls); the second run asks only for the rest of it."""
    published = published_copy(converted(), tmp_path / "out")
    rel = "target/rank-1/part-00000.safetensors"
    assert (published / rel).stat().st_size > 12 * MiB
    before = sum((published / p).stat().st_size for p in node_files(published, 1) if not p.startswith("target/"))
    dest, home = tmp_path / "node1", tmp_path / "hf"
    with HubServer({REPO_ID: published}) as hub:
        hub.stall_after = before + 11 * MiB  # inside the target file, after its first 10 MiB chunk
        proc = subprocess.Popen(cli_argv("fetch", REPO_ID, dest, "--nnodes", 3, "--node-rank", 1), env=hub_env(hub, home),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        partial = dest / ".lucifer-fetch" / rel
        try:
            assert hub.stalled.wait(120)
            deadline = time.monotonic() + 60  # the client writes the 10 MiB it holds, then waits for more
            while not (partial.exists() and partial.stat().st_size >= 10 * MiB) and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        hub.release()
        deadline = time.monotonic() + 30  # the killed run's request is recorded once the server gives up on it
        while rel not in hub.files_requested() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not (dest / "COMPLETE").exists() and not (dest / rel).exists()
        first = len(hub.requests)
        r = fetch_hub(hub, home, REPO_ID, dest, "--nnodes", 3, "--node-rank", 1)
        assert r.returncode == 0, r.stderr
        again = [q for q in hub.requests[first:] if q.method == "GET" and not q.path.startswith("api/")]
    assert [q.path for q in again] == [rel], again  # the files finished before are kept, not asked for
    assert again[0].range is not None and int(again[0].range.split("=")[1].split("-")[0]) >= 10 * MiB
    assert again[0].sent == (published / rel).stat().st_size - int(again[0].range.split("=")[1].split("-")[0])
    assert "already there" in r.stdout and run("verify", dest).exit_code == 0
    assert not (dest / ".lucifer-fetch").exists()


@pytest.mark.parametrize("args,needle", [
    (["--ranks", "3"], "--ranks '3': the output has TP ranks 0..2"),
    (["--ranks", "0,0"], "--ranks '0,0': rank 0 is named twice"),  # issue 61 G: taken as --ranks 0 before
    (["--nnodes", "3"], "--nnodes and --node-rank go together"),
    ([], "pass the ranks the node runs"),
    (["--ranks", "1", "--revision", "main"], "--revision applies only to a repo id"),
])
def test_refusals_before_anything_is_written(published, tmp_path, args, needle):
    r = run("fetch", published, tmp_path / "d", *args)
    assert r.exit_code == 2 and needle in r.stderr and not (tmp_path / "d").exists(), r.output


def test_convert_writes_the_model_card_the_manifest_records(tiny_pattern, tmp_path):
    """README.md: the Hub's front matter (tags, license from the source's own card, no base_model for a local
    source), the conversion id, TP, layout, arch, bytes per node, and each node's fetch and serve commands;
    recorded among the copies, so verify checks it, stage and fetch bring it and --resume writes it again."""
    from huggingface_hub import ModelCard

    from lucifer_shard.output.manifest_types import Manifest

    model = tmp_path / "model"
    shutil.copytree(tiny_pattern, model)
    (model / "README.md").write_text("---\nlicense: other\nlicense_name: deepseek\nlicense_link: LICENSE\n---\n# x\n")
    out = tmp_path / "out"
    args = ("convert", "--tp", 3, "--expert-layout", "model", "--max-file-size", "2M", model, out)
    assert run(*args).exit_code == 0
    card, m = ModelCard.load(out / "README.md"), Manifest.load(out)
    assert card.data.to_dict() == {"license": "other", "license_name": "deepseek", "license_link": "LICENSE",
                                   "tags": ["lucifer-shard", "deepseek_v4", "tensor-parallel-3", "safetensors"]}
    text = card.text
    assert f"| conversion id | `{m.conversion_id}` |" in text and "| TP size | 3 |" in text
    assert "| expert layout | model |" in text and "| arch | any GPU family (model layout) |" in text
    from lucifer_shard.units import size

    for node in range(3):
        node_bytes = sum(f.bytes for _, _, f in m.files([node]))
        assert f"| 3 | {node} | {node} | {size(node_bytes)} |" in text
        assert f"lucifer-shard fetch REPO DEST --nnodes 3 --node-rank {node}\n" in text
        draft = " --draft" if "draft" in m.roles else ""  # issue 64: the card's serve line omitted the draft
        assert f"lucifer-shard serve DEST{draft} --nnodes 3 --node-rank {node} --master-addr HOST\n" in text
    assert "draft" in m.roles and "is on no package index: build its wheel" in text  # where the tool comes from
    assert m.copies["README.md"].bytes == (out / "README.md").stat().st_size
    assert run("verify", out).exit_code == 0
    r = run("stage", out, tmp_path / "node2", "--ranks", 2)
    assert r.exit_code == 0 and (tmp_path / "node2" / "README.md").read_bytes() == (out / "README.md").read_bytes()
    original = (out / "README.md").read_bytes()
    (out / "README.md").write_text(original.decode().replace("REPO", "someone/else"))
    r = run("verify", out)
    assert r.exit_code == 1 and "README.md" in r.stderr + r.stdout and str(CONVERT_RESUME) in r.stderr + r.stdout
    r = run(*args, "--resume")
    assert r.exit_code == 0 and "README.md" in r.stdout, r.output
    assert (out / "README.md").read_bytes() == original and run("verify", out).exit_code == 0


def test_the_card_names_the_source_repo_as_base_model(converted):
    import dataclasses

    from lucifer_shard.engine.card import card_text
    from lucifer_shard.output.manifest_types import Manifest

    m = Manifest.load(converted())
    hub = dataclasses.replace(m, source=dataclasses.replace(m.source, repo="deepseek-ai/DeepSeek-V4-Flash-0731",
                                                            revision="a" * 40))
    text = card_text(hub, {})
    assert text.startswith("---\nbase_model: deepseek-ai/DeepSeek-V4-Flash-0731\ntags:\n")
    assert "of `deepseek-ai/DeepSeek-V4-Flash-0731` at `" + "a" * 40 + "`" in text
    assert "base_model" not in card_text(m, {})  # a local checkpoint: no repo id to name


def test_an_edited_manifest_is_refused_before_any_other_file(published, tmp_path):
    import json

    bad = published_copy(published, tmp_path / "bad")
    doc = json.loads((bad / "lucifer-manifest.json").read_text())
    doc["tool_version"] = "0.0.0-edited"
    (bad / "lucifer-manifest.json").write_text(json.dumps(doc, indent=1))
    dest = tmp_path / "node1"
    with HubServer({REPO_ID: bad}) as hub:
        r = fetch_hub(hub, tmp_path / "hf", REPO_ID, dest, "--nnodes", 3, "--node-rank", 1)
        assert hub.files_requested() == ["lucifer-manifest.json"]
    assert r.returncode == 2 and "lucifer-manifest.json: manifest_digest does not match its content" in r.stderr
    assert not dest.exists()


@pytest.mark.parametrize("readme,license", [
    (None, {}),
    ("# no front matter\n", {}),
    ("---\nlicense: [unclosed\n---\n", {}),  # front matter the Hub cannot read either: nothing carried over
    ("---\nlicense: mit\ntags: [x]\n---\n# card\n", {"license": "mit"}),
])
def test_the_license_comes_from_the_sources_own_card_or_not_at_all(tmp_path, readme, license):
    from lucifer_shard.engine.card import source_license

    if readme is not None:
        (tmp_path / "README.md").write_text(readme)
    assert source_license(tmp_path) == license


# ---------------------------------------------------------------- issue 61, class B: fetch held to the output standard

B_EDITS = {  # rank 0's first target file in a re-sealed manifest: (field, new value from old, what the error names)
    "bytes + 1": ("bytes", lambda n: n + 1, "(truncated)"),
    "bytes 2**62": ("bytes", lambda n: 2 ** 62, f"the manifest records {2 ** 62} (truncated)"),
    "content stamp": ("content", lambda c: "blake3:" + "1" * 64, "__metadata__ lucifer.content is"),
    # an output written before the manifest recorded the stamps' digest (source.content.stamps): the file's own
    # stamp is what refuses it
    "content stamp, no stamps digest": ("content", lambda c: "blake3:" + "1" * 64, "__metadata__ lucifer.content is"),
}


def fetch_node0(source: Path, dest: Path, route: str, home: Path):
    """`fetch SOURCE DEST --nnodes 3 --node-rank 0` from the directory, or from the stand-in Hub serving it;
    `stage` for the same node, the standard fetch is held to."""
    if route == "hub":
        with HubServer({REPO_ID: source}) as hub:
            return fetch_hub(hub, home, REPO_ID, dest, "--nnodes", 3, "--node-rank", 0)
    return run(route, source, dest, "--nnodes", 3, "--node-rank", 0)


@pytest.mark.parametrize("route", ["fetch", "hub", "stage"])
@pytest.mark.parametrize("edit", B_EDITS)
def test_61b_a_resealed_manifest_verify_refuses_is_refused_without_complete(published, tmp_path, edit, route):
    """Before the fix fetch exited 0 on each (from a directory) and stage on the content stamp: fetch copied
    by digest alone, which covers neither the recorded size nor the recorded stamp (the header holds the old)."""
    from test_output_check import edited  # its edit-and-re-seal (the self-digest is public)

    field, change, needle = B_EDITS[edit]

    def edit_first_file(doc: dict) -> None:
        f = doc["roles"]["target"]["ranks"][0]["files"][0]
        f[field] = change(f[field])
        if edit.endswith("no stamps digest"):
            del doc["source"]["content"]["stamps"]

    bad = edited(published, tmp_path / "bad", edit_first_file)
    assert run("verify", bad).exit_code == 1  # the standard: verify refuses each
    dest = tmp_path / "node0"
    r = fetch_node0(bad, dest, route, tmp_path / "hf")
    if route == "hub" and field == "bytes":  # huggingface_hub asks for the manifest's size and refuses first
        one_error(r, 2, "target/rank-0/part-00000.safetensors")
    elif edit == "content stamp":  # class C: the manifest's digest of the stamps no longer holds: refused first
        one_error(r, 1 if route == "stage" else 2, "is not the digest of the rank files' content stamps")
    else:
        one_error(r, 1, "target/rank-0/part-00000.safetensors", needle)
    assert not (dest / "COMPLETE").exists()


@pytest.mark.parametrize("route", ["fetch", "hub"])
def test_61b_a_truncated_rank_file_is_refused_by_its_size_and_no_complete(published, tmp_path, route):
    bad = published_copy(published, tmp_path / "bad")
    rel = "target/rank-0/part-00000.safetensors"
    data = (bad / rel).read_bytes()
    (bad / rel).write_bytes(data[:-1])
    dest = tmp_path / "node0"
    r = fetch_node0(bad, dest, route, tmp_path / "hf")
    if route == "hub":  # huggingface_hub asks for the manifest's size and refuses the short body first (what
        one_error(r, 2, rel, "should be of size")  # came stays in the download area, for the next run to resume)
        assert not (dest / "COMPLETE").exists() and not (dest / rel).exists()
    else:
        one_error(r, 1, rel, f"{len(data) - 1} bytes, the manifest records {len(data)} (truncated)")
        refused_and_unpublished(dest, rel)


@pytest.mark.parametrize("command", ["fetch", "stage"])
def test_61b_a_dest_that_is_a_symlink_is_refused_untouched(published, tmp_path, command):
    """Before the fix both followed the link and wrote the share into the folder it points to."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "dest").symlink_to(tmp_path / "empty", target_is_directory=True)
    r = run(command, published, tmp_path / "dest", "--nnodes", 3, "--node-rank", 0)
    one_error(r, 2, f"{tmp_path / 'dest'}: is a symlink", "does not follow a link for DEST")
    assert not list((tmp_path / "empty").iterdir()) and (tmp_path / "dest").is_symlink()


# ---------------------------------------------------------------- a failing link (issue 61 E, issue 63 item 3)

FAST_RETRY = Path(__file__).resolve().parent / "fastretry"  # the harness that cuts huggingface_hub's retry waits


def link_env(hub: HubServer, home: Path) -> dict[str, str]:
    """hub_env with huggingface_hub's retry waits cut short (tests/fastretry) and a 1 s read timeout."""
    return {**hub_env(hub, home), "HF_HUB_DOWNLOAD_TIMEOUT": "1", "HF_HUB_ETAG_TIMEOUT": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, (str(FAST_RETRY), os.environ.get("PYTHONPATH"))))}


def environment_line(r: subprocess.CompletedProcess, *needles: str) -> str:
    line = one_error(r, 2, *needles)
    assert json.loads(r.stdout)["error"]["kind"] == "environment", r.stdout
    return line


@pytest.mark.parametrize("how", ["reset", "refuse", "status:503", "status:402"])
def test_a_link_failing_mid_file_ends_fetch_in_one_line_and_the_same_fetch_finishes(published, staged, tmp_path,
                                                                                     how):
    dest, home = tmp_path / "node1", tmp_path / "hf"
    with HubServer({REPO_ID: published}) as hub:
        hub.fail, hub.fail_after = how, sum((published / p).stat().st_size for p in node_files(published, 1)) // 2
        r = run_process("fetch", REPO_ID, dest, "--nnodes", 3, "--node-rank", 1, "--json", env=link_env(hub, home),
                        timeout=300)
        line = environment_line(r, "run the same fetch again", REPO_ID)
        if how == "status:402":
            assert "quota" in line and "a third" in line
        if how == "reset":  # cut inside a rank file: its bytes stay where the next run continues them
            assert "bytes are kept in" in line and ".lucifer-fetch" in line
        assert not (dest / "COMPLETE").exists()
        if how != "refuse":
            hub.fail_after = None
            hub.failed.clear()
            assert fetch_hub(hub, home, REPO_ID, dest, "--nnodes", 3, "--node-rank", 1).returncode == 0
            assert contents(dest) == contents(staged)


def test_a_hub_gone_from_the_start_ends_fetch_in_one_line(published, tmp_path):
    with HubServer({REPO_ID: published}) as hub:
        hub.stop()
        r = run_process("fetch", REPO_ID, tmp_path / "d", "--ranks", 1, "--json", env=link_env(hub, tmp_path / "hf"),
                        timeout=300)
        environment_line(r, "cannot connect", "run the same fetch again")
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_stop_during_a_read_timeout_ends_as_the_stop(published, tmp_path, sig, code):
    """The Hub stops sending mid-file; the stop lands while huggingface_hub waits out its read timeout or
    its retry: the command ends as the stop, one line, no internal error."""
    with HubServer({REPO_ID: published}) as hub:
        hub.stall_after = sum((published / p).stat().st_size for p in node_files(published, 1)) // 2
        env = {**hub_env(hub, tmp_path / "hf"), "HF_HUB_DOWNLOAD_TIMEOUT": "1"}
        proc = subprocess.Popen(cli_argv("fetch", REPO_ID, tmp_path / "d", "--ranks", 1), env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert hub.stalled.wait(120)
            time.sleep(1.5)  # past the first read timeout: in huggingface_hub's retry
            proc.send_signal(sig)
            out, err = proc.communicate(timeout=30)
        finally:
            proc.kill()
            hub.release()
    assert proc.returncode == code, err
    # huggingface_hub's own retry warnings come first; the command's last word is its stop message
    assert "Traceback" not in err and "internal error" not in err, err
    assert err.strip().splitlines()[-1].startswith("interrupted: "), err
