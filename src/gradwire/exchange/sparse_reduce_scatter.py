"""Sparse reduce-scatter by index region: each owner gets the rank-order sum of its region.

Every rank brings a sparse contribution over a flat space of ``numel`` positions, cut by the
caller's ``boundaries`` (``p + 1`` ints, :mod:`.regions`) into ``p`` regions; rank j owns region j
(for the sparse AllReduce, balanced regions; for a sharded front-end, its shards).

1. **Scatter** (``all_to_all_single``): each rank sends the entries that fall in region j to
   rank j, coded by the optional :class:`~.region_payload.RegionCodec` (raw entries without
   one), indices relative to the region start. Counts first, unless the caller says how many
   entries any rank may send into each region (``most``) and the codec bounds such payloads:
   then in fixed frames (:mod:`.region_payload`), one round.
2. **Reduce**: each owner decodes what it received and sums it in rank order: the same bits on
   any device, run after run, whatever the arrival order.

**Bytes** this rank sends (``sent_by_collective``): ``8 (p-1)`` for the counts, then its coded
entries outside its own region, about ``(p-1)/p * n`` entries for ``n`` spread evenly; with
frames, the frames' capacities for its peers (no counts).

**Failures and the verdict.** A collective that fails raises :class:`.CollectiveError` on every
survivor (:mod:`.checked`). A payload this owner cannot decode, or a non-finite sum, does *not*
raise: it comes back as the :class:`RegionStatus` of this rank alone, after every collective of
the call has completed, so no peer is left waiting. Peers may hold other statuses; before acting
on one, the ranks must agree: :func:`agree_status` runs one small exact AllReduce of
:func:`status_words` (two bitmaps of ranks), and a caller that runs a SUM AllReduce of integers
anyway can append the same words to it, as :func:`.sparse_allreduce` does to its first histogram.

Blocking, on the caller's thread (:func:`start_sparse_reduce_scatter` returns the reduce-scatter in flight
and finishes it on the caller's thread when asked); every rank must call it in the same order with the same
``numel`` and ``boundaries``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from .. import kernels
from ..errors import DecodeError
from ..finite import all_finite
from ..sparse import is_support
from .checked import (allreduce_sum_exact, exchange_counts, group_rank, group_size, result_checked,
                      start_alltoall_sized)
from .inflight import Launched
from .region_payload import RegionCodec, decode_region, encode_region, frame_capacity, from_frame, is_wide, to_frame
from .regions import check_boundaries

WHAT = "sparse_reduce_scatter"


class RegionStatus(enum.Enum):
    """What one owner found in its region."""

    OK = "ok"
    DECODE_FAILED = "decode failed"  #: some peer's payload did not decode (the sums are empty)
    NONFINITE = "non-finite"  #: some sum is NaN or Inf


@dataclass(frozen=True)
class SparseReduceScatterResult:
    """This rank's region, reduced, and what it contributed.

    Attributes:
        indices: (m,) int64, strictly ascending, **relative to** ``start`` (add ``start`` for
            positions in the flat space).
        values: (m,) float32, the rank-order sums (NaN/Inf possible when ``status`` is NONFINITE;
            empty when DECODE_FAILED).
        start: this rank's region is ``[start, start + length)``.
        length: its length.
        contributed: (n,) float32, this rank's input values as their owners decode them (the
            input itself for raw entries; for error feedback).
        status: this rank's verdict alone (see the module docstring: agree before acting).
        error: the DecodeError behind DECODE_FAILED.
        sent_by_collective: bytes this rank handed to each collective for its peers.
        received: per source rank, the (relative indices, values) this owner decoded from it (empty
            when DECODE_FAILED); with ``contributed`` what a caller can check the transfer by (a digest).
    """

    indices: torch.Tensor
    values: torch.Tensor
    start: int
    length: int
    contributed: torch.Tensor
    status: RegionStatus
    error: Optional[DecodeError] = None
    sent_by_collective: dict[str, int] = field(default_factory=dict)
    received: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank sent, all collectives together."""
        return sum(self.sent_by_collective.values())


def sparse_reduce_scatter(*, indices: torch.Tensor, values: torch.Tensor, numel: int, boundaries: Sequence[int],
                          group: Optional[dist.ProcessGroup] = None, codec: Optional[RegionCodec] = None,
                          what: str = WHAT, most: Optional[Sequence[int]] = None) -> SparseReduceScatterResult:
    """Send each region's entries to its owner; return this rank's region summed in rank order.

    Args:
        indices: (n,) int64, strictly ascending in ``[0, numel)``.
        values: (n,) float32 (non-finite values give status NONFINITE, not an exception).
        numel: positions in the flat space.
        boundaries: ``p + 1`` ints, ``0 = b[0] <= ... <= b[p] = numel``, the same on every rank.
        group: the process group (None: the default one; no group initialized: a world of one).
        codec: codes the region payloads (None: raw entries).
        what: names the caller in error messages.
        most: ``p`` ints, the same on every rank: the most entries any rank sends into each
            region (fixed frames where the codec can bound them); None: counts first.

    Returns:
        :class:`SparseReduceScatterResult`.

    Raises:
        ValueError: bad arguments (this rank only: every rank passing the same ``numel`` and
            ``boundaries`` fails alike, before any collective).
        CollectiveError: a collective failed (on every surviving rank).
    """
    return result_checked(start_sparse_reduce_scatter(indices=indices, values=values, numel=numel,
                                                      boundaries=boundaries, group=group, codec=codec, what=what,
                                                      most=most), what)


def start_sparse_reduce_scatter(*, indices: torch.Tensor, values: torch.Tensor, numel: int,
                                boundaries: Sequence[int], group: Optional[dist.ProcessGroup] = None,
                                codec: Optional[RegionCodec] = None, what: str = WHAT,
                                most: Optional[Sequence[int]] = None) -> Launched[SparseReduceScatterResult]:
    """:func:`sparse_reduce_scatter` up to its payloads' start (encoding, the counts round when there
    is one); the decoding and the owner's sum when the caller asks for the result, on its thread.

    A caller with other work (FSDP2's backward of the next module) lets the payloads travel
    meanwhile. ``indices`` and ``values`` are not read after this returns.

    Args:
        as :func:`sparse_reduce_scatter`.

    Returns:
        A :class:`~.inflight.Launched` whose ``result(timeout)`` is the :class:`SparseReduceScatterResult`.

    Raises:
        ValueError: bad arguments, before any collective.
        CollectiveError: the counts round failed, or the payloads' collective could not start. A
            failure on the wire of the payloads is raised by ``result`` (a ``RuntimeError`` naming it).
    """
    size, me = group_size(group), group_rank(group)
    if me < 0:
        raise ValueError(f"{what}: this rank is not a member of the group it was given")
    bounds = check_boundaries(boundaries, numel, size)
    check_contribution(indices, values, numel)
    device = values.device
    starts = torch.tensor(bounds, dtype=torch.int64, device=device)
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    wide = is_wide(bounds)

    cuts = torch.searchsorted(indices, starts).tolist()
    counts = [b - a for a, b in zip(cuts, cuts[1:])]
    relative = indices - torch.repeat_interleave(starts[:-1], torch.tensor(counts, device=device))
    payloads, contributed = [], []
    for j in range(size):  # one payload per owner; the entries inside are handled as tensors
        data, decoded = encode_region(codec, relative[cuts[j]:cuts[j + 1]], values[cuts[j]:cuts[j + 1]],
                                      lengths[j], wide)
        payloads.append(data)
        contributed.append(decoded)
    capacities = _capacities(codec, most, lengths, wide, what)
    if capacities is None:
        collective = "reduce-scatter all_to_all_single"
        send_counts = [p.numel() for p in payloads]
        recv_counts = (exchange_counts(send_counts, group, device=device, what=what, collective=collective)
                       if size > 1 else send_counts)
        received, work = start_alltoall_sized(torch.cat(payloads), send_counts, recv_counts, group, what=what,
                                              collective=collective)
        sent = {"reduce-scatter counts": 8 * (size - 1), "reduce-scatter": sum(send_counts) - send_counts[me]}
        sizes = recv_counts
    else:
        assert most is not None
        collective = "reduce-scatter all_to_all_single (frames)"
        frames = [to_frame(payloads[j], counts[j], int(most[j]), capacities[j]) for j in range(size)]
        received, work = start_alltoall_sized(torch.cat(frames), capacities, [capacities[me]] * size, group,
                                              what=what, collective=collective)
        sent = {"reduce-scatter": sum(capacities) - capacities[me]}
        sizes = [capacities[me]] * size
    framed = capacities is not None

    def finish() -> SparseReduceScatterResult:
        chunks = list(torch.split(received, sizes))
        status, error, pieces = RegionStatus.OK, None, []
        try:
            if framed:
                chunks = [from_frame(frame, f"{what}: rank {src}'s frame") for src, frame in enumerate(chunks)]
            pieces = [decode_region(codec, chunk, lengths[me], wide, f"{what}: rank {src}'s contribution")
                      for src, chunk in enumerate(chunks)]
            region_indices, sums = reduce_in_rank_order(pieces, device, lengths[me])
            if not all_finite(sums):
                status = RegionStatus.NONFINITE
        except DecodeError as caught:
            status, error, pieces = RegionStatus.DECODE_FAILED, caught, []
            region_indices = torch.empty(0, dtype=torch.int64, device=device)
            sums = torch.empty(0, dtype=torch.float32, device=device)
        return SparseReduceScatterResult(region_indices, sums, bounds[me], lengths[me], torch.cat(contributed),
                                         status, error, sent, tuple(pieces))

    return Launched(work, finish, collective)


def _capacities(codec: Optional[RegionCodec], most: Optional[Sequence[int]], lengths: list[int], wide: bool,
                what: str) -> Optional[list[int]]:
    """Each region's frame capacity, or None (counts first): without ``most``, or where the
    codec cannot bound a region's payload. Every rank computes the same from the same inputs."""
    if most is None:
        return None
    if len(most) != len(lengths) or any(int(m) < 0 for m in most):
        raise ValueError(f"{what}: most must hold {len(lengths)} counts >= 0, got {list(most)}")
    capacities = [frame_capacity(codec, int(m), length, wide) for m, length in zip(most, lengths)]
    return None if any(c is None for c in capacities) else [int(c) for c in capacities if c is not None]


@dataclass(frozen=True)
class AgreedStatus:
    """The ranks whose region failed to decode / held a non-finite sum, the same on every rank."""

    decode_failed: tuple[int, ...]
    nonfinite: tuple[int, ...]

    @property
    def ok(self) -> bool:
        """Whether every rank's region was fine."""
        return not self.decode_failed and not self.nonfinite


def status_words(status: RegionStatus, rank: int, world_size: int, dtype: torch.dtype) -> torch.Tensor:
    """This rank's status as ``2 * ceil(p / (bits - 1))`` integer words of ``dtype`` (``bits`` its
    width): a bitmap of the ranks whose decode failed, then one of the ranks that saw a non-finite
    sum, bit ``r % (bits-1)`` of word ``r // (bits-1)`` for rank r (the sign bit unused). Each rank
    sets only its own bit, so a SUM over the ranks is their OR, exact, and never overflows."""
    per_word = torch.iinfo(dtype).bits - 1
    words = torch.zeros(2, -(-world_size // per_word), dtype=dtype)
    if status is not RegionStatus.OK:
        words[0 if status is RegionStatus.DECODE_FAILED else 1, rank // per_word] = 1 << (rank % per_word)
    return words.reshape(-1)


def read_status_words(words: torch.Tensor, world_size: int) -> AgreedStatus:
    """The summed :func:`status_words` of every rank back to the ranks named in each bitmap."""
    per_word = torch.iinfo(words.dtype).bits - 1
    bits = (words.cpu().to(torch.int64).reshape(2, -1, 1) >> torch.arange(per_word)) & 1
    named = bits.reshape(2, -1)[:, :world_size]
    return AgreedStatus(*(tuple(row.nonzero().reshape(-1).tolist()) for row in named))


def agree_status(status: RegionStatus, group: Optional[dist.ProcessGroup] = None, *,
                 device: Optional[torch.device] = None, what: str = WHAT) -> AgreedStatus:
    """Every rank's :class:`RegionStatus`, agreed.

    One exact SUM AllReduce (:func:`.allreduce_sum_exact`) of :func:`status_words`, int32,
    ``2 ceil(p/31)`` words, about ``16 ceil(p/31)`` bytes sent per rank.

    Args:
        status: this rank's own.
        group: the process group (None: the default one).
        device: where the words travel (a CUDA device for NCCL; default the CPU).
        what: names the caller in errors.

    Returns:
        The ranks whose decode failed and those that saw a non-finite sum, the same on every rank.

    Raises:
        CollectiveError: the round failed.
    """
    size = group_size(group)
    words = status_words(status, group_rank(group), size, torch.int32).to(device or "cpu")
    return read_status_words(allreduce_sum_exact(words, group, what=what, collective="status all_reduce"), size)


def check_contribution(indices: torch.Tensor, values: torch.Tensor, numel: int) -> None:
    """``ValueError`` unless ``indices`` is (n,) int64 strictly ascending in ``[0, numel)`` and
    ``values`` (n,) float32."""
    if indices.dtype != torch.int64 or indices.dim() != 1:
        raise ValueError(f"indices must be a 1-D int64 tensor, got {indices.dtype} of shape {tuple(indices.shape)}")
    if values.dtype != torch.float32 or values.shape != indices.shape:
        raise ValueError(f"values must be float32 with the shape of indices, got {values.dtype} {tuple(values.shape)}")
    if not is_support(indices, numel):
        raise ValueError(f"indices must be strictly ascending in [0, numel={numel})")


#: a region this many times its received entries or fewer is reduced through a dense scratch of
#: its length (two O(length) passes); a sparser one by sorting its entries. Measured on one CPU
#: thread, 4 pieces of random positions: at 10% of a region of 127k each (FSDP's top-k 10%) the
#: dense way takes 1.3 ms against 3.5 ms, at 1% 0.44 ms against 0.25 ms
#: (tests/exchange/test_sparse_reduce_scatter.py holds both ways to the same bits).
DENSE_REDUCE_RATIO = 8

#: up to this many pieces, :func:`reduce_in_rank_order`'s sparse way merges them one after the
#: other in native code (each merge reads what the earlier ones gave: ``O(pieces * entries)``);
#: more fall back to one sort of all of them
NATIVE_MERGE_PIECES = 16


def reduce_in_rank_order(pieces: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device,
                         length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Union of the pieces' positions (ascending, in ``[0, length)``) and the sums of their
    values, added in the pieces' order: each piece's positions are distinct, so every addition is
    a plain, ordered read-add-write, ``((0 + v_0) + v_1) + ...`` for every position, the same bits
    on any device, run after run, whichever of the two ways below runs."""
    if not pieces:
        return torch.empty(0, dtype=torch.int64, device=device), torch.empty(0, dtype=torch.float32, device=device)
    received = sum(rel.numel() for rel, _ in pieces)
    if length <= DENSE_REDUCE_RATIO * received:
        sums_at = torch.zeros(length, dtype=torch.float32, device=device)
        hit = torch.zeros(length, dtype=torch.bool, device=device)
        for rel, vals in pieces:  # one pass per source rank, in rank order
            sums_at.index_add_(0, rel, vals)
            hit[rel] = True
        positions = hit.nonzero().reshape(-1)
        return positions, sums_at[positions]
    if device.type == "cpu" and len(pieces) <= NATIVE_MERGE_PIECES and kernels.available():
        return _merged_in_rank_order(pieces)
    everything = torch.cat([rel for rel, _ in pieces])
    positions, inverse = torch.unique(everything, sorted=True, return_inverse=True)
    sums = torch.zeros(positions.numel(), dtype=torch.float32, device=everything.device)
    offset = 0
    for rel, vals in pieces:  # one pass per source rank, in rank order
        slots = inverse[offset: offset + rel.numel()]
        sums[slots] = sums[slots] + vals
        offset += rel.numel()
    return positions, sums


def _merged_in_rank_order(pieces: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`reduce_in_rank_order`'s sparse way as merges, piece after piece in rank order (each
    ``(0 + v_0) + v_1 ...`` as the sort gives it; :func:`gradwire.kernels.union_add`: two pieces of
    167,607 entries in 2.05 ms against 6.95 ms for ``torch.unique`` and a scatter, one thread)."""
    positions = np.empty(0, dtype=np.int64)
    sums = np.empty(0, dtype=np.float32)
    for rel, vals in pieces:
        positions, sums = kernels.union_add(positions, sums, rel.contiguous().numpy(),
                                            vals.to(torch.float32).contiguous().numpy())
    return torch.from_numpy(positions), torch.from_numpy(sums)
