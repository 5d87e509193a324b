"""Every registered sparsifier passes the shared contract; per-sparsifier files add what is particular."""

from __future__ import annotations

import pytest
import torch

import gradwire.sparsify as sparsify

from .contract import check_sparsifier

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sparsify.sparsifiers())
def test_sparsifier_contract(name: str, device: str) -> None:
    check_sparsifier(name, device)


def test_registry_lists_the_documented_sparsifiers() -> None:
    assert {"topk", "sampled-topk", "gaussian-k", "threshold", "randomk", "randomblock"} <= set(sparsify.sparsifiers())
    shared = {name for name in sparsify.sparsifiers() if sparsify.get_sparsifier(
        name, **({"threshold": 1.0} if name == "threshold" else {"density": 0.1})).shared_support}
    assert shared == {"randomk", "randomblock"}
