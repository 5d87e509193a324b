"""``eliasfano``: classic Elias-Fano — low bits packed, high parts in a unary bitmap.

With ``n = numel`` and ``k`` indices, ``l = floor(log2(n / k))`` (0 when ``k > n / 2``). Both
are known from the payload header, so ``l`` is not sent. Section::

    low bits    k * l bits packed (bits.pack_uint layout), ceil(k * l / 8) bytes
    high bits   bit (position >> l) + i set for the i-th index; ceil((last high part + k) / 8) bytes

Cost: at most ``2 + ceil(log2(n / k))`` bits per index, about 0.5 bits above the information
bound ``log2(e) + log2(n / k)`` at typical densities, with random access possible in principle.
"""

from __future__ import annotations

import numpy as np

from ...errors import require
from ...sparse import strictly_ascending
from ..base import IndexCodec, IndexEncoding, register_index_codec
from ._bitstream import read_fixed, require_count, require_zero_padding, write_fixed


def low_width(numel: int, count: int) -> int:
    """``floor(log2(numel / count))`` for ``0 < count <= numel``."""
    return (numel // count).bit_length() - 1


@register_index_codec
class EliasFanoIndexCodec(IndexCodec):
    """Lossless: Elias-Fano, at most ``2 + ceil(log2(n / k))`` bits per index.

    About 0.5 bits per index above the information bound at typical densities, with no
    parameter to send (``l`` follows from ``numel`` and ``count``); no options. Every index
    sets one bit of the high bitmap, so ``k <= 8 B`` and decoding is ``O(B + k)``
    (docs/wire-format.md, "Decode cost bounds").
    """

    name = "eliasfano"
    wire_id = 6

    def __init__(self) -> None:
        pass

    def encode(self, indices: np.ndarray, numel: int) -> IndexEncoding:
        count = indices.size
        if count == 0:
            return IndexEncoding(b"", indices)
        width = low_width(numel, count)
        low = write_fixed(indices & ((1 << width) - 1), width)
        set_bits = (indices >> width) + np.arange(count, dtype=np.int64)
        high = np.zeros(int(set_bits[-1]) + 1, dtype=np.uint8)
        high[set_bits] = 1
        return IndexEncoding(low + np.packbits(high, bitorder="little").tobytes(), indices)

    def max_section_bytes(self, most: int, numel: int) -> int:
        """See :meth:`IndexCodec.max_section_bytes`: the section's size follows from the count
        alone (the last high part is at most ``(numel - 1) >> l``); the maximum over every count
        up to ``most``."""
        counts = np.arange(1, min(int(most), int(numel)) + 1, dtype=np.int64)
        if counts.size == 0:
            return 0
        _, exponent = np.frexp((numel // counts).astype(np.float64))  # exact: floor(log2(x)) = e - 1
        width = exponent.astype(np.int64) - 1
        low = (counts * width + 7) // 8
        high = (((numel - 1) >> width) + counts + 7) // 8
        return int(np.max(low + high))

    def decode(self, data: memoryview, numel: int, count: int) -> np.ndarray:
        require_count(numel, count)
        if count == 0:
            require(len(data) == 0, "index section of an empty set is not empty")
            return np.zeros(0, dtype=np.int64)
        width = low_width(numel, count)
        low_bytes = (count * width + 7) // 8
        # Every index sets one high bit, so count is bounded by the data before anything is allocated.
        require(len(data) >= low_bytes + (count + 7) // 8, f"{len(data)} bytes cannot hold {count} Elias-Fano codes")
        buffer = np.frombuffer(data, dtype=np.uint8)
        high_bits = np.flatnonzero(np.unpackbits(buffer[low_bytes:], bitorder="little"))
        require(high_bits.size == count, f"high bitmap holds {high_bits.size} indices, expected {count}")
        require(int(high_bits[-1]) // 8 + 1 == buffer.size - low_bytes, "trailing bytes after the high bitmap")
        high = high_bits - np.arange(count, dtype=np.int64)
        require(int(high[-1]) <= (numel - 1) >> width, "high part exceeds the tensor size")
        require_zero_padding(buffer[:low_bytes], count * width, "low bits")
        low = read_fixed(buffer[:low_bytes], count, width)
        positions = (high << width) | low.astype(np.int64)
        require(int(positions[-1]) < numel, "index exceeds the tensor size")
        # Equal high parts need ascending low parts; nothing above guarantees that.
        require(strictly_ascending(positions), "indices are not strictly ascending")
        return positions
