"""Shared machinery of the curve-fitting value codecs ``polyfit`` and ``dexp`` (DeepReduce).

Both sort the values in descending order, fit a curve of the value against its normalized rank
piece by piece (segments of consecutive ranks), and send the curve parameters plus the sort
permutation. They differ only in the curve (a :class:`CurveModel`): Chebyshev polynomials for
``polyfit``, ``a*exp(p*t) + c*exp(q*t)`` for ``dexp``.

Guaranteed tolerance. With ``T = tolerance * max|v|`` every decoded value is within ``T`` of
its input (error measured in float64 on the decoded values of the input dtype; the contract
test's own measure). The encoder checks each segment on exactly the values the decoder will
produce -- parameters rounded to float32, the same evaluation code, the same power-of-two
rescaling and the same final cast to the dtype -- and every operation in that evaluation is a
correctly rounded IEEE operation on one element (no library ``exp``, see :func:`det_exp`), so
the decoded bytes give the same result on any machine and in any batch. Segments that fail
are split in half and refitted (a loop over refinement rounds, each a batched fit of all
failing segments); a failing segment too short to split is sent raw: float16 (of the rescaled
value) when that meets the tolerance, else float32 (float64 input), else the input's own bytes
(exact). Finally the whole fitted section is compared with sending every value raw (float16 /
float32 / own dtype, the cheapest that meets the tolerance, no permutation needed), and the
smaller one is sent.

The permutation is the honest cost of this family: each value's rank takes ``ceil(log2 k)`` bits
(13 at k = 5,000, 18 at k = 167,772; the floor for any exact code is log2(k!)/k, 10.8 and 15.9
bits), so the fitted layout beats plain float16 only for k <= 2**15. Naming each value's *place
on the curve* only as finely as the tolerance needs is what pays at any k: the **levels** layout
sends every value as the nearest multiple ``q`` of a step just under ``2 T`` (so
``|q * step - v| <= T``, room left for the final rounding), entropy-coded with ANS under the
section's own histogram of ``q`` (:mod:`._ans`) -- the sorted curve's information (where the
values lie, how densely) is exactly that histogram, and a rank is never sent. At the default
tolerance 0.05 it costs about 3 bits per value on gradients at any k, against 16 for float16 and
17-22 bits of ranks alone for k = 2**16 .. 2**22 (``gradwire bench codecs`` prints the rows).
The encoder checks the decoded values like every other layout (a coarser step that fails on some
value, e.g. through the final rounding to bfloat16, is retried at half the step) and sends
whichever layout -- plain, levels or fitted -- is smallest; the codecs' ``level_layout=False``
leaves it out.

Section layout (little-endian)::

    mode      u8         0 = plain, 1 = fitted, 2 = levels
  levels:
    E         i16        values were divided by 2**E, |v / 2**E| < 1
    step      float32    finite, > 0
    Q         u16        largest |q|, 1..32767
    stream    ANS stream (see _ans) of q + Q, alphabet 2Q + 1; decoded: q * step * 2**E
  plain:
    kind      u8         1 = float16, 2 = float32 (both of v / 2**E), 3 = own dtype
    E         i16        power-of-two scale (0 for kind 3)
    values    k x size(kind), original order
  fitted:
    E         i16        values were divided by 2**E, |v / 2**E| < 1
    P         u8         float32 parameters per fitted segment (model-specific)
    S         u32        segment count, 1..k
    lengths   S x bit_width(k) bits (pack_uint), each >= 1, summing to k; segments tile the
                         descending order from rank 0
    kinds     S x 2 bits: 0 = fitted, 1 = float16, 2 = float32, 3 = own dtype
    params    float32 x P per fitted segment, in segment order
    f16       float16 x (total length of kind-1 segments), in rank order
    f32       float32 x (total length of kind-2 segments)
    own       dtype bytes x (total length of kind-3 segments)
    ranks     k x bit_width(k - 1) bits (pack_uint): rank[i] = position of value i in the
                         descending order; must be a permutation of 0..k-1

All packed fields are byte-aligned and padded with zero bits.
"""

from __future__ import annotations

import math
import struct
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ...errors import is_real, require
from ..bits import ByteReader, bit_width, pack_uint, unpack_uint
from ._ans import MAX_ALPHABET, decode_symbols, encode_symbols

MODE_PLAIN, MODE_FITTED, MODE_LEVELS = 0, 1, 2
KIND_FIT, KIND_F16, KIND_F32, KIND_OWN = 0, 1, 2, 3
_FITTED_HEADER = struct.Struct("<BhBI")
_PLAIN_HEADER = struct.Struct("<BBh")
_LEVELS_HEADER = struct.Struct("<BhfH")
_MAX_Q = (MAX_ALPHABET - 1) // 2
#: Largest |E| a section may carry: float64's exponents fit in this with room to spare.
_MAX_EXPONENT = 1100


# --------------------------------------------------------------------------------------------
# Deterministic elementwise evaluation helpers


_INV_LN2 = 1.4426950408889634
# fdlibm's split of ln 2: the high part has 21 trailing zero bits, so n * _LN2_HI is exact
_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10
_EXP_TAYLOR = [1.0 / math.factorial(i) for i in range(14)]


def det_exp(z: np.ndarray) -> np.ndarray:
    """exp(z) in float64 from correctly rounded IEEE operations only.

    numpy's and torch's ``exp`` may take different code paths (SIMD body vs scalar tail,
    CPU features, library versions), which can differ in the last bit; an encoder that checks
    its tolerance needs the decoder's exact bits. Range reduction z = n ln2 + r (|r| <= 0.35)
    then a degree-13 Taylor polynomial (truncation < 1e-17 relative) and an exact ldexp give
    ~1 ulp accuracy and the same bits everywhere.
    """
    z = np.clip(z, -1000.0, 1000.0)  # beyond this exp is 0 or Inf anyway; keeps n small
    n = np.rint(z * _INV_LN2)
    r = (z - n * _LN2_HI) - n * _LN2_LO
    poly = np.full_like(r, _EXP_TAYLOR[13])
    for coefficient in reversed(_EXP_TAYLOR[:13]):
        poly = poly * r + coefficient
    return np.ldexp(poly, n.astype(np.int32))


def finish(scaled: np.ndarray, exponent: int, dtype: torch.dtype) -> torch.Tensor:
    """Undo the power-of-two scale (exact in float64) and round once to ``dtype``."""
    return torch.from_numpy(np.ldexp(scaled, exponent)).to(dtype)


# --------------------------------------------------------------------------------------------
# Curve models


@dataclass
class Batch:
    """Elements of a set of segments, concatenated: element e belongs to segment ``seg[e]``
    (0..S-1, in order), sits at ``j[e]`` (0..n-1) inside it, and the segment has ``n[e]``
    elements. ``offsets`` are the segments' first elements (for ``reduceat``)."""

    seg: np.ndarray
    j: np.ndarray
    n: np.ndarray
    offsets: np.ndarray

    @staticmethod
    def of(lengths: np.ndarray) -> "Batch":
        """The batch of segments of ``lengths`` (each >= 1) laid end to end."""
        lengths = lengths.astype(np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        seg = np.repeat(np.arange(lengths.size), lengths)
        j = (np.arange(seg.size) - offsets[seg]).astype(np.float64)
        return Batch(seg, j, lengths[seg].astype(np.float64), offsets)


class CurveModel(ABC):
    """A curve family: fitted per segment, evaluated per element."""

    #: float32 parameters per fitted segment
    n_params: int

    @abstractmethod
    def fit(self, y: np.ndarray, batch: Batch, segments: int) -> np.ndarray:
        """Least-squares-ish parameters (segments, n_params), float64, for values ``y``."""

    @abstractmethod
    def evaluate(self, params: np.ndarray, batch: Batch) -> np.ndarray:
        """The curve at every element of ``batch`` (float64). ``params``: (S, n_params) float64
        holding float32 values. Must use only correctly rounded elementwise operations so the
        result of an element depends on nothing but its parameters, j and n."""


# --------------------------------------------------------------------------------------------
# Encoder


@dataclass
class _Plan:
    """The encoder's choice for a fitted section, in segment order."""

    lengths: np.ndarray
    kinds: np.ndarray
    params: np.ndarray  # float32 (n_fit, P)


def _raw_bytes(kind: int, dtype: torch.dtype) -> int:
    return {KIND_F16: 2, KIND_F32: 4, KIND_OWN: torch.finfo(dtype).bits // 8}[kind]


def _raw_kinds(dtype: torch.dtype) -> list[int]:
    """Raw formats cheaper than the dtype's own bytes, cheapest first, then the dtype itself."""
    own = torch.finfo(dtype).bits // 8
    return [kind for kind in (KIND_F16, KIND_F32) if _raw_bytes(kind, dtype) < own] + [KIND_OWN]


def _raw_decoded(kind: int, scaled: np.ndarray, exponent: int, values: torch.Tensor) -> torch.Tensor:
    """What the decoder returns for values sent raw as ``kind``."""
    if kind == KIND_OWN:
        return values
    wire = np.float16 if kind == KIND_F16 else np.float32
    return finish(scaled.astype(wire).astype(np.float64), exponent, values.dtype)


def _within(decoded: torch.Tensor, reference: np.ndarray, limit: float) -> np.ndarray:
    """Per element: |decoded - reference| <= limit, measured in float64 (NaN counts as outside)."""
    return np.abs(decoded.double().numpy() - reference) <= limit


def encode_fit(
    values: torch.Tensor, model: CurveModel, tolerance: float, *, allow_plain: bool = True,
    allow_levels: bool = True,
) -> tuple[bytes, torch.Tensor]:
    """Section bytes and exactly what :func:`decode_fit` will return for them.

    Args:
        values: (k,) float16/bfloat16/float32/float64, finite.
        model: the curve family of the fitted layout.
        tolerance: the bound ``|decoded - v| <= tolerance * max|v|``, in (0, 1].
        allow_plain: False forces the fitted layout (for measurements of the fit itself; no
            levels either).
        allow_levels: False leaves the levels layout out of the choice.

    Returns:
        ``(section, decoded)``, ``decoded`` of ``values``' shape and dtype.

    Raises:
        ValueError: ``values`` holds NaN or Inf.
    """
    values = values.detach().cpu().contiguous()
    dtype = values.dtype
    v = values.to(torch.float64).numpy()
    if not np.isfinite(v).all():
        raise ValueError("curve-fitting codecs cannot encode NaN or Inf values")
    k = v.size
    peak = float(np.abs(v).max()) if k else 0.0
    limit = tolerance * peak
    exponent = math.frexp(peak)[1] if peak > 0 else 0
    scaled = np.ldexp(v, -exponent)  # |scaled| < 1: float32 parameters and float16 stay in range

    # plain: every value raw in original order, the cheapest format that meets the tolerance
    plain = None
    for kind in _raw_kinds(dtype):
        decoded = _raw_decoded(kind, scaled, exponent, values)
        if kind == KIND_OWN or _within(decoded, v, limit).all():
            plain = (kind, decoded)
            break
    assert plain is not None
    plain_kind, plain_decoded = plain
    best = None  # (bytes, decoded) of the smaller of plain and levels, when they may be sent
    if allow_plain:
        best = (_plain_section(plain_kind, exponent, scaled, values), plain_decoded)
        levels = _levels_section(scaled, v, exponent, limit, dtype) if allow_levels and k else None
        if levels is not None and len(levels[0]) < len(best[0]):
            best = levels
    rank_width = bit_width(k - 1) if k else 0
    fitted_floor = _FITTED_HEADER.size + (k * rank_width + 7) // 8 + 4 * model.n_params
    if best is not None and (k < 2 or fitted_floor >= len(best[0])):
        return best
    if k == 0:
        return _plain_section(plain_kind, exponent, scaled, values), plain_decoded

    order = np.argsort(-scaled, kind="stable")  # descending
    ranks = np.empty(k, dtype=np.int64)
    ranks[order] = np.arange(k)
    scaled_sorted, values_sorted = scaled[order], values[torch.from_numpy(order)]
    plan, sorted_decoded = _refine(scaled_sorted, v[order], values_sorted, exponent, limit, model)
    data = _fitted_section(plan, exponent, model.n_params, scaled_sorted, values_sorted, ranks)
    if best is not None and len(best[0]) <= len(data):
        return best
    return data, sorted_decoded[torch.from_numpy(ranks)]


def _levels_decoded(q: np.ndarray, step: np.float32, exponent: int, dtype: torch.dtype) -> torch.Tensor:
    """What the decoder returns for levels ``q`` (int64): q * step (one rounding in float64), then
    the power-of-two scale and one rounding to ``dtype`` (see :func:`finish`)."""
    return finish(q.astype(np.float64) * np.float64(step), exponent, dtype)


def _levels_section(scaled: np.ndarray, v: np.ndarray, exponent: int, limit: float,
                    dtype: torch.dtype) -> "tuple[bytes, torch.Tensor] | None":
    """The levels layout if it meets the tolerance (a step of about 2T, else T), else None."""
    half_width = math.ldexp(limit, -exponent)  # T in the units of ``scaled``
    # |q * step - v| <= step / 2 exactly; the final rounding to the dtype may add a unit roundoff
    # of |q * step| < 1 + T: leave room for it, or the rare value at a cell's edge fails the check
    # and the whole section falls back to the half step (measured: 1 in 4M float32 values did)
    roundoff = float(torch.finfo(dtype).eps) / 2 + 2.0**-52
    for step_wanted in (2.0 * (half_width - roundoff * (1.0 + half_width)), half_width):
        step = np.float32(step_wanted)
        if step > step_wanted:
            step = np.nextafter(step, np.float32(0))
        if not (np.isfinite(step) and step > 0):
            continue
        q = np.rint(scaled / np.float64(step)).astype(np.int64)
        largest = max(1, int(np.abs(q).max()))
        if largest > _MAX_Q:
            return None  # a finer step only needs more levels
        decoded = _levels_decoded(q, step, exponent, dtype)
        if _within(decoded, v, limit).all():
            header = _LEVELS_HEADER.pack(MODE_LEVELS, exponent, float(step), largest)
            return header + encode_symbols(q + largest, 2 * largest + 1), decoded
    return None


def _initial_lengths(scaled_sorted: np.ndarray) -> np.ndarray:
    """Positive, zero and negative runs of the descending values: the curve has a kink at 0."""
    positive = int((scaled_sorted > 0).sum())
    negative = int((scaled_sorted < 0).sum())
    lengths = np.array([positive, scaled_sorted.size - positive - negative, negative], dtype=np.int64)
    return lengths[lengths > 0]


def _refine(
    scaled_sorted: np.ndarray,
    v_sorted: np.ndarray,
    values_sorted: torch.Tensor,
    exponent: int,
    limit: float,
    model: CurveModel,
) -> tuple[_Plan, torch.Tensor]:
    """Fit, check, split failing segments, repeat; returns the plan and the decoded (sorted)
    values."""
    k = scaled_sorted.size
    dtype = values_sorted.dtype
    decoded = torch.empty(k, dtype=dtype)
    min_fit = 2 * model.n_params  # shorter segments cost no more raw than their parameters
    fit_starts: list[np.ndarray] = []
    fit_lengths: list[np.ndarray] = []
    fit_params: list[np.ndarray] = []
    raw_starts: list[np.ndarray] = []
    raw_lengths: list[np.ndarray] = []

    lengths = _initial_lengths(scaled_sorted)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    while starts.size:  # one batched refinement round per pass; failing segments halve
        short = lengths < min_fit
        raw_starts.append(starts[short])
        raw_lengths.append(lengths[short])
        starts, lengths = starts[~short], lengths[~short]
        if not starts.size:
            break
        batch = Batch.of(lengths)
        positions = starts[batch.seg] + batch.j.astype(np.int64)
        with np.errstate(all="ignore"):
            params = model.fit(scaled_sorted[positions], batch, lengths.size).astype(np.float32)
        params[~np.isfinite(params).all(axis=1)] = 0  # a failed fit just fails the check below
        with np.errstate(all="ignore"):
            curve = finish(model.evaluate(params.astype(np.float64), batch), exponent, dtype)
        ok_element = _within(curve, v_sorted[positions], limit)
        ok = np.logical_and.reduceat(ok_element, batch.offsets)
        keep = ok[batch.seg]
        decoded[torch.from_numpy(positions[keep])] = curve[torch.from_numpy(keep)]
        fit_starts.append(starts[ok])
        fit_lengths.append(lengths[ok])
        fit_params.append(params[ok])
        # failing segments: halve them when both halves can still be fitted, else send raw
        bad_starts, bad_lengths = starts[~ok], lengths[~ok]
        split = bad_lengths >= 2 * min_fit
        raw_starts.append(bad_starts[~split])
        raw_lengths.append(bad_lengths[~split])
        bad_starts, bad_lengths = bad_starts[split], bad_lengths[split]
        first = bad_lengths // 2
        starts = np.stack([bad_starts, bad_starts + first], axis=1).reshape(-1)
        lengths = np.stack([first, bad_lengths - first], axis=1).reshape(-1)

    # raw segments: the cheapest raw kind that meets the tolerance on the whole segment
    r_starts = np.concatenate(raw_starts) if raw_starts else np.zeros(0, dtype=np.int64)
    r_lengths = np.concatenate(raw_lengths) if raw_lengths else np.zeros(0, dtype=np.int64)
    r_kinds = np.full(r_starts.size, -1, dtype=np.int64)
    if r_starts.size:
        batch = Batch.of(r_lengths)
        positions = r_starts[batch.seg] + batch.j.astype(np.int64)
        for kind in _raw_kinds(dtype):
            candidate = _raw_decoded(kind, scaled_sorted[positions], exponent,
                                     values_sorted[torch.from_numpy(positions)])
            fits = np.logical_and.reduceat(_within(candidate, v_sorted[positions], limit), batch.offsets)
            take = (fits | (kind == KIND_OWN)) & (r_kinds < 0)  # own bytes are exact: always fit
            r_kinds[take] = kind
            element = take[batch.seg]
            decoded[torch.from_numpy(positions[element])] = candidate[torch.from_numpy(element)]

    f_starts = np.concatenate(fit_starts) if fit_starts else np.zeros(0, dtype=np.int64)
    f_lengths = np.concatenate(fit_lengths) if fit_lengths else np.zeros(0, dtype=np.int64)
    f_params = np.concatenate(fit_params) if fit_params else np.zeros((0, model.n_params), np.float32)
    f_params = f_params[np.argsort(f_starts, kind="stable")]
    starts = np.concatenate([f_starts, r_starts])
    order = np.argsort(starts, kind="stable")
    lengths = np.concatenate([f_lengths, r_lengths])[order]
    kinds = np.concatenate([np.full(f_starts.size, KIND_FIT, dtype=np.int64), r_kinds])[order]
    lengths, kinds = _merge_raw(lengths, kinds)
    return _Plan(lengths, kinds, f_params), decoded


def _merge_raw(lengths: np.ndarray, kinds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Join neighbouring raw segments of the same kind (saves their length fields)."""
    if kinds.size < 2:
        return lengths, kinds
    new_group = np.ones(kinds.size, dtype=bool)
    new_group[1:] = (kinds[1:] != kinds[:-1]) | (kinds[1:] == KIND_FIT)
    firsts = np.flatnonzero(new_group)
    return np.add.reduceat(lengths, firsts), kinds[firsts]


def _plain_section(kind: int, exponent: int, scaled: np.ndarray, values: torch.Tensor) -> bytes:
    header = _PLAIN_HEADER.pack(MODE_PLAIN, kind, exponent if kind != KIND_OWN else 0)
    if kind == KIND_OWN:
        return header + (values.view(torch.uint8).numpy().tobytes() if values.numel() else b"")
    return header + scaled.astype("<f2" if kind == KIND_F16 else "<f4").tobytes()


def _fitted_section(
    plan: _Plan,
    exponent: int,
    n_params: int,
    scaled_sorted: np.ndarray,
    values_sorted: torch.Tensor,
    ranks: np.ndarray,
) -> bytes:
    k = scaled_sorted.size
    segment_of = np.repeat(plan.kinds, plan.lengths)  # kind of every sorted element
    own = values_sorted[torch.from_numpy(segment_of == KIND_OWN)].contiguous()
    parts = [
        _FITTED_HEADER.pack(MODE_FITTED, exponent, n_params, plan.lengths.size),
        pack_uint(plan.lengths, bit_width(k)),
        pack_uint(plan.kinds, 2),
        plan.params.astype("<f4").tobytes(),
        scaled_sorted[segment_of == KIND_F16].astype("<f2").tobytes(),
        scaled_sorted[segment_of == KIND_F32].astype("<f4").tobytes(),
        own.view(torch.uint8).numpy().tobytes() if own.numel() else b"",
        pack_uint(ranks, bit_width(k - 1)),
    ]
    return b"".join(parts)


# --------------------------------------------------------------------------------------------
# Decoder


def _take_packed(reader: ByteReader, count: int, width: int, what: str) -> np.ndarray:
    """``count`` integers of ``width`` bits, byte-aligned, zero padding bits required."""
    size = (count * width + 7) // 8
    packed = reader.take(size, what)
    spare = size * 8 - count * width
    require(spare == 0 or packed[-1] >> (8 - spare) == 0, f"{what}: padding bits are not zero")
    return unpack_uint(packed, count, width)


def decode_fit(
    data: memoryview, count: int, dtype: torch.dtype, model_for: "Callable[[int], CurveModel | None]"
) -> torch.Tensor:
    """Decode a section written by :func:`encode_fit`.

    Args:
        data: the section, untrusted.
        count: values to produce, from the payload header.
        dtype: the sender's dtype.
        model_for: ``model_for(P)`` returns the curve model for P parameters per segment, or
            None when P is not one the codec writes.

    Returns:
        (count,) ``dtype``, in the values' original order.

    Raises:
        DecodeError: on bad bytes; the section bounds ``count`` before anything of its size is
            allocated.
    """
    require(count >= 0, "negative element count")
    reader = ByteReader(data)
    mode = reader.u8("mode")
    require(mode in (MODE_PLAIN, MODE_FITTED, MODE_LEVELS), f"unknown mode {mode}")
    own_size = torch.finfo(dtype).bits // 8
    if mode == MODE_PLAIN:
        kind, exponent = reader.unpack("<Bh", "plain header")
        require(kind in (KIND_F16, KIND_F32, KIND_OWN), f"unknown raw kind {kind}")
        require(kind != KIND_OWN or exponent == 0, "scale exponent on own-dtype values")
        require(abs(exponent) <= _MAX_EXPONENT, f"scale exponent {exponent} out of range")
        size = _raw_bytes(kind, dtype)
        require(reader.remaining == count * size,
                f"plain section holds {reader.remaining} bytes, expected {count * size}")
        return _read_raw(reader.rest(), kind, count, exponent, dtype)

    if mode == MODE_LEVELS:
        exponent, step, largest = reader.unpack("<hfH", "levels header")
        require(abs(exponent) <= _MAX_EXPONENT, f"scale exponent {exponent} out of range")
        require(math.isfinite(step) and step > 0, f"level step {step} is not a positive number")
        require(1 <= largest <= _MAX_Q, f"largest level {largest} is not in 1..{_MAX_Q}")
        q = decode_symbols(reader, count, 2 * largest + 1, "levels") - largest
        reader.expect_end()
        with np.errstate(all="ignore"):
            return _levels_decoded(q, np.float32(step), exponent, dtype)

    exponent, n_params, segments = reader.unpack("<hBI", "fitted header")
    require(abs(exponent) <= _MAX_EXPONENT, f"scale exponent {exponent} out of range")
    model = model_for(n_params)
    require(model is not None, f"{n_params} parameters per segment is not a valid model")
    require(1 <= segments <= count, f"{segments} segments for {count} values")
    length_width = bit_width(count)
    rank_width = bit_width(count - 1)
    # the ranks alone need count * rank_width bits: bounds count by the bytes present
    require(reader.remaining * 8 >= count * rank_width + segments * (length_width + 2), "truncated fitted section")
    lengths = _take_packed(reader, segments, length_width, "segment lengths").astype(np.int64)
    require(bool((lengths >= 1).all()) and int(lengths.sum()) == count, "segment lengths do not tile the values")
    kinds = _take_packed(reader, segments, 2, "segment kinds").astype(np.int64)
    n_fit = int((kinds == KIND_FIT).sum())
    total = {kind: int(lengths[kinds == kind].sum()) for kind in (KIND_F16, KIND_F32, KIND_OWN)}
    expected = (
        4 * n_params * n_fit
        + 2 * total[KIND_F16]
        + 4 * total[KIND_F32]
        + own_size * total[KIND_OWN]
        + (count * rank_width + 7) // 8
    )
    require(reader.remaining == expected, f"fitted section body holds {reader.remaining} bytes, expected {expected}")
    params = np.frombuffer(reader.take(4 * n_params * n_fit, "parameters"), dtype="<f4").reshape(n_fit, n_params)
    require(bool(np.isfinite(params).all()), "non-finite curve parameter")
    raw_f16 = reader.take(2 * total[KIND_F16], "float16 values")
    raw_f32 = reader.take(4 * total[KIND_F32], "float32 values")
    raw_own = reader.take(own_size * total[KIND_OWN], "raw values")
    ranks = _take_packed(reader, count, rank_width, "ranks").astype(np.int64)
    require(bool((ranks < count).all()), "rank out of range")
    seen = np.zeros(count, dtype=bool)
    seen[ranks] = True
    require(bool(seen.all()), "ranks are not a permutation")

    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    sorted_values = torch.empty(count, dtype=dtype)
    fitted = kinds == KIND_FIT
    if n_fit:
        batch = Batch.of(lengths[fitted])
        positions = starts[fitted][batch.seg] + batch.j.astype(np.int64)
        with np.errstate(all="ignore"):
            curve = model.evaluate(params.astype(np.float64), batch)
        sorted_values[torch.from_numpy(positions)] = finish(curve, exponent, dtype)
    for kind, raw in ((KIND_F16, raw_f16), (KIND_F32, raw_f32), (KIND_OWN, raw_own)):
        if total[kind]:
            mask = kinds == kind
            batch = Batch.of(lengths[mask])
            positions = starts[mask][batch.seg] + batch.j.astype(np.int64)
            sorted_values[torch.from_numpy(positions)] = _read_raw(raw, kind, total[kind], exponent, dtype)
    return sorted_values[torch.from_numpy(ranks)]


def _read_raw(raw: memoryview, kind: int, count: int, exponent: int, dtype: torch.dtype) -> torch.Tensor:
    if count == 0:
        return torch.zeros(0, dtype=dtype)
    if kind == KIND_OWN:
        return torch.frombuffer(bytearray(raw), dtype=dtype)
    wire = "<f2" if kind == KIND_F16 else "<f4"
    with np.errstate(all="ignore"):
        return finish(np.frombuffer(raw, dtype=wire).astype(np.float64), exponent, dtype)


def check_tolerance(tolerance: float) -> float:
    """Validate the ``tolerance`` option: a real number in (0, 1]."""
    if not is_real(tolerance) or not (
        0 < float(tolerance) <= 1
    ):
        raise ValueError(f"tolerance={tolerance!r} is not supported; "
                         "allowed: a number in (0, 1] (fraction of max|values|)")
    return float(tolerance)


__all__ = ["Batch", "CurveModel", "check_tolerance", "decode_fit", "det_exp", "encode_fit", "finish"]
