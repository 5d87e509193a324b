"""``fp32``, ``fp16``, ``bf16``: values cast to one float format and sent raw.

``fp32`` is lossless for float32/float16/bfloat16 input (float64 input is rounded to float32).
``fp16`` and ``bf16`` round to nearest; their error bound is half a unit in the last place of
the target format (relative 2**-11 for fp16, 2**-8 for bf16) for values inside its range;
fp16 overflows to ±Inf beyond 65504. NaN and ±Inf stay NaN and ±Inf.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch

from ...errors import require
from ..base import ValueCodec, register_value_codec


def convert_float(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values.to(dtype)``, except that float16/bfloat16 <-> float32 keep NaN payload bits, so a
    widening followed by the matching narrowing is bit-exact (torch canonicalizes NaNs)."""
    if values.dtype == dtype:
        return values
    pair = (values.dtype, dtype)
    if pair == (torch.bfloat16, torch.float32):
        return (values.view(torch.int16).to(torch.int32) << 16).view(torch.float32)
    if pair == (torch.float32, torch.bfloat16):
        out = values.to(torch.bfloat16)
        if _may_hold_nan(values):
            nan = torch.isnan(values)
            out[nan] = (values[nan].view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)
        return out
    if torch.float16 in pair and torch.float32 in pair:
        # torch's vectorized cast for the numbers (numpy's float32 -> float16 is ~10x slower: 1.7 ms
        # per 100k values here), numpy's for the NaNs alone, which it converts with their payload bits
        out = values.to(dtype)
        if _may_hold_nan(values):
            nan = torch.isnan(values)
            numpy_dtype = np.float32 if dtype == torch.float32 else np.float16
            out[nan] = torch.from_numpy(values[nan].numpy().astype(numpy_dtype))
        return out
    return values.to(dtype)


def _may_hold_nan(values: torch.Tensor) -> bool:
    """False only when ``values`` holds no NaN: a NaN anywhere makes the sum NaN, so one reduction
    (no bool tensor; top-k's 112k values per bucket, five conversions a step) answers the common
    case, and a NaN sum (a NaN, or +Inf with -Inf) sends the caller to its exact ``isnan``."""
    return bool(torch.isnan(values.sum()))


def _raw_bytes(values: torch.Tensor) -> bytes:
    return values.contiguous().view(torch.uint8).numpy().tobytes() if values.numel() else b""


class _CastCodec(ValueCodec):
    wire_dtype: ClassVar[torch.dtype]

    def __init__(self) -> None:
        pass

    def encode(self, values: torch.Tensor) -> bytes:
        return _raw_bytes(convert_float(values, self.wire_dtype))

    def max_section_bytes(self, most: int) -> int:
        """See :meth:`ValueCodec.max_section_bytes`: exactly the width times the count."""
        return torch.finfo(self.wire_dtype).bits // 8 * int(most)

    def decode(self, data: memoryview, count: int, dtype: torch.dtype) -> torch.Tensor:
        size = torch.finfo(self.wire_dtype).bits // 8
        require(len(data) == count * size, f"{self.name} section has {len(data)} bytes, expected {count * size}")
        if count == 0:
            return torch.zeros(0, dtype=dtype)
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return convert_float(raw.view(self.wire_dtype), dtype)

    def encode_with_reconstruction(self, values: torch.Tensor) -> tuple[bytes, torch.Tensor]:
        cast = convert_float(values, self.wire_dtype)
        lossless_here = torch.finfo(values.dtype).bits <= torch.finfo(self.wire_dtype).bits and (
            values.dtype == self.wire_dtype or self.wire_dtype == torch.float32
        )
        return _raw_bytes(cast), values if lossless_here else convert_float(cast, values.dtype)


@register_value_codec
class Float32Codec(_CastCodec):
    """Values as float32, 32 bits each: lossless for float32/float16/bfloat16 input.

    float64 input is rounded to float32 (``lossless`` describes the usual case; the
    reconstruction says what arrived). No options; the section is exactly ``4 k`` bytes and
    decodes in ``O(k)`` (docs/wire-format.md, "Decode cost bounds").
    """

    name = "fp32"
    wire_id = 1
    wire_dtype = torch.float32


@register_value_codec
class Float16Codec(_CastCodec):
    """Values rounded to float16, 16 bits each: lossy, relative error at most 2**-11 in range.

    Magnitudes below 6.1e-5 lose precision (subnormal) and beyond 65504 overflow to +-Inf; use
    ``fp16-scaled`` for small gradients. No options; the section is exactly ``2 k`` bytes and
    decodes in ``O(k)`` (docs/wire-format.md, "Decode cost bounds").
    """

    name = "fp16"
    wire_id = 2
    lossless = False
    wire_dtype = torch.float16


@register_value_codec
class BFloat16Codec(_CastCodec):
    """Values rounded to bfloat16, 16 bits each: lossy, relative error at most 2**-8.

    float32's range, so nothing overflows. No options; the section is exactly ``2 k`` bytes and
    decodes in ``O(k)`` (docs/wire-format.md, "Decode cost bounds").
    """

    name = "bf16"
    wire_id = 3
    lossless = False
    wire_dtype = torch.bfloat16
