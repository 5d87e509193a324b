"""Blocking collectives whose failure raises, naming the collective, on every surviving rank.

A failed ``Work`` (a peer died, the connection broke, the group timed out) must never let a
rank go on with a buffer the collective did not write. Every function here waits on its work
and turns any failure into :class:`CollectiveError` (``"<what>: <collective> failed: ..."``).

Every exchange of data runs as ``all_to_all_single`` (works on gloo and NCCL; uneven ones with
split sizes, after a round that tells every receiver what it gets unless it knows already,
:func:`alltoall_sized`): gloo has no uneven list
``all_to_all`` and no ``all_gather`` of uneven sizes, padding would make the busiest rank set
everyone's volume, and a full-mesh exchange lets every survivor notice a dead peer itself (see
:func:`allgather_tensor`). The one exception is :func:`allreduce_sum_checked`, a plain
``all_reduce`` for a few words (region boundaries' votes). A world of one never touches
``torch.distributed``.

Each wait is bounded by :func:`time_limit` where a caller set one (the hook sets its
``collective_timeout`` around every exchange), else by the process group's own timeout: a peer
that stopped calling (stuck, or training without the hook) fails the round in seconds, not after
gloo's 30 minutes.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import TYPE_CHECKING, Any, Iterator, Optional, TypeVar

import torch
import torch.distributed as dist

from ..errors import CollectiveError
from ..lifetime import wait_for

if TYPE_CHECKING:
    from .inflight import Launched

T = TypeVar("T")

#: ``dist.reduce_scatter_single``: torch 2.13 deprecates ``reduce_scatter_tensor`` (a FutureWarning
#: on every rank and call) for it, with the same arguments; releases before it have only the old name
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    """Ranks in ``group`` (None: the default group); 1 without an initialized process group."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def group_rank(group: Optional[dist.ProcessGroup]) -> int:
    """This rank's rank in ``group`` (-1 if not a member); 0 without an initialized process group."""
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


_time_limit: contextvars.ContextVar[Optional[float]] = contextvars.ContextVar("gradwire_time_limit", default=None)


@contextlib.contextmanager
def time_limit(seconds: Optional[float]) -> Iterator[None]:
    """Inside, every blocking round here waits at most ``seconds`` (None: the group's own timeout)."""
    token = _time_limit.set(seconds)
    try:
        yield
    finally:
        _time_limit.reset(token)


def wait_checked(work: object, what: str, collective: str, *, keep: bool = True) -> None:
    """Wait for ``work``, keeping it referenced (:mod:`gradwire.lifetime`).

    Args:
        work: what a ``dist`` collective started with ``async_op=True`` returned.
        what: the caller, for the message.
        collective: which collective, for the message.
        keep: False when the caller holds ``work`` (and so its tensors) itself and has
            ``gradwire.lifetime.track``-ed it, rather than the queue of recent works (which would keep
            16 calls' buffers: for a large dense collective, that is memory).

    Raises:
        CollectiveError: it failed, reported no success, or outlasted :func:`time_limit`.
    """
    seconds = _time_limit.get()
    try:
        ok = wait_for(work, seconds, collective, keep=keep)  # keeps the Work alive (gradwire.lifetime)
    except RuntimeError as error:  # gloo raises on a closed connection or a timeout
        # wait_for's message says which limit ended the wait (the one set here, or the group's
        # own timeout or a failed peer before it) and carries the backend's error
        raise CollectiveError(f"{what}: {error} (a peer may be dead, stuck, or training without the gradwire "
                              "hook)") from error
    if ok is False:  # some backends report failure by returning False instead of raising
        raise CollectiveError(f"{what}: {collective} failed (work reported no success)")


def result_checked(launched: "Launched[T]", what: str) -> "T":
    """Wait for a started exchange (:class:`~.inflight.Launched`) as :func:`wait_checked` waits, within
    :func:`time_limit`, then finish it on this thread: its blocking form. The ``Launched`` holds the
    ``Work`` (it is tracked, :mod:`gradwire.lifetime`).

    Raises:
        CollectiveError: the collective failed, reported no success, or outlasted the limit.
    """
    if launched.work is not None:
        wait_checked(launched.work, what, launched.collective, keep=False)
    return launched.result()


def allgather_tensor(tensor: torch.Tensor, group: Optional[dist.ProcessGroup], *, what: str,
                     collective: str) -> torch.Tensor:
    """All ranks' equally shaped ``tensor``s stacked in rank order.

    Runs as an ``all_to_all_single`` (each rank sends its tensor to every peer: the same
    ``(p-1) * size`` bytes as a ring) so that every rank talks to every peer directly: a dead peer
    fails each survivor's own transfer at once, where in a ring a survivor two hops away would wait
    for a neighbour that has already given up, until the group's timeout.

    Args:
        tensor: the same shape and dtype on every rank, on the group's device.
        group: the process group (None: the default one).
        what: the caller, for error messages.
        collective: the collective's name, for error messages.

    Returns:
        Shape ``(p, *tensor.shape)``, row r from rank r.

    Raises:
        CollectiveError: the exchange failed.
    """
    size = group_size(group)
    if size == 1:
        return tensor.unsqueeze(0).clone()
    flat = tensor.reshape(-1)
    gathered = torch.empty(size * flat.numel(), dtype=tensor.dtype, device=tensor.device)
    wait_checked(dist.all_to_all_single(gathered, flat.repeat(size), group=group, async_op=True), what, collective)
    return gathered.reshape(size, *tensor.shape)


def allreduce_sum_checked(tensor: torch.Tensor, group: Optional[dist.ProcessGroup], *, what: str,
                          collective: str) -> torch.Tensor:
    """In-place SUM AllReduce of ``tensor``; returns it. CollectiveError if it fails."""
    if group_size(group) > 1:
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
        wait_checked(work, what, collective)
    return tensor


def alltoallv(buffer: torch.Tensor, send_counts: list[int], group: Optional[dist.ProcessGroup], *,
              what: str, collective: str) -> tuple[torch.Tensor, list[int]]:
    """Send ``buffer[sum(send_counts[:j]) : ...+send_counts[j]]`` to rank j: an uneven all-to-all.

    Two rounds: the counts (int64, ``p`` each), then the data.

    Args:
        buffer: 1-D, the pieces for rank 0, 1, ... concatenated.
        send_counts: elements for each rank, ``p`` ints summing to ``len(buffer)``.
        group: the process group (None: the default one).
        what: the caller, for error messages.
        collective: the collective's name, for error messages.

    Returns:
        The received buffer (rank order, ``buffer``'s dtype and device) and the counts received
        from each rank.

    Raises:
        CollectiveError: a round failed or a peer sent a negative count.
    """
    if group_size(group) == 1:
        return buffer.clone(), list(send_counts)
    recv_counts = exchange_counts(send_counts, group, device=buffer.device, what=what, collective=collective)
    return alltoall_sized(buffer, list(send_counts), recv_counts, group, what=what, collective=collective), recv_counts


def exchange_counts(send_counts: list[int], group: Optional[dist.ProcessGroup], *, device: torch.device,
                    what: str, collective: str) -> list[int]:
    """:func:`alltoallv`'s first round, blocking: the ``p`` counts each rank sends, in, the counts it receives.

    Raises:
        CollectiveError: the round failed or a peer sent a negative count.
    """
    counts_out = torch.tensor(send_counts, dtype=torch.int64, device=device)
    counts_in = torch.empty_like(counts_out)
    wait_checked(dist.all_to_all_single(counts_in, counts_out, group=group, async_op=True), what,
                 f"{collective} (counts)")
    recv_counts = [int(c) for c in counts_in.tolist()]
    if min(recv_counts) < 0:
        raise CollectiveError(f"{what}: {collective} (counts) received a negative count {recv_counts}")
    return recv_counts


def alltoall_sized(buffer: torch.Tensor, send_sizes: list[int], recv_sizes: list[int],
                   group: Optional[dist.ProcessGroup], *, what: str, collective: str) -> torch.Tensor:
    """:func:`alltoallv` when every rank already knows what it receives: one round, no counts.

    Args:
        buffer: 1-D, the pieces for rank 0, 1, ... concatenated.
        send_sizes: elements for each rank, ``p`` ints summing to ``len(buffer)``.
        recv_sizes: elements from each rank (what each sender's ``send_sizes`` holds for this
            rank: the callers derive both from the same shared numbers).
        group: the process group (None: the default one).
        what: the caller, for error messages.
        collective: the collective's name, for error messages.

    Returns:
        The received buffer, rank order, ``buffer``'s dtype and device.

    Raises:
        CollectiveError: the round failed.
    """
    received, work = start_alltoall_sized(buffer, send_sizes, recv_sizes, group, what=what, collective=collective)
    if work is not None:
        wait_checked(work, what, collective)
    return received


def start_alltoall_sized(buffer: torch.Tensor, send_sizes: list[int], recv_sizes: list[int],
                         group: Optional[dist.ProcessGroup], *, what: str, collective: str
                         ) -> tuple[torch.Tensor, Any]:
    """:func:`alltoall_sized` started, not waited for: the buffer it will write and its ``Work``
    (None in a world of one, where the buffer is already the answer). Read the buffer only after
    the Work's wait succeeded.

    Raises:
        CollectiveError: the collective could not be started.
    """
    if group_size(group) == 1:
        return buffer.clone(), None
    received = torch.empty(sum(recv_sizes), dtype=buffer.dtype, device=buffer.device)
    try:
        work = dist.all_to_all_single(received, buffer, output_split_sizes=list(recv_sizes),
                                      input_split_sizes=list(send_sizes), group=group, async_op=True)
    except RuntimeError as error:
        raise CollectiveError(f"{what}: {collective} could not start: {error}") from error
    return received, work


def allgatherv(buffer: torch.Tensor, group: Optional[dist.ProcessGroup], *, what: str,
               collective: str) -> tuple[torch.Tensor, list[int]]:
    """AllGather of uneven 1-D buffers without padding.

    Runs as an ``all_to_all_single`` that sends one's own buffer to every peer, so a rank sends
    ``(p-1) * len(buffer)`` elements, not ``(p-1) * max``; a lengths round goes first.

    Returns:
        Every rank's ``buffer`` concatenated in rank order, and the length of each. Arguments
        and errors as for :func:`allgatherv_tagged`.
    """
    received, lengths, _ = allgatherv_tagged(buffer, 0, group, what=what, collective=collective)
    return received, lengths


def allgatherv_tagged(buffer: torch.Tensor, tag: int, group: Optional[dist.ProcessGroup], *, what: str,
                      collective: str) -> tuple[torch.Tensor, list[int], list[int]]:
    """:func:`allgatherv` whose lengths round also carries one ``tag`` per rank.

    The tag shares the length's int64 word (no extra bytes), e.g. for the ranks to check, before
    the data moves, that they agree on something.

    Args:
        buffer: 1-D, under 2**32 elements, on the group's device; any length per rank.
        tag: ``0 <= tag < 2^31``.
        group: the process group (None: the default one).
        what: the caller, for error messages.
        collective: the collective's name, for error messages.

    Returns:
        The buffers concatenated in rank order, their lengths, and the ranks' tags.

    Raises:
        ValueError: ``tag`` or the buffer's length out of range.
        CollectiveError: a round failed or a peer sent a malformed word.
    """
    if not 0 <= tag < 2**31 or buffer.numel() >= 2**32:
        raise ValueError(f"{what}: tag={tag} must be in [0, 2^31) and the buffer under 2^32 elements")
    size = group_size(group)
    if size == 1:
        return buffer.clone(), [buffer.numel()], [tag]
    mine = torch.tensor([(tag << 32) | buffer.numel()], dtype=torch.int64, device=buffer.device)
    words = allgather_tensor(mine, group, what=what, collective=f"{collective} (lengths)").reshape(-1).tolist()
    lengths, tags = [w & 0xFFFFFFFF for w in words], [w >> 32 for w in words]
    if min(tags) < 0:
        raise CollectiveError(f"{what}: {collective} (lengths) received a negative word {words}")
    received = torch.empty(sum(lengths), dtype=buffer.dtype, device=buffer.device)
    work = dist.all_to_all_single(received, buffer.repeat(size), output_split_sizes=lengths,
                                  input_split_sizes=[buffer.numel()] * size, group=group, async_op=True)
    wait_checked(work, what, collective)
    return received, lengths, tags


def exact_allreduce_chunks(words: int, world_size: int) -> list[int]:
    """How many of the ``words`` elements each rank reduces in :func:`allreduce_sum_exact`:
    rank r the slice ``[r * words // p, (r+1) * words // p)``."""
    cuts = [r * words // world_size for r in range(world_size + 1)]
    return [b - a for a, b in zip(cuts, cuts[1:])]


def exact_allreduce_bytes(words: int, word_bytes: int, rank: int, world_size: int) -> int:
    """Bytes rank ``rank`` sends in :func:`allreduce_sum_exact` of ``words`` elements: every slice but
    its own to their reducers, then its reduced slice to each peer, ``(words + (p-2) c_r) * word_bytes``
    (``c_r`` its slice): ``2 (p-1)/p * words * word_bytes`` on average over the ranks, like a ring."""
    if world_size == 1:
        return 0
    own = exact_allreduce_chunks(words, world_size)[rank]
    return (words - own + (world_size - 1) * own) * word_bytes


def allreduce_sum_exact(tensor: torch.Tensor, group: Optional[dist.ProcessGroup], *, what: str,
                        collective: str) -> torch.Tensor:
    """SUM over the ranks of a 1-D integer ``tensor``, as a reduce-scatter then an AllGather, each one
    ``all_to_all_single`` of the raw bytes; for two ranks, one ``all_to_all_single`` of the whole
    tensor each way (the same bytes as the two rounds at p = 2, one round fewer: a sparse
    AllReduce runs one such sum per threshold level, and on 2 ranks every round is a wait for the
    slower one).

    Integer sums are exact, so every rank gets the same tensor whatever the order of additions;
    moving bytes lets any integer dtype travel (gloo has no int16 collectives); and every rank
    talks to every peer, so a dead peer fails each survivor's own transfer at once (see
    :func:`allgather_tensor`). Bytes sent: :func:`exact_allreduce_bytes`.

    Args:
        tensor: (m,) integer tensor, the same m and dtype on every rank; the sum must fit its dtype.

    Returns:
        (m,) the sum, same dtype and device.

    Raises:
        CollectiveError: a round failed (named ``"<collective> (reduce-scatter)"`` / ``"(allgather)"``,
            for two ranks ``"<collective> (exchange)"``).
        ValueError: ``tensor`` is not a 1-D integer tensor.
    """
    if tensor.dim() != 1 or tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
        raise ValueError(f"{what}: allreduce_sum_exact needs a 1-D integer tensor, got {tensor.dtype} "
                         f"of shape {tuple(tensor.shape)}")
    size, me = group_size(group), group_rank(group)
    if size == 1:
        return tensor.clone()
    if size == 2:
        return _sum_of_two(tensor, group, what=what, collective=collective)
    width = tensor.element_size()
    chunks = exact_allreduce_chunks(tensor.numel(), size)
    own = chunks[me]
    sent_bytes = tensor.contiguous().view(torch.uint8)
    received = torch.empty(size * own * width, dtype=torch.uint8, device=tensor.device)
    work = dist.all_to_all_single(received, sent_bytes, output_split_sizes=[own * width] * size,
                                  input_split_sizes=[c * width for c in chunks], group=group, async_op=True)
    wait_checked(work, what, f"{collective} (reduce-scatter)")
    reduced = received.view(tensor.dtype).reshape(size, own).sum(dim=0).to(tensor.dtype)
    gathered = torch.empty(tensor.numel() * width, dtype=torch.uint8, device=tensor.device)
    work = dist.all_to_all_single(gathered, reduced.view(torch.uint8).repeat(size),
                                  output_split_sizes=[c * width for c in chunks],
                                  input_split_sizes=[own * width] * size, group=group, async_op=True)
    wait_checked(work, what, f"{collective} (allgather)")
    return gathered.view(tensor.dtype)


def _sum_of_two(tensor: torch.Tensor, group: Optional[dist.ProcessGroup], *, what: str,
                collective: str) -> torch.Tensor:
    """:func:`allreduce_sum_exact` for two ranks: each sends its whole tensor to the other, one round
    (``m`` words each way, as the reduce-scatter and AllGather send at p = 2)."""
    return tensor + swap_with_peer(tensor, group, what=what, collective=f"{collective} (exchange)")


def swap_with_peer(tensor: torch.Tensor, group: Optional[dist.ProcessGroup], *, what: str,
                   collective: str) -> torch.Tensor:
    """In a group of two: the other rank's ``tensor``, for this rank's, in one ``all_to_all_single``
    (each rank sends its whole tensor to the other and nothing to itself).

    Args:
        tensor: the same shape and dtype on both ranks, on the group's device.
        group: a process group of two ranks (None: the default one).
        what: the caller, for error messages.
        collective: the collective's name, for error messages.

    Returns:
        The peer's tensor, ``tensor``'s shape and dtype.

    Raises:
        ValueError: the group does not have two ranks.
        CollectiveError: the exchange failed.
    """
    if group_size(group) != 2:
        raise ValueError(f"{what}: swap_with_peer needs a group of two ranks, got {group_size(group)}")
    nbytes = tensor.numel() * tensor.element_size()
    sizes = [0, nbytes] if group_rank(group) == 0 else [nbytes, 0]
    received = torch.empty(nbytes, dtype=torch.uint8, device=tensor.device)
    work = dist.all_to_all_single(received, tensor.contiguous().reshape(-1).view(torch.uint8),
                                  output_split_sizes=sizes, input_split_sizes=sizes, group=group, async_op=True)
    wait_checked(work, what, collective)
    return received.view(tensor.dtype).reshape(tensor.shape)
