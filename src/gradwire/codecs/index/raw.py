"""``raw``: each index as a little-endian uint32 — the COO baseline every other codec is measured against.

Positions of tensors with more than 2**32 elements need uint64; the section's first byte says
which width follows (4 or 8).
"""

from __future__ import annotations

import numpy as np

from ...errors import require
from ..base import IndexCodec, IndexEncoding, register_index_codec


@register_index_codec
class RawIndexCodec(IndexCodec):
    """Lossless COO baseline: every index as a uint32 (uint64 beyond 2**32 positions).

    32 bits per index (64 for tensors of more than 2**32 elements) plus one byte; no options.
    Decoding reads ``k = (B - 1) / width`` indices from a section of ``B`` bytes in ``O(k)``
    (docs/wire-format.md, "Decode cost bounds"); order and range are checked by the payload
    layer.
    """

    name = "raw"
    wire_id = 1

    def __init__(self) -> None:
        pass

    def encode(self, indices: np.ndarray, numel: int) -> IndexEncoding:
        width = 4 if numel <= 1 << 32 else 8
        data = bytes([width]) + indices.astype(f"<u{width}").tobytes()
        return IndexEncoding(data, indices)

    def max_section_bytes(self, most: int, numel: int) -> int:
        """See :meth:`IndexCodec.max_section_bytes`: the width byte and ``most`` words."""
        return 1 + (4 if numel <= 1 << 32 else 8) * int(most)

    def decode(self, data: memoryview, numel: int, count: int) -> np.ndarray:
        require(len(data) >= 1, "raw index section is empty")
        width = data[0]
        require(width in (4, 8), f"raw index width {width} is not 4 or 8")
        require(len(data) == 1 + width * count,
                f"raw index section has {len(data)} bytes, expected {1 + width * count}")
        return np.frombuffer(data[1:], dtype=f"<u{width}").astype(np.int64)
