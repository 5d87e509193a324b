"""DiLoCo-style local steps whose outer steps go through gradwire's compression core: :class:`DiLoCo`.

>>> import torch, torch.distributed as dist, gradwire
>>> dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29519", rank=0, world_size=1)
>>> model = torch.nn.Linear(8, 2)
>>> inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
>>> local = gradwire.DiLoCo(model, inner, sync_every=4)
>>> for step in range(8):                  # the training loop stays as it is
...     inner.zero_grad()
...     model(torch.randn(5, 8)).square().mean().backward()
...     inner.step()                       # every 4th step also runs an outer step
>>> local.stats()["outer_steps"]
2
>>> dist.destroy_process_group()

A front-end of the core (:mod:`gradwire.core`), like the DDP hook: a sync of fragment f is one
round of the core's :class:`~gradwire.core.pipeline.Pipeline` over one :class:`~gradwire.core.group.Group`
whose target is a float32 flat buffer holding Δ_f, reduced to the mean over the outer group.
The arithmetic around it (Δ, the error-feedback decay, the outer step, the merge) is
:mod:`.outer`; the schedule of fragments is :mod:`.fragments`; docs/local-steps.md tells the rules.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Hashable, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..core import checkpoint
from ..core.config import ExchangeConfig
from ..core.group import Group
from ..core.pipeline import Pipeline
from ..core.round import APPLY, RAISE, SKIP, Verdict
from ..core.strategies import Exchange
from ..errors import collective_failed
from ..exchange import check_same_on_all_ranks, ring_allreduce_bytes
from ..exchange.collectives import allreduce_sum, world_size_of
from ..exchange.inflight import Launched
from ..tensors import GradientExchange
from .fragments import assign_fragments, fragment_due, layers_of
from .options import LocalStepsConfig, default_unsent
from .outer import OuterOptimizerFactory, OuterState, feedback_input, fragment_group, sgd_factory, unsent_to_model

FORMAT = "gradwire.diloco/1"


@dataclass
class _Sync:
    """One sync in flight or completed: the fragments it covers, the core's groups and exchanges,
    the local step at which it is merged, the buffers' AllReduce, and (once completed) the verdict."""

    fragments: list[int]
    groups: list[Group]
    exchanges: list[Exchange]
    finish_at: int
    buffers: Optional[Launched] = None
    buffer_flat: Optional[torch.Tensor] = None
    verdict: Optional[Verdict] = None
    bytes_sent: float = 0.0
    started: float = field(default_factory=time.perf_counter)


class DiLoCo:
    """DiLoCo: every rank runs ``sync_every`` inner steps of its own optimizer from the shared global
    parameters θ, then the ranks average the pseudo-gradient ``Δ = θ - θ_local`` (compressed by the
    core, with error feedback) and an outer optimizer steps θ with it.

    The training loop stays as it is (``loss.backward(); inner_optimizer.step()``): the sync runs
    from an optimizer step post-hook, every ``sync_every / fragments`` inner steps. Every rank must
    construct it (a collective: rank 0's parameters and buffers are broadcast over
    ``process_group``, and the options are compared across ranks).

    Args:
        model: a module, or a DDP module whose process group is inside a node (DDP or the hook
            averages gradients there; ``process_group`` is the group across nodes).
        inner_optimizer: the optimizer of ``model``'s parameters the loop steps.
        sync_every: H, inner steps between two syncs of the same parameter (>= 1).
        outer_lr, outer_momentum, nesterov: the default outer optimizer, SGD (DiLoCo's 0.7 / 0.9 /
            Nesterov).
        compressor, density, value_codec, index_codec, collective, quantize, error_feedback: the
            outer exchange's compression, as for :class:`gradwire.CommHookState` (default: dense
            float32 AllReduce); e.g. ``compressor="topk", density=0.03, value_codec="qsgd-ans"`` or
            ``quantize="int4"``.
        warmup_steps: synchronous inner steps before the first local period (their gradients are
            averaged over ``process_group`` before each inner step; DiLoCo starts from a trained model).
        fragments: F; each syncs 1/F of the parameters (layers dealt out strided and balanced,
            :mod:`.fragments`) every ``H / F`` steps.
        overlap_steps: τ; a sync's exchange stays in flight for τ inner steps and its result is
            merged afterwards (``merge_alpha``; at most ``H / F``). Only non-blocking strategies
            (dense, AllGather's payloads) overlap; the quantized AllReduce completes inside the
            step that starts it, the sparse AllReduce inside the step that finishes it.
        process_group: the ranks that sync (default: the world).
        outer_optimizer: a factory ``params -> torch.optim.Optimizer`` replacing the SGD default;
            ``params`` are float32 tensors shaped like the model's parameters.
        feedback_decay: β of SparseLoCo's rule ``e <- β e + Δ`` (1: plain error feedback).
        merge_alpha: α of the overlap merge ``θ_local <- α θ_local + (1 - α) θ`` (Streaming DiLoCo's
            mixing; used only with ``overlap_steps`` > 0 and ``overlap_merge="mix"``).
        overlap_merge: how an overlapped sync's θ meets the τ inner steps taken while it was in
            flight: ``"mix"`` (Streaming DiLoCo's α mix, above) or ``"carry"`` (``θ_local <- θ +
            (θ_local - θ_local at the sync's start)``: those steps are kept whole on top of the new
            θ and go into the next Δ; it costs a float32 copy of the fragment while in flight).
        unsent: where what a compressed sync did not send waits: ``"residual"`` (the core's
            error-feedback memory; every rank restarts from θ) or ``"model"`` (each rank restarts
            from ``θ - e``, its own unsent part ``e``, and the residual is emptied: the next Δ carries
            it again, and an inner optimizer never re-learns a step the model already took).
            ``synchronize()`` always leaves θ in the model (and ``e`` in the residual). Default
            (None): ``"model"`` for a sparsifier with plain error feedback, which held quality
            where the residual rule did not (docs/local-steps.md), else ``"residual"``
            (:func:`~gradwire.local_steps.options.default_unsent`).
        warmup_quantize: the warm-up's gradient AllReduce in ``"int8"`` or ``"int4"`` blocks (with
            error feedback, the core's ``quantize``) instead of float32: a synchronous warm-up at
            about a quarter (an eighth) of DDP's bytes.
        warmup_exact_steps: with ``warmup_quantize``, how many of the warm-up's first steps still
            average exactly (float32) before the quantized ones: error feedback from step 1 can
            fall behind under Adam (one of two seeds did, docs/local-steps.md). At most
            ``warmup_steps``; 0 quantizes from the first step.
        **options: further options of the core's :class:`~gradwire.core.config.ExchangeConfig`
            (``codec_options``, ``scope``, ``nonfinite``, ``collective_timeout``, ``quantize_block``, ...).

    Raises:
        ValueError: an invalid option (naming it and the allowed values), or options that differ
            between ranks.
    """

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer, sync_every: int,
                 outer_lr: float = 0.7, outer_momentum: float = 0.9, nesterov: bool = True,
                 compressor: str = "none", density: Optional[float] = None, value_codec: Any = "fp32",
                 index_codec: Any = "eliasfano", collective: str = "auto", quantize: Optional[str] = None,
                 error_feedback: bool = True, warmup_steps: int = 0, fragments: int = 1, overlap_steps: int = 0,
                 process_group: Optional[dist.ProcessGroup] = None, *,
                 outer_optimizer: Optional[OuterOptimizerFactory] = None, feedback_decay: float = 1.0,
                 merge_alpha: float = 0.5, unsent: Optional[str] = None, warmup_quantize: Optional[str] = None,
                 warmup_exact_steps: int = 0, overlap_merge: str = "mix", **options: Any) -> None:
        if "config" in options:
            raise ValueError("DiLoCo takes the exchange's options as keywords, not config=")
        self.config = ExchangeConfig(compressor=compressor, density=density, value_codec=value_codec,
                                     index_codec=index_codec, collective=collective, quantize=quantize,
                                     error_feedback=error_feedback, **options)
        unsent = default_unsent(self.config) if unsent is None else unsent
        self.local = LocalStepsConfig(
            sync_every=sync_every, outer_lr=outer_lr, outer_momentum=outer_momentum, nesterov=nesterov,
            outer_optimizer=None if outer_optimizer is None else getattr(outer_optimizer, "__qualname__",
                                                                         type(outer_optimizer).__name__),
            warmup_steps=warmup_steps, fragments=fragments, overlap_steps=overlap_steps,
            feedback_decay=feedback_decay, merge_alpha=merge_alpha, overlap_merge=overlap_merge, unsent=unsent,
            warmup_quantize=warmup_quantize, warmup_exact_steps=warmup_exact_steps)
        if unsent == "model" and self.config.momentum_correction is not None:
            raise ValueError("unsent='model' keeps what a sync did not send in the model; momentum_correction's "
                             "velocities cannot move there: use error_feedback")
        self.model = model
        module = model.module if isinstance(model, DistributedDataParallel) else model
        every = list(module.named_parameters())
        ids = {id(p): i for i, (_, p) in enumerate(every)}
        named = [(n, p) for n, p in every if p.requires_grad]
        known = {id(p) for group in inner_optimizer.param_groups for p in group["params"]}
        if not named or any(id(p) not in known for _, p in named):
            raise ValueError("inner_optimizer must hold every parameter of model that requires grad")
        self.inner_optimizer = inner_optimizer
        self.process_group = process_group
        self.world_size = world_size_of(process_group)
        self.names = [n for n, _ in named]
        self.parameters = [p for _, p in named]
        self._keys: list[Hashable] = [id(p) for p in self.parameters]
        self._tensor_ids = [ids[id(p)] for p in self.parameters]
        self._specs = {n: checkpoint.ParameterSpec(p.numel(), torch.float32) for n, p in named}
        self._buffers = [b for b in module.buffers() if b.is_floating_point()]
        # a collective on every rank: rank 0's parameters and buffers everywhere, as DDP does; it also
        # averages the warm-up's gradients
        self._warmup = GradientExchange(module, process_group, broadcast_parameters=True, compressor="none",
                                        quantize=warmup_quantize, warmup_steps=warmup_exact_steps,
                                        nonfinite=self.config.nonfinite,
                                        collective_timeout=self.config.collective_timeout)
        check_same_on_all_ranks(self.describe(), process_group, timeout=self.config.collective_timeout)
        factory = outer_optimizer or sgd_factory(outer_lr, outer_momentum, nesterov)
        self.outer = OuterState(self.parameters, assign_fragments(layers_of(named), fragments), factory)
        self.pipeline = Pipeline(self.config, process_group)
        self._deltas = [torch.zeros(self.outer.numel(f), dtype=torch.float32, device=self.parameters[m[0]].device)
                        for f, m in enumerate(self.outer.fragments)]
        self.inner_steps = 0
        #: the inner step the local schedule counts from (the warm-up's end, or the last forced sync)
        self.origin = warmup_steps
        self.outer_steps = 0
        self.rounds = 0
        self.skipped_outer_steps = 0
        self._dirty = False  # the model differs from θ (local steps since the last full sync)
        self._in_flight: Optional[_Sync] = None
        self._last_round: list[Any] = []  # the last sync's Works, held until the next round starts
        self._counters = {"bytes_outer": 0.0, "bytes_peak_sync": 0.0, "seconds_sync": 0.0, "seconds_warmup": 0.0}
        self._handles = [inner_optimizer.register_step_pre_hook(self._before_inner_step),
                         inner_optimizer.register_step_post_hook(self._after_inner_step)]

    # ------------------------------------------------------------------------------ public
    def describe(self) -> str:
        """Every option that must match across ranks: the local steps' and the exchange's."""
        return f"{self.local.describe()} | {self.config.describe()}"

    def synchronize(self) -> None:
        """Force a sync of every fragment now (e.g. before evaluating or saving): afterwards the model
        holds the global parameters θ on every rank, and the local schedule restarts from this step.
        A collective; a no-op when the model already holds θ (in the warm-up, or right after a full
        sync). The exchanged Δ̂ is averaged into θ plainly (``θ <- θ - mean Δ̂``), not through the
        outer optimizer: a forced sync is not an outer step (no momentum step, no count in
        ``outer_steps``), so evaluating often does not push training along.

        Raises:
            NonFiniteGradientError, CollectiveError, DivergenceError, StepFailedError, DecodeError:
                as the post-hook's syncs (every rank alike; no outer step is applied).
        """
        if self.inner_steps <= self.local.warmup_steps:
            self.outer.capture()
            return
        if self._in_flight is not None:
            self._finish(self._in_flight)
        if self._dirty:
            self._finish(self._start(list(range(self.local.fragments)), finish_at=0), alpha=0.0, into_model=False,
                         outer_step=False)
        self.origin = self.inner_steps

    def stats(self) -> dict[str, float]:
        """Counters of this rank, in bytes, steps and seconds.

        Returns:
            ``inner_steps``, ``local_steps`` (after the warm-up), ``outer_steps`` (applied),
            ``skipped_outer_steps``; ``bytes_sent`` (everything this rank sent: the warm-up's
            gradient AllReduces, the outer exchanges, the buffers), ``bytes_outer`` (outer exchanges
            and buffers only), ``bytes_per_inner_step`` (``bytes_sent / inner_steps``),
            ``bytes_per_local_step`` (``bytes_outer / local_steps``), ``bytes_ddp_per_step`` (what
            DDP's AllReduce sends per step for these parameters), ``bytes_peak_sync`` (the largest
            sync), ``seconds_sync`` (time the post-hook spent on outer steps), ``seconds_warmup``,
            and the core's counters of the outer exchanges (``total_seconds_communicate``, ...).
        """
        local_steps = max(self.inner_steps - self.local.warmup_steps, 0)
        warmup = self._warmup.pipeline.stats.total.get("bytes_sent", 0.0)
        numel = sum(p.numel() for p in self.parameters)
        out = {f"exchange_{k}": v for k, v in self.pipeline.stats.snapshot().items()}
        out.update(self._counters)
        out.update(inner_steps=self.inner_steps, local_steps=local_steps, outer_steps=self.outer_steps,
                   skipped_outer_steps=self.skipped_outer_steps, bytes_warmup=warmup,
                   bytes_sent=warmup + self._counters["bytes_outer"],
                   bytes_per_inner_step=(warmup + self._counters["bytes_outer"]) / max(self.inner_steps, 1),
                   bytes_per_local_step=self._counters["bytes_outer"] / max(local_steps, 1),
                   bytes_ddp_per_step=ring_allreduce_bytes(numel, 4, self.world_size))
        return out

    def close(self) -> None:
        """Remove the optimizer hooks (the inner optimizer steps on its own afterwards)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ------------------------------------------------------------------------------ hooks
    def _before_inner_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.inner_steps < self.local.warmup_steps:
            started = time.perf_counter()
            self._warmup.synchronize()  # the synchronous warm-up: gradients averaged over the group
            self._counters["seconds_warmup"] += time.perf_counter() - started

    def _after_inner_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.inner_steps += 1
        if self.inner_steps <= self.local.warmup_steps:
            if self.inner_steps == self.local.warmup_steps:
                self.outer.capture()  # θ := the warm-up's (identical) result
            return
        self._dirty = True
        step = self.inner_steps - self.origin
        sync = self._in_flight
        if sync is not None:
            if step >= sync.finish_at:
                self._finish(sync)
            else:
                self.pipeline.poll(sync.exchanges)  # decode what has arrived; never waits
        fragment = fragment_due(step, self.local.sync_every, self.local.fragments)
        if fragment is not None:
            sync = self._start([fragment], finish_at=step + self.local.overlap_steps)
            if self.local.overlap_steps == 0:
                self._finish(sync)

    # ------------------------------------------------------------------------------ a sync
    def _start(self, fragments: list[int], finish_at: int) -> _Sync:
        """Compute Δ of ``fragments`` and launch their exchange (one group each) and the buffers'."""
        started = time.perf_counter()
        self._last_round = []
        self.pipeline.check_config()
        buffers, buffer_flat = None, None
        if self._buffers and self.world_size > 1:
            buffer_flat = torch.cat([b.detach().reshape(-1).to(torch.float32) for b in self._buffers])
            buffers = allreduce_sum(buffer_flat, self.process_group, collective="AllReduce (buffers)")
        groups, exchanges = [], []
        feedback = self.pipeline.feedback if self.config.error_feedback else None
        for fragment in fragments:
            members, offsets = self.outer.fragments[fragment], self.outer.offsets[fragment]
            delta = self.outer.pseudo_gradient(fragment, self._deltas[fragment], keep_start=self.local.carries)
            feedback_input(delta, feedback, self.local.feedback_decay, members, offsets, self._keys)
            group = fragment_group(delta, self.parameters, members, offsets, self._keys, self._tensor_ids,
                                   float(self.world_size))
            groups.append(group)
            exchanges.append(self.pipeline.start(group, self.rounds))
        self.rounds += 1
        sync = _Sync(fragments, groups, exchanges, finish_at, buffers, buffer_flat)
        if buffer_flat is not None:
            sync.bytes_sent += ring_allreduce_bytes(buffer_flat.numel(), 4, self.world_size)
        self._in_flight = sync
        self._counters["seconds_sync"] += time.perf_counter() - started
        return sync

    def _complete(self, sync: _Sync) -> None:
        """Wait for the sync's exchanges and agree on them (a collective); its verdict is kept."""
        if sync.verdict is not None:
            return
        started = time.perf_counter()
        timeout = self.config.collective_timeout
        for exchange in sync.exchanges:
            exchange.complete(timeout)
        if sync.buffers is not None:
            try:
                sync.buffer_flat = sync.buffers.result(timeout).div_(self.world_size)
            except Exception as error:  # recorded: the round's agreement makes every rank raise together
                for group in sync.groups:
                    group.mark_failed(collective_failed("AllReduce of buffers", self.rounds - 1, error))
        sync.verdict = self.pipeline.finish(sync.groups, sync.exchanges, self.rounds - 1)
        self._last_round = [work for exchange in sync.exchanges for work in exchange.works()]
        sync.bytes_sent += self.pipeline.stats.current.get("bytes_sent", 0.0)
        self.pipeline.stats.end_step()
        self._counters["bytes_outer"] += sync.bytes_sent
        self._counters["bytes_peak_sync"] = max(self._counters["bytes_peak_sync"], sync.bytes_sent)
        self._counters["seconds_sync"] += time.perf_counter() - started

    def _finish(self, sync: _Sync, alpha: Optional[float] = None, into_model: bool = True,
                outer_step: bool = True) -> None:
        """Complete ``sync`` if needed, then act on its verdict: outer step and merge (apply), back to
        θ (skip), or raise the round's typed error (every rank alike; θ unchanged). ``into_model``:
        with ``unsent="model"``, the residual moves into the model (False: θ exactly, residual kept).
        ``outer_step=False`` (a forced sync): the average goes into θ plainly (:meth:`OuterState.average`)."""
        self._complete(sync)
        started = time.perf_counter()
        self._in_flight = None
        verdict = sync.verdict
        assert verdict is not None
        if verdict.action == RAISE:
            assert verdict.error is not None
            raise verdict.error
        carry = alpha is None and self.local.carries
        if alpha is None:
            alpha = self.local.merge_alpha if self.local.overlap_steps else 0.0
        if verdict.action == SKIP:  # no outer step; every rank drops this period's local progress alike
            self.skipped_outer_steps += 1
            for fragment in sync.fragments:
                self.outer.merge(fragment, 0.0)
        else:
            assert verdict.action == APPLY
            model_holds = into_model and self.local.unsent == "model"
            for fragment in sync.fragments:
                if outer_step:
                    self.outer.apply(fragment, self._deltas[fragment])
                else:
                    self.outer.average(fragment, self._deltas[fragment])
                if model_holds:
                    unsent_to_model(self.outer, fragment, self.pipeline.feedback, self._keys, alpha,
                                    self.local.feedback_decay, carry=carry)
                else:
                    self.outer.merge(fragment, alpha, carry=carry)
            self.outer_steps += int(outer_step)
            if sync.buffer_flat is not None:
                self._write_buffers(sync.buffer_flat)
        if alpha == 0.0 and len(sync.fragments) == self.local.fragments and not (
                into_model and self.local.unsent == "model" and verdict.action == APPLY):
            self._dirty = False
        self._counters["seconds_sync"] += time.perf_counter() - started

    @torch.no_grad()
    def _write_buffers(self, flat: torch.Tensor) -> None:
        position = 0
        for buffer in self._buffers:
            buffer.copy_(flat[position: position + buffer.numel()].view(buffer.shape))
            position += buffer.numel()

    # ------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """This rank's state: θ, the outer optimizer, the exchange's residuals (per rank, the core's
        format), the inner optimizer, the step counters and a completed exchange not merged yet.

        A collective while an overlapped exchange is in flight (it is completed now and merged at its
        own step, so a run resumed from this state continues exactly as one that was not stopped):
        call it on every rank at the same step.

        Raises:
            as :meth:`synchronize`, when completing the exchange in flight fails.
        """
        pending = None
        if self._in_flight is not None:
            sync = self._in_flight
            self._complete(sync)
            assert sync.verdict is not None
            if sync.verdict.action == RAISE:
                self._in_flight = None
                raise sync.verdict.error  # type: ignore[misc]
            pending = {"fragments": list(sync.fragments), "finish_at": sync.finish_at, "action": sync.verdict.action,
                       "deltas": [self._deltas[f].cpu().clone() for f in sync.fragments],
                       "starts": [None if f not in self.outer.starts else self.outer.starts[f].cpu().clone()
                                  for f in sync.fragments],
                       "buffers": None if sync.buffer_flat is None else sync.buffer_flat.cpu().clone()}
        describe = self.describe()
        return {"format": FORMAT, "rank": self.pipeline.rank(), "world_size": self.world_size, "config": describe,
                "config_hash": checkpoint.config_hash(describe), "inner_steps": self.inner_steps,
                "origin": self.origin, "outer_steps": self.outer_steps, "rounds": self.rounds,
                "skipped_outer_steps": self.skipped_outer_steps, "dirty": self._dirty,
                "counters": dict(self._counters), **self.outer.state_dict(self.names),
                "exchange": self.pipeline.state_dict(names=dict(zip(self._keys, self.names)), specs=self._specs,
                                                     iteration=self.rounds),
                "inner_optimizer": self.inner_optimizer.state_dict(), "pending": pending,
                "warmup_exchange": self._warmup.state_dict() if self.local.warmup_quantize else None}

    def load_state_dict(self, state: dict[str, Any], device: "torch.device | str | None" = None) -> None:
        """Restore :meth:`state_dict` output of this rank (tensors go to the parameters' device).

        Raises:
            ValueError: not a DiLoCo state, another rank's, another world size's or other options'
                (one message saying which), or global parameters that do not fit the model;
                nothing is changed then.
        """
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise ValueError(f"not a gradwire DiLoCo state (format={getattr(state, 'get', dict().get)('format')!r}, "
                             f"expected {FORMAT!r})")
        if state.get("world_size") != self.world_size:
            raise ValueError(f"DiLoCo state was saved with world size {state.get('world_size')}, this group has "
                             f"{self.world_size}: residuals are per rank and cannot be re-split")
        if state.get("rank") != self.pipeline.rank():
            raise ValueError(f"DiLoCo state belongs to rank {state.get('rank')}, this is rank {self.pipeline.rank()}: "
                             "error-feedback residuals are per rank (save every rank's state)")
        if state.get("config_hash") != checkpoint.config_hash(self.describe()):
            raise ValueError(f"DiLoCo state was saved with other options: {state.get('config')!r}; "
                             f"this DiLoCo has {self.describe()!r}")
        for name, parameter in zip(self.names, self.parameters):
            stored = state["global"].get(name)
            if not (isinstance(stored, torch.Tensor) and stored.shape == parameter.shape
                    and stored.is_floating_point()):
                raise ValueError(f"DiLoCo state: global parameter {name!r} is missing or not shaped "
                                 f"{tuple(parameter.shape)}")
        keys = dict(zip(self._keys, self.names))
        target = device if device is not None else self.parameters[0].device
        self.pipeline.load_state_dict(state["exchange"], names=keys, specs=self._specs, device=target)
        self.outer.load_state_dict(state, self.names)
        self.inner_optimizer.load_state_dict(state["inner_optimizer"])
        if self.local.warmup_quantize and state.get("warmup_exchange") is not None:
            self._warmup.load_state_dict(state["warmup_exchange"])
        for name in ("inner_steps", "origin", "outer_steps", "rounds", "skipped_outer_steps"):
            setattr(self, name, int(state[name]))
        self._dirty = bool(state["dirty"])
        self._counters.update(state.get("counters", {}))
        self._in_flight, self._last_round = None, []
        self.outer.starts = {}
        pending = state.get("pending")
        if pending is not None:
            for fragment, delta, start in zip(pending["fragments"], pending["deltas"],
                                              pending.get("starts") or [None] * len(pending["fragments"])):
                self._deltas[fragment].copy_(delta)
                if start is not None:
                    self.outer.starts[fragment] = start.to(self._deltas[fragment].device)
            buffer_flat = None if pending["buffers"] is None else pending["buffers"].to(target)
            self._in_flight = _Sync(list(pending["fragments"]), [], [], int(pending["finish_at"]),
                                    buffer_flat=buffer_flat, verdict=Verdict(pending["action"]))
