"""``nonzero``: exactly the non-zero entries, whatever the amount option says."""

from __future__ import annotations

import pytest
import torch

import gradwire.sparsify as sparsify


def test_selects_exactly_the_nonzero_rows_of_an_embedding_gradient() -> None:
    table = torch.nn.Embedding(1000, 16)
    table(torch.tensor([[3, 3, 999, 17]])).sum().backward()
    flat = table.weight.grad.reshape(-1)
    indices = sparsify.get_sparsifier("nonzero").select(flat)
    rows = torch.tensor([3, 17, 999])
    assert torch.equal(indices, (rows[:, None] * 16 + torch.arange(16)).reshape(-1))


def test_special_values_and_options() -> None:
    chooser = sparsify.get_sparsifier("nonzero", density=0.01)  # the hook's default amount: ignored
    flat = torch.tensor([0.0, -0.0, float("nan"), 1e-45, -2.0, float("inf")])
    assert chooser.select(flat).tolist() == [2, 3, 4, 5]
    assert chooser.select(torch.zeros(10)).numel() == 0
    assert chooser.target_k(100) is None and chooser.count_bounds(100) == (0, 100)
    with pytest.raises(ValueError, match="option k"):
        sparsify.get_sparsifier("nonzero", k=3)
    with pytest.raises(ValueError, match="density"):
        sparsify.get_sparsifier("nonzero", density=2.0)
