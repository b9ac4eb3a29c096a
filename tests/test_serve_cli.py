"""serve and doctor as a user meets them, in this environment without vLLM (tests/shim/ runs them
against the real vllm==0.33.0): option parsing around `--`, --dry-run, --mtp, the doctor's guide,
the wheel for the serving image."""
from __future__ import annotations

import json
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from lucifer_shard import __version__
from lucifer_shard.cli import cli
from lucifer_shard.runtime_shim import compat, doctor
from lucifer_shard.runtime_shim.doctor import FAIL, OK, Check

REPO = Path(__file__).resolve().parent.parent
SPEC = '{"method":"mtp","num_speculative_tokens":%d}'


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def command_of(out: Path, *tail: str) -> str:
    return (f"vllm serve {out} --tensor-parallel-size 3 --load-format lucifer_tp3 --attention-backend "
            f"FLASHINFER_MLA_SPARSE_DSV4 --moe-backend flashinfer_cutlass" + "".join(" " + t for t in tail))


@pytest.fixture
def preflight_passes(monkeypatch):
    """A vetted serving environment, as far as the doctor's checks go."""
    monkeypatch.setattr(doctor, "doctor_report", lambda out=None, mtp=False: [Check("vllm", OK, "vetted build")])


def test_options_go_anywhere_before_the_double_dash(converted):
    out = converted()
    r = run("serve", out, "--dry-run", "--", "--max-model-len", "4096", "--help")
    assert r.exit_code == 1  # no vLLM here: the preflight fails, the command is still printed
    assert r.stdout.strip().splitlines()[-1] == command_of(out, "--max-model-len 4096 --help")
    assert "[FAIL] vllm: not installed in this environment" in r.stdout
    assert r.stderr.startswith("error: serve: preflight failed (1 check(s)); first: [FAIL] vllm")
    assert run("serve", "--dry-run", out).stdout == r.stdout.replace(" --max-model-len 4096 --help", "")


def test_help_is_help_wherever_it_is(converted):
    for args in (["serve", converted(), "--help"], ["serve", "--help"], ["serve", converted(), "--mtp", "-h"]):
        r = run(*args)
        assert r.exit_code == 0 and r.output.startswith("Usage: cli serve [OPTIONS] OUT [-- VLLM_ARGS]...")
        assert "--speculative-config" in r.output and "--dry-run" in r.output


def test_vllm_arguments_before_the_double_dash_are_refused_with_the_fix(converted):
    r = CliRunner().invoke(cli, ["serve", str(converted()), "--max-model-len", "4096"])
    assert r.exit_code == 2 and "No such option" in r.output and "--max-model-len" in r.output
    assert "vLLM's own arguments go after `--`: lucifer-shard serve OUT [OPTIONS] -- --max-model-len 65536" in r.output


def test_dry_run_passes_only_with_the_preflight(converted, preflight_passes):
    out = converted()
    r = run("serve", out, "--dry-run", "--mtp", "--", "--port", "8000")
    assert r.exit_code == 0, r.output
    assert r.stdout.strip().splitlines()[-1] == command_of(out, f"--speculative-config '{SPEC % 1}' --port 8000")
    doc = json.loads(run("serve", out, "--dry-run", "--mtp", "--mtp-tokens", "2", "--json").stdout)
    assert doc["ok"] and doc["result"]["preflight_ok"]
    assert doc["result"]["argv"][-2:] == ["--speculative-config", SPEC % 2]
    assert json.loads(doc["result"]["argv"][-1]) == {"method": "mtp", "num_speculative_tokens": 2}


def test_serve_execs_vllm_after_the_preflight(converted, preflight_passes, monkeypatch):
    ran = []
    monkeypatch.setattr(doctor, "exec_vllm", ran.append)
    out = converted()
    r = run("serve", out, "--mtp", "--", "--max-model-len", "65536")
    assert r.exit_code == 0 and ran == [command_of(out, f"--speculative-config {SPEC % 1}", "--max-model-len",
                                                    "65536").split(" ")]
    assert "preflight passed" in r.stderr


@pytest.mark.parametrize("args,needle", [
    (["--mtp-tokens", "2"], "--mtp-tokens applies only with --mtp"),
    (["--json"], "--json applies only with --dry-run"),
    (["--mtp", "--", "--speculative-config", "{}"], "--speculative-config is in the vLLM arguments but --mtp sets it"),
    (["--", "-tp", "4"], "--tensor-parallel-size is in the vLLM arguments but lucifer-shard serve sets it"),
    (["--", "--load-format=auto"], "--load-format is in the vLLM arguments"),
])
def test_serve_refusals(converted, args, needle):
    r = run("serve", converted(), *args)
    assert r.exit_code == 2 and r.stderr.startswith("error: ") and needle in r.stderr, r.output


def test_mtp_needs_a_draft(converted):
    """The doctor's output checks run without vLLM too."""
    out = converted(mtp=False)
    r = run("serve", out, "--dry-run", "--mtp")
    assert r.exit_code == 1
    assert "[FAIL] output MTP draft: OUT has no draft/ (converted with --no-mtp) -> serve without --mtp" in r.stdout
    r = run("doctor", converted())
    assert "[info] output MTP draft: OUT/draft holds the MTP draft -> serve --mtp to use it" in r.stdout


def test_dry_run_without_a_manifest_still_shows_the_command(tmp_path):
    r = run("serve", tmp_path, "--dry-run")
    assert r.exit_code == 1
    assert "[FAIL] output: lucifer_tp3:" in r.stdout and "lucifer-manifest.json not found" in r.stdout
    assert r.stdout.strip().splitlines()[-1].startswith(f"vllm serve {tmp_path} --tensor-parallel-size '<TP of OUT>'")


def test_doctor_without_vllm_says_which_build_and_how_to_install(converted):
    r = run("doctor", converted())
    assert r.exit_code == 1
    text = r.stdout
    assert "[  ok] lucifer-shard dependencies: all present" in text
    assert "[FAIL] vllm: not installed in this environment" in text and "-> run doctor inside the serving image" in text
    assert "vetted vLLM builds for lucifer_tp3:" in text and "pip install vllm==0.33.0" in text
    cols = list(compat.SUPPORTED_BUILDS[0].serves())
    for b in compat.SUPPORTED_BUILDS:
        row = next(line for line in text.splitlines() if line.strip().startswith(b.commit + " "))
        assert b.install in row if b.stock else all(branch in row for branch in b.branches), row
        words = row.split()
        assert words[1] == b.flashinfer
        assert words[2:2 + len(cols)] == ["yes" if ok else "no" for ok in b.serves().values()], row
    wheel = f"lucifer_shard-{__version__}-py3-none-any.whl"
    assert "make wheel" in text and f"pip install --no-deps {wheel}" in text and "pip check" in text
    assert "[  ok] output: " in text and "tp 3, arch sm120" in text
    assert r.stderr.startswith("error: doctor: 1 check(s) failed; first: [FAIL] vllm")
    doc = json.loads(run("doctor", "--json").stdout)
    assert not doc["ok"] and doc["error"]["exit_code"] == 1
    assert [b["commit"] for b in doc["result"]["builds"]] == ["45c1582e9", "cece381c4", "81564374e", "0.33.0", "0.32.0"]
    assert doc["result"]["builds"][1]["serves"]["MTP draft (--mtp)"] is False
    failed = [c for c in doc["result"]["checks"] if c["status"] == FAIL]
    assert failed and all(c["fix"] for c in failed)
    assert run("doctor", "--mtp").output.startswith("error: --mtp checks an output's MTP draft: pass OUT")


def test_no_serve_extra_and_the_wheel_carries_the_plugin(tmp_path):
    """The plugin serves on stock vllm==0.33.0 or a fork build, whichever the serving environment has, so no
    extra pins one; `make wheel` builds what that environment needs."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert "serve" not in project.get("optional-dependencies", {})
    assert not any(dep.startswith("vllm") for dep in project["dependencies"])
    dist = tmp_path / "dist"
    subprocess.run(["make", "-s", "wheel", f"PY={sys.executable}", f"DIST={dist}"], cwd=REPO, check=True,
                   capture_output=True)
    (wheel,) = dist.glob("*.whl")
    assert wheel.name == f"lucifer_shard-{__version__}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        entry = z.read(f"lucifer_shard-{__version__}.dist-info/entry_points.txt").decode()
    assert {"lucifer_shard/runtime_shim/loader.py", "lucifer_shard/configs/deepseek-v4-flash.json"} <= names
    assert "lucifer_tp3 = lucifer_shard.runtime_shim:register" in entry and "lucifer-shard = lucifer_shard.cli:main" in entry
