"""Sparse AllReduce whose per-worker volume does not grow with the number of workers (Ok-Topk style).

Every rank brings a sparse contribution (its selected entries of its compensated gradient) over a
flat space of ``numel`` positions, cut into ``p`` regions (:mod:`.regions`); rank j owns region j.

1. **Reduce-scatter** (``all_to_all_single``, counts first): each rank sends the entries that fall
   in region j to rank j, indices relative to the region start.
2. **Reduce**: each owner sums what it received, in rank order (deterministic).
3. **Agreed threshold**: each owner summarizes its reduced magnitudes in ``summary_size`` order
   statistics (exact when the region has fewer entries); one AllGather of these fixed-size rows,
   and every rank computes the same threshold ``t`` that leaves about ``k`` entries over all
   regions (:func:`agreed_threshold`). No ``torch.topk``: ties at ``t`` all survive, on every rank.
4. **AllGather** (``all_to_all_single`` with uneven sizes, lengths first): each owner sends the
   entries of its region with ``|sum| >= t`` to everyone. Every rank, the owner included, uses the
   *decoded* bytes, so the result is identical bit for bit on all ranks.

**Volume per worker** (entries of ``e`` bytes; no overlap between ranks' supports, balanced
regions): ``(p-1)/p * k`` in step 1 plus ``(p-1) * k/p`` in step 4, i.e. about ``2k(p-1)/p``
entries, plus ``(p-1) * 4 (summary_size + 2)`` summary bytes and two tiny count rounds. An
imbalanced region costs its owner up to ``(p-1) * k`` in step 4; :func:`.balanced_boundaries` keeps
regions even. The exact bytes this rank handed to the collectives (its own share excluded) are in
``SparseAllreduceResult.bytes_sent``.

**How many survive**: the count is ``k`` up to the summary's resolution. Per region the estimate
of "entries ``>= t``" is exact when the region has at most ``summary_size`` entries and is off by
less than one sample spacing, ``ceil((n_j - 1) / (summary_size - 1))``, otherwise; so the total is
within ``k ± 2 * sum_j spacing_j`` (about ``2 N / summary_size``, ``N`` = the reduced support),
plus entries tied with ``t``. ``k >= N`` keeps everything (density 1.0 equals a dense AllReduce).

**Error feedback** (:meth:`SparseAllreduceResult.residual`): with ``c_r`` rank r's compensated
gradient, ``s_r`` its contribution as the owners decoded it (``contributed``), ``S`` the surviving
positions and ``A`` the applied result: ``residual_r = c_r - s_r|S + carry_r``, where ``carry_r``
(non-zero only for a lossy codec) is what owner r's second encoding changed, ``sum_r s_r|S - A``
on its region. Summed over ranks, ``sum_r residual_r = sum_r c_r - A``: whatever is not applied
this step is in some rank's residual, so EF telescopes exactly (for lossless values ``carry`` is
empty and ``A = sum_r s_r|S``).

**Codecs**: the exchange knows none. A :class:`RegionCodec` adapter (from the hook) codes each
region payload; without one, entries travel raw: int32 index relative to the region start (two
int32 words when a region is 2^31 or more long) and the float32 value's bits, 8 (12) bytes each.

**Failures**: every collective is waited on and checked (:class:`.CollectiveError` names it); a
payload an owner cannot decode, or a non-finite reduced value, is announced in the summary row, so
every rank raises (:class:`~gradwire.errors.DecodeError`) or returns ``finite=False`` together.

Blocking, on the caller's thread; every rank must call it in the same order with the same
``numel``, ``k``, ``boundaries`` and ``summary_size``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence

import torch
import torch.distributed as dist

from ..errors import DecodeError
from .checked import allgather_tensor, allgatherv, alltoallv, group_rank, group_size
from .regions import check_boundaries

WHAT = "sparse_allreduce"
#: Status in a summary row's count field: the owner could not decode a payload / saw NaN or Inf.
_DECODE_FAILED, _NONFINITE = -1.0, -2.0


class RegionCodec(Protocol):
    """Codes one region payload. ``indices`` are int64, ascending, relative to the region start,
    in ``[0, numel)``; ``values`` float32. ``encode`` returns the bytes and the values the receiver
    will decode (same length as ``values``); ``decode`` must return exactly the encoded indices
    (lossless indices; values may be lossy) and raise only ``DecodeError`` on bad bytes."""

    def encode(self, *, indices: torch.Tensor, values: torch.Tensor, numel: int) -> tuple[bytes, torch.Tensor]: ...

    def decode(self, data: bytes, numel: int) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class SparseAllreduceResult:
    """The reduced sparse sum (identical on every rank) and this rank's error-feedback terms.

    ``indices`` (m,) int64 ascending, ``values`` (m,) float32: the sum over ranks of the surviving
    entries (not divided by p). ``survived`` (n,) bool over this rank's input entries: those whose
    position is in the result. ``contributed`` (n,) float32: this rank's input values as the
    owners decoded them. ``carry_indices``/``carry_values``: see the module docstring (empty for
    lossless values). ``finite`` is False on every rank when some reduced value was NaN/Inf (the
    result is then empty). ``bytes_sent``: bytes this rank handed to the collectives for its peers.
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
        return sum(self.sent_by_collective.values())

    def residual(self, compensated: torch.Tensor, *, indices: torch.Tensor) -> torch.Tensor:
        """This rank's new residual (flat, like ``compensated``): ``compensated`` minus its
        contribution where it survived, plus the owner's ``carry``. ``indices``: the input indices."""
        residual = compensated.reshape(-1).clone()
        kept = self.survived
        residual[indices[kept]] -= self.contributed[kept].to(residual.dtype)
        if self.carry_indices.numel():
            residual[self.carry_indices] += self.carry_values.to(residual.dtype)
        return residual


def sparse_allreduce(*, indices: torch.Tensor, values: torch.Tensor, numel: int, k: int,
                     boundaries: Sequence[int], group: Optional[dist.ProcessGroup] = None,
                     codec: Optional[RegionCodec] = None, summary_size: int = 256) -> SparseAllreduceResult:
    """Sum the ranks' sparse contributions and keep about ``k`` entries of the sum (see module doc).

    ``indices`` (n,) int64 strictly ascending in ``[0, numel)``, ``values`` (n,) float32 (finite;
    non-finite values make every rank return ``finite=False``). ``boundaries``: ``p + 1`` ints, the
    same on every rank. ``summary_size`` >= 2: order statistics per region for the threshold.
    """
    size, me = group_size(group), group_rank(group)
    if me < 0:
        raise ValueError(f"{WHAT}: this rank is not a member of the group it was given")
    bounds = check_boundaries(boundaries, numel, size)
    _check_input(indices, values, numel, k, summary_size)
    device = values.device
    starts = torch.tensor(bounds, dtype=torch.int64, device=device)
    region_lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    wide = max(region_lengths, default=0) >= 2**31
    sent: dict[str, int] = {}

    # 1. reduce-scatter: region j's entries (relative indices) to rank j
    cuts = torch.searchsorted(indices, starts).tolist()
    counts = [b - a for a, b in zip(cuts, cuts[1:])]
    relative = indices - torch.repeat_interleave(starts[:-1], torch.tensor(counts, device=device))
    payloads, contributed = [], []
    for j in range(size):
        data, reconstructed = _encode(codec, relative[cuts[j]:cuts[j + 1]], values[cuts[j]:cuts[j + 1]],
                                      region_lengths[j], wide)
        payloads.append(data)
        contributed.append(reconstructed)
    send_counts = [p.numel() for p in payloads]
    received, recv_counts = alltoallv(torch.cat(payloads), send_counts, group, what=WHAT,
                                      collective="reduce-scatter all_to_all_single")
    sent["reduce-scatter counts"] = 8 * (size - 1)
    sent["reduce-scatter"] = sum(send_counts) - send_counts[me]

    # 2. reduce this rank's region, in rank order
    own_length = region_lengths[me]
    status, error = 0.0, None
    try:
        pieces = [_decode(codec, chunk, own_length, wide, f"rank {src}'s contribution")
                  for src, chunk in enumerate(torch.split(received, recv_counts))]
        region_indices, sums = _reduce(pieces)
        if not bool(torch.isfinite(sums).all()):
            status = _NONFINITE
    except DecodeError as caught:
        status, error = _DECODE_FAILED, caught
        region_indices = torch.empty(0, dtype=torch.int64, device=device)
        sums = torch.empty(0, dtype=torch.float32, device=device)

    # 3. agree on a threshold from every region's summary
    summary = _to_wire(region_summary(sums.abs(), summary_size, status=status)).to(device)
    rows = _from_wire(allgather_tensor(summary, group, what=WHAT, collective="summary all_gather").cpu())
    sent["summary"] = (size - 1) * summary.numel() * 4
    statuses = rows[:, 0]
    if bool((statuses == _DECODE_FAILED).any()):
        failed = (statuses == _DECODE_FAILED).nonzero().reshape(-1).tolist()
        raise DecodeError(f"{WHAT}: rank(s) {failed} could not decode a region payload"
                          + (f" ({error})" if error else "")) from error
    if bool((statuses == _NONFINITE).any()):
        empty = torch.empty(0, dtype=torch.int64, device=device)
        return SparseAllreduceResult(empty, torch.empty(0, device=device), torch.zeros_like(indices, dtype=torch.bool),
                                     torch.cat(contributed), empty, torch.empty(0, device=device),
                                     float("nan"), False, sent)
    threshold = agreed_threshold(rows, k)

    # 4. allgather the surviving entries of every region; everyone uses the decoded bytes
    keep = sums.abs().double() >= threshold
    kept_indices, kept_sums = region_indices[keep], sums[keep]
    data, _ = _encode(codec, kept_indices, kept_sums, own_length, wide)
    gathered, lengths = allgatherv(data, group, what=WHAT, collective="allgather all_to_all_single")
    sent["allgather lengths"] = 8 * (size - 1)
    sent["allgather"] = data.numel() * (size - 1)
    out_indices, out_values = [], []
    for owner, chunk in enumerate(torch.split(gathered, lengths)):
        rel, vals = _decode(codec, chunk, region_lengths[owner], wide, f"rank {owner}'s region")
        out_indices.append(rel + bounds[owner])
        out_values.append(vals)
        if owner == me:
            own_applied = vals
    result_indices, result_values = torch.cat(out_indices), torch.cat(out_values)

    carry_indices = torch.empty(0, dtype=torch.int64, device=device)
    carry_values = torch.empty(0, dtype=torch.float32, device=device)
    if codec is not None:
        changed = own_applied != kept_sums
        carry_indices = kept_indices[changed] + bounds[me]
        carry_values = (kept_sums - own_applied)[changed]
    return SparseAllreduceResult(result_indices, result_values, positions_in(indices, result_indices),
                                 torch.cat(contributed), carry_indices, carry_values, threshold, True, sent)


def positions_in(needles: torch.Tensor, haystack: torch.Tensor) -> torch.Tensor:
    """Bool mask: which of ``needles`` occur in ``haystack`` (both int64 ascending)."""
    if haystack.numel() == 0:
        return torch.zeros_like(needles, dtype=torch.bool)
    where = torch.searchsorted(haystack, needles).clamp(max=haystack.numel() - 1)
    return haystack[where] == needles


def region_summary(magnitudes: torch.Tensor, size: int, *, status: float = 0.0) -> torch.Tensor:
    """One summary row (float64, ``size + 1``): ``[n, q_0 >= q_1 >= ... ]`` where ``q_i`` is the
    magnitude at descending rank ``i * (n-1) // (size-1)`` (all magnitudes when ``n <= size``),
    padded with -1. A negative ``status`` replaces ``n`` to flag a failed region."""
    row = torch.full((size + 1,), -1.0, dtype=torch.float64)
    n = magnitudes.numel()
    row[0] = status if status else float(n)
    if n and not status:
        ordered = torch.sort(magnitudes.float(), descending=True).values.cpu().double()
        row[1:1 + min(n, size)] = ordered if n <= size else ordered[_sample_ranks(n, size)]
    return row


def _to_wire(row: torch.Tensor) -> torch.Tensor:
    """A summary row as int32 words: the count (int64, 2 words), then the float32 magnitudes' bits
    (the magnitudes are float32 sums, so nothing is lost; half the bytes of float64)."""
    count = torch.tensor([int(row[0])], dtype=torch.int64).view(torch.int32)
    return torch.cat([count, row[1:].float().view(torch.int32)])


def _from_wire(words: torch.Tensor) -> torch.Tensor:
    """Gathered wire rows ``(p, size + 2)`` int32 back to float64 summary rows ``(p, size + 1)``."""
    counts = words[:, :2].reshape(-1).view(torch.int64).double()
    return torch.cat([counts[:, None], words[:, 2:].contiguous().view(torch.float32).double()], dim=1)


def _sample_ranks(n: int, size: int) -> torch.Tensor:
    return torch.arange(size, dtype=torch.int64) * (n - 1) // (size - 1)


def agreed_threshold(rows: torch.Tensor, k: int) -> float:
    """The magnitude threshold leaving about ``k`` entries, from the gathered summary rows
    (``(p, size + 1)`` float64, see :func:`region_summary`). A pure function of ``rows`` and ``k``:
    every rank computes the same value. ``-inf`` keeps everything (``k >= N``), ``inf`` nothing.

    Per region, "entries ``>= t``" is read off the order statistics, interpolated linearly in
    magnitude between samples; the threshold is then interpolated between the two adjacent sample
    values whose estimated totals bracket ``k``.
    """
    counts = rows[:, 0].to(torch.int64)
    total = int(counts.sum())
    if k >= total:
        return float("-inf")
    if k <= 0:
        return float("inf")
    size = rows.shape[1] - 1
    kept = counts.clamp(max=size)
    valid = torch.arange(size)[None, :] < kept[:, None]
    samples = torch.where(valid, rows[:, 1:], torch.tensor(float("-inf"), dtype=torch.float64))
    big = counts > size
    ranks = torch.where(big[:, None], torch.arange(size)[None, :] * (counts[:, None] - 1).clamp(min=0) // max(size - 1, 1),
                        torch.arange(size)[None, :]).double()
    last = (kept - 1).clamp(min=0)

    def estimate(t: float) -> float:
        above = (samples >= t).sum(dim=1)  # samples are descending: the first `above` are >= t
        lo = (above - 1).clamp(min=0).minimum(last)[:, None]
        hi = above.minimum(last)[:, None]
        m_lo, m_hi = samples.gather(1, lo)[:, 0], samples.gather(1, hi)[:, 0]
        r_lo, r_hi = ranks.gather(1, lo)[:, 0], ranks.gather(1, hi)[:, 0]
        gap = m_lo - m_hi
        fraction = torch.where(gap > 0, (m_lo - t) / torch.where(gap > 0, gap, 1.0), torch.zeros_like(gap))
        inside = r_lo + 1 + fraction * (r_hi - r_lo - 1)
        per_region = torch.where(above == 0, torch.zeros_like(inside),
                                 torch.where(above >= kept, counts.double(), inside))
        return float(per_region.sum())

    candidates = torch.unique(samples[valid]).flip(0).tolist()  # descending
    low, high = 0, len(candidates) - 1  # estimate(candidates[-1]) == total > k
    while low < high:  # first candidate whose estimate reaches k
        middle = (low + high) // 2
        if estimate(candidates[middle]) >= k:
            high = middle
        else:
            low = middle + 1
    t = candidates[low]
    if low == 0:
        return t
    above, below = estimate(t), estimate(candidates[low - 1])
    return t + (candidates[low - 1] - t) * (above - k) / (above - below) if above > below else t


def _check_input(indices: torch.Tensor, values: torch.Tensor, numel: int, k: int, summary_size: int) -> None:
    if indices.dtype != torch.int64 or indices.dim() != 1:
        raise ValueError(f"indices must be a 1-D int64 tensor, got {indices.dtype} of shape {tuple(indices.shape)}")
    if values.dtype != torch.float32 or values.shape != indices.shape:
        raise ValueError(f"values must be float32 with the shape of indices, got {values.dtype} {tuple(values.shape)}")
    if k < 0 or summary_size < 2:
        raise ValueError(f"k={k} must be >= 0 and summary_size={summary_size} >= 2")
    if indices.numel() and (int(indices[0]) < 0 or int(indices[-1]) >= numel
                            or not bool((indices[1:] > indices[:-1]).all())):
        raise ValueError(f"indices must be strictly ascending in [0, numel={numel})")


def _encode(codec: Optional[RegionCodec], relative: torch.Tensor, values: torch.Tensor, length: int,
            wide: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One region payload as a uint8 tensor (on ``values``' device) and the values it decodes to.
    Nothing to send is zero bytes, whatever the codec."""
    if relative.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=values.device), values
    if codec is None:
        words = relative.view(torch.int32).reshape(-1, 2) if wide else relative.to(torch.int32)[:, None]
        packed = torch.cat([words, values.contiguous().view(torch.int32)[:, None]], dim=1)
        return packed.reshape(-1).view(torch.uint8), values
    data, reconstructed = codec.encode(indices=relative, values=values, numel=length)
    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(values.device)
    return payload, reconstructed.to(device=values.device, dtype=torch.float32)


def _decode(codec: Optional[RegionCodec], chunk: torch.Tensor, length: int, wide: bool,
            what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Relative indices and values of one payload, checked: ascending, inside the region."""
    if chunk.numel() == 0:
        return (torch.empty(0, dtype=torch.int64, device=chunk.device),
                torch.empty(0, dtype=torch.float32, device=chunk.device))
    if codec is None:
        entry = 12 if wide else 8
        if chunk.numel() % entry:
            raise DecodeError(f"{WHAT}: {what} has {chunk.numel()} bytes, not a multiple of {entry}")
        words = chunk.clone().view(torch.int32).reshape(-1, entry // 4)
        relative = words[:, :2].reshape(-1).view(torch.int64) if wide else words[:, 0].to(torch.int64)
        values = words[:, -1].contiguous().view(torch.float32)
    else:
        relative, values = codec.decode(chunk.cpu().numpy().tobytes(), length)
        relative = relative.to(device=chunk.device, dtype=torch.int64).reshape(-1)
        values = values.to(device=chunk.device, dtype=torch.float32).reshape(-1)
    if relative.numel() != values.numel() or (relative.numel() and (
            int(relative[0]) < 0 or int(relative[-1]) >= length or not bool((relative[1:] > relative[:-1]).all()))):
        raise DecodeError(f"{WHAT}: {what} has indices outside [0, {length}) or not strictly ascending")
    return relative, values


def _reduce(pieces: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Union of the pieces' positions (ascending) and the sums of their values, added in the
    pieces' order (each piece's positions are distinct, so every addition is a plain, ordered
    read-add-write: the same bits on any device, run after run)."""
    everything = torch.cat([rel for rel, _ in pieces])
    positions, inverse = torch.unique(everything, sorted=True, return_inverse=True)
    sums = torch.zeros(positions.numel(), dtype=torch.float32, device=everything.device)
    offset = 0
    for rel, vals in pieces:
        slots = inverse[offset: offset + rel.numel()]
        sums[slots] = sums[slots] + vals
        offset += rel.numel()
    return positions, sums
