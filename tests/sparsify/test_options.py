"""get_sparsifier: amounts, option validation, config and the input checks of select."""

from __future__ import annotations

import pytest
import torch

import gradwire.sparsify as sparsify
from gradwire.sparsify import get_sparsifier


@pytest.mark.parametrize(
    "name, options, words",
    [
        ("foo", {"density": 0.1}, ["sparsifier='foo'", "allowed", "topk"]),
        ("topk", {"density": 1.5}, ["density=1.5", "(0, 1]"]),
        ("topk", {"density": 0.0}, ["density=0.0"]),
        ("topk", {"k": 0}, ["k=0", ">= 1"]),
        ("topk", {"k": 2.5}, ["k=2.5"]),
        ("topk", {}, ["exactly one of density or k"]),
        ("randomk", {"density": 0.1, "k": 3}, ["exactly one of density or k"]),
        ("topk", {"threshold": 1.0}, ["no option threshold", "allowed: density, k, seed"]),
        ("threshold", {"density": 0.1}, ["no option density", "allowed: threshold, seed"]),
        ("threshold", {}, ["threshold=None"]),
        ("threshold", {"threshold": -1.0}, ["threshold=-1.0", "> 0"]),
        ("threshold", {"threshold": float("inf")}, ["threshold=inf"]),
        ("sampled-topk", {"density": 0.1, "bogus": 1}, ["no option bogus", "sample_fraction"]),
        ("sampled-topk", {"density": 0.1, "tolerance": 1.0}, ["tolerance=1.0"]),
        ("sampled-topk", {"density": 0.1, "max_tries": 0}, ["max_tries=0"]),
        ("sampled-topk", {"density": 0.1, "sample_fraction": 0.0}, ["sample_fraction=0.0"]),
        ("randomk", {"density": 0.1, "seed": -1}, ["seed=-1"]),
    ],
)
def test_invalid_options_name_the_option(name: str, options: dict, words: list[str]) -> None:
    with pytest.raises(ValueError) as error:
        get_sparsifier(name, **options)
    for word in words:
        assert word in str(error.value)


@pytest.mark.parametrize("numel, density, k", [(0, 0.5, 0), (1, 0.001, 1), (1000, 0.001, 1), (1000, 0.0125, 12),
                                               (1000, 0.0135, 14), (1000, 1.0, 1000), (7, 0.5, 4)])
def test_target_k_from_density(numel: int, density: float, k: int) -> None:
    assert get_sparsifier("topk", density=density).target_k(numel) == k


def test_target_k_from_k_is_capped_at_numel() -> None:
    sparsifier = get_sparsifier("randomk", k=10)
    assert [sparsifier.target_k(n) for n in (0, 3, 10, 11)] == [0, 3, 10, 10]
    assert get_sparsifier("threshold", threshold=0.5).target_k(100) is None


def test_count_bounds() -> None:
    assert get_sparsifier("topk", k=100).count_bounds(1000) == (100, 100)
    assert get_sparsifier("sampled-topk", k=100).count_bounds(1000) == (80, 120)
    assert get_sparsifier("sampled-topk", k=100).count_bounds(110) == (80, 110)
    assert get_sparsifier("sampled-topk", k=2).count_bounds(1000) == (2, 2)
    assert get_sparsifier("threshold", threshold=1.0).count_bounds(1000) == (0, 1000)


@pytest.mark.parametrize("name", sparsify.sparsifiers())
def test_config_repr_and_equality(name: str) -> None:
    options = {"threshold": 0.5} if name == "threshold" else {"density": 0.25}
    sparsifier = get_sparsifier(name, seed=3, **options)
    config = sparsifier.get_config()
    assert config["id"] == name and config["seed"] == 3
    rebuilt = get_sparsifier(config.pop("id"), **config)
    assert rebuilt == sparsifier and hash(rebuilt) == hash(sparsifier)
    assert rebuilt != get_sparsifier(name, seed=4, **options)
    assert type(sparsifier).__name__ in repr(sparsifier)


@pytest.mark.parametrize("bad", [torch.zeros(3, 3), torch.arange(5), torch.zeros(4, dtype=torch.bool)])
def test_select_rejects_non_flat_or_non_float(bad: torch.Tensor) -> None:
    with pytest.raises(ValueError):
        get_sparsifier("topk", k=1).select(bad)
