"""``delta-varint``: the gaps between positions as LEB128 varints, the classic posting-list code.

Section: one varint per index and nothing else — the first position, then each difference minus
one. A gap below 2**7 costs 8 bits, below 2**14 16 bits, and so on (``8 * ceil(bits / 7)``), so
uniformly random positions cost about ``8 * ceil(log2(n / k) / 7)`` bits per index: byte-aligned
and cheap, but 25-70% above the information bound.
"""

from __future__ import annotations

import numpy as np

from ..base import IndexCodec, IndexEncoding, register_index_codec
from ..bits import decode_varint, encode_varint
from ._bitstream import gaps_of, positions_from_gaps, require_count


@register_index_codec
class DeltaVarintIndexCodec(IndexCodec):
    """Lossless: LEB128 varints of the gaps, byte-aligned and cheap, 25-70% above the bound.

    About ``8 * ceil(log2(n / k) / 7)`` bits per index for random positions; no options. Every
    index takes at least one byte, so ``k <= B`` and decoding is ``O(B)``
    (docs/wire-format.md, "Decode cost bounds").
    """

    name = "delta-varint"
    wire_id = 2

    def __init__(self) -> None:
        pass

    def encode(self, indices: np.ndarray, numel: int) -> IndexEncoding:
        return IndexEncoding(encode_varint(gaps_of(indices)), indices)

    def decode(self, data: memoryview, numel: int, count: int) -> np.ndarray:
        require_count(numel, count)
        # decode_varint checks count against the byte count before it allocates anything.
        return positions_from_gaps(decode_varint(data, count), numel)
