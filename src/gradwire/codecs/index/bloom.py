"""``bloom``: DeepReduce's Bloom-filter index codec (lossy).

The sender inserts its ``k`` indices into a Bloom filter of ``m`` bits with ``h`` hash
functions and sends the filter. The receiver asks the filter about *every* position in
``[0, numel)``; the answer is the set of *positives*: every true index plus, at rate about
``fpr``, false positives. A *policy* then decides which positives the values belong to:

* ``p0`` — send every positive. ``IndexEncoding.positions`` is a superset of the input; the
  payload layer reads the false positives' values from the dense (error-compensated) tensor
  when ``encode_tensors(..., dense=...)``/``encode_sparse(..., dense=...)`` is given one, so
  what the receiver reconstructs is exact at every sent position. The price is
  ``false_positives_sent`` extra values (about ``fpr * (numel - k)``).
* ``p1`` — send exactly ``k`` positives chosen at random; sender and receiver draw the same
  ones from the ``seed`` carried in the section. Some true indices are dropped and some false
  positives sent in their place (with the value zero unless ``dense`` is given).
* ``p2`` — DeepReduce's conflict sets: a positive that is the *only* positive hashing to one of
  its filter bits must be a true index (the bit was set by some inserted index, and every
  inserted index is a positive). Those "sure" positives are sent first; the rest of the ``k``
  are drawn at random (shared seed) from the other positives. Keeps more true indices than
  ``p1`` at the same cost.

Sizing (standard optimum for a target false-positive rate ``fpr``)::

    h = max(1, round(log2(1 / fpr)))                      hash functions
    m = max(8, 8 * ceil(k * ln(1 / fpr) / ln(2)**2 / 8))  bits (rounded up to whole bytes)

so the filter costs ``m / k ~= 1.44 * log2(1 / fpr)`` bits per index: 4.8 at fpr=0.1, 9.6 at
0.01, 14.4 at 0.001 — against 32 for ``raw``. Under ``p0`` the false positives also cost their
values: ``stats["false_positives_sent"] * bytes_per_value`` extra bytes in the value section
(4 per value for ``fp32``), i.e. about ``fpr * (numel - k) * 32`` bits. The caller compares
that with what the filter saves; the codec cannot, since it never sees the value codec.

Hashing: a position ``x < 2**32`` is split into ``lo`` and ``hi``, its low and high 16 bits;
``h1 = T1[lo] + U1[hi]`` and ``h2 = T2[lo] + U2[hi]`` (mod 2**32, ``h2`` odd) — simple
tabulation hashing (Patrascu & Thorup), with addition — and probe ``i`` is
``fastrange32(h1 + i * h2, m) = ((h1 + i * h2) mod 2**32 * m) >> 32`` (Kirsch–Mitzenmacher
double hashing, Lemire's range reduction: no division). The four tables are 2**16 words each
of the SplitMix64 stream of the seed: 1 MiB whatever ``numel`` and ``k``; no per-index table
exists, probes are computed on the fly for whole arrays. Why tabulation rather than a 64-bit
mixer per position: inside a block of 2**16 consecutive positions probe ``i`` is
``V_i[lo] + constant`` (``V_i = T1 + i * T2``), one vector add, where SplitMix64 takes nine
passes — and querying all ``numel`` positions is where this codec spends its time (1.5-2x
faster than the mixer, measured). Random choices (``p1``/``p2``) keep the positives with the
smallest key ``splitmix64`` of the position under a second salt: a uniformly random
``k``-subset that both sides compute identically, in one pass, in ``O(k)`` memory.

Section layout (little-endian)::

    policy   u8    0 = p0, 1 = p1, 2 = p2
    h        u8    hash functions, 1..32
    seed     u64   salts the hashes and the random choices
    k        u64   indices inserted (the true count)
    m        u64   filter bits: a multiple of 8, 8 <= m <= 2**32
    filter   m/8 bytes; bit j is bit (j % 8) of byte j // 8

26 bytes of header, then the filter. The payload header's ``count`` is the number of positions
the policy sends: the number of positives for ``p0``, ``k`` for ``p1``/``p2``.

Limits. Decoding queries every one of the ``numel`` positions: ``O(numel)`` hash work (about
2.5 probes per position: probes stop at the first clear bit) in blocks of 2**16
positions so memory stays bounded, spread over ``torch.get_num_threads()`` threads (at most 16).
That is what the scheme costs, so ``numel`` is limited to ``2**32``: decode refuses a larger one
with :class:`~gradwire.errors.DecodeError` before touching the data (a hostile header could
otherwise make the receiver hash 2**40 positions), and encode refuses it with ``ValueError``.
Below that, ``codecs.decode`` refuses Bloom tensors of more than ``2**16 + len(payload)``
elements unless the caller passes ``max_numel`` or ``expected_numels`` (the hook does): each
queried position counts 8x against the payload's decode budget (docs/wire-format.md).
Positions then fit in 32 bits, and so does the range reduction. The decoder's memory is the
unpacked filter (``m`` bytes, 8x the section), the output (``count`` positions), ``O(k)`` for
the random choices and block-sized buffers; it stops as soon as the filter proves inconsistent
with ``count`` or ``k``. The sender scans too: the policy needs the positives. Measured cost on
one core: about 10 ns per position (``numel = 2**24``: 0.1-0.9 s per encode or decode, more for
larger filters, whose unpacked bits leave the cache; ``numel = 2**31``: about 20 s).
"""

from __future__ import annotations

import contextlib
import functools
import math
import struct
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterator

import numpy as np
import torch

from ...errors import check_choice, check_int, is_real, require
from ..base import IndexCodec, IndexEncoding, register_index_codec

#: Largest ``numel`` the codec accepts: the receiver hashes every position.
MAX_BLOOM_NUMEL = 1 << 32
#: Most hash functions (fpr down to about 2**-32); more only makes the receiver slower.
MAX_HASHES = 32
#: Largest filter in bits: probes are reduced with 32-bit fastrange.
MAX_FILTER_BITS = 1 << 32

POLICIES = ("p0", "p1", "p2")

_HEADER = struct.Struct("<BBQQQ")
_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
# Salts for the two uses of the seed: filter hashes and random choices must be independent.
_HASH_PURPOSE = 0x243F6A8885A308D3
_CHOICE_PURPOSE = 0x13198A2E03707344

# Positions are hashed a block of 2**16 at a time (one value of the high half). Working arrays
# stay small (<= 512 KiB) and the per-call overhead of numpy is paid once per 65536 positions.
_BLOCK_BITS = 16
_BLOCK = 1 << _BLOCK_BITS
# Positions per thread task (4 blocks). At most 2 tasks per thread are in flight, so even a
# hostile all-ones filter buffers no more than 2 * threads * 2 MiB of positives.
_SEGMENT = 1 << 18
# p2 makes two passes over the positives; it keeps them between passes up to this many
# (as uint32: 64 MiB), else it hashes every position again rather than grow without bound.
_CACHE_LIMIT = 1 << 24
# Pending candidates buffered before a bottom-k merge.
_MERGE_BATCH = 1 << 16

_U64 = np.uint64
_U32_MASK = 0xFFFFFFFF


def _splitmix64(value: int) -> int:
    """Scalar SplitMix64 finalizer (Python int), for deriving salts from the seed."""
    z = value & _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def _salt(seed: int, purpose: int) -> int:
    return _splitmix64(seed ^ purpose)


def _splitmix_stream(salt: int, positions: np.ndarray) -> np.ndarray:
    """Outputs ``positions`` (uint64 array) of the SplitMix64 stream started at ``salt``."""
    z = positions.astype(np.uint64)
    # x-th output: finalizer of salt + (x + 1) * GAMMA; uint64 arithmetic wraps by design
    # (numpy does not warn for arrays).
    z *= _U64(_GAMMA)
    z += _U64((salt + _GAMMA) & _MASK64)
    tmp = np.empty_like(z)
    np.right_shift(z, _U64(30), out=tmp)
    z ^= tmp
    z *= _U64(_MIX1)
    np.right_shift(z, _U64(27), out=tmp)
    z ^= tmp
    z *= _U64(_MIX2)
    np.right_shift(z, _U64(31), out=tmp)
    z ^= tmp
    return z


@functools.lru_cache(maxsize=8)
def _probe_tables(seed: int, h: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(V, U1, U2)`` for ``seed``: V is (h, 2**16) with ``V[i] = T1 + i * T2``; read-only.

    T1, T2, U1, U2 are 2**16 words each of the SplitMix64 stream of the seed. Cached: every
    encode and decode with the same seed and h reuses them (at most 8 MiB each, for h = 32).
    """
    words = _splitmix_stream(_salt(seed, _HASH_PURPOSE), np.arange(2 * _BLOCK, dtype=np.uint64))
    # Little-endian halves, so the tables (and so the wire format) are the same on any machine.
    t1, t2, u1, u2 = np.frombuffer(words.astype("<u8").tobytes(), dtype="<u4").astype(np.uint32).reshape(4, _BLOCK)
    t2 |= np.uint32(1)  # h2 = T2[lo] + U2[hi] is odd: the h probes are distinct mod 2**32
    u2 &= np.uint32(0xFFFFFFFE)
    # Built in place (uint32 wraps): a temporary of the same size would double this decoder's
    # largest fixed allocation (8 MiB at h = 32).
    v = np.empty((h, _BLOCK), dtype=np.uint32)
    np.multiply(np.arange(h, dtype=np.uint32)[:, None], t2[None, :], out=v)
    v += t1[None, :]
    for table in (v, u1, u2):
        table.flags.writeable = False
    return v, u1, u2


class _Hasher:
    """The filter's ``h`` probes for positions ``x < 2**32``; see "Hashing" in the module doc.

    ``h1(x) = T1[lo] + U1[hi]`` and ``h2(x) = T2[lo] + U2[hi]`` (mod 2**32), where ``lo`` and
    ``hi`` are the low and high 16 bits of ``x`` (simple tabulation hashing with addition);
    probe ``i`` is ``fastrange32(h1 + i * h2, m) = ((h1 + i * h2) mod 2**32 * m) >> 32``.
    Probe ``i`` is thus ``fastrange32(V_i[lo] + W_i[hi])`` with ``V_i = T1 + i * T2``: inside a
    block of 2**16 positions it is one add of a constant to a table — no per-position mixing.
    """

    def __init__(self, seed: int, m: int, h: int) -> None:
        self.m = _U64(m)
        self.h = h
        self.v, self.u1, self.u2 = _probe_tables(seed, h)

    def probes(self, positions: np.ndarray) -> Iterator[np.ndarray]:
        """For ``i = 0 .. h-1``: probe ``i``'s filter bit of every position (int64 array)."""
        positions = positions.astype(np.int64, copy=False)
        lo = positions & (_BLOCK - 1)
        hi = positions >> _BLOCK_BITS
        offset = self.u1.take(hi)  # W_i[hi], advanced by U2[hi] per probe (uint32 wraps)
        step = self.u2.take(hi)
        for i in range(self.h):  # a loop over hash functions, vectorized over positions
            if i:
                offset += step
            g = self.v[i].take(lo)
            g += offset
            product = np.multiply(g, self.m, dtype=np.uint64)
            product >>= _U64(32)
            yield product.view(np.int64)

    def probe_bits(self, positions: np.ndarray) -> np.ndarray:
        """All ``h`` bits of each position: int64 array (len(positions), h); callers keep
        ``len(positions)`` to a block so this stays small."""
        out = np.empty((positions.size, self.h), dtype=np.int64)
        for i, bits in enumerate(self.probes(positions)):
            out[:, i] = bits
        return out


class _Scanner:
    """Hashes ranges of positions and returns those the filter answers positive."""

    def __init__(self, filt: np.ndarray, hasher: _Hasher) -> None:
        self.filt = filt
        self.hasher = hasher

    def segment(self, start: int, stop: int) -> np.ndarray:
        """Positives in ``[start, stop)`` (block-aligned ``start``), ascending int64."""
        g = np.empty(_BLOCK, dtype=np.uint32)
        product = np.empty(_BLOCK, dtype=np.uint64)
        ok = np.empty(_BLOCK, dtype=bool)
        both = np.empty(_BLOCK, dtype=bool)
        parts = []
        for block_start in range(start, stop, _BLOCK):
            length = min(stop, block_start + _BLOCK) - block_start
            found = self._block(block_start, g[:length], product[:length], ok[:length], both[:length])
            if found.size:
                parts.append(found)
        if not parts:
            return np.zeros(0, dtype=np.int64)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _probe_all(self, i: int, offset: int, g: np.ndarray, product: np.ndarray, out: np.ndarray) -> None:
        """Filter bit of probe ``i`` for every position of the block, into ``out``."""
        hasher = self.hasher
        np.add(hasher.v[i, : g.size], np.uint32(offset), out=g)  # uint32 wrap = mod 2**32
        np.multiply(g, hasher.m, out=product, dtype=np.uint64)
        product >>= _U64(32)
        np.take(self.filt, product.view(np.int64), out=out, mode="wrap")  # indices < m already

    def _block(self, block_start: int, g: np.ndarray, product: np.ndarray, ok: np.ndarray,
               both: np.ndarray) -> np.ndarray:
        hasher = self.hasher
        hi = block_start >> _BLOCK_BITS
        u1, u2 = int(hasher.u1[hi]), int(hasher.u2[hi])
        # Probes 0 and 1 on every position (cheap: one add to a table), then the rest only on
        # the survivors: each probe passes about half (the filter's fill at the optimum), so
        # a quarter of the positions go on, an eighth after probe 2, and so on.
        self._probe_all(0, u1, g, product, ok)
        if hasher.h > 1:
            self._probe_all(1, (u1 + u2) & _U32_MASK, g, product, both)
            ok &= both
        alive = np.flatnonzero(ok)
        for i in range(2, hasher.h):
            if not alive.size:
                break
            probe = hasher.v[i].take(alive)
            probe += np.uint32((u1 + i * u2) & _U32_MASK)
            bit = np.multiply(probe, hasher.m, dtype=np.uint64)
            bit >>= _U64(32)
            keep = np.flatnonzero(self.filt.take(bit.view(np.int64)))
            if keep.size != alive.size:
                alive = alive.take(keep)
        alive += block_start
        return alive


def _choice_keys(positions: np.ndarray, salt: int) -> np.ndarray:
    """Random order for p1/p2: 32 random high bits, the position below (keys are distinct)."""
    z = _splitmix_stream(salt, positions)
    z &= _U64(0xFFFFFFFF00000000)
    z |= positions.astype(np.uint64)
    return z


def _workers() -> int:
    return max(1, min(16, torch.get_num_threads()))


def _positive_chunks(filt: np.ndarray, hasher: _Hasher, numel: int) -> Iterator[np.ndarray]:
    """Every positive in ``[0, numel)``, ascending, as a sequence of int64 arrays."""
    scanner = _Scanner(filt, hasher)
    bounds = ((s, min(numel, s + _SEGMENT)) for s in range(0, numel, _SEGMENT))
    workers = _workers() if numel > _SEGMENT else 1
    if workers == 1:
        for start, stop in bounds:
            yield scanner.segment(start, stop)
        return
    # numpy releases the GIL inside these calls, so segments hash in parallel; a short window
    # of futures keeps memory bounded and the output in order.
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="gradwire-bloom")
    window: deque[Future[np.ndarray]] = deque()
    try:
        for start, stop in bounds:
            window.append(pool.submit(scanner.segment, start, stop))
            if len(window) >= 2 * workers:
                yield window.popleft().result()
        while window:
            yield window.popleft().result()
    finally:
        for future in window:
            future.cancel()
        pool.shutdown(wait=True)


class _BottomK:
    """The ``k`` candidates with the smallest keys seen so far, in ``O(k)`` memory."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.keys = np.zeros(0, dtype=np.uint64)
        self.positions = np.zeros(0, dtype=np.int64)
        self.pending_keys: list[np.ndarray] = []
        self.pending_positions: list[np.ndarray] = []
        self.pending = 0
        self.threshold: "np.uint64 | None" = None  # largest kept key once k are kept

    def add(self, keys: np.ndarray, positions: np.ndarray) -> None:
        if self.k == 0 or not keys.size:
            return
        if self.threshold is not None:
            below = keys < self.threshold
            keys, positions = keys[below], positions[below]
            if not keys.size:
                return
        self.pending_keys.append(keys)
        self.pending_positions.append(positions)
        self.pending += keys.size
        if self.pending >= max(self.k, _MERGE_BATCH):
            self._merge()

    def _merge(self) -> None:
        if not self.pending:
            return
        keys = np.concatenate([self.keys, *self.pending_keys])
        positions = np.concatenate([self.positions, *self.pending_positions])
        self.pending_keys, self.pending_positions, self.pending = [], [], 0
        if keys.size > self.k:
            keep = np.argpartition(keys, self.k - 1)[: self.k]
            keys, positions = keys[keep], positions[keep]
        self.keys, self.positions = keys, positions
        if keys.size == self.k:
            self.threshold = keys.max()

    def take(self, count: int) -> np.ndarray:
        """Positions of the ``count`` smallest keys (``count <= k``), unsorted."""
        self._merge()
        if count >= self.keys.size:
            return self.positions
        if count <= 0:
            return np.zeros(0, dtype=np.int64)
        return self.positions[np.argpartition(self.keys, count - 1)[:count]]


def sizing(k: int, fpr: float) -> tuple[int, int]:
    """``(h, m)`` for ``k`` indices at false-positive rate ``fpr`` (see the module docstring)."""
    h = max(1, round(math.log2(1.0 / fpr)))
    bits = math.ceil(k * math.log(1.0 / fpr) / math.log(2) ** 2)
    return h, max(8, 8 * math.ceil(bits / 8))


@register_index_codec
class BloomIndexCodec(IndexCodec):
    """DeepReduce Bloom-filter index codec; lossy, see the module docstring.

    The filter costs about ``1.44 log2(1 / fpr)`` bits per index (9.6 at the default), and
    ``encode`` returns in :attr:`~gradwire.codecs.IndexEncoding.positions` exactly the positions
    the receiver will use (``stats`` counts the false positives). Decoding queries all ``numel``
    positions, ``O(numel * h)``, so ``numel`` is limited to 2**32 and each position counts 8x
    against the payload's decode budget (:attr:`scans_every_position`; docs/wire-format.md,
    "Decode cost bounds").

    Args:
        fpr: target false-positive rate, ``2**-32 <= fpr < 1`` (default 0.01). Under ``p0`` it
            costs about ``fpr * numel`` extra values, so choose it well below the density
            ``k / numel``.
        policy: ``"p0"`` (default; every positive), ``"p1"`` (k at random) or ``"p2"`` (conflict
            sets first, then k at random).
        seed: unsigned 64-bit, salts the hashes and the random choices (vary it per step to
            decorrelate false positives); it travels in the section.

    Raises:
        ValueError: an option out of range. ``encode`` also raises it for ``numel > 2**32`` or a
            filter of more than 2**32 bits.
    """

    name = "bloom"
    wire_id = 10
    scans_every_position = True
    lossless = False

    def __init__(self, *, fpr: float = 0.01, policy: str = "p0", seed: int = 0) -> None:
        if not is_real(fpr) or not 2.0**-32 <= fpr < 1.0:
            raise ValueError(f"fpr={fpr!r} is not supported; allowed: a number with 2**-32 <= fpr < 1")
        check_choice("policy", policy, POLICIES)
        self.fpr = float(fpr)
        self.policy = policy
        self.seed = check_int("seed", seed, 0, _MASK64)

    # -- encode -------------------------------------------------------------------------------

    def encode(self, indices: np.ndarray, numel: int) -> IndexEncoding:
        if numel > MAX_BLOOM_NUMEL:
            raise ValueError(
                f"bloom supports numel <= 2**32 (the receiver hashes every position); got {numel}"
            )
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        k = int(indices.size)
        h, m = sizing(k, self.fpr)
        if m > MAX_FILTER_BITS:
            raise ValueError(
                f"a filter for {k} indices at fpr={self.fpr} needs {m} bits, more than 2**32; "
                "raise fpr or use a lossless index codec"
            )
        filt = np.zeros(m, dtype=bool)
        if k:
            for bits in _Hasher(self.seed, m, h).probes(indices):
                filt[bits] = True
        policy = POLICIES.index(self.policy)
        positions, positives, sure = _select(filt, numel, policy, h, m, self.seed, k, None)
        header = _HEADER.pack(policy, h, self.seed, k, m)
        data = header + np.packbits(filt, bitorder="little").tobytes()

        if policy == 0:
            true_sent = k  # every inserted index is a positive, and p0 sends them all
        else:
            slot = np.minimum(np.searchsorted(indices, positions), max(k - 1, 0))
            true_sent = int(np.count_nonzero(indices[slot] == positions)) if k else 0
        stats: dict[str, float] = {
            "true_k": k,
            "positives": positives,
            "false_positives": positives - k,
            "false_positives_sent": int(positions.size) - true_sent,
            "true_positives_sent": true_sent,
            "sure_positives": sure,
            "filter_bits": m,
            "hashes": h,
            "bits_per_index": m / k if k else float(m),
            "measured_fpr": (positives - k) / (numel - k) if numel > k else 0.0,
        }
        return IndexEncoding(data, positions, stats)

    # -- decode -------------------------------------------------------------------------------

    def decode(self, data: memoryview, numel: int, count: int) -> np.ndarray:
        require(0 <= numel <= MAX_BLOOM_NUMEL, f"bloom decodes numel <= 2**32 (it hashes every position), got {numel}")
        require(0 <= count <= numel, f"count {count} is not in [0, {numel}]")
        require(len(data) >= _HEADER.size, f"truncated: bloom header needs {_HEADER.size} bytes, have {len(data)}")
        policy, h, seed, k, m = _HEADER.unpack_from(data, 0)
        require(policy < len(POLICIES), f"unknown bloom policy {policy}")
        require(1 <= h <= MAX_HASHES, f"bloom hash count {h} is not in [1, {MAX_HASHES}]")
        require(8 <= m <= MAX_FILTER_BITS and m % 8 == 0,
                f"bloom filter size {m} bits is not a multiple of 8 in [8, 2**32]")
        require(len(data) - _HEADER.size == m // 8,
                f"bloom filter has {len(data) - _HEADER.size} bytes, header says {m // 8}")
        require(k <= numel, f"bloom filter holds {k} indices for a tensor of {numel}")
        if policy == 0:
            require(count >= k, f"p0 sends every positive, at least the {k} inserted, not {count}")
        else:
            require(count == k, f"{POLICIES[policy]} sends exactly k={k} positions, header count is {count}")
        filt = np.unpackbits(np.frombuffer(data, dtype=np.uint8, offset=_HEADER.size), bitorder="little").view(bool)
        ones = int(np.count_nonzero(filt))
        # Each inserted index sets between 1 and h bits: an empty filter means k = 0.
        require((ones == 0) == (k == 0) and ones <= h * k, f"bloom filter has {ones} bits set for k={k}, h={h}")
        positions, _, _ = _select(filt, numel, policy, h, m, seed, k, count)
        return positions


def _select(
    filt: np.ndarray, numel: int, policy: int, h: int, m: int, seed: int, k: int, count: "int | None"
) -> tuple[np.ndarray, int, int]:
    """The positions ``policy`` sends, the number of positives, the number of sure positives.

    Shared by encoder and decoder so both compute the same thing. ``count`` (decoder only)
    lets ``p0`` stop as soon as the filter yields more positives than the header announced.
    Raises DecodeError when the filter cannot have come from ``k`` insertions.
    """
    if k == 0:
        # Nothing was inserted: the filter is empty (decode checked) and nothing is positive.
        require(not count, f"bloom filter is empty, header count is {count}")
        return np.zeros(0, dtype=np.int64), 0, 0
    hasher = _Hasher(seed, m, h)
    choice_salt = _salt(seed, _CHOICE_PURPOSE)
    # closing(): stopping early (a DecodeError) must stop the worker threads at once.
    with contextlib.closing(_positive_chunks(filt, hasher, numel)) as chunks:
        return _apply_policy(chunks, filt, hasher, numel, policy, m, k, count, choice_salt)


def _apply_policy(
    chunks: Iterator[np.ndarray],
    filt: np.ndarray,
    hasher: _Hasher,
    numel: int,
    policy: int,
    m: int,
    k: int,
    count: "int | None",
    choice_salt: int,
) -> tuple[np.ndarray, int, int]:
    if policy == 0:
        parts, total = [], 0
        for part in chunks:
            total += part.size
            require(count is None or total <= count, f"bloom filter yields more than the {count} positives announced")
            parts.append(part)
        require(count is None or total == count, f"bloom filter yields {total} positives, header says {count}")
        require(total >= k, f"bloom filter yields {total} positives, fewer than the {k} inserted")
        positions = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return positions, total, 0
    if policy == 1:
        chosen = _BottomK(k)
        total = 0
        for part in chunks:
            total += part.size
            chosen.add(_choice_keys(part, choice_salt), part)
        require(total >= k, f"bloom filter yields {total} positives, fewer than the {k} inserted")
        return np.sort(chosen.take(k)), total, 0
    return _select_conflict_sets(chunks, lambda: _positive_chunks(filt, hasher, numel), hasher, m, k, choice_salt)


def _blocks(parts: Iterator[np.ndarray]) -> Iterator[np.ndarray]:
    """Split arrays into pieces of at most one block, so (pieces x h) matrices stay small."""
    for part in parts:
        for start in range(0, part.size, _BLOCK):
            yield part[start : start + _BLOCK]


def _select_conflict_sets(
    chunks: Iterator[np.ndarray],
    rescan: Callable[[], Iterator[np.ndarray]],
    hasher: _Hasher,
    m: int,
    k: int,
    choice_salt: int,
) -> tuple[np.ndarray, int, int]:
    """p2: sure positives (sole positive on some bit) first, then random others up to ``k``."""
    # Pass 1: for every bit, how many distinct positives probe it (saturating at 2).
    conflicts = np.zeros(m, dtype=np.uint8)
    cache: "list[np.ndarray] | None" = []
    total = 0
    for part in chunks:
        total += part.size
        if cache is not None:
            if total <= _CACHE_LIMIT:
                cache.append(part.astype(np.uint32))  # positions < 2**32
            else:
                cache = None
        for piece in _blocks(iter([part])):
            bits = np.sort(hasher.probe_bits(piece), axis=1)
            # A positive whose probes repeat a bit counts once there: conflict sets are sets.
            distinct = np.ones(bits.shape, dtype=bool)
            distinct[:, 1:] = bits[:, 1:] != bits[:, :-1]
            ids, hits = np.unique(bits[distinct], return_counts=True)
            conflicts[ids] = np.minimum(conflicts[ids] + np.minimum(hits, 2), 2).astype(np.uint8)
    require(total >= k, f"bloom filter yields {total} positives, fewer than the {k} inserted")

    # Pass 2: sure positives; the others compete for the remaining slots by random key.
    sure_parts: list[np.ndarray] = []
    sure_total = 0
    others = _BottomK(k)
    # Without the cache (too many positives to keep), hash every position once more.
    source = (part for part in cache) if cache is not None else rescan()
    with contextlib.closing(source) as second:
        for piece in _blocks(second):
            piece = piece.astype(np.int64)
            sure = (conflicts[hasher.probe_bits(piece)] == 1).any(axis=1)
            sure_total += int(np.count_nonzero(sure))
            require(sure_total <= k, f"bloom filter has more than k={k} sure positives")
            sure_parts.append(piece[sure])
            rest = piece[~sure]
            others.add(_choice_keys(rest, choice_salt), rest)
    sure_positions = np.concatenate(sure_parts) if sure_parts else np.zeros(0, dtype=np.int64)
    fill = others.take(k - sure_total)
    return np.sort(np.concatenate([sure_positions, fill])), total, sure_total


__all__ = ["BloomIndexCodec", "MAX_BLOOM_NUMEL", "POLICIES", "sizing"]
