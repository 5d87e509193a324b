"""Error feedback: what a step does not send is kept and added to the next step's gradient.

``compensated = grad + residual``; after sending, ``residual = compensated - received`` where
``received`` is exactly what the other ranks reconstruct (zero off the sent positions). So
``received + new residual == grad + old residual``; bit for bit when the value codec is lossless.

:class:`MomentumCorrection` is DGC's variant for momentum SGD: the momentum is accumulated
locally before sparsification (``u = m u + g``, ``v = v + u``) and both are zeroed at the sent
positions ("factor masking"), so the optimizer should then run *without* momentum.

Memory is keyed by a stable key per parameter (never a bucket index: DDP rebuilds its buckets
after the first iteration).
"""

from __future__ import annotations

import math
from typing import Hashable, Optional

import torch

from .scatter import scatter_add


def accumulation_dtype(grad: torch.Tensor) -> torch.dtype:
    """Residuals and compensated gradients are float32, or float64 for float64 gradients."""
    return torch.float64 if grad.dtype == torch.float64 else torch.float32


class ErrorFeedback:
    """Residual memory per parameter. Residuals are float32 (or float64 for float64 gradients)
    of the parameter's numel, on the gradient's device.

    The compensated gradient is written into a spare buffer per parameter (last step's
    residual, once it is replaced) rather than a fresh tensor: a fresh 45 MB tensor per step
    costs more in page faults than the addition itself (measured here: 40 ms against 12 ms for
    ResNet-18's gradients).
    """

    def __init__(self, *, storage_dtype: Optional[torch.dtype] = None, spares: bool = True,
                 decay: float = 1.0) -> None:
        self.residuals: dict[Hashable, torch.Tensor] = {}
        #: β of ``e <- β (x - sent)``: 1 is plain error feedback; below 1 what is owed fades, so a
        #: coordinate's debt cannot grow into a burst (with Adam a burst inflates the second moment
        #: and shrinks the coordinate's later steps); 0 drops what was not sent
        self.decay = float(decay)
        self._spares: dict[Hashable, torch.Tensor] = {}
        #: residuals are kept in this dtype (None: the accumulation dtype); bfloat16 halves their
        #: memory (FSDP: 2 n instead of 4 n bytes per rank), at the cost of rounding what is owed
        self.storage_dtype = storage_dtype
        #: keep last step's residual as the next compensation buffer (speed) or free it (memory)
        self.spares = spares

    def _buffer(self, key: Hashable, like: torch.Tensor) -> torch.Tensor:
        """A flat accumulation-dtype tensor of ``like.numel()`` elements to write the compensated gradient into."""
        dtype = accumulation_dtype(like)
        spare = self._spares.pop(key, None)
        if spare is not None and spare.numel() == like.numel() and spare.dtype == dtype and spare.device == like.device:
            return spare
        return torch.empty(like.numel(), dtype=dtype, device=like.device)

    def prepare(self, key: Hashable, grad: torch.Tensor) -> "tuple[torch.Tensor, torch.Tensor | None]":
        """The buffer ``grad + residual`` goes into (flat, float32/float64, ``grad.numel()``
        elements, owned by the caller until :meth:`update` or :meth:`clear`) and the residual to
        add (None: nothing owed yet), for a caller that computes the sum itself (fused with a scan)."""
        out = self._buffer(key, grad)
        return out, self._readable(key, out.dtype)

    def prepare_pieces(self, keys: "list[Hashable]", numels: "list[int]", like: torch.Tensor
                       ) -> "tuple[torch.Tensor, torch.Tensor | None, list[bool]]":
        """:meth:`prepare` for many keys at once, laid end to end (a many-pieces selection,
        :meth:`~gradwire.sparsify.Sparsifier.select_compensated_pieces`).

        Returns the flat buffer the compensated pieces go into (``sum(numels)`` elements of
        ``like``'s accumulation dtype, on its device; owned by the caller until :meth:`update`,
        which keeps views of it), their residuals end to end (None: no key owes anything) and
        which key has one. Once a round has kept views of one buffer, the next round finds them
        end to end: its residuals are a view, not a copy, and the buffer of the round before
        (their spares) is reused."""
        dtype = accumulation_dtype(like)
        total = sum(numels)
        spares = [self._spares.pop(key, None) for key in keys]
        out = _end_to_end(spares, numels, dtype, like.device)
        if out is None:
            out = torch.empty(total, dtype=dtype, device=like.device)
        residuals = [self._readable(key, dtype) for key in keys]
        has = [residual is not None for residual in residuals]
        if not any(has):
            return out, None, has
        flat = _end_to_end(residuals, numels, dtype, like.device)
        if flat is None:  # one copy (the first round, a changed layout, a key that was unused)
            flat = torch.cat([r if r is not None else torch.empty(n, dtype=dtype, device=like.device)
                              for r, n in zip(residuals, numels)])
        return out, flat, has

    def compensate(self, key: Hashable, grad: torch.Tensor) -> torch.Tensor:
        """``grad + residual`` as a flat tensor (float32/float64) of ``grad.numel()`` elements,
        owned by the caller until :meth:`update` or :meth:`clear`; ``grad`` is not modified."""
        flat = grad.reshape(-1)
        out, residual = self.prepare(key, flat)
        if residual is None:
            out.copy_(flat)
        else:
            torch.add(flat, residual, out=out)
        return out

    def _readable(self, key: Hashable, dtype: torch.dtype) -> "torch.Tensor | None":
        """The residual in ``dtype`` (a converted copy when it is stored in another one, so that
        sums with it are never computed in bfloat16)."""
        residual = self.residuals.get(key)
        return residual if residual is None or residual.dtype == dtype else residual.to(dtype)

    def _keep(self, key: Hashable, residual: torch.Tensor) -> None:
        previous = self.residuals.get(key)
        if self.storage_dtype is not None and residual.dtype != self.storage_dtype:
            residual = residual.to(self.storage_dtype)
        self.residuals[key] = residual
        if self.spares and previous is not None and previous is not residual and previous.dtype != self.storage_dtype:
            self._spares[key] = previous

    def update(self, key: Hashable, compensated: torch.Tensor, indices: torch.Tensor, received: torch.Tensor) -> None:
        """Keep ``compensated - received`` where ``received`` is ``values`` at ``indices`` and zero elsewhere.

        ``compensated`` is consumed (modified in place and stored).
        """
        self._subtract_sent(compensated, indices, received)
        self._keep(key, compensated)

    def update_pieces(self, keys: "list[Hashable]", numels: "list[int]", compensated: torch.Tensor,
                      positions: torch.Tensor, received: torch.Tensor) -> None:
        """:meth:`update` for many keys whose compensated gradients lie end to end in one flat
        tensor (``numels`` each, in order): one scatter over it, then each key keeps its view.

        Args:
            keys: the pieces' keys, in order.
            numels: their element counts (summing to ``compensated.numel()``).
            compensated: (sum of numels,) float32/float64, consumed (modified in place, kept as views).
            positions: (k,) int64, distinct, in ``compensated``'s flat space.
            received: (k,) what was received there (cast to ``compensated``'s dtype).
        """
        self._subtract_sent(compensated, positions, received)
        for key, piece in zip(keys, compensated.split(numels)):
            self._keep(key, piece)

    def _subtract_sent(self, compensated: torch.Tensor, positions: torch.Tensor, received: torch.Tensor) -> None:
        """``compensated[positions] -= received``, then the decay, in place (positions distinct)."""
        # one fused scatter: the same bits as ``compensated[positions] -= received``, without its
        # gather and separate subtraction
        scatter_add(compensated, positions, received.to(compensated.dtype), alpha=-1)
        if self.decay != 1.0:  # an extra pass only for a decaying memory
            compensated.mul_(self.decay)

    def held_copy(self, residual: torch.Tensor, accumulate: torch.dtype, *, owned: bool = False) -> torch.Tensor:
        """A copy of a new residual in the dtype it will be stored in, to hold until the round's
        agreement and then :meth:`replace` with: a round that waits for other groups (FSDP2: every
        module of a step) holds bfloat16 residuals at half the bytes.

        Args:
            residual: flat (read only).
            accumulate: the residuals' dtype when no ``storage_dtype`` is set (float32/float64).
            owned: ``residual`` is the caller's own (a view of a tensor nothing else reads or
                writes, e.g. an exchange's result): held as it is when it is in that dtype already.

        Returns:
            ``residual.numel()`` elements in ``storage_dtype`` (or ``accumulate``): a new tensor,
            or with ``owned`` ``residual`` itself where no conversion is needed.
        """
        return residual.to(self.storage_dtype or accumulate, copy=not owned)

    def replace(self, key: Hashable, residual: torch.Tensor) -> None:
        """Keep ``residual`` (flat) for ``key``: an exchange that computed the new residual whole
        (the hierarchical one keeps each rank's shard of the node's sum)."""
        if self.decay != 1.0:  # decayed in at least float32, then stored
            residual = residual.to(torch.promote_types(residual.dtype, torch.float32)) * self.decay
        self._keep(key, residual)

    def residual(self, key: Hashable) -> "torch.Tensor | None":
        """The residual kept for ``key`` (flat), or None; read-only by convention."""
        return self.residuals.get(key)

    def clear(self, key: Hashable) -> None:
        """Everything was sent (dense step): nothing is left over."""
        self.residuals.pop(key, None)

    def norm(self) -> float:
        """L2 norm over all residuals (0.0 when empty), for ``stats()``.

        One fused read of every residual (``torch._foreach_norm``, accumulated in float32, float64
        residuals in float64) and one host sync per device and dtype. Front-ends and training
        loops call ``stats()`` every step, so this must not cost more than a read: the earlier
        float64 copy-square-sum took ~3 passes and ~33 ms a step for the 4.7M MLP on 2 cores, as
        much as the step itself, and inflated ``auto``'s measured sparse rounds, which run it,
        against dense ones, which have no residuals. The per-residual norms' squares are added
        exactly (``math.fsum``), so the norm does not depend on the order the residuals were kept
        in: a state loaded from a checkpoint (in the checkpoint's order) reports the same norm."""
        if not self.residuals:
            return 0.0
        # grouped by device and accumulation dtype (float32, or float64 for float64 residuals)
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for residual in self.residuals.values():
            accumulate = torch.promote_types(residual.dtype, torch.float32)
            groups.setdefault((residual.device, accumulate), []).append(residual)
        squares: list[float] = []
        for (_, accumulate), residuals in groups.items():
            norms = torch._foreach_norm(residuals, 2, dtype=accumulate)
            squares.extend(value * value for value in torch.stack(norms).double().tolist())
        return math.sqrt(math.fsum(squares))

    def state_dict(self, names: dict[Hashable, str]) -> dict[str, torch.Tensor]:
        return {names[key]: value.detach().cpu().clone() for key, value in self.residuals.items() if key in names}

    def load_state_dict(self, state: dict[str, torch.Tensor], keys: dict[str, Hashable],
                        device_of: dict[Hashable, torch.device]) -> None:
        self.residuals = {keys[name]: value.to(device_of[keys[name]]).clone() for name, value in state.items()}
        self._spares = {}


def _end_to_end(tensors: "list[torch.Tensor | None]", numels: "list[int]", dtype: torch.dtype,
                device: torch.device) -> "torch.Tensor | None":
    """One flat view over ``tensors`` when they lie end to end in one storage, in order, with these
    sizes, dtype and device; else None."""
    first = tensors[0] if tensors else None
    if first is None or first.dtype != dtype or first.device != device:
        return None
    storage, itemsize, offset = first.untyped_storage(), first.element_size(), first.storage_offset()
    at = offset
    for tensor, numel in zip(tensors, numels):
        if (tensor is None or tensor.numel() != numel or tensor.dtype != dtype or not tensor.is_contiguous()
                or tensor.untyped_storage().data_ptr() != storage.data_ptr() or tensor.storage_offset() != at):
            return None
        at += numel
    if at * itemsize > storage.nbytes():
        return None
    return torch.empty(0, dtype=dtype, device=device).set_(storage, offset, (at - offset,))


class MomentumCorrection(ErrorFeedback):
    """DGC momentum correction with factor masking. ``momentum`` in [0, 1)."""

    def __init__(self, momentum: float = 0.9, *, spares: bool = True) -> None:
        super().__init__(spares=spares)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum={momentum} must be in [0, 1)")
        self.momentum = momentum
        self.velocities: dict[Hashable, torch.Tensor] = {}

    def compensate(self, key: Hashable, grad: torch.Tensor) -> torch.Tensor:
        flat = grad.reshape(-1)
        velocity = self.velocities.get(key)
        if velocity is None:
            velocity = flat.to(accumulation_dtype(grad), copy=True)
            self.velocities[key] = velocity
        else:
            torch.add(flat, velocity, alpha=self.momentum, out=velocity)  # u = m u + g, in place
        out = self._buffer(key, flat)
        residual = self.residuals.get(key)
        if residual is None:
            out.copy_(velocity)
        else:
            torch.add(velocity, residual, out=out)
        return out

    def update(self, key: Hashable, compensated: torch.Tensor, indices: torch.Tensor, received: torch.Tensor) -> None:
        self.velocities[key][indices] = 0  # factor masking: sent momentum must not be sent again
        super().update(key, compensated, indices, received)

    def clear(self, key: Hashable) -> None:
        super().clear(key)
        self.velocities.pop(key, None)

    def update_pieces(self, keys: "list[Hashable]", numels: "list[int]", compensated: torch.Tensor,
                      positions: torch.Tensor, received: torch.Tensor) -> None:
        # the selection never lays momentum-corrected entries end to end (Selection.segments_apply)
        raise NotImplementedError("momentum correction keeps its residuals entry by entry (update)")

    def load_velocities(self, velocities: dict[Hashable, torch.Tensor]) -> None:
        """Restore checkpointed velocities (flat, already checked and on the gradients' device)."""
        self.velocities = {key: value.clone() for key, value in velocities.items()}
