"""topk is the exact largest-magnitude set; sampled-topk and gaussian-k keep a threshold set near k."""

from __future__ import annotations

import pytest
import torch

from gradwire.sparsify import get_sparsifier

from .contract import random_flat


def test_topk_is_the_true_largest_magnitude_set() -> None:
    flat = random_flat(50_000, seed=3) * torch.linspace(0.1, 3.0, 50_000)
    for k in (1, 17, 5000, 49_999):
        indices = get_sparsifier("topk", k=k).select(flat)
        expected = torch.sort(torch.argsort(flat.abs(), descending=True)[:k]).values
        assert torch.equal(indices, expected)


@pytest.mark.parametrize("shape", ["normal", "heavy-tailed", "ties", "mostly-zero", "periodic", "on-sample", "nan",
                                   "inf", "constant"])
@pytest.mark.parametrize("density", [0.0001, 0.01, 0.2])
def test_topk_scan_path_is_exact_on_large_tensors(shape: str, density: float) -> None:
    """Large tensors go through the sampled-threshold scan; the result must still be the top-k."""
    numel = (1 << 18) + 7
    base = random_flat(numel, seed=21)
    positions = torch.arange(numel)
    flat = {
        "normal": base,
        "heavy-tailed": base**5,
        "ties": torch.round(base * 2) / 2,
        "mostly-zero": torch.where(positions % 700 == 0, base, torch.zeros(())),
        # the large values sit between the evenly spaced sample points: the sample sees none
        "periodic": torch.where(positions % 32 == 5, base * 100, base * 1e-3),
        # the large values sit exactly on the sample points: the threshold is too high and too
        # few candidates pass, so the search must lower it and rescan
        "on-sample": torch.where(positions % 32 == 0, base * 100, base * 1e-3),
        "nan": torch.where(positions % 1000 == 3, torch.tensor(float("nan")), base),
        "inf": torch.where(positions % 5000 == 3, torch.tensor(float("inf")), base),
        "constant": torch.full((numel,), -0.5),
    }[shape]
    sparsifier = get_sparsifier("topk", density=density)
    k = sparsifier.target_k(numel)
    indices = sparsifier.select(flat)
    assert indices.numel() == k
    assert bool((indices[1:] > indices[:-1]).all())
    magnitudes = flat.abs().nan_to_num(nan=-1.0)
    expected = torch.sort(magnitudes, descending=True).values[:k]
    assert torch.equal(torch.sort(magnitudes[indices], descending=True).values, expected)
    if shape in ("normal", "heavy-tailed"):  # distinct values: the positions themselves are determined
        assert torch.equal(indices, torch.sort(torch.topk(magnitudes, k).indices).values)


def test_topk_keeps_nan_only_when_short_of_numbers() -> None:
    flat = torch.tensor([float("nan"), 1.0, -3.0, float("nan"), 2.0])
    assert get_sparsifier("topk", k=2).select(flat).tolist() == [2, 4]
    assert get_sparsifier("topk", k=4).select(flat).numel() == 4


def test_topk_of_signed_values_uses_magnitude() -> None:
    flat = torch.tensor([0.5, -9.0, 1.0, 8.0, -0.1])
    assert get_sparsifier("topk", k=2).select(flat).tolist() == [1, 3]


def _is_threshold_set(flat: torch.Tensor, indices: torch.Tensor) -> bool:
    """Every kept magnitude >= every dropped one (what a threshold selection guarantees)."""
    kept = torch.zeros(flat.numel(), dtype=torch.bool)
    kept[indices] = True
    magnitudes = flat.abs().double()
    return bool(magnitudes[kept].min() >= magnitudes[~kept].max())


@pytest.mark.parametrize("name", ["sampled-topk", "gaussian-k"])
@pytest.mark.parametrize("shape", ["normal", "heavy-tailed", "mixed-scale", "constant", "mostly-zero", "ties"])
def test_threshold_search_stays_in_bounds_on_hard_inputs(name: str, shape: str) -> None:
    numel = 1 << 17
    base = random_flat(numel, seed=9)
    flat = {
        "normal": base,
        "heavy-tailed": base**5,
        "mixed-scale": torch.cat([base[: numel // 2] * 1e4, base[numel // 2 :] * 1e-4]),
        "constant": torch.full((numel,), -0.25),
        "mostly-zero": torch.where(torch.arange(numel) % 500 == 0, base, torch.zeros(())),
        "ties": torch.round(base * 2) / 2,
    }[shape]
    for density in (0.0005, 0.01, 0.2):
        sparsifier = get_sparsifier(name, density=density)
        indices = sparsifier.select(flat, step=1)
        fewest, most = sparsifier.count_bounds(numel)
        assert fewest <= indices.numel() <= most, (shape, density, indices.numel())
        assert _is_threshold_set(flat, indices), (shape, density)


def test_sampled_topk_is_deterministic_per_step_and_options_apply() -> None:
    flat = random_flat(1 << 18, seed=4)
    sparsifier = get_sparsifier("sampled-topk", density=0.01)
    assert torch.equal(sparsifier.select(flat, step=5), sparsifier.select(flat, step=5))
    exact = get_sparsifier("sampled-topk", density=0.01, tolerance=0.0).select(flat)
    assert exact.numel() == get_sparsifier("topk", density=0.01).target_k(flat.numel())
    assert torch.equal(exact, get_sparsifier("topk", density=0.01).select(flat))
    one_try = get_sparsifier("sampled-topk", k=3000, max_tries=1, sample_fraction=0.001, min_sample=16)
    assert 2400 <= one_try.select(flat).numel() <= 3600


def test_small_tensors_get_an_exact_topk() -> None:
    flat = random_flat(3000, seed=2)  # smaller than min_sample: nothing to sample from
    for name in ("sampled-topk", "gaussian-k"):
        indices = get_sparsifier(name, k=30, tolerance=0.0).select(flat)
        assert torch.equal(indices, get_sparsifier("topk", k=30).select(flat))


def test_threshold_search_never_keeps_nan() -> None:
    flat = random_flat(1 << 16, seed=1)
    flat[::1000] = float("nan")
    indices = get_sparsifier("sampled-topk", density=0.01).select(flat)
    assert not bool(torch.isnan(flat[indices]).any())


@pytest.mark.parametrize("shape", ["normal", "on-sample", "periodic", "mostly-zero", "ties", "small"])
@pytest.mark.parametrize("with_residual", [True, False])
def test_fused_compensate_and_select_equals_compensate_then_select(shape: str, with_residual: bool) -> None:
    """One chunked pass (add, then scan each chunk in cache) gives what the two steps give: the
    same compensated tensor, bit for bit, and the same positions."""
    from gradwire.sparsify.topk import FUSED_CHUNK_NUMEL, compensated_largest_magnitudes, largest_magnitudes

    numel = 1000 if shape == "small" else 3 * FUSED_CHUNK_NUMEL + 11
    base = random_flat(numel, seed=5)
    positions = torch.arange(numel)
    grad = {
        "normal": base, "small": base, "ties": torch.round(base * 2) / 2,
        "on-sample": torch.where(positions % 32 == 0, base * 100, base * 1e-3),
        "periodic": torch.where(positions % 32 == 5, base * 100, base * 1e-3),
        "mostly-zero": torch.where(positions % 700 == 0, base, torch.zeros(())),
    }[shape]
    residual = random_flat(numel, seed=6) * 0.3 if with_residual else None
    k = max(1, numel // 100)
    out = torch.full((numel,), float("nan"))
    fused = compensated_largest_magnitudes(grad, residual, out, k)
    compensated = grad + residual if residual is not None else grad.clone()
    assert torch.equal(out, compensated)
    expected = largest_magnitudes(compensated, k)
    magnitudes = compensated.abs()
    assert fused.numel() == k and bool((fused[1:] > fused[:-1]).all())
    assert torch.equal(torch.sort(magnitudes[fused]).values, torch.sort(magnitudes[expected]).values)
    if shape != "ties":  # distinct values: the positions themselves are determined
        assert torch.equal(fused, expected)


@pytest.mark.parametrize("rows, columns", [(2048, 2048), (768, 3072), (4096, 1024), (1000, 1000)])
def test_the_threshold_sample_walks_every_column_of_a_weight(rows: int, columns: int) -> None:
    # a stride dividing the row length sampled the same few columns of every row (issue 17's MLP)
    from gradwire.sparsify.topk import SAMPLE_SIZE, sample_stride

    numel = rows * columns
    stride = sample_stride(numel)
    assert all(stride % d for d in range(2, int(stride ** 0.5) + 1)), "the stride is prime"
    assert 0.5 * numel / SAMPLE_SIZE <= stride <= numel / SAMPLE_SIZE
    sampled_columns = {position % columns for position in range(0, numel, stride)}
    assert len(sampled_columns) >= min(columns, numel // stride) * 0.99
