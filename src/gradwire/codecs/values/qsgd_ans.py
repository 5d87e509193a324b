"""``qsgd-ans``: QSGD's unbiased stochastic levels, entropy-coded (ANS) instead of fixed-width.

Quantization is QSGD's (see :mod:`.qsgd`): the k values are cut into buckets of
``bucket_size``; in a bucket each magnitude is placed on ``s + 1`` levels (``s = levels``)
evenly spaced from ``low`` to ``high`` and rounded to one of its two neighbouring levels,
the upper one with probability equal to its fractional position (``rounding="stochastic"``:
E[decoded] = v, unbiased) or to the nearest (``rounding="nearest"``: half the error, biased --
for use with error feedback, which absorbs a bias but not a variance larger than the signal).
``norm`` sets the level range: ``"l2"`` (QSGD's: 0 to the bucket's L2 norm; with s = 7 these
are exactly the levels of ``qsgd bits=4``), ``"max"`` (0 to the largest magnitude: finer levels
for the same s) or ``"range"`` (the smallest to the largest magnitude: for top-k selections,
whose magnitudes all lie far from 0, levels=1 sends each value as +-(its bucket's min or max)).
Randomness as in ``qsgd`` (``seed``).

The levels are far from uniformly used -- with the L2 norm most values fall in level 0 or 1 --
so instead of ``1 + log2(s + 1)`` bits each, the signed levels (2s + 1 symbols, as a zero level
carries no sign; 2s + 2 under ``range``) are entropy-coded with ANS under the section's own
count table (:mod:`._ans`). On N(0, 1) values, bucket 512, this sends qsgd-4's exact levels in
about 1.13 bits per value instead of 4.06 (``gradwire bench codecs`` prints the measured table).

Section layout (little-endian)::

    norm         u8                        0 = l2, 1 = max, 2 = range (rounding is not sent)
    s            u16                       levels, 1..MAX_LEVELS
    bucket_size  u32                       >= 1
    lows         float32 x B (range only)  each bucket's min |v| rounded *down* to float32
    highs        float32 x B               B = ceil(k / bucket_size); finite, >= low; rounded
                                           *up* to float32, so every |v| <= its bucket's high
    stream       the ANS stream (see _ans) of sign * l + s (alphabet 2s + 1), or under
                 range l + (s + 1) * negative (alphabet 2s + 2)

Error bound, per element of a bucket with stored ``low`` (0 unless range) and ``high``::

    |decoded - v| <= (high - low) / s + u * high + tiny        (half the first term if nearest)

with ``u`` and ``tiny`` as in ``qsgd`` (the reconstruction, computed in float64, is rounded
once to the values' dtype; float16/bfloat16 results beyond the dtype's range are clamped).

Non-finite input raises ValueError (a non-finite scale would poison its bucket).
"""

from __future__ import annotations

import numpy as np
import torch

from ...errors import check_choice, check_int, require
from ..base import ValueCodec, register_value_codec
from ..bits import ByteReader
from ._ans import decode_symbols, encode_symbols
from .qsgd import _bucket_norms, _round_up_f32

MAX_LEVELS = 1 << 14
NORMS = ("l2", "max", "range")
ROUNDINGS = ("stochastic", "nearest")


def _round_down_f32(values: np.ndarray) -> np.ndarray:
    """Largest float32 <= each value (>= 0)."""
    stored = values.astype(np.float32)
    high = stored.astype(np.float64) > values
    stored[high] = np.nextafter(stored[high], np.float32(0))
    return stored


def _scales(magnitudes: np.ndarray, bucket_size: int, norm: str) -> tuple[np.ndarray, np.ndarray]:
    """(low, high) float32 per bucket: levels run from low (0 unless ``range``) to high."""
    starts = np.arange(0, magnitudes.size, bucket_size)
    if norm == "l2":
        high = _round_up_f32(_bucket_norms(magnitudes, bucket_size))
    else:
        high = _round_up_f32(np.maximum.reduceat(magnitudes, starts))
    if norm == "range":
        return _round_down_f32(np.minimum.reduceat(magnitudes, starts)), high
    return np.zeros(starts.size, dtype=np.float32), high


def _alphabet(levels: int, norm: str) -> int:
    # a zero level carries no sign, except under ``range``, where level 0 is the magnitude low
    return 2 * levels + 2 if norm == "range" else 2 * levels + 1


def _to_symbols(signed: np.ndarray, negative: np.ndarray, levels: int, norm: str) -> np.ndarray:
    if norm == "range":
        return np.abs(signed) + (levels + 1) * negative
    return signed + levels


def _from_symbols(symbols: np.ndarray, levels: int, norm: str) -> tuple[np.ndarray, np.ndarray]:
    """(level magnitudes, negative) of decoded symbols."""
    if norm == "range":
        negative = symbols > levels
        return np.where(negative, symbols - levels - 1, symbols), negative
    signed = symbols - levels
    return np.abs(signed), signed < 0


def _per_element(per_bucket: np.ndarray, count: int, bucket_size: int) -> np.ndarray:
    """Each bucket's value repeated over its elements (float64, shape (count,)). The counts are
    capped by ``count``, so a hostile ``bucket_size`` cannot size an allocation."""
    repeats = np.full(per_bucket.size, min(bucket_size, count), dtype=np.int64)
    if per_bucket.size:
        repeats[-1] = count - bucket_size * (per_bucket.size - 1)
    return np.repeat(per_bucket.astype(np.float64), repeats)


def _to_dtype(value: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """One rounding of float64 ``value`` to ``dtype`` (numpy's casts for float32/float16: torch's
    multi-threaded ``to`` was slower under load than the arithmetic)."""
    if dtype == torch.float64:
        return torch.from_numpy(value)
    if dtype in (torch.float32, torch.float16):
        return torch.from_numpy(value.astype(np.float32 if dtype == torch.float32 else np.float16))
    return torch.from_numpy(value).to(dtype)


def _reconstruct(level: np.ndarray, negative: np.ndarray, low: np.ndarray, high: np.ndarray, levels: int,
                 bucket_size: int, dtype: torch.dtype) -> torch.Tensor:
    """What the decoder returns for levels, signs and float32 scales; the encoder uses it too,
    so its reconstruction is bit-identical to a decode."""
    count = level.size
    step = _per_element((high.astype(np.float64) - low) / levels, count, bucket_size)
    magnitude = level * step
    if low.any():
        magnitude += _per_element(low, count, bucket_size)
    if dtype != torch.float64:
        np.minimum(magnitude, float(torch.finfo(dtype).max), out=magnitude)
    np.negative(magnitude, out=magnitude, where=negative)
    return _to_dtype(magnitude, dtype)


@register_value_codec
class QSGDANSCodec(ValueCodec):
    """QSGD's stochastic levels with one float32 scale per bucket, ANS-coded; lossy.

    The levels are far from uniformly used, so entropy coding sends ``qsgd bits=4``'s exact
    levels (``levels=7``, ``norm="l2"``) in about 1.13 bits per value on N(0, 1) instead of 4.06;
    the error bound per element is ``(high - low) / levels`` plus rounding (module docstring).
    Decoding checks the symbol count against the ANS stream's length first (at most
    ``96 * 32`` symbols per 32-bit word, docs/wire-format.md), then is ``O(B + k)``.

    Args:
        levels: ``s``, the steps between a bucket's lowest and highest level (``s + 1`` levels),
            an int in [1, 16384] (default 7).
        norm: the level range per bucket: ``"l2"`` (default; 0 to the L2 norm, QSGD's),
            ``"max"`` (0 to the largest magnitude: finer levels for the same ``s``) or ``"range"``
            (smallest to largest magnitude; suits top-k selections, whose magnitudes lie far
            from 0).
        bucket_size: values per scale, an int in [1, 2**32 - 1] (default 512).
        rounding: ``"stochastic"`` (default; unbiased) or ``"nearest"`` (half the error but
            biased: for use with error feedback, which absorbs a bias but not a variance larger
            than the signal). Not sent: the decoder does not need it.
        seed: None (default: fresh randomness on every call) or a non-negative int, which makes
            stochastic rounding reproducible.

    Raises:
        ValueError: an option out of range. ``encode`` also raises it for NaN/Inf values and for
            a bucket scale beyond float32's range.
    """

    name = "qsgd-ans"
    wire_id = 10
    lossless = False

    def __init__(self, *, levels: int = 7, norm: str = "l2", bucket_size: int = 512, rounding: str = "stochastic",
                 seed: "int | None" = None) -> None:
        self.levels = check_int("levels", levels, 1, MAX_LEVELS)
        check_choice("norm", norm, NORMS)
        check_choice("rounding", rounding, ROUNDINGS)
        self.norm = norm
        self.rounding = rounding
        self.bucket_size = check_int("bucket_size", bucket_size, 1, (1 << 32) - 1)
        self.seed = check_int("seed", seed, 0, optional=True)

    def _quantize(self, values: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(levels int64 in [0, s], negative bool, low float32, high float32) for ``values``."""
        v = values.detach().cpu()
        v = v.numpy() if v.dtype in (torch.float32, torch.float64, torch.float16) else v.float().numpy()
        v = v.astype(np.float64)
        if not np.isfinite(v).all():
            raise ValueError("qsgd-ans cannot encode NaN or Inf values (a bucket scale would be non-finite)")
        if v.size == 0:
            empty = np.zeros(0, dtype=np.float32)
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool), empty, empty
        magnitudes = np.abs(v)
        low, high = _scales(magnitudes, self.bucket_size, self.norm)
        if not np.isfinite(high).all():
            raise ValueError("qsgd-ans: a bucket scale exceeds the float32 range; scale the values down")
        width = _per_element(high.astype(np.float64) - low, v.size, self.bucket_size)
        scaled = magnitudes
        if low.any():
            scaled = magnitudes - _per_element(low, v.size, self.bucket_size)
        # levels * |v| / width, 0 where a bucket is all one magnitude
        np.divide(scaled * self.levels, width, out=scaled, where=width > 0)
        scaled[width <= 0] = 0.0
        if self.rounding == "stochastic":
            # floor(r + U) is floor(r) + 1 with probability frac(r): unbiased
            scaled += np.random.default_rng(self.seed).random(v.size)
        else:
            scaled += 0.5  # nearest level: half the error bound, biased (error feedback absorbs it)
        # the clip guards rounding at the ends
        level = np.clip(np.floor(scaled), 0, self.levels).astype(np.int64)
        negative = np.signbit(v) & ((level > 0) | (self.norm == "range"))
        return level, negative, low, high

    def _section(self, level: np.ndarray, negative: np.ndarray, low: np.ndarray, high: np.ndarray) -> bytes:
        header = (bytes([NORMS.index(self.norm)]) + int(self.levels).to_bytes(2, "little")
                  + int(self.bucket_size).to_bytes(4, "little"))
        signed = np.where(negative, -level, level)
        lows = low.astype("<f4").tobytes() if self.norm == "range" else b""
        symbols = _to_symbols(signed, negative, self.levels, self.norm)
        return header + lows + high.astype("<f4").tobytes() + encode_symbols(symbols, _alphabet(self.levels, self.norm))

    def encode(self, values: torch.Tensor) -> bytes:
        return self._section(*self._quantize(values))

    def encode_with_reconstruction(self, values: torch.Tensor) -> tuple[bytes, torch.Tensor]:
        level, negative, low, high = self._quantize(values)
        decoded = _reconstruct(level, negative, low, high, self.levels, self.bucket_size, values.dtype)
        return self._section(level, negative, low, high), decoded

    def decode(self, data: memoryview, count: int, dtype: torch.dtype) -> torch.Tensor:
        require(count >= 0, "negative element count")
        reader = ByteReader(data)
        norm = reader.u8("qsgd-ans norm")
        require(norm < len(NORMS), f"qsgd-ans norm code {norm} is unknown")
        (levels,) = reader.unpack("<H", "qsgd-ans levels")
        require(1 <= levels <= MAX_LEVELS, f"qsgd-ans levels {levels} is not in 1..{MAX_LEVELS}")
        bucket_size = reader.u32("qsgd-ans bucket size")
        require(bucket_size >= 1, "qsgd-ans bucket size is zero")
        norm_name = NORMS[norm]
        buckets = -(-count // bucket_size)
        arrays = 2 if norm_name == "range" else 1
        require(4 * arrays * buckets <= reader.remaining, f"qsgd-ans: {buckets} scales do not fit the section")
        low = (np.frombuffer(reader.take(4 * buckets, "qsgd-ans lows"), dtype="<f4") if norm_name == "range"
               else np.zeros(buckets, dtype=np.float32))
        high = np.frombuffer(reader.take(4 * buckets, "qsgd-ans scales"), dtype="<f4")
        require(bool(np.isfinite(high).all() and (low >= 0).all() and (high >= low).all()),
                "qsgd-ans scales are negative, not finite or not ordered")
        symbols = decode_symbols(reader, count, _alphabet(levels, norm_name), "qsgd-ans levels")
        reader.expect_end()
        level, negative = _from_symbols(symbols, levels, norm_name)
        return _reconstruct(level, negative, low, high, levels, bucket_size, dtype)
