"""Native single-pass kernels for the CPU hot path, compiled by numba when it is installed.

Top-k with error feedback spends most of its CPU in one loop that torch and numpy can only write
as several passes: ``x = grad + residual``, ``|x|``, ``|x| >= t``, the positions where that holds.
Chunked so that each chunk stays in cache, those are still four calls and three temporaries per
chunk (9.0 ms for ResNet-18's 11.2M gradients here against a 3.6 ms ``torch.add``); as one
compiled loop they are one read of each input and one write of ``x`` (about 1.4 floors).

numba is an optional dependency (``pip install gradwire[fast]``); without it, or with
``GRADWIRE_NATIVE=0`` in the environment, :func:`available` is False and callers keep their
torch/numpy path, which gives the same results bit for bit (``tests/test_kernels.py``).
Compilation happens once per process and dtype at the first call (well under a second; cached on
disk beside this module when that is writable).
"""

from __future__ import annotations

import os
from typing import Any, Callable, NamedTuple, Optional

import numpy as np

#: elements per block of the kernels' vectorized loops (see _kernels)
_BLOCK = 32
_compiled: Optional[dict[str, Callable[..., Any]]] = None
_tried = False


def available() -> bool:
    """Whether the native kernels can run here (numba importable and not disabled)."""
    return _kernels() is not None


def _kernels() -> Optional[dict[str, Callable[..., Any]]]:
    global _compiled, _tried
    if _tried:
        return _compiled
    _tried = True
    if os.environ.get("GRADWIRE_NATIVE", "1") == "0":
        return None
    try:
        import numba
    except ImportError:  # the optional extra is not installed: callers keep the torch/numpy path
        return None

    options = {"nogil": True, "boundscheck": False, "cache": True}
    block = _BLOCK

    # Each kernel walks blocks of 32: the block's arithmetic and its "any element at or above the
    # limit?" test form a loop without branches that LLVM vectorizes; only a block with a hit
    # (about a quarter of them at 1% density) is walked again, in L1, for its positions. 4.2 ms
    # against 5.0 ms for the plain loop with a branch per element (11.2M float32, one thread;
    # the floor torch.add is 3.0 ms on that run).
    @numba.njit(**options)
    def positions_of(values: np.ndarray, begin: int, end: int, limit: float, positions: np.ndarray,
                     found: int) -> int:  # pragma: no cover - compiled
        """Append the positions in [begin, end) where |values| >= limit; the new count (counting
        on past the room, which then stays unwritten)."""
        if found + (end - begin) <= positions.size:  # room for all: store without branching
            for i in range(begin, end):
                positions[found] = i
                found += abs(values[i]) >= limit
            return found
        for i in range(begin, end):
            if abs(values[i]) >= limit:
                if found < positions.size:
                    positions[found] = i
                found += 1
        return found

    @numba.njit(**options)
    def compensate_scan(grad: np.ndarray, residual: np.ndarray, out: np.ndarray, limit: float,
                        positions: np.ndarray, zero_grad: bool, find: bool) -> tuple:  # pragma: no cover - compiled
        # find=False: the flags only (a loop-invariant test, which LLVM hoists out of the loop)
        found = 0
        n = out.size
        full = n - n % block
        finite = True  # every x = grad + residual finite (a NaN/Inf gradient, or an overflow, makes it False)
        nonzero = False  # some grad element is not zero (an all-zero gradient: a parameter unused this step)
        for start in range(0, full, block):
            hit = 0
            for j in range(block):
                g = grad[start + j]
                x = g + residual[start + j]
                out[start + j] = x
                if find:
                    hit |= abs(x) >= limit  # False for NaN, as numpy's greater_equal
                finite &= abs(x) < np.inf
                nonzero |= g != 0
            if zero_grad:  # the block is in cache: zeroing it here saves the output's zero-fill pass
                for j in range(block):
                    grad[start + j] = 0.0
            if hit:
                found = positions_of(out, start, start + block, limit, positions, found)
        for i in range(full, n):
            g = grad[i]
            x = g + residual[i]
            out[i] = x
            finite &= abs(x) < np.inf
            nonzero |= g != 0
            if zero_grad:
                grad[i] = 0.0
        if find:
            found = positions_of(out, full, n, limit, positions, found)
        return found, finite, nonzero

    @numba.njit(**options)
    def scan(values: np.ndarray, limit: float, positions: np.ndarray) -> tuple:  # pragma: no cover - compiled
        found = 0
        n = values.size
        full = n - n % block
        finite = True
        nonzero = False
        for start in range(0, full, block):
            hit = 0
            for j in range(block):
                v = values[start + j]
                hit |= abs(v) >= limit
                finite &= abs(v) < np.inf
                nonzero |= v != 0
            if hit:
                found = positions_of(values, start, start + block, limit, positions, found)
        for i in range(full, n):
            v = values[i]
            finite &= abs(v) < np.inf
            nonzero |= v != 0
        return positions_of(values, full, n, limit, positions, found), finite, nonzero

    _compiled = {"compensate_scan": compensate_scan, "scan": scan}
    return _compiled


#: the dtypes the kernels are compiled for (numba has no bfloat16; float16 stays on numpy)
DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def usable(*arrays: Optional[np.ndarray]) -> bool:
    """Whether the kernels can take these arrays (None entries are skipped): available, one dtype
    of :data:`DTYPES` for all, C-contiguous."""
    given = [a for a in arrays if a is not None]
    return (available() and bool(given) and given[0].dtype in DTYPES
            and all(a.dtype == given[0].dtype and a.flags.c_contiguous for a in given))


class Scan(NamedTuple):
    """What a scan found: ``positions`` (ascending int64; None when more than the room passed),
    and, over the scanned values, whether all are finite and whether any is not zero."""

    positions: Optional[np.ndarray]
    finite: bool
    nonzero: bool


def scan(values: np.ndarray, limit: Any, capacity: int) -> Scan:
    """The ascending positions where ``|values| >= limit``, in one read, and two flags of ``values``.

    Args:
        values: (n,) contiguous float32/float64.
        limit: the threshold as a scalar of ``values``' dtype.
        capacity: how many positions to make room for.

    Returns:
        A :class:`Scan` (``positions`` None when more than ``capacity`` passed).

    Raises:
        RuntimeError: the kernels are not :func:`available`.
    """
    kernels = _require()
    positions = np.empty(max(1, capacity), dtype=np.int64)
    found, finite, nonzero = kernels["scan"](values, limit, positions)
    return Scan(None if found > positions.size else positions[:found], bool(finite), bool(nonzero))


def _require() -> dict[str, Callable[..., Any]]:
    kernels = _kernels()
    if kernels is None:
        raise RuntimeError("gradwire.kernels: numba is not available (pip install gradwire[fast])")
    return kernels


def compensate_and_scan(grad: np.ndarray, residual: Optional[np.ndarray], out: np.ndarray, limit: Any,
                        capacity: int, *, zero_grad: bool = False) -> Scan:
    """``out = grad + residual`` (``out = grad`` when ``residual`` is None) and the ascending
    positions where ``|out| >= limit``, in one pass; with the flags the pipeline's check needs
    (``finite``: every ``out`` element; ``nonzero``: some ``grad`` element), so that pass can
    stand in for it.

    Args:
        grad: (n,) contiguous float32/float64; ``residual`` and ``out`` the same dtype and size.
        residual: (n,) or None.
        out: (n,) receives the sum, whatever the return value.
        limit: the threshold as a scalar of the arrays' dtype (the caller rounds it).
        capacity: how many positions to make room for (a guess from a sample).
        zero_grad: also set ``grad`` to zeros on the way (it is read first): the caller's output
            buffer, which would be zero-filled next, is ``grad``'s storage.

    Returns:
        A :class:`Scan`; ``positions`` None when more than ``capacity`` passed (``out`` is written
        in full then, and the flags are complete: rescan ``out`` for the positions).

    Raises:
        RuntimeError: the kernels are not :func:`available`.
    """
    kernels = _require()
    if residual is None:  # nothing to add: copy, then scan the copy (out = grad: the same flags)
        np.copyto(out, grad)
        if zero_grad:
            grad.fill(0)
        return scan(out, limit, capacity)
    positions = np.empty(max(1, capacity), dtype=np.int64)
    found, finite, nonzero = kernels["compensate_scan"](grad, residual, out, limit, positions, zero_grad, True)
    return Scan(None if found > positions.size else positions[:found], bool(finite), bool(nonzero))


def compensate_and_check(grad: np.ndarray, residual: Optional[np.ndarray], out: np.ndarray, *,
                         zero_grad: bool = False) -> tuple[bool, bool]:
    """``out = grad + residual`` (``out = grad`` when ``residual`` is None) in one pass, with the
    pipeline's check on the way: (every ``out`` element finite, some ``grad`` element not zero).

    Args:
        grad: (n,) contiguous float32/float64; ``residual`` and ``out`` the same dtype and size.
        residual: (n,) or None.
        out: (n,) receives the sum.
        zero_grad: also set ``grad`` to zeros afterwards (see :func:`compensate_and_scan`).

    Raises:
        RuntimeError: the kernels are not :func:`available`.
    """
    kernels = _require()
    if residual is None:
        np.copyto(out, grad)
        finite, nonzero = bool(np.isfinite(out).all()), bool(out.any())
        if zero_grad:
            grad.fill(0)
        return finite, nonzero
    # the same pass without looking for positions: only the flags are wanted
    _, finite, nonzero = kernels["compensate_scan"](grad, residual, out, out.dtype.type(np.inf),
                                                    np.empty(0, dtype=np.int64), zero_grad, False)
    return bool(finite), bool(nonzero)
