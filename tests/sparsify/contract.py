"""The one shared contract every sparsifier passes (parametrized over ``sparsifiers()``).

* :func:`make`: a sparsifier by name at a density (``threshold`` gets the magnitude a standard
  normal exceeds with that probability, so the same cases drive it).
* :func:`check_indices`: sorted, unique, int64, in range, on the input's device; values gathered.
* :func:`check_sparsifier`: the whole matrix — counts within the promised bounds, determinism,
  shared support independent of the values, float16/bfloat16/float32/float64, numel 0 and 1,
  density 1.0, non-finite input, global scope equal to selecting over the concatenation.
"""

from __future__ import annotations

import torch

import gradwire.sparsify as sparsify
from gradwire.sparsify import Sparsifier
from gradwire.sparse import SparseTensor

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def normal_quantile(density: float) -> float:
    """The magnitude ``t`` with ``P(|x| >= t) = density`` for ``x ~ N(0, 1)``."""
    return float(torch.special.ndtri(torch.tensor(1.0 - density / 2.0, dtype=torch.float64)))


def make(name: str, *, density: float = 0.01, k: int | None = None, seed: int = 0) -> Sparsifier:
    """``name`` at ``density`` (or ``k``); ``threshold`` at the N(0, 1) quantile of ``density``."""
    if name == "threshold":
        return sparsify.get_sparsifier(name, threshold=normal_quantile(density), seed=seed)
    if name == "nonzero":  # keeps what is non-zero, whatever the amount
        return sparsify.get_sparsifier(name, seed=seed)
    if k is not None:
        return sparsify.get_sparsifier(name, k=k, seed=seed)
    return sparsify.get_sparsifier(name, density=density, seed=seed)


def random_flat(numel: int, *, seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=generator).to(dtype=dtype, device=device)


def check_indices(indices: torch.Tensor, flat: torch.Tensor) -> None:
    """Sorted, unique int64 indices in ``[0, numel)`` on ``flat``'s device."""
    assert indices.dtype == torch.int64, indices.dtype
    assert indices.dim() == 1
    assert indices.device == flat.device, (indices.device, flat.device)
    SparseTensor(flat[indices], indices, flat.numel()).check()  # strictly ascending, in range


def check_values(sparse: SparseTensor, flat: torch.Tensor) -> None:
    """``sparsify``'s values are the input at its indices, bit for bit (NaN included)."""
    assert sparse.numel == flat.numel() and sparse.values.dtype == flat.dtype
    width = {2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    assert torch.equal(sparse.values.view(width), flat.reshape(-1)[sparse.indices].view(width))


def check_count(sparsifier: Sparsifier, flat: torch.Tensor, indices: torch.Tensor) -> None:
    """The count is within :meth:`count_bounds`; ``threshold`` keeps exactly ``|x| >= t``."""
    fewest, most = sparsifier.count_bounds(flat.numel())
    assert fewest <= indices.numel() <= most, (sparsifier, indices.numel(), (fewest, most))
    if sparsifier.name == "threshold":
        expected = torch.nonzero(flat.double().abs() >= sparsifier.threshold).view(-1)
        assert torch.equal(indices.cpu(), expected.cpu()), sparsifier
    if sparsifier.name == "nonzero":
        assert torch.equal(indices.cpu(), torch.nonzero(flat.cpu().double() != 0).view(-1)), sparsifier


def check_determinism(name: str, device: str) -> None:
    """Same call -> same indices. Shared support: independent of the values, varies with
    step, tensor_id and seed."""
    sparsifier = make(name, density=0.05)
    flat = random_flat(4000, seed=1, device=device)
    first = sparsifier.select(flat, step=3, tensor_id=7)
    assert torch.equal(first, sparsifier.select(flat, step=3, tensor_id=7))
    assert torch.equal(first, make(name, density=0.05).select(flat.clone(), step=3, tensor_id=7))
    if sparsifier.shared_support:
        other_values = random_flat(4000, seed=2, device=device)
        assert torch.equal(first, sparsifier.select(other_values, step=3, tensor_id=7)), "support depends on values"
        assert not torch.equal(first, sparsifier.select(flat, step=4, tensor_id=7)), "same support at another step"
        assert not torch.equal(first, sparsifier.select(flat, step=3, tensor_id=8)), "same support for another tensor"
        assert not torch.equal(first, make(name, density=0.05, seed=1).select(flat, step=3, tensor_id=7))


def check_edge_sizes(name: str, device: str) -> None:
    """numel 0 and 1; density 1.0 (and k >= numel) keep everything."""
    sparsifier = make(name, density=0.3)
    for numel in (0, 1, 2, 3):
        flat = random_flat(numel, seed=numel, device=device) * 10  # |x| large enough for threshold
        indices = sparsifier.select(flat)
        check_indices(indices, flat)
        check_count(sparsifier, flat, indices)
    if name not in ("threshold", "nonzero"):
        flat = random_flat(1000, device=device)
        everything = torch.arange(1000, device=device)
        assert torch.equal(make(name, density=1.0).select(flat), everything)
        assert torch.equal(make(name, k=5000).select(flat), everything)
        assert make(name, k=1).select(flat).numel() == 1


def check_dtypes(name: str, device: str) -> None:
    for dtype in DTYPES:
        sparsifier = make(name, density=0.02)
        flat = random_flat(30_000, seed=5, dtype=dtype, device=device)
        indices = sparsifier.select(flat, step=1)
        check_indices(indices, flat)
        check_count(sparsifier, flat, indices)


def check_large(name: str, device: str) -> None:
    """Large enough that sampled-topk samples (and does not fall back to an exact top-k)."""
    for density in (0.001, 0.01, 0.1):
        sparsifier = make(name, density=density)
        flat = random_flat(1 << 18, seed=11, device=device)
        indices = sparsifier.select(flat, step=2, tensor_id=1)
        check_indices(indices, flat)
        check_count(sparsifier, flat, indices)


def check_nonfinite(name: str, device: str) -> None:
    """NaN/Inf do not break the contract on the indices (what is selected is documented)."""
    flat = random_flat(5000, device=device)
    flat[::97] = float("nan")
    flat[5::101] = float("inf")
    sparsifier = make(name, density=0.05)
    indices = sparsifier.select(flat)
    check_indices(indices, flat)
    check_values(sparsify.sparsify(flat, sparsifier), flat)
    fewest, most = sparsifier.count_bounds(flat.numel())
    assert indices.numel() <= most
    if name == "threshold":
        assert not bool(torch.isnan(flat[indices]).any())


def check_global_scope(name: str, device: str) -> None:
    """Selecting globally over several tensors = selecting over their concatenation, split."""
    sparsifier = make(name, density=0.03)
    sizes_and_scales = ((3000, 1.0), (1, 5.0), (0, 1.0), (7000, 0.5))
    flats = [random_flat(n, seed=n, device=device) * scale for n, scale in sizes_and_scales]
    pieces = sparsify.select_global(sparsifier, flats, step=4)
    assert len(pieces) == len(flats)
    offset, joined = 0, []
    for piece, flat in zip(pieces, flats):
        check_indices(piece, flat)
        joined.append(piece + offset)
        offset += flat.numel()
    whole = sparsifier.select(torch.cat(flats), step=4, tensor_id=0)
    assert torch.equal(torch.cat(joined), whole)
    assert sparsify.select_global(sparsifier, []) == []


def check_sparsifier(name: str, device: str = "cpu") -> None:
    """The whole contract for the sparsifier registered as ``name``."""
    sparsifier = make(name)
    assert sparsifier.name == name
    assert isinstance(sparsifier.shared_support, bool)
    flat = random_flat(10_000, device=device)
    indices = sparsifier.select(flat)
    check_indices(indices, flat)
    check_count(sparsifier, flat, indices)
    sparse = sparsify.sparsify(flat.reshape(100, 100), sparsifier)
    assert torch.equal(sparse.indices, indices)
    check_values(sparse, flat)
    check_determinism(name, device)
    check_edge_sizes(name, device)
    check_dtypes(name, device)
    check_large(name, device)
    check_nonfinite(name, device)
    check_global_scope(name, device)
