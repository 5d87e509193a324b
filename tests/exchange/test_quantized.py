"""Blockwise int8/int4 quantization: bounds, layout, non-finite blocks, hostile bytes."""

from __future__ import annotations

import math

import pytest
import torch

from gradwire.errors import DecodeError
from gradwire.exchange.blockquant import LEVELS, dequantize, quantize, quantized_bytes, roundtrip

BLOCK = 64


def _qd(x: torch.Tensor, bits: int, block_size: int = BLOCK) -> torch.Tensor:
    return dequantize(quantize(x, bits=bits, block_size=block_size), x.shape[-1], bits=bits, block_size=block_size)


def _scales(x: torch.Tensor, bits: int, block_size: int = BLOCK) -> torch.Tensor:
    """Each value's block scale (float64, from the float32 scale the wire carries), shape of ``x``."""
    n = x.shape[-1]
    blocks = math.ceil(n / block_size)
    packed = quantize(x, bits=bits, block_size=block_size)
    scales = packed[..., : 4 * blocks].clone(memory_format=torch.contiguous_format).view(torch.float32).double()
    return scales.repeat_interleave(block_size, dim=-1)[..., :n]


# ----------------------------------------------------------------------------------------- blockquant


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n, block_size", [(1, 64), (63, 64), (64, 64), (65, 64), (1000, 64), (999, 7), (50, 1),
                                           (257, 256)])
def test_round_trip_error_is_at_most_half_a_scale(bits: int, n: int, block_size: int) -> None:
    g = torch.Generator().manual_seed(n * 31 + bits)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 4)  # blocks of very different sizes
    packed = quantize(x, bits=bits, block_size=block_size)
    assert packed.dtype == torch.uint8 and packed.shape == (quantized_bytes(n, bits, block_size),)
    y = dequantize(packed, n, bits=bits, block_size=block_size)
    scale = _scales(x, bits, block_size)
    error = (x.double() - y.double()).abs()
    assert bool((error <= scale / 2).all()), float((error / scale).max())
    # the block's largest value uses the top code: the scale is absmax / L, not something looser
    blocks = math.ceil(n / block_size)
    padded = torch.nn.functional.pad(x, (0, blocks * block_size - n)).reshape(blocks, block_size)
    torch.testing.assert_close(scale[::block_size] * LEVELS[bits], padded.abs().amax(1).double(), rtol=1e-6, atol=0)
    # x - D(Q(x)) is exact in float32: an error-feedback residual loses nothing
    assert torch.equal((x - y).double(), x.double() - y.double())
    assert torch.equal(roundtrip(x, bits=bits, block_size=block_size)[1], y)


def test_int4_packs_two_codes_per_byte_low_nibble_first_for_odd_lengths() -> None:
    x = torch.tensor([1.0, -2.0, 7.0])  # absmax 7: scale 1.0, codes 1, -2, 7
    packed = quantize(x, bits=4, block_size=64)
    assert packed.tolist() == [0, 0, 128, 63, 0xE1, 0x07]  # 1.0f little-endian; (1 | -2 << 4), (7 | padding 0)
    assert dequantize(packed, 3, bits=4, block_size=64).tolist() == [1.0, -2.0, 7.0]
    # five values in two blocks of 3: two scales, then three bytes; the last high nibble is padding
    x = torch.tensor([3.5, -7.0, 0.0, -1.5, 7.0])  # scales 1 and 1; codes 4 -7 0 -2 7 (ties to even)
    packed = quantize(x, bits=4, block_size=3)
    assert packed.numel() == quantized_bytes(5, 4, 3) == 4 * 2 + 3
    assert packed[:8].view(torch.float32).tolist() == [1.0, 1.0]
    assert packed[8:].tolist() == [4 | (-7 & 0xF) << 4, 0 | (-2 & 0xF) << 4, 7]
    assert dequantize(packed, 5, bits=4, block_size=3).tolist() == [4.0, -7.0, 0.0, -2.0, 7.0]


def test_int8_layout_and_round_half_to_even() -> None:
    x = torch.tensor([127.0, 0.5, 1.5, 2.5, -2.5, -127.0])  # scale 1.0: ties go to the even code
    packed = quantize(x, bits=8, block_size=8)
    assert packed[:4].view(torch.float32).tolist() == [1.0]
    assert packed[4:].view(torch.int8).tolist() == [127, 0, 2, 2, -2, -127]
    assert torch.equal(quantize(x, bits=8, block_size=8), packed)  # deterministic


def test_rows_are_chunks_of_their_own() -> None:
    x = torch.randn(4, 130, generator=torch.Generator().manual_seed(3))
    x[2] *= 1000
    for bits in (8, 4):
        batch = quantize(x, bits=bits, block_size=BLOCK)
        assert batch.shape == (4, quantized_bytes(130, bits, BLOCK))
        for row in range(4):
            assert torch.equal(batch[row], quantize(x[row].clone(), bits=bits, block_size=BLOCK))
        assert torch.equal(dequantize(batch, 130, bits=bits, block_size=BLOCK),
                           torch.stack([_qd(x[row].clone(), bits) for row in range(4)]))
        # bytes at an odd offset in a receive buffer decode the same (float32 views need alignment)
        shifted = torch.cat([torch.zeros(1, dtype=torch.uint8), batch.reshape(-1)])[1:].reshape(batch.shape)
        assert torch.equal(dequantize(shifted[1], 130, bits=bits, block_size=BLOCK), _qd(x[1].clone(), bits))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_nonfinite_block_gets_a_nan_scale_and_decodes_to_nan(bits: int, bad: float) -> None:
    x = torch.randn(200, generator=torch.Generator().manual_seed(5))
    x[70] = bad  # block 1 of [0, 64), [64, 128), ...
    packed = quantize(x, bits=bits, block_size=BLOCK)
    scales = packed[:16].view(torch.float32)
    assert torch.isnan(scales).tolist() == [False, True, False, False]
    y = dequantize(packed, 200, bits=bits, block_size=BLOCK)
    assert bool(torch.isnan(y[64:128]).all())
    assert bool(torch.isfinite(y[:64]).all() and torch.isfinite(y[128:]).all())
    assert torch.equal(y[128:], _qd(x[128:].clone(), bits))


def test_large_small_and_zero_blocks_keep_float32_scales() -> None:
    x = torch.cat([torch.full((64,), 3e38), torch.full((64,), -1e-30), torch.zeros(64)])
    x[1], x[65] = 1e38, -3e-31
    for bits in (8, 4):
        packed = quantize(x, bits=bits, block_size=BLOCK)
        scales = packed[:12].view(torch.float32)
        assert bool(torch.isfinite(scales).all()) and scales[1] < 0.1 * 2.0**-24  # fp16: Inf and 0
        y = dequantize(packed, x.numel(), bits=bits, block_size=BLOCK)
        assert bool(((x.double() - y.double()).abs() <= _scales(x, bits) / 2).all())
        assert scales[2] == 0 and y[128:].tolist() == [0.0] * 64


@pytest.mark.parametrize("bits", [8, 4])
def test_wrong_length_or_type_raises_decode_error(bits: int) -> None:
    packed = quantize(torch.randn(100), bits=bits, block_size=BLOCK)
    for wrong in (packed[:-1], torch.cat([packed, packed[:1]]), packed[:0], packed.view(torch.int8)):
        with pytest.raises(DecodeError, match="uint8 bytes"):
            dequantize(wrong, 100, bits=bits, block_size=BLOCK)
    with pytest.raises(DecodeError):
        dequantize(packed, 101, bits=bits, block_size=BLOCK)  # the receiver's n decides, not the bytes
    with pytest.raises(DecodeError):
        dequantize(torch.stack([packed, packed])[:, 1:], 100, bits=bits, block_size=BLOCK)


@pytest.mark.parametrize("bits", [8, 4])
def test_hostile_bytes_of_the_right_length_decode_to_bounded_values(bits: int) -> None:
    g = torch.Generator().manual_seed(bits)
    data = torch.randint(0, 256, (50, quantized_bytes(300, bits, BLOCK)), dtype=torch.uint8, generator=g)
    data[:, 4 * 5:] = 0x80 if bits == 8 else 0x88  # codes -128 / nibble -8: outside [-L, L]
    values = dequantize(data, 300, bits=bits, block_size=BLOCK)
    scales = data[:, :20].contiguous().view(torch.float32).repeat_interleave(BLOCK, dim=1)[:, :300]
    finite = torch.isfinite(scales)
    assert torch.equal(values[finite], -LEVELS[bits] * scales[finite])  # clamped to the top code
    assert not bool(torch.isfinite(values[~finite]).any())


def test_bad_options_are_value_errors() -> None:
    with pytest.raises(ValueError, match="bits"):
        quantize(torch.randn(4), bits=2, block_size=4)
    with pytest.raises(ValueError, match="block_size"):
        quantize(torch.randn(4), bits=8, block_size=0)
    with pytest.raises(ValueError, match="float32"):
        quantize(torch.randn(4, dtype=torch.float64), bits=8, block_size=4)


def test_byte_formula() -> None:
    assert quantized_bytes(300, 8, 64) == 4 * 5 + 300
    assert quantized_bytes(300, 4, 64) == 4 * 5 + 150
    assert quantized_bytes(301, 4, 64) == 4 * 5 + 151
    assert quantized_bytes(0, 4, 64) == 0
