"""Blocks that restart at every segment (FSDP2's flat gradient: one segment per parameter chunk)."""

from __future__ import annotations

import pytest
import torch

from gradwire.errors import DecodeError
from gradwire.exchange.blockquant import block_count, dequantize, quantize, quantized_bytes, roundtrip


@pytest.mark.parametrize("bits", [8, 4])
def test_a_segmented_chunk_is_its_segments_quantized_one_by_one(bits: int) -> None:
    generator = torch.Generator().manual_seed(0)
    segments = [5, 0, 130, 1, 64, 7]
    x = torch.randn(3, sum(segments), generator=generator) * torch.logspace(-6, 2, sum(segments))
    packed, local = roundtrip(x, bits=bits, block_size=64, segments=segments)
    assert packed.shape == (3, quantized_bytes(x.shape[1], bits, 64, segments))
    assert block_count(x.shape[1], 64, segments) == 1 + 0 + 3 + 1 + 1 + 1
    start = 0
    for length in segments:
        if length:
            _, alone = roundtrip(x[:, start: start + length].contiguous(), bits=bits, block_size=64)
            assert torch.equal(local[:, start: start + length], alone)
        start += length
    assert torch.equal(dequantize(packed, x.shape[1], bits=bits, block_size=64, segments=segments), local)
    assert torch.equal(quantize(x, bits=bits, block_size=64, segments=segments), packed)


def test_a_small_segment_is_no_longer_rounded_to_zero_by_a_large_neighbour() -> None:
    x = torch.cat([torch.full((24,), 1e-4), torch.full((104,), 1.0)]).reshape(1, -1)
    _, joined = roundtrip(x, bits=4, block_size=128)
    _, segmented = roundtrip(x, bits=4, block_size=128, segments=[24, 104])
    assert torch.count_nonzero(joined[0, :24]) == 0
    assert torch.allclose(segmented[0, :24], x[0, :24])


def test_segments_that_do_not_sum_to_the_chunk_are_refused() -> None:
    with pytest.raises(ValueError, match="summing to n=10"):
        quantized_bytes(10, 8, 4, [3, 3])
    with pytest.raises(ValueError, match="summing"):
        roundtrip(torch.zeros(1, 10), bits=8, block_size=4, segments=[11])


def test_bytes_of_other_segments_are_a_decode_error() -> None:
    packed = quantize(torch.randn(1, 10), bits=8, block_size=4, segments=[10])
    with pytest.raises(DecodeError):
        dequantize(packed, 10, bits=8, block_size=4, segments=[5, 5])
