"""The link at the Hub's own speed (issue 63 item 1), against the stand-in Hub (tests/hubserver.py) that
huggingface_hub's own client talks to: a file comes over several ranged connections at once when each
connection is capped (as a CDN caps them), still hashed against the Hub's SHA-256 and continued from its
bytes on disk after a cut; a Xet-stored file goes huggingface_hub's Xet path, the choice read from
huggingface_hub's own metadata API."""
from __future__ import annotations

import hashlib
import os
import time

import pytest

from hubserver import HubServer
from lucifer_shard.errors import SourceError
from lucifer_shard.guarded_io import Tree
from lucifer_shard.source import download
from lucifer_shard.source.download import download_route
from lucifer_shard.source.hub import DownloadFolder, LinkFault, download_resumed, repo_at

REPO_ID = "someone/one-big-shard"
NAME = "model-00001-of-00001.safetensors"  # served as an LFS file; its content needs not parse here
MiB = 1 << 20


@pytest.fixture
def served(tmp_path, monkeypatch):
    """One 128 MiB file (four of the route's blocks) on the stand-in Hub, huggingface_hub pointed at it."""
    from huggingface_hub import constants

    root = tmp_path / "repo"
    root.mkdir()
    data = os.urandom(128 * MiB)
    (root / NAME).write_bytes(data)
    with HubServer({REPO_ID: root}) as hub:
        # what HF_ENDPOINT sets when huggingface_hub is imported, for this process's client
        monkeypatch.setattr(constants, "ENDPOINT", hub.url)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
        yield hub, data


def _download(hub: HubServer, dest, size: int) -> str | None:
    return download_resumed(REPO_ID, hub.repos[REPO_ID].commit, NAME, Tree(dest), NAME, size, lambda n: None)


def test_a_file_comes_over_several_capped_connections_at_once(served, tmp_path):
    """Each connection capped at 8 MiB/s: one connection would take 16 s for 128 MiB; several at once bring
    it at the link's rate, every byte hashed as it came (the SHA-256 returned is the file's)."""
    hub, data = served
    hub.conn_rate = 8 * MiB
    (tmp_path / "dl").mkdir()
    t0 = time.perf_counter()
    sha = _download(hub, tmp_path / "dl", len(data))
    took = time.perf_counter() - t0
    assert (tmp_path / "dl" / NAME).read_bytes() == data
    assert sha == hashlib.sha256(data).hexdigest()
    assert hub.most_at_once >= 4, hub.most_at_once
    assert took < 16.0, f"{took:.1f} s: not faster than one capped connection (16 s)"
    ranges = sorted(r.range for r in hub.requests if r.method == "GET" and r.path == NAME)
    assert len(ranges) == 4 and all(r.startswith("bytes=") for r in ranges), ranges


def test_a_cut_download_in_blocks_keeps_a_whole_prefix_and_continues_from_it(served, tmp_path):
    hub, data = served
    hub.fail, hub.fail_after = "reset", 80 * MiB
    (tmp_path / "dl").mkdir()
    with pytest.raises(LinkFault) as e:
        _download(hub, tmp_path / "dl", len(data))
    kept = (tmp_path / "dl" / NAME).read_bytes()
    assert len(kept) < len(data) and kept == data[:len(kept)]  # in order, no hole: what the next run keeps
    assert f"{len(kept):,} of its {len(data):,} bytes are kept" in str(e.value)
    hub.fail_after = None
    hub.failed.clear()
    first = len(hub.requests)
    sha = _download(hub, tmp_path / "dl", len(data))
    assert sha == hashlib.sha256(data).hexdigest()
    assert (tmp_path / "dl" / NAME).read_bytes() == data
    again = [r for r in hub.requests[first:] if r.method == "GET" and r.path == NAME]
    assert min(int(r.range.split("=")[1].split("-")[0]) for r in again) == len(kept)
    assert sum(r.sent for r in again) == len(data) - len(kept)


@pytest.mark.parametrize("xet", [False, True], ids=["lfs", "xet"])
def test_the_route_is_chosen_from_huggingface_hubs_own_metadata(served, xet):
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    hub, _ = served
    hub.xet = xet
    metadata = get_hf_file_metadata(hf_hub_url(REPO_ID, NAME, revision=hub.repos[REPO_ID].commit))
    assert (metadata.xet_file_data is not None) == xet
    assert download_route(metadata) == ("xet" if xet else "ranged")


@pytest.mark.parametrize("honest", [True, False], ids=["honest", "other-bytes"])
def test_a_xet_file_goes_through_huggingface_hubs_xet_get_and_is_hashed(served, tmp_path, monkeypatch, honest):
    """No Xet storage service stands in here, so huggingface_hub's `xet_get` is replaced by one that writes
    the bytes the Hub would reconstruct (or other bytes of the same size): the route calls it with the
    metadata huggingface_hub parsed, and the file is still checked against the Hub's SHA-256."""
    from huggingface_hub import file_download

    hub, data = served
    hub.xet = True
    calls = []

    def xet_get(*, incomplete_path, xet_file_data, headers, expected_size, displayed_filename, tqdm_class):
        calls.append((xet_file_data.file_hash, expected_size))
        incomplete_path.write_bytes(data if honest else data[::-1])
    monkeypatch.setattr(file_download, "xet_get", xet_get)
    repo = repo_at(REPO_ID, hub.repos[REPO_ID].commit)
    folder = DownloadFolder(repo, tmp_path / "dl")
    folder.claim()
    if honest:
        assert folder.fetch(NAME).read_bytes() == data
    else:
        with pytest.raises(SourceError, match="SHA-256"):
            folder.fetch(NAME)
        assert not (tmp_path / "dl" / NAME).exists()
    assert calls == [(hashlib.sha256(data).hexdigest(), len(data))]
    assert not [r for r in hub.requests if r.method == "GET" and r.path == NAME]  # no byte over plain HTTP
    folder.close([NAME])


def test_a_server_ignoring_ranges_is_refused_in_blocks(served, tmp_path):
    hub, data = served
    assert download.BLOCK < len(data)  # the first block's answer, the whole file, is more than it asked for
    hub.ignore_range = True
    (tmp_path / "dl").mkdir()
    with pytest.raises(SourceError, match="does not serve byte ranges"):
        _download(hub, tmp_path / "dl", len(data))
