"""The safetensors dtypes the checkpoint and the rank files hold, with their sizes; and the exact dtype
conversions a rule may ask for (`Rule.out_dtype`), on raw bytes, for convert and diff alike. torch's
dtype of each is torch_dtypes.py (this module is read by the header reader, which never imports torch)."""
from typing import Callable

import numpy as np

DTYPE_SIZE = {"BF16": 2, "F32": 4, "I64": 8, "I32": 4, "I8": 1, "U8": 1, "F8_E4M3": 1, "F8_E8M0": 1}


class InexactConversion(ValueError):
    """A source value the output dtype cannot hold exactly."""


def _i64_to_i32(raw: np.ndarray) -> np.ndarray:
    v = raw.view(np.int64)
    out = v.astype(np.int32)
    if not np.array_equal(out.astype(np.int64), v):
        raise InexactConversion("values outside int32")
    return out.view(np.uint8)


def _bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    # a BF16 is the top half of the F32 of the same value: every BF16 widens exactly
    return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.uint8)


# (source dtype, output dtype) -> bytes to bytes; the last axis is in bytes on both sides
CONVERSIONS: dict[tuple[str, str], Callable[[np.ndarray], np.ndarray]] = {
    ("I64", "I32"): _i64_to_i32,
    ("BF16", "F32"): _bf16_to_f32,
}


def convert_bytes(raw: np.ndarray, src: str, dst: str) -> np.ndarray:
    """`raw` (uint8, C-contiguous, last axis in bytes of `src`) as bytes of `dst`; InexactConversion
    where a value does not survive."""
    return CONVERSIONS[(src, dst)](np.ascontiguousarray(raw))
