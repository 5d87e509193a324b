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

from typing import Hashable

import torch


def accumulation_dtype(grad: torch.Tensor) -> torch.dtype:
    """Residuals and compensated gradients are float32, or float64 for float64 gradients."""
    return torch.float64 if grad.dtype == torch.float64 else torch.float32


class ErrorFeedback:
    """Residual memory per parameter. Residuals are float32 (or float64 for float64 gradients)
    of the parameter's numel, on the gradient's device."""

    def __init__(self) -> None:
        self.residuals: dict[Hashable, torch.Tensor] = {}

    def compensate(self, key: Hashable, grad: torch.Tensor) -> torch.Tensor:
        """``grad + residual`` as a new flat tensor (float32/float64) of ``grad.numel()`` elements."""
        flat = grad.reshape(-1).to(accumulation_dtype(grad))  # no copy when already float32
        residual = self.residuals.get(key)
        return flat + residual if residual is not None else flat.clone()

    def update(self, key: Hashable, compensated: torch.Tensor, indices: torch.Tensor, received: torch.Tensor) -> None:
        """Keep ``compensated - received`` where ``received`` is ``values`` at ``indices`` and zero elsewhere.

        ``compensated`` is consumed (modified in place and stored).
        """
        compensated[indices] -= received.to(compensated.dtype)
        self.residuals[key] = compensated

    def clear(self, key: Hashable) -> None:
        """Everything was sent (dense step): nothing is left over."""
        self.residuals.pop(key, None)

    def norm(self) -> float:
        """L2 norm over all residuals (0.0 when empty)."""
        if not self.residuals:
            return 0.0
        return float(torch.sqrt(sum(torch.sum(r.double() ** 2).cpu() for r in self.residuals.values())))

    def state_dict(self, names: dict[Hashable, str]) -> dict[str, torch.Tensor]:
        return {names[key]: value.detach().cpu().clone() for key, value in self.residuals.items() if key in names}

    def load_state_dict(self, state: dict[str, torch.Tensor], keys: dict[str, Hashable], device_of: dict[Hashable, torch.device]) -> None:
        self.residuals = {keys[name]: value.to(device_of[keys[name]]).clone() for name, value in state.items()}


class MomentumCorrection(ErrorFeedback):
    """DGC momentum correction with factor masking. ``momentum`` in [0, 1)."""

    def __init__(self, momentum: float = 0.9) -> None:
        super().__init__()
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum={momentum} must be in [0, 1)")
        self.momentum = momentum
        self.velocities: dict[Hashable, torch.Tensor] = {}

    def compensate(self, key: Hashable, grad: torch.Tensor) -> torch.Tensor:
        flat = grad.reshape(-1).to(accumulation_dtype(grad), copy=True)
        velocity = self.velocities.get(key)
        if velocity is not None:
            flat.add_(velocity, alpha=self.momentum)
        self.velocities[key] = flat.clone()
        residual = self.residuals.get(key)
        if residual is not None:
            flat += residual
        return flat

    def update(self, key: Hashable, compensated: torch.Tensor, indices: torch.Tensor, received: torch.Tensor) -> None:
        self.velocities[key][indices] = 0  # factor masking: sent momentum must not be sent again
        super().update(key, compensated, indices, received)

    def clear(self, key: Hashable) -> None:
        super().clear(key)
        self.velocities.pop(key, None)
