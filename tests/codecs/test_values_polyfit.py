"""``polyfit``: guaranteed tolerance, permutation accounting, fallbacks, hostile sections.

The shared fitting machinery (``values/_fit.py``) is exercised here; ``dexp`` adds its model.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gradwire.codecs as codecs
from gradwire.codecs.bits import pack_uint, unpack_uint
from gradwire.codecs.values import _fit
from gradwire.codecs.values.polyfit import ChebyshevModel, PolyFitCodec
from gradwire.errors import DecodeError

from .contract import check_config, check_value_codec
from .value_helpers import DTYPES, fuzz_decoder, relative_bound


def gradient_like(k: int, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"normal": torch.randn(k, generator=generator) * 1e-3, "heavy": torch.randn(k, generator=generator) ** 3}


def mode(data: bytes) -> int:
    return data[0]


@pytest.mark.parametrize("tolerance", [0.05, 1e-3])
def test_contract(tolerance: float) -> None:
    codec = PolyFitCodec(tolerance=tolerance)
    check_config(codec)
    check_value_codec(codec, relative_bound(tolerance))


def test_smaller_than_fp32_on_gradients() -> None:
    for label, values in gradient_like(100_000).items():
        data, received = PolyFitCodec().encode_with_reconstruction(values)
        assert len(data) < 4 * values.numel(), label
        assert float((received - values).abs().max()) <= 0.05 * float(values.abs().max())


def test_fits_and_beats_fp16_when_the_permutation_is_cheap() -> None:
    """At k = 5000 the ranks cost 13 bits: the fitted layout wins over float16."""
    for label, values in gradient_like(5000, seed=1).items():
        data = PolyFitCodec(level_layout=False).encode(values)
        assert mode(data) == _fit.MODE_FITTED, label
        assert len(data) < 2 * values.numel(), label


@pytest.mark.parametrize("tolerance", [0.2, 0.05, 0.01, 1e-3, 1e-4])
@pytest.mark.parametrize("degree", [0, 3, 6])
def test_bound_holds_on_the_fitted_path(tolerance: float, degree: int) -> None:
    """Forced fitted layout (no plain fallback): every element within tolerance * max|v|."""
    model = ChebyshevModel(degree + 1)
    for label, values in gradient_like(3000, seed=degree).items():
        data, received = _fit.encode_fit(values, model, tolerance, allow_plain=False)
        assert mode(data) == _fit.MODE_FITTED
        decoded = PolyFitCodec().decode(memoryview(data), values.numel(), values.dtype)
        assert torch.equal(decoded, received), label
        error = (decoded.double() - values.double()).abs().max().item()
        assert error <= tolerance * values.double().abs().max().item(), (label, error)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_on_the_fitted_path(dtype: torch.dtype) -> None:
    values = (torch.randn(2000, generator=torch.Generator().manual_seed(5)) ** 3).to(dtype)
    for tolerance in (0.05, 1e-3):
        data, received = _fit.encode_fit(values, ChebyshevModel(4), tolerance, allow_plain=False)
        decoded = PolyFitCodec().decode(memoryview(data), values.numel(), dtype)
        assert decoded.dtype == dtype and torch.equal(decoded.view(torch.uint8), received.view(torch.uint8))
        assert (decoded.double() - values.double()).abs().max() <= tolerance * values.double().abs().max()


def test_huge_and_tiny_float64_scales() -> None:
    for scale in (1e300, 1e-300, 1e-310):
        values = torch.randn(1000, dtype=torch.float64, generator=torch.Generator().manual_seed(2)) * scale
        data, received = _fit.encode_fit(values, ChebyshevModel(4), 0.01, allow_plain=False)
        assert torch.equal(PolyFitCodec().decode(memoryview(data), 1000, torch.float64), received)
        assert (received - values).abs().max() <= 0.01 * values.abs().max()


def test_permutation_is_counted_in_the_section() -> None:
    values = gradient_like(4096)["normal"]
    data = _fit.encode_fit(values, ChebyshevModel(4), 0.05, allow_plain=False)[0]
    assert len(data) >= 4096 * 12 // 8  # 12-bit ranks


def test_plain_fallback_for_tiny_inputs_and_tight_tolerance() -> None:
    one = torch.tensor([0.25])
    assert mode(PolyFitCodec().encode(one)) == _fit.MODE_PLAIN
    values = gradient_like(30_000)["normal"]
    # float16 cannot meet 1e-5 near max|v|: whatever is chosen meets it and costs <= float32
    data, received = PolyFitCodec(tolerance=1e-5).encode_with_reconstruction(values)
    assert len(data) <= 4 + 4 * values.numel()
    assert (received - values).abs().max() <= 1e-5 * values.abs().max()
    values = gradient_like(100_000)["normal"]
    data = PolyFitCodec(level_layout=False).encode(values)  # 17-bit ranks cost more than float16
    assert mode(data) == _fit.MODE_PLAIN and data[1] == _fit.KIND_F16


def test_degree_and_tolerance_options() -> None:
    for degree in (-1, 11, 2.0, True):
        with pytest.raises(ValueError, match="degree"):
            PolyFitCodec(degree=degree)
    for tolerance in (0, -0.1, 1.5, float("nan"), True, "0.1"):
        with pytest.raises(ValueError, match="tolerance"):
            PolyFitCodec(tolerance=tolerance)
    # a section written with degree 5 decodes on a default instance: P travels in the section
    values = gradient_like(3000)["heavy"]
    data, received = PolyFitCodec(degree=5, level_layout=False).encode_with_reconstruction(values)
    assert mode(data) == _fit.MODE_FITTED and data[3] == 6
    assert torch.equal(PolyFitCodec().decode(memoryview(data), 3000, torch.float32), received)


@pytest.mark.parametrize("k", [1 << 16, 1 << 18])
def test_levels_layout_beats_fp16_at_large_k_within_the_bound(k: int) -> None:
    """Issue 12: the fit pays at any k. The levels layout costs < 4 bits per value here, far below
    float16's 16 and the 16-18 bits the ranks alone would cost; the bound still holds."""
    for label, values in gradient_like(k, seed=7).items():
        data, received = PolyFitCodec().encode_with_reconstruction(values)
        assert mode(data) == _fit.MODE_LEVELS, label
        assert 8 * len(data) / k < 4.0, label
        assert torch.equal(PolyFitCodec().decode(memoryview(data), k, values.dtype), received)
        assert (received.double() - values.double()).abs().max() <= 0.05 * values.double().abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tolerance", [0.3, 0.05, 1e-3, 1e-4])
def test_levels_layout_bound_every_dtype(dtype: torch.dtype, tolerance: float) -> None:
    values = (torch.randn(20_000, generator=torch.Generator().manual_seed(6)) ** 3).to(dtype)
    data, received = PolyFitCodec(tolerance=tolerance).encode_with_reconstruction(values)
    decoded = PolyFitCodec().decode(memoryview(data), values.numel(), dtype)
    assert torch.equal(decoded.view(torch.uint8), received.view(torch.uint8))
    assert (decoded.double() - values.double()).abs().max() <= tolerance * values.double().abs().max()
    if tolerance >= 0.05:
        assert mode(data) == _fit.MODE_LEVELS


def test_levels_layout_hostile_sections() -> None:
    values = gradient_like(5000)["heavy"]
    data = PolyFitCodec().encode(values)
    assert mode(data) == _fit.MODE_LEVELS
    for count in (4999, 5001, 1 << 40):
        with pytest.raises(DecodeError):
            PolyFitCodec().decode(memoryview(data), count, torch.float32)
    for bad_step in (0.0, -1.0, float("inf"), float("nan")):
        hostile = data[:3] + np.float32(bad_step).tobytes() + data[7:]
        with pytest.raises(DecodeError, match="step"):
            PolyFitCodec().decode(memoryview(hostile), 5000, torch.float32)
    with pytest.raises(DecodeError):
        PolyFitCodec().decode(memoryview(data[:7] + b"\x00\x00" + data[9:]), 5000, torch.float32)


def test_nonfinite_refused() -> None:
    with pytest.raises(ValueError):
        PolyFitCodec().encode(torch.tensor([1.0, float("nan")]))


def test_evaluation_is_batch_independent_and_exp_is_accurate() -> None:
    """The guarantee rests on per-element determinism: evaluating segments alone or together
    gives the same bits."""
    rng = np.random.default_rng(0)
    model = ChebyshevModel(6)
    lengths = rng.integers(1, 300, 40)
    params = rng.standard_normal((40, 6)).astype(np.float32).astype(np.float64)
    together = model.evaluate(params, _fit.Batch.of(lengths))
    alone = np.concatenate([model.evaluate(params[i : i + 1], _fit.Batch.of(lengths[i : i + 1])) for i in range(40)])
    assert np.array_equal(together, alone)
    z = rng.uniform(-700, 700, 10_000)
    assert np.allclose(_fit.det_exp(z), np.exp(z), rtol=4e-16, atol=0)
    assert np.array_equal(_fit.det_exp(z)[1:7], _fit.det_exp(z[1:7]))


def test_hostile_sections() -> None:
    codec = PolyFitCodec()
    values = gradient_like(500)["normal"]
    fitted = _fit.encode_fit(values, ChebyshevModel(4), 0.05, allow_plain=False)[0]
    assert codec.decode(memoryview(fitted), 500, torch.float32).shape == (500,)
    with pytest.raises(DecodeError):
        codec.decode(memoryview(fitted), 1 << 40, torch.float32)
    with pytest.raises(DecodeError):
        codec.decode(memoryview(fitted[:4] + (1 << 31).to_bytes(4, "little") + fitted[8:]), 500, torch.float32)
    bad_model = bytearray(fitted)
    bad_model[3] = 12  # 12 parameters: degree 11 is not written by any codec
    with pytest.raises(DecodeError):
        codec.decode(memoryview(bytes(bad_model)), 500, torch.float32)
    # ranks that are not a permutation: duplicate the first rank into the second
    ranks = np.frombuffer(fitted[-((500 * 9 + 7) // 8):], dtype=np.uint8)
    values_ranks = unpack_uint(ranks, 500, 9)
    values_ranks[1] = values_ranks[0]
    broken = fitted[: -len(ranks)] + pack_uint(values_ranks, 9)
    with pytest.raises(DecodeError, match="permutation"):
        codec.decode(memoryview(broken), 500, torch.float32)
    plain = PolyFitCodec().encode(torch.ones(3))
    for bad in (b"", b"\x02", b"\x00\x04\x00\x00", b"\x00\x03\x01\x00" + bytes(12)):
        with pytest.raises(DecodeError):
            codec.decode(memoryview(bad), 3, torch.float32)
    assert codec.decode(memoryview(plain), 3, torch.float32).tolist() == [1.0, 1.0, 1.0]


def test_fuzz_decode() -> None:
    seeds = [
        (_fit.encode_fit(values, ChebyshevModel(degree + 1), 0.05, allow_plain=False)[0], values.numel(), values.dtype)
        for degree, values in ((3, torch.randn(300) ** 3), (0, torch.randn(40).half()), (2, torch.randn(3).double()))
    ] + [(PolyFitCodec().encode(torch.randn(5)), 5, torch.float32),
         (PolyFitCodec().encode(torch.randn(300) ** 3), 300, torch.float32),  # the levels layout
         (PolyFitCodec(tolerance=0.01).encode(torch.randn(200).bfloat16()), 200, torch.bfloat16)]
    assert {seed[0][0] for seed in seeds} == {_fit.MODE_PLAIN, _fit.MODE_FITTED, _fit.MODE_LEVELS}
    fuzz_decoder(PolyFitCodec, seeds, max_examples=250)


def test_registered() -> None:
    assert codecs.get_value_codec("polyfit", tolerance=0.1).tolerance == 0.1
    assert PolyFitCodec.wire_id == 7 and not PolyFitCodec.lossless
