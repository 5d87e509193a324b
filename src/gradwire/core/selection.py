"""Error-feedback compensation and sparsification of a group's entries."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from .. import kernels
from ..sparsify import select_global
from ..sparsify.base import Sparsifier
from .feedback import ErrorFeedback, accumulation_dtype
from .group import BufferTarget, Entry, Group, check_entries
from .stats import ExchangeStats


class Selection:
    """1. ``compensated = grad + residual`` per entry (float32/64, into a reused buffer);
    2. an entry whose gradient is all zeros on this rank (a parameter DDP found unused) is marked
       ``unused``: it selects nothing and keeps its residual whole, so what it owes is neither
       applied nor lost (for shared supports it sends zeros at the shared positions);
    3. the sparsifier picks ascending int64 indices per entry (``scope="layer"``) or once over
       the group (``scope="global"``).
    A rank whose gradient is not finite (``group.finite`` is False) selects on zeros instead
    (shared supports must still agree in size) and leaves its memory untouched.

    ``stats`` counts ``count_compensations`` and ``count_selections`` (entries), so a test can
    check that each entry is compensated and selected exactly once per round.

    Where the native kernels take an entry (:mod:`gradwire.kernels`: a large float CPU tensor),
    its compensation also tells whether the compensated gradient is finite and the gradient not
    all zeros, so the pipeline's check (:func:`~.group.check_entries`, one more read of the
    bucket) skips it (:meth:`deferrable`) and :meth:`run` completes it, as if the check had come
    first: an unused entry selects nothing and keeps its residual whole; NaN makes a per-rank
    support select nothing and a shared one select its positions on zeros. It also zeroes the
    bucket buffer on the way (``BufferTarget.zeroed``), which the strategy's output then is.
    A shared support defers the whole group's check to one native pass (:meth:`segments_apply`).
    """

    def __init__(self, sparsifier: Sparsifier, feedback: Optional[ErrorFeedback], scope: str,
                 stats: ExchangeStats) -> None:
        self.sparsifier = sparsifier
        self.feedback = feedback
        self.scope = scope
        self.stats = stats

    def compensate(self, group: Group, *, detect_unused: bool = True) -> None:
        """Steps 1-2 only (an exchange that selects on something else, e.g. a node's sum).
        ``entry.unused`` comes from the pipeline's check (:func:`~.group.check_entries`)."""
        finite = group.finite
        with self.stats.timer("compensate"):
            for entry in group.entries:
                entry.unused = detect_unused and finite and entry.unused
                entry.compensated = self._compensate(entry, finite)
        self.stats.add("count_compensations", len(group.entries))

    def deferrable(self, group: Group) -> "frozenset[int]":
        """Positions of the entries whose check :meth:`run` can do on its way (see the class
        docstring); empty unless the selection is fused and the kernels are here."""
        if self.scope != "layer" or type(self.feedback) not in (ErrorFeedback, type(None)) or not kernels.available():
            return frozenset()
        if self.segments_apply(group):
            return frozenset(range(len(group.entries)))
        return frozenset(position for position, entry in enumerate(group.entries)
                         if self.sparsifier.fused_check_applies(entry.grad))

    def segments_apply(self, group: Group) -> bool:
        """Whether :meth:`run` compensates and checks the whole group in one native call
        (:meth:`_run_segments`): a support every rank shares (its positions need no values, so
        nothing is fused with the pass but the check), per-layer, plain error feedback or none,
        and a group that tiles one float32/float64 CPU buffer the strategy sums into."""
        if not (self.sparsifier.shared_support and self.scope == "layer" and group.entries
                and type(self.feedback) in (ErrorFeedback, type(None)) and kernels.available() and _zeroable(group)):
            return False
        assert isinstance(group.target, BufferTarget)
        buffer = group.target.buffers[0]
        return buffer.device.type == "cpu" and buffer.dtype in (torch.float32, torch.float64)

    def run(self, group: Group, step: int, *, deferred: "frozenset[int]" = frozenset()) -> None:
        """Steps 1-3: compensate, then select (fused per entry where the sparsifier can, see
        :meth:`~gradwire.sparsify.Sparsifier.select_compensated`: timed as ``select`` then).
        ``deferred``: entries the pipeline did not check (:meth:`deferrable`)."""
        if deferred and len(deferred) == len(group.entries) and self.segments_apply(group):
            self._run_segments(group, step)
            return
        if self.scope == "layer" and type(self.feedback) in (ErrorFeedback, type(None)):
            self._run_fused(group, step, deferred)
            return
        assert not deferred, "only the fused selection checks on its way"
        self.compensate(group)
        with self.stats.timer("select"):
            if self.scope == "global":  # unused entries hold zeros, which a per-rank support skips
                selected = select_global(self.sparsifier, [e.compensated for e in group.entries], step=step)
            else:
                selected = [self._select_one(entry, step) for entry in group.entries]
            for entry, indices in zip(group.entries, selected):
                entry.indices, entry.values = indices, None
        self.stats.add("count_selections", len(group.entries))

    def _run_fused(self, group: Group, step: int, deferred: "frozenset[int]" = frozenset()) -> None:
        finite = group.finite
        late_nonfinite = False
        # with a deferred check the bucket's own buffer can be zeroed as each gradient is read out
        # of it (the output the strategy sums into is that buffer: one zero-fill pass fewer)
        zero = bool(deferred) and _zeroable(group)
        zeroed: set[int] = set()
        with self.stats.timer("select"):
            batched = self._select_pieces(group, deferred)
            for position, entry in enumerate(group.entries):
                if position in batched:
                    continue
                checked = position not in deferred
                if checked:
                    entry.unused = finite and entry.unused
                if checked and (not finite or entry.unused):
                    entry.compensated = self._compensate(entry, finite)
                    entry.indices, entry.values = self._select_one(entry, step), None
                    continue
                grad = entry.grad.reshape(-1)
                if self.feedback is not None:
                    out, residual = self.feedback.prepare(entry.key, grad)
                else:
                    out, residual = torch.empty(grad.numel(), dtype=accumulation_dtype(grad), device=grad.device), None
                flags: dict = {}
                entry.indices = self.sparsifier.select_compensated(grad, residual, out, step=step,
                                                                   tensor_id=entry.tensor_id, flags=flags,
                                                                   zero_grad=zero and not checked)
                entry.compensated, entry.values = out, flags.get("values")
                if flags.get("zeroed"):
                    zeroed.add(position)
                if checked:
                    continue
                if "finite" not in flags:  # the kernel did not run on it (e.g. mostly zeros): check it here
                    check_entries(group, only=frozenset((position,)))
                    late_nonfinite = late_nonfinite or not group.finite
                else:
                    entry.unused = not flags["nonzero"]
                    late_nonfinite = late_nonfinite or not flags["finite"]
                if entry.unused and not late_nonfinite:  # nothing of it is sent; its residual stays whole
                    entry.compensated = self._compensate(entry, True)
                    entry.indices, entry.values = self._select_one(entry, step), None
            if late_nonfinite:  # as if the check had come first
                self._as_nonfinite(group, step)
            if zero:  # the rest of the buffer (small tensors, any the kernel skipped), now read too
                for position, entry in enumerate(group.entries):
                    if position not in zeroed:
                        entry.grad.zero_()
                assert isinstance(group.target, BufferTarget)
                group.target.zeroed = True
        self.stats.add("count_compensations", len(group.entries))
        self.stats.add("count_selections", len(group.entries))

    def _run_segments(self, group: Group, step: int) -> None:
        """Steps 1-3 for a group :meth:`segments_apply` to, its check deferred whole: one native
        pass compensates every entry into one flat buffer end to end, checks them (finite, unused)
        and zeroes the bucket; then every entry's positions (:meth:`_select_all`). What each entry ends with is what
        :meth:`_run_fused` gives it; only the rounds of Python per entry (62 for ResNet-18's
        bucket, most of them biases and norms) and the pipeline's own check go."""
        entries = group.entries
        assert isinstance(group.target, BufferTarget)
        buffer = group.target.buffers[0].view(-1)
        numels = [entry.numel for entry in entries]
        with self.stats.timer("select"):
            if self.feedback is not None:
                out, residual, has_residual = self.feedback.prepare_pieces([e.key for e in entries], numels, buffer)
            else:
                out = torch.empty(buffer.numel(), dtype=buffer.dtype, device=buffer.device)
                residual, has_residual = None, [False] * len(entries)
            finite, nonzero = kernels.compensate_and_check_segments(
                buffer.detach().numpy(), None if residual is None else residual.numpy(),
                np.array(has_residual, dtype=np.bool_), out.numpy(),
                ends=np.cumsum(numels, dtype=np.int64), zero_grad=True)
            group.target.zeroed = True  # every gradient was read out of the buffer, then zeroed
            group.finite = group.finite and finite
            if not group.finite:
                self._as_nonfinite(group, step)  # reads no gradient: they are zeros now
            else:
                used = nonzero.tolist()
                for entry, piece, entry_used in zip(entries, out.split(numels), used):
                    entry.unused = not entry_used
                    # an unused entry sends zeros and keeps its residual whole (_compensate reads no gradient)
                    entry.compensated = self._compensate(entry, True) if entry.unused else piece
                    entry.values = None
                self._select_all(group, step)
                if all(used):
                    group.compensated_flat = out
        self.stats.add("count_compensations", len(entries))
        self.stats.add("count_selections", len(entries))

    def _select_all(self, group: Group, step: int) -> None:
        """Every entry's positions: in one call where the sparsifier has one (positions that need
        no values), else entry by entry (:meth:`_select_one`)."""
        entries = group.entries
        selected = self.sparsifier.select_segments([e.numel for e in entries], step=step,
                                                   tensor_ids=[e.tensor_id for e in entries], device=group.device)
        if selected is None:
            selected = [self._select_one(entry, step) for entry in entries]
        for entry, indices in zip(entries, selected):
            entry.indices = indices

    def _select_pieces(self, group: Group, deferred: "frozenset[int]") -> "frozenset[int]":
        """The checked, used entries of a finite group that the sparsifier takes many at a time
        (:meth:`~gradwire.sparsify.Sparsifier.pieces_apply`: top-k's small tensors), compensated
        and selected in one call when there are several and they share one storage; their
        positions (empty: the per-entry loop takes every entry). The answer is each entry's own,
        as the loop would give it: only the rounds of Python per entry go (an FSDP module's 48
        pieces, a bucket's biases and norms)."""
        if not group.finite:
            return frozenset()
        chosen = [position for position, entry in enumerate(group.entries)
                  if position not in deferred and not entry.unused and self.sparsifier.pieces_apply(entry.grad)]
        if len(chosen) < 2:
            return frozenset()
        grads = [group.entries[position].grad for position in chosen]
        storage = grads[0].untyped_storage()
        if any(grad.untyped_storage().data_ptr() != storage.data_ptr() or grad.dtype != grads[0].dtype
               for grad in grads):
            return frozenset()
        source = torch.empty(0, dtype=grads[0].dtype, device=grads[0].device).set_(
            storage, 0, (storage.nbytes() // grads[0].element_size(),))
        numels = [grad.numel() for grad in grads]
        keys = [group.entries[position].key for position in chosen]
        if self.feedback is not None:
            out, residual, has_residual = self.feedback.prepare_pieces(keys, numels, grads[0])
        else:
            out = torch.empty(sum(numels), dtype=accumulation_dtype(grads[0]), device=grads[0].device)
            residual, has_residual = None, [False] * len(chosen)
        selected = self.sparsifier.select_compensated_pieces(
            source, starts=[grad.storage_offset() for grad in grads], numels=numels, residual=residual,
            has_residual=has_residual, out=out)
        for position, piece, (indices, values) in zip(chosen, out.split(numels), selected):
            entry = group.entries[position]
            entry.compensated, entry.indices, entry.values = piece, indices, values
        return frozenset(chosen)

    def _as_nonfinite(self, group: Group, step: int) -> None:
        """A deferred check found NaN/Inf: what :meth:`run` would have done had it known first
        (the pipeline's plan selects nothing for a per-rank support; a shared support selects
        the same value-independent positions on zeros)."""
        group.finite = False
        for entry in group.entries:
            entry.unused, entry.values = False, None
            if self.sparsifier.shared_support:
                entry.compensated = self._compensate(entry, False)
                entry.indices = self._select_one(entry, step)
            else:
                entry.compensated, entry.indices = None, None

    def _compensate(self, entry: Entry, finite: bool) -> torch.Tensor:
        if not finite or entry.unused:  # nothing of it is sent; its residual stays as it is
            return torch.zeros(entry.numel, dtype=accumulation_dtype(entry.grad), device=entry.grad.device)
        if self.feedback is not None:
            return self.feedback.compensate(entry.key, entry.grad)
        return entry.grad.reshape(-1).to(accumulation_dtype(entry.grad), copy=True)

    def _select_one(self, entry: Entry, step: int) -> torch.Tensor:
        if entry.unused and not self.sparsifier.shared_support:
            return torch.zeros(0, dtype=torch.int64, device=entry.compensated.device)
        return self.sparsifier.select(entry.compensated, step=step, tensor_id=entry.tensor_id)


def _zeroable(group: Group) -> bool:
    """Whether the group's entries tile one flat buffer the strategy will zero and sum into."""
    target = group.target
    if not isinstance(target, BufferTarget) or len(target.buffers) != 1 or not target.buffers[0].is_contiguous():
        return False
    offset = 0
    for entry in group.entries:
        if entry.offset != offset:
            return False
        offset += entry.numel
    return offset == target.numel
