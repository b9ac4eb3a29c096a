"""doctor and serve against the real vLLM release of the venv (stock: virtual TP supplied by the plugin)."""
from __future__ import annotations

import json
import re

import pytest

from lucifer_shard.model import runtimes


# The git commit each wheel was built from (its vllm/_version.py)
WHEEL_COMMITS = {"0.33.0": "4ba787ec9", "0.34.0": "62d4bc3c7"}


def _by_name(checks):
    return {c.name: c for c in checks}


def test_doctor_on_the_stock_release_reports_plugin_virtual_tp(shim):
    import shim_fixtures as sf
    from lucifer_shard.runtime_shim.serving.doctor import FAIL, OK, WARN, doctor_report, format_report

    checks = doctor_report()
    c = _by_name(checks)
    v = sf.vllm_version()
    commit = WHEEL_COMMITS.get(v, "[0-9a-f]{9}")  # a release under `vet`: its commit is not known here
    assert c["vllm"].status == OK and re.fullmatch(
        rf"{re.escape(v)} \(commit {commit}\) = vetted build vLLM {re.escape(v)} \(PyPI, CUDA 13 wheel\)", c["vllm"].detail)
    vt = c["virtual TP"]
    assert vt.status == OK and vt.detail.startswith(f"supplied by the plugin on vLLM {v} "), vt
    rel = c["expert re-layout wrapper"]  # the release's re-layout is vetted: kernel-layout outputs load verbatim
    assert rel.status == OK and rel.detail == (f"installed (build {v}): kernel-layout experts (sm120/sm100, sm90) "
                                               "load verbatim"), rel
    assert c["source vllm.engine.arg_utils.EngineArgs.create_engine_config"].status == OK
    assert c["plugin entry point"].status == OK and "lucifer_shard.runtime_shim:register" in c["plugin entry point"].detail
    assert c["load format lucifer_tp3"].status == OK
    for mod_attr in ("vllm.model_executor.model_loader.register_model_loader", "vllm.config.LoadConfig"):
        assert c[f"symbol {mod_attr}"].status == OK
    assert c["GPU"].status == WARN and c["GPU"].blocks  # CPU box, vLLM's CUDA build
    assert not [x for x in checks if x.status == FAIL], [str(x) for x in checks if x.status == FAIL]
    # issue 53: what is missing here, not "can work here"
    tail = format_report(checks).splitlines()[-1]
    assert tail.startswith("no check failed, but lucifer_tp3 cannot serve on this host: GPU: ") and \
        "needs an NVIDIA GPU" in tail and "can work here" not in tail, tail
    assert all(x.fix for x in checks if x.status in (FAIL, WARN)), [str(x) for x in checks if not x.fix]


def test_doctor_gates_on_what_the_output_needs(out_kernel, out_model, tmp_path, shim):
    from lucifer_shard.runtime_shim.serving.doctor import FAIL, INFO, OK, doctor_report

    c = _by_name(doctor_report(out_kernel))  # TP3, experts in kernel layout: the stock release loads them verbatim
    assert "tp 3, arch sm120, experts kernel layout (FLASHINFER_CUTLASS_MXFP4_MXFP8)" in c["output"].detail
    assert "output needs virtual TP" not in c  # the plugin supplies it
    assert "output kernel-layout experts" not in c and c["expert re-layout wrapper"].status == OK
    assert not [x for x in c.values() if x.status == FAIL], [str(x) for x in c.values() if x.status == FAIL]
    c = _by_name(doctor_report(out_model))  # TP3, model layout: the stock release serves it
    assert c["virtual TP"].status == OK and c["expert re-layout wrapper"].status == OK
    assert not [x for x in c.values() if x.status == FAIL], [str(x) for x in c.values() if x.status == FAIL]
    import shim_fixtures as sf

    tp2 = tmp_path / "tp2"
    sf.cli("convert", "--tp", "2", "--arch", "sm120", "--expert-layout", "model", str(out_model.parent / "model"),
           str(tp2), "--quiet")
    c = _by_name(doctor_report(tp2))
    assert c["virtual TP"].status == OK and not [x for x in c.values() if x.status == FAIL]


def test_doctor_checks_sm90_kernel_layout_against_the_installed_flashinfers_generation(shim_base, monkeypatch, shim):
    """The venv's FlashInfer (0.7.x, folded) reads the default sm90 kernel layout; one of the legacy generation
    (its version replaced here: the venv has one FlashInfer) fails the output, naming both fixes. sm120 kernel
    layout depends on no generation: no such check."""
    import shim_fixtures as sf
    from lucifer_shard.runtime_shim.serving import doctor
    from lucifer_shard.runtime_shim.serving.doctor import FAIL, OK, doctor_report

    out = sf.convert_tiny(shim_base, "--arch", "sm90")
    c = _by_name(doctor_report(out))["output FlashInfer layout"]
    assert c.status == OK and c.detail.endswith(f"which flashinfer-python {doctor.dist_version('flashinfer-python')} reads")
    real = doctor.dist_version
    monkeypatch.setattr(doctor, "dist_version", lambda name: "0.6.14" if name == "flashinfer-python" else real(name))
    c = _by_name(doctor_report(out))["output FlashInfer layout"]
    assert c.status == FAIL and "flashinfer-python 0.6.14 reads the legacy layout" in c.detail
    assert c.fix == "re-convert with --flashinfer-layout legacy, or install flashinfer-python 0.6.16, >=0.6.18, 0.7.x"
    assert "output FlashInfer layout" not in _by_name(doctor_report(sf.convert_tiny(shim_base)))


@pytest.fixture
def unvetted(monkeypatch, shim):
    """This vLLM as an unvetted release: no vetted build has its create_engine_config."""
    from lucifer_shard.runtime_shim.adapt import compat, wrappers

    keys = {s.key for s in wrappers.WRAPPERS[runtimes.STOCK_CONFIG].symbols}
    other = {commit: {key: "sha256:" + "0" * 64 if key in keys else h for key, h in hashes.items()}
             for commit, hashes in wrappers.HASHES.items()}
    monkeypatch.setattr(wrappers, "HASHES", other)
    monkeypatch.setattr(compat, "VERDICTS", {})


def test_unvetted_vllm_fails_in_one_line_naming_the_function_the_pin_and_the_vet_command(unvetted):
    """A stock vLLM whose create_engine_config is not a vetted release's: the wrappers stay off, and the
    doctor fails without OUT (lucifer_tp3 is there for TP3), saying in one line which function's hash did
    not match, the newest vetted release to install and the command that vets this one."""
    import shim_fixtures as sf
    from lucifer_shard.runtime_shim.adapt import compat
    from lucifer_shard.runtime_shim.serving.doctor import FAIL, STOCK, doctor_report

    checks = _by_name(doctor_report())
    vt = checks["virtual TP"]
    assert vt.status == FAIL and "\n" not in str(vt), vt
    assert "source hash of vllm.engine.arg_utils.EngineArgs.create_engine_config sha256:" in vt.detail
    vetted = ", ".join(b.commit for b in runtimes.SUPPORTED_BUILDS if runtimes.STOCK_CONFIG in b.wrappers)
    assert f"matches no build vetted for it ({vetted})" in vt.detail
    assert vt.fix.startswith(f"pip install vllm=={STOCK.commit}") and ": the newest vetted release; or vet vLLM " in vt.fix
    assert f"python tools/vet.py {sf.vllm_version()} " in vt.fix
    assert not compat.installed(runtimes.STOCK_CONFIG)
    assert all(x.status != FAIL for x in checks.values() if x.name != "virtual TP")


def test_unvetted_vllm_doctor_exits_non_zero_for_tp3_and_not_for_tp2(unvetted, out_model, tmp_path):
    from click.testing import CliRunner

    import shim_fixtures as sf
    from lucifer_shard.cli import cli

    from lucifer_shard.runtime_shim.serving.doctor import STOCK

    fix = f"-> pip install vllm=={STOCK.commit}"
    for args in ([], [str(out_model)]):  # without OUT, and with a TP3 output
        r = CliRunner().invoke(cli, ["doctor", *args])
        assert r.exit_code == 1, r.output
        assert "[FAIL] virtual TP: not available" in r.stdout and fix in r.stdout, r.stdout
        assert ": the newest vetted release; or vet vLLM" in r.stdout
    assert "[FAIL] output needs virtual TP" in r.stdout
    tp2 = tmp_path / "tp2"
    sf.cli("convert", "--tp", "2", "--arch", "sm120", "--expert-layout", "model", str(out_model.parent / "model"),
           str(tp2), "--quiet")
    r = CliRunner().invoke(cli, ["doctor", str(tp2)])  # 64 heads divide by 2: no virtual TP needed
    assert r.exit_code == 0 and "[info] virtual TP: not available" in r.stdout, r.output


def test_doctor_flags_b12x_env_and_plugin_allow_list(monkeypatch, shim):
    from lucifer_shard.runtime_shim.serving.doctor import FAIL, doctor_report

    monkeypatch.setenv("VLLM_USE_B12X_MOE", "1")
    monkeypatch.setenv("VLLM_PLUGINS", "something_else")
    c = _by_name(doctor_report())
    assert c["env VLLM_USE_B12X_MOE"].status == FAIL
    assert c["env VLLM_PLUGINS"].status == FAIL and "excludes lucifer_tp3" in c["env VLLM_PLUGINS"].detail


def test_serve_argv_and_refusals(out_kernel, shim):
    from lucifer_shard.runtime_shim.errors import ShimError
    from lucifer_shard.runtime_shim.serving.serve import serve_argv

    argv = serve_argv(out_kernel, 3, ["--max-model-len", "4096"])
    assert argv == ["vllm", "serve", str(out_kernel), "--tensor-parallel-size", "3", "--load-format", "lucifer_tp3",
                    "--attention-backend", "FLASHINFER_MLA_SPARSE_DSV4", "--moe-backend", "flashinfer_cutlass",
                    "--max-model-len", "4096"]
    with pytest.raises(ShimError) as e:
        serve_argv(out_kernel, 3, ["-tp", "4"])
    assert "lucifer-shard serve sets it from the manifest" in str(e.value) and "\n" not in str(e.value)


def test_cli_commands(out_kernel, out_model, shim):
    from click.testing import CliRunner

    from lucifer_shard.cli import cli

    r = CliRunner().invoke(cli, ["doctor", str(out_model)])
    assert r.exit_code == 0, r.output
    assert "[  ok] virtual TP: supplied by the plugin" in r.output and "vetted vLLM builds for lucifer_tp3" in r.output
    r = CliRunner().invoke(cli, ["serve", str(out_model), "--dry-run", "--", "--max-model-len", "4096"])
    assert r.exit_code == 0, r.output  # the stock release: the preflight passes for a TP3 model-layout output
    assert r.stdout.strip().splitlines()[-1].endswith(
        "--load-format lucifer_tp3 --attention-backend FLASHINFER_MLA_SPARSE_DSV4 --moe-backend flashinfer_cutlass "
        "--max-model-len 4096")
    r = CliRunner().invoke(cli, ["serve", str(out_kernel), "--dry-run"])  # kernel layout: the stock release loads it
    assert r.exit_code == 0 and "[FAIL]" not in r.output, r.output
    assert r.stdout.strip().splitlines()[-1].endswith("--moe-backend flashinfer_cutlass")
    r = CliRunner().invoke(cli, ["doctor", str(out_model)])
    import shim_fixtures as sf

    # the fork's own symbols, absent from a stock release, are facts about other builds: shown with -v only
    fork_symbol = "source vllm.config.virtual_tp.maybe_apply_b12x_virtual_tp_padding"
    assert f"importing vLLM {sf.vllm_version()} to check it" in r.stderr and fork_symbol not in r.stdout
    assert fork_symbol in CliRunner().invoke(cli, ["doctor", "-v", str(out_model)]).stdout


def test_serve_checks_what_needs_vllm_inside_vllm(out_kernel, out_model, shim, monkeypatch):
    """serve's preflight before exec imports no vLLM and passes a kernel-layout output; the checks that need
    vLLM run in vLLM's first process, from register(), and stop it there in one line per failed check
    (issue 34: serve adds at most 2 s before vLLM starts)."""
    import os

    from click.testing import CliRunner

    from lucifer_shard import runtime_shim
    from lucifer_shard.cli import cli
    from lucifer_shard.runtime_shim.adapt import compat
    from lucifer_shard.runtime_shim.adapt.settings import SERVE_ENV
    from lucifer_shard.runtime_shim.serving import doctor, serve

    execs = []
    monkeypatch.setattr(serve, "exec_vllm", lambda argv, env: execs.append((argv, env)))
    r = CliRunner().invoke(cli, ["serve", str(out_kernel)])  # this CPU box: refused before exec (issue 53)
    assert r.exit_code == 1 and not execs and "[FAIL] GPU: no NVIDIA GPU visible" in r.stderr, r.output
    monkeypatch.setattr(doctor, "host_gpu", lambda: ("NVIDIA H200", "9.0"))  # as on the serving host
    r = CliRunner().invoke(cli, ["serve", str(out_kernel)])
    assert r.exit_code == 0 and "preflight passed" in r.stderr, r.output
    (argv, env), = execs
    assert os.path.basename(argv[0]) == "vllm" and argv[1:3] == ["serve", str(out_kernel)] and SERVE_ENV in env
    assert [str(c) for c in doctor.in_vllm_failures(out_model, False)] == []
    assert [str(c) for c in doctor.in_vllm_failures(out_kernel, False)] == []  # the release's re-layout is vetted
    from lucifer_shard.runtime_shim.adapt import compat

    monkeypatch.setitem(compat.VERDICTS, runtimes.RELAYOUT,  # as on a vLLM whose re-layout is not vetted
                        compat.WrapperVerdict(runtimes.RELAYOUT, False, None, (), "a stand-in reason"))
    failed = doctor.in_vllm_failures(out_kernel, False)
    assert [c.name for c in failed] == ["output kernel-layout experts"]
    monkeypatch.setenv(SERVE_ENV, env[SERVE_ENV])  # as vLLM's process inherits it
    with pytest.raises(SystemExit) as e:
        runtime_shim._serve_preflight()
    assert str(e.value).splitlines()[0].startswith("lucifer-shard serve: preflight failed in vLLM: [FAIL] output "
                                                   "kernel-layout experts: this vLLM cannot load experts in kernel layout verbatim")
    assert SERVE_ENV not in os.environ  # vLLM's child processes do not check again
    monkeypatch.setenv(SERVE_ENV, serve.serve_environment(out_model, True)[SERVE_ENV])
    runtime_shim._serve_preflight()  # passes: vLLM goes on


@pytest.fixture
def cpu_platform(monkeypatch):
    """vLLM's CPU platform, as `vllm bench` sets it: the engine-argument parser needs a device type."""
    from vllm import platforms
    from vllm.platforms.cpu import CpuPlatform

    monkeypatch.setattr(platforms, "current_platform", CpuPlatform())


def test_vllm_serve_parses_the_exact_command(out_kernel, shim, cpu_platform):
    """The stock release's own `vllm serve` parser takes the command serve builds, --mtp's draft config included."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from lucifer_shard.runtime_shim.serving.serve import serve_argv

    argv = serve_argv(out_kernel, 3, ["--max-model-len", "4096"], mtp_tokens=2)
    parser = FlexibleArgumentParser()
    command = ServeSubcommand()
    command.subparser_init(parser.add_subparsers(dest="subparser"))
    args = parser.parse_args(argv[1:])
    command.validate(args)
    engine = AsyncEngineArgs.from_cli_args(args)
    assert (args.model_tag, engine.tensor_parallel_size, engine.load_format, engine.max_model_len) == (
        str(out_kernel), 3, "lucifer_tp3", 4096)
    assert (str(engine.attention_backend), engine.moe_backend) == ("FLASHINFER_MLA_SPARSE_DSV4", "flashinfer_cutlass")
    assert engine.speculative_config == {"method": "mtp", "num_speculative_tokens": 2}


def test_the_mtp_draft_comes_from_out_with_the_targets_loader(out_kernel, shim, cpu_platform):
    """vLLM's SpeculativeConfig for `{"method": "mtp"}` without a draft model: the draft is OUT itself, as the
    DeepSeek-V4 MTP architecture, with no load config of its own (the target's: lucifer_tp3, whose loader
    then picks OUT/draft). Upstream has no virtual TP, so this resolves at TP1; the fork pads the draft too."""
    from vllm.config import ParallelConfig, SpeculativeConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    from lucifer_shard.model.drafts import speculative_config

    target = AsyncEngineArgs(model=str(out_kernel), load_format="lucifer_tp3", max_model_len=4096).create_model_config()
    spec = SpeculativeConfig(target_model_config=target, target_parallel_config=ParallelConfig(tensor_parallel_size=1),
                             **json.loads(speculative_config("mtp", 1)))
    draft = spec.draft_model_config
    assert (spec.method, draft.model, draft.architectures, draft.hf_config.n_predict) == (
        "mtp", str(out_kernel), ["DeepSeekV4MTPModel"], 1)
    assert spec.draft_load_config is None


# ------------------------------------------------------------- what serve refuses before vLLM starts

REFUSED_FORMS = [
    ["-pp", "2"], ["--pipeline-parallel-size=2"], ["--pipeline_parallel_size", "2"], ["-dp", "2"],
    ["--data-parallel-size=3"], ["-pcp", "2"], ["--enable-expert-parallel"], ["-ep"],
    ["--disable-expert-parallel", "--enable-expert-parallel"], ["--enable-eplb"], ["--enable-lora"],
    ["--model-loader-extra-config", '{"pattern": 1}'], ["--model-loader-extra-config", '{"verify": "sometimes"}'],
    ["--model-loader-extra-config.verify", "sometimes"], ["--model_loader_extra_config.role=both"],
    ["--model-loader-extra-config", '{"verify": "full"}', "--model-loader-extra-config.x", "1"],
]
ACCEPTED_FORMS = [
    [], ["-pp", "1"], ["--data-parallel-size=1"], ["--no-enable-expert-parallel"],
    ["--enable-expert-parallel", "--disable-expert-parallel"], ["--enable-lora", "--no-enable-lora"],
    ["--model-loader-extra-config", '{"verify": "full", "role": "auto"}'], ["--model-loader-extra-config.verify", "none"],
]


def _vllm_reads(argv):
    """What the stock release's own `vllm serve` parser makes of argv, as the load-time checks see it: the
    settings' problems (runtime_shim.settings.config_problems) and the loader's verdict on its extra config."""
    from types import SimpleNamespace

    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from lucifer_shard.runtime_shim.adapt import settings

    parser = FlexibleArgumentParser()
    ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
    e = AsyncEngineArgs.from_cli_args(parser.parse_args(argv[1:]))
    pc = SimpleNamespace(**{k: getattr(e, k) for k in ("pipeline_parallel_size", "data_parallel_size",
                                                       "prefill_context_parallel_size", "enable_expert_parallel",
                                                       "enable_eplb")})
    problems = settings.config_problems(SimpleNamespace(parallel_config=pc,
                                                        lora_config=object() if e.enable_lora else None))
    extra = settings.extra_config_problem(e.model_loader_extra_config)
    return problems + ([extra] if extra else [])


@pytest.mark.parametrize("args", REFUSED_FORMS + ACCEPTED_FORMS)
def test_serve_refuses_exactly_what_vllm_parses_into_a_refused_config(out_model, shim, cpu_platform, args):
    """serve reads vLLM's arguments without vLLM (the conversion box); here vLLM's own parser reads the same
    words, and the load-time checks find in its result exactly the problems serve found in the words."""
    from lucifer_shard.runtime_shim.adapt import settings
    from lucifer_shard.runtime_shim.serving.serve import serve_argv

    argv = serve_argv(out_model, 3, ["--max-model-len", "4096"])
    assert settings.argument_problems(args) == _vllm_reads(argv + args)
    assert bool(settings.argument_problems(args)) == (args in REFUSED_FORMS)


def _any_arch(out_model, tmp_path):
    """out_model's source converted without --arch: manifest "arch": null (a re-sealed edit of out_model's
    arch is refused since issue 52: the options say sm120)."""
    import shim_fixtures as sf

    out = out_model.parent / "out_any_arch"
    if not (out / "COMPLETE").exists():
        sf.cli("convert", "--tp", "3", "--expert-layout", "model", str(out_model.parent / "model"), str(out),
               "--quiet")
    return out


@pytest.mark.parametrize("arch,cap", [("sm90", "9.0"), ("sm100", "10.0"), ("sm120", "12.0"), (None, "none")])
def test_an_output_for_any_arch_serves_with_this_gpus_backends(out_model, tmp_path, shim, monkeypatch, arch, cap):
    from click.testing import CliRunner

    from lucifer_shard.cli import cli
    from lucifer_shard.runtime_shim.adapt import lucifer_tuple
    from lucifer_shard.runtime_shim.manifest import load_manifest
    from lucifer_shard.runtime_shim.serving.doctor import FAIL, INFO, doctor_report
    from lucifer_shard.runtime_shim.serving.serve import backends_remark

    from lucifer_shard.runtime_shim.adapt import lucifer_tuple
    from lucifer_shard.runtime_shim.serving import doctor

    out = _any_arch(out_model, tmp_path)
    assert load_manifest(out).arch is None
    monkeypatch.setattr(lucifer_tuple, "device_arch", lambda: (arch, cap))
    monkeypatch.setattr(doctor, "local_arch", lambda: arch)  # serve reads the GPU with nvidia-smi
    c = _by_name(doctor_report(out))
    assert "arch any (converted without --arch)" in c["output"].detail
    assert not [x for x in c.values() if x.status == FAIL], [str(x) for x in c.values() if x.status == FAIL]
    r = CliRunner().invoke(cli, ["serve", str(out), "--dry-run"])
    assert r.exit_code == 0, r.output
    line = r.stdout.strip().splitlines()[-1]
    if arch is None:
        assert "output arch" not in c and "--attention-backend" not in line
        assert r.stdout.strip().splitlines()[-2] == backends_remark()
    else:
        attn, moe = runtimes.STOCK_BACKENDS[arch]
        assert c["output arch"].status == INFO and f"--attention-backend {attn} --moe-backend {moe}" in c["output arch"].detail
        assert line.endswith(f"--load-format lucifer_tp3 --attention-backend {attn} --moe-backend {moe}")
    # the fork's tuple check: no "files were laid out for" an arch the manifest does not name
    assert not [p for p in lucifer_tuple.tuple_problems(_engine_like(out), load_manifest(out)) if "GPU capability" in p]


def _engine_like(out):
    from types import SimpleNamespace

    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    import shim_fixtures as sf

    pc = SimpleNamespace(tensor_parallel_size=3, pipeline_parallel_size=1, data_parallel_size=1,
                         prefill_context_parallel_size=1, enable_expert_parallel=False, enable_eplb=False)
    return SimpleNamespace(model_config=sf.model_config(out, plan=None), parallel_config=pc, lora_config=None,
                           attention_config=SimpleNamespace(backend=AttentionBackendEnum["FLASHINFER_MLA_SPARSE_DSV4"]),
                           kernel_config=SimpleNamespace(moe_backend="flashinfer_cutlass"))


def test_a_gpu_of_no_supported_family_is_told_unsupported(shim, monkeypatch):
    from lucifer_shard.runtime_shim.adapt import lucifer_tuple
    from lucifer_shard.runtime_shim.serving.doctor import FAIL, doctor_report

    monkeypatch.setattr(lucifer_tuple, "device_arch", lambda: (None, "8.0"))
    gpu = _by_name(doctor_report())["GPU"]
    assert gpu.status == FAIL and "capability 8.0: unsupported" in gpu.detail and "H100" in gpu.detail
    assert "serving host" not in str(gpu)


def test_doctor_inside_this_vetted_release_names_it_first_with_its_flashinfer(shim):
    """Issue 53: inside a working vetted release doctor's first route is this environment's build (serve here),
    marked in the table, with no other "route to take"; 0.34.0's venv holds FlashInfer 0.7.4, the release that
    stands in for its 0.7.3 pin where the index lacks it (tools/vllm-env.sh), and that is no warning."""
    from click.testing import CliRunner

    import shim_fixtures as sf
    from lucifer_shard.cli import cli
    from lucifer_shard.runtime_shim.serving.doctor import OK, dist_version, doctor_report

    v = sf.vllm_version()
    text = CliRunner().invoke(cli, ["doctor"]).stdout
    routes = [line for line in text.splitlines() if re.match(r"  \d\. ", line)]
    assert routes[0].startswith(f"  1. this environment's vLLM {v} (PyPI, CUDA 13 wheel), a vetted build: serve with "
                                f"it here"), routes
    assert "route to take" not in text and f"* {v} " in text
    fi = _by_name(doctor_report())["flashinfer"]
    assert fi.status == OK and fi.detail.startswith(f"flashinfer-python {dist_version('flashinfer-python')} (build "
                                                    f"pins "), fi
