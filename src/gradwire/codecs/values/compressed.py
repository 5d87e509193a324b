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

from ...errors import check_flag, check_int, require
from ..base import ValueCodec, register_value_codec
from ..bits import DEFLATE_MAX_RATIO, ZSTD_MAX_RATIO, inflate_exact, zstd_exact

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
        self.level = check_int("level", level, *self.level_range)
        self.shuffle = check_flag("shuffle", shuffle)

    def _compress(self, raw: bytes) -> bytes:
        raise NotImplementedError

    def _decompress(self, stream: memoryview, expected: int) -> bytes:
        """Exactly ``expected`` bytes, or DecodeError; never more than ``expected`` (+1) allocated."""
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
        return _from_bytes(self._decompress(data[1:], expected), count, dtype, bool(flags & _SHUFFLED))


@register_value_codec
class ZstdCodec(_CompressedCodec):
    """Lossless: raw value bytes (byte-shuffled by default) in one Zstandard frame.

    Fresh gradients are nearly incompressible: about 27.6 bits per float32 value on
    ``randn * 1e-3`` with the shuffle (29.6 without). Decoding requires the frame to declare
    exactly ``k * element size`` bytes and that size to be at most ``2**15`` times the stream's
    length, in ``O(k)`` (docs/wire-format.md, "Decode cost bounds").

    Args:
        level: zstd compression level, an int in [1, 22] (default 3): encode time for size.
        shuffle: group the values' byte planes before compressing (default True; see the
            module docstring for why it pays).

    Raises:
        ValueError: ``level`` out of range or ``shuffle`` not a bool.
    """

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
        return zstd_exact(stream, expected, "zstd value section")


@register_value_codec
class DeflateCodec(_CompressedCodec):
    """Lossless: raw value bytes (byte-shuffled by default) in one raw DEFLATE stream.

    About 27.3 bits per float32 value on ``randn * 1e-3`` with the shuffle (29.6 without).
    Decoding refuses ``k * element size`` beyond 1032 times the stream's length and never
    inflates more than that, in ``O(k)`` (docs/wire-format.md, "Decode cost bounds").

    Args:
        level: zlib compression level, an int in [0, 9] (default 6).
        shuffle: group the values' byte planes before compressing (default True).

    Raises:
        ValueError: ``level`` out of range or ``shuffle`` not a bool.
    """

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
        return inflate_exact(stream, expected, "deflate value section")
