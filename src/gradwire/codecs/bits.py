"""Vectorized bit-level building blocks shared by the codecs.

Every function works on whole numpy arrays: no Python loop runs per element. Bit order is
little-endian throughout: bit 0 of the first value is bit 0 of the first byte.

Decoders take their sizes from a length they were given and check it against the bytes they
hold *before* allocating, so hostile lengths raise :class:`~gradwire.errors.DecodeError`
instead of allocating gigabytes.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np
import zstandard

from .. import kernels
from ..errors import DecodeError, require

#: Largest dense tensor a payload may describe (elements). Bounds every allocation a decoder makes.
MAX_NUMEL = 1 << 40

#: Most bytes a zstd frame yields per frame byte: a block of up to 128 KiB costs at least 4
#: bytes (3-byte header + 1 RLE byte). Decoders refuse sections that claim more.
ZSTD_MAX_RATIO = 1 << 15
#: Deflate's ceiling: a length/distance pair of >= 2 bits yields at most 258 bytes.
DEFLATE_MAX_RATIO = 1032


def zstd_exact(stream: "bytes | memoryview", expected: int, what: str) -> bytes:
    """Decompress one zstd frame that must hold exactly ``expected`` bytes, never allocating more.

    ``decompress()`` sizes its output by the frame header's content size, so that claim is
    checked against ``expected`` before anything is decompressed; the callers have already
    bounded ``expected`` by ``ZSTD_MAX_RATIO`` times the stream's length.

    Args:
        stream: the frame, untrusted; nothing may follow it.
        expected: the exact decompressed size the payload header implies, in bytes.
        what: names the section in error messages.

    Returns:
        The ``expected`` bytes.

    Raises:
        DecodeError: a malformed frame, a content size other than ``expected`` (or none), or
            trailing bytes.
    """
    try:
        declared = zstandard.frame_content_size(stream)
    except zstandard.ZstdError as error:
        raise DecodeError(f"{what}: bad zstd frame header: {error}") from error
    require(declared == expected, f"{what}: zstd frame declares {declared} bytes, expected {expected}")
    try:
        raw = zstandard.ZstdDecompressor().decompress(stream, max_output_size=expected, allow_extra_data=False)
    except zstandard.ZstdError as error:
        raise DecodeError(f"{what}: malformed zstd frame: {error}") from error
    require(len(raw) == expected, f"{what}: zstd frame produced {len(raw)} bytes, expected {expected}")
    return raw


def inflate_exact(stream: "bytes | memoryview", expected: int, what: str) -> bytes:
    """Inflate one raw DEFLATE stream (RFC 1951) that must hold exactly ``expected`` bytes.

    The output is capped at ``expected + 1`` bytes: one byte more than expected tells a longer
    stream (a decompression bomb stops there), and nothing larger is ever allocated.

    Args:
        stream: the stream, untrusted; nothing may follow it.
        expected: the exact inflated size the payload header implies, in bytes.
        what: names the section in error messages.

    Returns:
        The ``expected`` bytes.

    Raises:
        DecodeError: a malformed, truncated, longer or shorter stream, or trailing bytes.
    """
    decompressor = zlib.decompressobj(-zlib.MAX_WBITS)
    try:
        raw = decompressor.decompress(stream, expected + 1)
    except zlib.error as error:
        raise DecodeError(f"{what}: malformed deflate stream: {error}") from error
    require(len(raw) <= expected, f"{what}: deflate stream holds more than {expected} bytes")
    require(len(raw) == expected, f"{what}: deflate stream produced {len(raw)} bytes, expected {expected}")
    require(decompressor.eof, f"{what}: deflate stream is truncated")
    require(not decompressor.unused_data and not decompressor.unconsumed_tail,
            f"{what}: trailing bytes after the deflate stream")
    return raw


def bit_width(max_value: int) -> int:
    """Bits needed to write every integer in ``[0, max_value]`` (0 for ``max_value == 0``)."""
    return int(max_value).bit_length()


def pack_uint(values: np.ndarray, width: int) -> bytes:
    """Pack non-negative integers of ``width`` bits each into bytes, LSB first.

    Args:
        values: integer array (flattened), every element < 2**width (not checked).
        width: bits per value, 0 <= width <= 64.

    Returns:
        ``ceil(len(values) * width / 8)`` bytes, the padding bits zero.

    Raises:
        ValueError: ``width`` out of range.
    """
    if not 0 <= width <= 64:
        raise ValueError(f"width={width} is not in [0, 64]")
    values = np.ascontiguousarray(values).astype(np.uint64, copy=False).reshape(-1)
    if width == 0 or values.size == 0:
        return b""
    if width in (8, 16, 32, 64):
        return values.astype(f"<u{width // 8}").tobytes()
    byte_width = (width + 7) // 8
    as_bytes = values.astype("<u8").view(np.uint8).reshape(-1, 8)[:, :byte_width]
    bits = np.unpackbits(as_bytes, axis=1, bitorder="little")[:, :width]
    return np.packbits(bits.reshape(-1), bitorder="little").tobytes()


def unpack_uint(data: "bytes | memoryview | np.ndarray", count: int, width: int) -> np.ndarray:
    """Inverse of :func:`pack_uint`: ``count`` integers of ``width`` bits.

    Args:
        data: the packed bytes, untrusted (bytes beyond the ``count * width`` bits are ignored).
        count: values to read.
        width: bits per value, 0 <= width <= 64.

    Returns:
        (count,) uint64.

    Raises:
        DecodeError: ``data`` holds fewer than ``count * width`` bits, or a bad ``count``/``width``.
    """
    require(0 <= width <= 64, f"bit width {width} is not in [0, 64]")
    require(count >= 0, "negative element count")
    buf = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
    need_bits = count * width
    require(buf.size * 8 >= need_bits, f"need {need_bits} bits, have {buf.size * 8}")
    if width == 0 or count == 0:
        return np.zeros(count, dtype=np.uint64)
    if width in (8, 16, 32, 64):
        return buf[: count * width // 8].view(f"<u{width // 8}").astype(np.uint64)
    bits = np.unpackbits(buf[: (need_bits + 7) // 8], count=need_bits, bitorder="little")
    bits = bits.reshape(count, width)
    byte_width = (width + 7) // 8
    padded = np.zeros((count, byte_width * 8), dtype=np.uint8)
    padded[:, :width] = bits
    packed = np.packbits(padded, axis=1, bitorder="little")
    out = np.zeros((count, 8), dtype=np.uint8)
    out[:, :byte_width] = packed
    return out.view("<u8").reshape(-1).astype(np.uint64, copy=False)


def pack_unary(quotients: np.ndarray) -> tuple[bytes, int]:
    """Unary code: each q becomes q zero bits then a one bit. Returns (bytes, total bits)."""
    quotients = np.asarray(quotients, dtype=np.int64).reshape(-1)
    if quotients.size == 0:
        return b"", 0
    ones = np.cumsum(quotients + 1) - 1
    total = int(ones[-1]) + 1
    bits = np.zeros(total, dtype=np.uint8)
    bits[ones] = 1
    return np.packbits(bits, bitorder="little").tobytes(), total


def unpack_unary(data: "bytes | memoryview", count: int) -> np.ndarray:
    """Inverse of :func:`pack_unary`: the first ``count`` quotients (int64)."""
    require(count >= 0, "negative element count")
    if count == 0:
        return np.zeros(0, dtype=np.int64)
    buf = np.frombuffer(data, dtype=np.uint8)
    require(buf.size * 8 >= count, f"unary stream of {buf.size} bytes cannot hold {count} codes")
    if kernels.available():  # one pass, a step per one bit (the numpy path unpacks every bit)
        quotients = kernels.unary_quotients(buf, count)
        require(quotients is not None, f"unary stream holds fewer than {count} codes")
        return quotients
    ones = np.flatnonzero(np.unpackbits(buf, bitorder="little"))
    require(ones.size >= count, f"unary stream holds {ones.size} codes, expected {count}")
    ones = ones[:count]
    quotients = np.empty(count, dtype=np.int64)
    quotients[0] = ones[0]
    quotients[1:] = np.diff(ones) - 1
    return quotients


def encode_varint(values: np.ndarray) -> bytes:
    """LEB128: 7 bits per byte, high bit set on every byte but a value's last."""
    values = np.asarray(values).astype(np.uint64, copy=False).reshape(-1)
    if values.size == 0:
        return b""
    # bytes per value: 1 for < 2^7, 2 for < 2^14, ... 10 for the full 64 bits
    widths = np.maximum(1, (_bit_lengths(values) + 6) // 7)
    max_width = int(widths.max())
    shifts = np.arange(max_width, dtype=np.uint64) * np.uint64(7)
    groups = ((values[:, None] >> shifts) & np.uint64(0x7F)).astype(np.uint8)
    columns = np.arange(max_width)
    groups[columns[None, :] < (widths[:, None] - 1)] |= 0x80
    return groups[columns[None, :] < widths[:, None]].tobytes()


def decode_varint(data: "bytes | memoryview", count: int) -> np.ndarray:
    """Inverse of :func:`encode_varint`: exactly ``count`` values, using every byte of ``data``."""
    require(count >= 0, "negative element count")
    buf = np.frombuffer(data, dtype=np.uint8)
    if count == 0:
        require(buf.size == 0, "trailing bytes after varints")
        return np.zeros(0, dtype=np.uint64)
    require(buf.size >= count, f"{buf.size} bytes cannot hold {count} varints")
    ends = np.flatnonzero(buf < 0x80)
    require(ends.size == count, f"found {ends.size} varints, expected {count}")
    require(int(ends[-1]) == buf.size - 1, "trailing bytes after varints")
    starts = np.empty(count, dtype=np.int64)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    lengths = ends - starts + 1
    require(int(lengths.max()) <= 10, "varint longer than 10 bytes")
    group_of_byte = np.repeat(np.arange(count), lengths)
    position = np.arange(buf.size) - starts[group_of_byte]
    contrib = (buf & 0x7F).astype(np.uint64) << (position.astype(np.uint64) * np.uint64(7))
    return np.bitwise_or.reduceat(contrib, starts)


def _bit_lengths(values: np.ndarray) -> np.ndarray:
    """Bit length of each uint64 (0 for 0), vectorized."""
    values = values.astype(np.uint64, copy=False)
    lengths = np.zeros(values.shape, dtype=np.int64)
    remaining = values.copy()
    for step in (32, 16, 8, 4, 2, 1):  # binary search over 6 steps, not a per-element loop
        big = remaining >= (np.uint64(1) << np.uint64(step))
        lengths[big] += step
        remaining[big] >>= np.uint64(step)
    lengths += (remaining > 0).astype(np.int64)
    return lengths


bit_lengths = _bit_lengths


class ByteReader:
    """A bounds-checked cursor over bytes; every read past the end raises DecodeError."""

    def __init__(self, data: "bytes | memoryview") -> None:
        self.view = memoryview(data).cast("B")
        self.offset = 0

    @property
    def remaining(self) -> int:
        """Bytes not read yet."""
        return len(self.view) - self.offset

    def take(self, size: int, what: str = "field") -> memoryview:
        """The next ``size`` bytes (a view, no copy); DecodeError naming ``what`` if fewer remain."""
        require(0 <= size <= self.remaining, f"truncated: {what} needs {size} bytes, {self.remaining} left")
        out = self.view[self.offset : self.offset + size]
        self.offset += size
        return out

    def unpack(self, fmt: str, what: str = "field") -> tuple:
        """``struct.unpack(fmt, ...)`` of the next bytes; the readers below are its one-field forms."""
        size = struct.calcsize(fmt)
        return struct.unpack(fmt, self.take(size, what))

    def u8(self, what: str = "u8") -> int:
        return self.unpack("<B", what)[0]

    def u32(self, what: str = "u32") -> int:
        return self.unpack("<I", what)[0]

    def u64(self, what: str = "u64") -> int:
        return self.unpack("<Q", what)[0]

    def f64(self, what: str = "f64") -> float:
        return self.unpack("<d", what)[0]

    def rest(self) -> memoryview:
        """Every byte not read yet."""
        return self.take(self.remaining, "rest")

    def expect_end(self) -> None:
        """DecodeError unless every byte was read."""
        require(self.remaining == 0, f"{self.remaining} trailing bytes")


__all__ = [
    "DEFLATE_MAX_RATIO",
    "MAX_NUMEL",
    "ZSTD_MAX_RATIO",
    "ByteReader",
    "DecodeError",
    "bit_lengths",
    "bit_width",
    "decode_varint",
    "encode_varint",
    "inflate_exact",
    "pack_unary",
    "pack_uint",
    "unpack_unary",
    "unpack_uint",
    "zstd_exact",
]
