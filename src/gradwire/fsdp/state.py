"""``gradwire.fsdp.compress``: a compressed reduce-scatter on every FSDP2 module, and its state.

1. ``compress(model, ...)`` installs a :class:`CompressedReduceScatter` on every ``FSDPModule``
   (``set_custom_reduce_scatter``) and makes FSDP include zero gradients for parameters a step
   did not use (``set_reduce_scatter_unused_params``), so every call's layout is the module's
   whole parameter list;
2. each call (one per module per step, on backward's thread) is one module's part of the step's
   round of the core: a :class:`~gradwire.core.group.Group` over FSDP's flat input, one entry per
   (parameter, destination chunk) (:mod:`.layout`), a :class:`~gradwire.core.group.ShardTarget`
   whose result is FSDP's output shard, and ``Pipeline.start``, which encodes it and launches its
   collective. FSDP2 then only views the output as the module's sharded gradients, so the
   exchange stays in flight while the backward goes on (``compress(defer=True)``, the default)
   and is completed — waited for, decoded, written, or its group failed — at the step's last
   module, before the agreement; the transfer overlaps the next modules' backward instead of
   holding the thread. Where FSDP2 reads the output right after the call (it divides a ``SUM``
   afterwards, casts to the parameters' dtype, accumulates into existing gradients, offloads to
   the CPU, or runs an all-reduce or post-accumulate-grad hook) and with HSDP, the call completes
   its exchange before returning (:meth:`FSDPCompressionState._may_defer`). A callback queued at
   the backward's end completes anything still in flight, so no optimizer step reads an unwritten
   gradient; nothing is agreed yet and no residual changes;
3. at the step's last module (every module has reduced once), one ``Pipeline.agree`` over all of
   the step's groups, and the verdict: apply (every module's residuals change), skip (zeros: this
   module's shard and the sharded gradients FSDP already took from the earlier ones), or raise on
   every rank alike (the typed error also stays on the state:
   :meth:`FSDPCompressionState.raise_if_failed`). One agreement per step rather than per module:
   a collective's latency per module saved, and a step either applies everywhere or nowhere.

HSDP (``fully_shard`` on a 2-D mesh, replicate x shard): FSDP2 would all-reduce each shard across
replicas itself, densely, after the reduce-scatter, with no public switch to replace it
(``set_requires_all_reduce(False)`` is gradient accumulation: FSDP then keeps the partial shard
and assigns no gradient; the all-reduce hook runs *after* the native all-reduce). FSDP2's own
extension point for a custom HSDP is the 1-D reduction (its code says so where it picks the
all-reduce stream). So ``compress`` gives each HSDP parameter group the 1-D view of its mesh for
the reduction (:func:`_reduce_in_one_dimension`, the one private attribute this module writes;
parameters, all-gathers and DTensor placements keep the 2-D mesh), and the compressed
reduce-scatter sums each shard across replicas itself, in the same round: one agreement, one
verdict, and residuals that change only when both stages succeeded on every rank.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Hashable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from ..core import checkpoint
from ..core.config import ExchangeConfig
from ..core.feedback import ErrorFeedback
from ..core.group import Entry, Group, Replicas, ShardTarget, Status
from ..core.pipeline import Pipeline
from ..core.round import RAISE, SKIP
from ..core.strategies import Exchange
from ..errors import check_choice
from ..exchange.collectives import check_same_on_all_ranks
from . import layout
from .all_gather import ALL_GATHER_BITS, AllGatherStats, CompletedWork, QuantizedAllGather
from .momentum import MomentumBases

logger = logging.getLogger("gradwire")

_ALLOWED_OPS = (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.PREMUL_SUM)


@dataclass
class _Unit:
    """One FSDP module's reduce-scatter: its parameters in FSDP's order and where their state goes."""

    name: str
    param_group: Any  # FSDPParamGroup (torch-private type, read for its divide factor and parameters)
    keys: list[Hashable]  # per parameter: the residual key's first part
    tensor_ids: list[int]  # per parameter: its index among the model's parameters
    shapes: list[tuple[int, ...]]
    dtype: torch.dtype  # the residuals' dtype before storage (float32: float64 is refused)
    replicas: Optional[dist.ProcessGroup]
    replica_size: int

    @property
    def replica_key(self) -> Hashable:
        return ("replicas", self.name)


@dataclass
class _Reduced:
    """One module's part of the step's round: completed, or in flight until the step's end (``deferred``)."""

    unit: _Unit
    group: Group
    exchange: Exchange
    output: torch.Tensor
    deferred: bool = False


def _grads_view(unit: _Unit, output: torch.Tensor) -> bool:
    """Whether every sharded gradient FSDP assigned from ``unit``'s reduce-scatter lies in ``output``'s storage."""
    storage = output.untyped_storage().data_ptr()
    for fsdp_param in getattr(unit.param_group, "fsdp_params", ()):
        grad = getattr(fsdp_param.sharded_param, "grad", None)
        if grad is None:
            continue
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        if local.numel() and local.untyped_storage().data_ptr() != storage:
            return False
    return True


def _zero_sharded_grads(unit: _Unit) -> None:
    """Zero the sharded gradients FSDP assigned from ``unit``'s reduce-scatter (a skipped step)."""
    for fsdp_param in getattr(unit.param_group, "fsdp_params", ()):
        grad = getattr(fsdp_param.sharded_param, "grad", None)
        if grad is not None:
            grad.zero_()


class CompressedReduceScatter(ReduceScatter):
    """FSDP2's ``ReduceScatter`` for one module: ``comm(output, input, group, op, async_op)``.

    ``input`` is the module's flat unsharded gradient ``(p s,)`` in FSDP's reduce dtype, chunk by
    rank (padded); ``output`` ``(s,)`` receives this rank's shard of the sum divided as ``op`` and
    FSDP's divide factors say (see :meth:`FSDPCompressionState.divisor`).
    """

    def __init__(self, state: "FSDPCompressionState", unit: _Unit) -> None:
        self.state, self.unit = state, unit

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False) -> Optional[dist.Work]:
        self.state.reduce_scatter(self.unit, output_tensor, input_tensor, group, op)
        return CompletedWork() if async_op else None


class FSDPCompressionState:
    """Options and memory of gradwire's compressed reduce-scatter for one FSDP2 model; what
    :func:`compress` returns. A thin FSDP adapter over the compression core
    (:class:`~gradwire.core.pipeline.Pipeline`, ``self.pipeline``).

    Args:
        model: the model, after ``fully_shard`` (its FSDP modules and parameter names).
        config: an :class:`~gradwire.ExchangeConfig` (see :func:`compress` for the options).
        momentum: ``b1`` of 1-bit Adam's exchange (:mod:`.momentum`), or None: gradients are sent.

    Raises:
        ValueError: no FSDP module with parameters; several parameter groups per module (per-parameter
            meshes); a parameter not sharded on dim 0; modules on different meshes; a mesh that is
            neither 1-D nor HSDP's 2-D; float64 gradients; an option the reduce-scatter cannot honour.
    """

    def __init__(self, model: nn.Module, config: ExchangeConfig, momentum: Optional[float] = None) -> None:
        check_config(config)
        check_momentum(momentum, config)
        self.config = config
        self.model = model
        self.units, self.process_group = _units(model)
        if momentum is not None and any(unit.replicas is not None for unit in self.units):
            raise ValueError("momentum= is not supported with HSDP (a 2-D mesh): a rank's base would have to span "
                             "both stages; use a 1-D mesh")
        #: what each module sent on the last applied step, with ``compress(momentum=b1)`` (None: gradients sent)
        self.momentum_bases: Optional[MomentumBases] = None if momentum is None else MomentumBases(momentum)
        #: the last round's verdict on every rank: "apply", "skip" or "raise" (None: no round yet)
        self.last_action: Optional[str] = None
        self.pipeline = Pipeline(config, self.process_group, spare_buffers=False)
        self.iteration = 0
        #: the typed error of the last round that failed (FSDP's autograd hooks may re-wrap it)
        self.error: Optional[BaseException] = None
        self._called: set[int] = set()
        #: whether an end-of-backward callback is queued for this backward (see _end_of_backward_armed)
        self._armed = False
        #: let a module's exchange stay in flight until the step's last module (compress(defer=...))
        self.defer = True
        #: the latest completed reduce-scatters' ``Work`` (see _complete)
        self._held_works: list[Any] = []
        #: this step's modules so far: completed (written or failed), agreed at the step's last module
        self._pending: list[_Reduced] = []
        self._names: dict[Hashable, str] = {}
        self._specs: dict[str, checkpoint.ParameterSpec] = {}
        #: compress(all_gather=...)'s counters (None: FSDP2's own all-gather)
        self.all_gather_stats: Optional[AllGatherStats] = None
        for unit in self.units:
            shard_size = _shard_size(unit)
            for key, name, shape in zip(unit.keys, _parameter_names(model, unit), unit.shapes):
                numel = layout.chunk_numel(shape, shard_size)
                for chunk in range(shard_size):
                    self._names[(key, chunk)] = f"{name}#{chunk}"
                    self._specs[f"{name}#{chunk}"] = checkpoint.ParameterSpec(numel, unit.dtype)
            if unit.replicas is not None:
                self._names[unit.replica_key] = f"{unit.name or '<root>'}#replicas"
                self._specs[f"{unit.name or '<root>'}#replicas"] = checkpoint.ParameterSpec(
                    layout.shard_numel(unit.shapes, shard_size), unit.dtype)

    # ----------------------------------------------------------------------------- public
    @property
    def feedback(self) -> Optional[ErrorFeedback]:
        """This rank's error-feedback memory (None without error feedback)."""
        return self.pipeline.feedback

    def stats(self) -> dict[str, float]:
        """Last step's (every module's reduce-scatter) and cumulative bytes and seconds; see
        :class:`gradwire.core.stats.ExchangeStats`. ``bytes_dense`` is what plain FSDP2 sends."""
        snapshot = self.pipeline.stats.snapshot()
        snapshot["residual_norm"] = self.feedback.norm() if self.feedback is not None else 0.0
        snapshot["residual_bytes"] = float(self.residual_bytes())
        if self.all_gather_stats is not None:  # compress(all_gather=...): the parameter all-gathers, cumulative
            gathered = self.all_gather_stats
            snapshot.update(all_gather_bytes_sent_total=gathered.bytes_sent,
                            all_gather_bytes_dense_total=gathered.bytes_dense,
                            all_gather_calls_total=float(gathered.calls),
                            seconds_all_gather_total=gathered.seconds)
        return snapshot

    def residual_bytes(self) -> int:
        """Bytes this rank's residuals hold now (4 n, or 2 n with ``residual_dtype="bfloat16"``,
        for the unsharded gradient's n elements)."""
        if self.feedback is None:
            return 0
        return sum(r.numel() * r.element_size() for r in self.feedback.residuals.values())

    def describe(self) -> str:
        """A canonical string of every option that must match across ranks."""
        return self.config.describe()

    def raise_if_failed(self) -> None:
        """Raise the typed error of the last failed round (``CollectiveError``, ``DecodeError``,
        ``DivergenceError``, ``NonFiniteGradientError``, ``StepFailedError``), if any, and forget it:
        FSDP's autograd hooks may hand the caller of ``backward()`` another exception type."""
        error, self.error = self.error, None
        if error is not None:
            raise error

    def state_dict(self, gather: bool = False) -> dict[str, Any]:
        """This rank's residuals (per parameter chunk ``"name#j"``, and per module ``"module#replicas"``
        with HSDP), the step counter and whose state it is (rank, world size, options); see
        :mod:`gradwire.core.checkpoint`. ``gather=True`` is a collective (rank 0 gets every rank's)."""
        state = self.pipeline.state_dict(names=self._names, specs=self._specs, iteration=self.iteration,
                                         gather=gather)
        if self.momentum_bases is None:
            return state
        if not gather:
            state["momentum_bases"] = self.momentum_bases.state_dict()
            return state
        # the gathered form: each rank's entry carries that rank's bases (what it sent is its own)
        every = self.momentum_bases.gathered_state_dicts([unit.name for unit in self.units], self.process_group)
        own = self.momentum_bases.state_dict()
        for entry in state["ranks"]:
            entry["momentum_bases"] = every[entry["rank"]] if every is not None else own
        return state

    def load_state_dict(self, state: dict[str, Any], device: "torch.device | str | None" = None) -> None:
        """Restore :meth:`state_dict` output (this rank's own or the gathered form); tensors go to
        ``device`` (default: the parameters'). Raises ``ValueError`` for another rank's state,
        another world size, other options, or tensors that do not fit (nothing changes then)."""
        if device is None:
            device = next(self.model.parameters()).device
        state, saved_bases = _without_bases(state, self.pipeline.rank())
        if (self.momentum_bases is None) != (saved_bases is None):
            raise ValueError("this state was saved " + ("with" if saved_bases is not None else "without")
                             + " compress(momentum=...) and is loaded " + ("without" if self.momentum_bases is None
                                                                        else "with") + " it")
        if self.momentum_bases is not None:
            shard_sizes = {unit.name: _shard_size(unit) for unit in self.units}
            check = MomentumBases(self.momentum_bases.beta)  # validated before anything changes
            check.load_state_dict(saved_bases, {
                unit.name: shard_sizes[unit.name] * layout.shard_numel(unit.shapes, shard_sizes[unit.name])
                for unit in self.units})
        self.iteration = self.pipeline.load_state_dict(state, names=self._names, specs=self._specs, device=device)
        if self.momentum_bases is not None:
            self.momentum_bases = check
        self._called, self._pending, self.error, self._armed = set(), [], None, False

    # ------------------------------------------------------------------------- the exchange
    def divisor(self, unit: _Unit, op: Any, shard_size: int) -> float:
        """What the sum over ranks is divided by before it is written.

        FSDP2 asks for a mean (``AVG``: over the shard group, or with HSDP over every rank), for a
        division by its ``gradient_divide_factor`` (``PREMUL_SUM``, or ``AVG`` when the factor is
        the shard group's size), or for a ``SUM`` that it divides itself before and after the call
        (``set_force_sum_reduction_for_comms``, fp16): by the factor, else the 1-D group's size.
        With HSDP the intended total is the factor, else the size of both dimensions; this returns
        what remains of it after FSDP's own division.
        """
        if not any(op == allowed for allowed in _ALLOWED_OPS):  # a PREMUL_SUM(x) is only equal from its own side
            raise ValueError(f"gradwire's reduce-scatter supports SUM, AVG and PREMUL_SUM, not {op}")
        factor = unit.param_group.gradient_divide_factor
        intended = float(factor) if factor is not None else float(shard_size * unit.replica_size)
        by_fsdp = 1.0
        if op == dist.ReduceOp.SUM:
            by_fsdp = float(factor) if factor is not None else float(shard_size)
        return intended / by_fsdp

    def reduce_scatter(self, unit: _Unit, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup,
                       op: Any) -> None:
        """One module's part of the step's round: the core's exchange of ``input`` into ``output``
        (module docstring); at the step's last module, the one agreement.

        Raises:
            ValueError: the input does not have the module's layout (nothing was sent).
            At the step's last module, the round's error (every rank raises at the same module and
                step): see :meth:`raise_if_failed`.
        """
        self.pipeline.check_config()
        shard_size = group.size()
        expected = layout.shard_numel(unit.shapes, shard_size)
        if output.numel() != expected or input.numel() != shard_size * expected:
            raise ValueError(f"gradwire.fsdp: module {unit.name or '<root>'!r} reduce-scatters {input.numel()} -> "
                             f"{output.numel()} elements; its parameters' layout is {shard_size} x {expected}")
        index = self.units.index(unit)
        if index in self._called:  # a module reduced twice: the last step ended without some module
            self._close_step()
        if self.momentum_bases is not None and self.iteration >= self.config.warmup_steps:
            self.momentum_bases.blend(unit.name, input)  # 1-bit Adam's exchange: this rank's momentum goes out
        entries = [Entry((unit.keys[piece.parameter], piece.chunk),
                         unit.tensor_ids[piece.parameter] * shard_size + piece.chunk,
                         input[piece.offset: piece.offset + piece.numel], piece.offset)
                   for piece in layout.pieces(unit.shapes, shard_size)]
        replicas = None if unit.replicas is None else Replicas(unit.replicas, unit.replica_key, -1 - index)
        target = ShardTarget(input, output, group=group, replicas=replicas)
        round_group = Group(target, entries, divisor=self.divisor(unit, op, shard_size))
        step = self.iteration
        exchange = self.pipeline.start(round_group, step)
        in_flight = exchange.launched is not None and exchange.launched.work is not None
        deferred = in_flight and self._may_defer(unit, output, op)
        if not deferred:
            self._complete([round_group], [exchange])  # written (or failed); nothing agreed yet
        # the round waits for the step's last module: let FSDP free this module's unsharded gradient
        # meanwhile (held by every module until the agreement it was ~180 MB of step memory more at
        # 25.5M parameters, 4 ranks: docs/fsdp.md, "Peak memory per rank"); an exchange in flight
        # reads only its own buffers from here on
        round_group.release_exchange_inputs()
        self._pending.append(_Reduced(unit, round_group, exchange, output, deferred))
        self._called.add(index)
        if len(self._called) == len(self.units):
            self._close_step()

    def _may_defer(self, unit: _Unit, output: torch.Tensor, op: Any) -> bool:
        """Whether ``unit``'s exchange may stay in flight until the step's last module (module
        docstring, step 2): FSDP2 must do nothing with ``output`` after this call but view it as
        the sharded gradients, which it does unless it divides it afterwards (``SUM``), casts it
        to the parameters' dtype (a copy), adds it to gradients that exist (accumulation), copies
        it to the CPU (offloading), or hands it to an all-reduce hook or a post-accumulate-grad
        hook. Anything else: completed now, as before. Deferred or not, the collectives start in
        the same order on every rank, so ranks may differ in this answer."""
        if not self.defer or op == dist.ReduceOp.SUM or unit.replicas is not None:
            return False
        if getattr(unit.param_group, "_all_reduce_hook", None) is not None:
            return False
        for fsdp_param in getattr(unit.param_group, "fsdp_params", ()):
            sharded = fsdp_param.sharded_param
            if (sharded.grad is not None or getattr(fsdp_param, "offload_to_cpu", False)
                    or getattr(sharded, "_post_accumulate_grad_hooks", None) or sharded.dtype != output.dtype):
                return False
        return self._end_of_backward_armed()

    def _end_of_backward_armed(self) -> bool:
        """Queue, once per backward, a callback at its end that completes what is still in flight
        (the step's last module normally has; this guards a step that ended without it, so the
        optimizer never reads a gradient that was not written). False outside a backward."""
        if self._armed:
            return True
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)
        except RuntimeError:  # not inside a backward (a direct call): complete now
            return False
        self._armed = True
        return True

    def _backward_ended(self) -> None:
        self._armed = False
        if not any(reduced.deferred for reduced in self._pending):
            return
        self._complete_deferred(self._pending)
        unwritten = [r.unit.name or "<root>" for r in self._pending if r.group.status != Status.WRITTEN]
        if unwritten:  # the agreement comes with a later call; the optimizer must not read these now
            raise RuntimeError(f"gradwire.fsdp: step {self.iteration}'s backward ended before its last module's "
                               f"reduce-scatter, and the exchange of module(s) {', '.join(unwritten)} did not write "
                               "its gradients; do not step (the next step's agreement fails or skips it on every "
                               "rank)")

    def _complete(self, groups: list[Group], exchanges: list[Exchange]) -> None:
        """``Pipeline.complete`` of ``exchanges``, its wait booked as ``seconds_communicate`` (their
        decoding is ``seconds_decode``, not counted twice)."""
        stats = self.pipeline.stats
        decoding = stats.current["seconds_decode"]
        began = time.perf_counter()
        self.pipeline.complete(groups, exchanges, self.iteration)
        stats.add("seconds_communicate", time.perf_counter() - began - (stats.current["seconds_decode"] - decoding))
        # a completed reduce-scatter's Work holds its sent and received chunks (about 1.06 bytes per
        # parameter for int4): the latest completion's are held until the next one (a backend
        # thread never drops the last reference to a buffer, gradwire.lifetime), not every module's
        # until the next step, which was 36 MB more step memory at 25.5M parameters, 4 ranks
        self._held_works = [work for exchange in exchanges for work in exchange.works()]
        for exchange in exchanges:
            exchange.launched = None

    def _complete_deferred(self, pending: list[_Reduced]) -> None:
        """Wait for and write every deferred module's shard (or fail its group), in start order;
        the wait is booked as ``seconds_communicate`` (decoding as ``seconds_decode``, not twice)."""
        deferred = [reduced for reduced in pending if reduced.deferred]
        if not deferred:
            return
        self._complete([r.group for r in deferred], [r.exchange for r in deferred])
        self.pipeline.stats.add("count_deferred_reduce_scatters", float(len(deferred)))
        for reduced in deferred:
            reduced.deferred = False
            if reduced.group.status == Status.WRITTEN and not _grads_view(reduced.unit, reduced.output):
                # FSDP took a copy, not a view: the write did not reach the gradients (a torch
                # change this module's checks did not foresee); no rank may step on that
                reduced.group.mark_failed(RuntimeError(
                    f"gradwire.fsdp: module {reduced.unit.name or '<root>'!r}'s gradients are not views of its "
                    "reduce-scatter output, so the deferred write did not reach them; compress(defer=False)"))

    def _close_step(self) -> None:
        """The step's one agreement over every module's group (one AllGather of 16 bytes per rank,
        not one per module): apply, skip or raise on every rank alike."""
        pending, self._pending = self._pending, []
        self._armed = False  # the next module's call arms the next backward (also after one that raised)
        self._complete_deferred(pending)
        groups = [reduced.group for reduced in pending]
        if self.all_gather_stats is not None and groups and groups[-1].balanced_digest:
            # the parameter all-gathers of this step: their balanced share joins the round's digest
            last = groups[-1]
            share = self.all_gather_stats.take_share()
            last.digest = share if last.digest is None else last.digest ^ share
        verdict = self.pipeline.agree(groups, self.iteration)
        self.last_action = verdict.action
        if self.momentum_bases is not None and verdict.action not in (RAISE, SKIP) \
                and self.iteration >= self.config.warmup_steps:
            for reduced in pending:  # only an applied step moves the bases, as it moves the residuals
                self.momentum_bases.record(reduced.unit.name, reduced.group)
        self._end_step()
        if verdict.action == RAISE:
            assert verdict.error is not None
            self.error = verdict.error
            raise verdict.error
        if verdict.action == SKIP:
            for reduced in pending:
                reduced.output.zero_()
                if reduced is not pending[-1]:  # FSDP already took the earlier modules' shards as gradients
                    _zero_sharded_grads(reduced.unit)

    def _end_step(self) -> None:
        self._called = set()
        self.iteration += 1
        self.pipeline.stats.end_step()
        if self.config.log_every and self.iteration % self.config.log_every == 0:
            logger.info("gradwire.fsdp step %d: %s", self.iteration, self.stats())

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("FSDPCompressionState holds process groups and FSDP's parameter groups; save "
                        "state_dict() instead")


def compress(model: nn.Module, *, config: Optional[ExchangeConfig] = None, all_gather: Optional[str] = None,
             momentum: Optional[float] = None, defer: bool = True, **options: Any) -> FSDPCompressionState:
    """Install gradwire's compressed reduce-scatter on every ``FSDPModule`` in ``model``.

    Call it on every rank after ``fully_shard`` and before the first backward.

    Args:
        model: a model ``fully_shard`` was applied to (1-D mesh, or HSDP's 2-D replicate x shard).
        config: an :class:`~gradwire.ExchangeConfig`; or its options as keywords, those of
            :class:`~gradwire.CommHookState` (``scope``, ``hierarchy`` and ``collective`` other than
            ``"auto"``/``"dense"`` do not apply to a reduce-scatter) plus:
        quantize: ``"int8"`` or ``"int4"``: blockwise (``quantize_block`` values per float32
            scale) over one all-to-all, summed in float32 by each shard's owner (``compressor``
            defaults to ``"none"`` then); None: a sparsifier (``compressor``, ``density``, codecs).
        error_feedback: keep per rank what was not sent (residuals of the unsharded gradient).
        residual_dtype: ``"float32"`` (4 bytes per gradient element per rank) or ``"bfloat16"`` (2).
        all_gather: ``"int8"`` or ``"int4"``: also quantize the parameter all-gathers (blocks of
            ``quantize_block``, restarting at every parameter; :mod:`.all_gather`), so forward and
            backward run on parameters within half a quantization step of the exact shards the
            optimizer keeps (exact during ``warmup_steps``, like the reduce-scatter); None
            (default): FSDP2's exact all-gather.
        momentum: ``b1`` in (0, 1), e.g. 0.9: 1-bit Adam's exchange (:mod:`gradwire.fsdp.momentum`):
            after ``warmup_steps`` (>= 1) exact steps, each rank sends its momentum
            ``b1 s + (1 - b1) g`` (``s``: what it sent the step before) through the sparsifier
            with error feedback, and the optimizer must be :class:`~gradwire.fsdp.MomentumAdamW`
            built on this state. For AdamW with top-k: docs/fsdp.md. None (default): gradients.
        defer: True (default): a module's reduce-scatter stays in flight while the backward goes
            on and is completed (waited, decoded, written) at the step's last module, where FSDP2
            allows it (module docstring, step 2), and a quantized all-gather is completed where
            FSDP2 reads its result (a prefetched one travels during the current module's backward);
            False: every collective completes inside FSDP2's call.

    Returns:
        The :class:`FSDPCompressionState` (``stats()``, ``state_dict()``, ``load_state_dict()``,
        ``raise_if_failed()``).

    Raises:
        ValueError: see :class:`FSDPCompressionState`; or an invalid option (naming it).
    """
    if config is not None and options:
        raise ValueError(f"pass either config= or options, not both (got {', '.join(sorted(options))})")
    if config is None:
        if options.get("quantize") is not None:
            options.setdefault("compressor", "none")
        config = ExchangeConfig(**options)
    check_choice("all_gather", all_gather, (None, *ALL_GATHER_BITS))
    check_choice("defer", defer, (True, False))
    state = FSDPCompressionState(model, config, momentum=momentum)
    state.defer = defer
    for unit in state.units:
        for module in _modules_of(model, unit):
            module.set_custom_reduce_scatter(CompressedReduceScatter(state, unit))
            module.set_reduce_scatter_unused_params(True, recurse=False)
    if all_gather is not None or momentum is not None:
        # a rank gathering int8 codes while a peer gathers float32 would mismatch its collectives, and
        # a rank sending momenta while a peer sends gradients would sum the two: every rank compares
        # the options now, before the first forward
        check_same_on_all_ranks(f"{config.describe()};all_gather={all_gather};momentum={momentum}",
                                state.process_group, timeout=config.collective_timeout)
    if all_gather is not None:
        state.all_gather_stats = AllGatherStats()
        for unit in state.units:
            shard_size = _shard_size(unit)
            segments = [layout.chunk_numel(shape, shard_size) for shape in unit.shapes]
            for module in _modules_of(model, unit):
                module.set_custom_all_gather(QuantizedAllGather(
                    segments, bits=ALL_GATHER_BITS[all_gather], block_size=config.quantize_block,
                    timeout=config.collective_timeout, stats=state.all_gather_stats, tag=state.units.index(unit),
                    # the warm-up's steps compute with the exact parameters too; the (rank-agreed)
                    # iteration advances at the step's last reduction, after every gather of the step
                    exact_now=lambda: state.iteration < config.warmup_steps, overlap=defer))
    return state


# --------------------------------------------------------------------------------- FSDP's side
def check_config(config: ExchangeConfig) -> None:
    """``ValueError`` for an option FSDP's reduce-scatter cannot honour (before any rank starts)."""
    if config.scope != "layer":
        raise ValueError("scope='global' does not apply to FSDP: each module's reduce-scatter is its own round")
    if config.hierarchy is not None:
        raise ValueError("hierarchy does not apply to FSDP's reduce-scatter (for HSDP, fully_shard on a 2-D mesh)")
    if config.collective not in ("auto", "dense"):
        raise ValueError(f"collective={config.collective!r} does not apply to a reduce-scatter (it has one sparse "
                         "form: regions = shards); use 'auto' or 'dense'")
    if config.compressor != "none" and not config.index_codec.lossless:
        raise ValueError(f"the sparse reduce-scatter sums entries by position, so index_codec must be lossless; "
                         f"got {config.index_codec.name!r}")


def check_momentum(momentum: Optional[float], config: ExchangeConfig) -> None:
    """``ValueError`` for a ``momentum=`` the reduce-scatter cannot run (:mod:`.momentum`)."""
    if momentum is None:
        return
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0.0 < momentum < 1.0:
        raise ValueError(f"momentum={momentum!r}: must be None or a number in (0, 1), e.g. 0.9 (Adam's beta1)")
    if config.compressor == "none" or config.quantize is not None:
        raise ValueError("momentum= needs a sparsifier (compressor='topk', ...): a rank's base is the positions and "
                         f"values it sent; got compressor={config.compressor!r}, quantize={config.quantize!r}")
    if not config.error_feedback or config.momentum_correction is not None or config.feedback_decay != 1.0:
        raise ValueError("momentum= needs plain error feedback (error_feedback=True, no momentum_correction, "
                         "feedback_decay=1.0): the optimizer's step is linear in the momentum, so what is held "
                         "back must arrive later whole")
    if config.warmup_steps < 1:
        raise ValueError(f"momentum= needs warmup_steps >= 1 (exact steps while Adam's second moment moves); got "
                         f"warmup_steps={config.warmup_steps}")


def _param_group(module: FSDPModule) -> Any:
    """The module's one FSDP parameter group (None: it has no parameters of its own)."""
    groups = module._get_fsdp_state()._fsdp_param_groups
    if len(groups) > 1:
        raise ValueError("gradwire.fsdp does not support several parameter groups per module (per-parameter "
                         "meshes from shard_placement_fn): FSDP's custom reduce-scatter is one per module")
    return groups[0] if groups else None


def _units(model: nn.Module) -> tuple[list[_Unit], Optional[dist.ProcessGroup]]:
    """Every FSDP module with parameters, and the process group their rounds agree over."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        FSDPMeshInfo,
        HSDPMeshInfo,
    )

    index = {id(p): i for i, (_, p) in enumerate(model.named_parameters())}
    modules = {id(m): n for n, m in model.named_modules()}
    units, meshes = [], []
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = _param_group(module)
        if group is None or not any(p.sharded_param.requires_grad for p in group.fsdp_params):
            continue
        info = group.mesh_info
        if not isinstance(info, FSDPMeshInfo):
            raise ValueError("gradwire.fsdp needs a sharded mesh (fully_shard), not FSDP2's pure replication")
        for fsdp_param in group.fsdp_params:
            if fsdp_param.fsdp_placement.dim != 0:
                raise ValueError(f"parameter {fsdp_param._module_info.param_name!r} is sharded on dim "
                                 f"{fsdp_param.fsdp_placement.dim}; gradwire.fsdp needs dim 0 (fully_shard's default)")
        if any(p.sharded_param.dtype == torch.float64 for p in group.fsdp_params):
            raise ValueError("gradwire.fsdp reduces float32, bfloat16 or float16 gradients, not float64")
        replicas = info.replicate_process_group if isinstance(info, HSDPMeshInfo) else None
        if replicas is not None:
            _reduce_in_one_dimension(group)
        meshes.append(info.mesh)
        units.append(_Unit(
            name=modules[id(module)], param_group=group,
            keys=[id(p.sharded_param) for p in group.fsdp_params],
            tensor_ids=[index.get(id(p.sharded_param), i) for i, p in enumerate(group.fsdp_params)],
            shapes=[tuple(p._orig_size) for p in group.fsdp_params],
            dtype=torch.float32,
            replicas=replicas, replica_size=1 if replicas is None else dist.get_world_size(replicas)))
    if not units:
        raise ValueError("no FSDPModule with trainable parameters in the model: call fully_shard first")
    mesh = meshes[0]
    if any(m != mesh for m in meshes):
        raise ValueError("gradwire.fsdp needs every FSDP module on one mesh")
    if mesh.ndim == 1:
        return units, mesh.get_group()
    if mesh.ndim == 2 and mesh.size() == dist.get_world_size():
        return units, None  # HSDP: every round agrees over the whole mesh, here the world
    raise ValueError(f"gradwire.fsdp needs a 1-D mesh or a 2-D (replicate, shard) mesh over the whole world; "
                     f"got {mesh.ndim}-D of {mesh.size()} ranks")


def _reduce_in_one_dimension(param_group: Any) -> None:
    """Turn FSDP2's dense HSDP all-reduce off for ``param_group``: its reduction sees the 1-D
    (shard) view of the mesh, so FSDP reduce-scatters only (through gradwire, which sums across
    replicas itself) and then divides and assigns the gradients as for 1-D FSDP. The parameters,
    their all-gathers and DTensor placements keep the 2-D mesh (the module docstring says why)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo

    info = param_group.mesh_info
    flat = FSDPMeshInfo(mesh=info.mesh, shard_mesh_dim=info.shard_mesh_dim, replicate_mesh_dim=info.replicate_mesh_dim,
                        dp_mesh_dims=info.dp_mesh_dims, spmd_mesh=info.spmd_mesh)
    flat.reduce_scatter_process_group = info.reduce_scatter_process_group
    if flat.shard_process_group is not info.shard_process_group:
        raise RuntimeError("gradwire.fsdp: this torch's FSDP2 builds its mesh views differently; HSDP unsupported")
    if param_group.post_forward_mesh_info is info:
        param_group.post_forward_mesh_info = flat
    param_group.mesh_info = flat


def _modules_of(model: nn.Module, unit: _Unit) -> list[FSDPModule]:
    return [m for n, m in model.named_modules() if n == unit.name and isinstance(m, FSDPModule)]


def _without_bases(state: Any, rank: int) -> tuple[Any, Any]:
    """``state`` without its ``momentum_bases`` (this rank's own form, or in the gathered form this
    rank's entry's; the core checks the rest), and those bases (None where there are none)."""
    if not isinstance(state, dict):
        return state, None
    if not state.get("gathered"):
        return {key: value for key, value in state.items() if key != "momentum_bases"}, state.get("momentum_bases")
    ranks = state.get("ranks")
    if not isinstance(ranks, list):
        return state, None
    own = [entry for entry in ranks if isinstance(entry, dict) and entry.get("rank") == rank]
    stripped = [{key: value for key, value in entry.items() if key != "momentum_bases"}
                if isinstance(entry, dict) else entry for entry in ranks]
    if own:
        return {**state, "ranks": stripped}, own[0].get("momentum_bases")
    # not this rank's file: the core's check says so; whether the file has bases still decides
    # which of the two messages about momentum= is due, so report an empty set if any entry has them
    return {**state, "ranks": stripped}, ({} if any(isinstance(entry, dict) and "momentum_bases" in entry
                                                   for entry in ranks) else None)


def _shard_size(unit: _Unit) -> int:
    return unit.param_group.mesh_info.shard_mesh_size


def _parameter_names(model: nn.Module, unit: _Unit) -> list[str]:
    names = {id(p): n for n, p in model.named_parameters()}
    return [names.get(key, f"{unit.name}.{i}") for i, key in enumerate(unit.keys)]

