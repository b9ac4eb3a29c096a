"""A JSON document declared once, as frozen dataclasses whose fields carry their spec (formats/schema.py):
the check (`schema_of`), the parse (`from_doc`) and the serialisation (`to_doc`) all walk that one
declaration, so a field added to a record is checked, read and written without a second edit.

A field's spec says how its value is held: `Rec` a nested record, `ListOf` a tuple, `MapOf` a dict,
`Only` an object of one field held as that field's value; other specs hold the JSON value itself.
A dataclass field without a spec (`sealed` of the manifest) is no part of the document.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cache
from typing import Any

from .schema import ListOf, MapOf, Null, Obj, Spec, Where

_SPEC = "lucifer.spec"


def fld(spec: Spec, *, optional: bool = False, omit_none: bool | None = None, default: Any = dataclasses.MISSING
        ) -> Any:
    """A record field of JSON spec `spec`. `optional`: the document may lack it (then `default`, else
    None); `omit_none` (default: `optional`): written only when not None, so documents written before
    the field existed keep their bytes."""
    if optional and default is dataclasses.MISSING:
        default = None
    return dataclasses.field(default=default, metadata={_SPEC: (spec, optional,
                                                                optional if omit_none is None else omit_none)})


def fields_of(cls: type) -> list[tuple[str, Spec, bool, bool]]:
    """(name, spec, optional, omit_none) of every document field of record class `cls`."""
    return [(f.name, *f.metadata[_SPEC]) for f in dataclasses.fields(cls) if _SPEC in f.metadata]


@dataclass(frozen=True)
class Rec(Spec):
    """A nested record of class `cls` (its fields' specs); `closed`: no other keys allowed."""

    cls: type
    closed: bool = False

    def check(self, value: Any, where: str) -> None:
        schema_of(self.cls, self.closed).check(value, where)


@dataclass(frozen=True)
class Only(Spec):
    """An object of the one field `key`, held as that field's value (`{"ranks": [...]}` as the list)."""

    key: str
    spec: Spec

    def check(self, value: Any, where: str) -> None:
        Obj({self.key: self.spec}).check(value, where)


@cache
def schema_of(cls: type, closed: bool = False) -> Obj:
    """The object spec of record class `cls`: what `check` holds a document to before `from_doc`."""
    specs = fields_of(cls)
    return Obj({n: s for n, s, opt, _ in specs if not opt}, {n: s for n, s, opt, _ in specs if opt}, closed)


def _parse(spec: Spec, value: Any) -> Any:
    if value is None:
        return None
    if isinstance(spec, Rec):
        return from_doc(spec.cls, value)
    if isinstance(spec, Only):
        return _parse(spec.spec, value[spec.key])
    if isinstance(spec, ListOf):
        return tuple(_parse(spec.item, v) for v in value)
    if isinstance(spec, MapOf):
        return {k: _parse(spec.value, v) for k, v in value.items()}
    if isinstance(spec, (Null, Where)):
        return _parse(spec.spec, value)
    return value


def _dump(spec: Spec, value: Any) -> Any:
    if value is None:
        return None
    if isinstance(spec, Rec):
        return to_doc(value)
    if isinstance(spec, Only):
        return {spec.key: _dump(spec.spec, value)}
    if isinstance(spec, ListOf):
        return [_dump(spec.item, v) for v in value]
    if isinstance(spec, MapOf):
        return {k: _dump(spec.value, v) for k, v in value.items()}
    if isinstance(spec, (Null, Where)):
        return _dump(spec.spec, value)
    return value


def from_doc(cls: type, doc: dict, **extra: Any) -> Any:
    """The record of a document `schema_of(cls)` checked; `extra`: its fields that are no part of the document."""
    return cls(**{n: _parse(s, doc[n]) for n, s, _, _ in fields_of(cls) if n in doc}, **extra)


def to_doc(record: Any) -> dict:
    """The document of `record`: the inverse of `from_doc`."""
    values = {n: (s, getattr(record, n), omit) for n, s, _, omit in fields_of(type(record))}
    return {n: _dump(s, v) for n, (s, v, omit) in values.items() if not (omit and v is None)}
