"""``bitmap``: one bit per position of the dense tensor, set where an index is.

Section: ``ceil(numel / 8)`` bytes, bit ``i`` (little-endian within each byte, as
``np.packbits(..., bitorder="little")``) set iff position ``i`` is an index; padding bits are
zero. Cost: ``n / k`` bits per index whatever the pattern, so it beats the gap codes only
above roughly 10-20% density (at 50% it is within 1% of the information bound).
"""

from __future__ import annotations

import numpy as np

from ...errors import require
from ..base import IndexCodec, IndexEncoding, register_index_codec
from ._bitstream import require_count


@register_index_codec
class BitmapIndexCodec(IndexCodec):
    """Lossless: one bit per position, ``n / k`` bits per index whatever the pattern.

    The choice above roughly 10-20% density, where the gap codes lose to it; no options. The
    section is exactly ``ceil(numel / 8)`` bytes and decodes in ``O(B)``, unpacking only the
    non-zero bytes (docs/wire-format.md, "Decode cost bounds").
    """

    name = "bitmap"
    wire_id = 3

    def __init__(self) -> None:
        pass

    def encode(self, indices: np.ndarray, numel: int) -> IndexEncoding:
        bitmap = np.zeros((numel + 7) // 8, dtype=np.uint8)
        if indices.size:
            byte = indices >> 3
            bit = np.left_shift(1, indices & 7).astype(np.uint8)
            # Indices ascend, so the bits of one byte are neighbours; OR each group in one pass
            # instead of materializing a numel-sized boolean mask.
            first = np.flatnonzero(np.diff(byte, prepend=-1))
            bitmap[byte[first]] = np.bitwise_or.reduceat(bit, first)
        return IndexEncoding(bitmap.tobytes(), indices)

    def max_section_bytes(self, most: int, numel: int) -> int:
        """See :meth:`IndexCodec.max_section_bytes`: always ``ceil(numel / 8)``."""
        return (int(numel) + 7) // 8

    def decode(self, data: memoryview, numel: int, count: int) -> np.ndarray:
        require_count(numel, count)
        size = (numel + 7) // 8
        require(len(data) == size, f"bitmap section has {len(data)} bytes, expected {size}")
        bitmap = np.frombuffer(data, dtype=np.uint8)
        if numel % 8:
            require(int(bitmap[-1]) >> (numel % 8) == 0, "bitmap padding bits are set")
        # Unpack only the non-zero bytes: work and memory follow the data, not 8 * len(data).
        occupied = np.flatnonzero(bitmap)
        bits = np.unpackbits(bitmap[occupied][:, None], axis=1, bitorder="little").view(bool)
        require(int(np.count_nonzero(bits)) == count, f"bitmap holds a different number of indices than {count}")
        positions = occupied[:, None] * 8 + np.arange(8, dtype=np.int64)
        return positions[bits]
