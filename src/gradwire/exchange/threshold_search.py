"""One magnitude threshold, the same bits on every rank, from summed histograms (a bucket select).

The owners of a sparse AllReduce hold disjoint sets of reduced values; the threshold must keep
about ``k`` of them in all. A non-negative float32's bit pattern read as an integer (31 bits: the
sign is 0) orders exactly like the float, zeros and denormals included: a **key**. The search
narrows an interval of keys ``[lo, hi)`` known to hold the k-th largest key, level by level:

* every owner counts its keys in ``[lo, hi)`` in ``W`` bins (:meth:`ThresholdSearch.edges`); level
  1 covers all keys with ``W`` equal bins (the top ``log2 W`` bits: ``W/256`` bins per octave of
  float32's exponent range), or, given a **hint** (the previous step's threshold ``h``), ``W - 2``
  equal bins over ``[h/2, 2h)`` and one bin below and one above;
* a SUM of the counts over the ranks (integers: exact, so every rank holds the same) and every rank
  picks, from the same counts, the bin holding the k-th largest key: the next ``[lo, hi)``;
* later levels split that interval into ``min(W, hi - lo)`` equal bins.

It stops as soon as the chosen bin's lower edge keeps at most ``slack`` entries beyond ``k``
(:func:`count_slack`), or when the bin is one key (one float value). The threshold is that lower
edge: a pure function of the summed counts and the hint, so bit-identical on every rank.

**Count bound** (``0 < k < N``, ``N`` the reduced support): ``k <= survivors <= k + max(slack, T - 1)``
with ``T`` the number of entries whose magnitude equals the k-th largest exactly; ties are never
split. The result holds the exact top-k of the magnitudes. ``k >= N`` keeps all ``N`` (threshold
``-inf``), ``k = 0`` none (``+inf``). :attr:`ThresholdSearch.survivors` is the exact count.

**Levels**: ``W`` from ``k`` (:func:`histogram_bits`, ``k/128`` to ``k/64`` bins, 64 to 2048).
Without a hint typical gradients stop after two levels (the second resolves ``W^2 / 256`` bins per
octave; small ``k`` may need a third); with a hint within a factor 2 of the new threshold, after one
(``(W-2)/2`` bins per octave around it); ties or adversarial magnitudes take at most
``ceil(31 / log2 W)`` levels, plus one for a hint that missed.
"""

from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass, replace
from typing import Optional

import torch

from .. import kernels

#: keys are in [0, 2^KEY_BITS): a non-negative float32's pattern without its (zero) sign bit
KEY_BITS = 31
KEYS = 1 << KEY_BITS
#: keys per octave: the float32 mantissa's 23 bits
OCTAVE = 1 << 23
#: words of the arguments' fingerprint that ride on level 1 (one per bit of a 16-bit CRC)
FINGERPRINT_WORDS = 16
MIN_BITS, MAX_BITS = 6, 11


def histogram_bits(k: int) -> int:
    """``log2 W``, the bins per level: ``k/128 < W <= k/64``, clamped to 64..2048.

    Two levels of 4-byte counts, each sent about twice (reduce-scatter, AllGather), then cost at most
    ``2 * 2 * 4 / 64 = 1/4`` byte per kept entry, against ``2 e`` for the entries themselves (``e``
    bytes each): 2-4% at ``e = 3.4``. Below ``k = 4096`` the floor of 64 bins trades bytes for levels:
    with a hint a level resolves 31 bins per octave, often enough for one level on small buckets,
    and without one two levels resolve 16 (a third may be needed); fewer bins would cost rounds
    (``2(p-1)`` each), which weigh on small buckets' time far more than their bytes."""
    return max(MIN_BITS, min(MAX_BITS, int(k).bit_length() - 7))


def count_slack(k: int) -> int:
    """Entries beyond ``k`` a level may keep and stop: ``max(4, k // 32)`` (at most ~3%)."""
    return max(4, int(k) // 32)


def count_dtype(numel: int) -> torch.dtype:
    """The smallest integer type every count fits: a count is at most ``numel`` (the summed bins
    count distinct positions)."""
    for dtype in (torch.int16, torch.int32):
        if numel <= torch.iinfo(dtype).max:
            return dtype
    return torch.int64


def fingerprints_agree(summed: torch.Tensor, world_size: int) -> bool:
    """Whether summed :meth:`ThresholdSearch.fingerprint_words` say every rank's search was the same."""
    words = summed.cpu().to(torch.int64)
    return bool(((words == 0) | (words == world_size)).all())


def magnitude_keys(values: torch.Tensor) -> torch.Tensor:
    """(n,) int64 keys of finite float32 ``values``: ``|v|``'s bit pattern, ordered like ``|v|``."""
    return values.abs().contiguous().view(torch.int32).to(torch.int64)


def key_of(value: float) -> int:
    """The key of a finite float ``value >= 0`` (rounded to float32)."""
    return int(torch.tensor([value], dtype=torch.float32).view(torch.int32)[0])


def key_to_float(key: int) -> float:
    """The float32 value whose pattern is ``key`` (``0 <= key < 2^31``), as a Python float (exact)."""
    return float(torch.tensor([key], dtype=torch.int32).view(torch.float32)[0])


@dataclass(frozen=True)
class ThresholdSearch:
    """The state every rank holds alike between levels.

    Attributes:
        k: survivors wanted.
        bins: bins per level.
        slack: entries beyond ``k`` a level may keep and stop (:func:`count_slack`).
        hint_key: the hint's key, used by level 1 only (None: no hint).
        lo: with ``hi``, the keys ``[lo, hi)`` known to hold the k-th largest (``lo == hi``:
            decided without one, 0 keep all, ``2^31`` none).
        hi: see ``lo``.
        above: entries with keys ``>= hi``.
        survivors: how many keys ``>= lo`` there are (None before level 1).
        level: levels done.
        done: whether :attr:`threshold` is decided.
    """

    k: int
    bins: int
    slack: int
    hint_key: Optional[int] = None
    lo: int = 0
    hi: int = KEYS
    above: int = 0
    survivors: Optional[int] = None
    level: int = 0
    done: bool = False

    @classmethod
    def start(cls, k: int, bins: Optional[int] = None, hint: Optional[float] = None) -> "ThresholdSearch":
        """A search for ``k`` survivors.

        Args:
            k: survivors wanted, >= 0.
            bins: bins per level, a power of two in 4..4096 (None: sized by ``k``,
                :func:`histogram_bits`).
            hint: where the threshold likely is (ignored unless finite and > 0).

        Returns:
            The state before level 1.

        Raises:
            ValueError: ``k`` or ``bins`` out of range.
        """
        if k < 0:
            raise ValueError(f"k={k} must be >= 0")
        if bins is None:
            bins = 1 << histogram_bits(k)
        elif bins < 4 or bins > 4096 or bins & (bins - 1):
            raise ValueError(f"summary_size={bins} must be a power of two in 4..4096")
        usable = hint is not None and math.isfinite(hint) and hint > 0
        return cls(k, bins, count_slack(k), key_of(hint) if usable else None)

    @property
    def threshold_key(self) -> int:
        """Keep the keys ``>=`` this (valid once ``done``: ``0`` keeps all, ``2^31`` none)."""
        return self.lo

    @property
    def threshold(self) -> float:
        """The agreed magnitude threshold: keep ``|v| >= threshold`` (``-inf``: all, ``inf``: none)."""
        if not self.done:
            raise ValueError("the search is not done")
        if self.lo == self.hi:  # decided at level 1 without a bin: everything or nothing
            return -math.inf if self.lo == 0 else math.inf
        return key_to_float(self.lo)

    def fingerprint_words(self, dtype: torch.dtype) -> torch.Tensor:
        """(16,) ``dtype`` words, bit j of a 16-bit CRC of ``(k, bins, hint)`` in word j. Summed over
        the ranks, every word is 0 or ``p`` when all ranks started the same search, and some word is
        not when two searches differ, but for one pair of arguments in 65,536
        (:func:`fingerprints_agree`): checked on level 1, before ranks that disagree could run
        different numbers of levels (mismatched collectives)."""
        crc = zlib.crc32(struct.pack("<qqq", self.k, self.bins, -1 if self.hint_key is None else self.hint_key))
        return (((crc ^ (crc >> 16)) >> torch.arange(FINGERPRINT_WORDS)) & 1).to(dtype)

    def edges(self) -> torch.Tensor:
        """(bins + 1,) int64 ascending edges of this level's bins, bin d holding keys in ``[e_d, e_{d+1})``."""
        if self.level == 0 and self.hint_key is not None:
            low, high = max(self.hint_key - OCTAVE, 0), min(self.hint_key + OCTAVE, KEYS)
            window = low + (high - low) * torch.arange(self.bins - 1, dtype=torch.int64) // (self.bins - 2)
            return torch.cat([torch.tensor([0]), window, torch.tensor([KEYS])])
        count = min(self.bins, self.hi - self.lo) if self.level else self.bins
        return self.lo + (self.hi - self.lo) * torch.arange(count + 1, dtype=torch.int64) // count

    def local_counts(self, keys: torch.Tensor) -> torch.Tensor:
        """This owner's histogram for the next level: (len(edges) - 1,) int64 counts of its ``keys``
        ((n,) int64) in ``[lo, hi)``, by bin."""
        edges = self.edges().to(keys.device)
        if keys.device.type == "cpu" and kernels.available():  # one pass, no mask or gathered copy
            return torch.from_numpy(kernels.bin_counts(keys.contiguous().numpy(), self.lo, self.hi,
                                                       edges[1:-1].contiguous().numpy()))
        inside = keys[(keys >= self.lo) & (keys < self.hi)]
        bins = torch.searchsorted(edges[1:-1], inside, right=True)
        return torch.bincount(bins, minlength=edges.numel() - 1)

    def refine(self, counts: torch.Tensor) -> "ThresholdSearch":
        """The next state from this level's summed histogram (every rank's ``local_counts`` summed):
        a pure function of ``counts`` and the state, so the same on every rank.

        Raises:
            ValueError: ``counts`` has the wrong size, or cannot hold the k-th largest key (the ranks
                ran different searches).
        """
        edges = self.edges()
        counts = counts.to(device="cpu", dtype=torch.int64).reshape(-1)
        if counts.numel() != edges.numel() - 1 or self.done:
            raise ValueError(f"expected {edges.numel() - 1} counts of a search not done, got {counts.numel()}")
        if self.level == 0:
            total = int(counts.sum())
            if self.k >= total:
                return replace(self, lo=0, hi=0, survivors=total, level=1, done=True)
            if self.k == 0:
                return replace(self, lo=KEYS, hi=KEYS, survivors=0, level=1, done=True)
        need = self.k - self.above  # the k-th largest key is the need-th largest in [lo, hi)
        at_or_above = counts.flip(0).cumsum(0).flip(0)  # [d]: keys in bins >= d
        digit = int((at_or_above >= need).sum()) - 1
        if need < 1 or digit < 0:
            raise ValueError(f"histogram of {int(counts.sum())} keys cannot hold the {need}-th largest")
        lo, hi = int(edges[digit]), int(edges[digit + 1])
        above = self.above + int(at_or_above[digit]) - int(counts[digit])
        survivors = self.above + int(at_or_above[digit])
        done = survivors - self.k <= self.slack or hi - lo == 1
        return replace(self, lo=lo, hi=hi, above=above, survivors=survivors, level=self.level + 1, done=done)
