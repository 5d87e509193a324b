"""``huffman``: canonical Huffman code of the gaps' bit lengths, the rest of each gap sent raw.

Gaps are as large as the tensor, so the Huffman alphabet is their size class: each ``x = gap + 1``
is the symbol ``s = bit_length(x) - 1`` (0..40, Elias-gamma's prefix) plus the ``s`` bits of ``x``
below its leading one. Code lengths are limited to 15 bits. Section::

    symbols      u8: alphabet size A (largest symbol + 1; 0 for the empty set)
    code table   ceil(A / 2) bytes: each symbol's code length, 4 bits (low nibble first), 0 = unused
    code bytes   LEB128 varint: size of the code stream
    codes        canonical Huffman code of each symbol, first code bit first in the LSB-first stream
    mantissas    to the end: x without its leading one bit, s bits each, packed LSB first

Cost: the entropy of the size classes (+ < 1 bit) plus ``mean(s)`` raw bits per index and a
table of at most 21 bytes. Raw bits lose a little where gaps are not uniform within a size
class: for random positions 1-3% above the bound, more at high density. Decoding has no loop
over elements: a lookup at every bit position gives the code length found there, and pointer
doubling over those jumps (log2 k whole-array passes) finds where each code starts.
"""

from __future__ import annotations

import heapq

import numpy as np

from ...errors import require
from ..base import IndexCodec, IndexEncoding, register_index_codec
from ..bits import ByteReader
from ._bitstream import (
    MAX_POSITION_BITS,
    bit_lengths,
    field_offsets,
    gaps_of,
    positions_from_gaps,
    read_fields,
    read_varint,
    require_count,
    require_zero_padding,
    varint_bytes,
    write_fields,
)

MAX_CODE_LENGTH = 15
ALPHABET_SIZE = MAX_POSITION_BITS + 1


def huffman_lengths(frequencies: "list[int]") -> "list[int]":
    """Optimal code lengths for the non-zero ``frequencies`` (0 for unused symbols)."""
    lengths = [0] * len(frequencies)
    used = [symbol for symbol, frequency in enumerate(frequencies) if frequency]
    if len(used) == 1:
        lengths[used[0]] = 1
        return lengths
    # At most 41 symbols: a plain heap merge is the clearest way and costs nothing.
    heap = [(frequencies[symbol], symbol, [symbol]) for symbol in used]
    heapq.heapify(heap)
    tiebreak = len(frequencies)
    while len(heap) > 1:
        weight_a, _, group_a = heapq.heappop(heap)
        weight_b, _, group_b = heapq.heappop(heap)
        for symbol in group_a + group_b:
            lengths[symbol] += 1
        heapq.heappush(heap, (weight_a + weight_b, tiebreak, group_a + group_b))
        tiebreak += 1
    return lengths


def limited_lengths(frequencies: "list[int]") -> "list[int]":
    """Huffman code lengths no longer than MAX_CODE_LENGTH.

    Over-long codes need very skewed counts; halving the counts (keeping each at >= 1) flattens
    them until the code fits — at worst all counts reach 1 and lengths are <= 6.
    """
    while True:
        lengths = huffman_lengths(frequencies)
        if max(lengths) <= MAX_CODE_LENGTH:
            return lengths
        frequencies = [(frequency + 1) // 2 for frequency in frequencies]


def canonical_codes(lengths: "list[int]") -> "list[int]":
    """Canonical codes (deflate's rule: shorter first, then by symbol), bit-reversed so that the
    code's first bit is the stream's first (least significant) bit."""
    codes = [0] * len(lengths)
    code = 0
    previous_length = 0
    for length, symbol in sorted((length, symbol) for symbol, length in enumerate(lengths) if length):
        code <<= length - previous_length
        previous_length = length
        codes[symbol] = int(format(code, f"0{length}b")[::-1], 2)
        code += 1
    return codes


def pack_lengths(lengths: "list[int]") -> bytes:
    """The code table: each length (0..15) in a nibble, low nibble first, zero-padded."""
    padded = list(lengths) + [0] * (len(lengths) % 2)
    return bytes(low | (high << 4) for low, high in zip(padded[0::2], padded[1::2]))


def unpack_lengths(data: memoryview, size: int) -> "list[int]":
    """Inverse of :func:`pack_lengths` for ``size`` symbols; DecodeError if the padding is not zero."""
    nibbles = [part for byte in bytes(data) for part in (byte & 15, byte >> 4)]
    require(all(length == 0 for length in nibbles[size:]), "code table padding is not zero")
    return nibbles[:size]


@register_index_codec
class HuffmanIndexCodec(IndexCodec):
    """Lossless: canonical Huffman code of the gaps' size classes, the rest of each gap raw.

    For random positions 1-3% above the information bound (more at high density), plus a code
    table of at most 21 bytes; no options. Every code takes at least one bit, so ``k <= 8 B``;
    decoding is ``O(B log k)`` whole-array passes (pointer doubling, no loop per element;
    docs/wire-format.md, "Decode cost bounds").
    """

    name = "huffman"
    wire_id = 5

    def __init__(self) -> None:
        pass

    def encode(self, indices: np.ndarray, numel: int) -> IndexEncoding:
        if indices.size == 0:
            return IndexEncoding(bytes([0]) + varint_bytes(0), indices)
        values = gaps_of(indices) + 1
        symbols = bit_lengths(values) - 1
        alphabet = int(symbols.max()) + 1
        lengths = limited_lengths(np.bincount(symbols, minlength=alphabet).tolist())
        code_stream = write_fields(
            np.array(canonical_codes(lengths), dtype=np.uint64)[symbols], np.array(lengths, dtype=np.int64)[symbols]
        )
        mantissas = write_fields(values - (np.int64(1) << symbols), symbols)
        header = bytes([alphabet]) + pack_lengths(lengths) + varint_bytes(len(code_stream))
        return IndexEncoding(header + code_stream + mantissas, indices)

    def decode(self, data: memoryview, numel: int, count: int) -> np.ndarray:
        require_count(numel, count)
        reader = ByteReader(data)
        alphabet = reader.u8("alphabet size")
        require(alphabet <= ALPHABET_SIZE, f"alphabet of {alphabet} symbols exceeds {ALPHABET_SIZE}")
        lengths = unpack_lengths(reader.take((alphabet + 1) // 2, "code table"), alphabet)
        code_stream = np.frombuffer(reader.take(read_varint(reader, "code bytes"), "code stream"), dtype=np.uint8)
        mantissa_stream = np.frombuffer(reader.rest(), dtype=np.uint8)
        if count == 0:
            require(alphabet == 0 and code_stream.size == 0 and mantissa_stream.size == 0,
                    "non-empty section for no indices")
            return np.zeros(0, dtype=np.int64)
        require(any(lengths), "code table is empty")
        require(
            sum(1 << (MAX_CODE_LENGTH - length) for length in lengths if length) <= 1 << MAX_CODE_LENGTH,
            "code lengths are oversubscribed",
        )
        # Every code is at least one bit: count is bounded by the data before anything is allocated.
        require(count <= code_stream.size * 8, f"{code_stream.size} code bytes cannot hold {count} codes")
        widths = _decode_symbols(code_stream, lengths, count).astype(np.int64)
        offsets, mantissa_bits = field_offsets(widths)
        require(mantissa_stream.size == (mantissa_bits + 7) // 8, "mantissa stream has the wrong size")
        require_zero_padding(mantissa_stream, mantissa_bits, "mantissa stream")
        values = read_fields(mantissa_stream, offsets, widths)
        values |= np.uint64(1) << widths.astype(np.uint64)
        values -= np.uint64(1)
        return positions_from_gaps(values, numel)


def _decode_symbols(stream: np.ndarray, lengths: "list[int]", count: int) -> np.ndarray:
    """The symbols of the first ``count`` codes of ``stream``; the codes must end in its last byte."""
    longest = max(lengths)
    table_symbol = np.zeros(1 << longest, dtype=np.uint8)
    table_length = np.zeros(1 << longest, dtype=np.uint8)  # 0: no code starts with these bits
    for symbol, (length, code) in enumerate(zip(lengths, canonical_codes(lengths))):
        if length:
            # Every window whose first `length` bits are this code decodes to it.
            entries = code + (np.arange(1 << (longest - length)) << length)
            table_symbol[entries] = symbol
            table_length[entries] = length

    bit_count = stream.size * 8
    padded = np.zeros(stream.size + 4, dtype=np.uint8)
    padded[: stream.size] = stream
    # The `longest` bits at every bit position: a 4-byte window per byte, shifted 0..7.
    byte_windows = np.ndarray((stream.size,), dtype="<u4", buffer=padded, strides=(1,))
    windows = (byte_windows[:, None] >> np.arange(8, dtype=np.uint32)) & np.uint32((1 << longest) - 1)
    windows = windows.reshape(-1)

    index_type = np.int32 if bit_count + 2 < 1 << 31 else np.int64
    past_end = bit_count + 1  # where a code that is invalid or runs past the stream leads
    length_here = table_length[windows]
    jump = np.arange(bit_count + 2, dtype=index_type)
    jump[:bit_count] += length_here
    jump[:bit_count][length_here == 0] = past_end
    jump[jump > bit_count] = past_end
    jump[bit_count:] = past_end
    next_code = jump

    # starts[i] = jump^i(0). Knowing the first m starts and jump^m, the next m are jump^m of them.
    starts = np.zeros(1, dtype=index_type)
    while starts.size < count:
        more = min(starts.size, count - starts.size)
        starts = np.concatenate([starts, jump[starts[:more]]])
        require(int(starts[-1]) < bit_count, "code stream ends before the last code")
        if starts.size < count:
            jump = jump[jump]
    end = int(next_code[starts[-1]])
    require(end <= bit_count, "invalid or truncated code in the code stream")
    require(stream.size == (end + 7) // 8, "trailing bytes after the codes")
    require_zero_padding(stream, end, "code stream")
    return table_symbol[windows[starts]]
