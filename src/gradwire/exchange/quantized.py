"""Dense exchanges of blockwise-quantized float32 (int8 / int4, :mod:`.blockquant`).

**Reduce-scatter** (:func:`quantized_reduce_scatter`, ZeRO++ qgZ style, the FSDP2 layout): the
input is ``(p s,)`` float32 laid out chunk by rank, rank j owning ``input[j s : (j+1) s]``.

1. Each rank quantizes each destination chunk (blocks start at every chunk's start).
2. One ``all_to_all_single`` of equal chunks of ``Q(s) = quantized_bytes(s, bits, block_size)``
   bytes: the sizes follow from ``s``, so no counts round, and every rank talks to every peer (a
   dead peer fails each survivor's own transfer at once, see :mod:`.checked`).
3. The owner dequantizes every source's chunk, its own included, and sums them in float32 in rank
   order: one ordered elementwise add per source, the same bits on any device, run after run.

**AllReduce** (:func:`quantized_allreduce`): the flat input of ``n`` values is padded with zeros to
``p s``, ``s = ceil(n / p)``, and reduce-scattered as above; the owner re-quantizes its summed shard
``S``; one AllGather (an ``all_to_all_single`` of equal sizes, gloo and NCCL) of the re-quantized
shards; every rank, the owner included, dequantizes the gathered bytes, so the result is identical
bit for bit on every rank. **Two ranks** swap their whole quantized inputs in one round instead
(the same bytes, or a block's scale fewer) and each adds the two decodings: nothing is re-quantized.

**Bytes per worker** (own share excluded, ``Q`` as above)::

    reduce-scatter  (p-1) Q(s)                 ~ (p-1)/p  n (bits/8 + 4/block_size)
    AllReduce       2 (p-1) Q(ceil(n/p))       ~ 2(p-1)/p n (bits/8 + 4/block_size)
    AllReduce, p=2  Q(n) <= 2 Q(ceil(n/2))

against ``(p-1)/p 4n`` and ``2(p-1)/p 4n`` for float32: a ratio of ``(bits/8 + 4/block_size) / 4``
(int8, blocks of 128: 0.258; int4: 0.133). ``bytes_sent`` in each result is the exact count.

**Status**: a block that was NaN/Inf on some rank travels with a NaN scale and decodes to NaN, so
the owner's sum is non-finite; so is a sum that overflowed. In the AllReduce the owner quantizes
that non-finite ``S``, which again writes NaN scales into the blocks concerned: every rank decodes
them, and every rank's ``finite`` is False for the same call, with no extra round. ``finite`` is a
0-dim bool tensor on the input's device, not a Python bool: reading it is a host sync the caller
may make once per step instead of once per exchange. When it is False, neither the result nor the
residual should be used.

**Error feedback**. Write ``D(Q(.))`` for quantize-then-dequantize, ``x_r`` for rank r's (padded)
input, ``x_r^j`` for its chunk j, ``q_r^j = D(Q(x_r^j))``, ``S_j = sum_r q_r^j`` (owner j's float32
rank-order sum), ``A_j = D(Q(S_j))`` (what every rank applies on chunk j). Rank r's local error is
``e_r = x_r - q_r`` (all chunks), the owner's re-quantization error ``c_j = S_j - A_j``, and rank r's
residual ``residual_r = e_r + c_r`` (``c_r`` placed on the chunk r owns). On chunk j::

    sum_r residual_r^j + A_j = sum_r (x_r^j - q_r^j) + (S_j - A_j) + A_j = sum_r x_r^j + (S_j - sum_r q_r^j)

so what was not applied this step is in some rank's residual: EF telescopes, up to two float32
roundings, both on the owner: of its sum (``S_j - sum_r q_r^j``, what any float32 AllReduce rounds)
and of ``e_j^j + c_j`` (half an ulp of that residual). ``e_r`` and ``c_j`` themselves are exact
(:mod:`.blockquant`). The reduce-scatter alone telescopes the same way with ``residual_r = e_r``
and ``S_j`` applied. Padding is zero on every rank, quantizes to exactly zero and carries no
residual, so it is dropped from the results. Two ranks' swap applies ``A = q_0 + q_1`` with
``residual_r = e_r``: ``sum_r residual_r + A = sum_r x_r`` up to the rounding of that one addition.

Blocking, on the caller's thread (:func:`start_quantized_reduce_scatter` returns the reduce-scatter in flight
and finishes it on the caller's thread when asked); every rank must call with the same sizes, ``bits`` and
``block_size``, in the same order. Every collective is started with ``async_op=True`` and waited
through :func:`.checked.wait_checked` (a failure raises :class:`~gradwire.errors.CollectiveError`
naming it, within :func:`.checked.time_limit`). Tensors stay on the input's device, which must be
one the group's backend moves (CPU for gloo, CUDA for NCCL); there is no host sync inside.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..errors import CollectiveError
from ..finite import finite_flag
from .blockquant import check_options, dequantize, roundtrip
from .checked import allgather_tensor, group_rank, group_size, result_checked, swap_with_peer, wait_checked
from .inflight import Launched

WHAT_REDUCE_SCATTER = "quantized_reduce_scatter"
WHAT_ALLREDUCE = "quantized_allreduce"


@dataclass(frozen=True)
class QuantizedReduceScatterResult:
    """What :func:`quantized_reduce_scatter` returns.

    Attributes:
        shard: ``(s,)`` float32, the SUM over ranks of this rank's chunk as dequantized (divide by p for AVG).
        error: ``(p s,)`` float32, this rank's quantization error ``input - D(Q(input))`` per chunk;
            None in what :func:`start_quantized_reduce_scatter`'s exchange returns (the error is
            :attr:`QuantizedScatterInFlight.error`, known at the start: the exchange in flight does
            not hold a second copy of it).
        finite: 0-dim bool tensor, False if ``shard`` holds NaN/Inf (some source's block or the sum).
        sent_by_collective: bytes this rank handed to each collective for its peers.
        chunks_sent: ``(p, Q)`` uint8, the quantized chunk this rank sent to each rank (row j to rank j).
        chunks_received: ``(p, Q)`` uint8, the chunk this rank received from each rank (row r from
            rank r); with ``chunks_sent`` what a caller can check the transfer by (a digest).
        works: the collective's ``Work`` (tracked, :mod:`gradwire.lifetime`), which the caller
            holds until it starts its next exchange: not the queue of recent works, where 16 calls'
            chunks would stay alive.
    """

    shard: torch.Tensor
    error: Optional[torch.Tensor]
    finite: torch.Tensor
    sent_by_collective: dict[str, int] = field(default_factory=dict)
    chunks_sent: Optional[torch.Tensor] = None
    chunks_received: Optional[torch.Tensor] = None
    works: tuple = ()

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank sent, all collectives together."""
        return sum(self.sent_by_collective.values())


@dataclass(frozen=True)
class QuantizedAllreduceResult:
    """What :func:`quantized_allreduce` returns.

    Attributes:
        values: ``(n,)`` float32, the SUM over ranks as applied, identical bit for bit on every rank.
        residual: ``(n,)`` float32, this rank's error-feedback residual (module docstring).
        finite: 0-dim bool tensor, the same on every rank: False if some rank's input or some sum
            was NaN/Inf.
        sent_by_collective: bytes this rank handed to each collective for its peers.
    """

    values: torch.Tensor
    residual: torch.Tensor
    finite: torch.Tensor
    sent_by_collective: dict[str, int] = field(default_factory=dict)

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank sent, all collectives together."""
        return sum(self.sent_by_collective.values())


def quantized_reduce_scatter(input: torch.Tensor, *, bits: int, block_size: int,
                             group: Optional[dist.ProcessGroup] = None,
                             segments: Optional[Sequence[int]] = None) -> QuantizedReduceScatterResult:
    """Sum the ranks' chunk-by-rank inputs into each owner's shard, over int8/int4 (module docstring).

    Args:
        input: ``(p s,)`` float32; rank j owns ``input[j s : (j+1) s]``. ``s`` need not be a
            multiple of ``block_size``.
        bits: 8 or 4.
        block_size: values per float32 scale, >= 1.
        group: the process group (None: the default one); p is its size.
        segments: lengths summing to ``s``, the same on every rank: blocks restart at each, in
            every chunk (:mod:`.blockquant`; FSDP2: one per parameter). None: one segment.

    Returns:
        :class:`QuantizedReduceScatterResult`; ``sent_by_collective`` is
        ``{"reduce-scatter": (p-1) quantized_bytes(s, bits, block_size, segments)}``.

    Raises:
        ValueError: ``input`` not 1-D float32, its length not a multiple of p, or bad options.
        CollectiveError: the ``all_to_all_single`` failed or timed out (a peer died, ...).
    """
    in_flight = start_quantized_reduce_scatter(input, bits=bits, block_size=block_size, group=group,
                                               segments=segments)
    return dataclasses.replace(result_checked(in_flight.launched, WHAT_REDUCE_SCATTER), error=in_flight.error)


def start_quantized_reduce_scatter(input: torch.Tensor, *, bits: int, block_size: int,
                                   group: Optional[dist.ProcessGroup] = None,
                                   segments: Optional[Sequence[int]] = None) -> "QuantizedScatterInFlight":
    """:func:`quantized_reduce_scatter`'s first two steps now (quantize, start the ``all_to_all_single``);
    its third (dequantize and sum) when the caller asks for the result, on the caller's thread.

    A caller that has other work (FSDP2's backward of the next module) lets the chunks travel
    meanwhile instead of holding its thread for the transfer. ``input`` is not read after this
    returns (the local error is taken here).

    Args:
        as :func:`quantized_reduce_scatter`.

    Returns:
        :class:`QuantizedScatterInFlight`: this rank's local error now (a caller that keeps
        residuals in another dtype converts it at once instead of holding it in float32 until the
        result), and a :class:`~.inflight.Launched` whose ``result(timeout)`` is the
        :class:`QuantizedReduceScatterResult` (``works`` holds the collective's ``Work``).

    Raises:
        ValueError: as :func:`quantized_reduce_scatter`, before anything is sent.
        CollectiveError: the collective could not be started. A failure on the wire is raised by
            ``result`` (a ``RuntimeError`` naming the collective, as every :class:`~.inflight.Launched`).
    """
    size = _members(group, WHAT_REDUCE_SCATTER)
    check_options(bits, block_size)
    _check_flat(input, WHAT_REDUCE_SCATTER)
    if input.numel() % size:
        raise ValueError(f"{WHAT_REDUCE_SCATTER}: input of {input.numel()} values is not {size} equal chunks")
    chunks = input.reshape(size, -1)
    s = chunks.shape[1]
    packed, local = roundtrip(chunks, bits=bits, block_size=block_size, segments=segments)  # (p, Q), (p, s)
    error = chunks - local
    sent = {"reduce-scatter": (size - 1) * packed.shape[1]}
    work = None
    received = packed
    if size > 1 and packed.numel():  # else nothing to move (every rank has the same sizes)
        received = torch.empty_like(packed)
        try:
            work = dist.all_to_all_single(received.reshape(-1), packed.reshape(-1), group=group, async_op=True)
        except RuntimeError as error_:
            raise CollectiveError(f"{WHAT_REDUCE_SCATTER}: reduce-scatter all_to_all_single could not start: "
                                  f"{error_}") from error_

    def finish() -> QuantizedReduceScatterResult:  # (not the error: the caller has it, n-sized, from the start)
        shard = _sum_in_rank_order(received, s, bits, block_size, segments)
        return QuantizedReduceScatterResult(shard, None, finite_flag(shard), sent, packed, received,
                                            (work,) if work is not None else ())

    return QuantizedScatterInFlight(error.reshape(-1), Launched(work, finish, "reduce-scatter all_to_all_single"))


@dataclass(frozen=True)
class QuantizedScatterInFlight:
    """What :func:`start_quantized_reduce_scatter` returns.

    Attributes:
        error: ``(p s,)`` float32, this rank's quantization error ``input - D(Q(input))`` per chunk
            (the same tensor as the result's ``error``).
        launched: the exchange in flight; ``result(timeout)`` is the :class:`QuantizedReduceScatterResult`.
    """

    error: torch.Tensor
    launched: Launched[QuantizedReduceScatterResult]


def quantized_allreduce(input: torch.Tensor, *, bits: int, block_size: int,
                        group: Optional[dist.ProcessGroup] = None) -> QuantizedAllreduceResult:
    """Sum the ranks' flat inputs over int8/int4: quantized reduce-scatter, re-quantized AllGather
    (for two ranks, one swap of the quantized inputs: :func:`_swap_of_two`).

    Args:
        input: ``(n,)`` float32, any ``n`` (padded with zeros to ``p ceil(n / p)`` inside).
        bits: 8 or 4 (both rounds).
        block_size: values per float32 scale, >= 1.
        group: the process group (None: the default one); p is its size.

    Returns:
        :class:`QuantizedAllreduceResult`; ``sent_by_collective`` is ``{"reduce-scatter": (p-1) Q,
        "allgather": (p-1) Q}`` with ``Q = quantized_bytes(ceil(n / p), bits, block_size)``; for two
        ranks ``{"exchange": quantized_bytes(n, bits, block_size)}``.

    Raises:
        ValueError: ``input`` not 1-D float32, or bad options.
        CollectiveError: a collective failed or timed out (a peer died, ...), naming which.
    """
    size = _members(group, WHAT_ALLREDUCE)
    check_options(bits, block_size)
    _check_flat(input, WHAT_ALLREDUCE)
    n = input.numel()
    if n == 0:  # every rank has the same n: all return without a collective
        return QuantizedAllreduceResult(input.clone(), input.clone(), finite_flag(input), {})
    if size == 2:
        return _swap_of_two(input, bits, block_size, group)
    chunk = math.ceil(n / size)
    padded = torch.nn.functional.pad(input, (0, size * chunk - n)).reshape(size, chunk)
    shard, error, sent = _reduce_scatter(padded, bits, block_size, group, size, WHAT_ALLREDUCE)

    # re-quantize the owner's sum; a non-finite S writes NaN scales, so every rank will see it
    packed, requantized = roundtrip(shard, bits=bits, block_size=block_size)
    me = group_rank(group)
    error[me] += shard - requantized  # the owner's carry c_j (itself exact: blockquant's docstring)
    gathered = allgather_tensor(packed, group, what=WHAT_ALLREDUCE, collective="allgather all_to_all_single")
    sent["allgather"] = (size - 1) * packed.numel()
    # every rank, the owner included, applies the gathered bytes as decoded: identical on all ranks
    values = dequantize(gathered, chunk, bits=bits, block_size=block_size).reshape(-1)[:n]
    return QuantizedAllreduceResult(values, error.reshape(-1)[:n], finite_flag(values), sent)


def _swap_of_two(input: torch.Tensor, bits: int, block_size: int,
                 group: Optional[dist.ProcessGroup]) -> QuantizedAllreduceResult:
    """:func:`quantized_allreduce` for two ranks: each quantizes its whole input once, the two swap
    them in one ``all_to_all_single`` (``Q(n) <= 2 Q(ceil(n/2))`` bytes each way: what the
    reduce-scatter and the AllGather send together at p = 2, one round fewer), and each adds the two
    decodings, ``D(Q(x_0)) + D(Q(x_1))``: float32 addition commutes, so both ranks hold the same bits.
    No sum is re-quantized, so the residual is the local error alone and the applied sum is within
    the two sources' half scales of the exact one (the AllGather's re-quantization adds the owner's)."""
    packed, local = roundtrip(input, bits=bits, block_size=block_size)  # (Q,), (n,): local is D(packed)
    peer = swap_with_peer(packed, group, what=WHAT_ALLREDUCE, collective="exchange all_to_all_single")
    values = local + dequantize(peer, input.numel(), bits=bits, block_size=block_size)
    return QuantizedAllreduceResult(values, input - local, finite_flag(values), {"exchange": packed.numel()})


def _reduce_scatter(chunks: torch.Tensor, bits: int, block_size: int, group: Optional[dist.ProcessGroup],
                    size: int, what: str) -> tuple[torch.Tensor, torch.Tensor, dict[str, int]]:
    """Steps 1-3 on ``chunks`` ``(p, s)`` float32, blocking: the owner's rank-order sum ``(s,)``,
    this rank's local error ``(p, s)`` and the bytes sent (the AllReduce's first round)."""
    s = chunks.shape[1]
    packed, local = roundtrip(chunks, bits=bits, block_size=block_size)  # (p, Q), (p, s)
    error = chunks - local
    if size == 1 or packed.numel() == 0:  # nothing to move (every rank has the same sizes)
        received = packed
    else:
        received = torch.empty_like(packed)
        work = dist.all_to_all_single(received.reshape(-1), packed.reshape(-1), group=group, async_op=True)
        wait_checked(work, what, "reduce-scatter all_to_all_single")
    sent = {"reduce-scatter": (size - 1) * packed.shape[1]}
    return _sum_in_rank_order(received, s, bits, block_size, None), error, sent


def _sum_in_rank_order(received: torch.Tensor, s: int, bits: int, block_size: int,
                       segments: Optional[Sequence[int]]) -> torch.Tensor:
    """Step 3: every source's ``(Q,)`` chunk (row r from rank r) dequantized, summed in rank order ``(s,)``."""
    decoded = dequantize(received, s, bits=bits, block_size=block_size, segments=segments)
    # a loop over ranks, not values: p ordered adds, where a sum over dim 0 leaves the order to the backend
    shard = decoded[0].clone()
    for source in range(1, decoded.shape[0]):
        shard += decoded[source]
    return shard


def _members(group: Optional[dist.ProcessGroup], what: str) -> int:
    if group_rank(group) < 0:
        raise ValueError(f"{what}: this rank is not a member of the group it was given")
    return group_size(group)


def _check_flat(input: torch.Tensor, what: str) -> None:
    if input.dtype != torch.float32 or input.dim() != 1:
        raise ValueError(f"{what}: input must be a 1-D float32 tensor, got {input.dtype} {tuple(input.shape)}")
