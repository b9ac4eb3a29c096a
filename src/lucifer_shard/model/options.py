"""A conversion's options: everything that decides the bytes of its rank files (and so its identity), each
field with its spec; the manifest and the conversion record hold them, the layout and build tables read them."""
from __future__ import annotations

from dataclasses import dataclass

from ..formats.records import fld, to_doc
from ..formats.schema import Bool, Int, Null, OneOf, Where
from .arches import ARCHES
from .plan import DEFAULT_ROUTE, MAX_TP, MOE_ROUTES

MAX_ALIGN = 2 << 20  # --align: a 2 MiB huge page is the largest alignment any loader asks for


def _power_of_two(x: int) -> str | None:
    return None if x & (x - 1) == 0 else f"{x} is not a power of two"


@dataclass(frozen=True)
class Options:
    """Everything that decides the bytes of a conversion (and so its identity); the manifest's and the
    conversion record's `options`, each field with its spec (formats/records.py)."""

    tp: int = fld(Int(1, MAX_TP))
    # None: model layout for any GPU family (the files do not depend on it)
    arch: str | None = fld(Null(OneOf(ARCHES)), default=ARCHES[0])
    expert_layout: str = fld(OneOf(("kernel", "model")), default="kernel")
    flashinfer_layout: str = fld(OneOf(("folded", "legacy")), default="folded")
    mtp: bool = fld(Bool(), default=True)
    max_file_bytes: int = fld(Int(1), default=4 << 30)
    # data-section and tensor alignment for direct-I/O loaders (a power of two >= 8)
    align: int = fld(Where(Int(8, MAX_ALIGN), _power_of_two), default=8)
    # a MOE_ROUTES key other than the default ("b12x"): the routed width's route. Written only when set, so
    # outputs of the default route keep the conversion id they had before the field existed.
    moe_backend: str | None = fld(OneOf(tuple(r for r in MOE_ROUTES if r != DEFAULT_ROUTE)), optional=True)

    def to_dict(self) -> dict:
        """The options as the manifest records them."""
        return to_doc(self)
