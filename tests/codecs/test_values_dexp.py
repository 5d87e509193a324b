"""``dexp``: double-exponential fit -- guaranteed tolerance, fit quality, hostile sections."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gradwire.codecs.bits import pack_uint
from gradwire.codecs.values import _fit
from gradwire.codecs.values.dexp import DoubleExpCodec, DoubleExpModel
from gradwire.errors import DecodeError

from .contract import check_config, check_value_codec
from .value_helpers import DTYPES, fuzz_decoder, relative_bound


@pytest.mark.parametrize("tolerance", [0.05, 1e-3])
def test_contract(tolerance: float) -> None:
    codec = DoubleExpCodec(tolerance=tolerance)
    check_config(codec)
    check_value_codec(codec, relative_bound(tolerance))


def test_recovers_a_double_exponential_in_one_segment() -> None:
    t = np.linspace(0.0, 1.0, 2000)
    curve = 0.9 * np.exp(-6.0 * t) - 0.05 * np.exp(3.0 * t)
    params = DoubleExpModel().fit(curve, _fit.Batch.of(np.array([2000])), 1)
    fitted = DoubleExpModel().evaluate(params.astype(np.float32).astype(np.float64), _fit.Batch.of(np.array([2000])))
    assert np.abs(fitted - curve).max() < 1e-3


@pytest.mark.parametrize("tolerance", [0.1, 0.02, 1e-3])
def test_bound_holds_on_the_fitted_path(tolerance: float) -> None:
    generator = torch.Generator().manual_seed(3)
    for values in (torch.randn(3000, generator=generator) * 1e-3, torch.randn(3000, generator=generator) ** 3):
        data, received = _fit.encode_fit(values, DoubleExpModel(), tolerance, allow_plain=False)
        decoded = DoubleExpCodec().decode(memoryview(data), values.numel(), values.dtype)
        assert torch.equal(decoded, received)
        assert (decoded.double() - values.double()).abs().max() <= tolerance * values.double().abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_and_size(dtype: torch.dtype) -> None:
    values = (torch.randn(5000, generator=torch.Generator().manual_seed(4)) ** 3).to(dtype)
    data, received = DoubleExpCodec(level_layout=False).encode_with_reconstruction(values)
    assert data[0] == _fit.MODE_FITTED and len(data) < 2 * values.numel()  # 13-bit ranks beat float16
    decoded = DoubleExpCodec().decode(memoryview(data), values.numel(), dtype)
    assert torch.equal(decoded.view(torch.uint8), received.view(torch.uint8))
    assert (decoded.double() - values.double()).abs().max() <= 0.05 * values.double().abs().max()


def test_options_and_nonfinite() -> None:
    for tolerance in (0, 2, None, False):
        with pytest.raises(ValueError, match="tolerance"):
            DoubleExpCodec(tolerance=tolerance)
    with pytest.raises(ValueError):
        DoubleExpCodec().encode(torch.tensor([float("inf"), 1.0]))
    with pytest.raises(ValueError, match="level_layout"):
        DoubleExpCodec(level_layout=1)


def test_levels_layout_at_large_k() -> None:
    values = torch.randn(1 << 17, generator=torch.Generator().manual_seed(8)) * 1e-3
    data, received = DoubleExpCodec().encode_with_reconstruction(values)
    assert data[0] == _fit.MODE_LEVELS and 8 * len(data) / values.numel() < 4.0
    assert torch.equal(DoubleExpCodec().decode(memoryview(data), values.numel(), values.dtype), received)
    assert (received - values).abs().max() <= 0.05 * values.abs().max()


def test_hostile_sections() -> None:
    values = torch.randn(400) ** 3
    data = _fit.encode_fit(values, DoubleExpModel(), 0.05, allow_plain=False)[0]
    wrong_p = bytearray(data)
    wrong_p[3] = 3  # dexp always writes 4 parameters
    with pytest.raises(DecodeError):
        DoubleExpCodec().decode(memoryview(bytes(wrong_p)), 400, torch.float32)
    with pytest.raises(DecodeError):
        DoubleExpCodec().decode(memoryview(data), 401, torch.float32)
    # huge but finite rates evaluate to Inf/NaN values without raising anything else
    header = _fit._FITTED_HEADER.pack(_fit.MODE_FITTED, 0, 4, 1)
    section = header + pack_uint(np.array([8]), 4) + b"\x00" + np.array([1e30, 3e38, -1e30, -3e38], "<f4").tobytes()
    section += pack_uint(np.arange(8), 3)
    out = DoubleExpCodec().decode(memoryview(section), 8, torch.float32)
    assert out.shape == (8,)


def test_fuzz_decode() -> None:
    seeds = [
        (_fit.encode_fit(values, DoubleExpModel(), 0.05, allow_plain=False)[0], values.numel(), values.dtype)
        for values in (torch.randn(300) ** 3, torch.randn(40).bfloat16())
    ] + [(DoubleExpCodec().encode(torch.randn(5).double()), 5, torch.float64)]
    fuzz_decoder(DoubleExpCodec, seeds, max_examples=200)
