"""bench/gpu_load.py's plumbing on CPU (`--device cpu --preset tiny`): the converter's output made,
every loader run cold and warm and checked, the JSON written, the scratch tree removed. The figures
themselves come from the H200 run, not from here."""
from __future__ import annotations

import json

import pytest
import torch

from helpers import script_module



@pytest.fixture(scope="module")
def gpu_load():
    return script_module("bench/gpu_load.py")


def test_one_invocation_measures_and_checks_every_loader(gpu_load, tmp_path, capsys):
    work, out = tmp_path / "work", tmp_path / "r.json"
    gpu_load.main(["--device", "cpu", "--preset", "tiny", "--reps", "2", "--work", str(work), "--json", str(out),
                   "--slots", "2", "--chunk-mib", "1", "--rank", "all"])
    res = json.loads(out.read_text())
    assert not work.exists()
    # every rank's tensors counted and checked: the ranks share names (a first run on the H200 kept one rank's)
    assert len(res["prepare"]["files"]) == 3 and res["tensor_bytes"] > 0.9 * res["prepare"]["file_bytes"]
    assert res["prepare"]["file_bytes"] > 0 and res["cold_method"] in ("drop_caches", "fadvise")
    ours = ("safetensors", "lucifer digests=off", "lucifer digests=on")
    assert set(ours) <= res["loaders"].keys()
    for name in ours:
        rec = res["loaders"][name]
        assert "error" not in rec and len(rec["cold"]) == len(rec["warm"]) == 2, (name, rec)
        assert rec["warm_vs_best_peer"] == pytest.approx(rec["warm_median"] / max(
            r["warm_median"] for n, r in res["loaders"].items() if not n.startswith("lucifer")), abs=1e-3)
    assert set(res["skipped"]) | res["loaders"].keys() >= set(gpu_load.PEERS)
    printed = capsys.readouterr().out
    assert "| lucifer digests=on |" in printed and str(out) in printed


def test_a_wrong_byte_fails_the_check(gpu_load):
    ref = {"a": torch.arange(10, dtype=torch.uint8), "b": torch.zeros(3, dtype=torch.uint8)}
    got = {"a": ref["a"].clone(), "b": torch.tensor([0, 0, 1], dtype=torch.uint8)}
    gpu_load.check({"a": ref["a"].clone(), "b": ref["b"].clone()}, ref)
    with pytest.raises(RuntimeError, match="1 tensors differ from the reference, e.g. b"):
        gpu_load.check(got, ref)


def test_digest_cost_bench_measures_every_setting_on_a_small_file(tmp_path):
    """bench/digest_cost.py's plumbing on CPU with small sizes: every measurement written, the reader's runs
    positive, the warm file removed (its figures come from the GPU host)."""
    module = script_module("bench/digest_cost.py")
    out, warm = tmp_path / "d.json", tmp_path / "warm.bin"
    module.main(["--device", "cpu", "--gb", "0.012", "--tensor-mb", "4", "--buffer-mib", "4", "--file", str(warm),
                 "--json", str(out)])
    res = json.loads(out.read_text())
    assert not warm.exists()
    assert res["cores"] >= 1 and res["memory copy 32 MiB, 16 threads"] > 0
    assert res["hash max_threads=-1 update=16MiB, 4 readers beside"] > 0
    runs = {k: v for k, v in res.items() if k.startswith("reader digests=")}
    assert len(runs) == 2 + 2 * 9 + 2 and all(min(v["reader"] if isinstance(v, dict) else v) > 0 for v in runs.values())
