"""One magnitude threshold, the same bits on every rank, from summed histograms: a radix select.

The owners of a sparse AllReduce hold disjoint sets of reduced values; the threshold must keep
about ``k`` of them in all. A non-negative float32's bit pattern read as an integer (31 bits: the
sign is 0) orders exactly like the float, zeros and denormals included, so the k-th largest
magnitude can be found digit by digit on these **keys**, ``b`` bits at a time:

* level 1: every owner counts its keys by their top ``b`` bits (``2^b`` bins: ``2^b / 256`` bins per
  octave of float32's exponent range, or ``256 / 2^b`` octaves per bin);
* a SUM over the ranks (integers: exact, so every rank holds the same counts) and every rank picks,
  from the same counts, the bin holding the k-th largest key: a **prefix** of the key;
* level 2 counts, among the keys with that prefix, the next ``b`` bits; and so on.

It stops as soon as the lower edge of the chosen bin keeps at most ``slack`` entries beyond ``k``
(:func:`count_slack`), or at full resolution (31 bits: one float value per bin). The threshold is
that lower edge: a pure function of the summed counts, so bit-identical on every rank.

**Count bound** (``0 < k < N``, ``N`` the reduced support): ``k <= survivors <= k + max(slack, T - 1)``
with ``T`` the number of entries whose magnitude equals the k-th largest exactly; ties are never
split. The result holds the exact top-k of the magnitudes. ``k >= N`` keeps all ``N`` (threshold
``-inf``), ``k = 0`` none (``+inf``). :attr:`RadixSearch.survivors` is the exact count.

**Size**: ``2^b`` counts per level, ``b`` from ``k`` (:func:`histogram_bits`: ``k/128`` to ``k/64`` bins,
128 to 2048), each of the smallest integer type that holds ``numel`` (:func:`count_dtype`). Typical
gradients stop after two levels (the second resolves ``2^(2b-8)`` bins per octave); ties or
adversarial magnitudes take at most ``ceil(31 / b)`` levels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

#: bits of a key: a non-negative float32's pattern without its (zero) sign bit
KEY_BITS = 31
MIN_BITS, MAX_BITS = 7, 11


def histogram_bits(k: int) -> int:
    """``b``, the bits resolved per level: ``2^b`` bins, ``k/128 < 2^b <= k/64``, clamped to 128..2048.

    Two levels of 4-byte counts, each sent about twice (reduce-scatter, AllGather), then cost at most
    ``2 * 2 * 4 / 64 = 1/4`` byte per kept entry, against ``2 e`` for the entries themselves (``e``
    bytes each): 2-4% at ``e = 3.4``. At least 128 bins keep small ``k`` to two levels (14 bits)."""
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


def magnitude_keys(values: torch.Tensor) -> torch.Tensor:
    """(n,) int64 keys of finite float32 ``values``: ``|v|``'s bit pattern, ordered like ``|v|``."""
    return values.abs().contiguous().view(torch.int32).to(torch.int64)


def key_to_float(key: int) -> float:
    """The float32 value whose pattern is ``key`` (``0 <= key < 2^31``), as a Python float (exact)."""
    return float(torch.tensor([key], dtype=torch.int32).view(torch.float32)[0])


@dataclass(frozen=True)
class RadixSearch:
    """The state every rank holds alike between levels.

    ``prefix``/``prefix_bits``: the agreed top bits of the k-th largest key; ``above``: entries whose
    key is above the chosen bin; ``survivors``: how many the current threshold keeps (None before
    level 1); ``threshold_key``: keep the keys ``>=`` it (valid once ``done``).
    """

    k: int
    bits: int
    slack: int
    prefix: int = 0
    prefix_bits: int = 0
    above: int = 0
    survivors: int | None = None
    done: bool = False
    threshold_key: int = 0

    @classmethod
    def start(cls, k: int, bins: int | None = None) -> "RadixSearch":
        """A search for ``k`` survivors with ``bins`` (a power of two, 2..4096; default sized by ``k``)."""
        if k < 0:
            raise ValueError(f"k={k} must be >= 0")
        if bins is None:
            bits = histogram_bits(k)
        elif bins < 2 or bins > 4096 or bins & (bins - 1):
            raise ValueError(f"bins={bins} must be a power of two in 2..4096")
        else:
            bits = bins.bit_length() - 1
        return cls(k, bits, count_slack(k))

    @property
    def width(self) -> int:
        """Bits the next level resolves (its histogram has ``2^width`` bins)."""
        return min(self.bits, KEY_BITS - self.prefix_bits)

    @property
    def threshold(self) -> float:
        """The agreed magnitude threshold: keep ``|v| >= threshold`` (``-inf``: all, ``inf``: none)."""
        if not self.done:
            raise ValueError("the search is not done")
        if self.threshold_key <= 0 and self.prefix_bits == 0:
            return -math.inf
        if self.threshold_key >= 1 << KEY_BITS:
            return math.inf
        return key_to_float(self.threshold_key)

    def local_counts(self, keys: torch.Tensor) -> torch.Tensor:
        """This owner's next-level histogram: (2^width,) int64 counts of its ``keys`` (int64) that
        carry the agreed prefix, by their next ``width`` bits."""
        inside = keys[(keys >> (KEY_BITS - self.prefix_bits)) == self.prefix]
        digits = (inside >> (KEY_BITS - self.prefix_bits - self.width)) & ((1 << self.width) - 1)
        return torch.bincount(digits, minlength=1 << self.width)

    def refine(self, counts: torch.Tensor) -> "RadixSearch":
        """The next state from the summed histogram of this level (every rank's ``local_counts``
        summed): a pure function of ``counts``, so the same on every rank.

        Raises:
            ValueError: ``counts`` has the wrong size, or cannot hold the k-th largest key (the ranks
                ran different searches).
        """
        counts = counts.to(device="cpu", dtype=torch.int64).reshape(-1)
        if counts.numel() != 1 << self.width or self.done:
            raise ValueError(f"expected {1 << self.width} counts of a search not done, got {counts.numel()}")
        if self.prefix_bits == 0:
            total = int(counts.sum())
            if self.k >= total:
                return replace(self, survivors=total, done=True, threshold_key=0)
            if self.k == 0:
                return replace(self, survivors=0, done=True, threshold_key=1 << KEY_BITS)
        need = self.k - self.above  # the k-th largest key is the need-th largest with this prefix
        at_or_above = counts.flip(0).cumsum(0).flip(0)  # [d]: keys whose digit is >= d
        digit = int((at_or_above >= need).sum()) - 1
        if need < 1 or digit < 0:
            raise ValueError(f"histogram of {int(counts.sum())} keys cannot hold the {need}-th largest")
        in_bin = int(counts[digit])
        above = self.above + int(at_or_above[digit]) - in_bin
        prefix_bits = self.prefix_bits + self.width
        prefix = (self.prefix << self.width) | digit
        survivors = above + in_bin
        done = survivors - self.k <= self.slack or prefix_bits == KEY_BITS
        return replace(self, prefix=prefix, prefix_bits=prefix_bits, above=above, survivors=survivors, done=done,
                       threshold_key=prefix << (KEY_BITS - prefix_bits))
