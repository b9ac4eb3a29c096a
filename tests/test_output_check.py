"""Issue 52: one standard for every reader of an output. Each re-sealed manifest edit of the issue's
classes O, W, N and P (the self-digest is public: tests/test_hostile_inputs.py::reseal) goes through every
command that reads an output, and they all refuse it alike: kind mismatch, exit 1, one error line.
On main at fedabc3 stage, serve, doctor, inspect, diff and check-numerics accepted or crashed on many."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from lucifer_shard.engine.convert import convert
from lucifer_shard.engine.synth import synth
from lucifer_shard.errors import ERROR_KINDS
from lucifer_shard.model.options import Options
from lucifer_shard.outnames import MANIFEST_NAME
from lucifer_shard.output.manifest import COMPLETE_NAME, manifest_text

from helpers import run, scratch

TARGET0 = ("roles", "target", "ranks", 0, "tensors")
EXPERTS = "model.layers.0.ffn.experts.routed_experts.w13_weight"
NORM = "model.norm.weight"
SHARDED = "model.layers.0.attn.wo_b.weight"


def _set(*path_value):
    """An edit that sets doc[path...] to value."""
    *path, value = path_value

    def edit(doc: dict) -> None:
        at = doc
        for k in path[:-1]:
            at = at[k]
        at[path[-1]] = value(at[path[-1]]) if callable(value) else value
    return edit


def _drop(*path):
    def edit(doc: dict) -> None:
        at = doc
        for k in path[:-1]:
            at = at[k]
        del at[path[-1]]
    return edit


def _drop_last_target_rank(doc: dict) -> None:
    doc["roles"]["target"]["ranks"].pop()


def _new_conversion_id(doc: dict) -> None:
    doc["conversion_id"] = "1" * 64  # COMPLETE is rewritten to match (`edited`)


def _add_tokenizer_copy(doc: dict) -> None:
    doc["copies"]["tokenizer.json"] = {"bytes": 10, "digest": "blake3:" + "2" * 64}
    doc["source"]["side_files"].append("tokenizer.json")


def _first_piece(field: str, delta: int):
    return _set(*TARGET0, SHARDED, "sources", 0, field, lambda v: v + delta)


# (name, output: "tiny" / "b12x" / "dspark", edit)
EDITS = [
    # O: the manifest's entries, plan and options against the rule table
    ("O rank entry dropped", "tiny", _drop_last_target_rank),
    ("O shape", "tiny", _set(*TARGET0, NORM, "shape", lambda s: [s[0] + 1])),
    ("O dtype", "tiny", _set(*TARGET0, NORM, "dtype", "F32")),
    ("O experts", "tiny", _set(*TARGET0, EXPERTS, "experts", lambda n: n - 1)),
    ("O zero_regions", "tiny", _set(*TARGET0, SHARDED, "zero_regions", [[0, 0, 1]])),
    ("O sources", "tiny", _first_piece("src_start", 1)),
    ("O pad", "tiny", _set(*TARGET0, NORM, "pad", "-inf")),
    ("O plan.tp", "tiny", _set("plan", "tp", 2)),
    ("O options.tp", "tiny", _set("options", "tp", 2)),
    ("O options.arch", "tiny", _set("options", "arch", "sm90")),
    ("O options.expert_layout", "tiny", _set("options", "expert_layout", "model")),
    ("O options.flashinfer_layout", "tiny", _set("options", "flashinfer_layout", "legacy")),
    ("O options.mtp", "tiny", _set("options", "mtp", False)),
    ("O options.max_file_bytes", "tiny", _set("options", "max_file_bytes", 1 << 20)),
    ("O options.align", "tiny", _set("options", "align", 4096)),
    ("O options.moe_backend", "tiny", _set("options", "moe_backend", "b12x")),
    ("O b12x kernel_local", "b12x", _set("plan", "axes", "routed", "kernel_local", lambda n: n + 64)),
    ("O draft role removed", "tiny", _drop("roles", "draft")),
    ("O copies entry removed", "tiny", _drop("copies", "config.json")),
    ("O conversion_id", "tiny", _new_conversion_id),
    # N: what follows from config.json, the draft kind and the per-shard digests
    ("N draft kind mtp on DSpark", "dspark", _set("draft", "kind", "mtp")),
    ("N draft tokens", "dspark", _set("draft", "tokens", 64)),
    ("N draft stages", "dspark", _set("draft", "stages", 2)),
    ("N draft record removed", "dspark", _drop("draft")),
    ("N content digest", "tiny", _set("source", "content", "digest", "blake3:" + "1" * 64)),
    ("N runtime_owned", "tiny", lambda doc: doc.update(runtime_owned=[NORM])),
    # P: sizes and copies (diff checked neither)
    ("P file size + 1", "tiny", _set("roles", "target", "ranks", 2, "files", 0, "bytes", lambda n: n + 1)),
    ("P file size 2**62", "tiny", _set("roles", "target", "ranks", 2, "files", 0, "bytes", 2 ** 62)),
    ("P copy of a missing tokenizer.json", "tiny", _add_tokenizer_copy),
    # V: informational fields, now derived and compared
    ("V runtime.moe_backend", "b12x", _set("runtime", "moe_backend", "marlin")),
    ("V moe_variant", "tiny", _set("moe_variant", "other")),
    ("V layouts name", "tiny", _set("layouts", "w13_weight", "name", "identity")),
    ("V dropped converted tensor", "tiny", _set("dropped", "layers.0.attn.wo_b.weight", "edited")),
]

NODE = ("--nnodes", "3", "--node-rank", "2")
COMMANDS = {  # every command that reads an output (doctor: its output checks, which run without vLLM)
    "verify": lambda out, model, dest: ["verify", out],
    "diff": lambda out, model, dest: ["diff", out, model],
    "inspect": lambda out, model, dest: ["inspect", out],
    "check-numerics": lambda out, model, dest: ["check-numerics", out, model, "--layers", "0"],
    "stage": lambda out, model, dest: ["stage", out, dest, *NODE],
    "serve": lambda out, model, dest: ["serve", out, "--dry-run", *NODE, "--master-addr", "10.0.0.1"],
    "doctor": lambda out, model, dest: ["doctor", out],
}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory, tiny_pattern):
    """{name: (OUT, MODEL)}: tiny in kernel layout, tiny on the b12x route, the DSpark preset."""
    with scratch(tmp_path_factory, "output-check") as root:
        dspark = synth("dspark", root / "dspark-model", fill="pattern", progress=False)
        made = {}
        for name, model, options in (("tiny", tiny_pattern, Options(tp=3)),
                                     ("b12x", tiny_pattern, Options(tp=3, arch=None, expert_layout="model",
                                                                    moe_backend="b12x")),
                                     ("dspark", dspark, Options(tp=3))):
            convert(str(model), root / name, options, progress=False)
            made[name] = (root / name, model)
        yield made


def edited(out: Path, dst: Path, edit) -> Path:
    """OUT hard-linked into `dst` with its manifest edited and re-sealed (new files: OUT is left alone)."""
    shutil.copytree(out, dst, copy_function=os.link)
    doc = json.loads((dst / MANIFEST_NAME).read_text())
    edit(doc)
    (dst / MANIFEST_NAME).unlink()
    (dst / MANIFEST_NAME).write_text(manifest_text({k: v for k, v in doc.items() if k != "manifest_digest"}))
    if doc["conversion_id"] != json.loads((out / MANIFEST_NAME).read_text())["conversion_id"]:
        (dst / COMPLETE_NAME).unlink()
        (dst / COMPLETE_NAME).write_text(doc["conversion_id"])
    return dst


@pytest.mark.parametrize("name, which, edit", EDITS, ids=[e[0] for e in EDITS])
def test_every_reader_refuses_a_resealed_edit_alike(outputs, tmp_path, name, which, edit):
    """Each command (with --json) ends with kind mismatch and exit 1, nothing staged: the same verdict
    verify gives, from the one output check (output/output_check)."""
    out, model = outputs[which]
    bad = edited(out, tmp_path / "out", edit)
    code = ERROR_KINDS["mismatch"][0]
    got, messages = {}, {}
    for command, argv in COMMANDS.items():
        r = run(*argv(bad, model, tmp_path / "dest"), "--json")
        error = json.loads(r.stdout)["error"] if r.stdout.strip().startswith("{") else None
        got[command] = (r.exit_code, error and error["kind"])
        messages[command] = error and error["message"]
        assert "Traceback" not in r.output and "internal error" not in r.output, (command, r.output)
    assert got == {c: (code, "mismatch") for c in COMMANDS}, (got, messages)
    assert not (tmp_path / "dest" / COMPLETE_NAME).exists()
