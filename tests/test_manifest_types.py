"""The typed documents (formats/records.py): the manifest (output/manifest_types.py) reads back what convert
wrote byte for byte, looks a rank up by its `rank` field and counts pad bytes as the regions lie; the
manifest, the share record (output/share.py) and the journal (engine/journal.py) are each read only by
their owners: the source is checked with `ast` for a second reader."""
from __future__ import annotations

import ast
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lucifer_shard.engine.journal import JournalEntry
from lucifer_shard.errors import OutputError
from lucifer_shard.formats.dtypes import DTYPE_SIZE
from lucifer_shard.formats.records import Only, Rec, fields_of, from_doc, schema_of, to_doc
from lucifer_shard.formats.schema import Bool, Int, ListOf, MapOf, Null, Obj, OneOf, Spec, Str, Where, check
from lucifer_shard.outnames import MANIFEST_NAME
from lucifer_shard.output.manifest import manifest_text
from lucifer_shard.output.manifest_types import MANIFEST_FIELDS, Manifest
from lucifer_shard.output.share import ShareRecord

from test_architecture import PACKAGES, modules

# The modules that read the manifest's fields: its schema and the records built from it.
OWNERS = ("lucifer_shard.output.manifest", "lucifer_shard.output.manifest_types")
# Field names other documents of the tool carry too, so a subscript with them says nothing about the
# manifest: the share record (output/share.py), the conversion record and journal (engine/outstate.py),
# the inspect summary (cli/cmd_check.summarize, which mirrors the manifest's names), the safetensors
# header (formats/stheader.py), the RUNTIME table, and names too common to be the manifest's alone.
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
    if isinstance(spec, Rec):
        return _field_names(schema_of(spec.cls, spec.closed))
    if isinstance(spec, Only):
        return {spec.key} | _field_names(spec.spec)
    return set()


def _string_key(node: ast.AST) -> str | None:
    """"k" of `x["k"]` or `x.get("k", ...)`."""
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        return node.slice.value if isinstance(node.slice.value, str) else None
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
            and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
        return node.args[0].value
    return None


# The other typed documents: their owners (the modules that may name their fields) and their specs.
DOCUMENTS = {
    "share record": (("lucifer_shard.output.share",), schema_of(ShareRecord), "ShareRecord.parse (output/share.py)"),
    "journal": (("lucifer_shard.engine.journal",), schema_of(JournalEntry), "engine/journal.read_journal"),
}
# Their field names are common ones: a module outside their owners may read them only from another
# document, named here with the keys it reads (a key added here must be read there: checked below).
OTHER_DOCUMENTS = {
    "lucifer_shard.output.manifest_types": ({"format", "format_version"}, "the manifest's own format check"),
    "lucifer_shard.cli.cmd_check": ({"conversion_id", "format_version", "tp_size", "path", "bytes", "tensors"},
                                    "inspect's summary (`summarize`), which mirrors the manifest's names"),
    "lucifer_shard.cli.cmd_numerics": ({"tp_size"}, "check-numerics' report"),
    "lucifer_shard.cli.group": ({"bytes"}, "plan's per-node footprint"),
    "lucifer_shard.cli.planview": ({"bytes", "ranks"}, "plan's footprint"),
    "lucifer_shard.cli.serve_cli": ({"nnodes", "node_rank"}, "serve's --nnodes/--node-rank settings"),
    "lucifer_shard.runtime_shim.serving.serve": ({"nnodes", "node_rank"}, "serve's --nnodes/--node-rank settings"),
    "lucifer_shard.proof.diff": ({"digest", "tp_size", "conversion_id"}, "diff's report"),
    "lucifer_shard.proof.verify": ({"tensors", "conversion_id"}, "verify's report"),
    "lucifer_shard.engine.repair": ({"conversion_id"}, "the conversion record (.lucifer/conversion.json)"),
    "lucifer_shard.engine.stage": ({"bytes"}, "stage's summary of the kernel cache it carried"),
    "lucifer_shard.output.kernel_cache": ({"format", "format_version", "bytes", "digest"},
                                          "the kernel cache's own record (kernel-cache/record.json)"),
    "lucifer_shard.engine.outstate": ({"conversion_id"}, "the conversion record"),
    "lucifer_shard.engine.owned": ({"path"}, "the manifest and journal read leniently for the names --force may "
                                             "delete, a damaged one's too"),
    "lucifer_shard.runtime_shim.manifest": ({"tp_size"}, "vLLM's virtual-TP plan"),
}
# The modules that build records from a document (formats/records.from_doc): each document's one reader.
BUILDERS = {"lucifer_shard.formats.records", *OWNERS, *(o for owners, _, _ in DOCUMENTS.values() for o in owners)}


def other_keys(packages: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the share record's and journal's field names it reads, outside those documents' owners."""
    names = set().union(*(_field_names(spec) for _, spec, _ in DOCUMENTS.values()))
    found: dict[str, set[str]] = {}
    for name, path in modules(packages).items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            key = _string_key(node)
            if key in names and not any(name in owners and key in _field_names(spec)
                                        for owners, spec, _ in DOCUMENTS.values()):
                found.setdefault(name, set()).add(key)
    return found


def second_readers(packages: dict[str, Path]) -> list[str]:
    """One line per place outside a document's owners that reads the document itself: a subscript or
    `.get` with a field name only the manifest carries, or one of the share record's or journal's outside
    OTHER_DOCUMENTS; a record built from a document outside its reader (`from_doc`); or a rank entry
    looked up by position (`.roles[role][i]`; `Manifest.rank` looks it up by its field)."""
    only = _field_names(MANIFEST_FIELDS) - SHARED
    found = []
    for name, path in modules(packages).items():
        elsewhere = OTHER_DOCUMENTS.get(name, (set(), ""))[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            where = f"{name}:{getattr(node, 'lineno', 0)}"
            key = _string_key(node)
            if key in only and name not in OWNERS:
                found.append(f"{where} reads the manifest's field {key!r}")
            for doc, (owners, spec, reader) in DOCUMENTS.items():
                if key in _field_names(spec) and name not in owners and key not in elsewhere:
                    found.append(f"{where} reads the {doc}'s field {key!r} (use {reader})")
            if isinstance(node, ast.Name) and node.id == "from_doc" and name not in BUILDERS:
                found.append(f"{where} builds a record from a document its reader did not check")
            if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Subscript)
                    and isinstance(node.value.value, ast.Attribute) and node.value.value.attr == "roles"):
                found.append(f"{where} looks a rank entry up by position (use Manifest.rank)")
    return found


def test_the_typed_documents_are_the_only_readers():
    assert second_readers(PACKAGES) == []


def test_other_documents_lists_only_what_is_read():
    """Each exception of OTHER_DOCUMENTS is still read where it says (a stale one would hide a second reader)."""
    read = other_keys(PACKAGES)
    present = modules(PACKAGES)
    assert {n: keys - read.get(n, set()) for n, (keys, _) in OTHER_DOCUMENTS.items()
            if n in present and keys - read.get(n, set())} == {}


def test_a_second_reader_is_found(tmp_path):
    pkg = tmp_path / "lucifer_shard"
    (pkg / "cli").mkdir(parents=True)
    (pkg / "cli" / "count.py").write_text(
        "def pads(doc, m):\n"
        "    t = doc['roles']['target']['ranks'][0]['tensors']['w']\n"
        "    return sum(hi - lo for _, lo, hi in t.get('zero_regions')), m.roles['target'][0]\n")
    (pkg / "engine").mkdir()
    (pkg / "engine" / "resume.py").write_text(
        "def kept(share, entry, doc):\n"
        "    return 1 in share['ranks'] and entry.get('sources'), from_doc(JournalEntry, doc)\n")
    found = second_readers({"lucifer_shard": pkg})
    assert any("'zero_regions'" in line for line in found)
    assert any("by position" in line for line in found)
    assert any("share record's field 'ranks'" in line for line in found)
    assert any("journal's field 'sources'" in line for line in found)
    assert any("builds a record" in line for line in found)


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


def documents(spec: Spec) -> st.SearchStrategy:
    """Documents of `spec` as a writer writes them: an optional field of a record that is written even
    when None (`omit_none` off) is always there, one written only when set is a value or absent."""
    if isinstance(spec, Rec):
        fields = {n: (documents(s), opt and omit) for n, s, opt, omit in fields_of(spec.cls)}
        return st.fixed_dictionaries({n: d for n, (d, maybe) in fields.items() if not maybe},
                                     optional={n: d for n, (d, maybe) in fields.items() if maybe})
    if isinstance(spec, Only):
        return st.fixed_dictionaries({spec.key: documents(spec.spec)})
    if isinstance(spec, ListOf):
        return st.lists(documents(spec.item), min_size=spec.min_len, max_size=min(spec.max_len, spec.min_len + 1))
    if isinstance(spec, MapOf):
        return st.dictionaries(documents(spec.key), documents(spec.value), max_size=2)
    if isinstance(spec, Null):
        return st.none() | documents(spec.spec)
    if isinstance(spec, Where):
        return documents(spec.spec).filter(lambda v: spec.test(v) is None)
    if isinstance(spec, Int):
        return st.sampled_from((spec.lo, spec.hi)) | st.integers(spec.lo, min(spec.hi, spec.lo + 1000))
    if isinstance(spec, Str):
        return st.from_regex(spec.pattern, fullmatch=True) if spec.pattern else st.text(max_size=8)
    if isinstance(spec, OneOf):
        return st.sampled_from(spec.values)
    assert isinstance(spec, Bool), spec
    return st.booleans()


@pytest.mark.parametrize("cls", [Manifest, ShareRecord, JournalEntry], ids=lambda c: c.__name__)
def test_documents_round_trip_through_their_records(cls):
    """Any document of a record's declaration (an older writer's too) is checked, parsed and written
    back to the same document and so the same JSON bytes: parse and serialisation are inverses."""
    @settings(max_examples=12, derandomize=True, database=None, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
    @given(documents(Rec(cls, closed=True)))
    def round_trip(doc):
        check(schema_of(cls), doc)
        assert json.dumps(to_doc(from_doc(cls, doc)), sort_keys=True) == json.dumps(doc, sort_keys=True)

    round_trip()


def test_a_field_that_does_not_round_trip_is_caught():
    """The property above fails on a serialisation that drops a field (the walker's own check)."""
    doc = {"path": "target/rank-0/part-00000.safetensors", "bytes": 1, "digest": "0" * 64, "tensors": {},
           "sources": {"w": "1" * 64}}
    entry = from_doc(JournalEntry, doc)
    assert to_doc(entry) == doc
    assert to_doc(replace(entry, sources=None)) != doc
