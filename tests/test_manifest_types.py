"""The typed manifest (spec/manifest_types.py): it reads back what convert wrote byte for byte, looks a
rank up by its `rank` field, counts pad bytes as the regions lie, and is the only place the manifest's
fields are read: the source is checked with `ast` for a second reader."""
from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from lucifer_shard.errors import OutputError
from lucifer_shard.spec.manifest import MANIFEST_FIELDS, MANIFEST_NAME, manifest_text
from lucifer_shard.spec.manifest_types import Manifest
from lucifer_shard.spec.rules import DTYPE_SIZE
from lucifer_shard.spec.schema import ListOf, MapOf, Null, Obj, Spec, Where

from test_architecture import PACKAGES, modules

# The modules that read the manifest's fields: its schema and the records built from it.
OWNERS = ("lucifer_shard.spec.manifest", "lucifer_shard.spec.manifest_types")
# Field names other documents of the tool carry too, so a subscript with them says nothing about the
# manifest: the share record (spec/share.py), the conversion record and journal (engine/outstate.py),
# the inspect summary (cli/cmd_check.summarize, which mirrors the manifest's names), the safetensors
# header (spec/stheader.py), the RUNTIME table, and names too common to be the manifest's alone.
SHARED = {"format", "format_version", "conversion_id", "tp_size", "ranks", "options", "tool_version", "side_files",
          "path", "bytes", "digest", "tensors", "sources", "source", "fingerprint", "content", "files", "plan",
          "axes", "name", "original", "padded", "local", "kernel_local", "moe_backend", "arch", "moe_variant",
          "expert_layout", "flashinfer_layout", "layouts", "layout_version", "runtime", "dropped", "roles", "rank",
          "dtype", "shape", "mtp", "key", "kind", "dim", "length", "version", "tp"}


def _field_names(spec: Spec) -> set[str]:
    """Every object field name a spec describes, at any depth."""
    if isinstance(spec, Obj):
        return {*spec.fields, *spec.optional}.union(*map(_field_names, (*spec.fields.values(),
                                                                         *spec.optional.values())))
    if isinstance(spec, MapOf):
        return _field_names(spec.value)
    if isinstance(spec, ListOf):
        return _field_names(spec.item)
    if isinstance(spec, (Null, Where)):
        return _field_names(spec.spec)
    return set()


def _string_key(node: ast.AST) -> str | None:
    """"k" of `x["k"]` or `x.get("k", ...)`."""
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        return node.slice.value if isinstance(node.slice.value, str) else None
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
            and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
        return node.args[0].value
    return None


def second_readers(packages: dict[str, Path]) -> list[str]:
    """One line per place outside OWNERS that reads the manifest itself: a subscript or `.get` with a
    field name only the manifest carries, a call of `parse_manifest` (the document before its records),
    or a rank entry looked up by position (`.roles[role][i]`; `Manifest.rank` looks it up by its field)."""
    only = _field_names(MANIFEST_FIELDS) - SHARED
    found = []
    for name, path in modules(packages).items():
        if name in OWNERS:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            where = f"{name}:{getattr(node, 'lineno', 0)}"
            key = _string_key(node)
            if key in only:
                found.append(f"{where} reads the manifest's field {key!r}")
            if isinstance(node, ast.Name) and node.id == "parse_manifest":
                found.append(f"{where} parses the manifest document itself (use Manifest.parse)")
            if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Subscript)
                    and isinstance(node.value.value, ast.Attribute) and node.value.value.attr == "roles"):
                found.append(f"{where} looks a rank entry up by position (use Manifest.rank)")
    return found


def test_the_typed_manifest_is_the_only_reader():
    assert second_readers(PACKAGES) == []


def test_a_second_reader_is_found(tmp_path):
    pkg = tmp_path / "lucifer_shard"
    (pkg / "cli").mkdir(parents=True)
    (pkg / "cli" / "count.py").write_text(
        "def pads(doc, m):\n"
        "    t = doc['roles']['target']['ranks'][0]['tensors']['w']\n"
        "    return sum(hi - lo for _, lo, hi in t.get('zero_regions')), m.roles['target'][0]\n")
    found = second_readers({"lucifer_shard": pkg})
    assert any("'zero_regions'" in line for line in found)
    assert any("by position" in line for line in found)


@pytest.mark.parametrize("kw", [{}, {"arch": "sm90"}, {"expert_layout": "model", "arch": None}, {"mtp": False}])
def test_manifest_round_trips_byte_for_byte(converted, kw):
    out = converted(**kw)
    m = Manifest.load(out)
    assert m.sealed
    assert manifest_text(m.to_dict()).encode() == (out / MANIFEST_NAME).read_bytes()


def test_rank_is_looked_up_by_its_field(converted):
    m = Manifest.load(converted())
    shuffled = replace(m, roles={role: tuple(reversed(ranks)) for role, ranks in m.roles.items()})
    for role in m.roles:
        assert [shuffled.rank(role, r).rank for r in range(m.tp_size)] == list(range(m.tp_size))
        with pytest.raises(OutputError, match=f"lists no {role} entry for TP rank {m.tp_size}"):
            shuffled.rank(role, m.tp_size)  # issue 52 W: never None for a caller to dereference
    with pytest.raises(OutputError, match="lists no nope entry"):
        m.rank("nope", 0)


def test_padding_bytes_are_the_bytes_in_the_zero_regions(converted):
    """`TensorRecord.padding_bytes` (what inspect reports) against a mask of the regions laid on the
    model-layout tensor, one expert at a time when stacked."""
    m = Manifest.load(converted())
    checked = 0
    for entry in m.roles["target"]:
        for t in entry.tensors.values():
            if not t.zero_regions:
                continue
            matrix = t.model_shape[1:] if t.experts else t.model_shape
            mask = np.zeros(matrix, bool)
            for dim, lo, hi in t.zero_regions:
                mask[(slice(None),) * dim + (slice(lo, hi),)] = True
            assert t.padding_bytes == int(mask.sum()) * DTYPE_SIZE[t.dtype] * (t.experts or 1), t
            checked += 1
    assert checked
