"""``zstd`` and ``deflate``: lossless value compression (one module, tested together)."""

from __future__ import annotations

import zlib

import pytest
import torch
import zstandard

import gradwire.codecs as codecs
from gradwire.errors import DecodeError

from .contract import check_config, check_value_codec
from .value_helpers import DTYPES, fuzz_decoder

NAMES = ["zstd", "deflate"]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("shuffle", [True, False])
def test_contract(name: str, shuffle: bool) -> None:
    codec = codecs.get_value_codec(name, shuffle=shuffle, level=1)
    check_config(codec)
    check_value_codec(codec)
    assert codec.lossless


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_bit_exact_every_dtype_with_nan_payloads(name: str, dtype: torch.dtype) -> None:
    codec = codecs.get_value_codec(name)
    width = {2: torch.int16, 4: torch.int32, 8: torch.int64}[torch.finfo(dtype).bits // 8]
    values = (torch.randn(1000, generator=torch.Generator().manual_seed(1)) * 1e-3).to(dtype)
    bits = values.view(width).clone()
    bits[:5] = torch.tensor([-1, 1 << (torch.finfo(dtype).bits - 2), 0, -(1 << (torch.finfo(dtype).bits - 1)), 7])
    values = bits.view(dtype)  # odd NaN payloads, -0.0, a subnormal
    out = codec.decode(memoryview(codec.encode(values)), values.numel(), dtype)
    assert torch.equal(out.view(width), values.view(width))


@pytest.mark.parametrize("name", NAMES)
def test_shuffle_helps_on_gradients(name: str) -> None:
    values = torch.randn(50_000, generator=torch.Generator().manual_seed(0)) * 1e-3
    shuffled = len(codecs.get_value_codec(name, shuffle=True).encode(values))
    plain = len(codecs.get_value_codec(name, shuffle=False).encode(values))
    assert shuffled < plain < 4 * values.numel()


def test_level_option_range() -> None:
    for name, good, bad in (("zstd", (1, 22), (0, 23, -1)), ("deflate", (0, 9), (-1, 10))):
        for level in good:
            assert codecs.get_value_codec(name, level=level).level == level
        for level in (*bad, 2.5, True, "3"):
            with pytest.raises(ValueError, match="level"):
                codecs.get_value_codec(name, level=level)
    with pytest.raises(ValueError, match="shuffle"):
        codecs.get_value_codec("zstd", shuffle=1)


def test_zstd_bombs_and_inconsistent_frames_raise() -> None:
    codec = codecs.get_value_codec("zstd")
    bomb = b"\x01" + zstandard.ZstdCompressor().compress(bytes(50_000_000))
    assert len(bomb) < 10_000
    with pytest.raises(DecodeError, match="declares"):
        codec.decode(memoryview(bomb), 100, torch.float32)
    unknown_size = b"\x01" + zstandard.ZstdCompressor(write_content_size=False).compress(bytes(400))
    with pytest.raises(DecodeError):
        codec.decode(memoryview(unknown_size), 100, torch.float32)
    good = codec.encode(torch.ones(100))
    with pytest.raises(DecodeError):
        codec.decode(memoryview(good + b"\0"), 100, torch.float32)  # trailing bytes
    with pytest.raises(DecodeError):
        codec.decode(memoryview(good[:-1]), 100, torch.float32)
    with pytest.raises(DecodeError):
        codec.decode(memoryview(b"\x02" + good[1:]), 100, torch.float32)  # unknown flag
    with pytest.raises(DecodeError):
        codec.decode(memoryview(b"\x01"), 1, torch.float32)
    with pytest.raises(DecodeError):
        codec.decode(memoryview(good), 1 << 40, torch.float32)


def test_deflate_bombs_and_inconsistent_streams_raise() -> None:
    codec = codecs.get_value_codec("deflate")
    compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
    bomb = b"\x01" + compressor.compress(bytes(50_000_000)) + compressor.flush()
    assert len(bomb) < 100_000
    with pytest.raises(DecodeError, match="more than"):
        codec.decode(memoryview(bomb), 100, torch.float32)
    good = codec.encode(torch.arange(100.0))
    assert torch.equal(codec.decode(memoryview(good), 100, torch.float32), torch.arange(100.0))
    for bad, count in ((good + b"\0", 100), (good[:-1], 100), (good, 99), (good, 101), (b"\x00\x03\x00", 1)):
        with pytest.raises(DecodeError):
            codec.decode(memoryview(bad), count, torch.float32)


@pytest.mark.parametrize("name", NAMES)
def test_fuzz_decode(name: str) -> None:
    codec = codecs.get_value_codec(name)
    seeds = [
        (codec.encode(values), values.numel(), values.dtype)
        for values in (torch.randn(50), torch.randn(20).half(), torch.zeros(0), torch.randn(3).double())
    ]
    fuzz_decoder(lambda: type(codec)(), seeds)
