"""``CommHookState`` and ``comm_hook``: DDP's buckets in, DDP's Futures out.

1. each DDP bucket becomes a :class:`~gradwire.core.group.Group` over its buffer (``scope="global"``
   holds the iteration's buckets in one group until the last one arrives, after the warm-up);
2. the core starts its exchange at once (:meth:`~gradwire.core.pipeline.Pipeline.start`) and
   finishes whatever has arrived while backward goes on;
3. at the step's last bucket the core ends the round (wait, second rounds, agree, error feedback on
   success) and this adapter acts on the verdict: resolve every Future of the step, zero and
   resolve (``nonfinite="skip"``), or fail them all with the same error on every rank.

The path of one gradient is told in docs/architecture.md.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Hashable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from ..core import checkpoint
from ..core.config import ExchangeConfig
from ..core.feedback import ErrorFeedback
from ..core.group import BufferTarget, Entry, Group, offset_in
from ..core.pipeline import Pipeline
from ..core.round import APPLY, SKIP
from ..core.strategies import Exchange
from ..exchange.collectives import world_size_of
from ..fsdp.detect import refuse_fsdp

logger = logging.getLogger("gradwire")

#: The DDP hook's options are exactly the core's.
HookConfig = ExchangeConfig


class CommHookState:
    """Options and memory of the gradwire hook; one per DDP model. A thin DDP adapter over the
    compression core (:class:`~gradwire.core.pipeline.Pipeline`, ``self.pipeline``): it turns
    DDP's buckets into groups and resolves DDP's Futures by the round's verdict.

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
            :mod:`gradwire.core.planner`), ``"allreduce"`` (shared supports only), ``"allgather"``,
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
        self.pipeline = Pipeline(self.config, process_group)
        self.iteration = 0
        self._pending: Optional[Group] = None
        #: the step's groups with the Futures DDP waits on for each
        self._step_groups: list[tuple[Group, list[torch.futures.Future]]] = []
        self._in_flight: list[Exchange] = []
        #: the last step's collectives' ``Work``, held until the next step's first bucket, so no
        #: backend thread frees their tensors (gradwire.lifetime; Exchange.works)
        self._last_step: list[Any] = []
        self._names: dict[Hashable, str] = {}
        self._param_index: dict[Hashable, int] = {}
        self._specs: dict[str, checkpoint.ParameterSpec] = {}
        #: the last failed step's error, with its own type (see :meth:`raise_if_failed`)
        self.last_error: Optional[BaseException] = None
        if model is not None:
            refuse_fsdp(model)
            self.attach(model)

    # ----------------------------------------------------------------------------- public
    def __getattr__(self, name: str) -> Any:
        # options read as attributes (state.compressor, state.density, ...) come from the config
        config = self.__dict__.get("config")
        if config is not None and name in HookConfig.__dataclass_fields__:
            return getattr(config, name)
        raise AttributeError(f"{type(self).__name__!s} has no attribute {name!r}")

    @property
    def feedback(self) -> Optional[ErrorFeedback]:
        """This rank's error-feedback memory (None without error feedback)."""
        return self.pipeline.feedback

    @property
    def sparsifier(self) -> Any:
        return self.pipeline.sparsifier

    def attach(self, model: torch.nn.Module) -> None:
        """Learn parameter names (for checkpoints) and stable per-parameter ids."""
        for index, (name, parameter) in enumerate(model.named_parameters()):
            self._names[id(parameter)] = name
            self._param_index[id(parameter)] = index
        self._specs = checkpoint.parameter_specs(model)

    def stats(self) -> dict[str, float]:
        """Last step's and cumulative bytes and seconds; see :class:`gradwire.core.stats.ExchangeStats`."""
        snapshot = self.pipeline.stats.snapshot()
        snapshot["residual_norm"] = self.feedback.norm() if self.feedback is not None else 0.0
        snapshot.update(self.pipeline.summary())
        return snapshot

    def describe(self) -> str:
        """A canonical string of every option that must match across ranks."""
        return self.config.describe()

    # ------------------------------------------------------------------------ typed errors
    def raise_if_failed(self) -> None:
        """Raise the last step's error with its own type, if that step failed (then forget it).

        DDP's reducer turns an exception set on a hook's Future into ``RuntimeError("Unable to cast
        ...")``, so ``except gradwire.NonFiniteGradientError`` around ``loss.backward()`` never
        matches. The hook keeps the step's error; call this after a failed ``backward()`` (or use
        :meth:`typed_errors`) to get it back.

        Raises:
            NonFiniteGradientError, CollectiveError, DivergenceError, StepFailedError, DecodeError:
                the last step's failure, the same on every rank.
        """
        error, self.last_error = self.last_error, None
        if error is not None:
            raise error

    @contextlib.contextmanager
    def typed_errors(self) -> Iterator[None]:
        """``with state.typed_errors(): loss.backward()``: a failed step raises its gradwire error
        (``NonFiniteGradientError``, ``CollectiveError``, ...) instead of DDP's ``RuntimeError``.

        Raises:
            the hook's typed error, chained to DDP's ``RuntimeError``; any other exception as is.
        """
        self.last_error = None
        try:
            yield
        except RuntimeError as wrapped:
            error, self.last_error = self.last_error, None
            if error is None or error is wrapped:
                raise
            raise error from wrapped

    def state_dict(self, gather: bool = False) -> dict[str, Any]:
        """This rank's residuals (and DGC velocities) by parameter name, the iteration counter,
        and whose state it is (rank, world size, options); see :mod:`gradwire.core.checkpoint`.

        ``gather=True`` is a collective for frameworks that save from rank 0 only: call it on
        every rank; rank 0's dict holds every rank's state, and loading it on every rank gives
        each rank its own.
        """
        return self.pipeline.state_dict(names=self._names, specs=self._specs, iteration=self.iteration, gather=gather)

    def load_state_dict(self, state: dict[str, Any], device: "torch.device | str" = "cpu") -> None:
        """Restore :meth:`state_dict` output, this rank's own or the gathered form (tensors moved to
        ``device``, the gradients' device). Raises ``ValueError`` for another rank's state, another
        world size, other options, or tensors that do not fit the model (nothing is changed then)."""
        self.iteration = self.pipeline.load_state_dict(state, names=self._names, specs=self._specs, device=device)
        self._pending, self._step_groups, self._in_flight, self._last_step = None, [], [], []

    def __getstate__(self) -> dict[str, Any]:
        # process groups cannot be pickled (as PyTorch's PowerSGDState does, drop it); neither
        # can what is in flight
        state = dict(self.__dict__)
        state.update(process_group=None, _pending=None, _step_groups=[], _in_flight=[], _last_step=[])
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    # ------------------------------------------------------------------------- the exchange
    def run_bucket(self, index: int, buffer: torch.Tensor, parameters: Sequence[torch.Tensor],
                   gradients: Sequence[torch.Tensor], is_last: bool) -> torch.futures.Future:
        """Process one bucket; returns a Future of ``buffer`` holding the averaged gradient.

        The Future resolves at the step's last bucket, once every rank agreed the step
        succeeded (see :mod:`gradwire.core.round`); the exchange itself starts at once.
        """
        self.pipeline.check_config()
        if self._pending is None and not self._step_groups:  # the step's first bucket
            self._last_step = []
        devices = [buffer.device] if buffer.device.type == "cuda" else None
        future: torch.futures.Future = torch.futures.Future(devices=devices)
        if self._pending is None:
            self._pending = Group(BufferTarget(), divisor=float(world_size_of(self.process_group)))
            self._step_groups.append((self._pending, []))
        group, futures = self._step_groups[-1]
        offset = group.numel
        for position, (parameter, grad) in enumerate(zip(parameters, gradients)):
            key = id(parameter)
            tensor_id = self._param_index.get(key, index * 100_003 + position)
            group.entries.append(Entry(key, tensor_id, grad, offset + offset_in(buffer, grad)))
        group.target.buffers.append(buffer)
        futures.append(future)
        if self.config.scope == "global" and not is_last and self.iteration >= self.config.warmup_steps:
            return future  # exchanged when the iteration's last bucket arrives
        self._pending = None
        self._in_flight.append(self.pipeline.start(group, self.iteration))
        self.pipeline.poll(self._in_flight)  # decode what has arrived while backward goes on
        if is_last:
            self._end_step()
        return future

    def _end_step(self) -> None:
        """The round's end, then DDP's Futures by the verdict (see :mod:`gradwire.core.round`)."""
        step_groups, in_flight = self._step_groups, self._in_flight
        self._step_groups, self._in_flight = [], []
        groups = [group for group, _ in step_groups]
        verdict = self.pipeline.finish(groups, in_flight, self.iteration)
        self._last_step = [work for exchange in in_flight for work in exchange.works()]
        for group, futures in step_groups:
            if verdict.action == SKIP:
                group.target.zero()
            for buffer, future in zip(group.target.buffers, futures):
                if future.done():
                    continue
                if verdict.action in (APPLY, SKIP):
                    future.set_result(buffer)
                else:
                    future.set_exception(verdict.error)
        if verdict.action not in (APPLY, SKIP):
            self.last_error = verdict.error
        self.iteration += 1
        self.pipeline.stats.end_step()
        if self.config.log_every and self.iteration % self.config.log_every == 0:
            logger.info("gradwire step %d: %s", self.iteration, self.stats())


def comm_hook(state: CommHookState, bucket: dist.GradBucket, *unexpected: Any) -> torch.futures.Future:
    """DDP communication hook: ``ddp_model.register_comm_hook(state, gradwire.comm_hook)``.

    Returns a Future of the bucket's buffer holding the gradient averaged over ranks.

    Raises:
        TypeError: called as another wrapper's hook (FSDP1 passes three arguments).
    """
    if unexpected or not isinstance(bucket, dist.GradBucket):
        raise TypeError("gradwire.comm_hook is a DistributedDataParallel hook; FSDP shards its gradients: use "
                        "gradwire.fsdp.compress(model, ...) for FSDP2 models")
    return state.run_bucket(bucket.index(), bucket.buffer(), bucket.parameters(), bucket.gradients(), bucket.is_last())



# DDP inspects the hook's annotations at registration; with postponed evaluation they would be
# strings, so give it the real objects.
comm_hook.__annotations__ = {
    "state": CommHookState,
    "bucket": dist.GradBucket,
    "unexpected": Any,
    "return": torch.futures.Future[torch.Tensor],
}
