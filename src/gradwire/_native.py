"""The numba kernels behind :mod:`gradwire.kernels` (imported only from there, only when numba is).

They live at module level, not inside a factory function: numba's on-disk cache is keyed by a
function's module and qualified name, and a closure (which referenced another compiled function
and the block size as free variables) missed it in every new process: each process compiled
again (1.5 s here) and added one more cache file (270 of them, 25 MB, after a day of tests).
``tests/test_kernels.py`` checks that a second process finds the cache.
"""

from __future__ import annotations

import numba
import numpy as np

#: elements per block of the vectorized loops (a constant: numba freezes module globals)
BLOCK = 32


# Each kernel walks blocks of 32: the block's arithmetic and its "any element at or above the
# limit?" test form a loop without branches that LLVM vectorizes; only a block with a hit
# (about a quarter of them at 1% density) is walked again, in L1, for its positions. 4.2 ms
# against 5.0 ms for the plain loop with a branch per element (11.2M float32, one thread;
# the floor torch.add is 3.0 ms on that run).
@numba.njit(nogil=True, boundscheck=False, cache=True)
def positions_of(values: np.ndarray, begin: int, end: int, limit: float, positions: np.ndarray,
                 found: int) -> int:
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


@numba.njit(nogil=True, boundscheck=False, cache=True)
def compensate_scan(grad: np.ndarray, residual: np.ndarray, out: np.ndarray, limit: float,
                    positions: np.ndarray, zero_grad: bool, find: bool) -> tuple:
    # find=False: the flags only (a loop-invariant test, which LLVM hoists out of the loop)
    found = 0
    n = out.size
    full = n - n % BLOCK
    finite = True  # every x = grad + residual finite (a NaN/Inf gradient, or an overflow, makes it False)
    nonzero = False  # some grad element is not zero (an all-zero gradient: a parameter unused this step)
    for start in range(0, full, BLOCK):
        hit = 0
        for j in range(BLOCK):
            g = grad[start + j]
            x = g + residual[start + j]
            out[start + j] = x
            if find:
                hit |= abs(x) >= limit  # False for NaN, as numpy's greater_equal
            finite &= abs(x) < np.inf
            nonzero |= g != 0
        if zero_grad:  # the block is in cache: zeroing it here saves the output's zero-fill pass
            for j in range(BLOCK):
                grad[start + j] = 0.0
        if hit:
            found = positions_of(out, start, start + BLOCK, limit, positions, found)
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

@numba.njit(nogil=True, boundscheck=False, cache=True)
def scan(values: np.ndarray, limit: float, positions: np.ndarray) -> tuple:
    found = 0
    n = values.size
    full = n - n % BLOCK
    finite = True
    nonzero = False
    for start in range(0, full, BLOCK):
        hit = 0
        for j in range(BLOCK):
            v = values[start + j]
            hit |= abs(v) >= limit
            finite &= abs(v) < np.inf
            nonzero |= v != 0
        if hit:
            found = positions_of(values, start, start + BLOCK, limit, positions, found)
    for i in range(full, n):
        v = values[i]
        finite &= abs(v) < np.inf
        nonzero |= v != 0
    return positions_of(values, full, n, limit, positions, found), finite, nonzero
