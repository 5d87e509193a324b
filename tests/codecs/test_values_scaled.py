"""fp16-scaled: fp16 precision over float32's range (a power-of-two scale per payload section)."""

from __future__ import annotations

import torch

import gradwire.codecs as codecs

from .contract import check_config, check_value_codec


def scaled_bound(values: torch.Tensor) -> torch.Tensor:
    """Half an fp16 ulp of each scaled value, scaled back: 2**-11 relative for normal values, and
    at most max|v| * 2**-39 absolute where the scaled value is an fp16 subnormal."""
    magnitudes = values.double().abs()
    finite = magnitudes[torch.isfinite(magnitudes)]
    largest = float(finite.max()) if finite.numel() else 0.0
    return torch.maximum(magnitudes * 2.0**-11, torch.full_like(magnitudes, largest * 2.0**-39))


def test_contract() -> None:
    codec = codecs.get_value_codec("fp16-scaled")
    check_config(codec)
    check_value_codec(codec, scaled_bound)


def test_small_gradients_keep_fp16_precision_where_plain_fp16_loses_them() -> None:
    values = torch.randn(10_000, generator=torch.Generator().manual_seed(1)) * 1e-7  # below fp16's normal range
    scaled = codecs.get_value_codec("fp16-scaled")
    plain = codecs.get_value_codec("fp16")
    _, scaled_back = scaled.encode_with_reconstruction(values)
    _, plain_back = plain.encode_with_reconstruction(values)
    relative = lambda back: float(((back - values).abs() / values.abs()).median())  # noqa: E731
    assert relative(scaled_back) < 2.0**-11
    assert relative(plain_back) > 2.0**-6  # subnormal fp16: a few bits left
    assert len(scaled.encode(values)) == 1 + 2 * values.numel()
