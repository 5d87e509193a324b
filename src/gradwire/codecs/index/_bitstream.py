"""Private helpers shared by the lossless index codecs: gaps, variable-width bit fields, varints.

Bit order matches :mod:`gradwire.codecs.bits`: little-endian, bit 0 of the first field is bit 0
of the first byte, each field written least significant bit first.

A *gap* is the first position, then each difference between neighbours minus one, so every gap
is >= 0 and the gaps of ``k`` positions in ``[0, n)`` sum to at most ``n - k``.
"""

from __future__ import annotations

import numpy as np

from ...errors import DecodeError, require
from ..bits import ByteReader, encode_varint

#: Positions below 2**40 need at most this many bits; the decoders reject wider fields.
MAX_POSITION_BITS = 40


def require_count(numel: int, count: int) -> None:
    """DecodeError unless the header's ``count`` is in ``[0, numel]``."""
    require(0 <= count <= numel, f"count {count} is not in [0, numel={numel}]")


def require_zero_padding(buffer: np.ndarray, used_bits: int, what: str) -> None:
    """The bits after ``used_bits`` in the last byte of ``buffer`` (``ceil(used_bits / 8)`` bytes) are zero.

    Encoders leave them zero; checking it catches a section decoded with the wrong count, which
    would otherwise often end inside the same last byte.
    """
    if used_bits % 8:
        require(int(buffer[used_bits // 8]) >> (used_bits % 8) == 0, f"{what}: padding bits are set")


def gaps_of(indices: np.ndarray) -> np.ndarray:
    """Strictly ascending positions -> gaps (int64, >= 0)."""
    gaps = np.empty(indices.size, dtype=np.int64)
    if indices.size:
        gaps[0] = indices[0]
        np.subtract(indices[1:], indices[:-1], out=gaps[1:])
        gaps[1:] -= 1
    return gaps


def exact_sum(values: np.ndarray) -> int:
    """Sum of non-negative integers below 2**41 without int64 overflow, for any count below 2**40."""
    values = values.astype(np.uint64, copy=False)
    high = int(np.sum(values >> np.uint64(20), dtype=np.uint64))
    low = int(np.sum(values & np.uint64((1 << 20) - 1), dtype=np.uint64))
    return (high << 20) + low


def positions_from_gaps(gaps: np.ndarray, numel: int) -> np.ndarray:
    """Inverse of :func:`gaps_of` for untrusted gaps; DecodeError unless all positions are < numel."""
    if gaps.size == 0:
        return np.zeros(0, dtype=np.int64)
    require(int(gaps.max()) < numel, "gap exceeds the tensor size")
    steps = gaps.astype(np.int64)
    steps += 1
    # Each step is <= 2**40, so fewer than 2**22 of them cannot overflow int64 on the way.
    if steps.size >= 1 << 22:
        require(exact_sum(steps) <= numel, "positions run past the tensor size")
    positions = np.cumsum(steps, out=steps)
    positions -= 1
    require(int(positions[-1]) < numel, "positions run past the tensor size")
    return positions


def bit_lengths(values: np.ndarray) -> np.ndarray:
    """Bit length of each non-negative integer below 2**53 (0 for 0), as int64."""
    # float64 holds these exactly and frexp's exponent is the bit length: one pass, no loop.
    _, exponents = np.frexp(values.astype(np.float64))
    return exponents.astype(np.int64)


def field_offsets(widths: np.ndarray) -> tuple[np.ndarray, int]:
    """Start bit of each field laid end to end, and the total bit count."""
    ends = np.cumsum(widths, dtype=np.int64)
    total = int(ends[-1]) if ends.size else 0
    ends -= widths
    return ends, total


def write_fixed(values: np.ndarray, width: int) -> bytes:
    """Pack each value in ``width`` bits (<= 57), end to end: the same bytes as bits.pack_uint.

    Eight fields of ``width`` bits fill exactly ``width`` bytes, so each group of eight is built
    in a few uint64 words with one whole-array pass per lane and then cut to its ``width`` bytes.
    """
    values = np.ascontiguousarray(values).astype(np.uint64, copy=False).reshape(-1)
    if width == 0 or values.size == 0:
        return b""
    groups = (values.size + 7) // 8
    lanes = np.zeros(groups * 8, dtype=np.uint64)
    lanes[: values.size] = values
    lanes = lanes.reshape(groups, 8)
    words = np.zeros((groups, (8 * width + 63) // 64), dtype="<u8")
    for lane in range(8):
        word, shift = divmod(lane * width, 64)
        words[:, word] |= lanes[:, lane] << np.uint64(shift)
        if shift + width > 64:
            words[:, word + 1] |= lanes[:, lane] >> np.uint64(64 - shift)
    packed = words.view(np.uint8)[:, :width]
    return packed.tobytes()[: (values.size * width + 7) // 8]


def read_fixed(buffer: np.ndarray, count: int, width: int) -> np.ndarray:
    """Inverse of :func:`write_fixed`: ``count`` fields of ``width`` bits (<= 57) as uint64.

    The caller checks that ``buffer`` holds ``ceil(count * width / 8)`` bytes.
    """
    if width == 0 or count == 0:
        return np.zeros(count, dtype=np.uint64)
    groups = (count + 7) // 8
    used = (count * width + 7) // 8
    words = np.zeros((groups, (8 * width + 63) // 64), dtype="<u8")
    as_bytes = words.view(np.uint8)
    flat = np.zeros(groups * width, dtype=np.uint8)
    flat[:used] = buffer[:used]
    as_bytes[:, :width] = flat.reshape(groups, width)
    lanes = np.empty((groups, 8), dtype=np.uint64)
    mask = np.uint64((1 << width) - 1)
    for lane in range(8):
        word, shift = divmod(lane * width, 64)
        field = words[:, word] >> np.uint64(shift)
        if shift + width > 64:
            field |= words[:, word + 1] << np.uint64(64 - shift)
        lanes[:, lane] = field & mask
    return lanes.reshape(-1)[:count]


def write_fields(values: np.ndarray, widths: np.ndarray) -> bytes:
    """Pack ``values[i]`` in ``widths[i]`` bits (<= 57 each), end to end, into ``ceil(total / 8)`` bytes.

    Every value must be below ``2**width``.
    """
    values = np.ascontiguousarray(values).astype(np.uint64, copy=False).reshape(-1)
    widths = np.asarray(widths, dtype=np.int64)
    offsets, total = field_offsets(widths)
    if total == 0:
        return b""
    words = np.zeros((total + 63) // 64 + 1, dtype=np.uint64)
    word = offsets >> 6
    shift = (offsets & 63).astype(np.uint64)
    # Fields starting in the same word are OR-ed together; word indices ascend, so reduceat groups them.
    first = np.flatnonzero(np.diff(word, prepend=-1))
    words[word[first]] = np.bitwise_or.reduceat(values << shift, first)
    # A field crossing a word boundary puts its high bits in the next word; at most one does per word.
    spill = np.flatnonzero(shift.astype(np.int64) + widths > 64)
    if spill.size:
        words[word[spill] + 1] |= values[spill] >> (np.uint64(64) - shift[spill])
    return words.astype("<u8", copy=False).tobytes()[: (total + 7) // 8]


def read_fields(buffer: np.ndarray, offsets: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """The fields at bit ``offsets`` of ``widths`` bits (<= 57) from ``buffer`` (uint8), as uint64.

    The caller checks that every field ends within ``buffer``.
    """
    padded = np.zeros(buffer.size + 8, dtype=np.uint8)
    padded[: buffer.size] = buffer
    # An overlapping view: element i is the little-endian 8 bytes starting at byte i.
    windows = np.ndarray((buffer.size + 1,), dtype="<u8", buffer=padded, strides=(1,))
    values = windows[offsets >> 3] >> (offsets & 7).astype(np.uint64)
    values &= (np.uint64(1) << widths.astype(np.uint64)) - np.uint64(1)
    return values


def varint_bytes(value: int) -> bytes:
    """One non-negative int as LEB128 (a header field)."""
    return encode_varint(np.array([value], dtype=np.uint64))


def read_varint(reader: ByteReader, what: str) -> int:
    """One LEB128 value from ``reader`` (a header field, so a scalar loop of at most 10 bytes)."""
    value = 0
    for shift in range(0, 70, 7):
        byte = reader.u8(what)
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value
    raise DecodeError(f"{what}: varint longer than 10 bytes")
