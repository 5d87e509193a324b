"""A group of buckets on its way through one exchange, and what finishing it means.

A :class:`BucketGroup` is one DDP bucket (layer scope) or all buckets of an iteration (global
scope). Its gradients are views into the buckets' buffers; a strategy writes the averaged
result back with :meth:`BucketGroup.write`. The Futures DDP waits on are not resolved there:
the step's end (:mod:`gradwire.hook.step`) resolves every group of the step together, once all
ranks agree the step succeeded, so no rank ever hands DDP a half-written or unagreed buffer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Optional

import torch


@dataclass
class Entry:
    """One parameter's gradient inside a group.

    ``grad``: a view into its bucket's buffer. ``offset``: element offset in the concatenation
    of the group's buffers. ``compensated`` (flat float32/64, the parameter's numel) and
    ``indices`` (ascending int64) are filled by selection. ``unused``: the gradient was all
    zeros on this rank (e.g. a parameter DDP found unused): it sends nothing and keeps its
    residual whole, so what it owes is neither applied nor lost.
    """

    key: Hashable
    tensor_id: int
    grad: torch.Tensor
    offset: int
    compensated: Optional[torch.Tensor] = None
    indices: Optional[torch.Tensor] = None
    unused: bool = False

    @property
    def numel(self) -> int:
        return self.grad.numel()


@dataclass
class BucketGroup:
    """Buckets exchanged together. ``status`` records how its exchange ended on this rank."""

    buffers: list[torch.Tensor]
    entries: list[Entry] = field(default_factory=list)
    futures: list[torch.futures.Future] = field(default_factory=list)
    #: "pending" -> "written" | "nonfinite" | "failed" (then ``error`` says why)
    status: str = "pending"
    error: Optional[BaseException] = None
    #: error-feedback updates, applied only once every rank agreed the step succeeded
    feedback_updates: list[tuple[Hashable, torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    feedback_clears: list[Hashable] = field(default_factory=list)
    #: residuals an exchange computed whole (hierarchical: its shard of the node's sum)
    feedback_sets: list[tuple[Hashable, torch.Tensor]] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return sum(b.numel() for b in self.buffers)

    @property
    def device(self) -> torch.device:
        return self.buffers[0].device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the result is summed in: the compensated gradients' (float32/64), else the buffer's."""
        for entry in self.entries:
            if entry.compensated is not None:
                return entry.compensated.dtype
        return self.buffers[0].dtype

    def signature(self) -> tuple[int, ...]:
        """Identifies the group's layout across steps (DDP's buckets change after step one)."""
        return (self.numel, *(e.tensor_id for e in self.entries))

    def flat_gradient(self) -> torch.Tensor:
        """The raw gradients as one flat tensor (the buffer itself when there is one bucket)."""
        if len(self.buffers) == 1:
            return self.buffers[0].view(-1)
        return torch.cat([b.reshape(-1) for b in self.buffers])

    def output_buffer(self, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed flat tensor to sum the received gradients into: the bucket's own buffer when
        there is one of that dtype (compensation already copied every gradient out), so the
        result needs no further copy; else a new one."""
        if len(self.buffers) == 1 and self.buffers[0].dtype == dtype and self.buffers[0].is_contiguous():
            return self.buffers[0].view(-1).zero_()
        return torch.zeros(self.numel, dtype=dtype, device=self.device)

    # ------------------------------------------------------------------------- outcomes
    def keep(self, entry: Entry, indices: torch.Tensor, sent: torch.Tensor) -> None:
        """Record ``residual = compensated - sent at indices`` for the step's end."""
        if entry.unused or entry.compensated is None:
            return
        self.feedback_updates.append((entry.key, entry.compensated, indices, sent))

    def keep_residual(self, entry: Entry, residual: torch.Tensor) -> None:
        """Record ``residual`` (flat, the entry's numel) as the entry's new residual for the step's end."""
        if not entry.unused:
            self.feedback_sets.append((entry.key, residual))

    def clear_all(self) -> None:
        """Everything was sent (a dense fallback): nothing stays behind, except for unused entries."""
        self.feedback_clears.extend(e.key for e in self.entries if not e.unused)

    def write(self, averaged: torch.Tensor) -> None:
        """Copy the flat averaged gradient into the buckets' buffers (if it is not one already)."""
        position = 0
        for buffer in self.buffers:
            size = buffer.numel()
            if averaged.data_ptr() != buffer.data_ptr():
                buffer.copy_(averaged[position: position + size].reshape(buffer.shape))
            position += size
        self.status = "written"

    def mark_nonfinite(self) -> None:
        self.status = "nonfinite"

    def mark_failed(self, error: BaseException) -> None:
        if self.status != "failed":
            self.status, self.error = "failed", error

    # -------------------------------------------------------------- resolving DDP's futures
    def resolve(self) -> None:
        for buffer, future in zip(self.buffers, self.futures):
            if not future.done():
                future.set_result(buffer)

    def resolve_zero(self) -> None:
        for buffer in self.buffers:
            buffer.zero_()
        self.resolve()

    def fail(self, error: BaseException) -> None:
        for future in self.futures:
            if not future.done():
                future.set_exception(error)


def offset_in(buffer: torch.Tensor, view: torch.Tensor) -> int:
    """Element offset of ``view`` inside ``buffer`` (DDP's gradients are views of its bucket)."""
    offset, remainder = divmod(view.data_ptr() - buffer.data_ptr(), buffer.element_size())
    if remainder or not 0 <= offset <= buffer.numel() - view.numel():
        raise RuntimeError("gradient is not a view of its bucket buffer")
    return offset


def all_finite(tensor: torch.Tensor) -> bool:
    """True when no element is NaN or Inf. A plain sum is finite in the common case and costs
    ~20x less than ``isfinite().all()``; only a non-finite sum (NaN/Inf inside, or an overflow of
    huge finite values) pays for the exact check."""
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())
