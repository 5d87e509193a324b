"""A group of tensors on its way through one exchange, where its result goes, and how it ended.

A :class:`Group` is what one strategy moves in one go: a DDP bucket (layer scope), every bucket
of an iteration (global scope), a ``GradientExchange`` bucket, an FSDP module's flat gradient.
Its gradients (:class:`Entry`) are views into its target's tensors; a strategy writes the reduced
result back with :meth:`Group.write`, divided by ``divisor`` (the world size for a mean, 1 for a
sum, or an FSDP divide factor). Two targets: :class:`BufferTarget` (every rank gets the whole
result) and :class:`ShardTarget` (FSDP2's reduce-scatter: each rank gets its own shard). Nothing
here resolves anything: the front-end
does, once every rank agreed the round succeeded (:mod:`gradwire.core.round`), so no rank ever
hands its framework a half-written or unagreed result.

``finite`` (this rank's input had no NaN/Inf) and ``k`` (how many entries a second selection of
the reduced sum keeps) are state of the group, set before a strategy starts, so every strategy
has the same entry point, ``start(group)``.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Hashable, Optional, Union

import numpy as np
import torch
import torch.distributed as dist

from .. import kernels
from ..finite import all_finite
from ..exchange.cost import ring_allreduce_bytes

if TYPE_CHECKING:
    from .feedback import ErrorFeedback


class Status(enum.IntEnum):
    """How a group's exchange ended on this rank; ordered so that the worst is the largest
    (a round's status is the maximum over its groups and over ranks)."""

    PENDING = -1
    WRITTEN = 0
    NONFINITE = 1
    FAILED = 2


@dataclass
class Entry:
    """One tensor's gradient inside a group.

    ``grad``: a view into its target's tensors. ``offset``: element offset in the group's flat
    space. ``compensated`` (flat float32/64, the tensor's numel) and ``indices`` (ascending
    int64) are filled by selection; ``values`` is ``compensated`` at ``indices`` when the
    selection read them on its way (None: the encoder gathers them). ``unused``: the gradient
    was all zeros on this rank (e.g. a parameter DDP found unused): it sends nothing and keeps
    its residual whole, so what it owes is neither applied nor lost.
    """

    key: Hashable
    tensor_id: int
    grad: torch.Tensor
    offset: int
    compensated: Optional[torch.Tensor] = None
    indices: Optional[torch.Tensor] = None
    values: Optional[torch.Tensor] = None
    unused: bool = False

    @property
    def numel(self) -> int:
        return self.grad.numel()


class BufferTarget:
    """The result goes into flat ``buffers`` laid end to end (DDP's bucket buffers, a
    ``GradientExchange`` bucket); the group's flat space is their concatenation."""

    def __init__(self, buffers: Optional[list[torch.Tensor]] = None) -> None:
        self.buffers: list[torch.Tensor] = [] if buffers is None else buffers
        #: the selection zeroed the (single) buffer on its way, after reading every gradient out of
        #: it (:class:`~.selection.Selection`): :meth:`output` then skips its zero-fill
        self.zeroed = False

    @property
    def numel(self) -> int:
        return sum(b.numel() for b in self.buffers)

    @property
    def device(self) -> torch.device:
        return self.buffers[0].device

    @property
    def dtype(self) -> torch.dtype:
        return self.buffers[0].dtype

    def inputs(self) -> list[torch.Tensor]:
        """The tensors holding this rank's gradients (checked for NaN/Inf before a strategy starts)."""
        return self.buffers

    def flat_input(self) -> torch.Tensor:
        """The raw gradients as one flat tensor (the buffer itself when there is one)."""
        if len(self.buffers) == 1:
            return self.buffers[0].view(-1)
        return torch.cat([b.reshape(-1) for b in self.buffers])

    def output(self, dtype: torch.dtype, *, zeroed: bool = True) -> torch.Tensor:
        """A zeroed flat tensor to sum the received gradients into: the buffer itself when there is
        one of that dtype (compensation already copied every gradient out), so the result needs no
        further copy; else a new one. ``zeroed=False``: for a result that writes every element (a
        dense one), as it is."""
        if len(self.buffers) == 1 and self.buffers[0].dtype == dtype and self.buffers[0].is_contiguous():
            flat = self.buffers[0].view(-1)
            was_zeroed, self.zeroed = self.zeroed, False
            return flat if was_zeroed or not zeroed else flat.zero_()
        return (torch.zeros if zeroed else torch.empty)(self.numel, dtype=dtype, device=self.device)

    def write(self, result: torch.Tensor) -> None:
        """Copy the flat result into the buffers (unless it is the buffer already)."""
        self.zeroed = False  # the flag says the buffer holds zeros: no longer, whichever path wrote
        position = 0
        for buffer in self.buffers:
            size = buffer.numel()
            if result.data_ptr() != buffer.data_ptr():
                buffer.copy_(result[position: position + size].reshape(buffer.shape))
            position += size

    def zero(self) -> None:
        for buffer in self.buffers:
            buffer.zero_()

    def results(self) -> list[torch.Tensor]:
        """What a digest of the written result covers, in order."""
        return self.buffers

    def dense_bytes(self, world_size: int, element_size: int) -> float:
        """What an uncompressed exchange of the input sends per rank: a ring AllReduce."""
        return ring_allreduce_bytes(self.numel, element_size, world_size)


@dataclass(frozen=True)
class Replicas:
    """HSDP: after the reduce-scatter inside the shard group, each shard is summed across the
    ranks that hold the same shard (``group``, FSDP's replicate dimension). ``key`` names the
    error-feedback memory of that second exchange (one per module, the shard's numel)."""

    group: Optional[dist.ProcessGroup]
    key: Hashable
    tensor_id: int


class ShardTarget:
    """The result is this rank's shard of a flat input laid out chunk by rank (FSDP2's
    reduce-scatter): ``input`` ``(p s,)``, chunk ``j`` summed over the ranks of ``group`` goes to its
    rank ``j``, whose ``output`` ``(s,)`` it is. The group's flat space is the input's; a strategy
    writes a result of ``s`` elements.

    Args:
        input: this rank's flat unsharded gradient, ``(p s,)`` (FSDP's reduce dtype).
        output: this rank's shard, ``(s,)``, written on success (any float dtype).
        group: the reduce-scatter's process group (p ranks; None: the default one).
        replicas: HSDP's second exchange of the shard across replicas (None: plain FSDP).
    """

    def __init__(self, input: torch.Tensor, output: torch.Tensor, *, group: Optional[dist.ProcessGroup],
                 replicas: Optional[Replicas] = None) -> None:
        self.input, self.output = input.reshape(-1), output.reshape(-1)
        self.group, self.replicas = group, replicas
        self.shards = self.input.numel() // max(1, self.output.numel())
        if self.output.numel() * self.shards != self.input.numel():
            raise ValueError(f"a reduce-scatter input of {self.input.numel()} elements is not whole chunks of the "
                             f"{self.output.numel()}-element output")
        self.index = dist.get_rank(group) if self.shards > 1 else 0

    @property
    def numel(self) -> int:
        return self.input.numel()

    @property
    def shard_numel(self) -> int:
        return self.output.numel()

    @property
    def device(self) -> torch.device:
        return self.input.device

    @property
    def dtype(self) -> torch.dtype:
        return self.input.dtype

    def boundaries(self) -> list[int]:
        """``p + 1`` region boundaries of the flat space: rank j owns ``[j s, (j+1) s)``."""
        return [j * self.shard_numel for j in range(self.shards + 1)]

    def inputs(self) -> list[torch.Tensor]:
        return [self.input]

    def flat_input(self) -> torch.Tensor:
        return self.input

    def shard_output(self, dtype: torch.dtype, *, zeroed: bool = True) -> torch.Tensor:
        """A zeroed ``(s,)`` tensor of ``dtype`` to sum this rank's shard into: the output itself
        when it has that dtype, else a new one (``zeroed=False``: as it is, for a dense result)."""
        if self.output.dtype == dtype and self.output.is_contiguous():
            return self.output.zero_() if zeroed else self.output
        return (torch.zeros if zeroed else torch.empty)(self.shard_numel, dtype=dtype, device=self.output.device)

    def write(self, result: torch.Tensor) -> None:
        """Copy the ``(s,)`` result into the output (cast to its dtype), unless it is the output."""
        if result.data_ptr() != self.output.data_ptr():
            self.output.copy_(result.reshape(-1))

    def zero(self) -> None:
        self.output.zero_()

    def results(self) -> list[torch.Tensor]:
        return [self.output]

    def dense_bytes(self, world_size: int, element_size: int) -> float:
        """What plain FSDP2 sends per rank for this input: a reduce-scatter, ``(p-1) s`` elements,
        and with replicas a ring AllReduce of the shard across them."""
        sent = float((self.shards - 1) * self.shard_numel * element_size)
        if self.replicas is not None:
            sent += ring_allreduce_bytes(self.shard_numel, element_size, world_size // self.shards)
        return sent


Target = Union[BufferTarget, ShardTarget]


@dataclass
class Group:
    """Tensors exchanged together. ``status`` records how its exchange ended on this rank.

    Args:
        target: where the reduced result goes (:class:`BufferTarget`, :class:`ShardTarget`).
        entries: the gradients, in the target's flat order.
        divisor: the sum over ranks is divided by this before it is written (world size: mean).
    """

    target: Target
    entries: list[Entry] = field(default_factory=list)
    divisor: float = 1.0
    #: this rank's input is finite (the pipeline checks before any strategy starts)
    finite: bool = True
    #: entries a second selection of the reduced sum keeps (sparse AllReduce, hierarchical)
    k: Optional[int] = None
    status: Status = Status.PENDING
    error: Optional[BaseException] = None
    #: a hash of what this rank summed (:mod:`.digest`), equal on every rank when nothing was
    #: corrupted in flight; set by the strategy when it writes (None: the written result is hashed)
    digest: Optional["int | torch.Tensor"] = None
    #: the digest is this rank's share of a balanced set (:func:`.digest.balanced_share`: shard
    #: groups, whose results differ per rank): the XOR over ranks is 0 when nothing was corrupted
    balanced_digest: bool = False
    #: error-feedback updates, applied only once every rank agreed the round succeeded
    feedback_updates: list[tuple[Hashable, torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    feedback_clears: list[Hashable] = field(default_factory=list)
    #: residuals an exchange computed whole (hierarchical: its shard of the node's sum)
    feedback_sets: list[tuple[Hashable, torch.Tensor]] = field(default_factory=list)
    #: every entry's ``compensated`` as one flat tensor in the group's flat order, set by the
    #: selection when it wrote them end to end and no entry is unused (None otherwise): a
    #: strategy can gather from it and keep its residual in one call instead of one per entry
    compensated_flat: Optional[torch.Tensor] = None
    #: :meth:`keep_flat`'s updates: (keys, numels, flat compensated, positions in it, sent there)
    feedback_flat_updates: list[tuple[list[Hashable], list[int], torch.Tensor, torch.Tensor, torch.Tensor]] = field(
        default_factory=list)

    @property
    def numel(self) -> int:
        return self.target.numel

    @property
    def device(self) -> torch.device:
        return self.target.device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the result is summed in: the compensated gradients' (float32/64), else the target's."""
        for entry in self.entries:
            if entry.compensated is not None:
                return entry.compensated.dtype
        return self.target.dtype

    @property
    def element_size(self) -> int:
        """Bytes per element of the uncompressed gradient (what a dense AllReduce would send)."""
        return torch.empty((), dtype=self.target.dtype).element_size()

    @property
    def sharded(self) -> bool:
        """Whether each rank gets its own shard of the result (FSDP2's reduce-scatter)."""
        return isinstance(self.target, ShardTarget)

    def dense_bytes(self, world_size: int) -> float:
        """Bytes per rank the uncompressed exchange of this group sends (``bytes_dense``)."""
        return self.target.dense_bytes(world_size, self.element_size)

    @property
    def compensated(self) -> bool:
        """Whether selection ran: the entries hold ``grad + residual`` (what a dense send owes)."""
        return any(entry.compensated is not None for entry in self.entries)

    def signature(self) -> tuple[int, ...]:
        """Identifies the group's layout across steps (DDP's buckets change after step one)."""
        return (self.numel, *(e.tensor_id for e in self.entries))

    def flat_gradient(self) -> torch.Tensor:
        return self.target.flat_input()

    def compensated_input(self, feedback: "Optional[ErrorFeedback]") -> torch.Tensor:
        """``grad + residual`` over the flat input, as a new float32 tensor: one ``torch.add(out=)``
        per used entry that holds a residual, one copy elsewhere. An unused entry sends its (zero)
        gradient and keeps its residual whole, which the strategy then does not replace
        (:meth:`keep_residual` skips it): nothing of it is sent twice."""
        source = self.flat_gradient()
        flat = torch.empty(source.numel(), dtype=torch.float32, device=source.device)
        done = 0  # flat[:done] is written
        for entry in sorted(self.entries, key=lambda e: e.offset):
            residual = feedback.residual(entry.key) if feedback is not None and not entry.unused else None
            if residual is None:
                continue
            start, end = entry.offset, entry.offset + entry.numel
            if start > done:
                flat[done:start] = source[done:start]
            torch.add(source[start:end], residual.to(torch.float32), out=flat[start:end])
            done = max(done, end)
        if done < flat.numel():
            flat[done:] = source[done:]
        return flat

    def output_buffer(self, dtype: torch.dtype, *, zeroed: bool = True) -> torch.Tensor:
        """A zeroed flat tensor of ``dtype`` the result is summed into: the whole flat space for a
        :class:`BufferTarget`, this rank's shard for a :class:`ShardTarget`. ``zeroed=False`` skips
        the zero-fill, for a dense result that writes every element."""
        if isinstance(self.target, ShardTarget):
            return self.target.shard_output(dtype, zeroed=zeroed)
        return self.target.output(dtype, zeroed=zeroed)

    # ------------------------------------------------------------------------- outcomes
    def keep(self, entry: Entry, indices: torch.Tensor, sent: torch.Tensor) -> None:
        """Record ``residual = compensated - sent at indices`` for the round's end."""
        if entry.unused or entry.compensated is None:
            return
        self.feedback_updates.append((entry.key, entry.compensated, indices, sent))

    def keep_flat(self, positions: torch.Tensor, sent: torch.Tensor) -> None:
        """:meth:`keep` for every entry at once: ``residual = compensated_flat - sent at positions``
        (int64 positions in the group's flat space, distinct), each entry's residual its view of it."""
        assert self.compensated_flat is not None, "keep_flat needs the selection's compensated_flat"
        self.feedback_flat_updates.append(([e.key for e in self.entries], [e.numel for e in self.entries],
                                           self.compensated_flat, positions, sent))

    def keep_residual(self, entry: Entry, residual: torch.Tensor) -> None:
        """Record ``residual`` (flat, the entry's numel) as the entry's new residual for the round's end."""
        if not entry.unused:
            self.feedback_sets.append((entry.key, residual))

    def clear_all(self) -> None:
        """Everything was sent (a dense fallback): nothing stays behind, except for unused entries."""
        self.feedback_clears.extend(e.key for e in self.entries if not e.unused)

    def write(self, result: torch.Tensor) -> None:
        """Write the flat reduced result (already divided) into the target."""
        self.target.write(result)
        self.status = Status.WRITTEN

    def release_exchange_inputs(self) -> None:
        """Once its exchange completed (written or failed), nothing reads what it sent from again:
        what waits for an agreement is the error-feedback records (which hold the compensated
        buffers), the status, the digest and the result. Drop this group's references to the
        caller's gradient storage (each entry's ``grad`` view and a :class:`ShardTarget`'s
        ``input``, kept as stand-ins of one element with the same ``numel``, dtype and device) and
        to each entry's selected ``indices`` and ``values``, so a front-end that holds many groups
        until one agreement (FSDP2: every module of a step) does not keep every unsharded gradient
        and every selection alive."""
        zeros: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}  # one element per kind, shared
        for entry in self.entries:
            entry.grad = _stand_in(entry.grad, zeros)
            entry.indices = entry.values = None
        if isinstance(self.target, ShardTarget):
            self.target.input = _stand_in(self.target.input, zeros)

    def mark_nonfinite(self) -> None:
        self.status = Status.NONFINITE

    def mark_failed(self, error: BaseException) -> None:
        if self.status != Status.FAILED:
            self.status, self.error = Status.FAILED, error


def _stand_in(tensor: torch.Tensor, zeros: "dict[tuple[torch.dtype, torch.device], torch.Tensor]") -> torch.Tensor:
    """A tensor shaped like flat ``tensor`` (same numel, dtype, device) backed by one element, taken
    from (or added to) ``zeros``, so a group's stand-ins cost one allocation, not one per entry."""
    kind = (tensor.dtype, tensor.device)
    if kind not in zeros:
        zeros[kind] = torch.zeros(1, dtype=tensor.dtype, device=tensor.device)
    return zeros[kind].expand(tensor.numel())


def flat_positions(indices: "list[torch.Tensor]", offsets: "list[int]") -> torch.Tensor:
    """Per-entry int64 ``indices`` (each relative to its entry) as positions in the group's flat
    space, end to end: ``indices[i] + offsets[i]``, in three calls over all of them instead of an
    addition per entry (ResNet-18's bucket: 62 entries). On the indices' device.

    Raises:
        ValueError: ``indices`` is empty (there is no device to put the result on).
    """
    if not indices:
        raise ValueError("flat_positions: no entries")
    joined = torch.cat(indices)
    counts = torch.tensor([i.numel() for i in indices], dtype=torch.int64)
    if joined.device.type == "cpu" and joined.dtype == torch.int64 and kernels.available():
        # in place over the fresh concatenation: 0.14 ms for ResNet-18's 60 entries at 1% (112k
        # positions) against 0.25 for repeat_interleave and the addition
        kernels.shift_segments(joined.numpy(), counts.numpy(), np.asarray(offsets, dtype=np.int64))
        return joined
    shifts = torch.repeat_interleave(torch.tensor(offsets, dtype=torch.int64), counts, output_size=joined.numel())
    return joined + shifts.to(joined.device)


def offset_in(buffer: torch.Tensor, view: torch.Tensor) -> int:
    """Element offset of ``view`` inside ``buffer`` (DDP's gradients are views of its bucket)."""
    offset, remainder = divmod(view.data_ptr() - buffer.data_ptr(), buffer.element_size())
    if remainder or not 0 <= offset <= buffer.numel() - view.numel():
        raise RuntimeError("gradient is not a view of its bucket buffer")
    return offset


def check_entries(group: Group, *, skip: "frozenset[int]" = frozenset(),
                  only: "Optional[frozenset[int]]" = None) -> None:
    """Set ``group.finite`` (every gradient finite on this rank) and each entry's ``unused`` (its
    gradient is all zeros here), from one fused pass over the group and one host sync.

    ``torch._foreach_norm`` (L2) reads every gradient once; a zero norm means all zeros and a
    finite norm means no NaN/Inf, except where squaring under- or overflows (elements below
    ~1e-23 or above ~1e19 in float32): so a zero norm is confirmed by ``any()`` and a non-finite
    one by an exact ``isfinite`` check, on that entry alone — rare paths, exact results.

    Args:
        group: the round's group.
        skip: positions of entries left out (the fused selection checks them on its way,
            :meth:`~.selection.Selection.deferrable`); ``group.finite`` then covers the others only.
        only: check just these positions (the rest of a check that was deferred); ``group.finite``
            stays False once it is False.
    """
    chosen = [entry for position, entry in enumerate(group.entries)
              if position not in skip and (only is None or position in only)]
    if not group.entries:
        group.finite = group.finite and all(all_finite(t) for t in group.target.inputs())
        return
    if not chosen:
        return
    grads = [entry.grad.reshape(-1) for entry in chosen]
    norms = torch.stack(torch._foreach_norm(grads)).tolist()
    finite = True
    for entry, grad, norm in zip(chosen, grads, norms):
        entry.unused = norm == 0.0 and not bool(grad.any())
        if not math.isfinite(norm):
            finite = finite and bool(torch.isfinite(grad).all())
    group.finite = group.finite and finite
