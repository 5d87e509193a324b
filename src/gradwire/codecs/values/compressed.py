"""``zstd`` and ``deflate``: the values' raw bytes, losslessly compressed.

The values are sent bit for bit in their own dtype (NaN payloads, signed zeros and infinities
included), optionally byte-shuffled, then compressed with Zstandard or raw DEFLATE (zlib,
``wbits=-15``: no zlib header or Adler-32, the payload already carries a checksum).

Section layout::

    flags   u8      bit 0: byte-shuffled; the other bits must be zero
    stream  bytes   zstd frame (content size in its header) or raw DEFLATE stream;
                    empty when there are no values

Byte shuffle: the k values, viewed as a (k, element size) byte matrix, are sent transposed --
every value's byte 0, then every value's byte 1, ... -- so the sign/exponent bytes, which
repeat a lot across a gradient, sit next to each other and the near-random low mantissa bytes
stop breaking up the compressor's matches. Measured on k = 167,772 float32 values
(randn * 1e-3): zstd-3 goes from 29.6 to 27.6 bits/value, DEFLATE-6 from 29.6 to 27.3;
heavy-tailed (randn**3) 30.7 -> 28.6; bfloat16 12.4 -> 11.5. Fresh gradients are close to
incompressible either way -- the shuffle is what makes a lossless compressor worth its time.
It costs one transpose each way and is on by default (option ``shuffle``).

Cost: encode and decode are linear in k; compression level trades encode time for size.
Decompression is bounded by the size the header implies (count * element size), and that size
by the stream's own length times the compressor's largest ratio (2**15 for zstd, 1032 for
DEFLATE): zstd frames must declare exactly that content size and may not be followed by extra
bytes; DEFLATE output is capped at that many bytes, so a decompression bomb raises DecodeError
instead of allocating.
"""

from __future__ import annotations

import zlib
from typing import ClassVar

import numpy as np
import torch
import zstandard

from ...errors import DecodeError, is_integer, require
from ..base import ValueCodec, register_value_codec
from ..bits import DEFLATE_MAX_RATIO, ZSTD_MAX_RATIO

_SHUFFLED = 0x01


def _element_size(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits // 8


def _to_bytes(values: torch.Tensor, shuffle: bool) -> bytes:
    """The values' bytes in their own dtype, byte planes grouped when ``shuffle``."""
    raw = values.contiguous().view(torch.uint8).numpy()
    if shuffle and values.element_size() > 1:
        raw = raw.reshape(-1, values.element_size()).T
    return np.ascontiguousarray(raw).tobytes()


def _from_bytes(raw: bytes, count: int, dtype: torch.dtype, shuffle: bool) -> torch.Tensor:
    """Inverse of :func:`_to_bytes`; ``len(raw) == count * element size`` is already checked."""
    size = _element_size(dtype)
    planes = np.frombuffer(raw, dtype=np.uint8)
    if shuffle and size > 1:
        planes = planes.reshape(size, count).T
    # copy: the tensor must own writable memory, not alias the decompressor's bytes
    return torch.from_numpy(np.ascontiguousarray(planes).reshape(-1).copy()).view(dtype)


class _CompressedCodec(ValueCodec):
    """Shared section handling; subclasses supply the compressor and its level range."""

    level_range: ClassVar[tuple[int, int]]
    #: Most output bytes the compressor can produce per stream byte (see codecs/bits.py).
    max_ratio: ClassVar[int]

    def __init__(self, *, level: int, shuffle: bool = True) -> None:
        low, high = self.level_range
        if not is_integer(level) or not low <= level <= high:
            raise ValueError(f"level={level!r} is not supported by {self.name}; allowed: integers {low}..{high}")
        if not isinstance(shuffle, bool):
            raise ValueError(f"shuffle={shuffle!r} is not supported; allowed: True, False")
        self.level = int(level)
        self.shuffle = shuffle

    def _compress(self, raw: bytes) -> bytes:
        raise NotImplementedError

    def _decompress(self, stream: memoryview, expected: int) -> bytes:
        """Exactly ``expected`` bytes, or DecodeError; never more than ``expected`` allocated."""
        raise NotImplementedError

    def encode(self, values: torch.Tensor) -> bytes:
        flags = _SHUFFLED if self.shuffle else 0
        if values.numel() == 0:
            return bytes([flags])
        return bytes([flags]) + self._compress(_to_bytes(values, self.shuffle))

    def decode(self, data: memoryview, count: int, dtype: torch.dtype) -> torch.Tensor:
        data = memoryview(data).cast("B")
        require(len(data) >= 1, f"{self.name} section is empty")
        flags = data[0]
        require(flags & ~_SHUFFLED == 0, f"{self.name}: unknown flags {flags:#x}")
        require(count >= 0, "negative element count")
        if count == 0:
            require(len(data) == 1, f"{self.name}: {len(data) - 1} stream bytes for zero values")
            return torch.zeros(0, dtype=dtype)
        expected = count * _element_size(dtype)
        # No compressor yields more than max_ratio bytes per input byte: a section claiming more
        # is refused before its frame header (which sizes the output buffer) is even read.
        require(expected <= self.max_ratio * (len(data) - 1),
                f"{self.name}: {len(data) - 1} stream bytes cannot hold {count} values")
        raw = self._decompress(data[1:], expected)
        require(len(raw) == expected, f"{self.name}: decompressed {len(raw)} bytes, expected {expected}")
        return _from_bytes(raw, count, dtype, bool(flags & _SHUFFLED))


@register_value_codec
class ZstdCodec(_CompressedCodec):
    """Lossless: raw value bytes (byte-shuffled by default) in one Zstandard frame."""

    name = "zstd"
    wire_id = 4
    level_range = (1, 22)
    max_ratio = ZSTD_MAX_RATIO

    def __init__(self, *, level: int = 3, shuffle: bool = True) -> None:
        super().__init__(level=level, shuffle=shuffle)

    def _compress(self, raw: bytes) -> bytes:
        # the frame records its content size; the decoder insists on it
        return zstandard.ZstdCompressor(level=self.level, write_content_size=True).compress(raw)

    def _decompress(self, stream: memoryview, expected: int) -> bytes:
        try:
            declared = zstandard.frame_content_size(stream)
        except zstandard.ZstdError as error:
            raise DecodeError(f"zstd: bad frame header: {error}") from error
        # decompress() allocates the declared content size, so check it before anything else
        require(declared == expected, f"zstd frame declares {declared} bytes, expected {expected}")
        try:
            return zstandard.ZstdDecompressor().decompress(stream, max_output_size=expected, allow_extra_data=False)
        except zstandard.ZstdError as error:
            raise DecodeError(f"zstd: {error}") from error


@register_value_codec
class DeflateCodec(_CompressedCodec):
    """Lossless: raw value bytes (byte-shuffled by default) in one raw DEFLATE stream."""

    name = "deflate"
    wire_id = 5
    level_range = (0, 9)
    max_ratio = DEFLATE_MAX_RATIO

    def __init__(self, *, level: int = 6, shuffle: bool = True) -> None:
        super().__init__(level=level, shuffle=shuffle)

    def _compress(self, raw: bytes) -> bytes:
        compressor = zlib.compressobj(self.level, zlib.DEFLATED, -15)
        return compressor.compress(raw) + compressor.flush()

    def _decompress(self, stream: memoryview, expected: int) -> bytes:
        decompressor = zlib.decompressobj(-15)
        try:
            # max_length caps the output (a bomb stops at expected bytes); expected > 0 here,
            # since max_length=0 would mean "unbounded"
            raw = decompressor.decompress(stream, expected)
            if not decompressor.eof:
                # the end-of-stream code may sit after the last output byte: consume it, and
                # anything that would produce one more byte is too long
                extra = decompressor.decompress(decompressor.unconsumed_tail, 1)
                require(not extra, f"deflate stream holds more than {expected} bytes")
        except zlib.error as error:
            raise DecodeError(f"deflate: {error}") from error
        require(decompressor.eof, "deflate stream is truncated")
        require(not decompressor.unused_data and not decompressor.unconsumed_tail, "bytes after the deflate stream")
        return raw
