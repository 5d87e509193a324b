"""``fp16-scaled``: fp16 values with a power-of-two scale, so small gradients keep fp16's precision.

Plain ``fp16`` has 11 significant bits but a narrow range: magnitudes below 6.1e-5 become
subnormal (fewer bits) and below 6e-8 become zero, as small gradients of deep or sequence
models often are. Multiplying by ``2**e`` before the cast, with ``e`` chosen so the largest
magnitude lands just below fp16's maximum, is exact and moves the whole set into fp16's normal
range (as AMP's loss scaling does): values down to ``2**-24`` of the largest keep full fp16
precision. Where every value is already in fp16's normal range the result is bit for bit that
of ``fp16`` (scaling by a power of two does not change a normal number's rounding): on the
MNIST-5k CNN, top-k 1%, both gave the same model.

Section: ``e`` as int8, then the ``count`` fp16 values of ``values * 2**e`` (raw, little-endian).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ...errors import require
from ..base import ValueCodec, register_value_codec

#: Scaled magnitudes stay below this (fp16's largest finite value is 65504): rounding up to the
#: next power of two cannot overflow.
_TARGET = 2.0**15
_MIN_EXPONENT, _MAX_EXPONENT = -127, 127


def scale_exponent(values: torch.Tensor) -> int:
    """``e`` such that ``max|values| * 2**e`` lies in ``[2**14, 2**15)`` (0 when there is no finite
    non-zero magnitude), clamped to int8."""
    if values.numel() == 0:
        return 0
    magnitudes = values.abs()
    finite = magnitudes[torch.isfinite(magnitudes)]
    largest = float(finite.max()) if finite.numel() else 0.0
    if largest == 0.0:
        return 0
    exponent = math.floor(math.log2(_TARGET / largest))
    if largest * 2.0**exponent >= _TARGET:  # log2 rounding at exact powers of two
        exponent -= 1
    return max(_MIN_EXPONENT, min(_MAX_EXPONENT, exponent))


@register_value_codec
class ScaledFloat16Codec(ValueCodec):
    """float16 after an exact power-of-two scale: 16 bits per value plus one byte, lossy.

    The scale puts the largest magnitude just below float16's maximum, so values down to
    ``2**-24`` of it keep float16's full relative precision (2**-11) where plain ``fp16`` would
    go subnormal or zero; where every value is already in float16's normal range the result is
    bit for bit that of ``fp16``. No options; the section is exactly ``1 + 2 k`` bytes and
    decodes in ``O(k)`` (docs/wire-format.md, "Decode cost bounds").
    """

    name = "fp16-scaled"
    wire_id = 9
    lossless = False

    def __init__(self) -> None:
        pass

    def encode(self, values: torch.Tensor) -> bytes:
        exponent = scale_exponent(values)
        # float64 holds float32/float16/bfloat16 and any power of two here exactly
        scaled = torch.ldexp(values.double(), torch.tensor(exponent, dtype=torch.float64)).to(torch.float16)
        body = scaled.contiguous().view(torch.uint8).numpy().tobytes() if values.numel() else b""
        return np.int8(exponent).tobytes() + body

    def decode(self, data: memoryview, count: int, dtype: torch.dtype) -> torch.Tensor:
        require(len(data) == 1 + 2 * count, f"fp16-scaled section has {len(data)} bytes, expected {1 + 2 * count}")
        exponent = int(np.frombuffer(data[:1], dtype=np.int8)[0])
        require(_MIN_EXPONENT <= exponent <= _MAX_EXPONENT, f"fp16-scaled exponent {exponent} is out of range")
        if count == 0:
            return torch.zeros(0, dtype=dtype)
        raw = torch.frombuffer(bytearray(data[1:]), dtype=torch.float16)
        return torch.ldexp(raw.double(), torch.tensor(-exponent, dtype=torch.float64)).to(dtype)
