"""``ans``: lossless, the values' own bit patterns, each byte plane entropy-coded with ANS.

The values are sent bit for bit in their dtype (NaN payloads, signed zeros, infinities
included). Viewed as a (k, element size) byte matrix, each column -- a *byte plane* -- is coded
on its own: with ANS under the plane's own 256-entry count table (:mod:`._ans`) when that is
smaller, else raw. For float16/bfloat16 gradients the high plane (sign, exponent, the top
mantissa bits) is far from uniform and shrinks; the low mantissa planes are close to random
and go raw. This is ``zstd``'s byte shuffle with an order-0 entropy coder per plane instead of
LZ matching + Huffman: it reaches each plane's order-0 entropy (within ~0.03 bits per byte)
where zstd's literal Huffman coder loses a little more; ``gradwire bench codecs`` prints both.

Section layout::

    per byte plane, least significant first:
      mode    u8      0 = raw: k bytes follow; 1 = ANS: a stream of alphabet 256 (see _ans)

Cost: linear in k; at most k * element size + element size bytes (all planes raw). The
decoder bounds each plane by its bytes (raw: exactly k; ANS: the stream's symbol bound).
"""

from __future__ import annotations

import numpy as np
import torch

from ...errors import require
from ..base import ValueCodec, register_value_codec
from ..bits import ByteReader
from ._ans import decode_symbols, encode_symbols

_RAW, _ANS = 0, 1


@register_value_codec
class ANSCodec(ValueCodec):
    """Lossless: every byte plane of the values' bit patterns, ANS-coded where that pays.

    Reaches each byte plane's order-0 entropy (within about 0.03 bits per byte) where that beats
    sending the plane raw: the sign/exponent plane of float16/bfloat16 gradients shrinks, the
    low mantissa planes go raw. At most ``k * element size + element size`` bytes. No options.
    Decoding bounds every plane by its bytes (raw: exactly ``k``; ANS: at most ``96 * 32``
    symbols per 32-bit word, docs/wire-format.md), then is ``O(B + k)``.
    """

    name = "ans"
    wire_id = 11

    def __init__(self) -> None:
        pass

    def encode(self, values: torch.Tensor) -> bytes:
        values = values.detach().cpu().contiguous()
        size = values.element_size()
        if values.numel() == 0:
            return bytes([_RAW]) * size
        planes = values.view(torch.uint8).numpy().reshape(-1, size)
        parts = []
        for plane in range(size):
            column = np.ascontiguousarray(planes[:, plane])
            coded = encode_symbols(column, 256)
            parts.append(bytes([_ANS]) + coded if len(coded) < column.size else bytes([_RAW]) + column.tobytes())
        return b"".join(parts)

    def decode(self, data: memoryview, count: int, dtype: torch.dtype) -> torch.Tensor:
        require(count >= 0, "negative element count")
        size = torch.finfo(dtype).bits // 8
        reader = ByteReader(data)
        columns = []
        for plane in range(size):
            mode = reader.u8("ans plane mode")
            require(mode in (_RAW, _ANS), f"ans: unknown plane mode {mode}")
            if mode == _RAW:
                columns.append(np.frombuffer(reader.take(count, f"ans raw plane {plane}"), dtype=np.uint8))
            else:
                columns.append(decode_symbols(reader, count, 256, f"ans plane {plane}").astype(np.uint8))
        reader.expect_end()
        if count == 0:
            return torch.zeros(0, dtype=dtype)
        return torch.from_numpy(np.stack(columns, axis=1).reshape(-1)).view(dtype)
