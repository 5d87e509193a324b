"""The outer step's arithmetic, shared by the :class:`~.diloco.DiLoCo` front-end and the simulator.

One :class:`OuterState` per rank (per simulated worker) holds the *global* parameters θ: a float32
flat buffer per fragment, whatever the model's dtype, and the outer optimizer over them. A sync of
fragment f is (docs/local-steps.md tells the whole rule):

1. :meth:`OuterState.pseudo_gradient`: ``Δ = θ_f - θ_local,f`` in float32 (local minus global would
   flip the sign the outer optimizer expects: torchft PR #233);
2. :func:`feedback_input`: with an error-feedback decay β < 1, ``Δ - (1 - β) e`` is what the core
   compensates, so that the core's ``+ e`` yields SparseLoCo's ``Δ + β e`` (β = 1: plain error
   feedback, the core's rule unchanged);
3. the exchange (the core's :class:`~gradwire.core.pipeline.Pipeline` over a :func:`fragment_group`,
   or the simulator's in-process twin) averages the compressed Δ̂ in place;
4. :meth:`OuterState.apply`: the outer optimizer steps on θ_f with the average as its gradient;
5. :meth:`OuterState.merge`: ``θ_local,f <- α θ_local,f + (1 - α) θ_f`` (α = 0 without overlap:
   every worker restarts from the global parameters), or with an overlap's carrying merge
   ``θ_local,f <- θ_f + (θ_local,f - θ_local,f at the sync's start)``; with ``unsent="model"``,
   :func:`unsent_to_model` merges towards ``θ_f - β e`` instead, ``e`` being this rank's residual
   of the sync (what of its Δ the others did not receive), and empties the residual: the model
   now holds what was not sent, so its next Δ carries it again.

Every rank holds the same θ and the same outer optimizer state, so every rank applying the same
average ends with bit-identical global parameters.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Optional, Sequence

import torch

from ..core.feedback import ErrorFeedback
from ..core.group import BufferTarget, Entry, Group

#: builds the outer optimizer over the global parameters (one float32 tensor per model parameter)
OuterOptimizerFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


def sgd_factory(lr: float, momentum: float, nesterov: bool) -> OuterOptimizerFactory:
    """DiLoCo's default outer optimizer: SGD (with Nesterov momentum when ``nesterov`` and ``momentum`` > 0).

    Raises:
        ValueError: ``lr`` <= 0 or ``momentum`` outside [0, 1).
    """
    if not (isinstance(lr, (int, float)) and 0 < lr < float("inf")):
        raise ValueError(f"outer_lr={lr!r} must be a number > 0")
    if not (isinstance(momentum, (int, float)) and 0 <= momentum < 1):
        raise ValueError(f"outer_momentum={momentum!r} must be in [0, 1)")

    def build(parameters: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(parameters, lr=lr, momentum=momentum, nesterov=bool(nesterov) and momentum > 0)

    return build


class OuterState:
    """Global parameters per fragment and the outer optimizer over them.

    Args:
        parameters: the model's (local) parameters, in a fixed order (every rank the same).
        fragments: per fragment, ascending indices into ``parameters`` (each index in exactly one).
        optimizer_factory: builds the outer optimizer over the global parameters, one float32
            ``nn.Parameter`` per model parameter, each a view into its fragment's flat buffer.

    ``global_flat[f]`` is fragment f's θ, float32 (n_f,); :meth:`capture` sets it from the model.
    """

    def __init__(self, parameters: Sequence[torch.Tensor], fragments: Sequence[Sequence[int]],
                 optimizer_factory: OuterOptimizerFactory) -> None:
        self.parameters = list(parameters)
        self.fragments = [list(f) for f in fragments]
        self.offsets: list[list[int]] = []
        self.global_flat: list[torch.Tensor] = []
        self.global_views: list[list[torch.nn.Parameter]] = []
        for members in self.fragments:
            offsets, position = [], 0
            for index in members:
                offsets.append(position)
                position += self.parameters[index].numel()
            device = self.parameters[members[0]].device
            flat = torch.zeros(position, dtype=torch.float32, device=device)
            views = [torch.nn.Parameter(flat[o: o + self.parameters[i].numel()].view(self.parameters[i].shape),
                                        requires_grad=False)
                     for i, o in zip(members, offsets)]
            self.offsets.append(offsets)
            self.global_flat.append(flat)
            self.global_views.append(views)
        every = [view for views in self.global_views for view in views]
        for view in every:
            view.requires_grad_(True)  # optimizers only take tensors that could have a gradient
        self.optimizer = optimizer_factory(every)
        #: per fragment whose overlapped sync is in flight with the carrying merge: θ_local,f as the
        #: sync started (float32, fragment-flat)
        self.starts: dict[int, torch.Tensor] = {}
        self.capture()

    def numel(self, fragment: int) -> int:
        return self.global_flat[fragment].numel()

    @torch.no_grad()
    def capture(self) -> None:
        """θ := the model's parameters (at construction, and when the synchronous warm-up ends)."""
        for members, views in zip(self.fragments, self.global_views):
            for index, view in zip(members, views):
                view.copy_(self.parameters[index])

    @torch.no_grad()
    def pseudo_gradient(self, fragment: int, out: torch.Tensor, keep_start: bool = False) -> torch.Tensor:
        """Step 1: ``out = θ_f - θ_local,f`` (float32, fragment-flat), returned.

        ``keep_start``: also keep a float32 copy of θ_local,f in :attr:`starts` (the carrying merge
        of an overlapped sync subtracts it, :meth:`merge`)."""
        if keep_start:
            self.starts[fragment] = torch.cat([self.parameters[i].detach().reshape(-1).to(torch.float32)
                                               for i in self.fragments[fragment]])
        for index, offset, view in zip(self.fragments[fragment], self.offsets[fragment], self.global_views[fragment]):
            local = self.parameters[index]
            torch.sub(view.reshape(-1), local.reshape(-1).to(torch.float32), out=out[offset: offset + local.numel()])
        return out

    def apply(self, fragment: int, averaged: torch.Tensor) -> None:
        """Step 4: one outer-optimizer step on fragment ``fragment`` with ``averaged`` (float32,
        fragment-flat) as its gradient; other fragments' parameters and optimizer state are untouched
        (their gradient is None)."""
        for index, offset, view in zip(self.fragments[fragment], self.offsets[fragment], self.global_views[fragment]):
            view.grad = averaged[offset: offset + view.numel()].view(view.shape)
        self.optimizer.step()
        for view in self.global_views[fragment]:
            view.grad = None

    @torch.no_grad()
    def average(self, fragment: int, averaged: torch.Tensor) -> None:
        """A forced sync's step 4: ``θ_f <- θ_f - averaged`` (the workers' models averaged: outer lr 1,
        no momentum), the outer optimizer's state untouched. A sync forced mid-period (before an
        evaluation or a save) is no outer step: through the optimizer it would add one more
        momentum step of a full period's size, even for a fragment with nothing new (two 4-fragment
        runs equal up to their last sync ended at 1.3510 through the optimizer and 1.3159 with
        this average, docs/local-steps.md)."""
        self.global_flat[fragment].sub_(averaged)

    @torch.no_grad()
    def merge(self, fragment: int, alpha: float = 0.0,
              held: Optional[Sequence[Optional[torch.Tensor]]] = None, carry: bool = False) -> None:
        """Step 5: ``θ_local,f <- α θ_local,f + (1 - α) (θ_f - held)`` (α = 0: a copy of the target),
        or with ``carry`` ``θ_local,f <- (θ_f - held) + (θ_local,f - start_f)``: the inner steps
        taken while the sync was in flight are kept whole on top of the new θ (their progress is
        then part of the next Δ; nothing is mixed away). ``start_f`` is the copy
        :meth:`pseudo_gradient` kept (``keep_start``), dropped here; without one it is a plain copy.

        Args:
            fragment: f.
            alpha: the mixing weight of the local parameters, in [0, 1] (ignored with ``carry``).
            held: per parameter of the fragment, a flat float32 tensor to keep back from θ (None:
                nothing), as :func:`unsent_to_model` passes this rank's residuals.
            carry: keep the local progress since the sync's start instead of mixing.
        """
        start = self.starts.pop(fragment, None)
        for position, (index, offset, view) in enumerate(zip(self.fragments[fragment], self.offsets[fragment],
                                                              self.global_views[fragment])):
            local = self.parameters[index]
            target = view
            if held is not None and held[position] is not None:
                target = view - held[position].view(view.shape)  # type: ignore[union-attr]
            if carry and start is not None:
                progress = local.to(torch.float32) - start[offset: offset + local.numel()].view(local.shape)
                local.copy_(target + progress)
            elif alpha == 0.0 or carry:
                local.copy_(target)
            else:
                local.copy_(torch.lerp(target, local.to(torch.float32), alpha))

    def state_dict(self, names: Sequence[str]) -> dict[str, Any]:
        """θ by parameter name (CPU float32 copies) and the outer optimizer's state."""
        state: dict[str, Any] = {}
        for members, views in zip(self.fragments, self.global_views):
            for index, view in zip(members, views):
                state[names[index]] = view.detach().cpu().clone()
        return {"global": state, "outer_optimizer": self.optimizer.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any], names: Sequence[str]) -> None:
        """Restore :meth:`state_dict` output (checked by the caller)."""
        for members, views in zip(self.fragments, self.global_views):
            for index, view in zip(members, views):
                view.copy_(state["global"][names[index]])
        self.optimizer.load_state_dict(state["outer_optimizer"])


def fragment_group(delta: torch.Tensor, parameters: Sequence[torch.Tensor], members: Sequence[int],
                   offsets: Sequence[int], keys: Sequence[Hashable], tensor_ids: Sequence[int],
                   divisor: float) -> Group:
    """The core's :class:`~gradwire.core.group.Group` over one fragment's flat Δ buffer: one entry per
    parameter (a view of ``delta``; residuals keyed by ``keys``), reduced to the mean (``divisor``)."""
    group = Group(BufferTarget([delta]), divisor=divisor)
    for index, offset in zip(members, offsets):
        numel = parameters[index].numel()
        group.entries.append(Entry(keys[index], tensor_ids[index], delta[offset: offset + numel], offset))
    return group


@torch.no_grad()
def feedback_input(delta: torch.Tensor, feedback: Optional[ErrorFeedback], decay: float,
                   members: Sequence[int], offsets: Sequence[int], keys: Sequence[Hashable]) -> None:
    """Step 2, in place: ``delta -= (1 - decay) e`` per parameter that holds a residual ``e``, so that
    the core's compensation ``delta + e`` equals SparseLoCo's ``Δ + β e`` (``decay`` = β; nothing to
    do at β = 1 or without error feedback)."""
    if feedback is None or decay == 1.0:
        return
    for index, offset in zip(members, offsets):
        residual = feedback.residual(keys[index])
        if residual is not None:
            delta[offset: offset + residual.numel()].add_(residual.to(delta.dtype), alpha=-(1.0 - decay))


def unsent_to_model(state: OuterState, fragment: int, feedback: Optional[ErrorFeedback], keys: Sequence[Hashable],
                    alpha: float, decay: float, carry: bool = False) -> None:
    """Step 5 with ``unsent="model"``: ``θ_local,f <- α θ_local,f + (1 - α) (θ_f - β e)`` per parameter,
    ``e`` its residual after the sync, which is then dropped from ``feedback``: the model holds it.

    Args:
        state: this rank's :class:`OuterState` (after :meth:`OuterState.apply`).
        fragment: f.
        feedback: this rank's error-feedback memory (None: nothing held back, a plain merge).
        keys: the residual key of each of ``state.parameters``.
        alpha: the overlap's mixing weight (0 without overlap).
        decay: β, the share of the residual the model keeps (1: all of it).
        carry: :meth:`OuterState.merge`'s carrying merge instead of the mix.
    """
    members = state.fragments[fragment]
    held: list[Optional[torch.Tensor]] = []
    for index in members:
        residual = feedback.residual(keys[index]) if feedback is not None else None
        held.append(None if residual is None else residual.to(torch.float32) * decay)
    state.merge(fragment, alpha, held, carry=carry)
    if feedback is not None:
        for index in members:
            feedback.clear(keys[index])
