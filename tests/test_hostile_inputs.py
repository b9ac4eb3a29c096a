"""Hostile files and inputs (issue 26, classes 3, 4, 5, 6, 7 and parts of 11): what a reader does
with a manifest that points outside OUT, rank files that are links, a convert that ran during a
read, two checkpoints with the same headers, edited config/tokenizer copies, and every field of
config.json and the manifest mutated to another type. Every command is driven through the real CLI
(click's CliRunner): a refusal is exit 2 (1 for a finding) with one `error:` line, never exit 70."""
from __future__ import annotations

import json
import os
import resource
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lucifer_shard.formats.stheader import read_header
from lucifer_shard.model.options import Options
from lucifer_shard.outnames import MANIFEST_NAME
from lucifer_shard.output.manifest import COMPLETE_NAME, manifest_text

from helpers import one_error, run, run_process, scratch

PART0 = "target/rank-0/part-00000.safetensors"


def copy_out(out: Path, dst: Path) -> Path:
    shutil.copytree(out, dst, symlinks=True)
    return dst


def manifest(out: Path) -> dict:
    return json.loads((out / MANIFEST_NAME).read_text())


def reseal(out: Path, doc) -> None:
    """Write `doc` as OUT's manifest with a valid self-digest (the digest is public: anyone can)."""
    text = manifest_text(doc) if isinstance(doc, dict) else json.dumps(doc)
    (out / MANIFEST_NAME).unlink()
    (out / MANIFEST_NAME).write_text(text)


def readers(out: Path, model: Path) -> list[tuple[str, ...]]:
    return [("verify", out), ("diff", out, model), ("inspect", out), ("check-numerics", out, model, "--layers", "0")]


# ---------------------------------------------------------------- class 3: paths outside OUT, links


@pytest.mark.parametrize("where", ["parent", "absolute", "other-rank", "dotted", "tensor-file"])
def test_manifest_paths_outside_the_contract_are_refused_by_every_reader(converted, tiny_pattern, tmp_path, where):
    """A re-sealed manifest whose file paths leave OUT (or leave the rank's own part_path) is refused
    by verify, diff, inspect, check-numerics and the loader's manifest reader; OUT holds no rank
    file of its own here, so on main verify and diff passed by reading the copy elsewhere."""
    from lucifer_shard.runtime_shim.errors import ShimError
    from lucifer_shard.runtime_shim.manifest import load_manifest as shim_load

    out = copy_out(converted(), tmp_path / "out")
    elsewhere = copy_out(converted(), tmp_path / "elsewhere")
    doc = manifest(out)
    f0 = doc["roles"]["target"]["ranks"][0]["files"][0]
    path = {"parent": f"../elsewhere/{PART0}", "absolute": str(elsewhere / PART0),
            "other-rank": "target/rank-1/part-00000.safetensors", "dotted": f"target/rank-0/../rank-0/{PART0[14:]}",
            "tensor-file": PART0}[where]
    if where == "tensor-file":
        t = doc["roles"]["target"]["ranks"][0]["tensors"]["model.norm.weight"]
        t["file"] = f"../elsewhere/{PART0}"
    else:
        for role in doc["roles"].values():
            for r, rank in enumerate(role["ranks"]):
                for f in rank["files"]:
                    rel = f["path"]
                    f["path"] = path.replace(PART0, rel) if where in ("parent", "absolute") else f["path"]
                    for t in rank["tensors"].values():
                        if t["file"] == rel and where in ("parent", "absolute"):
                            t["file"] = f["path"]
        if where in ("other-rank", "dotted"):
            for t in doc["roles"]["target"]["ranks"][0]["tensors"].values():
                if t["file"] == f0["path"]:
                    t["file"] = path
            f0["path"] = path
    if where in ("parent", "absolute"):
        shutil.rmtree(out / "target")
        shutil.rmtree(out / "draft")
    reseal(out, doc)
    for args in readers(out, tiny_pattern):
        one_error(run(*args, "--quiet"), 2, "lucifer-manifest.json", "run the same convert command with --force")
    with pytest.raises(ShimError) as e:
        shim_load(out)
    assert "\n" not in str(e.value) and "manifest was edited" in str(e.value)


@pytest.mark.parametrize("link", ["file", "rank-folder", "role-folder"])
def test_rank_files_reached_through_links_are_refused(converted, tiny_pattern, tmp_path, link):
    """A rank file (or a rank or role folder) that is a symlink to the very same bytes elsewhere is
    not followed: verify and diff report it (exit 1), check-numerics too, before any layer (exit 1: the
    output is there but damaged)."""
    out = copy_out(converted(), tmp_path / "out")
    elsewhere = copy_out(converted(), tmp_path / "elsewhere")
    target = {"file": PART0, "rank-folder": "target/rank-0", "role-folder": "target"}[link]
    p = out / target
    shutil.rmtree(p) if p.is_dir() else p.unlink()
    p.symlink_to(elsewhere / target)
    for args in (("verify", out), ("diff", out, tiny_pattern)):
        line = one_error(run(*args, "--quiet"), 1)
        assert "symlink" in line, line
    one_error(run("check-numerics", "--quiet", out, tiny_pattern, "--layers", "0"), 1, "symlink")


# ---------------------------------------------------------------- class 5: content in the identity


@pytest.fixture(scope="module")
def twins(converted, tiny_pattern, tiny_random):
    """Two conversions of checkpoints with identical headers and sizes but other weights."""
    return converted(), converted(tiny_random)


def test_same_headers_other_weights_get_other_stamps(twins):
    a, b = twins
    ma, mb = manifest(a), manifest(b)
    assert ma["conversion_id"] == mb["conversion_id"]  # the identity known before any byte is read
    for out, m in ((a, ma), (b, mb)):
        for role, rdoc in m["roles"].items():
            for entry in rdoc["ranks"]:
                for f in entry["files"]:
                    assert read_header(out / f["path"]).metadata["lucifer.content"] == f["content"]
    fa = ma["roles"]["target"]["ranks"][0]["files"][0]["content"]
    fb = mb["roles"]["target"]["ranks"][0]["files"][0]["content"]
    assert fa != fb and len(fa) == len(fb) == len("blake3:") + 64


def test_a_rank_file_of_other_weights_is_named_by_its_stamp(twins, tmp_path):
    a, b = twins
    out = copy_out(a, tmp_path / "out")
    (out / PART0).unlink()
    shutil.copyfile(b / PART0, out / PART0)
    from lucifer_shard.proof.verify import verify

    report = verify(out, progress=False)
    assert any("lucifer.content" in p.message and "other source weights" in p.message for p in report.problems)


def test_resume_stamps_and_records_the_same_content(tiny_pattern, tmp_path):
    """A conversion finished by --resume (one part redone, the others kept from the journal) has the
    same stamps and manifest as a conversion in one go, and verify passes."""
    args = ("convert", "--quiet", "--tp", "3", "--arch", "sm120", "--max-file-size", "8MiB", tiny_pattern)
    whole = tmp_path / "whole"
    assert run(*args, whole).exit_code == 0
    out = tmp_path / "out"
    assert run(*args, out).exit_code == 0
    for name in (COMPLETE_NAME, MANIFEST_NAME, "target/rank-1/part-00001.safetensors"):
        (out / name).unlink()
    r = run(*args, out, "--resume")
    assert r.exit_code == 0, r.output
    assert run("verify", "--quiet", out).exit_code == 0
    strip = lambda d: {k: v for k, v in d.items() if k not in ("source", "manifest_digest")}  # noqa: E731
    assert strip(manifest(out)) == strip(manifest(whole))


# ---------------------------------------------------------------- class 6: config and tokenizer copies


@pytest.mark.parametrize("name,edit", [("config.json", lambda d: {**d, "rope_theta": 12345}),
                                       ("tokenizer_config.json", lambda d: {**d, "chat_template": "{{ evil }}"})])
def test_edited_copies_fail_verify_and_the_serve_preflight(converted, tmp_path, name, edit):
    out = copy_out(converted(), tmp_path / "out")
    doc = json.loads((out / name).read_text())
    (out / name).unlink()
    (out / name).write_text(json.dumps(edit(doc)))
    one_error(run("verify", "--quiet", out), 1, name, "not the copy convert made")
    r = run("serve", out, "--dry-run")
    assert r.exit_code == 1 and f"[FAIL] output: lucifer_tp3: {out}: {name}:" in r.stdout, r.output  # the output check


# ---------------------------------------------------------------- class 7: field types of config.json


def _model_with(tiny_pattern: Path, tmp: Path, text: str | bytes) -> Path:
    model = tmp / "model"
    if not model.exists():
        model.mkdir()
    (model / "config.json").unlink(missing_ok=True)
    (model / "config.json").write_bytes(text if isinstance(text, bytes) else text.encode())
    return model


def _config(tiny_pattern: Path) -> dict:
    return json.loads((tiny_pattern / "config.json").read_text())


@pytest.mark.parametrize("case", ["o_groups 0", "string", "null", "Infinity", "NaN", "5000 digits", "not UTF-8",
                                  "nested", "float", "negative vocab", "bool", "list", "huge", "top level list"])
def test_config_values_of_the_wrong_type_are_input_errors(tiny_pattern, tmp_path, case):
    cfg = _config(tiny_pattern)
    text = {
        "o_groups 0": json.dumps({**cfg, "o_groups": 0}),
        "string": json.dumps({**cfg, "hidden_size": "256"}),
        "null": json.dumps({**cfg, "num_attention_heads": None}),
        "Infinity": json.dumps({**cfg, "swiglu_limit": 1.0}).replace("1.0", "Infinity"),
        "NaN": json.dumps({**cfg, "swiglu_limit": 1.0}).replace("1.0", "NaN"),
        "5000 digits": json.dumps({**cfg, "vocab_size": 7}).replace(": 7", ": " + "9" * 5000),
        "not UTF-8": json.dumps(cfg).encode().replace(b'"deepseek_v4"', b'"deepseek_v4\xff"'),
        "nested": json.dumps(cfg)[:-1] + ', "deep": ' + "[" * 100_000 + "]" * 100_000 + "}",
        "float": json.dumps({**cfg, "hidden_size": 256.7}),
        "negative vocab": json.dumps({**cfg, "vocab_size": -1000}),
        "bool": json.dumps({**cfg, "num_hidden_layers": True}),
        "list": json.dumps({**cfg, "compress_ratios": "0,0,4"}),
        "huge": json.dumps({**cfg, "n_routed_experts": 1 << 40}),
        "top level list": json.dumps([cfg]),
    }[case]
    model = _model_with(tiny_pattern, tmp_path, text)
    one_error(run("plan", "--quiet", "--tp", "3", model), 2, "config.json")


_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 70), 1 << 70),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=4),
                    st.lists(st.integers(-3, 3), max_size=3), st.just({}), st.just({"a": [1, None]}))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(["vocab_size", "hidden_size", "num_hidden_layers", "num_nextn_predict_layers",
                              "num_attention_heads", "head_dim", "q_lora_rank", "o_lora_rank", "o_groups",
                              "compress_ratios", "index_n_heads", "index_head_dim", "hc_mult",
                              "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok",
                              "n_shared_experts", "num_hash_layers", "swiglu_limit", "quantization_config",
                              "architectures", "model_type", "expert_dtype"]),
       value=_VALUES)
def test_config_field_mutations_never_reach_an_internal_error(tiny_pattern, tmp_path, field, value):
    """Any field the tool reads, set to a value of any type: plan either plans (a value that happens
    to be valid) or refuses with one line and exit 2 (1: a plan that does not fit the disk)."""
    model = _model_with(tiny_pattern, tmp_path, json.dumps({**_config(tiny_pattern), field: value}))
    r = run("plan", "--quiet", "--tp", "3", model)
    if r.exit_code != 0:
        one_error(r, 2)


# ---------------------------------------------------------------- class 7: the manifest


def _nodes(doc, path=()):
    yield path
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _nodes(v, (*path, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _nodes(v, (*path, i))


def _set(doc, path, value):
    if not path:
        return value
    node = doc
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return doc


@pytest.fixture(scope="module")
def mutable_out(converted, tmp_path_factory):
    with scratch(tmp_path_factory, "mutated") as root:
        out = copy_out(converted(), root / "out")
        text = (out / MANIFEST_NAME).read_text()
        nodes = list(_nodes(json.loads(text)))
        shallow = [p for p in nodes if len(p) <= 3 or (len(p) <= 7 and p[-1] in (0, "rank", "path", "bytes", "files",
                                                                              "content", "tensors", "ranks"))]
        yield out, text, nodes, shallow


def test_kernel_layout_options_without_an_arch_are_a_finding(mutable_out):
    """The mutation CI's random draw found (options.arch null, the manifest re-sealed): the layout table
    refuses kernel layout without an arch, and verify and inspect report that as a finding, not an
    internal error."""
    out, text, _, _ = mutable_out
    reseal(out, _set(json.loads(text), ("options", "arch"), None))
    try:
        for command in ("verify", "inspect"):
            r = run(command, "--quiet", out)
            one_error(r, 1)
        r = run("verify", out)
        assert "the recorded options are not a combination convert writes: unknown arch None" in r.output, r.output
    finally:
        (out / MANIFEST_NAME).write_text(text)


@settings(max_examples=70, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), value=_VALUES)
def test_manifest_field_mutations_are_findings_or_refusals(mutable_out, data, value):
    """Any node of the manifest (the whole document, a role, a rank entry, a file entry, a tensor
    field) replaced by a value of another type and the manifest re-sealed: verify and inspect end
    with a finding (exit 1) or a one-line refusal (exit 2), never an internal error; the loader's
    manifest reader raises its one-line ShimError or reads the rank entries it would load."""
    from lucifer_shard.runtime_shim.errors import ShimError
    from lucifer_shard.runtime_shim.load.loadplan import expert_groups
    from lucifer_shard.runtime_shim.manifest import open_output, rank_entry, roles

    out, text, nodes, shallow = mutable_out
    path = data.draw(st.one_of(st.sampled_from(shallow), st.sampled_from(nodes)))
    doc = _set(json.loads(text), path, value)
    reseal(out, doc)
    try:
        for command in ("verify", "inspect"):
            r = run(command, "--quiet", out)
            if r.exit_code != 0:
                one_error(r, (1, 2))
        try:
            output = open_output(out)
            for role in roles(output.manifest):
                for rank in range(output.manifest.tp_size):
                    expert_groups(output, rank_entry(output, role, rank))
        except ShimError as e:
            assert "\n" not in str(e)
    finally:
        (out / MANIFEST_NAME).write_text(text)


def test_an_edited_model_shape_is_a_finding_and_pads_are_read_by_the_rule_table(mutable_out):
    """The example the mutation test above found (2026-12-04): a kernel-layout expert's model_shape edited to
    hold a 0 and the manifest re-sealed. verify reports the edited entry against the rule table (exit 1) and
    reads the tensor's pads as the rule table lays them out; it used to size them from the edited entry and
    stop with an internal error (numpy could not broadcast)."""
    out, text, _, _ = mutable_out
    try:
        name = "model.layers.4.mtp_block.ffn.experts.routed_experts.w13_weight"
        reseal(out, _set(json.loads(text), ("roles", "draft", "ranks", 0, "tensors", name, "model_shape", 1), 0))
        r = run("verify", out)
        assert r.exit_code == 1 and "entry field 'model_shape' is [8, 0, 128]" in r.output, r.output
    finally:
        (out / MANIFEST_NAME).write_text(text)


@pytest.mark.parametrize("doc", [[], "manifest", None, 7, {"format": "lucifer-shard/manifest"}])
def test_a_manifest_of_the_wrong_type_is_an_input_error(converted, tiny_pattern, tmp_path, doc):
    out = copy_out(converted(), tmp_path / "out")
    (out / MANIFEST_NAME).unlink()
    (out / MANIFEST_NAME).write_text(json.dumps(doc))
    for args in readers(out, tiny_pattern):
        one_error(run(*args, "--quiet"), 2, "lucifer-manifest.json")


def _many_files_out(tiny_pattern: Path, tmp_path: Path) -> Path:
    """64 KiB parts: below the command line's 1 MiB floor, so through the engine (which takes any size)."""
    from lucifer_shard.engine.convert import convert
    from lucifer_shard.model.options import Options

    out = tmp_path / "many"
    convert(str(tiny_pattern), out, Options(tp=3, max_file_bytes=64 << 10), progress=False)
    return out


def test_verify_and_diff_keep_few_files_open(tiny_pattern, tmp_path):
    """An output of 351 rank files is checked under `ulimit -n 100` (on main: EMFILE, exit 70)."""
    out = _many_files_out(tiny_pattern, tmp_path)
    n = sum(1 for _ in out.rglob("*.safetensors"))
    assert n > 300, n

    def limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (100, 100))

    for args in (("verify", out), ("diff", out, tiny_pattern)):
        r = run_process(*args, "--quiet", preexec_fn=limit, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]


def test_an_unreadable_shard_is_an_input_error(tiny_pattern, tmp_path, monkeypatch):
    """As root chmod 000 reads anyway: EACCES is simulated on every way of opening the shard."""
    import builtins

    shard = "model-00003-of-00005.safetensors"
    real_open, real_os_open = builtins.open, os.open

    def deny(path):
        if str(path).endswith(shard):
            raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(builtins, "open", lambda p, *a, **k: (deny(p), real_open(p, *a, **k))[1])
    monkeypatch.setattr(os, "open", lambda p, *a, **k: (deny(p), real_os_open(p, *a, **k))[1])
    one_error(run("convert", "--quiet", "--tp", "3", "--arch", "sm120", tiny_pattern, tmp_path / "out"), 2,
              shard, "Permission denied")


def test_the_internal_error_handler_survives_an_out_it_cannot_stat(monkeypatch, tmp_path):
    """A true bug while OUT's name is over 255 bytes: still one line naming a log, exit 70."""
    from lucifer_shard.proof import verify as verify_mod

    def boom(*a, **k):
        raise RuntimeError("a bug")

    monkeypatch.setattr(verify_mod, "verify", boom)
    r = run("verify", tmp_path / ("x" * 300))
    assert r.exit_code == 70 and "Traceback" not in r.output, r.output
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    assert "internal error: RuntimeError: a bug; details in " in line
    log = line.rsplit("details in ", 1)[1]
    assert Path(log).is_file() and "RuntimeError: a bug" in Path(log).read_text()


@pytest.mark.parametrize("args,needle", [
    (("plan", "--tp", "3", "--align", str(1 << 40)), "--align 1099511627776"),
    (("plan", "--tp", "3", "--max-file-size", "inf"), "--max-file-size 'inf'"),
    (("plan", "--tp", "3", "--max-file-size", "0"), "--max-file-size '0'"),
])
def test_absurd_options_are_refused_before_any_work(tiny_pattern, args, needle):
    one_error(run(*args, "--quiet", tiny_pattern), 2, needle)


@pytest.mark.parametrize("args,needle", [
    (("--tokens", "100000000"), "--tokens 100000000"), (("--seed", str(1 << 70)), "--seed"),
    (("--layers", "3-1"), "runs backwards"), (("--layers", ","), "expected layer indices"),
    (("--layers", "0-99999999999"), "does not exist"), (("--layers", "1--2"), "expected layer indices"),
])
def test_check_numerics_refuses_what_checks_nothing_or_everything(converted, tiny_pattern, args, needle):
    one_error(run("check-numerics", "--quiet", converted(), tiny_pattern, *args), 2, needle)


# ---------------------------------------------------------------- class 4: a writer inside a reader's run


def test_a_convert_that_ran_during_verify_is_named_not_reported_as_damage(tiny_pattern, tiny_random, tmp_path,
                                                                         monkeypatch):
    """A whole `convert --force` of other weights (same headers) between verify's first look and its
    reading of the files: verify says OUT was rewritten (exit 2), not N problems."""
    from lucifer_shard.engine.convert import convert
    from lucifer_shard.proof import structure

    out = tmp_path / "out"
    options = Options(tp=3)
    convert(str(tiny_pattern), out, options, progress=False)
    real = structure.open_files

    def rewritten_meanwhile(report, out_, manifest_, *a, **k):
        convert(str(tiny_random), out, options, force=True, progress=False)
        return real(report, out_, manifest_, *a, **k)

    monkeypatch.setattr("lucifer_shard.proof.verify.open_files", rewritten_meanwhile)
    one_error(run("verify", "--quiet", out), 2, "was rewritten while verify ran", "run verify again")


def test_a_convert_that_ran_during_inspect_is_named(tiny_pattern, tmp_path, monkeypatch):
    from lucifer_shard.cli import cmd_check
    from lucifer_shard.engine.convert import convert

    out = tmp_path / "out"
    convert(str(tiny_pattern), out, Options(tp=3), progress=False)
    real = cmd_check.summarize

    def rewritten_meanwhile(out_):
        doc = real(out_)
        convert(str(tiny_pattern), out, Options(tp=3), force=True, progress=False)
        return doc

    monkeypatch.setattr(cmd_check, "summarize", rewritten_meanwhile)
    one_error(run("inspect", "--quiet", out), 2, "was rewritten while inspect ran")


# ---------------------------------------------------------------- class 11: COMPLETE for the loader


@pytest.mark.parametrize("complete", ["empty", "garbage", "other id", "directory", "symlink"])
def test_the_loader_reads_complete_as_the_conversion_id_only(converted, tmp_path, complete):
    from lucifer_shard.runtime_shim.errors import ShimError
    from lucifer_shard.runtime_shim.manifest import load_manifest as shim_load

    out = copy_out(converted(), tmp_path / "out")
    c = out / COMPLETE_NAME
    real = c.read_text()
    c.unlink()
    if complete == "directory":
        c.mkdir()
    elif complete == "symlink":
        (tmp_path / "elsewhere").write_text(real)
        c.symlink_to(tmp_path / "elsewhere")
    else:
        c.write_text({"empty": "", "garbage": "\x00garbage\n", "other id": "ab" * 32 + "\n"}[complete])
    with pytest.raises(ShimError) as e:
        shim_load(out)
    assert "\n" not in str(e.value) and COMPLETE_NAME in str(e.value)
    one_error(run("verify", "--quiet", out), 1, COMPLETE_NAME)
