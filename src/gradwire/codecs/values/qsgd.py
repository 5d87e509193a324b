"""``qsgd``: b-bit stochastic quantization with per-bucket norms (Alistarh et al., QSGD).

The k values are cut into buckets of ``bucket_size`` consecutive values. Within a bucket of
L2 norm ``n``, each value v is sent as a sign and a level ``l`` in ``0..s`` with
``s = 2**(bits - 1) - 1``; with ``r = s * |v| / n``, ``l`` is ``floor(r)`` or ``floor(r) + 1``,
the latter with probability ``r - floor(r)``, so E[l] = r and the decoded ``sign * l * n / s``
is an unbiased estimate of v. Randomness comes from ``numpy.random.default_rng(seed)``:
``seed=None`` draws fresh randomness on every call; an integer seed makes encoding
reproducible.

Section layout (little-endian)::

    bits         u8                         2..8
    bucket_size  u32                        >= 1
    norms        float32 x ceil(k / bucket_size)   finite, >= 0; each the bucket's L2 norm
                                            rounded *up* to float32, so every |v| <= norm
    codes        ceil(k * bits / 8) bytes   pack_uint, ``bits`` bits per value:
                                            level in the low bits - 1 bits, sign in the top bit

Cost: ``bits`` bits per value plus 32 bits per bucket (4.06 bits/value at bits=4, bucket 512).
Encode and decode are a few vectorized passes over the values.

Error bound, per element of a bucket with stored norm ``n`` (within 2**-23 of the true L2
norm)::

    |decoded - v| <= n / s + u * n + tiny

where ``u`` is the unit roundoff of the values' dtype (2**-24 float32, 2**-11 float16, 2**-8
bfloat16, 2**-53 float64: the reconstruction, computed in float64, is rounded once to that
dtype) and ``tiny`` is half the dtype's smallest subnormal. Unbiasedness holds before that
final rounding. A float16/bfloat16 reconstruction whose magnitude would overflow the dtype is
clamped to its largest finite value (only possible when a bucket's norm exceeds the dtype's
range), which only moves it closer to v.

Non-finite input (NaN, +-Inf) raises ValueError: a norm of Inf or NaN would poison its whole
bucket. So do values whose bucket norm does not fit float32 (float64 input beyond ~3e38).
"""

from __future__ import annotations

import numpy as np
import torch

from ...errors import check_int, require
from ..base import ValueCodec, register_value_codec
from ..bits import ByteReader, pack_uint, unpack_uint

_HEADER_BYTES = 5


def _bucket_norms(magnitudes: np.ndarray, bucket_size: int) -> np.ndarray:
    """L2 norm of each bucket (float64), scaled by its max so float64 input cannot overflow."""
    starts = np.arange(0, magnitudes.size, bucket_size)
    peak = np.maximum.reduceat(magnitudes, starts)
    safe_peak = np.where(peak > 0, peak, 1.0)
    scaled = magnitudes / np.repeat(safe_peak, np.diff(np.append(starts, magnitudes.size)))
    return peak * np.sqrt(np.add.reduceat(scaled * scaled, starts))


def _round_up_f32(norms: np.ndarray) -> np.ndarray:
    """Smallest float32 >= each norm, so |v| <= stored norm and levels never exceed s."""
    with np.errstate(over="ignore"):  # overflow to Inf is reported by the caller
        stored = norms.astype(np.float32)
    low = stored.astype(np.float64) < norms
    stored[low] = np.nextafter(stored[low], np.float32(np.inf))
    return stored


def _reconstruct(codes: np.ndarray, norms: np.ndarray, bits: int, bucket_size: int, dtype: torch.dtype) -> torch.Tensor:
    """What the decoder returns for ``codes`` and float32 ``norms``; the encoder uses it too,
    so its reconstruction is bit-identical to a decode."""
    s = (1 << (bits - 1)) - 1
    levels = (codes & np.uint64(s)).astype(np.float64)
    negative = (codes >> np.uint64(bits - 1)).astype(bool)
    # index instead of np.repeat: a hostile bucket_size must not size an allocation
    norm_of = norms.astype(np.float64)[np.arange(codes.size) // bucket_size]
    magnitude = levels * (norm_of / s)
    if dtype != torch.float64:
        # a norm above the dtype's range (large float16 buckets) would round to Inf
        magnitude = np.minimum(magnitude, float(torch.finfo(dtype).max))
    # np.where keeps -0.0 for a zero level of a negative value
    return torch.from_numpy(np.where(negative, -magnitude, magnitude)).to(dtype)


@register_value_codec
class QSGDCodec(ValueCodec):
    """Unbiased b-bit stochastic quantization with one float32 norm per bucket; lossy.

    ``bits + 32 / bucket_size`` bits per value (4.06 at the defaults). Each value decodes to an
    unbiased estimate within ``n / s`` of it, ``n`` its bucket's L2 norm and
    ``s = 2**(bits - 1) - 1`` (plus rounding terms: module docstring). Every value takes at
    least 2 bits, so ``k <= 4 B`` and decoding is ``O(k)`` (docs/wire-format.md, "Decode cost
    bounds").

    Args:
        bits: bits per value including the sign, an int in [2, 8] (default 4): ``2**(bits-1) - 1``
            levels per sign.
        bucket_size: values per float32 norm, an int in [1, 2**32 - 1] (default 512). Smaller
            buckets cost more norms and err less.
        seed: None (default: fresh randomness on every call) or a non-negative int, which makes
            encoding reproducible. The decoder needs no seed.

    Raises:
        ValueError: an option out of range. ``encode`` also raises it for NaN/Inf values and for
            a bucket norm beyond float32's range.
    """

    name = "qsgd"
    wire_id = 6
    lossless = False

    def __init__(self, *, bits: int = 4, bucket_size: int = 512, seed: "int | None" = None) -> None:
        self.bits = check_int("bits", bits, 2, 8)
        self.bucket_size = check_int("bucket_size", bucket_size, 1, (1 << 32) - 1)
        self.seed = check_int("seed", seed, 0, optional=True)

    def _quantize(self, values: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """(codes uint64, norms float32) for ``values``."""
        v = values.detach().cpu().to(torch.float64).numpy()
        if not np.isfinite(v).all():
            raise ValueError("qsgd cannot encode NaN or Inf values (a bucket norm would be non-finite)")
        if v.size == 0:
            return np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.float32)
        magnitudes = np.abs(v)
        norms = _round_up_f32(_bucket_norms(magnitudes, self.bucket_size))
        if not np.isfinite(norms).all():
            raise ValueError("qsgd: a bucket norm exceeds the float32 range; scale the values down")
        s = (1 << (self.bits - 1)) - 1
        norm_of = norms.astype(np.float64)[np.arange(v.size) // self.bucket_size]
        ratio = np.divide(magnitudes, norm_of, out=np.zeros_like(magnitudes), where=norm_of > 0)
        scaled = s * ratio
        uniform = np.random.default_rng(self.seed).random(v.size)
        # floor(r + U) is floor(r) + 1 with probability frac(r): unbiased; clip guards rounding
        levels = np.minimum(np.floor(scaled + uniform), s).astype(np.uint64)
        codes = levels | (np.signbit(v).astype(np.uint64) << np.uint64(self.bits - 1))
        return codes, norms

    def _section(self, codes: np.ndarray, norms: np.ndarray) -> bytes:
        header = bytes([self.bits]) + int(self.bucket_size).to_bytes(4, "little")
        return header + norms.astype("<f4").tobytes() + pack_uint(codes, self.bits)

    def encode(self, values: torch.Tensor) -> bytes:
        codes, norms = self._quantize(values)
        return self._section(codes, norms)

    def encode_with_reconstruction(self, values: torch.Tensor) -> tuple[bytes, torch.Tensor]:
        codes, norms = self._quantize(values)
        return self._section(codes, norms), _reconstruct(codes, norms, self.bits, self.bucket_size, values.dtype)

    def decode(self, data: memoryview, count: int, dtype: torch.dtype) -> torch.Tensor:
        reader = ByteReader(data)
        bits = reader.u8("qsgd bits")
        require(2 <= bits <= 8, f"qsgd bits {bits} is not in 2..8")
        bucket_size = reader.u32("qsgd bucket size")
        require(bucket_size >= 1, "qsgd bucket size is zero")
        require(count >= 0, "negative element count")
        buckets = -(-count // bucket_size)
        code_bytes = -(-count * bits // 8)
        # checked before anything of size count is allocated
        require(
            reader.remaining == 4 * buckets + code_bytes,
            f"qsgd section has {reader.remaining + _HEADER_BYTES} bytes, "
            f"expected {_HEADER_BYTES + 4 * buckets + code_bytes}",
        )
        norms = np.frombuffer(reader.take(4 * buckets, "qsgd norms"), dtype="<f4")
        require(bool(np.isfinite(norms).all() and (norms >= 0).all()), "qsgd norm is negative or not finite")
        packed = reader.take(code_bytes, "qsgd codes")
        spare = code_bytes * 8 - count * bits
        require(spare == 0 or packed[-1] >> (8 - spare) == 0, "qsgd padding bits are not zero")
        codes = unpack_uint(packed, count, bits)
        return _reconstruct(codes, norms, bits, bucket_size, dtype)
