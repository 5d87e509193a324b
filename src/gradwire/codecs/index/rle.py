"""``rle``: DeepReduce's run-length code of the bitmap — alternating 0-run and 1-run lengths.

The bitmap is read as ``z0, o0, z1, o1, ..., z(m-1), o(m-1)`` then trailing zeros: ``z0 >= 0``
zeros, ``o0 >= 1`` ones, ``zj >= 1`` zeros, and so on. The trailing zeros follow from ``numel``
and are not sent. Each run length ``x`` (``z0 + 1`` for the first, so all are >= 1) is coded
Elias-gamma style, with its two halves in separate streams so decoding is whole-array passes::

    m            LEB128 varint: number of 1-runs
    lengths      bits.pack_unary stream of bit_length(x) - 1 for the 2m runs
    mantissas    starting at the next byte: x without its leading one bit, bit_length(x) - 1 bits
                 each, packed end to end, LSB first

A run of ``x`` costs ``2 * floor(log2 x) + 1`` bits. Scattered indices pay for a 0-run and a
1-run each (about ``2 log2(n / k)`` bits per index, well above the bound); long runs of
consecutive indices cost almost nothing, e.g. all of ``[0, n)`` takes a few bytes.
"""

from __future__ import annotations

import numpy as np

from ...errors import DecodeError, require
from ..base import IndexCodec, IndexEncoding, register_index_codec
from ..bits import ByteReader, pack_unary, unpack_unary
from ._bitstream import (
    MAX_POSITION_BITS,
    bit_lengths,
    exact_sum,
    field_offsets,
    read_fields,
    read_varint,
    require_count,
    require_zero_padding,
    varint_bytes,
    write_fields,
)


def run_lengths(indices: np.ndarray) -> np.ndarray:
    """``z0 + 1, o0, z1, o1, ...`` (int64, all >= 1) for strictly ascending ``indices``."""
    first_of_run = np.flatnonzero(np.diff(indices, prepend=-2) != 1)
    last_of_run = np.append(first_of_run[1:] - 1, indices.size - 1)
    runs = np.empty(2 * first_of_run.size, dtype=np.int64)
    starts = indices[first_of_run]
    runs[0] = starts[0] + 1
    runs[2::2] = starts[1:] - indices[last_of_run[:-1]] - 1
    runs[1::2] = last_of_run - first_of_run + 1
    return runs


@register_index_codec
class RunLengthIndexCodec(IndexCodec):
    """Lossless: DeepReduce's run-length code, Elias-gamma lengths of alternating 0/1 runs.

    Near-free for long runs of consecutive indices (all of ``[0, n)`` takes a few bytes), about
    ``2 log2(n / k)`` bits per index for scattered ones; no options. A run of ``2**40`` takes a
    few bytes, so the section does not bound ``k``: decoding is ``O(B + k)`` and ``k`` is bounded
    by the payload layer's limit (docs/wire-format.md, "Decode cost bounds").
    """

    name = "rle"
    wire_id = 4

    def __init__(self) -> None:
        pass

    def encode(self, indices: np.ndarray, numel: int) -> IndexEncoding:
        if indices.size == 0:
            return IndexEncoding(varint_bytes(0), indices)
        runs = run_lengths(indices)
        widths = bit_lengths(runs) - 1
        lengths, _ = pack_unary(widths)
        mantissas = write_fields(runs - (np.int64(1) << widths), widths)
        return IndexEncoding(varint_bytes(runs.size // 2) + lengths + mantissas, indices)

    def decode(self, data: memoryview, numel: int, count: int) -> np.ndarray:
        require_count(numel, count)
        reader = ByteReader(data)
        one_runs = read_varint(reader, "run count")
        require(one_runs <= count, f"{one_runs} runs of ones cannot hold {count} indices")
        buffer = np.frombuffer(reader.rest(), dtype=np.uint8)
        if one_runs == 0:
            require(count == 0 and buffer.size == 0, "run-length section does not match an empty set")
            return np.zeros(0, dtype=np.int64)
        run_count = 2 * one_runs
        require(run_count <= buffer.size * 8, f"{buffer.size} bytes cannot hold {run_count} runs")
        widths = unpack_unary(buffer, run_count)
        require(int(widths.max()) <= MAX_POSITION_BITS, "run longer than any tensor")
        offsets, mantissa_bits = field_offsets(widths)
        mantissa_start = (mantissa_bits + run_count + 7) // 8
        mantissa_stream = buffer[mantissa_start:]
        require(mantissa_stream.size == (mantissa_bits + 7) // 8, "run-length mantissa stream has the wrong size")
        require_zero_padding(buffer[:mantissa_start], mantissa_bits + run_count, "run length stream")
        require_zero_padding(mantissa_stream, mantissa_bits, "run-length mantissa stream")
        runs = read_fields(mantissa_stream, offsets, widths).astype(np.int64)
        runs |= np.int64(1) << widths
        zeros = runs[0::2]
        zeros[0] -= 1
        ones = runs[1::2]
        require(exact_sum(ones) == count, f"runs of ones hold a different number of indices than {count}")
        require(exact_sum(zeros) + count <= numel, "runs exceed the tensor size")
        return _expand(zeros, ones, count)


def _expand(zeros: np.ndarray, ones: np.ndarray, count: int) -> np.ndarray:
    """Positions of the ones: a step of 1 inside a run, ``zeros[j] + 1`` onto the first of run j."""
    try:
        steps = np.ones(count, dtype=np.int64)
    except MemoryError as error:  # a valid section can name up to 2**40 positions in a few bytes
        raise DecodeError(f"cannot allocate {count} positions") from error
    run_starts = np.cumsum(ones) - ones
    steps[run_starts] = zeros + 1
    positions = np.cumsum(steps, out=steps)
    positions -= 1
    return positions
