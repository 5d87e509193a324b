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

from ._prefetch import AHEAD, prefetch_read, prefetch_write

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
def append_candidates(bits: np.uint64, start: int, source: np.ndarray, positions: np.ndarray,
                      values: np.ndarray, found: int) -> int:
    """Append ``start + j`` and ``source[start + j]`` for every set bit j of ``bits``, ascending;
    the new count (counting on past the room, whose candidates are then not written)."""
    room = positions.size
    while bits:
        if found < room:
            position = start + trailing_zeros(bits)
            positions[found] = position
            values[found] = source[position]
        found += 1
        bits &= bits - np.uint64(1)
    return found


@numba.njit(nogil=True, boundscheck=False, cache=True)
def compensate_scan(grad: np.ndarray, residual: np.ndarray, out: np.ndarray, limit: float,
                    positions: np.ndarray, values: np.ndarray, zero_grad: bool, find: bool) -> tuple:
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
        found = append_candidates(bits, start, out, positions, values, found)
    for i in range(full, n):
        g = grad[i]
        x = g + residual[i]
        out[i] = x
        finite &= abs(x) < np.inf
        nonzero |= g != 0
        if zero_grad:
            grad[i] = 0.0
        if find and abs(x) >= limit:
            found = append_candidates(np.uint64(1), i, out, positions, values, found)
    return found, finite, nonzero


@numba.njit(nogil=True, boundscheck=False, cache=True)
def scan(source: np.ndarray, limit: float, positions: np.ndarray, values: np.ndarray) -> tuple:
    found = 0
    n = source.size
    full = n - n % BLOCK
    finite = True
    nonzero = False
    for start in range(0, full, BLOCK):
        bits = np.uint64(0)
        for j in range(BLOCK):
            v = source[start + j]
            bits |= np.uint64(abs(v) >= limit) << np.uint64(j)
            finite &= abs(v) < np.inf
            nonzero |= v != 0
        found = append_candidates(bits, start, source, positions, values, found)
    for i in range(full, n):
        v = source[i]
        finite &= abs(v) < np.inf
        nonzero |= v != 0
        if abs(v) >= limit:
            found = append_candidates(np.uint64(1), i, source, positions, values, found)
    return found, finite, nonzero


@numba.njit(nogil=True, boundscheck=False, cache=True)
def sample_magnitudes(grad: np.ndarray, residual: np.ndarray, add: bool, stride: int, out: np.ndarray) -> None:
    # out[i] = float32(|grad[i * stride] (+ residual[i * stride])|), NaN as -1 and infinity as
    # float32's largest (what torch's nan_to_num(nan=-1) leaves), in one call where torch's
    # gather, add, abs, cast and nan_to_num over the sample are five
    count = out.size
    for i in range(count):
        if i + AHEAD < count:  # every strided load misses the cache: ask for a later one now
            prefetch_read(grad, (i + AHEAD) * stride)
            if add:
                prefetch_read(residual, (i + AHEAD) * stride)
        x = grad[i * stride]
        if add:
            x = x + residual[i * stride]
        magnitude = np.float32(abs(x))
        if magnitude != magnitude:
            magnitude = np.float32(-1.0)
        elif magnitude == np.inf:
            magnitude = np.float32(3.4028234663852886e38)
        out[i] = magnitude


@numba.njit(nogil=True, boundscheck=False, cache=True)
def append_ones(bits: np.uint64, base: int, quotients: np.ndarray, found: int, last: int) -> tuple:
    """For each set bit of ``bits`` (bit j at stream position ``base + j``) until ``quotients``
    is full: the zeros since the previous one. Returns (found, the last one's position)."""
    count = quotients.size
    while bits and found < count:
        bit = base + trailing_zeros(bits)
        quotients[found] = bit - last - 1
        last = bit
        found += 1
        bits &= bits - np.uint64(1)
    return found, last


@numba.njit(nogil=True, boundscheck=False, cache=True)
def unary_quotients(words: np.ndarray, tail: np.ndarray, quotients: np.ndarray) -> int:
    """The unary codes of a little-endian bit stream (``words``: its whole 8-byte words,
    ``tail``: the bytes after them): ``quotients[i]`` = the zeros before the i-th one bit; stops
    once ``quotients`` is full. Returns how many were found. Work: one step per word and per
    one bit found, so bounded by the stream's size."""
    found, last = 0, -1
    for w in range(words.size):
        found, last = append_ones(words[w], w * 64, quotients, found, last)
        if found == quotients.size:
            return found
    for b in range(tail.size):
        found, last = append_ones(np.uint64(tail[b]), words.size * 64 + b * 8, quotients, found, last)
    return found


#: up to this many magnitudes the k-th largest is one partition of them all
PARTITION_ALL_MAX = 2048
#: the threshold sample's size for larger pieces
KTH_SAMPLE = 512


@numba.njit(nogil=True, boundscheck=False, cache=True)
def kept_from_kth(magnitudes: np.ndarray, kth: float, k: int, chosen: np.ndarray) -> int:
    """Write to ``chosen`` (room for k + 1) the ascending indices of the ``k`` largest
    ``magnitudes``, given the k-th largest ``kth``: every one above it, then the first ties.
    Returns k.

    About half the candidates are kept, in no pattern a branch predictor could learn, so the
    passes that pick have no branch: each writes its index and counts it only if kept (the
    room's k + 1st slot takes the last discarded write). Cut at the last tie kept, the two
    passes compare with ``>=`` before it and ``>`` after it; for 38k candidates 120 us here,
    where a branch per element took 240 us."""
    count = magnitudes.size
    above = 0
    for i in range(count):
        above += magnitudes[i] > kth
    tied = k - above  # >= 1: the k-th itself; the first `tied` elements equal to it are kept
    last = -1
    for i in range(count):  # predictable: taken `tied` times
        if magnitudes[i] == kth:
            tied -= 1
            if tied == 0:
                last = i
                break
    found = 0
    for i in range(last + 1):
        chosen[found] = i
        found += np.int64(magnitudes[i] >= kth)
    for i in range(last + 1, count):
        chosen[found] = i
        found += np.int64(magnitudes[i] > kth)
    return found


@numba.njit(nogil=True, boundscheck=False, cache=True)
def keep_largest(magnitudes: np.ndarray, where: np.ndarray, k: int, out: np.ndarray, positions: np.ndarray,
                 values: np.ndarray) -> int:
    """Of the ascending positions ``where`` and their ``magnitudes`` (which hold every element of
    ``out`` at or above its k-th largest magnitude), write the k largest to ``positions`` and
    ``out`` there to ``values``: everything above the k-th (found by a partition), then the first
    ties. Returns k."""
    count = magnitudes.size
    chosen = np.empty(k + 1, dtype=np.int64)
    kept_from_kth(magnitudes, np.partition(magnitudes, count - k)[count - k], k, chosen)
    for j in range(k):
        position = where[chosen[j]]
        positions[j] = position
        values[j] = out[position]
    return k


@numba.njit(nogil=True, boundscheck=False, cache=True)
def keep_candidates(magnitudes: np.ndarray, kth: float, k: int, positions: np.ndarray, values: np.ndarray,
                    kept_positions: np.ndarray, kept_values: np.ndarray) -> int:
    """Of candidates (``positions``, ``values``, ``magnitudes`` = ``|values|``), the ``k`` of largest
    magnitude given the k-th largest ``kth``, in the candidates' order, into ``kept_positions``
    and ``kept_values``. Returns k."""
    chosen = np.empty(k + 1, dtype=np.int64)
    kept_from_kth(magnitudes, kth, k, chosen)
    for j in range(k):
        kept_positions[j] = positions[chosen[j]]
        kept_values[j] = values[chosen[j]]
    return k


@numba.njit(nogil=True, boundscheck=False, cache=True)
def compensate_top(grad: np.ndarray, residual: np.ndarray, add: bool, out: np.ndarray, k: int, largest: float,
                   positions: np.ndarray, values: np.ndarray) -> int:
    """``out = grad + residual`` (``out = grad`` unless ``add``) and the ``k`` largest ``|out|``
    (``0 < k < n``) into ``positions`` (ascending) and ``values``: the numpy path's answer
    exactly (``np.partition`` for the k-th, then everything above it and the first ties; NaN
    ranks below every number, an infinity counts as ``largest``, the dtype's largest finite
    value, as ``nan_to_num`` makes it). For small and middling tensors, where the per-call
    overhead of the torch/numpy path's eight calls is what costs.

    numba's partition is slower than numpy's on large arrays (a top-k among 10k candidates: 180 us
    against 40 us here), so above :data:`PARTITION_ALL_MAX` elements only the candidates at or
    above a threshold read off an evenly spaced sample are partitioned, the threshold set so that
    more than k pass (the sample rank of ``gradwire.sparsify.topk._scan_from_sample``): if at least
    k elements are >= t, the k-th largest is >= t, so it is the k-th largest of those, and every
    element above it is one of them. Too few passing, or more than the room made for them (an
    unlucky sample), partitions everything. Returns k."""
    n = out.size
    magnitudes = np.empty(n, dtype=out.dtype)
    for i in range(n):
        x = grad[i] + residual[i] if add else grad[i]
        out[i] = x
        m = abs(x)
        magnitudes[i] = -1.0 if m != m else min(m, largest)
    if n > PARTITION_ALL_MAX:
        stride = n // KTH_SAMPLE
        sample = magnitudes[::stride]
        size = sample.size
        expected = k * size / n
        rank = int(expected + 4.0 * np.sqrt(expected) + 8.0)
        if rank < size:
            threshold = np.partition(sample, size - rank)[size - rank]
            room = min(n, 2 * (rank * n) // size + 64)
            where = np.empty(room, dtype=np.int64)
            passing = 0
            for i in range(n):
                if magnitudes[i] >= threshold:
                    if passing < room:
                        where[passing] = i
                    passing += 1
            if k <= passing <= room:
                where = where[:passing]
                return keep_largest(magnitudes[where], where, k, out, positions, values)
    return keep_largest(magnitudes, np.arange(n), k, out, positions, values)


@numba.njit(nogil=True, boundscheck=False, cache=True)
def compensate_top_pieces(source: np.ndarray, starts: np.ndarray, residual: np.ndarray, add: np.ndarray,
                          out: np.ndarray, lengths: np.ndarray, ks: np.ndarray, largest: float,
                          positions: np.ndarray, values: np.ndarray) -> int:
    """:func:`compensate_top` for many pieces in one call: piece i is ``source[starts[i]:
    starts[i] + lengths[i]]``, its residual and its compensated output lie end to end in
    ``residual`` and ``out`` (added only where ``add[i]``), its ``ks[i]`` positions (relative to
    the piece, ascending) and values follow piece i-1's in ``positions`` and ``values``. An FSDP
    module's 48 (parameter, destination) pieces, or a bucket's biases and norms, cost one call
    instead of 48 rounds of Python. Returns the positions written (the sum of ``ks``)."""
    written = 0
    at = 0
    for i in range(starts.size):
        a, n, k = starts[i], lengths[i], ks[i]
        written += compensate_top(source[a:a + n], residual[at:at + n], add[i], out[at:at + n], k, largest,
                                  positions[written:written + k], values[written:written + k])
        at += n
    return written


@numba.njit(nogil=True, boundscheck=False, cache=True)
def compensate_check_segments(grad: np.ndarray, residual: np.ndarray, add: np.ndarray, out: np.ndarray,
                              ends: np.ndarray, nonzero: np.ndarray, zero_grad: bool) -> bool:
    """``compensate_scan``'s flags-only pass over consecutive segments of one array in one call:
    segment i is ``[ends[i-1], ends[i])`` (from 0), ``out = grad + residual`` there where
    ``add[i]``, ``out = grad`` elsewhere; ``nonzero[i]`` says whether segment i's gradient has a
    non-zero element. A DDP bucket's 62 tensors, small ones included, cost one call and no check
    of their own. Returns whether every element of ``out`` is finite."""
    finite = True
    begin = 0
    for i in range(ends.size):
        end = ends[i]
        if add[i]:
            _, segment_finite, segment_nonzero = compensate_scan(
                grad[begin:end], residual[begin:end], out[begin:end], np.inf, positions_none(), values_none(out),
                zero_grad, False)
        else:
            segment_finite, segment_nonzero = copy_check(grad[begin:end], out[begin:end], zero_grad)
        finite &= segment_finite
        nonzero[i] = segment_nonzero
        begin = end
    return finite


@numba.njit(nogil=True, boundscheck=False, cache=True)
def shift_segments(values: np.ndarray, counts: np.ndarray, shifts: np.ndarray) -> None:
    # values[start_j : start_j + counts[j]] += shifts[j], segments end to end, in place: one pass
    # where torch's repeat_interleave writes the shifts out and an addition reads them again
    start = 0
    for j in range(counts.size):
        shift = shifts[j]
        for i in range(start, start + counts[j]):
            values[i] += shift
        start += counts[j]


@numba.njit(nogil=True, boundscheck=False, cache=True)
def positions_none() -> np.ndarray:
    return np.empty(0, dtype=np.int64)


@numba.njit(nogil=True, boundscheck=False, cache=True)
def values_none(like: np.ndarray) -> np.ndarray:
    return np.empty(0, dtype=like.dtype)


@numba.njit(nogil=True, boundscheck=False, cache=True)
def copy_check(grad: np.ndarray, out: np.ndarray, zero_grad: bool) -> tuple:
    """``out = grad`` (a segment with nothing owed), the same flags as ``compensate_scan``'s."""
    finite = True
    nonzero = False
    for i in range(out.size):
        g = grad[i]
        out[i] = g
        finite &= abs(g) < np.inf
        nonzero |= g != 0
        if zero_grad:
            grad[i] = 0.0
    return finite, nonzero


@numba.njit(nogil=True, boundscheck=False, cache=True)
def add_at(target: np.ndarray, positions: np.ndarray, values: np.ndarray, alpha: float) -> int:
    """``target[positions[i]] += alpha * values[i]`` in order (repeated positions accumulate, as
    ``index_add_`` does). Returns 0 when every value written is finite (a sum that is not finite
    stays so under further additions, so this is whether the final values there are), 1 when
    one is not, -1 (having stopped there) at a position outside ``target``."""
    n = target.size
    finite = True
    count = positions.size
    for i in range(count):
        if i + AHEAD < count:  # each position misses the cache: ask for a later one now (_prefetch)
            prefetch_write(target, positions[i + AHEAD])
        position = positions[i]
        if position < 0 or position >= n:  # a predictable branch: checking costs nothing here
            return -1
        x = target[position] + alpha * values[i]
        target[position] = x
        finite &= abs(x) < np.inf
    return 0 if finite else 1


@numba.njit(nogil=True, boundscheck=False, cache=True)
def rice_shifted_sums(indices: np.ndarray, low: int, sums: np.ndarray) -> None:
    """``sums[j]`` = the sum of ``gap >> (low + j)`` over the gaps of ascending ``indices``
    (gap = the zeros skipped before each index): the unary part of a Rice code's size for each
    candidate parameter, in one pass."""
    previous = -1
    for i in range(indices.size):
        gap = indices[i] - previous - 1
        previous = indices[i]
        for j in range(sums.size):
            sums[j] += gap >> (low + j)


@numba.njit(nogil=True, boundscheck=False, cache=True)
def rice_write(indices: np.ndarray, parameter: int, section: np.ndarray, unary_start: int) -> None:
    """The Rice section after its parameter byte: every gap's low ``parameter`` bits end to end
    from ``section[1]`` (as ``write_fixed``), then from ``section[unary_start]`` every gap's
    quotient in unary (as ``pack_unary``); bits little-endian within a byte, ``section`` zeroed
    and sized exactly by the caller."""
    mask = (np.int64(1) << parameter) - 1
    accumulator = np.uint64(0)
    held = 0  # bits in the accumulator, < 8 between gaps
    byte = 1
    bit = np.int64(unary_start) * 8
    previous = -1
    for i in range(indices.size):
        gap = indices[i] - previous - 1
        previous = indices[i]
        if parameter:
            accumulator |= np.uint64(gap & mask) << np.uint64(held)
            held += parameter
            while held >= 8:
                section[byte] = np.uint8(accumulator & np.uint64(0xFF))
                accumulator >>= np.uint64(8)
                held -= 8
                byte += 1
        bit += gap >> parameter
        section[bit >> 3] |= np.uint8(1 << (bit & 7))
        bit += 1
    if held:
        section[byte] = np.uint8(accumulator & np.uint64(0xFF))


#: the lane hash's odd multiplier (a 64-bit golden-ratio constant): lane j ends as the polynomial
#: sum of its words times powers of it, mod 2**64, so one changed bit always changes its lane
LANE_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)
#: blocks per round of :func:`divide_and_hash` (written out there) and the multiplier's power that
#: steps a lane over them
HASH_ROUND = 4
LANE_MULTIPLIER_ROUND = np.uint64(0x9E3779B97F4A7C15 ** 4 % 2 ** 64)


@numba.njit(nogil=True, boundscheck=False, cache=True)
def divide_and_hash(values: np.ndarray, words: np.ndarray, divisor: float, factor: float, lanes: np.ndarray,
                    multiply: bool) -> bool:
    """``values /= divisor`` in place (``values *= factor`` when ``multiply``: the caller sets it
    only where that is the same bits, ``factor`` then ``1 / divisor`` in ``values``' dtype); then,
    per block of 64, ``lanes[j] = lanes[j] * M + words[start + j]`` over the quotients' bit
    patterns (``words`` views ``values``' memory as unsigned integers of its width; a short last
    block feeds the first lanes). Returns whether every quotient is finite. One read and one write
    of ``values``: the division, the finiteness test and the hash each used to be a pass of their
    own."""
    n = values.size
    full = n - n % BLOCK
    step = HASH_ROUND * BLOCK
    rounds = full - full % step
    finite = True
    # Horner's rule one block at a time chains every block's multiply on the last one's (latency
    # bound: 0.91 ms per 4.7M float32 here, against 0.51 for the division alone). Four blocks at a
    # time give the same lanes, lane * M**4 + ((w0 * M + w1) * M + w2) * M + w3, with the words'
    # part off the chain (scripts/kernel_bench.py). The loops are written out, each with a fixed
    # trip count and no call or branch inside, so that LLVM vectorizes every one of them.
    for start in range(0, rounds, step):
        if multiply:  # a power-of-two divisor: x * (1 / d) rounds exactly as x / d, at a multiply's cost
            for i in range(start, start + step):
                x = values[i] * factor
                values[i] = x
                finite &= abs(x) < np.inf
        else:
            for i in range(start, start + step):
                x = values[i] / divisor
                values[i] = x
                finite &= abs(x) < np.inf
        for j in range(BLOCK):  # the blocks are in cache: their words cost no second read of memory
            h = np.uint64(words[start + j]) * LANE_MULTIPLIER + np.uint64(words[start + BLOCK + j])
            h = h * LANE_MULTIPLIER + np.uint64(words[start + 2 * BLOCK + j])
            h = h * LANE_MULTIPLIER + np.uint64(words[start + 3 * BLOCK + j])
            lanes[j] = lanes[j] * LANE_MULTIPLIER_ROUND + h
    for i in range(rounds, n):
        x = values[i] / divisor
        values[i] = x
        finite &= abs(x) < np.inf
    for start in range(rounds, full, BLOCK):
        for j in range(BLOCK):
            lanes[j] = lanes[j] * LANE_MULTIPLIER + np.uint64(words[start + j])
    for i in range(full, n):
        lanes[i - full] = lanes[i - full] * LANE_MULTIPLIER + np.uint64(words[i])
    return finite


@numba.njit(nogil=True, boundscheck=False, cache=True)
def sorted_members(needles: np.ndarray, haystack: np.ndarray, out: np.ndarray) -> None:
    """``out[i] = needles[i] in haystack``, both int64 ascending: one merge of the two, where a
    binary search per needle misses the cache ``log2(haystack)`` times."""
    j = 0
    m = haystack.size
    for i in range(needles.size):
        needle = needles[i]
        while j < m and haystack[j] < needle:
            j += 1
        out[i] = j < m and haystack[j] == needle


@numba.njit(nogil=True, boundscheck=False, cache=True)
def union_add(a_positions: np.ndarray, a_values: np.ndarray, b_positions: np.ndarray, b_values: np.ndarray,
              out_positions: np.ndarray, out_values: np.ndarray) -> int:
    """The union of two strictly ascending sparse vectors, ``a + b``: ``a`` where only ``a`` holds
    the position, ``0.0 + b`` where only ``b`` does (the bits of an addition into zeros, -0.0
    included), ``a + b`` where both do. Returns how many were written."""
    i = 0
    j = 0
    n = 0
    na = a_positions.size
    nb = b_positions.size
    while i < na or j < nb:
        if j >= nb or (i < na and a_positions[i] < b_positions[j]):
            out_positions[n] = a_positions[i]
            out_values[n] = a_values[i]
            i += 1
        elif i >= na or b_positions[j] < a_positions[i]:
            out_positions[n] = b_positions[j]
            out_values[n] = 0.0 + b_values[j]
            j += 1
        else:
            out_positions[n] = a_positions[i]
            out_values[n] = a_values[i] + b_values[j]
            i += 1
            j += 1
        n += 1
    return n


@numba.njit(nogil=True, boundscheck=False, cache=True)
def bin_counts(keys: np.ndarray, lo: int, hi: int, inner_edges: np.ndarray, counts: np.ndarray) -> None:
    """``counts[d] +=`` the keys in ``[lo, hi)`` whose bin is ``d``: the number of ``inner_edges``
    (ascending) ``<= key`` (``searchsorted(..., right=True)``), one pass and no temporaries."""
    m = inner_edges.size
    for i in range(keys.size):
        key = keys[i]
        if key < lo or key >= hi:
            continue
        low = 0
        high = m
        while low < high:  # the first edge > key
            middle = (low + high) >> 1
            if inner_edges[middle] <= key:
                low = middle + 1
            else:
                high = middle
        counts[low] += 1


@numba.njit(nogil=True, boundscheck=False, cache=True)
def block_bounds(lengths: np.ndarray, block_size: int) -> np.ndarray:
    """``(nb, 2)`` int64: each block's first and past-last element in a chunk whose blocks restart
    at each of ``lengths`` (the last block of a segment shorter), in order."""
    count = 0
    for s in range(lengths.size):
        count += (lengths[s] + block_size - 1) // block_size
    bounds = np.empty((count, 2), dtype=np.int64)
    block = 0
    start = 0
    for s in range(lengths.size):
        end = start + lengths[s]
        for position in range(start, end, block_size):
            bounds[block, 0] = position
            bounds[block, 1] = min(position + block_size, end)
            block += 1
        start = end
    return bounds


@numba.njit(nogil=True, boundscheck=False, cache=True)
def block_quantize(x: np.ndarray, words: np.ndarray, lengths: np.ndarray, block_size: int, level: int, bits: int,
                   scales: np.ndarray, codes: np.ndarray, local: np.ndarray, want_local: bool) -> None:
    """:mod:`gradwire.exchange.blockquant`'s quantization of every row of ``x`` (float32 ``(rows, n)``;
    ``words`` its uint32 view) in one read: per block (restarting at each of ``lengths``) its
    absmax, then its codes, packed into ``codes`` (uint8 ``(rows, ceil(n bits / 8))``, two's
    complement bytes or nibbles, element ``2i`` low), its float32 scale into ``scales``
    (``(rows, nb)``) and, with ``want_local``, the decoded values ``code * scale`` into ``local``.
    The arithmetic is torch's, operation for operation in float32: ``absmax / L``,
    ``rint(x / divisor)`` (half to even), the clamp; a block holding NaN or Inf gets a NaN scale
    and codes 0.

    The absmax is an integer max over the values' bits without their sign (ordered as the
    magnitudes for every non-NaN float; above Inf's bits only NaNs), so the loop has no branch
    and vectorizes; the codes go through a block-sized float32 buffer, then are packed."""
    top = np.float32(level)
    one = np.float32(1.0)
    buffer = np.empty(block_size, dtype=np.float32)
    infinity = np.uint32(0x7F800000)
    magnitude_bits = np.uint32(0x7FFFFFFF)
    bounds = block_bounds(lengths, block_size)
    for r in range(x.shape[0]):
        for block in range(bounds.shape[0]):
            position, stop = bounds[block, 0], bounds[block, 1]
            m = stop - position
            largest = np.uint32(0)
            for i in range(position, stop):
                largest = max(largest, words[r, i] & magnitude_bits)
            finite = largest < infinity
            scale = np.uint32(largest).view(np.float32) / top if finite else np.float32(np.nan)
            scales[r, block] = scale
            if finite:
                divisor = scale if scale > 0 else one
                for i in range(m):
                    buffer[i] = min(max(np.rint(x[r, position + i] / divisor), -top), top)
            else:
                buffer[:m] = 0
            if bits == 8:
                for i in range(m):
                    codes[r, position + i] = np.uint8(np.int32(buffer[i]) & 0xFF)
            else:
                for i in range(m):
                    nibble = np.uint8(np.int32(buffer[i]) & 0x0F)
                    at = position + i
                    if at & 1:
                        codes[r, at >> 1] |= np.uint8(nibble << 4)
                    else:
                        codes[r, at >> 1] = nibble
            if want_local:  # through the integer code, as a receiver decodes it (rint gives -0.0, a code +0)
                for i in range(m):
                    local[r, position + i] = np.float32(np.int32(buffer[i])) * scale


@numba.njit(nogil=True, boundscheck=False, cache=True)
def block_dequantize(scales: np.ndarray, codes: np.ndarray, lengths: np.ndarray, block_size: int, level: int,
                     bits: int, out: np.ndarray) -> None:
    """``out[r, i] = code * scale`` (float32) for codes packed as :func:`block_quantize` writes them,
    each clamped to ``[-L, L]`` first (bytes off the wire may hold -128 or the nibble 8)."""
    bounds = block_bounds(lengths, block_size)
    for r in range(out.shape[0]):
        for block in range(bounds.shape[0]):
            scale = scales[r, block]
            for i in range(bounds[block, 0], bounds[block, 1]):
                if bits == 8:
                    code = np.int32(codes[r, i])
                    if code >= 128:
                        code -= 256
                else:
                    code = np.int32((codes[r, i >> 1] >> (4 * (i & 1))) & 0x0F)
                    if code >= 8:
                        code -= 16
                if code > level:
                    code = level
                elif code < -level:
                    code = -level
                out[r, i] = np.float32(code) * scale
