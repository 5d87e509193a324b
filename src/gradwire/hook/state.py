"""``CommHookState``: the hook's options and memory, composed of small named parts.

* :class:`~gradwire.hook.config.HookConfig` — every option, validated, frozen;
* :class:`~gradwire.hook.selection.Selection` — error feedback + sparsifier;
* exchange strategies (:mod:`gradwire.hook.strategies`) — how a group travels;
* :class:`~gradwire.hook.step.StepEnd` — the step's end: wait, agree, resolve;
* :class:`~gradwire.stats.ExchangeStats` — bytes and seconds.
"""

from __future__ import annotations

import logging
from typing import Any, Hashable, Optional, Sequence

import torch
import torch.distributed as dist

from .. import checkpoint
from ..exchange import check_same_on_all_ranks, ring_allreduce_bytes
from ..exchange.alphabeta import Link
from ..exchange.checked import time_limit
from ..exchange.collectives import world_size_of
from ..feedback import ErrorFeedback, MomentumCorrection
from ..stats import ExchangeStats
from .config import CAST_VALUE_CODECS, HookConfig
from .group import BucketGroup, Entry, all_finite, offset_in
from .selection import Selection
from .step import StepEnd
from .choice import Calibration, calibrate, candidates, choose_strategy, entry_bytes
from .strategies import (
    DenseAllReduce,
    Exchange,
    ExchangeContext,
    ExchangeStrategy,
    HierarchicalExchange,
    PayloadAllGather,
    SharedSupportAllReduce,
    SparseAllReduce,
    count_slack,
    local_size_of,
)

logger = logging.getLogger("gradwire")

#: In-node links for the hierarchical candidate of ``auto`` (shared memory or NVLink class: an
#: assumption, not a measurement — the model only needs them far faster than the network).
IN_NODE_LINK = Link(5e-6, 1e-10)


class CommHookState:
    """Options and memory of the gradwire hook; one per DDP model.

    Args:
        process_group: the group to communicate over (default: the world).
        config: a :class:`HookConfig`; or give its options as keywords instead:
        compressor: one of :func:`gradwire.sparsify.sparsifiers` or ``"none"`` (dense AllReduce).
        density / k / threshold: how much to keep: a fraction in (0, 1], a count per tensor
            (layer scope) or per model (global), or a magnitude for ``threshold``.
        value_codec, index_codec: codec names, configs or instances (see ``gradwire.codecs``).
        codec_options: options routed to the codecs by name (e.g. ``{"bits": 4}`` for qsgd).
        error_feedback: keep what is not sent and add it to the next step.
        momentum_correction: DGC's momentum correction with this momentum (e.g. 0.9): momentum
            is accumulated before sparsification; use the optimizer without momentum then.
        scope: ``"layer"`` (each parameter keeps its density) or ``"global"`` (one selection over
            the whole model, made when the iteration's last bucket arrives).
        collective: ``"auto"`` (α–β–γ cost model over every strategy, see
            :mod:`gradwire.hook.choice`), ``"allreduce"`` (shared supports only), ``"allgather"``,
            ``"sparse-allreduce"`` (volume per worker independent of the number of workers) or
            ``"dense"``.
        hierarchy: ``None``, ``"auto"`` (torchrun's ``LOCAL_WORLD_SIZE``) or ranks per node: dense
            inside a node, sparse AllReduce across nodes (with ``collective="sparse-allreduce"``,
            or as a candidate of ``"auto"``).
        link_gbit, link_alpha: the network for ``auto``'s model (Gbit/s per worker, seconds per
            round); None: measured at the first step.
        seed: shared seed of random supports; every rank must use the same.
        warmup_steps: dense AllReduce for the first N steps.
        nonfinite: ``"raise"`` (every rank raises :class:`NonFiniteGradientError`) or ``"skip"``
            (every rank gets zero gradients for that step; residuals untouched).
        verify: ``"digest"`` (default: ranks compare a hash of the averaged gradients every step
            and all raise if they differ) or ``"none"``.
        collective_timeout: seconds after which an unfinished exchange fails the step on every
            rank: the step's in-flight exchanges together, and each blocking round (lengths,
            sparse AllReduce rounds, calibration, the step-end agreement) on its own (default 120;
            gloo's own is 30 minutes).
        model: the model (DDP-wrapped or not); needed for :meth:`state_dict` names and stable
            per-parameter random streams.
        log_every: log :meth:`stats` every N steps at INFO level (0: never).
    """

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None, *, config: Optional[HookConfig] = None,
                 model: Optional[torch.nn.Module] = None, **options: Any) -> None:
        if config is not None and options:
            raise ValueError(f"pass either config= or options, not both (got {', '.join(sorted(options))})")
        self.config = config if config is not None else HookConfig(**options)
        self.process_group = process_group
        self.sparsifier = self.config.build_sparsifier()
        self.value_codec, self.index_codec = self.config.value_codec, self.config.index_codec
        self.feedback: Optional[ErrorFeedback] = None
        if self.config.momentum_correction is not None:
            self.feedback = MomentumCorrection(self.config.momentum_correction)
        elif self.config.error_feedback:
            self.feedback = ErrorFeedback()
        self.iteration = 0
        self._stats = ExchangeStats()
        self._selection = (Selection(self.sparsifier, self.feedback, self.config.scope, self._stats)
                           if self.sparsifier is not None else None)
        self._checked = False
        self._pending: Optional[BucketGroup] = None
        self._step_groups: list[BucketGroup] = []
        self._in_flight: list[Exchange] = []
        #: the last step's exchanges, held (with their collectives' Work) until the next step's
        #: first bucket, so no backend thread frees their tensors (gradwire.lifetime)
        self._last_step: list[Exchange] = []
        #: built at first use, when the process group is up
        self._strategies: Optional[dict[str, ExchangeStrategy]] = None
        self._context: Optional[ExchangeContext] = None
        self._step_end: Optional[StepEnd] = None
        self._calibration: Optional[Calibration] = None
        self._choices: dict[tuple[int, ...], str] = {}
        self._names: dict[Hashable, str] = {}
        self._param_index: dict[Hashable, int] = {}
        self._specs: dict[str, checkpoint.ParameterSpec] = {}
        if model is not None:
            self.attach(model)

    # ----------------------------------------------------------------------------- public
    def __getattr__(self, name: str) -> Any:
        # options read as attributes (state.compressor, state.density, ...) come from the config
        config = self.__dict__.get("config")
        if config is not None and name in HookConfig.__dataclass_fields__:
            return getattr(config, name)
        raise AttributeError(f"{type(self).__name__!s} has no attribute {name!r}")

    def attach(self, model: torch.nn.Module) -> None:
        """Learn parameter names (for checkpoints) and stable per-parameter ids."""
        for index, (name, parameter) in enumerate(model.named_parameters()):
            self._names[id(parameter)] = name
            self._param_index[id(parameter)] = index
        self._specs = checkpoint.parameter_specs(model)

    def stats(self) -> dict[str, float]:
        """Last step's and cumulative bytes and seconds; see :class:`gradwire.stats.ExchangeStats`."""
        snapshot = self._stats.snapshot()
        snapshot["residual_norm"] = self.feedback.norm() if self.feedback is not None else 0.0
        return snapshot

    def describe(self) -> str:
        """A canonical string of every option that must match across ranks."""
        return self.config.describe()

    def state_dict(self, gather: bool = False) -> dict[str, Any]:
        """This rank's residuals (and DGC velocities) by parameter name, the iteration counter,
        and whose state it is (rank, world size, options); see :mod:`gradwire.checkpoint`.

        ``gather=True`` is a collective for frameworks that save from rank 0 only: call it on
        every rank; rank 0's dict holds every rank's state, and loading it on every rank gives
        each rank its own.
        """
        if self.feedback is not None and self.feedback.residuals and not self._names:
            raise ValueError("state_dict needs parameter names: pass model= to CommHookState or call attach(model)")
        residuals = velocities = None
        if self.feedback is not None:
            residuals = self.feedback.state_dict(self._names)
            if isinstance(self.feedback, MomentumCorrection):
                velocities = {self._names[k]: v for k, v in self.feedback.velocities.items() if k in self._names}
        world = world_size_of(self.process_group)
        local = checkpoint.build_state(rank=self._rank(), world_size=world, config=self.describe(),
                                       iteration=self.iteration, residuals=residuals, velocities=velocities)
        return checkpoint.gather_state(local, self._specs, self.process_group) if gather else local

    def load_state_dict(self, state: dict[str, Any], device: "torch.device | str" = "cpu") -> None:
        """Restore :meth:`state_dict` output, this rank's own or the gathered form (tensors moved to
        ``device``, the gradients' device). Raises ``ValueError`` for another rank's state, another
        world size, other options, or tensors that do not fit the model (nothing is changed then)."""
        if not self._names:
            raise ValueError("load_state_dict needs parameter names: pass model= to CommHookState or call attach(model)")
        kinds = () if self.feedback is None else \
            ("residuals", "velocities") if isinstance(self.feedback, MomentumCorrection) else ("residuals",)
        mine = checkpoint.select_state(state, rank=self._rank(), world_size=world_size_of(self.process_group),
                                       config=self.describe(), specs=self._specs, kinds=kinds)
        keys = {name: key for key, name in self._names.items()}
        self.iteration = mine.iteration
        self._reset_exchange()  # every rank restarts from the same point
        if self.feedback is not None:
            self.feedback.load_state_dict(mine.residuals, keys, {keys[n]: torch.device(device) for n in mine.residuals})
            if isinstance(self.feedback, MomentumCorrection):
                self.feedback.load_velocities({keys[n]: t.to(device) for n, t in mine.velocities.items()})

    def _rank(self) -> int:
        return dist.get_rank(self.process_group) if world_size_of(self.process_group) > 1 else 0

    def __getstate__(self) -> dict[str, Any]:
        # process groups cannot be pickled (as PyTorch's PowerSGDState does, drop it); neither
        # can what is in flight, and frame sizes must restart from a length round on every rank
        state = dict(self.__dict__)
        state.update(process_group=None, _pending=None, _step_groups=[], _in_flight=[], _last_step=[],
                     _strategies=None, _context=None, _step_end=None, _calibration=None, _choices={})
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    # ------------------------------------------------------------------------- the exchange
    def run_bucket(self, index: int, buffer: torch.Tensor, parameters: Sequence[torch.Tensor],
                   gradients: Sequence[torch.Tensor], is_last: bool) -> torch.futures.Future:
        """Process one bucket; returns a Future of ``buffer`` holding the averaged gradient.

        The Future resolves at the step's last bucket, once every rank agreed the step
        succeeded (see :mod:`gradwire.hook.step`); the exchange itself starts at once.
        """
        if not self._checked:
            check_same_on_all_ranks(self.describe(), self.process_group, timeout=self.config.collective_timeout)
            self._checked = True
        if self._pending is None and not self._step_groups:  # the step's first bucket
            self._last_step = []
        devices = [buffer.device] if buffer.device.type == "cuda" else None
        future: torch.futures.Future = torch.futures.Future(devices=devices)
        group = self._pending if self._pending is not None else BucketGroup(buffers=[])
        offset = group.numel
        for position, (parameter, grad) in enumerate(zip(parameters, gradients)):
            key = id(parameter)
            tensor_id = self._param_index.get(key, index * 100_003 + position)
            group.entries.append(Entry(key, tensor_id, grad, offset + offset_in(buffer, grad)))
        group.buffers.append(buffer)
        group.futures.append(future)
        if self.config.scope == "global" and not is_last and self.iteration >= self.config.warmup_steps:
            self._pending = group  # exchanged when the iteration's last bucket arrives
            return future
        self._pending = None
        self._step_groups.append(group)
        try:
            with time_limit(self.config.collective_timeout):  # blocking rounds (sparse, calibration)
                self._in_flight.append(self._exchange(group))
        except BaseException as error:  # recorded; every rank fails this step together
            group.mark_failed(error)
        for exchange in self._in_flight:  # decode what has arrived while backward goes on
            if exchange.done():
                exchange.complete()
        if is_last:
            self._end_step()
        return future

    def _exchange(self, group: BucketGroup) -> Exchange:
        """Choose the group's strategy (the same on every rank) and start it."""
        strategies = self._strategies_for_step()
        context = self._context
        assert context is not None
        context.stats.add("bytes_dense", ring_allreduce_bytes(group.numel, group.buffers[0].element_size(),
                                                              context.world_size))
        finite = all(all_finite(b) for b in group.buffers)
        config = self.config
        if self.sparsifier is None or self.iteration < config.warmup_steps or config.collective == "dense":
            return strategies["dense"].start(group)
        if finite or self.sparsifier.shared_support:
            assert self._selection is not None
            self._selection.run(group, self.iteration, finite)
        if self.sparsifier.shared_support:
            if config.collective == "allreduce" or (config.collective == "auto"
                                                    and self.value_codec.name in CAST_VALUE_CODECS):
                return strategies["allreduce"].start(group, finite=finite)
            return strategies["allgather"].start(group, finite=finite)
        name = self._per_rank_strategy(group)
        k = self._target_k(group)
        if name == "hierarchical":
            self._selection.compensate(group, finite, detect_unused=False)
            return strategies["hierarchical"].start(group, finite=finite, k=k)
        if finite:
            assert self._selection is not None
            self._selection.run(group, self.iteration, finite)
        if name == "sparse-allreduce":
            return strategies["sparse-allreduce"].start(group, finite=finite, k=k)
        if name == "dense":
            return strategies["dense"].start(group, compensated=True, finite=finite)
        return strategies["allgather"].start(group, finite=finite)

    def _target_k(self, group: BucketGroup) -> int:
        """The group's k for a second selection: the sum of the sparsifier's per-parameter targets
        (the same on every rank); every entry when the sparsifier has no target (threshold)."""
        assert self.sparsifier is not None
        total = 0
        for entry in group.entries:
            target = self.sparsifier.target_k(entry.numel)
            if target is None:
                return group.numel
            total += target
        return total

    def _per_rank_strategy(self, group: BucketGroup) -> str:
        """allgather / sparse-allreduce / hierarchical / dense for a per-rank support."""
        config = self.config
        if config.collective == "sparse-allreduce":
            return "hierarchical" if self._local_size() > 1 else "sparse-allreduce"
        if config.collective != "auto" or self._context is None or self._context.world_size == 1:
            return "allgather"
        signature = group.signature()
        if signature not in self._choices:
            if self._calibration is None:
                self._calibration = calibrate(self.process_group, self._context.world_size,
                                              index_codec=self.index_codec, value_codec=self.value_codec,
                                              link_gbit=config.link_gbit, link_alpha=config.link_alpha)
            k = self._target_k(group)
            costs = candidates(numel=group.numel, k=k, world_size=self._context.world_size,
                               bytes_per_entry=entry_bytes(self.index_codec, self.value_codec, numel=group.numel, k=k),
                               sparse_allreduce=self.index_codec.lossless, local_size=self._local_size())
            self._choices[signature] = choose_strategy(self._calibration, costs, intra=IN_NODE_LINK)
        return self._choices[signature]

    def _local_size(self) -> int:
        if self.config.hierarchy is None or self._context is None:
            return 1
        return local_size_of(self.config.hierarchy, self._context.world_size)

    def _strategies_for_step(self) -> dict[str, ExchangeStrategy]:
        if self._strategies is None:
            world = world_size_of(self.process_group)
            rank = dist.get_rank(self.process_group) if world > 1 else 0
            self._context = ExchangeContext(self.config, self.value_codec, self.index_codec, self.process_group,
                                            world, rank, self._stats)
            dense = DenseAllReduce(self._context)
            self._strategies = {
                "dense": dense,
                "allreduce": SharedSupportAllReduce(self._context),
                "allgather": PayloadAllGather(self._context, dense, count_slack(self.sparsifier)),
                "sparse-allreduce": SparseAllReduce(self._context),
            }
            if self.sparsifier is not None:
                self._strategies["hierarchical"] = HierarchicalExchange(self._context, self.sparsifier)
            self._step_end = StepEnd(self.config, self.process_group, world, self._stats, self.feedback)
        assert self._context is not None
        self._context.step = self.iteration
        return self._strategies

    def _reset_exchange(self) -> None:
        self._pending, self._step_groups, self._in_flight, self._last_step = None, [], [], []
        self._choices = {}
        if self._strategies is not None:
            for strategy in self._strategies.values():
                strategy.reset()

    def _end_step(self) -> None:
        """Wait, settle second rounds, agree, resolve (see :mod:`gradwire.hook.step`)."""
        groups, in_flight = self._step_groups, self._in_flight
        self._step_groups, self._in_flight = [], []
        step_end = self._step_end
        assert step_end is not None
        step_end.wait(groups, in_flight, self.iteration)
        self._last_step = in_flight
        for strategy in (self._strategies or {}).values():
            try:
                strategy.settle()
            except BaseException as error:  # a strategy records its own failures; this is a bug guard
                for group in groups:
                    group.mark_failed(error)
        step_end.finish(groups, self.iteration)
        self.iteration += 1
        self._stats.end_step()
        if self.config.log_every and self.iteration % self.config.log_every == 0:
            logger.info("gradwire step %d: %s", self.iteration, self.stats())


def comm_hook(state: CommHookState, bucket: dist.GradBucket) -> torch.futures.Future:
    """DDP communication hook: ``ddp_model.register_comm_hook(state, gradwire.comm_hook)``.

    Returns a Future of the bucket's buffer holding the gradient averaged over ranks.
    """
    return state.run_bucket(bucket.index(), bucket.buffer(), bucket.parameters(), bucket.gradients(), bucket.is_last())


# DDP inspects the hook's annotations at registration; with postponed evaluation they would be
# strings, so give it the real objects.
comm_hook.__annotations__ = {
    "state": CommHookState,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}
