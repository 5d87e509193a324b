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

from ...errors import check_int, require
from ...sparse import strictly_ascending
from ..base import IndexCodec, IndexEncoding, register_index_codec
from ..bits import DEFLATE_MAX_RATIO, ZSTD_MAX_RATIO, ByteReader, inflate_exact, zstd_exact
from ._bitstream import require_count



def _index_width(numel: int) -> int:
    return 4 if numel <= 1 << 32 else 8


def _index_bytes(indices: np.ndarray, numel: int) -> tuple[int, bytes]:
    width = _index_width(numel)
    return width, indices.astype(f"<u{width}").tobytes()


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
    """Lossless baseline: the raw uint32 (uint64) indices in one Zstandard frame.

    Shows what a dedicated gap code buys rather than being one: about 25 bits per index for
    random positions at 1% density (n = 2**24). Decoding requires the frame to declare exactly
    ``count * width`` bytes and that ``width * k <= 2**15 B`` (zstd's largest ratio) before it
    decompresses, in ``O(k)`` (docs/wire-format.md, "Decode cost bounds").

    Args:
        level: zstd compression level, an int in [1, 22] (default 3): encode time for size.

    Raises:
        ValueError: ``level`` out of range.
    """

    name = "zstd"
    wire_id = 8

    def __init__(self, *, level: int = 3) -> None:
        self.level = check_int("level", level, 1, zstandard.MAX_COMPRESSION_LEVEL)

    def encode(self, indices: np.ndarray, numel: int) -> IndexEncoding:
        width, raw = _index_bytes(indices, numel)
        compressed = zstandard.ZstdCompressor(level=self.level, write_content_size=True).compress(raw)
        return IndexEncoding(bytes([width]) + compressed, indices)

    def decode(self, data: memoryview, numel: int, count: int) -> np.ndarray:
        width, compressed, expected = _split_section(data, numel, count, ZSTD_MAX_RATIO)
        return _positions(zstd_exact(compressed, expected, "zstd index section"), width, numel)


@register_index_codec
class DeflateIndexCodec(IndexCodec):
    """Lossless baseline: the raw uint32 (uint64) indices in one raw DEFLATE stream.

    About 16 bits per index for random positions at 1% density (11.5-27 from 10% to 0.1%, n =
    2**24). Decoding refuses ``width * k > 1032 B`` (DEFLATE's largest ratio) and never
    inflates more than ``count * width + 1`` bytes, in ``O(k)`` (docs/wire-format.md, "Decode
    cost bounds").

    Args:
        level: zlib compression level, an int in [0, 9] (default 6).

    Raises:
        ValueError: ``level`` out of range.
    """

    name = "deflate"
    wire_id = 9

    def __init__(self, *, level: int = 6) -> None:
        self.level = check_int("level", level, 0, 9)

    def encode(self, indices: np.ndarray, numel: int) -> IndexEncoding:
        width, raw = _index_bytes(indices, numel)
        compressor = zlib.compressobj(self.level, zlib.DEFLATED, -zlib.MAX_WBITS)
        return IndexEncoding(bytes([width]) + compressor.compress(raw) + compressor.flush(), indices)

    def decode(self, data: memoryview, numel: int, count: int) -> np.ndarray:
        width, compressed, expected = _split_section(data, numel, count, DEFLATE_MAX_RATIO)
        return _positions(inflate_exact(compressed, expected, "deflate index section"), width, numel)
