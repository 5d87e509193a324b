"""Sparse AllReduce whose per-worker volume does not grow with the number of workers (Ok-Topk style).

Every rank brings a sparse contribution (its selected entries of its compensated gradient) over a
flat space of ``numel`` positions, cut into ``p`` regions (:mod:`.regions`); rank j owns region j.

1. **Reduce-scatter** (:func:`.sparse_reduce_scatter`): each rank sends region j's entries to rank
   j (counts first), and each owner sums what it received in rank order (deterministic).
2. **Agreed threshold** (:mod:`.threshold_search`): each owner counts its reduced magnitudes in a
   histogram of ``W`` bins over their float32 bit patterns (a log2 scale: ``W/256`` bins per octave
   over the whole float32 range, or, given ``threshold_hint``, ``W - 2`` bins over ``[hint/2, 2
   hint)`` and one on either side); one exact SUM AllReduce of the histograms, the first one led by
   a fingerprint of the search's arguments and this rank's status words; every rank picks the same
   bin from the same sums and, while that bin holds more than a small slack of entries beyond ``k``,
   refines inside it with another histogram (typically none more with a good hint, one without).
   The threshold ``t`` is the chosen bin's lower edge: the same bits on every rank. No
   ``torch.topk``: ties at ``t`` all survive.
3. **AllGather** (``all_to_all_single`` with uneven sizes, lengths first): each owner sends the
   entries of its region with ``|sum| >= t`` to everyone. Every rank, the owner included, uses the
   *decoded* bytes, so the result is identical bit for bit on all ranks. The lengths round also
   carries each rank's ``t``, checked like the fingerprint: ranks that disagree all raise.

**Volume per worker**, ``e`` bytes per coded entry, disjoint supports, balanced regions, ``L``
histogram levels of ``W`` counts of ``w`` bytes (``w`` = 2 up to ``numel`` 32767, 4 up to
``2^31 - 1``, else 8)::

    (p-1)/p * k * e  +  8 (p-1)                       reduce-scatter: data, counts
  + 2 (p-1)/p * w * (L W + 16 + 2 ceil(p / (8w - 1)))  histograms, fingerprint, two status bitmaps
  + (p-1) * k/p * e  +  8 (p-1)                       AllGather: data, lengths (and thresholds)

about ``2k(p-1)/p`` entries plus ``2 L W w`` bytes, whatever ``p`` (the histograms' part is flat in
p but for one word per ``8w - 1`` ranks; the counts and lengths, 16 bytes per peer, are the only
terms linear in p). ``W`` is ``k/128..k/64``, at least 64 (:func:`.histogram_bits`), so with ``L = 2``
the histograms add at most 1/4 byte per kept entry for ``k >= 4096``. An imbalanced region costs its owner up to
``(p-1) * k`` in step 3; :func:`.balanced_boundaries` keeps regions even. The exact bytes this rank
handed to the collectives (its own share excluded) are in ``SparseAllreduceResult.sent_by_collective``
(one ``"threshold histogram <l>"`` key per level; :func:`.exact_allreduce_bytes` gives each). Rounds:
``(4 + 2L)(p-1)`` counted as in :mod:`.alphabeta` (each ``all_to_all_single`` ``p - 1``; ``4 + L`` at
p = 2, where a histogram's sum is one exchange).

**How many survive** (``N`` the reduced support): all ``N`` when ``k >= N``, none when ``k = 0``,
else ``k <= survivors <= k + max(max(4, k // 32), T - 1)``, ``T`` the entries tied at the k-th
largest magnitude: the result holds the exact top-k of the sum (density 1.0 equals a dense AllReduce).

**Error feedback** (:meth:`SparseAllreduceResult.residual`): with ``c_r`` rank r's compensated
gradient, ``s_r`` its contribution as the owners decoded it (``contributed``), ``S`` the surviving
positions and ``A`` the applied result: ``residual_r = c_r - s_r|S + carry_r``, where ``carry_r``
(non-zero only for a lossy codec) is what owner r's second encoding changed, ``sum_r s_r|S - A``
on its region. Summed over ranks, ``sum_r residual_r = sum_r c_r - A``: whatever is not applied
this step is in some rank's residual, so EF telescopes exactly (for lossless values ``carry`` is
empty and ``A = sum_r s_r|S``).

**Codecs**: the exchange knows none; a :class:`.RegionCodec` adapter (from the hook) codes each
region payload (:mod:`.region_payload`; raw entries without one).

**Failures**: every collective is waited on and checked (:class:`.CollectiveError` names it); a
payload an owner cannot decode, or a non-finite reduced value, is announced in the status bitmaps
of the first histogram, so every rank raises (:class:`~gradwire.errors.DecodeError`) or returns
``finite=False`` together, after the same rounds. Ranks that passed different ``k``,
``summary_size`` or ``threshold_hint`` see it in the fingerprint and all raise ``ValueError`` there,
before they could run different numbers of levels (the hook passes the previous step's threshold,
identical on every rank by construction).

Blocking, on the caller's thread; every rank must call it in the same order with the same
``numel``, ``k``, ``boundaries``, ``summary_size`` and ``threshold_hint``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .. import kernels
from ..errors import DecodeError
from .checked import allgatherv_tagged, allreduce_sum_exact, exact_allreduce_bytes, group_rank, group_size
from .threshold_search import (FINGERPRINT_WORDS, KEYS, ThresholdSearch, count_dtype, fingerprints_agree,
                               magnitude_keys)
from .region_payload import RegionCodec, decode_region, encode_region, is_wide
from .regions import check_boundaries
from .sparse_reduce_scatter import RegionStatus, read_status_words, sparse_reduce_scatter, status_words

__all__ = ["RegionCodec", "SparseAllreduceResult", "coding_carry", "positions_in", "sparse_allreduce"]

WHAT = "sparse_allreduce"


@dataclass(frozen=True)
class SparseAllreduceResult:
    """The reduced sparse sum (identical on every rank) and this rank's error-feedback terms.

    Attributes:
        indices: (m,) int64 ascending, the surviving positions.
        values: (m,) float32, the sum over ranks there (not divided by p).
        survived: (n,) bool over this rank's input entries: those whose position is in the result.
        contributed: (n,) float32, this rank's input values as the owners decoded them.
        carry_indices: positions of the owner's re-coding error (module docstring; empty for
            lossless values).
        carry_values: float32, that error.
        threshold: the agreed magnitude threshold (NaN when not ``finite``).
        finite: False on every rank when some reduced value was NaN/Inf (the result is then empty).
        sent_by_collective: bytes this rank handed to each collective for its peers.
    """

    indices: torch.Tensor
    values: torch.Tensor
    survived: torch.Tensor
    contributed: torch.Tensor
    carry_indices: torch.Tensor
    carry_values: torch.Tensor
    threshold: float
    finite: bool
    sent_by_collective: dict[str, int] = field(default_factory=dict)

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank sent, all collectives together."""
        return sum(self.sent_by_collective.values())

    def residual(self, compensated: torch.Tensor, *, indices: torch.Tensor) -> torch.Tensor:
        """This rank's new residual: ``compensated`` minus its contribution where it survived, plus the carry.

        Args:
            compensated: this rank's compensated gradient over the flat space (any shape).
            indices: the input indices passed to :func:`sparse_allreduce`.

        Returns:
            Flat, ``compensated``'s dtype and device.
        """
        residual = compensated.reshape(-1).clone()
        kept = self.survived
        residual[indices[kept]] -= self.contributed[kept].to(residual.dtype)
        if self.carry_indices.numel():
            residual[self.carry_indices] += self.carry_values.to(residual.dtype)
        return residual


def sparse_allreduce(*, indices: torch.Tensor, values: torch.Tensor, numel: int, k: int,
                     boundaries: Sequence[int], group: Optional[dist.ProcessGroup] = None,
                     codec: Optional[RegionCodec] = None, summary_size: Optional[int] = None,
                     threshold_hint: Optional[float] = None) -> SparseAllreduceResult:
    """Sum the ranks' sparse contributions and keep about ``k`` entries of the sum (see module doc).

    Args:
        indices: (n,) int64, strictly ascending in ``[0, numel)``.
        values: (n,) float32 (non-finite values make every rank return ``finite=False``).
        numel: positions in the flat space.
        k: entries to keep, >= 0 (the count bound is in the module doc).
        boundaries: ``p + 1`` ints, the same on every rank (:mod:`.regions`).
        group: the process group (None: the default one; none initialized: a world of one).
        codec: codes the region payloads (None: raw 8-byte entries).
        summary_size: histogram bins per level, a power of two in 4..4096 (None: sized by ``k``,
            :func:`.histogram_bits`).
        threshold_hint: where the threshold is likely to be, e.g. the previous step's ``threshold``
            for the same tensors; the first histogram then resolves ``[hint/2, 2 hint)`` finely and
            typically settles it in one level. Any value is safe (a bad one costs one more level;
            non-finite or <= 0: none), but it must be the same on every rank (checked: see Raises).

    Returns:
        :class:`SparseAllreduceResult`, the same ``indices``/``values``/``threshold`` on every rank.

    Raises:
        ValueError: bad arguments (before any collective, alike on ranks that pass the same ones).
        DecodeError: some owner could not decode a payload (on every rank, naming the owners).
        ValueError: the ranks passed different ``k``, ``summary_size`` or ``threshold_hint`` (seen in
            the first histogram round's fingerprint, or as different thresholds in the AllGather's
            lengths round: on every rank, before the data moves).
        CollectiveError: a collective failed (on every surviving rank).
    """
    size, me = group_size(group), group_rank(group)
    bounds = check_boundaries(boundaries, numel, size)
    search = ThresholdSearch.start(k, summary_size, threshold_hint)
    scattered = sparse_reduce_scatter(indices=indices, values=values, numel=numel, boundaries=bounds, group=group,
                                      codec=codec, what=WHAT)
    sent = dict(scattered.sent_by_collective)
    device = values.device
    keys = (magnitude_keys(scattered.values) if scattered.status is RegionStatus.OK
            else torch.empty(0, dtype=torch.int64, device=device))

    # 2. agree on a threshold; the arguments' fingerprint and the status bitmaps ride on level 1
    dtype = count_dtype(numel)
    head = torch.cat([search.fingerprint_words(dtype), status_words(scattered.status, me, size, dtype)]).to(device)
    summed = _allreduce(torch.cat([head, search.local_counts(keys).to(dtype)]), group, 1, sent)
    if not fingerprints_agree(summed[:FINGERPRINT_WORDS], size):
        raise ValueError(f"{WHAT}: the ranks started different threshold searches: every rank must pass the "
                         "same k, summary_size and threshold_hint")
    status = read_status_words(summed[FINGERPRINT_WORDS:head.numel()], size)
    if status.decode_failed:
        error = scattered.error
        raise DecodeError(f"{WHAT}: rank(s) {list(status.decode_failed)} could not decode a region payload"
                          + (f" ({error})" if error else "")) from error
    if status.nonfinite:
        empty = torch.empty(0, dtype=torch.int64, device=device)
        return SparseAllreduceResult(empty, torch.empty(0, device=device), torch.zeros_like(indices, dtype=torch.bool),
                                     scattered.contributed, empty, torch.empty(0, device=device),
                                     float("nan"), False, sent)
    search = search.refine(summed[head.numel():])
    while not search.done:
        search = search.refine(_allreduce(search.local_counts(keys).to(dtype), group, search.level + 1, sent))

    # 3. allgather the surviving entries of every region; everyone uses the decoded bytes
    keep = keys >= search.threshold_key
    kept_indices, kept_sums = scattered.indices[keep], scattered.values[keep]
    wide = is_wide(bounds)
    data, _ = encode_region(codec, kept_indices, kept_sums, scattered.length, wide)
    tag = min(search.threshold_key, KEYS - 1)  # "none" and the NaN patterns alike: nothing finite is kept
    gathered, lengths, tags = allgatherv_tagged(data, tag, group, what=WHAT, collective="allgather all_to_all_single")
    if len(set(tags)) > 1:
        raise ValueError(f"{WHAT}: the ranks agreed on different thresholds (keys {sorted(set(tags))}): "
                         "every rank must pass the same k, summary_size and threshold_hint")
    sent["allgather lengths"] = 8 * (size - 1)
    sent["allgather"] = data.numel() * (size - 1)
    out_indices, out_values = [], []
    for owner, chunk in enumerate(torch.split(gathered, lengths)):  # one payload per owner
        rel, vals = decode_region(codec, chunk, bounds[owner + 1] - bounds[owner], wide,
                                  f"{WHAT}: rank {owner}'s region")
        out_indices.append(rel + bounds[owner])
        out_values.append(vals)
        if owner == me:
            own_applied = vals
    result_indices, result_values = torch.cat(out_indices), torch.cat(out_values)

    carry_indices = torch.empty(0, dtype=torch.int64, device=device)
    carry_values = torch.empty(0, dtype=torch.float32, device=device)
    if codec is not None:
        carry_indices, carry_values = coding_carry(kept_indices, kept_sums, own_applied, scattered.start)
    return SparseAllreduceResult(result_indices, result_values, positions_in(indices, result_indices),
                                 scattered.contributed, carry_indices, carry_values, search.threshold, True, sent)


def coding_carry(kept: torch.Tensor, sums: torch.Tensor, applied: torch.Tensor,
                 start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An owner's re-coding error (the module docstring's ``carry``): where the decoded survivors
    ``applied`` differ from the ``sums`` it coded, those flat positions (``kept`` relative to the
    region's ``start``) and ``sums - applied`` there."""
    changed = applied != sums
    return kept[changed] + start, (sums - applied)[changed]


def _allreduce(words: torch.Tensor, group: Optional[dist.ProcessGroup], level: int,
               sent: dict[str, int]) -> torch.Tensor:
    """One exact SUM of a level's words over the ranks, its bytes booked under the level's name."""
    name = f"threshold histogram {level}"
    sent[name] = exact_allreduce_bytes(words.numel(), words.element_size(), group_rank(group), group_size(group))
    return allreduce_sum_exact(words, group, what=WHAT, collective=f"{name} all_to_all_single")


def positions_in(needles: torch.Tensor, haystack: torch.Tensor) -> torch.Tensor:
    """Bool mask: which of ``needles`` occur in ``haystack`` (both int64 ascending)."""
    if haystack.numel() == 0:
        return torch.zeros_like(needles, dtype=torch.bool)
    if needles.device.type == "cpu" and haystack.device.type == "cpu" and kernels.available():
        # one merge: searchsorted's binary search misses the cache about log2(m) times per needle
        return torch.from_numpy(kernels.sorted_members(needles.contiguous().numpy(), haystack.contiguous().numpy()))
    where = torch.searchsorted(haystack, needles).clamp(max=haystack.numel() - 1)
    return haystack[where] == needles
