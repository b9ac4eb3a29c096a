"""serve and doctor as a user meets them, in this environment without vLLM (tests/shim/ runs them
against the real vllm==0.33.0): option parsing around `--`, --dry-run, --mtp, the doctor's guide,
the wheel for the serving image."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from lucifer_shard import __version__
from lucifer_shard.model import runtimes
from lucifer_shard.outnames import MANIFEST_NAME
from lucifer_shard.output.manifest import manifest_text
from lucifer_shard.runtime_shim.serving import doctor, serve
from lucifer_shard.runtime_shim.serving.doctor import FAIL, OK, Check

from helpers import own_copy, run, script_module

REPO = Path(__file__).resolve().parent.parent
SPEC = '{"method":"mtp","num_speculative_tokens":%d}'


def command_of(out: Path, *tail: str, backends: bool = True) -> str:
    pair = " --attention-backend FLASHINFER_MLA_SPARSE_DSV4 --moe-backend flashinfer_cutlass" if backends else ""
    return (f"vllm serve {out.resolve()} --tensor-parallel-size 3 --load-format lucifer_tp3{pair}"
            + "".join(" " + t for t in tail))


SKIPPED = ("environment checks skipped: vLLM is not installed here, so vLLM, the plugin and the GPU were not "
           "checked; run lucifer-shard doctor OUT (or this dry run) again on the serving host")


@pytest.fixture
def preflight_passes(monkeypatch):
    """A vetted serving environment, as far as the doctor's checks go."""
    passed = [Check("vllm", OK, "vetted build")]
    monkeypatch.setattr(doctor, "doctor_report", lambda out=None, mtp=False, node_ranks=None: passed)
    monkeypatch.setattr(doctor, "quick_checks", lambda out, mtp=False, node_ranks=None, manifest=None: passed)


def edited_copy(out: Path, dst: Path, edit) -> Path:
    """OUT hard-linked into `dst`, its manifest replaced by `edit(manifest)` re-sealed (the self-digest
    is public: anyone can recompute it, tests/test_hostile_inputs.py::reseal)."""
    shutil.copytree(out, dst, copy_function=os.link)
    doc = json.loads((dst / MANIFEST_NAME).read_text())
    edit(doc)
    (dst / MANIFEST_NAME).unlink()  # a new file: the hard link to OUT's manifest is left alone
    (dst / MANIFEST_NAME).write_text(manifest_text({k: v for k, v in doc.items() if k != "manifest_digest"}))
    return dst


@pytest.fixture
def any_arch(converted):
    """A model-layout output as `convert` without --arch writes it: manifest "arch": null (any GPU family)."""
    return converted(arch=None, expert_layout="model")


def test_options_go_anywhere_before_the_double_dash(converted):
    out = converted()
    r = run("serve", out, "--dry-run", "--", "--max-model-len", "4096", "--help")
    assert r.exit_code == 0, r.output  # no vLLM here: only OUT's checks gate the dry run
    assert r.stdout.strip().splitlines()[-1] == command_of(out, "--max-model-len 4096 --help")
    assert "[skip] vllm: not installed in this environment" in r.stdout and "[FAIL]" not in r.stdout
    assert "OUT's checks passed; 1 environment check(s) skipped (no vLLM here)" in r.stdout
    assert run("serve", "--dry-run", out).stdout == r.stdout.replace(" --max-model-len 4096 --help", "")


def test_dry_run_on_the_conversion_box_passes_on_the_output_alone(converted):
    """Without vLLM the environment cannot be checked: the dry run says so, exits 0 for a good output,
    and the real run still refuses to exec."""
    out = converted(expert_layout="model")
    r = run("serve", out, "--dry-run", "--mtp")
    assert r.exit_code == 0 and r.stderr == "", r.output
    lines = r.stdout.strip().splitlines()
    assert lines[-2:] == [SKIPPED, command_of(out, f"--speculative-config '{SPEC % 1}'")]
    doc = json.loads(run("serve", out, "--dry-run", "--json").stdout)
    assert doc["ok"] and doc["error"] is None
    res = doc["result"]
    # issue 43 finding 12: preflight_ok is the verdict `ok` and the exit code follow; what it covered is
    # environment_checked's to say
    assert (res["preflight_ok"], res["output_ok"], res["environment_checked"], res["notes"]) == (True, True, False,
                                                                                                 [SKIPPED])
    r = run("serve", out)
    assert r.exit_code == 1 and "error: serve: preflight failed (1 check(s)); first: [FAIL] vllm" in r.stderr
    doc = json.loads(run("serve", out, "--dry-run", "--mtp", "--json").stdout)
    assert doc["ok"] and doc["result"]["command"] == command_of(out, f"--speculative-config '{SPEC % 1}'")


def test_output_failures_come_before_the_environments(converted, tmp_path):
    out = converted(expert_layout="model")
    damaged = tmp_path / "damaged"
    shutil.copytree(out, damaged, copy_function=os.link)
    config = json.loads((damaged / "config.json").read_text())
    (damaged / "config.json").unlink()
    (damaged / "config.json").write_text(json.dumps({**config, "rope_theta": 1.0}))
    for args in (["serve", damaged, "--dry-run"], ["doctor", damaged]):
        r = run(*args)
        assert r.exit_code == 1, r.output
        report = [line for line in r.stdout.splitlines() if line.startswith("[")]
        scopes = [line.startswith(("[  ok] output", "[FAIL] output", "[info] output")) for line in report]
        assert scopes == sorted(scopes, reverse=True) and scopes[0], report  # every output check first
        assert "first: [FAIL] output: " in r.stderr and "config.json: " in r.stderr, r.stderr  # the output check
    doc = json.loads(run("serve", damaged, "--dry-run", "--json").stdout)
    assert doc["error"]["kind"] == "mismatch" and not doc["result"]["output_ok"]  # an edited OUT, as every reader says
    assert doc["result"]["checks"][0]["scope"] == "output"  # one output check: the manifest refused (issue 52)


def test_the_command_names_out_by_its_absolute_path(converted, monkeypatch):
    out = converted()
    monkeypatch.chdir(out.parent.parent)
    relative = Path(out.parent.name) / "." / out.name
    r = run("serve", relative, "--dry-run")
    assert r.stdout.strip().splitlines()[-1] == command_of(out)
    assert json.loads(run("serve", relative, "--dry-run", "--json").stdout)["result"]["argv"][2] == str(out.resolve())


@pytest.mark.parametrize("args,needle", [
    (["-pp", "2"], "pipeline_parallel_size=2 (rank files are per TP rank: start with --pipeline-parallel-size 1)"),
    (["--pipeline-parallel-size=2"], "pipeline_parallel_size=2"),
    (["--pipeline_parallel_size", "3"], "pipeline_parallel_size=3"),
    (["--data-parallel-size", "2"], "data_parallel_size=2"),
    (["-dp=2"], "data_parallel_size=2"),
    (["-pcp", "2"], "prefill_context_parallel_size=2"),
    (["--enable-expert-parallel"], "expert parallel on (the files shard the experts by TP: drop --enable-expert-parallel)"),
    (["--disable-expert-parallel", "-ep"], "expert parallel on"),
    (["--enable-eplb"], "EPLB on"),
    (["--enable_lora"], "LoRA on"),
    (["--model-loader-extra-config", '{"pattern": 1}'],
     "unknown --model-loader-extra-config key(s) 'pattern'; lucifer_tp3 accepts role, verify"),
    (["--model-loader-extra-config=[1]"], "--model-loader-extra-config [1] is not a JSON object"),
    (["--model-loader-extra-config", "verify=full"], "is not a JSON object"),
    (["--model-loader-extra-config", '{"verify": "sometimes"}'],
     "verify='sometimes'; expected one of 'none', 'headers', 'full'"),
    (["--model-loader-extra-config.role", "both"], "role='both'; expected one of 'auto', 'target', 'draft'"),
    (["--model-loader-extra-config", '{"verify": "full"}', "--model-loader-extra-config.x", "1"], "key(s) 'x'"),
])
def test_vllm_arguments_the_plugin_refuses_at_load_are_refused_before(converted, args, needle):
    """The same table as the load-time checks (runtime_shim.settings), in each spelling vLLM's parser takes."""
    for mode in (["--dry-run"], []):
        r = run("serve", converted(), *mode, "--", "--max-model-len", "4096", *args)
        assert r.exit_code == 2 and r.stderr.startswith("error: lucifer_tp3: refused before vLLM starts"), r.output
        assert needle in r.stderr and r.stdout == "", r.output


@pytest.mark.parametrize("args", [
    ["-pp", "1"], ["--data-parallel-size=1"], ["--no-enable-expert-parallel"],
    ["--enable-expert-parallel", "--disable-expert-parallel"], ["--enable-lora", "--no-enable-lora"],
    ["--model-loader-extra-config", '{"verify": "full", "role": "auto"}'],
    ["--model-loader-extra-config.verify", "none"], ["--served-model-name", "-pp"],
])
def test_vllm_arguments_the_plugin_accepts_pass(converted, args):
    r = run("serve", converted(), "--dry-run", "--json", "--", *args)
    assert r.exit_code == 0 and json.loads(r.stdout)["result"]["argv"][-len(args):] == args, r.output


def test_the_refusals_are_the_loaders_table():
    """One table: serve reads the loader's keys and the load-time settings, it has no list of its own."""
    from lucifer_shard.runtime_shim.adapt import settings

    assert settings.argument_problems(["--model-loader-extra-config", json.dumps(
        {k: v[-1] for k, v in settings.LOADER_OPTIONS.items()})]) == []
    for r in settings.REQUIRED:
        on = [r.flags[-1]] if r.switch else [r.flags[-1], "2"]
        (problem,) = settings.argument_problems(on)
        assert problem == r.problem(True if r.switch else "2")


@pytest.mark.parametrize("command", ["doctor", "serve"])
def test_what_is_no_output_is_an_output_error_naming_the_next_step(tmp_path, tiny_random, converted, command):
    """The OUT rule: nothing there, a file, a checkpoint, an empty directory, an unfinished conversion are
    kind `output` (exit 2), each with the step that gets an output; never a check about a load format."""
    (tmp_path / "file").write_text("x")
    (tmp_path / "empty").mkdir()
    unfinished = tmp_path / "unfinished"
    shutil.copytree(converted(), unfinished, copy_function=os.link)
    (unfinished / "COMPLETE").unlink()
    cases = {tmp_path / "nothing": "no such output directory",
             tmp_path / "file": "a file, not an output directory; pass the directory lucifer-shard convert wrote",
             tiny_random: "this is a checkpoint: convert it first, then use OUT; run lucifer-shard convert --tp 3 --expert-layout model",
             tmp_path / "empty": "not a lucifer-shard output (no lucifer-manifest.json): convert into it first",
             unfinished: "unfinished; run the same convert command with --resume"}
    for out, message in cases.items():
        r = run(command, out, *(["--dry-run"] if command == "serve" else []))
        assert r.exit_code == 2 and r.stderr.startswith(f"error: {out}: {message}"), r.output
        assert r.stderr.count("\n") == 1 and "lucifer_tp3" not in r.stderr, r.stderr
        doc = json.loads(run(command, out, "--json", *(["--dry-run"] if command == "serve" else [])).stdout)
        assert doc["error"]["kind"] == "output" and doc["error"]["exit_code"] == 2


def test_an_output_for_any_arch_gets_the_serving_gpus_backends(any_arch, monkeypatch):
    """manifest "arch": null (convert without --arch, experts in model layout): serve takes the backends of
    the GPU it finds (runtimes.STOCK_BACKENDS); without one the command leaves them to vLLM, and says so."""

    r = run("doctor", any_arch)
    assert "tp 3, arch any (converted without --arch), experts model layout" in r.stdout, r.output
    r = run("serve", any_arch, "--dry-run")
    assert r.exit_code == 0, r.output
    skip_note, backends_note, line = r.stdout.strip().splitlines()[-3:]
    assert line == command_of(any_arch, backends=False)
    assert skip_note == SKIPPED and backends_note == serve.backends_remark()
    assert "no GPU is visible here" in backends_note and "sm90: FLASHMLA_SPARSE_DSV4 + marlin" in backends_note
    assert "sm120, sm121, sm100: FLASHINFER_MLA_SPARSE_DSV4 + flashinfer_cutlass" in backends_note
    assert json.loads(run("serve", any_arch, "--dry-run", "--json").stdout)["result"]["notes"] == [SKIPPED,
                                                                                               backends_note]
    for arch in ("sm90", "sm100", "sm120"):
        monkeypatch.setattr(doctor, "local_arch", lambda a=arch: a)
        r = run("serve", any_arch, "--dry-run")
        attn, moe = runtimes.STOCK_BACKENDS[arch]
        assert r.stdout.strip().splitlines()[-1] == command_of(any_arch).replace(
            "FLASHINFER_MLA_SPARSE_DSV4 --moe-backend flashinfer_cutlass", f"{attn} --moe-backend {moe}"), arch
        assert "backends:" not in r.stdout


def test_arch_null_with_kernel_layout_experts_is_refused(converted, tmp_path):
    """Kernel-layout experts are one GPU family's: a null arch there is an edited manifest."""
    out = edited_copy(converted(), tmp_path / "edited", lambda doc: doc.update(arch=None))
    r = run("serve", out, "--dry-run")
    assert r.exit_code == 1 and "[FAIL] output: lucifer_tp3: " in r.stdout
    assert "arch is null (any GPU family) but the experts are in kernel layout" in r.stdout


def test_help_is_help_wherever_it_is(converted):
    for args in (["serve", converted(), "--help"], ["serve", "--help"], ["serve", converted(), "--mtp", "-h"]):
        r = run(*args)
        assert r.exit_code == 0 and r.output.startswith("Usage: cli serve [OPTIONS] OUT [-- VLLM_ARGS]...")
        assert "--speculative-config" in r.output and "--dry-run" in r.output


def test_vllm_arguments_before_the_double_dash_are_refused_with_the_fix(converted):
    r = run("serve", converted(), "--max-model-len", "4096")
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


def test_serve_execs_vllm_after_the_preflight(converted, preflight_passes, monkeypatch, tmp_path):
    ran = []
    monkeypatch.setattr(serve, "exec_vllm", lambda argv, env: ran.append((argv, env)))
    out = own_copy(converted(), tmp_path / "out")
    r = run("serve", out, "--mtp", "--", "--max-model-len", "65536")
    assert r.exit_code == 0 and [argv for argv, _ in ran] == [
        command_of(out, f"--speculative-config {SPEC % 1}", "--max-model-len", "65536").split(" ")]
    assert json.loads(ran[0][1]["LUCIFER_SHARD_SERVE"]) == {"out": str(out.resolve()), "mtp": True}
    assert "preflight passed" in r.stderr


@pytest.mark.parametrize("args,needle", [
    (["--mtp-tokens", "2"], "--draft-tokens applies only with --draft"),
    (["--json"], "--json applies only with --dry-run"),
    (["--mtp", "--", "--speculative-config", "{}"], "--speculative-config is in the vLLM arguments but --draft sets it"),
    (["--", "-tp", "4"], "--tensor-parallel-size is in the vLLM arguments but lucifer-shard serve sets it"),
    (["--", "--load-format=auto"], "--load-format is in the vLLM arguments"),
    (["--dry-run", "--", "--hf-overrides", "{}"], "--hf-overrides is in the vLLM arguments but the plugin sets it"),
    (["--dry-run", "--", "--hf_overrides.num_attention_heads=72"], "--hf-overrides is in the vLLM arguments"),
])
def test_serve_refusals(converted, args, needle):
    r = run("serve", converted(), *args)
    assert r.exit_code == 2 and r.stderr.startswith("error: ") and needle in r.stderr, r.output


def test_mtp_needs_a_draft(converted):
    """The doctor's output checks run without vLLM too."""
    out = converted(mtp=False)
    r = run("serve", out, "--dry-run", "--mtp")
    assert r.exit_code == 1
    assert "[FAIL] output draft: OUT has no draft/ (converted with --no-mtp) -> serve without --draft" in r.stdout
    r = run("doctor", converted())
    assert "[info] output draft: OUT/draft holds the MTP layer (DeepSeekV4MTP, --speculative-config method 'mtp') -> serve --draft to use it" in r.stdout


def test_dry_run_with_an_unreadable_manifest_prints_no_placeholder(converted, tmp_path):
    """A manifest that does not load (here: not JSON) is a failed output check; the dry run then prints
    no command rather than one with a placeholder for the TP size."""
    out = tmp_path / "broken"
    shutil.copytree(converted(), out, copy_function=os.link)
    (out / MANIFEST_NAME).unlink()
    (out / MANIFEST_NAME).write_text("{not json")
    r = run("serve", out, "--dry-run")
    assert r.exit_code in (1, 2) and "<TP of OUT>" not in r.output and "vllm serve" not in r.stdout, r.output


def test_doctor_without_vllm_says_which_build_and_how_to_install(converted):
    r = run("doctor", converted())
    assert r.exit_code == 1
    text = r.stdout
    assert "[  ok] lucifer-shard dependencies: all present" in text
    assert "[FAIL] vllm: not installed in this environment" in text and "-> run doctor inside the serving environment" in text
    assert "vetted vLLM builds for lucifer_tp3:" in text and "pip install vllm==0.34.0" in text
    cols = list(runtimes.SUPPORTED_BUILDS[0].serves())
    assert not [c for c in cols if "--mtp" in c]  # the drafts' columns: --draft serves either kind
    table, how = text.split("vetted vLLM builds", 1)[1].split("how to get each:", 1)
    for b in runtimes.SUPPORTED_BUILDS:
        row = next(line for line in table.splitlines() if line.strip().startswith(b.commit + " "))
        words = row.split()
        assert words[1] == b.flashinfer
        assert words[2:2 + len(cols)] == ["yes" if ok else "no" for ok in b.serves().values()], row
        assert b.proven and row.endswith(b.proven), row  # each build's proof level (docs/serving.md's table has one)
        got = next(line for line in how.splitlines() if line.strip().startswith(b.commit + " "))
        assert b.install in got if b.stock else all(branch in got for branch in b.branches), got
    wheel = f"lucifer_shard-{__version__}-py3-none-any.whl"
    assert "make wheel" in text and f"pip install --no-deps {wheel}" in text and "pip check" in text
    assert "[  ok] output: " in text and "tp 3, arch sm120" in text
    assert r.stderr.startswith("error: doctor: 1 check(s) failed; first: [FAIL] vllm")
    doc = json.loads(run("doctor", "--json").stdout)
    assert not doc["ok"] and doc["error"]["exit_code"] == 1
    assert [b["commit"] for b in doc["result"]["builds"]] == ["45c1582e9", "cece381c4", "81564374e", "0.34.0", "0.33.0",
                                                              "0.32.0"]
    assert doc["result"]["builds"][1]["serves"]["MTP draft"] is False
    assert [b["cells"] for b in doc["result"]["builds"]] == [b.cells() for b in runtimes.SUPPORTED_BUILDS]
    failed = [c for c in doc["result"]["checks"] if c["status"] == FAIL]
    assert failed and all(c["fix"] for c in failed)
    assert run("doctor", "--mtp").output.startswith("error: --mtp checks an output's draft: pass OUT")


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
    assert {"lucifer_shard/runtime_shim/load/loader.py", "lucifer_shard/configs/deepseek-v4-flash.json",
            "lucifer_shard/runtime_shim/adapt/wrappers/hashes.json"} <= names
    assert "lucifer_tp3 = lucifer_shard.runtime_shim:register" in entry and "lucifer-shard = lucifer_shard.cli.entry:main" in entry


def test_where_to_get_a_server_is_one_table_in_doctor_and_readme():
    """The serving page's "Where to get a server" and doctor's guide (here, without vLLM) say the same routes, in
    the same order, from guide.routes(); the stock route comes first, with the install that works where the index
    lacks 0.34.0's FlashInfer pin (tools/vllm-env.sh's re-pin); no route names an image no one can pull."""
    from lucifer_shard.runtime_shim.serving import guide

    readme = (REPO / "docs" / "serving.md").read_text()
    section = readme.split("## Where to get a server", 1)[1].split("\n## ", 1)[0]
    items = [" ".join(item.replace("`", "").split()) for item in re.split(r"\n\d\. ", section)[1:]]
    expected = [f"{route}: {how}" for route, how in guide.routes()]
    assert items == expected
    text = run("doctor").stdout
    assert [f"  {i}. {line}" for i, line in enumerate(expected, 1)] == [
        line for line in text.splitlines() if re.match(r"  \d\. ", line)]
    assert expected[0].startswith("stock vLLM 0.34.0, the route to take: pip install vllm==0.34.0 (where the package "
                                  "index lacks flashinfer-python==0.7.3")
    repin = re.search(r'DEFAULT_REPIN="flashinfer-python==([\w.]+)->flashinfer-python==([\w.]+)"',
                      (REPO / "tools" / "vllm-env.sh").read_text())
    assert (doctor.STOCK.flashinfer, doctor.STOCK.flashinfer_repin) == repin.groups()
    assert doctor.STOCK.repinned_install() in expected[0]
    commits = {b.commit for b in runtimes.SUPPORTED_BUILDS}  # the annotations name builds of the table, forks all
    assert set(runtimes.FLASHINFER_REPIN) <= commits and {b.commit for b in runtimes.SUPPORTED_BUILDS if not b.stock} \
        <= set(runtimes.PROVEN) <= commits
    image = runtimes.AUDIT_IMAGE
    assert not [r for r in expected if image["tag"] in r or image["id"] in r]
    assert readme.index("## Where to get a server") < readme.index("## From a checkpoint to a running server")
    doc = json.loads(run("doctor", "--json").stdout)["result"]
    assert [r["route"] for r in doc["routes"]] == [r for r, _ in guide.routes()]
    assert [b["image"] for b in doc["builds"] if b["image"]] == [image]


@pytest.mark.parametrize("commit", ["0.33.0", "0.34.0", "0.32.0"])
def test_inside_a_vetted_build_doctor_names_it_first_and_points_nowhere_else(commit):
    """Issue 53: inside a working vetted build, that build is the first route (serve with it here), marked in the
    table; no other is "the route to take"."""
    from lucifer_shard.runtime_shim.serving import guide

    here = next(b for b in runtimes.SUPPORTED_BUILDS if b.commit == commit)
    found = guide.routes(here)
    assert found[0][0] == f"this environment's {here.label}, a vetted build" and here.proven in found[0][1]
    assert not [r for r, _ in found if "the route to take" in r]
    assert [r for r, _ in found[1:] if r.startswith("stock vLLM")] == (
        [] if here is doctor.STOCK else [f"stock vLLM {doctor.STOCK.commit}, the newest vetted release"])
    lines = guide.guide_lines(here)
    assert lines[0] == f"vetted vLLM builds for lucifer_tp3 (this environment: {commit}, marked *):"
    assert [line.split()[1] for line in lines if line.startswith("* ")] == [commit]


def test_the_repinned_install_is_the_release_then_its_requirements():
    """The 0.34.0 install without its FlashInfer pin: the release with no dependencies, then its own requirements
    (no extra's) with the one pin swapped, read from the installed metadata (what tools/vllm-env.sh installs)."""
    line = doctor.STOCK.repinned_install()
    first, second = line.split(" && ", 1)
    assert first == f"pip install --no-deps vllm=={doctor.STOCK.commit}"
    code = re.fullmatch(r'python -c "(.*)" \| pip install -r /dev/stdin', second).group(1)
    reqs = ['flashinfer-python==0.7.3', 'torch==2.14.0; extra == "x"', 'torch==2.14.0', 'six; python_version > "3.11"']
    import contextlib
    import importlib.metadata as md
    import io
    from unittest import mock

    assert not set(code) & set('$`"')  # bash passes the double-quoted code to python as it stands
    out = io.StringIO()
    with mock.patch.object(md, "requires", lambda name: reqs if name == "vllm" else None), \
            contextlib.redirect_stdout(out):
        exec(code, {})
    assert out.getvalue().splitlines() == ["flashinfer-python==0.7.4", "torch==2.14.0", 'six; python_version > "3.11"']


def _bench_serve_start():
    return script_module("bench/serve_start.py")


def test_serve_adds_at_most_two_seconds_before_vllm_starts(converted, tmp_path):
    """Issue 34: from the start of `lucifer-shard serve` to the exec of vLLM (a stand-in `vllm` on PATH and,
    no vLLM being installed here, vllm 0.34.0's package metadata) at most 2 s, best of three on a busy
    machine; the exec'd vLLM gets the command. Inside a real vLLM environment:
    tests/shim/test_serve_start.py (make test-shim)."""
    bench = _bench_serve_start()
    out = converted(expert_layout="model")
    runs = [bench.time_serve_start(out, tmp_path / "standin", "--mtp") for _ in range(3)]
    assert min(t for t, _, _ in runs) <= 2.0, [t for t, _, _ in runs]
    argv = runs[0][1]
    assert argv[:2] == ["serve", str(out.resolve())] and "--load-format" in argv, argv
    assert bench.imported_before_exec(out, tmp_path / "standin") == []  # torch is installed here


def test_the_preflight_before_exec_imports_no_vllm_or_torch(converted, monkeypatch):
    """quick_checks is what serve runs before exec: nothing of vLLM or torch may be imported by it."""
    out = converted(expert_layout="model")
    code = ("import sys; from lucifer_shard.runtime_shim.serving import doctor; doctor.quick_checks(sys.argv[1], True); "
            "doctor.serve_backends(None); print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "[]", r.stdout


def test_the_readme_checklist_names_the_vetted_stock_pin_and_the_gpu_families():
    """The serving checklist's vLLM pin is the shim's vetted stock build (model/runtimes' table: update one, the
    other must follow), and its GPU families are doctor's, by product name."""
    readme = (REPO / "README.md").read_text()
    checklist = readme.split("## Serving checklist", 1)[1].split("\n## ", 1)[0]
    pins = re.findall(r"pip install vllm==([\w.]+)", checklist)
    assert pins == [doctor.STOCK.commit], pins
    for arch, products in re.findall(r"(sm\d+) \(([^)]*)\)", doctor.GPU_FAMILIES):
        assert f"{' / '.join(products.split(', '))} = `{arch}`" in checklist, (arch, products)
    first_screen = "\n".join(readme.splitlines()[:60])
    for heading in ("## Quickstart", "## Serving checklist", "## Proof status"):
        assert heading in first_screen


def _delete_file(out: Path, other: Path) -> None:
    (out / "target" / "rank-1" / "part-00000.safetensors").unlink()


def _truncate_file(out: Path, other: Path) -> None:
    path = out / "target" / "rank-2" / "part-00000.safetensors"
    data = path.read_bytes()[: 64 << 10]
    path.unlink()  # a new file: the hard link to the fixture's is left alone
    path.write_bytes(data)


def _delete_folder(out: Path, other: Path) -> None:
    shutil.rmtree(out / "target" / "rank-0")


def _swap_other_weights(out: Path, other: Path) -> None:
    """The rank files of another checkpoint converted with the same options: the same headers."""
    for rank in range(3):
        path = out / "target" / f"rank-{rank}" / "part-00000.safetensors"
        path.unlink()
        os.link(other / "target" / f"rank-{rank}" / "part-00000.safetensors", path)


@pytest.mark.parametrize("damage,needle", [
    (_delete_file, "target rank 1 lm_head.weight: target/rank-1/part-00000.safetensors: file is missing"),
    (_truncate_file, "target/rank-2/part-00000.safetensors: 65536 bytes, the manifest records"),
    (_delete_folder, "target/rank-0/part-00000.safetensors: rank folder target/rank-0 is missing"),
    (_swap_other_weights, "lucifer.content is 'blake3:"),
])
def test_a_partial_or_swapped_copy_fails_the_preflight_as_a_mismatch(converted, tiny_random, tmp_path, damage,
                                                                      needle):
    """Issue 43 finding 10: the preflight opens this node's rank files as inspect does (presence, size,
    header, identity stamp; no hashing): serve --dry-run, serve and doctor exit 1, kind mismatch."""
    out = converted(expert_layout="model")
    copy = tmp_path / "copy"
    shutil.copytree(out, copy, copy_function=os.link)
    damage(copy, converted(tiny_random, expert_layout="model"))
    for args in (["serve", copy, "--dry-run"], ["doctor", copy]):
        r = run(*args, "--json")
        doc = json.loads(r.stdout)
        assert r.exit_code == 1 and doc["error"]["kind"] == "mismatch", r.output
        assert "[FAIL] output" in doc["error"]["message"] and needle in doc["error"]["message"]  # a size: the output check
    r = run("serve", copy)
    assert r.exit_code == 1 and "first: [FAIL] output" in r.stderr and needle in r.stderr, r.output
    r = run("serve", copy, "--dry-run", "-q")
    assert r.exit_code == 1 and r.stdout == "", r.output  # no command for a script to run
    r = run("serve", out, "--dry-run")
    assert r.exit_code == 0 and "[  ok] output rank files: 6 file(s) of rank(s) 0, 1, 2: present" in r.stdout


def test_a_share_is_checked_for_its_own_ranks_and_served_as_its_node(converted, tmp_path):
    """Finding 12: a share served without --nnodes names the flags its node needs; with them, only its
    own rank files are opened; every node's command says whose path it names."""
    share = tmp_path / "node1"
    assert run("stage", converted(expert_layout="model"), share, "--nnodes", "3", "--node-rank", "1", "-q").exit_code == 0
    r = run("serve", share, "--dry-run")
    assert r.exit_code == 1 and ("[FAIL] output node ranks: this share holds rank(s) 1 only: add --nnodes 3 "
                                 "--node-rank 1 --master-addr H (node 0's address)") in r.stdout, r.output
    assert "1 check(s) failed; 1 environment check(s) skipped" in r.stdout and "(1 check(s))" in r.stderr
    r = run("serve", share, "--dry-run", "--nnodes", "3", "--node-rank", "1", "--master-addr", "node0.lan")
    assert r.exit_code == 0 and "[  ok] output rank files: 2 file(s) of rank(s) 1: present" in r.stdout, r.output
    assert f"Each names this box's path, {share.resolve()}: on another box put the path of that node's share" in r.stdout
    (share / "target" / "rank-1" / "part-00000.safetensors").unlink()
    r = run("serve", share, "--dry-run", "--nnodes", "3", "--node-rank", "1", "--master-addr", "node0.lan")
    assert r.exit_code == 1 and "rank-1/part-00000.safetensors: file is missing" in r.stderr, r.output


@pytest.mark.parametrize("addr", ["--headless", "", "-tp", "node_0", "-node0", "a..b"])
def test_master_addr_is_a_host_name_or_an_address(converted, addr):
    r = run("serve", converted(), "--dry-run", "--nnodes", "3", "--node-rank", "0", "--master-addr", addr)
    assert r.exit_code == 2 and f"--master-addr {addr!r}: not a host name or IP address" in r.stderr, r.output


@pytest.mark.parametrize("addr", ["10.0.0.1", "fe80::1", "node0", "node-0.example.lan"])
def test_master_addr_takes_hosts_and_addresses(converted, addr):
    r = run("serve", converted(), "--dry-run", "--nnodes", "3", "--node-rank", "0", "--master-addr", addr)
    assert r.exit_code == 0 and f"--master-addr {addr}" in r.stdout, r.output


def test_each_gpu_row_of_the_proof_table_names_its_machine_model_and_vllm():
    """Issue 43 finding 13: a GPU row says on which machine, with which model (a synth preset: no Flash
    checkpoint ran on a GPU) and which vLLM (or none) it ran; what has not run is listed as not proven (a real
    drafter's acceptance: the drafts that ran on the H200 were random-fill)."""
    from lucifer_shard.engine.presets import PRESETS

    proof_page = (REPO / "docs" / "evidence" / "proof-status.md").read_text()  # the table, moved from the README
    table = proof_page.split("## Proof status", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[3:] if line.startswith("|")]
    gpu = [(claim, status) for claim, status, _ in rows if status.startswith("proven") and "CPU" not in status]
    assert gpu
    for claim, status in gpu:
        assert re.search(r"NVIDIA (H100|H200|B200|GB200|RTX|DGX)", status), status
        assert any(f"`{p}`" in claim + status or f"synth {p}" in claim + status for p in PRESETS), claim
        assert re.search(r"vLLM 0\.\d+\.\d+|no vLLM", status), status
    unproven = [claim for claim, status, _ in rows if status.startswith("**not")]
    assert any("0.34.0 on a GPU" in c for c in unproven) and any("acceptance rate" in c for c in unproven), unproven
