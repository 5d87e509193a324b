"""The native kernels (gradwire.kernels, numba) against the torch/numpy path they replace: the same
compensated tensor bit for bit and the same positions, including NaN, infinities, float64, a tail
that is not a whole block and more candidates than the room the sample predicted."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from gradwire import kernels
from gradwire.sparsify import topk

pytest.importorskip("numba")
pytestmark = pytest.mark.skipif(not kernels.available(), reason="GRADWIRE_NATIVE=0")


def _numpy_positions(values: np.ndarray, limit: float) -> np.ndarray:
    return np.flatnonzero(np.abs(values) >= values.dtype.type(limit)).astype(np.int64)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("numel", [1, 31, 32, 33, 1000, 65_539])
def test_compensate_and_scan_equals_numpy(dtype: type, numel: int) -> None:
    rng = np.random.default_rng(numel)
    grad = rng.standard_normal(numel).astype(dtype)
    residual = (rng.standard_normal(numel) * 0.3).astype(dtype)
    grad[::97] = np.nan
    grad[5::101] = np.inf
    grad[7::103] = -np.inf
    out = np.full(numel, 7.0, dtype=dtype)
    limit = dtype(1.5)
    found = kernels.compensate_and_scan(grad, residual, out, limit, capacity=numel)
    expected_out = grad + residual
    np.testing.assert_array_equal(out, expected_out)  # NaN positions compare equal here
    assert found is not None
    np.testing.assert_array_equal(found, _numpy_positions(expected_out, limit))
    scanned = kernels.scan(expected_out, limit, capacity=numel)
    assert scanned is not None
    np.testing.assert_array_equal(scanned, found)


def test_too_many_candidates_returns_none_with_out_written() -> None:
    grad = np.ones(1000, dtype=np.float32)
    residual = np.ones(1000, dtype=np.float32)
    out = np.zeros(1000, dtype=np.float32)
    assert kernels.compensate_and_scan(grad, residual, out, np.float32(0.5), capacity=10) is None
    np.testing.assert_array_equal(out, np.full(1000, 2.0, dtype=np.float32))
    assert kernels.scan(out, np.float32(0.5), capacity=999) is None


def test_usable_refuses_mixed_dtypes_and_strides() -> None:
    a = np.zeros(64, dtype=np.float32)
    assert kernels.usable(a, None, a)
    assert not kernels.usable(a, a.astype(np.float64))
    assert not kernels.usable(a[::2])
    assert not kernels.usable(a.astype(np.float16))


@pytest.mark.parametrize("with_residual", [True, False])
def test_topk_native_and_numpy_paths_agree(monkeypatch: pytest.MonkeyPatch, with_residual: bool) -> None:
    """The same top-k (and compensated tensor) with the kernels and without them, where the
    sampled threshold leaves more candidates than predicted (a heavy tail off the sample)."""
    numel = 3 * topk.FUSED_CHUNK_NUMEL + 17
    generator = torch.Generator().manual_seed(3)
    grad = torch.randn(numel, generator=generator)
    grad[1::32] *= 50.0  # never on the evenly spaced sample (stride 24): more candidates than room
    residual = torch.randn(numel, generator=generator) * 0.2 if with_residual else None
    k = numel // 100
    native_out = torch.empty(numel)
    native = topk.compensated_largest_magnitudes(grad, residual, native_out, k)
    monkeypatch.setattr(kernels, "_kernels", lambda: None)
    assert not kernels.available()
    numpy_out = torch.empty(numel)
    reference = topk.compensated_largest_magnitudes(grad, residual, numpy_out, k)
    assert torch.equal(native_out, numpy_out)
    assert torch.equal(native, reference)
    assert torch.equal(topk.largest_magnitudes(numpy_out, k), reference)


def test_environment_switch_turns_the_kernels_off() -> None:
    env = {**os.environ, "GRADWIRE_NATIVE": "0"}
    code = "from gradwire import kernels; print(kernels.available())"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "False", result.stderr
