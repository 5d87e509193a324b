"""The one shared round-trip helper every codec passes (in the manner of numcodecs' tests/common.py).

* :func:`index_cases` / :func:`check_index_codec`: the edge-case matrix for index codecs — empty
  set, one element, all elements, first/last position, n = 1, n near 2**31, random sets at
  several densities. Lossless codecs must return the exact set; lossy ones (Bloom) must return
  the positions their encoder said it sends, and those must contain... whatever their policy
  promises (checked in their own tests).
* :func:`check_value_codec`: float16/bfloat16/float32 inputs, empty, one value, NaN/Inf.
  Lossless codecs are bit-exact (NaN payloads included); lossy codecs either refuse non-finite
  input with ValueError or keep it, and stay within the ``bound`` their test passes in.
* :func:`check_config`: get_config/from_config round-trips and names the codec.
* :func:`check_rejects_corruption`: truncations and bit flips of a payload raise DecodeError.
"""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np
import pytest
import torch

import gradwire.codecs as codecs
from gradwire.codecs.base import Codec, IndexCodec, ValueCodec
from gradwire.errors import DecodeError


def index_cases(seed: int = 0) -> Iterator[tuple[str, np.ndarray, int]]:
    """(label, sorted unique int64 indices, numel) covering the edge cases."""
    rng = np.random.default_rng(seed)
    yield "empty", np.zeros(0, dtype=np.int64), 1000
    yield "empty-n0", np.zeros(0, dtype=np.int64), 0
    yield "n1-one", np.array([0], dtype=np.int64), 1
    yield "n1-empty", np.zeros(0, dtype=np.int64), 1
    yield "one-first", np.array([0], dtype=np.int64), 1000
    yield "one-last", np.array([999], dtype=np.int64), 1000
    yield "first-and-last", np.array([0, 999], dtype=np.int64), 1000
    yield "all", np.arange(777, dtype=np.int64), 777
    yield "all-but-one", np.delete(np.arange(500, dtype=np.int64), 250), 500
    yield "dense-run", np.arange(100, 400, dtype=np.int64), 1000
    big = (1 << 31) - 3
    yield "near-2^31", np.array([0, 17, big - 2, big - 1], dtype=np.int64), big
    for density in (0.001, 0.01, 0.1, 0.5):
        n = 200_003
        k = max(1, int(n * density))
        yield f"random-{density}", np.sort(rng.choice(n, size=k, replace=False)).astype(np.int64), n
    clustered = np.unique(np.concatenate([np.arange(5000, 5300), rng.integers(0, 1 << 20, 3000)]))
    yield "clustered", clustered.astype(np.int64), 1 << 20


def roundtrip_indices(codec: IndexCodec, indices: np.ndarray, numel: int) -> tuple[np.ndarray, np.ndarray]:
    """Through the full payload: (positions the encoder says it sends, positions decoded)."""
    values = torch.arange(indices.size, dtype=torch.float32)
    encoded = codecs.encode_tensors([(values, torch.from_numpy(indices), numel)], codec, codecs.get_value_codec("fp32"))
    _, decoded, decoded_numel = codecs.decode(encoded.payload)
    assert decoded_numel == numel
    return encoded.tensors[0].indices.numpy(), decoded.numpy()


#: Codecs that query every position get the near-2**31 case in a slow test of their own.
SCAN_LIMIT = 1 << 26


def check_index_codec(codec: IndexCodec, *, max_numel: int | None = None) -> None:
    """Every edge case round-trips through a payload; lossless codecs return the input set."""
    if max_numel is None:
        max_numel = SCAN_LIMIT if codec.scans_every_position else 1 << 62
    for label, indices, numel in index_cases():
        if numel > max_numel:
            continue
        sent, decoded = roundtrip_indices(codec, indices, numel)
        assert decoded.dtype == np.int64, label
        np.testing.assert_array_equal(decoded, sent, err_msg=f"{codec!r} on {label}: decoded != sent")
        if codec.lossless:
            np.testing.assert_array_equal(decoded, indices, err_msg=f"{codec!r} on {label}")
        check_rejects_corruption(codecs.encode(torch.ones(indices.size), torch.from_numpy(indices), numel,
                                               index_codec=codec))


def value_cases(seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """(label, 1-D float tensor) — finite cases only; non-finite ones are in :func:`nonfinite_cases`."""
    generator = torch.Generator().manual_seed(seed)
    yield "empty", torch.zeros(0)
    yield "one", torch.tensor([0.25])
    yield "zeros", torch.zeros(64)
    yield "constant", torch.full((100,), -3.5)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        yield f"normal-{dtype}", (torch.randn(5000, generator=generator) * 1e-3).to(dtype)
    yield "heavy-tailed", torch.randn(20_000, generator=generator) ** 3
    yield "mixed-scale", torch.cat([torch.randn(100, generator=generator) * 1e3, torch.randn(100, generator=generator) * 1e-6])


def nonfinite_cases() -> Iterator[tuple[str, torch.Tensor]]:
    yield "nan-inf", torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), -0.0, 2.0])
    yield "nan-f16", torch.tensor([float("nan"), 1.0], dtype=torch.float16)


def roundtrip_values(codec: ValueCodec, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Through the full payload: (what the encoder says arrives, what decodes)."""
    indices = torch.arange(values.numel(), dtype=torch.int64)
    encoded = codecs.encode_tensors([(values, indices, values.numel())], codecs.get_index_codec("raw"), codec)
    decoded, _, _ = codecs.decode(encoded.payload)
    return encoded.tensors[0].values, decoded


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    width = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return bool(torch.equal(a.view(width), b.view(width)))


def check_value_codec(codec: ValueCodec, bound: "Callable[[torch.Tensor], torch.Tensor] | None" = None) -> None:
    """Round-trip the value matrix. ``bound(values)`` gives the allowed per-element absolute error
    (shape (k,)) for lossy codecs; lossless codecs must be bit-exact, NaN included."""
    assert codec.lossless or bound is not None, f"lossy codec {codec!r} must state an error bound"
    for label, values in value_cases():
        sent, decoded = roundtrip_values(codec, values)
        assert decoded.dtype == values.dtype and decoded.shape == values.shape, label
        assert _same_bits(decoded, sent), f"{codec!r} on {label}: decoded differs from what the encoder reported"
        if codec.lossless:
            assert _same_bits(decoded, values), f"{codec!r} on {label}: not bit-exact"
        else:
            error = (decoded.double() - values.double()).abs()
            allowed = bound(values).double() if values.numel() else error
            assert bool((error <= allowed + 1e-12).all()), (
                f"{codec!r} on {label}: max error {error.max().item():.3g} exceeds its bound"
            )
    for label, values in nonfinite_cases():
        if codec.lossless:
            sent, decoded = roundtrip_values(codec, values)
            assert _same_bits(decoded, values), f"{codec!r} on {label}: NaN/Inf not kept bit-exact"
        else:
            try:
                _, decoded = roundtrip_values(codec, values)
            except ValueError as error:
                assert not isinstance(error, DecodeError)
                continue
            finite = torch.isfinite(values)
            assert torch.equal(torch.isnan(decoded), torch.isnan(values)), f"{codec!r} on {label}: NaN moved"
            assert torch.equal(decoded[~finite & ~torch.isnan(values)], values[~finite & ~torch.isnan(values)])


def check_config(codec: Codec) -> None:
    config = codec.get_config()
    assert config["id"] == codec.name
    rebuilt = type(codec).from_config(config)
    assert rebuilt == codec and rebuilt.get_config() == config
    assert repr(codec).startswith(type(codec).__name__)


def check_rejects_corruption(payload: bytes, seed: int = 0) -> None:
    """Every truncation point sampled and single bit flips raise DecodeError and nothing else."""
    rng = np.random.default_rng(seed)
    cuts = {0, 1, len(payload) - 1, len(payload) // 2, *rng.integers(0, len(payload), 6).tolist()}
    for cut in cuts:
        with pytest.raises(DecodeError):
            codecs.decode(payload[:cut])
    for position in rng.integers(0, len(payload) * 8, 8).tolist():
        flipped = bytearray(payload)
        flipped[position // 8] ^= 1 << (position % 8)
        with pytest.raises(DecodeError):
            codecs.decode(bytes(flipped))
