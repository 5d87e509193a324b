"""``rice``: Golomb-Rice code of the gaps, remainders and quotients in two separate streams.

Each gap ``g`` (first position, then difference minus one) splits into ``g >> b`` (unary: that
many zero bits, then a one) and ``g & (2**b - 1)`` (``b`` bits). Section::

    b            u8, 0..40
    remainders   k * b bits packed (bits.pack_uint layout), ceil(k * b / 8) bytes
    quotients    bits.pack_unary stream of the k quotients, to the end of the section

Cost: ``b + 1 + mean(g >> b)`` bits per index. Keeping the two streams apart makes decoding a
handful of whole-array passes. By default ``b`` is the cheapest of the three candidates around
``log2(ln 2 * mean gap)``, sized exactly; for uniformly random positions this lands within about
1.5% of the information bound ``log2 C(n, k)`` from 0.1% to 10% density.
"""

from __future__ import annotations

import math

import numpy as np

from ... import kernels
from ...errors import check_int, require
from ..base import IndexCodec, IndexEncoding, register_index_codec
from ..bits import pack_unary, unpack_unary
from ._bitstream import (
    MAX_POSITION_BITS,
    gaps_of,
    positions_from_gaps,
    read_fixed,
    require_count,
    require_zero_padding,
    write_fixed,
)


def rice_size_bits(gaps: np.ndarray, parameter: int) -> int:
    """Exact coded size of ``gaps`` with Rice parameter ``parameter``, in bits."""
    return int(np.sum(gaps >> parameter)) + gaps.size * (parameter + 1)


def best_parameter(gaps: np.ndarray) -> int:
    """The cheapest parameter near the optimum for geometric gaps of the same mean."""
    if gaps.size == 0:
        return 0
    return min(parameter_candidates(float(gaps.mean())), key=lambda b: rice_size_bits(gaps, b))


def parameter_candidates(mean: float) -> list[int]:
    """The parameters worth sizing for gaps of this mean, ascending and consecutive."""
    # For geometric gaps of mean m the best Rice parameter is about log2(ln 2 * m); the exact sizes
    # of its neighbours settle the rounding (three cheap passes).
    guess = int(math.floor(math.log2(max(mean * math.log(2), 1.0))))
    return [b for b in (guess - 1, guess, guess + 1) if 0 <= b <= MAX_POSITION_BITS]


def max_rice_bytes(most: int, numel: int, parameter: "int | None" = None) -> int:
    """The most bytes a Rice section of at most ``most`` positions in ``[0, numel)`` takes.

    With ``c`` positions the gaps sum to ``S <= numel - c``, and a parameter ``b`` costs
    ``c (b + 1) + sum(g >> b) <= c (b + 1) + S / 2**b`` bits, growing with ``S``. A fixed ``b``:
    take ``S = numel - c``. The chosen ``b`` is the cheapest of the candidates around the guess
    ``G(S) = floor(log2(max(ln 2 * S / c, 1)))``, which grows with ``S``; ``G*`` is the guess
    for ``S = numel - c``. Where ``G(S) = G*``, the candidates are those of ``S = numel - c``: at
    most the cheapest of them there. Where ``G(S) < G*``, ``G(S) + 1`` is one, and
    ``S / 2**(G(S) + 1) < c / ln 2`` by the guess's definition: at most ``c (G* + 1) + c / ln 2``.
    About 8% above a section of uniformly random positions at 10% density. Bytes add the
    parameter byte and each stream's rounding; the maximum is over every ``c <= most`` (the
    bound is not monotone in ``c``).

    Args:
        most: the largest count, ``0 <= most <= numel``.
        numel: the dense size.
        parameter: the codec's fixed ``b``, or None for the chosen one.

    Returns:
        Bytes.
    """
    counts = np.arange(1, min(int(most), int(numel)) + 1, dtype=np.float64)
    if counts.size == 0:
        return 1
    spare = float(numel) - counts
    if parameter is not None:
        bits = counts * (parameter + 1) + np.floor(spare / 2.0**parameter)
    else:
        top = _guesses(spare, counts)
        at_top = np.full(counts.size, np.inf)
        for shift in (-1, 0, 1):
            b = top + shift
            cost = counts * (b + 1) + np.floor(spare / 2.0**b)
            at_top = np.where((b >= 0) & (b <= MAX_POSITION_BITS), np.minimum(at_top, cost), at_top)
        lower = np.where(top >= 1, counts * (top + 1) + np.ceil(counts / math.log(2) * (1 + 1e-9)) + 1, 0.0)
        bits = np.maximum(at_top, lower)
    return int(np.max(np.ceil(bits / 8))) + 3  # the parameter byte, one rounding per stream


def _guesses(spare: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The codec's guess (:func:`parameter_candidates`) for gaps summing to ``spare`` over
    ``counts`` positions, bit for bit: numpy's ``log2`` may differ from ``math.log2`` by an ulp,
    so the values within 1e-9 of an integer are recomputed as the codec computes them."""
    logs = np.log2(np.maximum(spare / counts * math.log(2), 1.0))
    guesses = np.floor(logs)
    for i in np.flatnonzero(np.abs(logs - np.round(logs)) < 1e-9):
        guesses[i] = math.floor(math.log2(max(float(spare[i]) / float(counts[i]) * math.log(2), 1.0)))
    return guesses


@register_index_codec
class RiceIndexCodec(IndexCodec):
    """Lossless: Golomb-Rice code of the gaps, within about 1.5% of ``log2 C(n, k)``.

    Each gap ``g`` costs ``b + 1 + (g >> b)`` bits: its ``b`` low bits as they are, the rest in
    unary. The best ``b`` is about ``log2(ln 2 * mean gap)``; for uniformly random positions the
    code then lands within about 1.5% of the information bound from 0.1% to 10% density (about
    8.1 bits per index at 1%). Every index ends its unary code with a one bit, so ``k <= 8 B``
    and decoding is a handful of whole-array passes, ``O(B + k)`` (docs/wire-format.md, "Decode
    cost bounds").

    Args:
        parameter: the Rice parameter ``b``, an int in [0, 40]: how many low bits of every gap
            are sent verbatim. None (the default) picks it per call from the data: the cheapest
            of the three candidates around ``log2(ln 2 * mean gap)``, each sized exactly (three
            extra passes over the gaps, cheap next to the encoding). A fixed ``b`` saves those
            passes but pays wherever the gaps do not fit it: up to one bit per index for every
            bit ``b`` is too large, and a unary quotient that grows as ``mean gap / 2**b`` where it
            is too small. It travels in the section (one byte), so the decoder needs no option.

    Raises:
        ValueError: ``parameter`` is neither None nor an int in [0, 40].
    """

    name = "rice"
    wire_id = 7

    def __init__(self, *, parameter: "int | None" = None) -> None:
        self.parameter = check_int("parameter", parameter, 0, MAX_POSITION_BITS, optional=True)

    def encode(self, indices: np.ndarray, numel: int) -> IndexEncoding:
        if indices.size and indices.dtype == np.int64 and indices.flags.c_contiguous and kernels.available():
            return IndexEncoding(self._encode_native(indices), indices)
        gaps = gaps_of(indices)
        parameter = best_parameter(gaps) if self.parameter is None else self.parameter
        remainders = write_fixed(gaps & ((1 << parameter) - 1), parameter)
        quotients, _ = pack_unary(gaps >> parameter)
        return IndexEncoding(bytes([parameter]) + remainders + quotients, indices)

    def _encode_native(self, indices: np.ndarray) -> bytes:
        """:meth:`encode`'s bytes in two native passes (the candidates' sizes, then the section)."""
        count = indices.size
        total_gaps = int(indices[-1]) - (count - 1)  # the gaps sum to the last index minus the others
        if self.parameter is not None:
            candidates = [self.parameter]
        else:
            candidates = parameter_candidates(total_gaps / count)
        shifted = kernels.rice_shifted_sums(indices, candidates[0], len(candidates))
        sizes = [int(s) + count * (b + 1) for b, s in zip(candidates, shifted)]
        best = min(range(len(candidates)), key=sizes.__getitem__)  # the first of equal sizes, as min()
        return kernels.rice_section(indices, candidates[best], int(shifted[best]) + count)

    def max_section_bytes(self, most: int, numel: int) -> int:
        """See :meth:`IndexCodec.max_section_bytes`: :func:`max_rice_bytes`."""
        return max_rice_bytes(most, numel, self.parameter)

    def decode(self, data: memoryview, numel: int, count: int) -> np.ndarray:
        require_count(numel, count)
        require(len(data) >= 1, "rice section is empty")
        buffer = np.frombuffer(data, dtype=np.uint8)
        parameter = int(buffer[0])
        require(parameter <= MAX_POSITION_BITS, f"rice parameter {parameter} exceeds {MAX_POSITION_BITS}")
        remainder_bytes = (count * parameter + 7) // 8
        # One unary terminator per index bounds count by the data before anything is allocated.
        require(
            len(data) >= 1 + remainder_bytes + (count + 7) // 8,
            f"{len(data)} bytes cannot hold {count} Rice codes",
        )
        unary = buffer[1 + remainder_bytes :]
        if count == 0:
            require(unary.size == 0, "trailing bytes after an empty set")
            return np.zeros(0, dtype=np.int64)
        quotients = unpack_unary(unary, count)
        unary_bits = int(quotients.sum()) + count
        require(unary.size == (unary_bits + 7) // 8, "trailing bytes after the quotients")
        require_zero_padding(unary, unary_bits, "quotient stream")
        require_zero_padding(buffer[1 : 1 + remainder_bytes], count * parameter, "remainder stream")
        require(int(quotients.max()) <= (numel - 1) >> parameter, "gap exceeds the tensor size")
        remainders = read_fixed(buffer[1 : 1 + remainder_bytes], count, parameter)
        gaps = (quotients << parameter) | remainders.astype(np.int64)
        return positions_from_gaps(gaps, numel)
