"""Hypothesis strategies that corrupt a valid safetensors file (or a checkpoint index) in the ways
real files break or are tampered with: one strategy per kind of corruption (KINDS, INDEX_KINDS),
each drawing the corrupted bytes.
"""
from __future__ import annotations

import json

from hypothesis import strategies as st

MAX_HEADER = 100_000_000
KNOWN_DTYPES = ["BF16", "F32", "I64", "I32", "I8", "U8", "F8_E4M3", "F8_E8M0"]

KINDS = (
    "length prefix wrong, past the file or huge",
    "header bytes overwritten",
    "file truncated",
    "trailing garbage",
    "dtype unknown, other or not a string",
    "shape negative, enormous, overflowing or mistyped",
    "data_offsets past EOF, reversed, duplicated or mistyped",
    "entry field missing or extra",
    "__metadata__ of the wrong type",
    "tensor name with NUL, control or invalid characters",
    "duplicate key",
    "header not a JSON object / invalid JSON",
    "header encoding not UTF-8",
    "gap between tensors",
)


def split(raw: bytes) -> tuple[dict, bytes]:
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def pack(header: bytes, data: bytes, pad: bool = True) -> bytes:
    if pad:
        header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header + data


def encode(doc: dict, data: bytes, ascii_only: bool = True) -> bytes:
    return pack(json.dumps(doc, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass"), data)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6)
names = st.one_of(
    st.sampled_from(["", "a\x00b", "x\ny", "tab\there", "\ud800", "\udfff tail", "__metadata__ ", "\u202e", "\x7f"]),
    st.text(max_size=12),
    st.text(alphabet=st.characters(codec="utf-8", categories=["Cc", "Cf", "Zl", "Zp"]), min_size=1, max_size=4))
dims = st.one_of(st.integers(0, 4096), st.sampled_from([-1, -2**63, 2**32, 2**63, 2**64, 2**64 - 1, 2**70]))


def _shape(draw, shape: list[int]):
    return draw(st.one_of(
        st.permutations(shape).map(list),
        st.lists(dims, max_size=4),
        st.lists(st.sampled_from([2**32, 2**33, 2**63 - 1]), min_size=2, max_size=40),  # product overflows
        st.just([*shape, 0, 2**70]),  # zero elements, one absurd dim
        st.lists(st.floats(0, 8) | st.booleans() | st.text(max_size=2), min_size=1, max_size=3),
        json_values))


def _offsets(draw, doc: dict, key: str, data_len: int):
    s, e = doc[key]["data_offsets"]
    others = [v["data_offsets"] for k, v in doc.items() if k not in ("__metadata__", key)]
    return draw(st.one_of(
        st.just([e, s]), st.just([s, e + 1]), st.just([s + 1, e + 1]), st.just([s, data_len + (1 << 30)]),
        st.sampled_from(others or [[0, 0]]), st.just([-1, e]), st.just([s, e, e]), st.just([s]),
        st.tuples(st.integers(0, 2**64), st.integers(0, 2**64)).map(list),
        st.just([float(s), float(e)]), st.just([True, e]), json_values))


@st.composite
def corrupted(draw, raw: bytes, kind: str) -> bytes:
    """One corruption of kind `kind` (one of KINDS) of the valid safetensors file `raw`."""
    doc, data = split(raw)
    n = int.from_bytes(raw[:8], "little")
    keys = [k for k in doc if k != "__metadata__"]
    key = draw(st.sampled_from(keys)) if keys else None
    if kind == KINDS[0]:
        new = draw(st.one_of(st.sampled_from([0, 1, 2, n - 1, n + 1, len(raw) - 8, len(raw) - 7, MAX_HEADER,
                                              MAX_HEADER + 1, 2**40, 2**63, 2**64 - 1]),
                             st.integers(0, 2**64 - 1)))
        return new.to_bytes(8, "little") + raw[8:]
    if kind == KINDS[1]:
        out = bytearray(raw)
        for _ in range(draw(st.integers(1, 4))):
            out[8 + draw(st.integers(0, max(0, n - 1)))] = draw(st.integers(0, 255))
        return bytes(out)
    if kind == KINDS[2]:
        return raw[:draw(st.integers(0, len(raw) - 1))]
    if kind == KINDS[3]:
        return raw + draw(st.binary(min_size=1, max_size=64))
    if kind == KINDS[4] and key:
        doc[key]["dtype"] = draw(st.one_of(st.sampled_from(KNOWN_DTYPES + ["F16", "BOOL", "F4", "u8", "", "F8"]),
                                           st.text(max_size=6), json_values))
    elif kind == KINDS[5] and key:
        doc[key]["shape"] = _shape(draw, doc[key]["shape"])
    elif kind == KINDS[6] and key:
        doc[key]["data_offsets"] = _offsets(draw, doc, key, len(data))
    elif kind == KINDS[7] and key:
        if draw(st.booleans()):
            del doc[key][draw(st.sampled_from(sorted(doc[key])))]
        else:
            doc[key][draw(st.text(min_size=1, max_size=6))] = draw(json_values)
    elif kind == KINDS[8]:
        doc["__metadata__"] = draw(st.one_of(
            st.lists(st.text(max_size=3), max_size=2), st.integers(), st.text(max_size=5), st.booleans(),
            st.dictionaries(st.text(max_size=4), json_values, min_size=1, max_size=3),
            st.just({"k": "\ud800"}), st.just({"\udc80": "v"})))
    elif kind == KINDS[9] and key:
        doc = {(draw(names) if k == key else k): v for k, v in doc.items()}
    elif kind == KINDS[10] and key:
        body = json.dumps(doc)  # the key again, first, with its own entry or another key's
        dup = json.dumps({key: doc[draw(st.sampled_from(keys))]})[1:-1]
        return pack(("{" + dup + "," + body[1:]).encode(), data)
    elif kind == KINDS[11]:
        header = draw(st.sampled_from([b"[]", b"null", b"42", b'"text"', b"[" * 5000 + b"]" * 5000,
                                       b"{" * 3000, b'{"a": NaN}', b"{'a': 1}", b"{} {}", b"",
                                       json.dumps(doc).encode()[:-1]]))
        if header == b'{"a": NaN}' and key:
            header = json.dumps(doc).replace(json.dumps(doc[key]["shape"]), "[NaN]", 1).encode()
        return pack(header, data)
    elif kind == KINDS[12]:
        text = json.dumps(doc, ensure_ascii=False)
        at = draw(st.integers(0, max(0, text.count('"') - 1)))  # which string gets the bad bytes
        bad = draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xc0\xaf", b"\xf8\x88\x80\x80\x80"]))
        header = draw(st.sampled_from([
            text.encode("utf-16"), b"\xef\xbb\xbf" + text.encode(), text.encode("utf-32"),
            b'"'.join(p + bad if i == at else p for i, p in enumerate(text.encode().split(b'"')))]))
        return pack(header, data)
    elif kind == KINDS[13] and key:
        if draw(st.booleans()):
            del doc[key]  # its bytes stay: a gap (or trailing bytes, if it was the last)
        else:
            shift = draw(st.integers(1, 64))
            for k in keys:
                doc[k]["data_offsets"] = [o + shift for o in doc[k]["data_offsets"]]
            data = b"\0" * shift + data
    return encode(doc, data, ascii_only=draw(st.booleans()))


@st.composite
def corrupted_index(draw, raw: bytes, shard: str, kind: str) -> bytes:
    """One corruption of kind `kind` (one of INDEX_KINDS) of a model.safetensors.index.json."""
    index = json.loads(raw)
    wm = index["weight_map"]
    key = draw(st.sampled_from(sorted(wm)))
    if kind == INDEX_KINDS[0]:
        wm[key] = draw(st.sampled_from([f"../{shard}", f"/etc/{shard}", f"sub/../../{shard}", "..", "/",
                                        f"./../{shard}", f"{shard}\x00", ""]))
    elif kind == INDEX_KINDS[1]:
        del wm[key]
    elif kind == INDEX_KINDS[2]:
        wm[key + draw(st.sampled_from([".extra", "_", "\x00"]))] = wm[key]
    elif kind == INDEX_KINDS[3]:
        wm[key] = draw(st.sampled_from(sorted(set(wm.values()) - {wm[key]}) + ["model-00009-of-00009.safetensors"]))
    elif kind == INDEX_KINDS[4]:
        index["weight_map"] = draw(st.one_of(st.lists(st.text(max_size=3), max_size=2), st.integers(), st.none(),
                                             st.just({key: 7}), st.just({key: None})))
    else:
        return draw(st.sampled_from([b"", b"[]", b"{", b'{"weight_map": 1}', b"\xff\xfe", raw[:len(raw) // 2]]))
    return json.dumps(index).encode()


INDEX_KINDS = (
    "index entry outside the model folder",
    "index omits a tensor a shard holds",
    "index lists a tensor no shard holds",
    "index names another or a missing shard",
    "weight_map of the wrong type",
    "index not JSON",
)
