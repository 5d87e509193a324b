"""Entropy coding of small-alphabet symbols: one ANS stream under a per-section count table.

Shared by ``qsgd-ans`` (signed quantization levels), ``ans`` (byte planes of float bit
patterns) and the level mode of ``polyfit``/``dexp``. The coder is ``constriction``'s stack
ANS (``constriction.stream.stack.AnsCoder``: 32-bit words, 64-bit state, 24-bit model
precision), measured here at ~70 M symbols/s encode and ~60 M/s decode for an 8-symbol
alphabet on one core -- the table and the numpy around it cost more than the coder.

Stream layout (little-endian)::

    A        u32                 alphabet size, 2..MAX_ALPHABET
    counts   A LEB128 varints    how often each symbol 0..A-1 occurs; they sum to the count
    W        u32                 number of 32-bit words
    words    W x u32             the ANS stream (constriction's ``get_compressed()``)

Model: ``p = (1 - MIX) * counts / count + MIX / A`` (float64 arithmetic, identical on both sides,
quantized by constriction's deterministic "leaky" quantizer). The ``MIX = 1/64`` share of
uniform mass costs at most log2(64/63) = 0.023 bits per symbol, and buys two guarantees:
every symbol is codable, and no symbol is cheaper than -log2(1 - MIX/2) = 0.0113 bits, so a
stream of W words holds at most ``MAX_SYMBOLS_PER_BIT * 32 W`` symbols. (The coder starts from a
fixed 64-bit seed state, not from constriction's empty state, where symbol 0 is free.) The
decoder checks the count against that before it allocates or decodes anything, so work and
memory are bounded by the section's length, then decodes and requires the stream to end in
the seed state and the decoded symbols' histogram to equal the table.
"""

from __future__ import annotations

import constriction
import numpy as np

from ...errors import DecodeError, require
from ..bits import ByteReader, decode_varint, encode_varint

# constriction's submodules are attributes of its native module, not importable packages
Categorical = constriction.stream.model.Categorical
AnsCoder = constriction.stream.stack.AnsCoder

#: The coder starts from this state (>= 2**32) instead of constriction's empty one: from an empty
#: state, symbol 0 costs nothing and small states grow only linearly, so a few words could hold
#: millions of symbols. From a full state every symbol adds its information content.
_SEED = np.array([1, 1], dtype=np.uint32)

MIX = 1.0 / 64.0
MAX_ALPHABET = 1 << 16
#: 1 / -log2(1 - MIX/2) is 88.4; the slack covers the model's 24-bit quantization.
MAX_SYMBOLS_PER_BIT = 96


def _model(counts: np.ndarray) -> Categorical:
    total = float(counts.sum())
    probabilities = (1.0 - MIX) * (counts.astype(np.float64) / total) + MIX / counts.size
    return Categorical(probabilities, perfect=False)


def max_symbols(words: int) -> int:
    """The most symbols a stream of ``words`` 32-bit words (seed state included) can hold."""
    return MAX_SYMBOLS_PER_BIT * 32 * words


def encode_symbols(symbols: np.ndarray, alphabet: int) -> bytes:
    """One ANS stream (layout in the module docstring) for ``symbols``.

    Args:
        symbols: integers in ``[0, alphabet)``, any shape (flattened).
        alphabet: the table's size, ``2 <= alphabet <= MAX_ALPHABET``.

    Returns:
        The stream bytes: table, word count and words.

    Raises:
        ValueError: ``alphabet`` out of range.
    """
    if not 2 <= alphabet <= MAX_ALPHABET:
        raise ValueError(f"alphabet of {alphabet} symbols is not in 2..{MAX_ALPHABET}")
    symbols = np.ascontiguousarray(symbols, dtype=np.int32).reshape(-1)
    counts = np.bincount(symbols, minlength=alphabet)
    header = np.uint32(alphabet).tobytes() + encode_varint(counts)
    coder = AnsCoder(_SEED.copy())
    if symbols.size:
        coder.encode_reverse(symbols, _model(counts))
    words = coder.get_compressed().astype("<u4")
    return header + np.uint32(words.size).tobytes() + words.tobytes()


def decode_symbols(reader: ByteReader, count: int, alphabet: int, what: str) -> np.ndarray:
    """Read one ANS stream at ``reader``'s position, exactly its bytes.

    ``count`` is checked against the stream's symbol bound (:func:`max_symbols`) before anything
    of its size is allocated.

    Args:
        reader: positioned at the stream; left just after it.
        count: symbols to decode, from the payload header.
        alphabet: the table size the stream must declare.
        what: names the stream in error messages.

    Returns:
        (count,) int64 symbols in ``[0, alphabet)``.

    Raises:
        DecodeError: on any inconsistency (table, word count, a stream that does not end in
            the seed state or whose symbols do not match the table).
    """
    require(count >= 0, "negative element count")
    declared = reader.u32(f"{what} alphabet size")
    require(declared == alphabet, f"{what}: alphabet of {declared} symbols, expected {alphabet}")
    require(2 <= alphabet <= MAX_ALPHABET, f"{what}: alphabet of {alphabet} symbols is not in 2..{MAX_ALPHABET}")
    # every varint takes at least one byte: bounds the table by the bytes present
    require(reader.remaining >= alphabet + 4, f"{what}: truncated count table")
    view = reader.view[reader.offset:]
    ends = np.flatnonzero(np.frombuffer(view, dtype=np.uint8) < 0x80)
    require(ends.size >= alphabet, f"{what}: truncated count table")
    table_bytes = int(ends[alphabet - 1]) + 1
    counts = decode_varint(reader.take(table_bytes, f"{what} count table"), alphabet)
    require(bool((counts <= np.uint64(count)).all()) and int(counts.sum(dtype=np.uint64)) == count,
            f"{what}: symbol counts do not sum to {count}")
    words = reader.u32(f"{what} word count")
    require(words <= reader.remaining // 4, f"{what}: {words} words announced, {reader.remaining // 4} present")
    require(words >= len(_SEED), f"{what}: {words} words cannot hold the coder's state")
    require(count <= max_symbols(words), f"{what}: {count} symbols cannot fit {words} words")
    data = np.frombuffer(reader.take(4 * words, f"{what} words"), dtype="<u4").astype(np.uint32)
    try:
        coder = AnsCoder(data)
        symbols = coder.decode(_model(counts.astype(np.int64)), count) if count else np.zeros(0, dtype=np.int64)
        rest = coder.get_compressed()
    except (ValueError, RuntimeError, OverflowError) as error:
        raise DecodeError(f"{what}: {error}") from error
    # ANS is a bijection on states: a stream of exactly these symbols ends in the seed state
    require(bool(np.array_equal(rest, _SEED)), f"{what}: stream does not hold exactly {count} symbols")
    symbols = symbols.astype(np.int64)
    require(bool(np.array_equal(np.bincount(symbols, minlength=alphabet), counts.astype(np.int64))),
            f"{what}: decoded symbols do not match the count table")
    return symbols


__all__ = ["MAX_ALPHABET", "MIX", "decode_symbols", "encode_symbols", "max_symbols"]
