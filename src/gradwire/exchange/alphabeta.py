"""α–β–γ time model of every exchange strategy, and the choice of the cheapest.

A strategy is predicted to take, per step and per bucket,

    time = α · rounds  +  β · bytes  +  γ · decoded_entries  +  cpu

* ``cpu``: seconds of work before anything travels (compensation, selection, encoding), which the
  caller measures for its sparsifier and codecs (:mod:`gradwire.core.costs`); zero for dense;

* ``rounds``: message steps one after another on the critical path (a ring AllReduce over p ranks
  takes ``2(p-1)``, a ring AllGather ``p-1``, a pairwise ``all_to_all`` ``p-1``);
* ``bytes``: what one worker sends (the busiest worker, where the strategy is uneven);
* ``decoded_entries``: sparse entries this worker decodes and adds (its CPU work after the wire);
* α (seconds per round), β (seconds per byte of one worker's link), γ (seconds per decoded entry),
  configured or measured at start-up. Hierarchical exchange has a second link, ``intra`` (in-node
  α, β), for its in-node traffic; the others run entirely on the (slow) ``link``.

Per worker, for a flat gradient of ``n`` float32 elements, ``k`` entries kept, ``e`` bytes per
coded entry, ``p`` workers (``L`` per node, ``N = p/L`` nodes; for the sparse AllReduce ``H``
histogram levels of ``W`` counts of ``w`` bytes, ``s = 16 + 2 ceil(p / (8w-1))`` fingerprint and
status words):

=========================  ==============  ===============================================  ============
strategy                   rounds          bytes                                            decoded
=========================  ==============  ===============================================  ============
dense ring AllReduce       2(p-1)          2(p-1)/p · 4n                                    0
quantized AllReduce        2(p-1)          2(p-1) · Q(ceil(n/p))  (b bits, blocks of B)     0
                                           ≈ 2(p-1)/p · n (b/8 + 4/B)
shared-support AllReduce   2(p-1)          2(p-1)/p · v(k+1)   (v: bytes per value)         0
payload AllGather          (p-1)·r         (p-1) · (k e + h)   (r: 2 with a length round)   (p-1) k
sparse AllReduce           (4+2H)(p-1)     (p-1)/p · k e + (p-1) · ι k/p · e + 16(p-1)      2k
                           (4+H at p=2)    + 2(p-1)/p · w (H W + s)   (ι: busiest / mean)
hierarchical (intra)       4(L-1)          (L-1)/L · 4n + (L-1) · (12 k/L + 20)             (L-1) k/L
hierarchical (cross)       sparse AllReduce of the shard: k/L entries over N nodes
=========================  ==============  ===============================================  ============

``Q(s) = 4 ceil(s/B) + ceil(s b/8)`` is one quantized chunk (:func:`.blockquant.quantized_bytes`);
the quantized AllReduce's rounds are its reduce-scatter and AllGather ``all_to_all_single``s
(:mod:`.quantized`), and its (de)quantization is elementwise work like dense's additions, not
decoded entries. It is lossy (the caller's error feedback keeps what it drops): offer it to
:func:`choose` only where that is acceptable.
The sparse AllReduce's rounds are the counts and data of its reduce-scatter, a reduce-scatter and
an AllGather (``all_to_all_single``) per histogram level (one exchange at p = 2, the same bytes:
:func:`.allreduce_sum_exact`), and the lengths and data of its
AllGather (:mod:`.sparse_allreduce`); its bytes are those its code hands to the collectives
(contributions assumed disjoint: the worst case for the reduce-scatter). The model takes ``H = 1``
level by default, the steady state of the hook, which passes each layout's previous threshold as
the hint (``H = 2`` is what a first step, without a hint, typically needs: :mod:`.threshold_search`),
and ``W`` sized by ``k`` as the code sizes it: the histograms cost at most ``8 H W/k <= H/8`` byte
per kept entry, whatever ``p``.
:func:`choose` is a pure function of its arguments: ranks that pass the same numbers choose the
same strategy; it never returns a strategy predicted slower than dense.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from .blockquant import quantized_bytes
from .threshold_search import histogram_bits

#: Strategies in the order ties are broken (dense first: never trade it for an equal prediction).
STRATEGIES = ("dense", "quantized-allreduce", "shared-support", "allgather", "sparse-allreduce", "hierarchical")


@dataclass(frozen=True)
class Link:
    """One link's cost constants.

    Attributes:
        alpha: seconds per round (latency), >= 0.
        beta: seconds per byte one worker sends (inverse bandwidth), >= 0.

    Raises:
        ValueError: a negative constant.
    """

    alpha: float
    beta: float

    def __post_init__(self) -> None:
        if self.alpha < 0 or self.beta < 0:
            raise ValueError(f"alpha={self.alpha} and beta={self.beta} must be >= 0")

    @classmethod
    def from_rate(cls, gbit_per_s: float, alpha: float = 20e-6) -> "Link":
        """A link of ``gbit_per_s`` line rate (β = 8 / rate) and ``alpha`` seconds per round."""
        if gbit_per_s <= 0:
            raise ValueError(f"gbit_per_s={gbit_per_s} must be > 0")
        return cls(alpha, 8.0 / (gbit_per_s * 1e9))


@dataclass(frozen=True)
class Cost:
    """One strategy's prediction: rounds/bytes on the main link, on the in-node link, decode work.

    Attributes:
        strategy: its name, one of :data:`STRATEGIES`.
        rounds: rounds on the critical path over the main link.
        bytes_sent: bytes the busiest worker sends over the main link.
        decoded_entries: sparse entries one worker decodes and adds.
        intra_rounds: rounds over the in-node link (hierarchical only).
        intra_bytes: bytes over the in-node link (hierarchical only).
        cpu_seconds: seconds of CPU work the strategy needs before anything travels (selection,
            encoding), as the caller measured them; dense needs none.
    """

    strategy: str
    rounds: float
    bytes_sent: float
    decoded_entries: float
    intra_rounds: float = 0.0
    intra_bytes: float = 0.0
    cpu_seconds: float = 0.0

    def seconds(self, link: Link, *, decode_per_entry: float = 0.0, intra: Optional[Link] = None) -> float:
        """The predicted time, ``α·rounds + β·bytes + γ·decoded + cpu`` (module docstring).

        Args:
            link: the main link.
            decode_per_entry: γ, seconds per decoded entry.
            intra: the in-node link (None: the main one).

        Returns:
            Seconds per step and bucket.
        """
        inner = intra or link
        return (link.alpha * self.rounds + link.beta * self.bytes_sent + decode_per_entry * self.decoded_entries
                + inner.alpha * self.intra_rounds + inner.beta * self.intra_bytes + self.cpu_seconds)


def dense_allreduce(numel: int, world_size: int, element_bytes: int = 4) -> Cost:
    """A ring AllReduce of ``numel`` elements of ``element_bytes`` bytes: ``2(p-1)`` rounds."""
    p = world_size
    return Cost("dense", 2 * (p - 1), 2 * (p - 1) / p * numel * element_bytes if p > 1 else 0.0, 0.0)


def quantized_allreduce_cost(numel: int, world_size: int, *, bits: int, block_size: int) -> Cost:
    """:func:`.quantized_allreduce` of ``numel`` float32 values.

    A quantized reduce-scatter and an AllGather of the re-quantized shards, each ``(p-1)`` chunks
    of ``quantized_bytes(ceil(numel/p))``; for two ranks one swap of ``quantized_bytes(numel)``;
    ``bits`` (8 or 4) and ``block_size`` as the exchange takes them.
    """
    p = world_size
    if p == 1:
        return Cost("quantized-allreduce", 0, 0.0, 0.0)
    if p == 2:
        return Cost("quantized-allreduce", 1, float(quantized_bytes(numel, bits, block_size)), 0.0)
    chunk = quantized_bytes(math.ceil(numel / p), bits, block_size)
    return Cost("quantized-allreduce", 2 * (p - 1), 2.0 * (p - 1) * chunk, 0.0)


def shared_support_allreduce(k: int, world_size: int, value_bytes: int = 4) -> Cost:
    """AllReduce of the ``k`` values at positions all ranks chose alike, plus one NaN-flag element."""
    cost = dense_allreduce(k + 1, world_size, value_bytes)
    return Cost("shared-support", cost.rounds, cost.bytes_sent, 0.0)


def allgather_payloads(k: int, world_size: int, entry_bytes: float, *, header_bytes: int = 64,
                       length_round: bool = True) -> Cost:
    """Ring AllGather of every rank's payload of ``k`` entries; every rank decodes the ``p-1`` others.

    Args:
        k: entries per payload.
        world_size: ranks, ``p``.
        entry_bytes: bytes per coded entry.
        header_bytes: bytes of a payload beyond its entries.
        length_round: a blocking AllGather of lengths first (first sight of a layout).
    """
    p = world_size
    rounds = (p - 1) * (2 if length_round else 1)
    sent = (p - 1) * (k * entry_bytes + header_bytes + (8 if length_round else 0))
    return Cost("allgather", rounds, sent, (p - 1) * k)


def sparse_allreduce_cost(k: int, world_size: int, entry_bytes: float = 8.0, *, summary_size: Optional[int] = None,
                          imbalance: float = 1.0, levels: int = 1, count_bytes: int = 4) -> Cost:
    """:func:`.sparse_allreduce` with ``k`` entries contributed per rank and ``k`` kept overall.

    Args:
        k: entries per rank and kept overall.
        world_size: ranks, ``p``.
        entry_bytes: bytes per coded entry (8: raw int32 index and float32 value).
        summary_size: histogram bins per level (None: sized by ``k``, as the code does).
        imbalance: the busiest region's kept entries over the mean (1.0 when balanced, up to p).
        levels: histogram levels (1: with a good hint; 2: typical without).
        count_bytes: bytes per count (2 for tensors of at most 32767 elements).

    Returns:
        The prediction (the module docstring's row).
    """
    p = world_size
    if p == 1:
        return Cost("sparse-allreduce", 0, 0.0, 0.0)
    bins = summary_size if summary_size is not None else 1 << histogram_bits(k)
    status_words = 16 + 2 * math.ceil(p / (8 * count_bytes - 1))  # fingerprint, two bitmaps of ranks
    reduce_scatter = (p - 1) / p * k * entry_bytes + 8 * (p - 1)
    histograms = 2 * (p - 1) / p * count_bytes * (levels * bins + status_words)
    allgather = (p - 1) * min(imbalance, p) * k / p * entry_bytes + 8 * (p - 1)
    level_rounds = 1 if p == 2 else 2  # allreduce_sum_exact: one exchange for two ranks
    return Cost("sparse-allreduce", (4 + level_rounds * levels) * (p - 1), reduce_scatter + histograms + allgather,
                2.0 * k)


def hierarchical_cost(numel: int, k: int, nodes: int, local_size: int, entry_bytes: float = 8.0, *,
                      summary_size: Optional[int] = None, imbalance: float = 1.0) -> Cost:
    """:func:`.hierarchical_sparse_allreduce` of ``numel`` elements keeping ``k``.

    An in-node dense reduce-scatter, the sparse AllReduce of one shard (``k / local_size`` entries)
    across ``nodes`` (:func:`sparse_allreduce_cost`, with ``entry_bytes``, ``summary_size`` and
    ``imbalance``), and an in-node AllGather of the shards' results (12 bytes per entry + a
    4-byte flag, after a lengths round), booked on the in-node link.
    """
    local = local_size
    cross = sparse_allreduce_cost(k // local, nodes, entry_bytes, summary_size=summary_size, imbalance=imbalance)
    intra_rounds = 4 * (local - 1)  # reduce-scatter counts + data, allgather lengths + data
    intra_bytes = ((local - 1) / local * 4 * numel + 8 * (local - 1)
                   + (local - 1) * (12 * k / local + 4 + 8)) if local > 1 else 0.0
    return Cost("hierarchical", cross.rounds, cross.bytes_sent, cross.decoded_entries + (local - 1) * k / local,
                intra_rounds, intra_bytes)


def choose(costs: list[Cost], link: Link, *, decode_per_entry: float = 0.0, intra: Optional[Link] = None) -> str:
    """The strategy predicted fastest, a pure function of its arguments (ranks agree).

    Args:
        costs: the candidates; must include ``dense``.
        link: the main link.
        decode_per_entry: γ, seconds per decoded entry.
        intra: the in-node link (None: the main one).

    Returns:
        The winner's name: a strategy wins only if it is predicted strictly faster than dense;
        ties go to the earlier name in :data:`STRATEGIES`.

    Raises:
        ValueError: no ``dense`` among ``costs``.
    """
    times = {c.strategy: c.seconds(link, decode_per_entry=decode_per_entry, intra=intra) for c in costs}
    if "dense" not in times:
        raise ValueError("choose() needs the dense AllReduce's cost among the candidates")
    order = {name: i for i, name in enumerate(STRATEGIES)}
    best = min(times, key=lambda name: (times[name], order.get(name, len(order))))
    return best if times[best] < times["dense"] else "dense"
