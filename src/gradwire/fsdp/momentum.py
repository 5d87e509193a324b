"""1-bit Adam's exchange for FSDP2: after a warm-up, each rank sends its *momentum*, not its gradient.

Under AdamW, top-k of the gradient with error feedback trails plain FSDP2 by far more than the
bytes saved would suggest (docs/fsdp.md, "Top-k with AdamW"): a coordinate sent in bursts moves at a
fraction of Adam's rate. 1-bit Adam (Tang et al., 2021) freezes Adam's second moment ``v`` after a
warm-up, which makes the step linear in the momentum, and compresses the momentum itself with error
feedback. Here, with ``compress(..., momentum=b1)`` and :class:`MomentumAdamW`:

1. steps ``t <= N`` (``warmup_steps``): the reduce-scatter is exact and the optimizer is AdamW;
2. steps ``t > N``, on each rank ``w``, per FSDP module: ``m_w = b1 s_w + (1 - b1) g_w``, where
   ``s_w`` is what this rank sent for the module the step before (its *base*, sparse: the positions
   and the values receivers decoded; zeros at ``t = N + 1``); ``m_w`` goes through the module's
   compressed reduce-scatter in place of ``g_w``, error feedback included;
3. each owner's shard of the result is the mean of the ranks' sends: the exchanged momentum ``m``,
   which :class:`MomentumAdamW` applies with the frozen ``v``:
   ``p <- p (1 - lr wd) - lr m / (1 - b1^t) / (sqrt(v / (1 - b2^N)) + eps)``.

The mean of the bases is the exchanged momentum of the step before, so the mean of the ``m_w`` is
1-bit Adam's momentum update; only the selection is per rank (a rank holds only its shard of the
global momentum, but it knows what it sent). What error feedback holds back arrives later, whole,
because the step is linear in ``m``. A base is kept only when the step applied on every rank.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist

from ..core.checkpoint import communication_device, gather_to_root
from ..core.group import Group
from ..lifetime import wait_for


class MomentumBases:
    """What this rank sent per FSDP module on the last applied step (step 2's ``s_w``), sparse.

    Args:
        beta: ``b1`` in ``m_w = b1 s_w + (1 - b1) g_w``, in (0, 1).
    """

    def __init__(self, beta: float) -> None:
        self.beta = beta
        #: per module name: (positions in the module's flat gradient, int64; the values sent, float32)
        self.bases: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def nbytes(self) -> int:
        """Bytes the bases hold on this rank (positions and values of every module)."""
        return sum(p.numel() * p.element_size() + v.numel() * v.element_size() for p, v in self.bases.values())

    def blend(self, name: str, gradient: torch.Tensor) -> None:
        """``gradient <- (1 - b1) gradient + b1 s_w``, in place (``gradient``: the module's flat
        unsharded gradient as FSDP hands it over, any float dtype)."""
        gradient.mul_(1.0 - self.beta)
        base = self.bases.get(name)
        if base is not None:
            positions, values = base
            if positions.device != gradient.device:  # loaded from a checkpoint: moved once, then kept there
                positions, values = positions.to(gradient.device), values.to(gradient.device)
                self.bases[name] = (positions, values)
            gradient.index_add_(0, positions, values.to(gradient.dtype), alpha=self.beta)

    def record(self, name: str, group: Group) -> None:
        """Keep what this rank sent in ``group`` (its error-feedback updates: the positions each entry
        sent and the values receivers decoded) as the module's base; entries that sent nothing
        contribute nothing."""
        offsets = {entry.key: entry.offset for entry in group.entries}
        positions: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for key, _, indices, sent in group.feedback_updates:
            positions.append(indices.reshape(-1).to(torch.int64) + offsets[key])
            values.append(sent.reshape(-1).float())
        for keys, numels, _, flat_positions, sent in group.feedback_flat_updates:
            flat_positions = flat_positions.to(torch.int64)
            device = flat_positions.device
            starts = torch.tensor([0, *numels], dtype=torch.int64, device=device).cumsum(0)
            piece = torch.searchsorted(starts[1:], flat_positions, right=True)
            entry_offsets = torch.tensor([offsets[key] for key in keys], dtype=torch.int64, device=device)
            positions.append(flat_positions - starts[piece] + entry_offsets[piece])
            values.append(sent.reshape(-1).float())
        if positions:  # kept on the gradients' device: no copy to the host on the step's path
            self.bases[name] = (torch.cat(positions), torch.cat(values))
        else:
            self.bases.pop(name, None)

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        return {name: {"positions": positions.detach().cpu().clone(), "values": values.detach().cpu().clone()}
                for name, (positions, values) in self.bases.items()}

    def gathered_state_dicts(self, names: list[str], process_group: Optional[dist.ProcessGroup] = None
                             ) -> Optional[list[dict[str, dict[str, torch.Tensor]]]]:
        """Collective over ``process_group``: every rank's :meth:`state_dict` on its rank 0 (in
        group rank order), None on the other ranks. Tensors only, no pickling: the counts per
        module, then positions and values padded to the longest rank's total.

        Args:
            names: every FSDP module's name, alike on every rank (a module without a base is sent
                as absent, not as empty).
        """
        world = dist.get_world_size(process_group)
        if world == 1:
            return [self.state_dict()]
        rank, device = dist.get_rank(process_group), communication_device(process_group)
        bases = [self.bases.get(name) for name in names]
        counts = torch.tensor([-1 if base is None else base[0].numel() for base in bases], dtype=torch.int64)
        longest = counts.clamp(min=0).sum().reshape(1).to(device)
        wait_for(dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=process_group, async_op=True), None,
                 "AllReduce of the momentum bases' sizes")
        size = int(longest.item())
        positions = torch.zeros(size, dtype=torch.int64)
        values = torch.zeros(size, dtype=torch.float32)
        present = [base for base in bases if base is not None]
        if present:
            own = torch.cat([p.detach().cpu() for p, _ in present])
            positions[:own.numel()] = own
            values[:own.numel()] = torch.cat([v.detach().cpu().float() for _, v in present])
        root = dist.get_global_rank(process_group, 0) if process_group is not None else 0
        gathered = [gather_to_root(tensor.to(device), root, rank, world, process_group)
                    for tensor in (counts, positions, values)]
        if gathered[0] is None:
            return None
        out = []
        for rank_counts, rank_positions, rank_values in zip(*gathered):
            state, start = {}, 0
            for name, count in zip(names, rank_counts.tolist()):
                if count >= 0:
                    state[name] = {"positions": rank_positions[start: start + count].cpu().clone(),
                                   "values": rank_values[start: start + count].cpu().clone()}
                    start += count
            out.append(state)
        return out

    def load_state_dict(self, state: Any, numels: dict[str, int]) -> None:
        """Restore :meth:`state_dict` output; ``numels``: each module's flat gradient size.

        Raises:
            ValueError: a module this model does not have, or positions/values that do not fit it
                (nothing is changed then).
        """
        if not isinstance(state, dict):
            raise ValueError(f"momentum_bases must be a dict of module names, got {type(state).__name__}")
        loaded: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for name, base in state.items():
            if name not in numels:
                raise ValueError(f"momentum_bases: module {name!r} is not one of this model's FSDP modules")
            positions = base.get("positions") if isinstance(base, dict) else None
            values = base.get("values") if isinstance(base, dict) else None
            if not (isinstance(positions, torch.Tensor) and isinstance(values, torch.Tensor)
                    and positions.dtype == torch.int64 and values.is_floating_point()
                    and positions.dim() == values.dim() == 1 and positions.numel() == values.numel()):
                raise ValueError(f"momentum_bases[{name!r}]: need 1-D int64 positions and float values of one length")
            if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= numels[name]):
                raise ValueError(f"momentum_bases[{name!r}]: positions outside the module's {numels[name]} elements")
            if not bool(torch.isfinite(values).all()):
                raise ValueError(f"momentum_bases[{name!r}]: non-finite values")
            loaded[name] = (positions.clone().cpu(), values.float().clone().cpu())
        self.bases = loaded


class MomentumAdamW(torch.optim.Optimizer):
    """AdamW for the warm-up, then 1-bit Adam's step on the momentum the reduce-scatter exchanged
    (module docstring, steps 1 and 3). Build it on the sharded parameters of the model
    ``state`` compresses; call ``step()`` once per backward.

    Args:
        params: the model's parameters (after ``fully_shard``).
        state: what ``gradwire.fsdp.compress(..., momentum=b1)`` returned: its ``warmup_steps`` is
            N, its ``momentum`` is ``b1``.
        lr, weight_decay, eps: as ``torch.optim.AdamW``.
        beta2: ``b2``, the second moment's decay during the warm-up.

    A coordinate that had no gradient during the warm-up (an embedding row of a token not yet seen)
    would keep ``v = 0``, and a momentum there would later move it by ``lr m / eps``. So when ``v``
    freezes, such coordinates take the mean ``v`` of the other coordinates of their tensor (of this
    rank's shard of it): they then move like a typical coordinate of the tensor. Coordinates that had
    gradients keep their own ``v`` (1-bit Adam's rule, unchanged).

    Raises:
        ValueError: ``state`` was made without ``momentum=``, or its warm-up is 0 (``v`` would be
            frozen at zero); an invalid ``lr``, ``weight_decay``, ``eps`` or ``beta2``.
        RuntimeError (from :meth:`step`): the optimizer's steps and the reduce-scatter's rounds
            disagree (a step without a backward, or several backwards per step); or every round of
            the warm-up was skipped, leaving ``v`` zero.
    """

    def __init__(self, params: Iterable[Any], state: Any, *, lr: float = 1e-3, weight_decay: float = 1e-2,
                 eps: float = 1e-8, beta2: float = 0.999) -> None:
        bases = getattr(state, "momentum_bases", None)
        if bases is None:
            raise ValueError("MomentumAdamW needs the state of gradwire.fsdp.compress(..., momentum=b1): without "
                             "momentum= the reduce-scatter sends gradients, which this optimizer would take for "
                             "momenta")
        warmup = state.config.warmup_steps
        if warmup < 1:
            raise ValueError("MomentumAdamW freezes Adam's second moment after compress(warmup_steps=N); N must be "
                             f">= 1, got {warmup}")
        for name, value, low in (("lr", lr, 0.0), ("weight_decay", weight_decay, 0.0), ("eps", eps, 0.0)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= low):
                raise ValueError(f"MomentumAdamW: {name}={value!r} must be a finite number >= {low}")
        if not (isinstance(beta2, (int, float)) and 0.0 <= beta2 < 1.0):
            raise ValueError(f"MomentumAdamW: beta2={beta2!r} must be in [0, 1)")
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, eps=eps, betas=(bases.beta, beta2),
                                      steps_taken=0, steps_applied=0, warmup_applied=0))
        self.compression = state
        self.freeze_after = warmup

    @property
    def steps_taken(self) -> int:
        """Steps taken, one per round of the reduce-scatter, skipped rounds included (kept in the
        parameter group, so ``state_dict()`` saves it). The warm-up ends by this count, as the
        exchange's does."""
        return int(self.param_groups[0]["steps_taken"])

    @steps_taken.setter
    def steps_taken(self, value: int) -> None:
        for group in self.param_groups:
            group["steps_taken"] = value

    @property
    def steps_applied(self) -> int:
        """Steps that moved the parameters (skipped rounds excluded): Adam's ``t`` in the bias
        corrections, as ``torch.optim.AdamW`` does not count a step a gradient scaler skips."""
        return int(self.param_groups[0].get("steps_applied", self.steps_taken))

    @property
    def warmup_applied(self) -> int:
        """Warm-up steps that moved ``v``: the count its bias correction is frozen at."""
        return int(self.param_groups[0].get("warmup_applied", min(self.steps_taken, self.freeze_after)))

    def _count_applied(self, warm: bool) -> None:
        applied, warmup_applied = self.steps_applied + 1, self.warmup_applied + int(warm)
        for group in self.param_groups:
            group["steps_applied"], group["warmup_applied"] = applied, warmup_applied

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.compression.iteration != self.steps_taken + 1:
            raise RuntimeError(f"MomentumAdamW: step {self.steps_taken + 1}, but the reduce-scatter has completed "
                               f"{self.compression.iteration} rounds; call step() once after each backward")
        self.steps_taken += 1
        if self.compression.last_action == "skip":  # the round gave zeros on every rank: no step, m and v kept
            return loss
        warm = self.steps_taken <= self.freeze_after  # by rounds: the exchange sends momenta from round N + 1 on
        if not warm and self.warmup_applied == 0:  # every rank skipped the same rounds, so every rank raises
            raise RuntimeError(f"MomentumAdamW: every round of the warm-up ({self.freeze_after} steps) was skipped "
                               "(non-finite gradients), so Adam's second moment is zero and cannot be frozen; "
                               "restart from a checkpoint with a longer warm-up")
        self._count_applied(warm)
        one_bit_adam_groups(self, t=self.steps_applied, v_steps=self.warmup_applied, warm=warm)
        return loss


@torch.no_grad()
def one_bit_adam_groups(optimizer: torch.optim.Optimizer, *, t: int, v_steps: int, warm: bool) -> None:
    """:func:`one_bit_adam_step` for every parameter with a gradient in ``optimizer``'s groups
    (each group's ``lr``, ``weight_decay``, ``betas``, ``eps``), its state in ``optimizer.state``."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                one_bit_adam_step(p, p.grad, optimizer.state[p], t=t, v_steps=v_steps, warm=warm, lr=group["lr"],
                                  weight_decay=group["weight_decay"], betas=group["betas"], eps=group["eps"])


@torch.no_grad()
def one_bit_adam_step(p: torch.Tensor, grad: torch.Tensor, state: dict, *, t: int, v_steps: int, warm: bool,
                      lr: float, weight_decay: float, betas: tuple[float, float], eps: float) -> None:
    """One parameter's applied step ``t`` (1-based) of :class:`MomentumAdamW`, in place.

    Args:
        p: the parameter (any shape; a DTensor shard under FSDP).
        grad: like ``p``: the gradient while ``warm``, then the exchanged momentum.
        state: the parameter's optimizer state; ``"m"`` and ``"v"`` (like ``p``) are created zero.
        t: this step's number among the applied ones (``m``'s bias correction).
        v_steps: the warm-up steps that moved ``v``, this one included (``v``'s bias correction).
        warm: a warm-up step (AdamW); otherwise ``v`` is frozen and ``grad`` is the momentum.
        lr, weight_decay, betas, eps: as ``torch.optim.AdamW``.
    """
    beta1, beta2 = betas
    if not state:
        state["m"], state["v"] = torch.zeros_like(p), torch.zeros_like(p)
    m, v = state["m"], state["v"]
    p.mul_(1.0 - lr * weight_decay)
    if warm:
        m.lerp_(grad, 1.0 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    else:
        if t == v_steps + 1:  # the first frozen step
            _fill_unseen(v)
        m.copy_(grad)  # the exchanged momentum
    denominator = (v / (1.0 - beta2 ** max(v_steps, 1))).sqrt_().add_(eps)
    p.addcdiv_(m, denominator, value=-lr / (1.0 - beta1 ** t))


def _fill_unseen(v: torch.Tensor) -> None:
    """Where ``v`` is 0 (no gradient through the warm-up), the mean of its positive entries, in
    place; over this rank's shard for a sharded (DTensor) parameter, so no collective runs."""
    local = v.to_local() if hasattr(v, "to_local") else v
    seen = local > 0
    count = int(seen.sum())
    if 0 < count < local.numel():
        local.masked_fill_(~seen, float(local.sum()) / count)
