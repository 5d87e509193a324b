"""``qsgd``: stochastic quantization -- bound, unbiasedness, options, hostile sections."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gradwire.codecs as codecs
from gradwire.codecs.values.qsgd import QSGDCodec
from gradwire.errors import DecodeError

from .contract import check_config, check_value_codec
from .value_helpers import fuzz_decoder

UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float64: 2.0**-53}


def qsgd_bound(bits: int, bucket_size: int):
    """The stated bound: norm / s + u * norm (+ half the smallest subnormal), per bucket."""
    s = 2 ** (bits - 1) - 1

    def bound(values: torch.Tensor) -> torch.Tensor:
        x = values.double()
        bucket = torch.arange(x.numel()) // bucket_size
        squares = torch.zeros(int(bucket.max()) + 1, dtype=torch.float64).index_add_(0, bucket, x * x)
        norm = squares.sqrt()[bucket]
        info = torch.finfo(values.dtype)
        return (norm / s + UNIT_ROUNDOFF[values.dtype] * norm) * (1 + 2.0**-20) + info.smallest_normal * info.eps / 2

    return bound


@pytest.mark.parametrize(("bits", "bucket_size"), [(2, 512), (4, 512), (8, 7), (3, 1)])
def test_contract(bits: int, bucket_size: int) -> None:
    codec = codecs.get_value_codec("qsgd", bits=bits, bucket_size=bucket_size, seed=3)
    check_config(codec)
    check_value_codec(codec, qsgd_bound(bits, bucket_size))


def test_contract_fresh_randomness() -> None:
    codec = codecs.get_value_codec("qsgd")
    check_config(codec)
    check_value_codec(codec, qsgd_bound(4, 512))


@pytest.mark.parametrize("bits", range(2, 9))
def test_bound_and_size_every_bit_width(bits: int) -> None:
    values = torch.randn(10_000, generator=torch.Generator().manual_seed(bits)) ** 3
    codec = QSGDCodec(bits=bits, bucket_size=256, seed=bits)
    data, received = codec.encode_with_reconstruction(values)
    assert len(data) == 5 + 4 * 40 + (10_000 * bits + 7) // 8
    error = (received.double() - values.double()).abs()
    assert bool((error <= qsgd_bound(bits, 256)(values)).all())
    assert torch.equal(codec.decode(memoryview(data), values.numel(), values.dtype), received)
    # every decoded value is one of its bucket's 2s + 1 levels: sign * l * norm / s
    s = 2 ** (bits - 1) - 1
    norms = torch.from_numpy(np.frombuffer(data[5 : 5 + 160], dtype="<f4").astype(np.float64))
    scaled = received.double() / norms[torch.arange(10_000) // 256] * s
    assert torch.allclose(scaled, scaled.round(), atol=1e-4)


def test_unbiased() -> None:
    """The mean over many seeds converges to the input (z-score of every element < 5)."""
    values = torch.randn(64, generator=torch.Generator().manual_seed(0))
    bits, bucket = 3, 16
    s = 2 ** (bits - 1) - 1
    runs = 2000
    sections = [QSGDCodec(bits=bits, bucket_size=bucket, seed=seed).encode(values) for seed in range(runs)]
    decoded = torch.stack([QSGDCodec().decode(memoryview(data), 64, torch.float32) for data in sections]).double()
    norms = torch.from_numpy(np.frombuffer(sections[0][5 : 5 + 16], dtype="<f4").astype(np.float64))
    norm_of = norms.repeat_interleave(bucket)
    ratio = values.double().abs() / norm_of * s
    fraction = ratio - ratio.floor()
    std = norm_of / s * torch.sqrt(fraction * (1 - fraction)) / runs**0.5
    mean = decoded.mean(dim=0)
    deterministic = std == 0
    assert torch.allclose(mean[deterministic], values.double()[deterministic], atol=1e-6)
    z = ((mean - values.double()) / std)[~deterministic]
    assert float(z.abs().max()) < 5.0
    assert abs(float(z.mean())) < 4.0 / (z.numel() ** 0.5)  # no systematic bias either


def test_seed_reproducible_and_none_fresh() -> None:
    values = torch.randn(1000)
    assert QSGDCodec(seed=7).encode(values) == QSGDCodec(seed=7).encode(values)
    assert QSGDCodec(seed=7).encode(values) != QSGDCodec(seed=8).encode(values)
    fresh = QSGDCodec()
    assert fresh.encode(values) != fresh.encode(values)


def test_option_ranges() -> None:
    for bits in (1, 9, 0, 2.5, True, "4"):
        with pytest.raises(ValueError, match="bits"):
            QSGDCodec(bits=bits)
    for bucket_size in (0, -1, 1 << 32, 1.5, False):
        with pytest.raises(ValueError, match="bucket_size"):
            QSGDCodec(bucket_size=bucket_size)
    for seed in (-1, 1.5, True):
        with pytest.raises(ValueError, match="seed"):
            QSGDCodec(seed=seed)
    assert QSGDCodec(bits=2).bits == 2 and QSGDCodec(bits=8).bits == 8


def test_nonfinite_and_out_of_range_refused() -> None:
    for bad in (torch.tensor([1.0, float("nan")]), torch.tensor([float("inf")]),
                torch.tensor([1e300], dtype=torch.float64)):
        with pytest.raises(ValueError):
            QSGDCodec().encode(bad)


def test_float16_large_buckets_do_not_overflow() -> None:
    values = torch.full((8,), 60000.0, dtype=torch.float16)
    for seed in range(5):
        received = QSGDCodec(bits=2, seed=seed).encode_with_reconstruction(values)[1]
        assert bool(torch.isfinite(received).all())


def test_hostile_sections() -> None:
    codec = QSGDCodec()
    header = bytes([4]) + (1).to_bytes(4, "little")
    with pytest.raises(DecodeError):
        codec.decode(memoryview(header), 1 << 40, torch.float32)  # claims a huge count
    huge_bucket = bytes([4]) + (2**32 - 1).to_bytes(4, "little") + np.float32(1).tobytes() + b"\x03"
    assert codec.decode(memoryview(huge_bucket), 1, torch.float32).item() == pytest.approx(3 / 7)
    for bad in (
        bytes([9]) + header[1:] + np.float32(1).tobytes() + b"\x01",  # bits out of range
        bytes([4]) + (0).to_bytes(4, "little") + b"\x01",  # bucket size 0
        header + np.float32(np.nan).tobytes() + b"\x01",  # NaN norm
        header + np.float32(-1).tobytes() + b"\x01",  # negative norm
        header + np.float32(1).tobytes() + b"\x11",  # non-zero padding bits
    ):
        with pytest.raises(DecodeError):
            codec.decode(memoryview(bad), 1, torch.float32)


def test_fuzz_decode() -> None:
    seeds = [
        (QSGDCodec(bits=bits, bucket_size=bucket, seed=0).encode(values), values.numel(), values.dtype)
        for bits, bucket, values in ((4, 16, torch.randn(50)), (2, 3, torch.randn(7).half()), (8, 512, torch.zeros(0)))
    ]
    fuzz_decoder(QSGDCodec, seeds)
