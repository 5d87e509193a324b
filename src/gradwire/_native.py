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
from numba.cpython.unsafe.numbers import trailing_zeros

#: elements per block of the vectorized loops: one bit each in a uint64 mask (a constant: numba
#: freezes module globals)
BLOCK = 64


# Each kernel walks blocks of 64. The block's arithmetic and its "|x| >= limit" tests form a
# loop without branches that LLVM vectorizes, the tests packed into one 64-bit mask; the
# positions are then read off the mask's set bits (count trailing zeros, clear the lowest), so
# the work after the pass is one step per candidate, not per element of a block that holds one.
# ResNet-18's 11.2M float32 gradients at 1.5% candidates, one thread: 3.8 ms, against 6.4 ms for
# blocks of 32 walked again element by element, 3.6 ms for the pass without the tests and
# 3.4-3.8 ms for torch.add (scripts/kernel_bench.py).
@numba.njit(nogil=True, boundscheck=False, cache=True)
def append_positions(bits: np.uint64, start: int, positions: np.ndarray, found: int) -> int:
    """Append ``start + j`` for every set bit j of ``bits``, ascending; the new count (counting on
    past the room, whose positions are then not written)."""
    room = positions.size
    while bits:
        if found < room:
            positions[found] = start + trailing_zeros(bits)
        found += 1
        bits &= bits - np.uint64(1)
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
        bits = np.uint64(0)
        for j in range(BLOCK):
            g = grad[start + j]
            x = g + residual[start + j]
            out[start + j] = x
            if find:
                bits |= np.uint64(abs(x) >= limit) << np.uint64(j)  # False for NaN, as numpy's greater_equal
            finite &= abs(x) < np.inf
            nonzero |= g != 0
        if zero_grad:  # the block is in cache: zeroing it here saves the output's zero-fill pass
            for j in range(BLOCK):
                grad[start + j] = 0.0
        found = append_positions(bits, start, positions, found)
    for i in range(full, n):
        g = grad[i]
        x = g + residual[i]
        out[i] = x
        finite &= abs(x) < np.inf
        nonzero |= g != 0
        if zero_grad:
            grad[i] = 0.0
        if find and abs(x) >= limit:
            found = append_positions(np.uint64(1), i, positions, found)
    return found, finite, nonzero


@numba.njit(nogil=True, boundscheck=False, cache=True)
def scan(values: np.ndarray, limit: float, positions: np.ndarray) -> tuple:
    found = 0
    n = values.size
    full = n - n % BLOCK
    finite = True
    nonzero = False
    for start in range(0, full, BLOCK):
        bits = np.uint64(0)
        for j in range(BLOCK):
            v = values[start + j]
            bits |= np.uint64(abs(v) >= limit) << np.uint64(j)
            finite &= abs(v) < np.inf
            nonzero |= v != 0
        found = append_positions(bits, start, positions, found)
    for i in range(full, n):
        v = values[i]
        finite &= abs(v) < np.inf
        nonzero |= v != 0
        if abs(v) >= limit:
            found = append_positions(np.uint64(1), i, positions, found)
    return found, finite, nonzero


@numba.njit(nogil=True, boundscheck=False, cache=True)
def unary_quotients(words: np.ndarray, tail: np.ndarray, quotients: np.ndarray) -> int:
    """The unary codes of a little-endian bit stream (``words``: its whole 8-byte words,
    ``tail``: the bytes after them): ``quotients[i]`` = the zeros before the i-th one bit; stops
    once ``quotients`` is full. Returns how many were found. Work: one step per word and per
    one bit found, so bounded by the stream's size."""
    count = quotients.size
    found = 0
    last = -1
    for w in range(words.size):
        bits = words[w]
        while bits:
            bit = w * 64 + trailing_zeros(bits)
            quotients[found] = bit - last - 1
            last = bit
            found += 1
            if found == count:
                return found
            bits &= bits - np.uint64(1)
    base = words.size * 64
    for b in range(tail.size):
        bits = np.uint64(tail[b])
        while bits:
            bit = base + b * 8 + trailing_zeros(bits)
            quotients[found] = bit - last - 1
            last = bit
            found += 1
            if found == count:
                return found
            bits &= bits - np.uint64(1)
    return found
