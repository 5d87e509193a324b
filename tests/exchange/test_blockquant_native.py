"""The one-pass blockwise kernels against the torch path of :mod:`gradwire.exchange.blockquant`,
bit for bit: scales, packed codes, decoded values, on inputs built to hit every branch (NaN, Inf,
zero and subnormal blocks, round-half-to-even ties, odd lengths, segments, hostile bytes)."""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from gradwire import kernels
from gradwire.exchange import blockquant
from gradwire.exchange.blockquant import LEVELS, dequantize, quantize, quantized_bytes, roundtrip

pytestmark = pytest.mark.skipif(not kernels.available(), reason="GRADWIRE_NATIVE=0")


def _adversarial(rows: int, n: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=generator) * torch.logspace(-30, 30, n).roll(seed % max(n, 1))
    if n >= 40:
        x[0, 3] = float("nan")
        x[-1, 17] = float("inf")
        x[0, 20:30] = 0.0  # a zero block where block_size <= 10
        x[-1, 31:35] = 1e-44  # subnormals
        x[0, 36:40] = torch.tensor([2.5, -2.5, 0.5, 127.0])  # ties once scaled by 1
    return x


def _both(fn, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    native = fn()
    with monkeypatch.context() as patched:
        patched.setattr(kernels, "available", lambda: False)
        reference = fn()
    return native, reference


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.view(torch.uint8 if a.dtype == torch.uint8 else
                                                                 torch.int32).equal(
        b.view(torch.uint8 if b.dtype == torch.uint8 else torch.int32))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n, block_size, segments", [
    (1, 1, None), (7, 3, None), (129, 128, None), (257, 64, None), (1000, 7, [1, 0, 500, 3, 496]),
    (63, 128, [10, 53]), (300, 16, [17, 33, 250]), (2048, 128, None),
])
def test_native_quantize_roundtrip_and_dequantize_equal_the_torch_path(
        monkeypatch: pytest.MonkeyPatch, bits: int, n: int, block_size: int, segments: Optional[list[int]]) -> None:
    for seed in range(3):
        x = _adversarial(3, n, seed)
        packed, reference = _both(lambda: quantize(x, bits=bits, block_size=block_size, segments=segments),
                                  monkeypatch)
        assert packed.shape[-1] == quantized_bytes(n, bits, block_size, segments)
        assert torch.equal(packed, reference), (seed, (packed != reference).nonzero()[:5])
        (native_packed, native_local), (torch_packed, torch_local) = _both(
            lambda: roundtrip(x, bits=bits, block_size=block_size, segments=segments), monkeypatch)
        assert torch.equal(native_packed, torch_packed)
        assert _same(native_local, torch_local)  # bit for bit, NaN included
        decoded, reference_decoded = _both(
            lambda: dequantize(packed, n, bits=bits, block_size=block_size, segments=segments), monkeypatch)
        assert _same(decoded, reference_decoded)
        assert _same(decoded, native_local)


@pytest.mark.parametrize("bits", [8, 4])
def test_native_decoding_of_hostile_bytes_clamps_as_the_torch_path(monkeypatch: pytest.MonkeyPatch,
                                                                   bits: int) -> None:
    """Codes of -128 or the nibble 8 (no encoder writes them) and arbitrary scale bytes."""
    n, block_size = 301, 32
    generator = torch.Generator().manual_seed(5)
    data = torch.randint(0, 256, (4, quantized_bytes(n, bits, block_size)), dtype=torch.uint8, generator=generator)
    scales = torch.tensor([1.0, -3.0, 0.0, 2.0 ** -140], dtype=torch.float32)
    data[:, :16] = scales.view(torch.uint8)  # some readable scales among random ones
    decoded, reference = _both(lambda: dequantize(data, n, bits=bits, block_size=block_size), monkeypatch)
    assert _same(decoded, reference)
    finite = decoded[torch.isfinite(decoded)]
    assert finite.numel() and bool((finite.abs() <= finite.abs().max()).all())


def test_the_kernel_is_what_runs_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    original = kernels.block_quantize
    monkeypatch.setattr(kernels, "block_quantize", lambda *a, **k: calls.append(1) or original(*a, **k))
    quantize(torch.ones(10), bits=8, block_size=4)
    assert calls == [1]
    assert LEVELS[4] == 7 and blockquant._native(torch.ones(1))
