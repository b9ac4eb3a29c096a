"""Field-type checks for the JSON documents lucifer-shard reads (config.json, the manifest): a
document is described by nested specs (`Int`, `Str`, `Obj`, `ListOf`, ...) and `check` names the
first field that does not fit, e.g. `roles.target.ranks[1].files[0].bytes: -3 is below 0`.

Strict where Python's JSON is lax: a bool is not an integer, a float is not an integer (256.7 or
256.0), NaN and Infinity are no numbers (`loads` refuses them), and every number has bounds, so
nothing derived from a field can overflow, go negative or allocate without limit. `loads` is the
one parser: UTF-8 only, nesting bounded, 4300-digit integers and constants refused, all as
`SchemaError` (a ValueError) with one line.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MAX_INT = 1 << 62  # sizes and counts: far above any real one, far below an int64 overflow
MAX_DEPTH = 64  # nesting of a document (ours are at most 8 deep)


class SchemaError(ValueError):
    """A field that does not fit its spec; the message is `<field path>: <what is wrong>`."""


def _short(value: Any, limit: int = 60) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


class Spec:
    def check(self, value: Any, where: str) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class Int(Spec):
    lo: int = 0
    hi: int = MAX_INT

    def check(self, value: Any, where: str) -> None:
        if type(value) is not int:
            raise SchemaError(f"{where}: {_short(value)} is {_kind(value)}, expected an integer")
        if not self.lo <= value <= self.hi:
            raise SchemaError(f"{where}: {_short(value)} is outside {self.lo}..{self.hi}")


@dataclass(frozen=True)
class Num(Spec):
    lo: float = -math.inf
    hi: float = math.inf

    def check(self, value: Any, where: str) -> None:
        if type(value) not in (int, float) or not math.isfinite(value):
            raise SchemaError(f"{where}: {_short(value)} is {_kind(value)}, expected a finite number")
        if not self.lo <= value <= self.hi:
            raise SchemaError(f"{where}: {_short(value)} is outside {self.lo}..{self.hi}")


@dataclass(frozen=True)
class Str(Spec):
    pattern: str | None = None  # a full match
    max_len: int = 4096

    def check(self, value: Any, where: str) -> None:
        if not isinstance(value, str):
            raise SchemaError(f"{where}: {_short(value)} is {_kind(value)}, expected a string")
        if len(value) > self.max_len:
            raise SchemaError(f"{where}: a string of {len(value)} characters, at most {self.max_len} expected")
        if self.pattern is not None and not re.fullmatch(self.pattern, value):
            raise SchemaError(f"{where}: {_short(value)} is not of the form {self.pattern}")


@dataclass(frozen=True)
class OneOf(Spec):
    values: tuple

    def check(self, value: Any, where: str) -> None:
        if not any(type(value) is type(v) and value == v for v in self.values):
            raise SchemaError(f"{where}: {_short(value)}, expected one of {', '.join(map(_short, self.values))}")


@dataclass(frozen=True)
class Bool(Spec):
    def check(self, value: Any, where: str) -> None:
        if type(value) is not bool:
            raise SchemaError(f"{where}: {_short(value)} is {_kind(value)}, expected true or false")


@dataclass(frozen=True)
class Null(Spec):
    """`spec`, or null."""

    spec: Spec

    def check(self, value: Any, where: str) -> None:
        if value is not None:
            self.spec.check(value, where)


@dataclass(frozen=True)
class ListOf(Spec):
    item: Spec
    min_len: int = 0
    max_len: int = 1 << 20

    def check(self, value: Any, where: str) -> None:
        if not isinstance(value, list):
            raise SchemaError(f"{where}: {_short(value)} is {_kind(value)}, expected a list")
        if not self.min_len <= len(value) <= self.max_len:
            raise SchemaError(f"{where}: a list of {len(value)}, expected {self.min_len}..{self.max_len} entries")
        for i, v in enumerate(value):
            self.item.check(v, f"{where}[{i}]")


@dataclass(frozen=True)
class MapOf(Spec):
    """An object with any keys (checked by `key`) and values of one spec."""

    value: Spec
    key: Spec = Str()

    def check(self, value: Any, where: str) -> None:
        if not isinstance(value, dict):
            raise SchemaError(f"{where}: {_short(value)} is {_kind(value)}, expected an object")
        for k, v in value.items():
            self.key.check(k, f"{where} key {_short(k)}")
            self.value.check(v, f"{where}.{k}" if where else k)


@dataclass(frozen=True)
class Obj(Spec):
    """An object with these fields (`optional` ones may be absent); other keys are allowed unless `closed`."""

    fields: dict[str, Spec]
    optional: dict[str, Spec] = field(default_factory=dict)
    closed: bool = False

    def check(self, value: Any, where: str) -> None:
        if not isinstance(value, dict):
            raise SchemaError(f"{where}: {_short(value)} is {_kind(value)}, expected an object")
        missing = [k for k in self.fields if k not in value]
        if missing:
            raise SchemaError(f"{where}: field {missing[0]!r} is missing")
        if self.closed:
            extra = sorted(set(value) - set(self.fields) - set(self.optional))
            if extra:
                raise SchemaError(f"{where}: unexpected field {extra[0]!r}")
        for k, spec in {**self.fields, **self.optional}.items():
            if k in value:
                spec.check(value[k], f"{where}.{k}" if where else k)


@dataclass(frozen=True)
class Where(Spec):
    """`spec`, then `test(value)`, which returns what is wrong or None."""

    spec: Spec
    test: Callable[[Any], str | None]

    def check(self, value: Any, where: str) -> None:
        self.spec.check(value, where)
        problem = self.test(value)
        if problem:
            raise SchemaError(f"{where}: {problem}")


def check(spec: Spec, value: Any, where: str = "") -> None:
    spec.check(value, where)


def no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    """json.loads object_pairs_hook: a key given twice is refused (json keeps the last one silently)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise SchemaError(f"key {dup!r} appears twice")
    return out


def refuse_constant(name: str):
    """json.loads parse_constant: NaN, Infinity and -Infinity are not JSON."""
    raise SchemaError(f"{name} is not a JSON number")


def _depth(doc: Any) -> int:
    """Nesting depth, iteratively (a deep document must not exhaust the stack here either)."""
    deepest, todo = 0, [(doc, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            if d > MAX_DEPTH:
                return d
            todo.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def loads(data: bytes) -> Any:
    """Parse a JSON document strictly (module docstring); SchemaError with one line otherwise."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SchemaError(f"not UTF-8 text (byte {e.start})") from None
    try:
        doc = json.loads(text, object_pairs_hook=no_duplicate_keys, parse_constant=refuse_constant)
    except RecursionError:
        raise SchemaError(f"nested more than {MAX_DEPTH} levels deep") from None
    except SchemaError:
        raise
    except ValueError as e:  # JSONDecodeError, and an integer of more than 4300 digits
        raise SchemaError(f"not valid JSON ({' '.join(str(e).split())})") from None
    if _depth(doc) > MAX_DEPTH:
        raise SchemaError(f"nested more than {MAX_DEPTH} levels deep")
    return doc
