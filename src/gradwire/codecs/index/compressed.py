"""``zstd`` and ``deflate``: the raw index bytes through a general-purpose compressor.

Section::

    width        u8: 4, or 8 when numel > 2**32
    compressed   the k indices as little-endian uint32 (uint64) through zstd (one frame, with
                 its content size) or raw deflate (RFC 1951, no zlib header)

Cost: whatever the compressor finds. Ascending positions share their high bytes, but neither
compressor sees the gaps: for random positions at n = 2**24 zstd spends about 25 bits per index
and deflate about 16 at 1% density (11.5-27 from 10% to 0.1%) — a baseline that shows what a
dedicated gap code buys, not a good code. Decoding knows the exact output size (``count * width``) before it
inflates anything and refuses both sections that claim more output than their compressor could
produce from their size and streams that do not produce exactly that many bytes.
"""

from __future__ import annotations

import zlib

import numpy as np
import zstandard

from ...errors import DecodeError, is_integer, require
from ...sparse import strictly_ascending
from ..base import IndexCodec, IndexEncoding, register_index_codec
from ..bits import DEFLATE_MAX_RATIO, ZSTD_MAX_RATIO, ByteReader
from ._bitstream import require_count



def _index_width(numel: int) -> int:
    return 4 if numel <= 1 << 32 else 8


def _index_bytes(indices: np.ndarray, numel: int) -> tuple[int, bytes]:
    width = _index_width(numel)
    return width, indices.astype(f"<u{width}").tobytes()


def _check_level(level: object, low: int, high: int) -> int:
    if not is_integer(level) or not low <= level <= high:
        raise ValueError(f"level={level!r} is not supported; allowed: an int in [{low}, {high}]")
    return int(level)


def _split_section(data: memoryview, numel: int, count: int, max_ratio: int) -> tuple[int, memoryview, int]:
    """(width, compressed bytes, expected decompressed size), refusing impossible ratios up front."""
    require_count(numel, count)
    reader = ByteReader(data)
    width = reader.u8("index width")
    require(width == _index_width(numel), f"index width {width} does not match numel {numel}")
    compressed = reader.rest()
    expected = count * width
    require(
        expected <= max_ratio * len(compressed),
        f"{len(compressed)} compressed bytes cannot hold {count} indices",
    )
    return width, compressed, expected


def _positions(raw: bytes, width: int, numel: int) -> np.ndarray:
    positions = np.frombuffer(raw, dtype=f"<u{width}").astype(np.int64)
    if positions.size:
        require(int(positions[-1]) < numel, "index exceeds the tensor size")
        # The raw bytes carry no structure; ascending order must be checked, not assumed.
        require(strictly_ascending(positions), "indices are not strictly ascending")
    return positions


@register_index_codec
class ZstdIndexCodec(IndexCodec):
    name = "zstd"
    wire_id = 8

    def __init__(self, *, level: int = 3) -> None:
        self.level = _check_level(level, 1, zstandard.MAX_COMPRESSION_LEVEL)

    def encode(self, indices: np.ndarray, numel: int) -> IndexEncoding:
        width, raw = _index_bytes(indices, numel)
        compressed = zstandard.ZstdCompressor(level=self.level, write_content_size=True).compress(raw)
        return IndexEncoding(bytes([width]) + compressed, indices)

    def decode(self, data: memoryview, numel: int, count: int) -> np.ndarray:
        width, compressed, expected = _split_section(data, numel, count, ZSTD_MAX_RATIO)
        try:
            # decompress() allocates whatever the frame header claims, so check the claim first.
            claimed = zstandard.frame_content_size(compressed)
            require(claimed == expected, f"zstd frame holds {claimed} bytes, expected {expected}")
            raw = zstandard.ZstdDecompressor().decompress(compressed, max_output_size=expected, allow_extra_data=False)
        except zstandard.ZstdError as error:
            raise DecodeError(f"malformed zstd frame: {error}") from error
        require(len(raw) == expected, f"zstd frame produced {len(raw)} bytes, expected {expected}")
        return _positions(raw, width, numel)


@register_index_codec
class DeflateIndexCodec(IndexCodec):
    name = "deflate"
    wire_id = 9

    def __init__(self, *, level: int = 6) -> None:
        self.level = _check_level(level, 0, 9)

    def encode(self, indices: np.ndarray, numel: int) -> IndexEncoding:
        width, raw = _index_bytes(indices, numel)
        compressor = zlib.compressobj(self.level, zlib.DEFLATED, -zlib.MAX_WBITS)
        return IndexEncoding(bytes([width]) + compressor.compress(raw) + compressor.flush(), indices)

    def decode(self, data: memoryview, numel: int, count: int) -> np.ndarray:
        width, compressed, expected = _split_section(data, numel, count, DEFLATE_MAX_RATIO)
        decompressor = zlib.decompressobj(-zlib.MAX_WBITS)
        try:
            # One byte past the expected size is enough to tell a longer stream; never inflate more.
            raw = decompressor.decompress(compressed, expected + 1)
        except zlib.error as error:
            raise DecodeError(f"malformed deflate stream: {error}") from error
        require(len(raw) == expected, f"deflate stream produced {len(raw)}+ bytes, expected {expected}")
        require(decompressor.eof, "deflate stream is truncated")
        require(not decompressor.unused_data and not decompressor.unconsumed_tail,
                "trailing bytes after the deflate stream")
        return _positions(raw, width, numel)
