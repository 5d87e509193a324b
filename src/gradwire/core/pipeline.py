"""The compression core every front-end drives: :class:`Pipeline`.

compensate -> select -> encode -> exchange -> decode -> residual, for :class:`~.group.Group`\\ s;
the path of one gradient is told in docs/architecture.md. A front-end (the DDP hook, a
``GradientExchange``, FSDP2's reduce-scatter, a local-steps sync) builds groups, calls
:meth:`Pipeline.start` for each (in the same order on every rank), and at its round's end
:meth:`Pipeline.finish`, which returns a :class:`~.round.Verdict`; it resolves, raises or zeroes
by it. Nothing here knows a GradBucket, a Future, FSDP or an optimizer.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Hashable, Optional, Sequence

import torch
import torch.distributed as dist

from ..exchange import check_same_on_all_ranks
from ..exchange.checked import time_limit
from ..exchange.collectives import world_size_of
from . import checkpoint
from .config import QUANTIZE_BITS, ExchangeConfig
from .feedback import ErrorFeedback, MomentumCorrection
from .group import Group, check_entries
from .planner import COMPENSATE, NO_SELECTION, SELECT, Planner
from .round import APPLY, Round, Verdict
from .selection import Selection
from .stats import ExchangeStats
from .strategies import (
    DenseAllReduce,
    Exchange,
    ExchangeContext,
    ExchangeStrategy,
    HierarchicalExchange,
    PayloadAllGather,
    QuantizedAllReduce,
    SharedSupportAllReduce,
    SparseAllReduce,
    count_slack,
    shard_strategies,
)


def build_feedback(config: ExchangeConfig, *, spares: bool = True) -> Optional[ErrorFeedback]:
    """The error-feedback memory ``config`` asks for: DGC's momentum correction, plain (or
    decaying, or bfloat16-stored) error feedback, or none. ``spares``: keep last step's residual
    as the next compensation buffer (see :class:`~.feedback.ErrorFeedback`)."""
    if config.momentum_correction is not None:
        return MomentumCorrection(config.momentum_correction, spares=spares)
    if config.error_feedback:
        return ErrorFeedback(storage_dtype=config.residual_storage, spares=spares, decay=config.feedback_decay)
    return None


class Pipeline:
    """Options and memory of one compressed exchange; one per model (or per front-end instance).

    Args:
        config: the options (:class:`~.config.ExchangeConfig`).
        process_group: the ranks to exchange with (default: the world).
        stats: the counters to add to (a new :class:`~.stats.ExchangeStats` by default).
        spare_buffers: keep last round's residual as the next compensation buffer (faster; a
            second residual's memory per tensor), or free it (FSDP, where memory is the point).

    The strategies, the planner and the round are built at first use, when the process group is
    up; :meth:`reset` makes every rank start again from the same point (after loading a checkpoint).
    """

    def __init__(self, config: ExchangeConfig, process_group: Optional[dist.ProcessGroup] = None, *,
                 stats: Optional[ExchangeStats] = None, spare_buffers: bool = True) -> None:
        self.config = config
        self.process_group = process_group
        self.stats = stats if stats is not None else ExchangeStats()
        self.sparsifier = config.build_sparsifier()
        # spare_buffers=False (FSDP): no second residual-sized buffer kept per tensor between rounds
        self.feedback: Optional[ErrorFeedback] = build_feedback(config, spares=spare_buffers)
        self.selection = (Selection(self.sparsifier, self.feedback, config.scope, self.stats)
                          if self.sparsifier is not None else None)
        self._checked = False
        self._strategies: Optional[dict[str, ExchangeStrategy]] = None
        self._context: Optional[ExchangeContext] = None
        self._planner: Optional[Planner] = None
        self._round: Optional[Round] = None
        #: a loaded planner state waiting for the planner (built at the first round)
        self._pending_planner: Optional[dict[str, Any]] = None

    # ----------------------------------------------------------------------------- a round
    def check_config(self) -> None:
        """At first use, every rank compares a hash of the options (and fails together on a
        mismatch or on a peer that never answers). A collective; idempotent afterwards."""
        if not self._checked:
            check_same_on_all_ranks(self.config.describe(), self.process_group,
                                    timeout=self.config.collective_timeout)
            self._checked = True

    def start(self, group: Group, step: int) -> Exchange:
        """Check the group's input, choose its strategy (the same on every rank), run the selection
        it needs and launch it. Never raises: a failure is recorded on the group (every rank then
        fails the round together at :meth:`finish`)."""
        strategies = self._build()
        assert self._context is not None and self._planner is not None
        self._context.step = step
        self.stats.add("bytes_dense", group.dense_bytes(self._context.world_size))
        try:
            with time_limit(self.config.collective_timeout):  # blocking rounds (sparse, calibration)
                return self._start(group, step, strategies)
        except BaseException as error:  # recorded; every rank fails this round together
            group.mark_failed(error)
            return Exchange(self._context, group)

    def _start(self, group: Group, step: int, strategies: dict[str, ExchangeStrategy]) -> Exchange:
        assert self._planner is not None
        # the entries the fused selection checks on its way (one read of the bucket fewer); a plan
        # that does not select checks them here after all
        deferred = self.selection.deferrable(group) if self.selection is not None else frozenset()
        plan = self._planner.plan(group, step)
        raw_dense = plan.strategy == "dense" and (
            plan.selection == NO_SELECTION or (plan.selection == COMPENSATE and not self._owes(group)))
        # A raw dense send is checked where its values land: NaN/Inf on any rank reaches every
        # rank's sum, which the strategy tests on its way (one pass for the division, the test and
        # the digest), so the input's own pass is not needed. Every other plan checks its input.
        if not raw_dense:
            with self.stats.timer("check"):
                check_entries(group, skip=deferred if plan.selection == SELECT else frozenset())
        if plan.selection == SELECT and not group.finite and not (
                self._planner.sparsifier is not None and self._planner.sparsifier.shared_support):
            plan = dataclasses.replace(plan, selection=NO_SELECTION)  # its exchange announces NaN instead
        if plan.selection == SELECT:
            assert self.selection is not None
            self.selection.run(group, step, deferred=deferred)
        elif plan.selection == COMPENSATE and not raw_dense:
            assert self.selection is not None
            self.selection.compensate(group, detect_unused=plan.detect_unused)
        return strategies[plan.strategy].start(group)

    def _owes(self, group: Group) -> bool:
        """Whether a dense send of ``group`` must compensate: some entry holds a residual (or DGC's
        velocity). When none does — after a dense round cleared them, as in ``auto``'s dense
        policy — the raw gradients are exactly what a compensated send would be, without its
        copies (compensate, gather into a fresh flat buffer)."""
        feedback = self.feedback
        if feedback is None:
            return False
        if isinstance(feedback, MomentumCorrection):
            return True
        return any(entry.key in feedback.residuals for entry in group.entries)

    @staticmethod
    def poll(in_flight: Sequence[Exchange]) -> None:
        """Finish (decode, write) the exchanges that have arrived, without waiting."""
        for exchange in in_flight:
            if exchange.done():
                exchange.complete()

    def finish(self, groups: Sequence[Group], in_flight: Sequence[Exchange], step: int) -> Verdict:
        """The round's end (:mod:`~.round`): wait, second rounds, agree (with the planner's measured
        round time, :mod:`~.online`), error feedback on success."""
        self.complete(groups, in_flight, step)
        return self.agree(groups, step)

    def complete(self, groups: Sequence[Group], in_flight: Sequence[Exchange], step: int) -> None:
        """The first half of :meth:`finish`: every exchange waited for (or failed) and its result
        written, second rounds run; nothing agreed and no residual changed yet. A front-end whose
        round spans several calls (FSDP2: one call per module, one agreement per step) completes
        each call's groups, then :meth:`agree`s once over all of them."""
        self._build()
        assert self._round is not None
        self._round.wait(groups, in_flight, step)
        for strategy in (self._strategies or {}).values():
            try:
                strategy.settle()
            except BaseException as error:  # a strategy records its own failures; this is a bug guard
                for group in groups:
                    group.mark_failed(error)

    def agree(self, groups: Sequence[Group], step: int) -> Verdict:
        """The second half of :meth:`finish`: one agreement over ``groups`` (each already through
        :meth:`complete`), error feedback applied only if every rank succeeded with all of them."""
        self._build()
        assert self._round is not None and self._planner is not None
        with self.stats.timer("agree"):
            verdict = self._round.agree(groups, step, self._planner.round_extras())
        self._planner.observe(step, verdict.extras, verdict.action == APPLY)
        return verdict

    def summary(self) -> dict[str, object]:
        """What ``stats()`` adds beyond the counters: ``auto``'s policy and measured round times."""
        return self._planner.summary() if self._planner is not None else {}

    def reset(self) -> None:
        """Forget what carries across rounds (frame sizes, regions, ``auto``'s choices), on every rank."""
        if self._planner is not None:
            self._planner.reset()
        if self._strategies is not None:
            for strategy in self._strategies.values():
                strategy.reset()

    # ----------------------------------------------------------------------------- state
    @property
    def planner(self) -> Optional[Planner]:
        """The planner (None before the first round)."""
        return self._planner

    def rank(self) -> int:
        return dist.get_rank(self.process_group) if world_size_of(self.process_group) > 1 else 0

    def state_dict(self, *, names: dict[Hashable, str], specs: dict[str, checkpoint.ParameterSpec], iteration: int,
                   gather: bool = False) -> dict[str, Any]:
        """This rank's residuals (and DGC velocities) by tensor name, with whose they are; see
        :mod:`~.checkpoint` (``gather=True`` is a collective)."""
        if self.feedback is not None and self.feedback.residuals and not names:
            raise ValueError("state_dict needs parameter names: pass model= to CommHookState or call attach(model)")
        residuals = velocities = None
        if self.feedback is not None:
            residuals = self.feedback.state_dict(names)
            if isinstance(self.feedback, MomentumCorrection):
                velocities = {names[k]: v for k, v in self.feedback.velocities.items() if k in names}
        planner = self._planner.state_dict() if self._planner is not None else self._pending_planner
        local = checkpoint.build_state(rank=self.rank(), world_size=world_size_of(self.process_group),
                                       config=self.config.describe(), iteration=iteration, residuals=residuals,
                                       velocities=velocities, planner=planner)
        return checkpoint.gather_state(local, self._stored(specs), self.process_group) if gather else local

    def _stored(self, specs: dict[str, checkpoint.ParameterSpec]) -> dict[str, checkpoint.ParameterSpec]:
        """The specs with residuals in their storage dtype (``residual_dtype``)."""
        storage = self.config.residual_storage
        if storage is None:
            return specs
        return {name: checkpoint.ParameterSpec(spec.numel, storage) for name, spec in specs.items()}

    def load_state_dict(self, state: dict[str, Any], *, names: dict[Hashable, str],
                        specs: dict[str, checkpoint.ParameterSpec], device: "torch.device | str" = "cpu") -> int:
        """Restore :meth:`state_dict` output (this rank's own or the gathered form) and return the
        iteration it was saved at. Raises ``ValueError`` for another rank's state, another world
        size, other options, or tensors that do not fit (nothing is changed then)."""
        if not names:
            raise ValueError("load_state_dict needs parameter names: pass model= to CommHookState or call "
                             "attach(model)")
        kinds = () if self.feedback is None else \
            ("residuals", "velocities") if isinstance(self.feedback, MomentumCorrection) else ("residuals",)
        mine = checkpoint.select_state(state, rank=self.rank(), world_size=world_size_of(self.process_group),
                                       config=self.config.describe(), specs=self._stored(specs), kinds=kinds)
        keys = {name: key for key, name in names.items()}
        self.reset()  # every rank restarts from the same point
        self._pending_planner = mine.planner
        if self._planner is not None and mine.planner is not None:
            self._planner.load_state_dict(mine.planner)
            self._pending_planner = None
        if self.feedback is not None:
            self.feedback.load_state_dict(mine.residuals, keys, {keys[n]: torch.device(device) for n in mine.residuals})
            if isinstance(self.feedback, MomentumCorrection):
                self.feedback.load_velocities({keys[n]: t.to(device) for n, t in mine.velocities.items()})
        return mine.iteration

    def __getstate__(self) -> dict[str, Any]:
        # process groups cannot be pickled (as PyTorch's PowerSGDState does, drop it); frame sizes
        # and choices must restart from a length round on every rank
        state = dict(self.__dict__)
        state.update(process_group=None, _strategies=None, _context=None, _planner=None, _round=None)
        return state

    # ----------------------------------------------------------------------------- building
    def _build(self) -> dict[str, ExchangeStrategy]:
        if self._strategies is None:
            world = world_size_of(self.process_group)
            config = self.config
            self._context = ExchangeContext(config.value_codec, config.index_codec, self.process_group, world,
                                            self.rank(), self.stats, timeout=config.collective_timeout,
                                            dense_fallback=config.collective == "auto", hierarchy=config.hierarchy)
            dense = DenseAllReduce(self._context)
            self._strategies = {
                "dense": dense,
                "allreduce": SharedSupportAllReduce(self._context),
                "allgather": PayloadAllGather(self._context, dense, count_slack(self.sparsifier)),
                "sparse-allreduce": SparseAllReduce(self._context),
            }
            if self.sparsifier is not None:
                self._strategies["hierarchical"] = HierarchicalExchange(self._context, self.sparsifier, self.feedback)
            if config.quantize is not None:
                self._strategies["quantized"] = QuantizedAllReduce(self._context, self.feedback,
                                                                   bits=QUANTIZE_BITS[config.quantize],
                                                                   block_size=config.quantize_block)
            # shard groups (FSDP2's reduce-scatter): strategies/reduce_scatter.py
            self._strategies.update(shard_strategies(
                self._context, sparsifier=self.sparsifier, feedback=self.feedback,
                quantize_bits=QUANTIZE_BITS.get(config.quantize or ""), quantize_block=config.quantize_block))
            self._planner = Planner(config, self.sparsifier, self.process_group, world)
            if self._pending_planner is not None:  # loaded before the first round
                self._planner.load_state_dict(self._pending_planner)
                self._pending_planner = None
            self._round = Round(config, self.process_group, world, self.stats, self.feedback)
        return self._strategies
