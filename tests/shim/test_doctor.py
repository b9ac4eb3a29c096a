"""doctor and serve against the real vllm==0.33.0 (upstream: no virtual TP)."""
from __future__ import annotations

import pytest


def _by_name(checks):
    return {c.name: c for c in checks}


def test_doctor_on_upstream_0_33_reports_virtual_tp_missing(shim):
    from lucifer_shard.runtime_shim.doctor import FAIL, OK, WARN, doctor_report, format_report

    checks = doctor_report()
    c = _by_name(checks)
    assert c["vllm"].detail.startswith("0.33.0 (commit 4ba787ec9)")
    assert "not one of the vetted builds" in c["vllm"].detail
    vt = c["virtual TP"]
    assert vt.status == FAIL
    assert "no vllm.config.virtual_tp" in vt.detail and "TP3 outputs cannot be served" in vt.detail
    assert "n_heads % tp_size == 0" in vt.detail and "45c1582e9" in vt.fix
    rel = c["expert re-layout wrapper"]
    assert rel.status == WARN and "signature" in rel.detail and "--expert-layout model" in rel.detail
    assert c["plugin entry point"].status == OK and "lucifer_shard.runtime_shim:register" in c["plugin entry point"].detail
    assert c["load format lucifer_tp3"].status == OK
    for mod_attr in ("vllm.model_executor.model_loader.register_model_loader", "vllm.config.LoadConfig"):
        assert c[f"symbol {mod_attr}"].status == OK
    assert c["GPU"].status == WARN  # CPU box
    text = format_report(checks)
    assert "lucifer_tp3 serving will not work here" in text


def test_doctor_with_output_dir(out_kernel, shim):
    from lucifer_shard.runtime_shim.doctor import FAIL, doctor_report

    c = _by_name(doctor_report(out_kernel))
    assert "tp 3, arch sm120, experts kernel layout (FLASHINFER_CUTLASS_MXFP4_MXFP8)" in c["output"].detail
    assert c["output needs virtual TP"].status == FAIL
    assert c["output kernel-layout experts"].status == FAIL


def test_doctor_flags_b12x_env_and_plugin_allow_list(monkeypatch, shim):
    from lucifer_shard.runtime_shim.doctor import FAIL, doctor_report

    monkeypatch.setenv("VLLM_USE_B12X_MOE", "1")
    monkeypatch.setenv("VLLM_PLUGINS", "something_else")
    c = _by_name(doctor_report())
    assert c["env VLLM_USE_B12X_MOE"].status == FAIL
    assert c["env VLLM_PLUGINS"].status == FAIL and "excludes lucifer_tp3" in c["env VLLM_PLUGINS"].detail


def test_serve_argv_dry_run_and_refusals(out_kernel, tmp_path, shim):
    from lucifer_shard.runtime_shim.doctor import serve, serve_argv
    from lucifer_shard.runtime_shim.errors import ShimError

    argv, checks = serve_argv(out_kernel, ["--max-model-len", "4096"], dry_run=True)
    assert argv == ["vllm", "serve", str(out_kernel), "--tensor-parallel-size", "3", "--load-format", "lucifer_tp3",
                    "--attention-backend", "FLASHINFER_MLA_SPARSE_DSV4", "--moe-backend", "flashinfer_cutlass",
                    "--max-model-len", "4096"]
    assert serve(out_kernel, [], dry_run=True).startswith("vllm serve ")
    with pytest.raises(ShimError) as e:  # upstream 0.33: preflight fails, nothing is executed
        serve_argv(out_kernel, [], dry_run=False)
    assert str(e.value).startswith("lucifer_tp3: preflight failed") and "\n" not in str(e.value)
    with pytest.raises(ShimError) as e:
        serve_argv(out_kernel, ["-tp", "4"], dry_run=True)
    assert "set by lucifer-shard serve from the manifest" in str(e.value)
    with pytest.raises(ShimError) as e:
        serve_argv(tmp_path, [], dry_run=True)
    assert "lucifer-manifest.json not found" in str(e.value)


def test_cli_commands(out_kernel, shim):
    from click.testing import CliRunner

    from lucifer_shard.serve_cli import doctor, serve

    r = CliRunner().invoke(doctor, [str(out_kernel)])
    assert r.exit_code == 1 and "virtual TP: missing" in r.output
    r = CliRunner().invoke(serve, ["--dry-run", str(out_kernel), "--", "--max-model-len", "4096"])
    assert r.exit_code == 0, r.output
    assert r.stdout.strip().splitlines()[-1].endswith(
        "--load-format lucifer_tp3 --attention-backend FLASHINFER_MLA_SPARSE_DSV4 --moe-backend flashinfer_cutlass "
        "--max-model-len 4096")
    r = CliRunner().invoke(serve, [str(out_kernel)])
    assert r.exit_code == 2 and "error: lucifer_tp3: preflight failed" in r.output
