"""The sparsifier interface, the amount of sparsity (density or k) and the registry.

A sparsifier looks at one flat gradient and says which positions to keep: it returns int64
indices, strictly ascending, on the gradient's device. It knows nothing of bytes, codecs or
ranks; gathering the values (``flat[indices]``) and sending them is someone else's job.

Amount of sparsity. Every sparsifier except ``threshold`` is told how many elements to keep,
by exactly one of

* ``density`` in (0, 1]: keep ``k = max(1, round(density * numel))`` elements, or
* ``k`` >= 1: keep ``min(k, numel)`` elements.

``threshold`` is told a magnitude instead and keeps a variable number of elements.

Non-finite inputs: the selection never checks for them. NaN compares false, so threshold-based
selection (``threshold``, ``sampled-topk``, ``gaussian-k``) never keeps a NaN (but ``±inf``
passes any threshold); ``topk`` ranks NaN below every number, so keeps it only when fewer
than ``k`` elements are not NaN; the random sparsifiers ignore values altogether. Callers check
gradients for NaN/Inf before sparsifying.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any, ClassVar, TypeVar

import torch

from .. import kernels
from ..configurable import Configurable, instantiate
from ..errors import is_integer, is_real

#: Below this many elements a tensor's check stays in the pipeline's fused pass over many tensors
#: (one ``torch._foreach_norm``) rather than in its own compensation.
FUSED_CHECK_MIN_NUMEL = 1 << 15


class Sparsifier(Configurable, ABC):
    """Choose which positions of a flat gradient to keep.

    Subclasses take their options as keyword-only ``__init__`` arguments, validate them there
    (``ValueError`` naming the option and what is allowed) and keep each under the same
    attribute name, so :meth:`get_config` can read them back.
    """

    #: Registry name, e.g. ``"topk"``.
    name: ClassVar[str]
    #: True when the chosen positions depend only on ``(seed, step, tensor_id, numel, k)`` and
    #: never on the values: every rank then picks the same positions and a plain AllReduce of
    #: the gathered values is correct.
    shared_support: ClassVar[bool] = False

    def select(self, flat: torch.Tensor, *, step: int = 0, tensor_id: int = 0) -> torch.Tensor:
        """Positions to keep.

        Args:
            flat: 1-D floating tensor (any float dtype, any device), shape (numel,).
            step: which training step this is.
            tensor_id: which tensor of the step this is. ``step`` and ``tensor_id`` seed the
                sparsifiers that use randomness, so that all ranks agree and each step differs.

        Returns:
            int64 indices, shape (count,), strictly ascending, in ``[0, numel)``, on ``flat``'s
            device; ``count`` lies within :meth:`count_bounds`.

        Raises:
            ValueError: ``flat`` is not a 1-D floating-point tensor.
        """
        if flat.dim() != 1:
            raise ValueError(f"flat must be a 1-D tensor, got shape {tuple(flat.shape)}")
        if not flat.is_floating_point():
            raise ValueError(f"flat must be a floating-point tensor, got {flat.dtype}")
        if flat.numel() == 0:
            return torch.zeros(0, dtype=torch.int64, device=flat.device)
        return self._select(flat, step=step, tensor_id=tensor_id)

    @abstractmethod
    def _select(self, flat: torch.Tensor, *, step: int, tensor_id: int) -> torch.Tensor:
        """:meth:`select` for a validated, non-empty ``flat``."""

    def fused_check_applies(self, grad: torch.Tensor) -> bool:
        """Whether :meth:`select_compensated` on ``grad`` fills ``flags`` (and honours
        ``zero_grad``): the native kernels are here and ``grad`` is a large float32/float64 CPU
        tensor (below ~32k elements the pipeline's one fused check over many tensors is cheaper)."""
        return (kernels.available() and grad.device.type == "cpu" and grad.dtype in (torch.float32, torch.float64)
                and grad.is_contiguous() and grad.numel() >= FUSED_CHECK_MIN_NUMEL)

    def select_compensated(self, grad: torch.Tensor, residual: "torch.Tensor | None", out: torch.Tensor, *,
                           step: int = 0, tensor_id: int = 0, flags: "dict | None" = None,
                           zero_grad: bool = False) -> torch.Tensor:
        """``out = grad + residual`` (``out = grad`` when ``residual`` is None), then :meth:`select` on ``out``.

        A sparsifier may fuse the two (``topk`` does, on the CPU: one pass over memory instead of
        two); the result is the same.

        Args:
            grad: (numel,) floating gradient, not modified.
            residual: (numel,) in ``out``'s dtype, or None.
            out: (numel,) float32/float64 buffer for the compensated gradient.
            step: as for :meth:`select`.
            tensor_id: as for :meth:`select`.
            flags: a dict that receives ``"finite"`` (every element of ``out``), ``"nonzero"``
                (some element of ``grad``) and ``"zeroed"`` when the compensation ran natively
                (:meth:`fused_check_applies`), which computes them on its way (the pipeline's
                check then skips this tensor); left empty otherwise.
            zero_grad: with ``flags``, also zero ``grad`` once it is read (the caller's output
                buffer is its storage, which would be zero-filled next); ``flags["zeroed"]`` says
                whether it was.

        Returns:
            int64 indices as :meth:`select` returns them.
        """
        if flags is not None and self.fused_check_applies(grad) and out.dtype == grad.dtype and out.is_contiguous() \
                and (residual is None or (residual.dtype == grad.dtype and residual.is_contiguous())):
            finite, nonzero = kernels.compensate_and_check(
                grad.detach().reshape(-1).numpy(), None if residual is None else residual.detach().numpy(),
                out.numpy(), zero_grad=zero_grad)
            flags.update(finite=finite, nonzero=nonzero, zeroed=zero_grad)
            return self.select(out, step=step, tensor_id=tensor_id)
        if residual is None:
            out.copy_(grad.reshape(-1))
        else:
            torch.add(grad.reshape(-1), residual, out=out)
        return self.select(out, step=step, tensor_id=tensor_id)

    def select_segments(self, numels: "list[int]", *, step: int, tensor_ids: "list[int]",
                        device: torch.device) -> "list[torch.Tensor] | None":
        """:meth:`select` for many tensors at once, for a sparsifier whose positions need no values
        (``shared_support``): what :meth:`select` answers for tensor i (``numels[i]`` elements,
        ``tensor_ids[i]``), as a list of int64 tensors on ``device``; None here (no such path:
        the caller selects tensor by tensor)."""
        return None

    def pieces_apply(self, grad: torch.Tensor) -> bool:
        """Whether :meth:`select_compensated_pieces` takes ``grad`` (False here: a sparsifier
        without a many-pieces path is called piece by piece)."""
        return False

    def select_compensated_pieces(self, source: torch.Tensor, *, starts: "list[int]", numels: "list[int]",
                                  residual: "torch.Tensor | None", has_residual: "list[bool]",
                                  out: torch.Tensor) -> "list[tuple[torch.Tensor, torch.Tensor]]":
        """:meth:`select_compensated` for many pieces of one tensor in one go, each with the
        answer it gets alone (and the values there); only for pieces :meth:`pieces_apply` to.

        Args:
            source: (N,) contiguous tensor holding every piece's gradient (not modified).
            starts: piece i is ``source[starts[i]: starts[i] + numels[i]]``.
            numels: the pieces' element counts.
            residual: (sum of numels,) in ``out``'s dtype, the pieces' residuals end to end, or
                None (no piece has one).
            has_residual: whether piece i has one (its part of ``residual`` is read only then).
            out: (sum of numels,) contiguous, ``source``'s dtype: receives the compensated pieces
                end to end.

        Returns:
            Per piece: (ascending int64 positions relative to the piece, ``out`` there).
        """
        raise NotImplementedError(f"{self.name} selects piece by piece")

    @abstractmethod
    def target_k(self, numel: int) -> int | None:
        """How many of ``numel`` elements this sparsifier aims to keep (None: no target)."""

    @abstractmethod
    def count_bounds(self, numel: int) -> tuple[int, int]:
        """``(fewest, most)`` elements :meth:`select` may return for a tensor of ``numel``.

        The most is what a receiver must be ready for (e.g. the size of an all-gather buffer).
        """


class DataSizedSparsifier(Sparsifier):
    """A sparsifier whose count the data decides (``threshold``, ``nonzero``): no target, and
    anything from 0 to ``numel`` elements."""

    def target_k(self, numel: int) -> None:
        return None

    def count_bounds(self, numel: int) -> tuple[int, int]:
        return 0, max(0, numel)


class BudgetSparsifier(Sparsifier):
    """A sparsifier told how many elements to keep: exactly one of ``density`` or ``k``.

    Subclasses implement :meth:`_select_k`, called only with ``1 <= k < numel``; selecting
    everything (``k == numel``) is answered here with ``arange(numel)``.

    Args:
        density: keep ``max(1, round(density * numel))`` elements, a number in (0, 1].
        k: keep ``min(k, numel)`` elements, an int >= 1.
        seed: an int >= 0 that seeds the randomness of the sparsifiers that use it (with the
            step and tensor id); the others ignore it.

    Raises:
        ValueError: not exactly one of ``density`` and ``k``, or a value out of range.
    """

    #: Allowed relative deviation of the returned count from ``k``: 0 means exactly ``k``.
    tolerance: float = 0.0

    def __init__(self, *, density: float | None = None, k: int | None = None, seed: int = 0) -> None:
        if (density is None) == (k is None):
            raise ValueError(f"{self.name} needs exactly one of density or k (got density={density!r}, k={k!r})")
        if density is not None and not is_density(density):
            raise ValueError(f"density={density!r} must be in (0, 1]")
        if k is not None and not (is_integer(k) and k >= 1):
            raise ValueError(f"k={k!r} must be an integer >= 1")
        self.density = None if density is None else float(density)
        self.k = k
        self.seed = check_seed(seed)

    def target_k(self, numel: int) -> int:
        """``max(1, round(density * numel))`` or ``k``, capped at ``numel``; 0 when ``numel`` is 0."""
        if numel <= 0:
            return 0
        if self.k is not None:
            return min(self.k, numel)
        return min(numel, max(1, round(self.density * numel)))  # type: ignore[operator]

    def count_bounds(self, numel: int) -> tuple[int, int]:
        k = self.target_k(numel)
        if k == 0:
            return 0, 0
        fewest = max(1, math.ceil(k * (1.0 - self.tolerance)))
        most = min(numel, max(fewest, math.floor(k * (1.0 + self.tolerance))))
        return fewest, most

    def _select(self, flat: torch.Tensor, *, step: int, tensor_id: int) -> torch.Tensor:
        k = self.target_k(flat.numel())
        if k >= flat.numel():
            return torch.arange(flat.numel(), dtype=torch.int64, device=flat.device)
        return self._select_k(flat, k, step=step, tensor_id=tensor_id)

    @abstractmethod
    def _select_k(self, flat: torch.Tensor, k: int, *, step: int, tensor_id: int) -> torch.Tensor:
        """Indices of about ``k`` (within :meth:`count_bounds`) elements, ``1 <= k < numel``."""


def is_density(value: object) -> bool:
    """Whether ``value`` is a number in (0, 1] (booleans are not numbers here)."""
    return is_real(value) and 0.0 < value <= 1.0


def check_seed(seed: int) -> int:
    """Validate a seed option (a non-negative int) and return it."""
    if not (is_integer(seed) and seed >= 0):
        raise ValueError(f"seed={seed!r} must be an integer >= 0")
    return seed


_S = TypeVar("_S", bound=type[Sparsifier])
_SPARSIFIERS: dict[str, type[Sparsifier]] = {}


def register_sparsifier(cls: _S) -> _S:
    """Class decorator: make ``cls`` available to :func:`get_sparsifier` by ``cls.name``."""
    existing = _SPARSIFIERS.get(cls.name)
    if existing is not None and existing is not cls:
        raise ValueError(f"sparsifier name {cls.name!r} is taken by {existing.__qualname__}")
    _SPARSIFIERS[cls.name] = cls
    return cls


def sparsifier_classes() -> dict[str, type[Sparsifier]]:
    """Registered sparsifier classes by name."""
    return dict(_SPARSIFIERS)


def get_sparsifier(
    name: str,
    *,
    density: float | None = None,
    k: int | None = None,
    threshold: float | None = None,
    seed: int = 0,
    **options: Any,
) -> Sparsifier:
    """A sparsifier by registry name, e.g. ``get_sparsifier("topk", density=0.01)``.

    ``density``/``k``/``threshold`` are passed on only when given, so a sparsifier that does
    not take one (``threshold`` takes no density; ``topk`` takes no threshold) rejects it with a
    ``ValueError`` naming the option and what the sparsifier accepts.

    Args:
        name: a registered name (:func:`~gradwire.sparsify.sparsifiers` lists them).
        density: fraction of elements to keep, for the sparsifiers told an amount.
        k: elements to keep, for the same ones (exactly one of ``density`` and ``k``).
        threshold: the magnitude of ``threshold``.
        seed: seeds the random choices (always passed on).
        **options: the sparsifier's own options (e.g. ``sample_fraction``).

    Returns:
        The sparsifier.

    Raises:
        ValueError: an unknown name, an option the sparsifier does not take, or a bad value.
    """
    given = {"density": density, "k": k, "threshold": threshold}
    params = {key: value for key, value in given.items() if value is not None}
    params.update(options)
    params["seed"] = seed
    return instantiate("sparsifier", _SPARSIFIERS, name, params)
