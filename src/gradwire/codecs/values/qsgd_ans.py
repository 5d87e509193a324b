"""``qsgd-ans``: QSGD's unbiased stochastic levels, entropy-coded (ANS) instead of fixed-width.

Quantization is QSGD's (see :mod:`.qsgd`): the k values are cut into buckets of
``bucket_size``; in a bucket of scale ``n`` each value v becomes a level ``l`` in ``0..s``
(``s = levels``), ``floor(r)`` or ``floor(r) + 1`` with ``r = s |v| / n``, the latter with
probability ``r - floor(r)``, so E[sign(v) l n / s] = v (unbiased). The scale is the bucket's
L2 norm (``norm="l2"``, QSGD's choice: with s = 7 these are exactly the levels of
``qsgd bits=4``) or its largest magnitude (``norm="max"``: finer levels for the same s, as
most values of a bucket lie far below its L2 norm). Randomness as in ``qsgd`` (``seed``).

The levels are far from uniformly used -- with the L2 norm most values fall in level 0 or 1 --
so instead of ``1 + log2(s + 1)`` bits each, the signed levels ``sign * l`` (2s + 1 symbols; a
zero level carries no sign) are entropy-coded with ANS under the section's own count table
(:mod:`._ans`). On N(0, 1) values, bucket 512, this sends qsgd-4's exact levels in about 1.1
bits per value instead of 4.06 (``gradwire bench codecs`` prints the measured table).

Section layout (little-endian)::

    norm         u8                        0 = l2, 1 = max
    s            u16                       levels, 1..MAX_LEVELS
    bucket_size  u32                       >= 1
    scales       float32 x ceil(k / bucket_size)   finite, >= 0; each rounded *up* to float32,
                                           so every |v| <= its bucket's scale
    stream       the ANS stream of (sign * l + s), alphabet 2s + 1 (see _ans)

Error bound, per element of a bucket with stored scale ``n``::

    |decoded - v| <= n / s + u * n + tiny

with ``u`` and ``tiny`` as in ``qsgd`` (the reconstruction, computed in float64, is rounded
once to the values' dtype; float16/bfloat16 results beyond the dtype's range are clamped).

Non-finite input raises ValueError (a non-finite scale would poison its bucket).
"""

from __future__ import annotations

import numpy as np
import torch

from ...errors import check_choice, require
from ..base import ValueCodec, register_value_codec
from ..bits import ByteReader
from ._ans import decode_symbols, encode_symbols
from .qsgd import _bucket_norms, _round_up_f32

MAX_LEVELS = 1 << 14
NORMS = ("l2", "max")


def _scales(magnitudes: np.ndarray, bucket_size: int, norm: str) -> np.ndarray:
    if norm == "l2":
        return _round_up_f32(_bucket_norms(magnitudes, bucket_size))
    starts = np.arange(0, magnitudes.size, bucket_size)
    return _round_up_f32(np.maximum.reduceat(magnitudes, starts))


def _reconstruct(signed: np.ndarray, scales: np.ndarray, levels: int, bucket_size: int,
                 dtype: torch.dtype) -> torch.Tensor:
    """What the decoder returns for signed levels and float32 scales; the encoder uses it too,
    so its reconstruction is bit-identical to a decode."""
    # index instead of np.repeat: a hostile bucket_size must not size an allocation
    scale_of = scales.astype(np.float64)[np.arange(signed.size) // bucket_size]
    value = signed.astype(np.float64) * (scale_of / levels)
    if dtype != torch.float64:
        limit = float(torch.finfo(dtype).max)
        value = np.clip(value, -limit, limit)
    return torch.from_numpy(value).to(dtype)


@register_value_codec
class QSGDANSCodec(ValueCodec):
    """Unbiased stochastic levels with one float32 scale per bucket, ANS-coded."""

    name = "qsgd-ans"
    wire_id = 10
    lossless = False

    def __init__(self, *, levels: int = 7, norm: str = "l2", bucket_size: int = 512,
                 seed: "int | None" = None) -> None:
        if isinstance(levels, bool) or not isinstance(levels, (int, np.integer)) or not 1 <= levels <= MAX_LEVELS:
            raise ValueError(f"levels={levels!r} is not supported; allowed: integers 1..{MAX_LEVELS}")
        check_choice("norm", norm, NORMS)
        if (isinstance(bucket_size, bool) or not isinstance(bucket_size, (int, np.integer))
                or not 1 <= bucket_size < 1 << 32):
            raise ValueError(f"bucket_size={bucket_size!r} is not supported; allowed: integers 1..2**32-1")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0):
            raise ValueError(f"seed={seed!r} is not supported; allowed: None or a non-negative integer")
        self.levels = int(levels)
        self.norm = norm
        self.bucket_size = int(bucket_size)
        self.seed = None if seed is None else int(seed)

    def _quantize(self, values: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """(signed levels int64 in [-s, s], scales float32) for ``values``."""
        v = values.detach().cpu().to(torch.float64).numpy()
        if not np.isfinite(v).all():
            raise ValueError("qsgd-ans cannot encode NaN or Inf values (a bucket scale would be non-finite)")
        if v.size == 0:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
        magnitudes = np.abs(v)
        scales = _scales(magnitudes, self.bucket_size, self.norm)
        if not np.isfinite(scales).all():
            raise ValueError("qsgd-ans: a bucket scale exceeds the float32 range; scale the values down")
        scale_of = scales.astype(np.float64)[np.arange(v.size) // self.bucket_size]
        ratio = np.divide(magnitudes, scale_of, out=np.zeros_like(magnitudes), where=scale_of > 0)
        uniform = np.random.default_rng(self.seed).random(v.size)
        # floor(r + U) is floor(r) + 1 with probability frac(r): unbiased; the clip guards rounding
        level = np.minimum(np.floor(self.levels * ratio + uniform), self.levels).astype(np.int64)
        return np.where(np.signbit(v), -level, level), scales

    def _section(self, signed: np.ndarray, scales: np.ndarray) -> bytes:
        header = (bytes([NORMS.index(self.norm)]) + int(self.levels).to_bytes(2, "little")
                  + int(self.bucket_size).to_bytes(4, "little"))
        return header + scales.astype("<f4").tobytes() + encode_symbols(signed + self.levels, 2 * self.levels + 1)

    def encode(self, values: torch.Tensor) -> bytes:
        return self._section(*self._quantize(values))

    def encode_with_reconstruction(self, values: torch.Tensor) -> tuple[bytes, torch.Tensor]:
        signed, scales = self._quantize(values)
        return self._section(signed, scales), _reconstruct(signed, scales, self.levels, self.bucket_size, values.dtype)

    def decode(self, data: memoryview, count: int, dtype: torch.dtype) -> torch.Tensor:
        require(count >= 0, "negative element count")
        reader = ByteReader(data)
        norm = reader.u8("qsgd-ans norm")
        require(norm < len(NORMS), f"qsgd-ans norm code {norm} is unknown")
        (levels,) = reader.unpack("<H", "qsgd-ans levels")
        require(1 <= levels <= MAX_LEVELS, f"qsgd-ans levels {levels} is not in 1..{MAX_LEVELS}")
        bucket_size = reader.u32("qsgd-ans bucket size")
        require(bucket_size >= 1, "qsgd-ans bucket size is zero")
        buckets = -(-count // bucket_size)
        require(4 * buckets <= reader.remaining, f"qsgd-ans: {buckets} scales do not fit the section")
        scales = np.frombuffer(reader.take(4 * buckets, "qsgd-ans scales"), dtype="<f4")
        require(bool(np.isfinite(scales).all() and (scales >= 0).all()), "qsgd-ans scale is negative or not finite")
        symbols = decode_symbols(reader, count, 2 * levels + 1, "qsgd-ans levels")
        reader.expect_end()
        return _reconstruct(symbols - levels, scales, levels, bucket_size, dtype)
