"""`vet` (tools/vet.py), the one command that vets a stock vLLM release: on the real wheels of the vetted
releases it reproduces their committed rows of `model/runtimes.SUPPORTED_BUILDS` and their entries in the data file
of hashes byte for byte, and shows what changed between them.

The wheels come from `pip download --no-deps`, which pip answers from its cache once the test venvs were
built (make test-shim); without that cache and without network these tests skip, saying why."""
from __future__ import annotations

import subprocess
import sys

import pytest

from lucifer_shard.model import runtimes

from shim_fixtures import TOOLS, tool

RELEASES = ("0.33.0", "0.34.0")


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict:
    vet = tool("vet")
    where = tmp_path_factory.mktemp("wheels")
    try:
        return {v: vet.fetch_wheel(v, where) for v in RELEASES}
    except vet.VetError as e:
        pytest.skip(f"needs the vLLM wheels (network or pip's cache): {e}")


def _committed(version: str):

    return next(b for b in runtimes.SUPPORTED_BUILDS if b.commit == version)


@pytest.mark.network
@pytest.mark.parametrize("version", RELEASES)
def test_vet_reproduces_the_committed_row(wheels, version, tmp_path):
    from lucifer_shard.runtime_shim.adapt import compat, wrappers

    vet = tool("vet")
    against = vet.last_vetted(version)
    assert against.commit == next(v for v in RELEASES if v != version)
    found = vet.candidate(version, wheels[version], against)
    assert found.build == _committed(version)
    assert found.hashes == wrappers.HASHES[version]
    text = vet.row_text(found.build)
    assert eval(text.strip().removesuffix(","), {"Build": runtimes.Build}) == _committed(version)  # noqa: S307
    data = tmp_path / "hashes.json"
    data.write_bytes(compat.HASHES_FILE.read_bytes())
    assert vet.write_hashes(found, data).endswith(f"the hashes of {version} unchanged (review: git diff hashes.json)")
    assert data.read_bytes() == compat.HASHES_FILE.read_bytes()  # vet's rewrite of a vetted release: no byte moves


@pytest.mark.network
def test_vet_shows_the_diff_of_each_changed_symbol(wheels):
    vet = tool("vet")
    lines = vet.changes("0.34.0", wheels["0.34.0"], _committed("0.33.0"), wheels["0.33.0"])
    headers = [ln for ln in lines if ln.startswith("=== ")]
    engine = [h for h in headers if ".EngineArgs.create_engine_config " in h]
    assert len(engine) == 1 and "(used by stock_virtual_tp_config)" in engine[0], headers
    from lucifer_shard.runtime_shim.adapt.wrappers import stock_config

    assert lines[lines.index(engine[0]) + 1] == f"read: {stock_config.WRAPPER.read_in_diff}"
    assert "sha256:1f9166220749 -> sha256:6df2ef3ae3e1, parameters unchanged" in engine[0]
    assert not [h for h in headers if "VocabParallelEmbedding" in h]  # byte-identical: no diff to read
    assert "+++ vllm==0.34.0:vllm/engine/arg_utils.py" in lines
    assert "-        mamba_config.validate_ssu_algorithm()" in lines and "+        mamba_config.__post_init__()" in lines
    for arg in ("enable_extensible_kv_cache", "max_num_inflight_kv_loads", "cache_aware_admission_window",
                "cache_aware_admission_threshold"):
        assert [ln for ln in lines if ln.startswith(f"+            {arg}=self.{arg},")], arg


@pytest.mark.network
def test_vet_command_writes_the_committed_hashes_and_prints_the_committed_row(wheels, tmp_path):
    """The command itself, without the venv and the proofs (--hashes-only): vetting 0.33.0 again leaves the data
    file of hashes as committed, byte for byte (a release's review is `git diff` of it), and prints its row."""
    from lucifer_shard.runtime_shim.adapt import compat

    data = tmp_path / "hashes.json"
    data.write_bytes(compat.HASHES_FILE.read_bytes())
    r = subprocess.run([sys.executable, str(TOOLS / "vet.py"), "0.33.0", "--hashes-only", "--hashes-file", str(data),
                        "--wheels", str(wheels["0.33.0"].parent)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "compared with the last vetted release vllm-0.34.0-" in r.stdout
    assert f"{data}: the hashes of 0.33.0 unchanged" in r.stdout
    assert data.read_bytes() == compat.HASHES_FILE.read_bytes()
    row = r.stdout[r.stdout.index("    Build(\n"):].strip().removesuffix(",")
    assert eval(row, {"Build": runtimes.Build}) == _committed("0.33.0")  # noqa: S307


def test_the_stock_proofs_are_the_makefiles():
    """`vet` runs the stock proofs `make test` runs on the previous release: one list, said twice."""
    from pathlib import Path

    vet = tool("vet")
    makefile = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    line = next(ln for ln in makefile.splitlines() if ln.startswith("STOCK_PROOFS = "))
    assert tuple(line.split(" = ", 1)[1].split()) == vet.STOCK_PROOFS


def test_the_candidate_row_reaches_the_harness_intact(monkeypatch):
    """vet hands the candidate to the proofs through LUCIFER_VET_CANDIDATE; the harness adds its row to the
    vetted builds of its own process, equal to what vet computed, after the committed ones (the newest
    vetted release stays the one doctor names), and its hashes to the vetted hashes."""
    import dataclasses

    import shim_fixtures as sf
    from lucifer_shard.runtime_shim.adapt import compat, wrappers

    vet = tool("vet")
    row = dataclasses.replace(_committed("0.34.0"), commit="9.9.9", label="vLLM 9.9.9 (PyPI, CUDA 13 wheel)",
                              install="pip install vllm==9.9.9")
    found = vet.Candidate(row, wrappers.HASHES["0.34.0"])
    committed = runtimes.SUPPORTED_BUILDS
    monkeypatch.setattr(runtimes, "SUPPORTED_BUILDS", committed)
    monkeypatch.setattr(wrappers, "HASHES", wrappers.HASHES)
    monkeypatch.setenv(vet.CANDIDATE_ENV, vet.candidate_json(found))
    sf.allow_vet_candidate()
    assert runtimes.SUPPORTED_BUILDS == (*committed, row)
    assert wrappers.HASHES["9.9.9"] == found.hashes and "9.9.9" not in compat.read_hashes()
    assert vet.stock_releases()[0] == row and vet.last_vetted("9.9.9").commit == "0.34.0"


def _vet(*args: str, env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    """The vet command with pip kept off every index (PIP_NO_INDEX, an empty find-links): no network."""
    import os
    import tempfile

    empty = tempfile.mkdtemp(prefix="lucifer-vet-links-")
    offline = {**os.environ, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": empty, "PIP_CONFIG_FILE": os.devnull,
               **(env or {})}
    try:
        return subprocess.run([sys.executable, str(TOOLS / "vet.py"), *args], capture_output=True,
                              text=True, env=offline, cwd=cwd)
    finally:
        os.rmdir(empty)


def _one_line_error(r: subprocess.CompletedProcess, needle: str) -> None:
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert needle in r.stderr and len([ln for ln in r.stderr.splitlines() if ln.startswith("error")]) == 1, r.stderr


def test_vet_refuses_a_wheels_path_that_is_a_file(tmp_path):
    """Issue 43 finding 14: `--wheels EXISTING_FILE` ended in a FileExistsError traceback."""
    wheels = tmp_path / "wheels"
    wheels.write_text("")
    _one_line_error(_vet("9.9.9", "--hashes-only", "--wheels", str(wheels)), f"--wheels {wheels}: a file, not a folder")


def test_a_release_that_does_not_exist_cannot_be_vetted_exit_2():
    r = _vet("9.9.9", "--hashes-only")
    _one_line_error(r, "pip download --no-deps vllm==9.9.9 failed (")
    assert "check that 9.9.9 is a release of vllm" in r.stderr


def test_vet_never_takes_over_another_checkouts_venv(tmp_path):
    """vet points the venv's editable install at its own checkout: a venv installed for another one (its
    make test-shim's) is refused before any download, whether named by --venv or LUCIFER_VLLM_VENV."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / ".lucifer-project").write_text("/elsewhere/lucifer-shard 0123456789abcdef\n")
    needle = f"the venv {theirs} is installed for the checkout /elsewhere/lucifer-shard"
    _one_line_error(_vet("9.9.9", "--venv", str(theirs)), needle)
    _one_line_error(_vet("9.9.9", env={"LUCIFER_VLLM_VENV": str(theirs)}), needle)
    _one_line_error(_vet("9.9.9", "--venv", str(TOOLS.parent / "venv")), "is inside the checkout")


def test_a_venv_that_vllm_env_refuses_is_not_a_failed_proof(tmp_path):
    """A venv that tools/vllm-env.sh refuses (here: it holds another release) is reported as that, with
    vllm-env's reason, not as "the stock proofs failed"."""
    import pytest as _pytest

    vet = tool("vet")
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".lucifer-base-ok").write_text("vllm==0.1.0\n")
    with _pytest.raises(vet.VetError) as e:
        vet.run_proofs("9.9.9", vet.Candidate(_committed("0.34.0"), {}), venv)
    assert e.value.exit_code == 2 and f"the venv {venv} could not be made or used" in str(e.value)
    assert "holds vllm==0.1.0, not vllm==9.9.9" in str(e.value), str(e.value)
    assert sorted(p.name for p in venv.iterdir()) == [".lucifer-base-ok"]  # nothing built, nothing removed
