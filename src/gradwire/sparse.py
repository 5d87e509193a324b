"""The sparse representation every layer shares.

A sparse gradient is three things: ``values`` (1-D float tensor, length k), ``indices``
(1-D int64 tensor, length k, strictly ascending positions into the flattened dense tensor)
and ``numel`` (the dense tensor's element count). Codecs, sparsifiers and the exchange all
speak this triple.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class SparseTensor:
    """``values[i]`` sits at flat position ``indices[i]`` of a dense tensor of ``numel`` elements.

    Construction checks shapes and dtypes only; :meth:`check` checks the order and range.

    Attributes:
        values: (k,), any float dtype.
        indices: (k,), int64, strictly ascending, in ``[0, numel)``; on ``values``' device.
        numel: the dense tensor's element count, >= 0.

    Raises:
        ValueError: not 1-D, lengths that differ, indices not int64, or a negative ``numel``.
    """

    values: torch.Tensor
    indices: torch.Tensor
    numel: int

    def __post_init__(self) -> None:
        if self.values.dim() != 1 or self.indices.dim() != 1:
            raise ValueError("values and indices must be 1-D tensors")
        if self.values.numel() != self.indices.numel():
            raise ValueError(
                f"values has {self.values.numel()} elements but indices has {self.indices.numel()}"
            )
        if self.indices.dtype != torch.int64:
            raise ValueError(f"indices must be int64, got {self.indices.dtype}")
        if self.numel < 0:
            raise ValueError(f"numel must be >= 0, got {self.numel}")

    @property
    def k(self) -> int:
        """Number of kept elements."""
        return int(self.indices.numel())

    @property
    def density(self) -> float:
        """Fraction of positions kept, ``k / numel`` (0.0 for an empty tensor)."""
        return self.k / self.numel if self.numel else 0.0

    @classmethod
    def from_dense(cls, dense: torch.Tensor, indices: torch.Tensor) -> "SparseTensor":
        """Gather ``dense.flatten()`` at ``indices`` (sorted here if they are not)."""
        flat = dense.reshape(-1)
        indices = indices.to(device=flat.device, dtype=torch.int64)
        indices, _ = torch.sort(indices)
        return cls(flat[indices], indices, flat.numel())

    @classmethod
    def nonzero_of(cls, dense: torch.Tensor) -> "SparseTensor":
        """The non-zero entries of ``dense`` (flattened)."""
        flat = dense.reshape(-1)
        indices = torch.nonzero(flat, as_tuple=False).reshape(-1)
        return cls(flat[indices], indices, flat.numel())

    def to_dense(self, shape: "torch.Size | tuple[int, ...] | None" = None) -> torch.Tensor:
        """Scatter into zeros of ``numel`` elements, reshaped to ``shape`` when given."""
        out = torch.zeros(self.numel, dtype=self.values.dtype, device=self.values.device)
        out[self.indices] = self.values
        return out if shape is None else out.reshape(shape)

    def check(self) -> None:
        """Raise ``ValueError`` unless indices are strictly ascending and inside ``[0, numel)``."""
        check_support(self.indices, self.numel)


def strictly_ascending(indices: "torch.Tensor | np.ndarray") -> bool:
    """Whether a 1-D integer tensor or array is strictly ascending (sorted, no duplicates); an
    empty or one-element one is."""
    return bool((indices[1:] > indices[:-1]).all())


def is_support(indices: "torch.Tensor | np.ndarray", numel: int) -> bool:
    """Whether ``indices`` are a valid support of a flat tensor of ``numel`` elements: strictly
    ascending and inside ``[0, numel)``."""
    if len(indices) == 0:
        return True
    return int(indices[0]) >= 0 and int(indices[-1]) < numel and strictly_ascending(indices)


def check_support(indices: "torch.Tensor | np.ndarray", numel: int) -> None:
    """The checked form of :func:`is_support`, for caller-supplied indices.

    Args:
        indices: 1-D integer tensor or array.
        numel: the dense size they index.

    Raises:
        ValueError: ``indices`` leave ``[0, numel)`` or are not strictly ascending, saying which.
    """
    if len(indices) == 0:
        return
    if int(indices.min()) < 0 or int(indices.max()) >= numel:
        raise ValueError(f"indices must lie in [0, {numel})")
    if not strictly_ascending(indices):
        raise ValueError("indices must be strictly ascending (sorted, no duplicates)")
