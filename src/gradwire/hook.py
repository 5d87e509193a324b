"""The DDP communication hook: sparsify, encode and exchange each bucket, with error feedback.

In the manner of ``torch.distributed.algorithms.ddp_comm_hooks``: a plain state object and a
function ``comm_hook(state, bucket) -> Future[Tensor]``.

>>> import torch, torch.distributed as dist, gradwire
>>> from torch.nn.parallel import DistributedDataParallel as DDP
>>> dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29517", rank=0, world_size=1)
>>> model = DDP(torch.nn.Linear(64, 10))
>>> state = gradwire.CommHookState(compressor="topk", density=0.1, index_codec="rice", model=model)
>>> model.register_comm_hook(state, gradwire.comm_hook)          # the one added line
>>> model(torch.randn(8, 64)).sum().backward()
>>> state.stats()["step"]
1
>>> dist.destroy_process_group()

The path of one bucket (layer scope, per-rank supports):

1. ``compensated = grad + residual`` for each parameter in the bucket (error feedback);
2. the sparsifier selects positions of ``compensated`` (per parameter, or once over all
   buckets of the iteration for ``scope="global"``);
3. all parameters' (values, indices) are encoded into one payload (value and index codecs);
4. the first time a bucket layout is seen, ranks exchange payload lengths (blocking; with
   ``collective="auto"`` the cost model compares the padded AllGather against a dense
   AllReduce on exactly those lengths, so every rank decides the same) and then the payloads;
   from then on one AllGather of fixed-size frames (length + payload, sized from the lengths
   seen so far, so identical on all ranks) carries both and backward never waits for it. A
   payload that outgrows its frame sends the rest in a second round at the step's last bucket;
5. the AllGather's callback decodes every rank's payload, sums in rank order (so all ranks get
   bit-identical results) and stores ``residual = compensated - what was received``.

Shared-support sparsifiers (``randomk``, ``randomblock``) pick the same positions on every rank,
so step 3-5 become one AllReduce of the selected values (no indices on the wire).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Hashable, Optional, Sequence

import torch
import torch.distributed as dist

from . import checkpoint
from . import codecs as codec_layer
from .bucket_payload import Part, decode_bucket, encode_bucket
from .errors import DecodeError, check_choice
from .exchange import (
    COLLECTIVES,
    FRAME_HEADER_BYTES,
    ByteGather,
    CostModel,
    allreduce_sum,
    check_same_on_all_ranks,
    gather_frames,
    gather_overflow,
)
from .exchange.collectives import world_size_of
from .exchange.cost import ring_allreduce_bytes
from .feedback import ErrorFeedback, MomentumCorrection, accumulation_dtype
from .sparsify import get_sparsifier, select_global, sparsifiers
from .stats import ExchangeStats

logger = logging.getLogger("gradwire")

SCOPES = ("layer", "global")
NONFINITE_POLICIES = ("raise", "skip")
#: Value codecs an AllReduce of values can apply (a cast); others need the AllGather path.
CAST_VALUE_CODECS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
#: Frame size for a group of buckets, relative to the longest payload seen: room for ordinary
#: step-to-step variation of the coded size, plus the count's own variation where the
#: sparsifier's count may vary (sampled top-k: up to 20% per tensor; see ``_count_slack``).
FRAME_HEADROOM = 0.1
FRAME_SLACK_BYTES = 64
#: An oversized frame shrinks by this factor per step toward its payloads.
FRAME_SHRINK = 0.95
#: No codec needs more than this many bytes per dense element (raw uint64 positions + float64
#: values take 16): a longer announced payload is refused before anything is allocated for it.
MAX_PAYLOAD_BYTES_PER_ELEMENT = 32


class NonFiniteGradientError(FloatingPointError):
    """A gradient held NaN or Inf on some rank (raised on every rank, together)."""


@dataclass
class _Entry:
    """One parameter's gradient inside a group of buckets."""

    key: Hashable
    tensor_id: int
    grad: torch.Tensor  # view into its bucket's buffer
    offset: int  # into the concatenation of the group's buffers
    compensated: Optional[torch.Tensor] = None
    indices: Optional[torch.Tensor] = None


@dataclass
class _Group:
    """Buckets exchanged together: one bucket (layer scope) or all of an iteration (global)."""

    buffers: list[torch.Tensor]
    entries: list[_Entry] = field(default_factory=list)
    futures: list[torch.futures.Future] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return sum(b.numel() for b in self.buffers)

    def signature(self) -> tuple[int, ...]:
        """Identifies the group's layout across steps (DDP's buckets change after step one)."""
        return (self.numel, *(e.tensor_id for e in self.entries))


@dataclass
class _FramedGather:
    """A group's one-round AllGather in flight, and what finishing it may still need."""

    group: _Group
    payload: bytes
    capacity: int
    encoded: Any
    done: Optional[torch.futures.Future] = None
    #: (lengths, heads) when some rank's payload did not fit: the rest is fetched at step end.
    overflow: Optional[tuple[list[int], list[memoryview]]] = None


class CommHookState:
    """Options and memory of the gradwire hook; one per DDP model.

    Args:
        process_group: the group to communicate over (default: the world).
        compressor: one of :func:`gradwire.sparsify.sparsifiers` or ``"none"`` (dense AllReduce).
        density / k / threshold: how much to keep: a fraction in (0, 1], a count per tensor
            (layer scope) or per model (global), or a magnitude for ``threshold``.
        value_codec, index_codec: codec names, configs or instances (see ``gradwire.codecs``).
        codec_options: options routed to the codecs by name (e.g. ``{"bits": 4}`` for qsgd).
        error_feedback: keep what is not sent and add it to the next step.
        momentum_correction: DGC's momentum correction with this momentum (e.g. 0.9): momentum
            is accumulated before sparsification; use the optimizer without momentum then.
        scope: ``"layer"`` (each parameter keeps its density) or ``"global"`` (one selection over
            the whole model, made when the iteration's last bucket arrives: no overlap with
            backward, one exchange per step).
        collective: ``"auto"`` (cost model), ``"allreduce"`` (shared supports only),
            ``"allgather"`` or ``"dense"``.
        seed: shared seed of random supports; every rank must use the same.
        warmup_steps: dense AllReduce for the first N steps.
        nonfinite: ``"raise"`` (every rank raises :class:`NonFiniteGradientError`) or
            ``"skip"`` (every rank gets a zero gradient for that bucket; residuals untouched).
        model: the model (DDP-wrapped or not); needed for :meth:`state_dict` names and stable
            per-parameter random streams.
        log_every: log :meth:`stats` every N steps at INFO level (0: never).
    """

    def __init__(
        self,
        process_group: Optional[dist.ProcessGroup] = None,
        *,
        compressor: str = "topk",
        density: Optional[float] = None,
        k: Optional[int] = None,
        threshold: Optional[float] = None,
        value_codec: Any = "fp32",
        index_codec: Any = "eliasfano",
        codec_options: Optional[dict[str, Any]] = None,
        error_feedback: bool = True,
        momentum_correction: Optional[float] = None,
        scope: str = "layer",
        collective: str = "auto",
        seed: int = 0,
        warmup_steps: int = 0,
        nonfinite: str = "raise",
        model: Optional[torch.nn.Module] = None,
        log_every: int = 0,
    ) -> None:
        check_choice("compressor", compressor, ("none", *sparsifiers()))
        check_choice("scope", scope, SCOPES)
        check_choice("collective", collective, COLLECTIVES)
        check_choice("nonfinite", nonfinite, NONFINITE_POLICIES)
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps={warmup_steps} must be >= 0")
        if log_every < 0:
            raise ValueError(f"log_every={log_every} must be >= 0")
        self.process_group = process_group
        self.compressor = compressor
        if compressor == "none":
            self.sparsifier = None
        else:
            if density is None and k is None and threshold is None:
                density = 0.01
            self.sparsifier = get_sparsifier(compressor, density=density, k=k, threshold=threshold, seed=seed)
        self.density, self.k, self.threshold = density, k, threshold
        self.value_codec, self.index_codec = codec_layer.resolve_codecs(value_codec, index_codec, dict(codec_options or {}))
        shared = bool(self.sparsifier is not None and self.sparsifier.shared_support)
        if collective == "allreduce" and not shared:
            raise ValueError(
                f"collective='allreduce' needs a shared support (randomk, randomblock); compressor={compressor!r} "
                "picks different positions per rank: use 'allgather' or 'auto'"
            )
        if collective == "allreduce" and self.value_codec.name not in CAST_VALUE_CODECS:
            raise ValueError(
                f"collective='allreduce' sums values on the wire, so value_codec must be one of "
                f"{', '.join(CAST_VALUE_CODECS)}; got {self.value_codec.name!r}"
            )
        self.shared_support = shared
        self.scope = scope
        self.collective = collective
        self.seed = seed
        self.warmup_steps = warmup_steps
        self.nonfinite = nonfinite
        self.error_feedback = error_feedback
        self.momentum_correction = momentum_correction
        self.feedback: Optional[ErrorFeedback]
        if momentum_correction is not None:
            self.feedback = MomentumCorrection(momentum_correction)
        else:
            self.feedback = ErrorFeedback() if error_feedback else None
        self.log_every = log_every
        self.iteration = 0
        self._stats = ExchangeStats()
        self._checked = False
        self._pending: Optional[_Group] = None
        #: Agreed frame size per group layout; identical on all ranks because it is derived
        #: only from lengths every rank has seen.
        self._frame_capacity: dict[tuple[int, ...], int] = {}
        self._framed: list[_FramedGather] = []
        self._frame_headroom = FRAME_HEADROOM + _count_slack(self.sparsifier)
        self._names: dict[Hashable, str] = {}
        self._param_index: dict[Hashable, int] = {}
        self._specs: dict[str, checkpoint.ParameterSpec] = {}
        if model is not None:
            self.attach(model)

    # ----------------------------------------------------------------------------- public
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
        return (
            f"compressor={self.compressor} density={self.density} k={self.k} threshold={self.threshold} "
            f"value_codec={self.value_codec.get_config()} index_codec={self.index_codec.get_config()} "
            f"error_feedback={self.error_feedback} momentum_correction={self.momentum_correction} "
            f"scope={self.scope} collective={self.collective} seed={self.seed} "
            f"warmup_steps={self.warmup_steps} nonfinite={self.nonfinite}"
        )

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
        rank = dist.get_rank(self.process_group) if world_size_of(self.process_group) > 1 else 0
        local = checkpoint.build_state(rank=rank, world_size=world_size_of(self.process_group), config=self.describe(),
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
        world = world_size_of(self.process_group)
        mine = checkpoint.select_state(state, rank=dist.get_rank(self.process_group) if world > 1 else 0,
                                       world_size=world, config=self.describe(), specs=self._specs, kinds=kinds)
        keys = {name: key for key, name in self._names.items()}
        self.iteration = mine.iteration
        self._frame_capacity, self._framed = {}, []  # every rank restarts from the same point
        if self.feedback is not None:
            self.feedback.residuals = {keys[n]: t.to(device).clone() for n, t in mine.residuals.items()}
            if isinstance(self.feedback, MomentumCorrection):
                self.feedback.velocities = {keys[n]: t.to(device).clone() for n, t in mine.velocities.items()}

    def __getstate__(self) -> dict[str, Any]:
        # process groups cannot be pickled (as PyTorch's PowerSGDState does, drop it)
        state = dict(self.__dict__)
        state["process_group"] = None
        state["_pending"] = None
        state["_framed"] = []
        state["_frame_capacity"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    # ------------------------------------------------------------------------- the exchange
    def run_bucket(self, index: int, buffer: torch.Tensor, parameters: Sequence[torch.Tensor],
                   gradients: Sequence[torch.Tensor], is_last: bool) -> torch.futures.Future:
        """Process one bucket; returns a Future of ``buffer`` holding the averaged gradient."""
        if not self._checked:
            check_same_on_all_ranks(self.describe(), self.process_group)
            self._checked = True
        devices = [buffer.device] if buffer.device.type == "cuda" else None
        future: torch.futures.Future = torch.futures.Future(devices=devices)
        group = self._pending if self._pending is not None else _Group(buffers=[])
        offset = group.numel
        for position, (parameter, grad) in enumerate(zip(parameters, gradients)):
            key = id(parameter)
            tensor_id = self._param_index.get(key, index * 100_003 + position)
            group.entries.append(_Entry(key, tensor_id, grad, offset + _offset_in(buffer, grad)))
        group.buffers.append(buffer)
        group.futures.append(future)
        if self.scope == "global" and not is_last and self.iteration >= self.warmup_steps:
            self._pending = group  # resolved when the iteration's last bucket arrives
            return future
        self._pending = None
        try:
            self._exchange(group)
        except BaseException as error:
            for pending in group.futures:
                if not pending.done():
                    pending.set_exception(error)
        if is_last:
            self._settle_frames()
            self._end_step()
        return future

    def _end_step(self) -> None:
        self.iteration += 1
        self._stats.end_step()
        if self.log_every and self.iteration % self.log_every == 0:
            logger.info("gradwire step %d: %s", self.iteration, self.stats())

    def _exchange(self, group: _Group) -> None:
        world = world_size_of(self.process_group)
        element_size = group.buffers[0].element_size()
        self._stats.add("bytes_dense", ring_allreduce_bytes(group.numel, element_size, world))
        finite = all(_all_finite(b) for b in group.buffers)
        if self.sparsifier is None or self.iteration < self.warmup_steps or self.collective == "dense":
            flat = group.buffers[0] if len(group.buffers) == 1 else torch.cat([b.reshape(-1) for b in group.buffers])
            self._dense(group, flat, world, element_size, use_compensated=False)
            return
        if finite or self.shared_support:
            self._select(group, finite)
        if self.shared_support and (self.collective == "allreduce" or (
                self.collective == "auto" and self.value_codec.name in CAST_VALUE_CODECS)):
            self._allreduce_values(group, world, finite)
        else:
            self._allgather(group, world, element_size, finite)

    def _select(self, group: _Group, finite: bool) -> None:
        """Compensate and select. A rank whose gradient is not finite selects on zeros instead
        (so shared supports still agree in size) and leaves its memory untouched."""
        with self._stats.timer("sparsify"):
            for entry in group.entries:
                if not finite:
                    entry.compensated = torch.zeros(entry.grad.numel(), dtype=torch.float32, device=entry.grad.device)
                elif self.feedback is not None:
                    entry.compensated = self.feedback.compensate(entry.key, entry.grad)
                else:
                    entry.compensated = entry.grad.reshape(-1).to(accumulation_dtype(entry.grad), copy=True)
            assert self.sparsifier is not None
            if self.scope == "global":
                selected = select_global(self.sparsifier, [e.compensated for e in group.entries], step=self.iteration)
            else:
                selected = [self.sparsifier.select(e.compensated, step=self.iteration, tensor_id=e.tensor_id)
                            for e in group.entries]
            for entry, indices in zip(group.entries, selected):
                entry.indices = indices

    # --- dense AllReduce (warm-up, "none", fallback of auto) ---------------------------------
    def _dense(self, group: _Group, flat: torch.Tensor, world: int, element_size: int, use_compensated: bool,
               finite: bool = True) -> None:
        if use_compensated:  # fallback after selection: send everything, nothing stays behind
            flat = torch.zeros(group.numel, dtype=group.entries[0].compensated.dtype, device=flat.device)
            for entry in group.entries:
                flat[entry.offset: entry.offset + entry.grad.numel()] = entry.compensated
            if not finite:  # compensated holds zeros here: a NaN tells every rank, through the sum
                flat[0] = math.nan
        self._stats.add("bytes_sent", ring_allreduce_bytes(group.numel, element_size, world))
        self._stats.add("count_dense_buckets", 1)
        start = _now()
        reduced = allreduce_sum(flat, self.process_group)

        def finish(future: torch.futures.Future) -> None:
            summed = future.value()
            self._stats.add("seconds_communicate", _now() - start)
            if not _all_finite(summed):
                self._resolve_nonfinite(group)
                return
            if use_compensated and self.feedback is not None:
                for entry in group.entries:
                    self.feedback.clear(entry.key)
            summed.div_(world)
            self._write(group, summed)

        reduced.add_done_callback(lambda f: _guard(group, finish, f))

    # --- AllReduce of values on a shared support ---------------------------------------------
    def _allreduce_values(self, group: _Group, world: int, finite: bool) -> None:
        wire_dtype = CAST_VALUE_CODECS.get(self.value_codec.name, torch.float32)
        device = group.buffers[0].device
        with self._stats.timer("encode"):
            sent = torch.cat([e.compensated[e.indices] for e in group.entries]).to(wire_dtype)
            # one extra element says "some rank saw NaN/Inf", so that all ranks act together
            flag = torch.tensor([0.0 if finite else 1.0], dtype=wire_dtype, device=sent.device)
            message = torch.cat([sent, flag]).to(device)
        self._stats.add("bytes_sent", ring_allreduce_bytes(message.numel(), message.element_size(), world))
        start = _now()
        reduced = allreduce_sum(message, self.process_group)

        def finish(future: torch.futures.Future) -> None:
            summed = future.value()
            self._stats.add("seconds_communicate", _now() - start)
            if float(summed[-1]) != 0 or not finite:
                self._resolve_nonfinite(group)
                return
            with self._stats.timer("decode"):
                averaged = summed[:-1].to(group.entries[0].compensated.dtype) / world
                out = _output_buffer(group, averaged.dtype)
                position = 0
                for entry in group.entries:
                    k = entry.indices.numel()
                    out[entry.offset + entry.indices] = averaged[position: position + k]
                    if self.feedback is not None:
                        self.feedback.update(entry.key, entry.compensated, entry.indices,
                                             sent[position: position + k].to(device))
                    position += k
                self._write(group, out)

        reduced.add_done_callback(lambda f: _guard(group, finish, f))

    # --- AllGather of encoded payloads --------------------------------------------------------
    def _allgather(self, group: _Group, world: int, element_size: int, finite: bool) -> None:
        """Exchange encoded payloads. A group layout seen for the first time exchanges lengths
        first (blocking); from then on one AllGather of frames sized from the lengths seen so
        far carries length and payload together, so backward never waits here."""
        encoded = None
        if finite:
            with self._stats.timer("encode"):
                encoded = encode_bucket([Part(e.compensated, e.indices, e.offset) for e in group.entries],
                                        group.numel, self.index_codec, self.value_codec)
        payload = encoded.payload if encoded else b""
        signature = group.signature()
        capacity = self._frame_capacity.get(signature) if world > 1 else None
        if capacity is None:
            self._allgather_measured(group, world, element_size, finite, encoded, payload, signature)
        else:
            self._allgather_framed(group, world, element_size, finite, encoded, payload, signature, capacity)

    def _allgather_measured(self, group: _Group, world: int, element_size: int, finite: bool, encoded: Any,
                            payload: bytes, signature: tuple[int, ...]) -> None:
        gather = ByteGather(payload, self.process_group, valid=finite)
        start = _now()
        lengths = gather.lengths()
        if min(lengths) < 0:
            self._stats.add("seconds_communicate", _now() - start)
            self._resolve_nonfinite(group)
            return
        _check_lengths(lengths, group)
        cost = CostModel(world)
        if self.collective == "auto" and world > 1 and not cost.prefer_allgather(max(lengths), group.numel, element_size):
            self._stats.add("bytes_sent", 8.0 * (world - 1))
            self._dense(group, group.buffers[0], world, element_size, use_compensated=True)
            return
        self._learn_frame(signature, lengths)
        self._stats.add("bytes_sent", 8.0 * (world - 1) + (world - 1) * max(lengths))
        self._stats.add("count_allgather_buckets", 1)

        def finish(future: torch.futures.Future) -> None:
            self._stats.add("seconds_communicate", _now() - start)
            self._combine(group, future.value(), encoded, world)

        gather.start().add_done_callback(lambda f: _guard(group, finish, f))

    def _allgather_framed(self, group: _Group, world: int, element_size: int, finite: bool, encoded: Any,
                          payload: bytes, signature: tuple[int, ...], capacity: int) -> None:
        frame_bytes = FRAME_HEADER_BYTES + capacity
        if self.collective == "auto" and not CostModel(world).prefer_allgather(frame_bytes, group.numel, element_size,
                                                                                rounds=1):
            # every rank holds the same capacity, so every rank falls back together; forgetting
            # it makes the next step measure again instead of staying dense for good
            del self._frame_capacity[signature]
            self._dense(group, group.buffers[0], world, element_size, use_compensated=True, finite=finite)
            return
        self._stats.add("bytes_sent", float((world - 1) * frame_bytes))
        self._stats.add("count_allgather_buckets", 1)
        record = _FramedGather(group, payload, capacity, encoded)
        start = _now()

        def finish(future: torch.futures.Future) -> None:
            lengths, heads = future.value()
            self._stats.add("seconds_communicate", _now() - start)
            if min(lengths) < 0:
                self._resolve_nonfinite(group)
                return
            _check_lengths(lengths, group)
            self._learn_frame(signature, lengths)
            if max(lengths) > capacity:
                record.overflow = (lengths, heads)  # a collective may not start here: see _settle_frames
                return
            self._combine(group, heads, encoded, world)

        frames = gather_frames(payload, capacity, self.process_group, valid=finite)
        record.done = frames.then(lambda f: _guard(group, finish, f))
        self._framed.append(record)

    def _learn_frame(self, signature: tuple[int, ...], lengths: Sequence[int]) -> None:
        """Next frame size for this layout, from lengths every rank has seen (so all agree)."""
        wanted = math.ceil(max(lengths) * (1.0 + self._frame_headroom)) + FRAME_SLACK_BYTES
        current = self._frame_capacity.get(signature)
        if current is not None and wanted < current:
            wanted = max(wanted, int(current * FRAME_SHRINK))
        self._frame_capacity[signature] = wanted

    def _settle_frames(self) -> None:
        """At the step's last bucket: wait for this step's frames and fetch what did not fit.

        Completion callbacks run on the backend's threads in no agreed order, so they must not
        start collectives; the main thread does it here, in launch order, and every rank runs
        the same second rounds because every rank saw the same lengths.
        """
        records, self._framed = self._framed, []
        world = world_size_of(self.process_group)
        for record in records:
            assert record.done is not None
            record.done.wait()
            if record.overflow is None:
                continue
            lengths, heads = record.overflow
            try:
                start = _now()
                tails = gather_overflow(record.payload, record.capacity, lengths, self.process_group)
                self._stats.add("seconds_communicate", _now() - start)
                self._stats.add("bytes_sent", float((world - 1) * (max(lengths) - record.capacity)))
                self._stats.add("count_frame_overflows", 1)
                payloads = [memoryview(bytes(head) + bytes(tail)) for head, tail in zip(heads, tails)]
                self._combine(record.group, payloads, record.encoded, world)
            except BaseException as error:
                _fail(record.group, error)

    def _combine(self, group: _Group, payloads: Sequence[memoryview], encoded: Any, world: int) -> None:
        """Decode every rank's payload, average into the group's buffers (summing in rank order, so
        every rank gets the same bits), keep the residuals and resolve the futures."""
        rank = dist.get_rank(self.process_group) if world > 1 else 0
        with self._stats.timer("decode"):
            dtype = group.entries[0].compensated.dtype if group.entries else torch.float32
            device = group.buffers[0].device
            out = _output_buffer(group, dtype)
            for source, data in enumerate(payloads):
                if source == rank:  # our own reconstruction is bit-identical to decoding it
                    positions, values = encoded.positions, encoded.values
                else:
                    positions, values = self._decode_from(source, data, group)
                values = values.to(dtype)  # a copy unless the codec returned the sent tensor itself
                if world > 1:  # divide the few sent values, not the whole buffer afterwards
                    values = values / world
                out.index_add_(0, positions.to(device), values.to(device))
            if self.feedback is not None:
                for entry, (indices, values) in zip(group.entries, encoded.sent):
                    self.feedback.update(entry.key, entry.compensated, indices.to(device), values.to(device))
            self._write(group, out)

    def _decode_from(self, source: int, data: memoryview, group: _Group) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            return decode_bucket(data, [e.grad.numel() for e in group.entries], [e.offset for e in group.entries],
                                 group.numel, self.index_codec)
        except DecodeError as error:
            raise DecodeError(f"payload from rank {source}: {error}") from error

    # --- results -------------------------------------------------------------------------------
    def _write(self, group: _Group, averaged: torch.Tensor) -> None:
        """Copy the averaged flat gradient into the buckets' buffers and resolve their futures."""
        position = 0
        for buffer, future in zip(group.buffers, group.futures):
            size = buffer.numel()
            if averaged.data_ptr() != buffer.data_ptr():
                buffer.copy_(averaged[position: position + size].reshape(buffer.shape))
            position += size
            future.set_result(buffer)

    def _resolve_nonfinite(self, group: _Group) -> None:
        self._stats.skipped_steps += 1
        if self.nonfinite == "raise":
            raise NonFiniteGradientError(
                f"NaN or Inf in gradients at step {self.iteration} on at least one rank "
                "(nonfinite='raise'; use nonfinite='skip' to drop such buckets)"
            )
        for buffer, future in zip(group.buffers, group.futures):
            buffer.zero_()
            future.set_result(buffer)


def _guard(group: _Group, finish: Any, future: torch.futures.Future) -> None:
    """Run a completion callback; any error it raises fails every future of the group."""
    try:
        future.value()  # re-raises a communication error
        finish(future)
    except BaseException as error:  # surfaces in backward() on every rank
        _fail(group, error)


def _fail(group: _Group, error: BaseException) -> None:
    for pending in group.futures:
        if not pending.done():
            pending.set_exception(error)


def _count_slack(sparsifier: Any) -> float:
    """How far above its target the sparsifier's count may go, as a fraction (0.2 for sampled
    top-k's default tolerance; 0 for exact counts and for sparsifiers without a target, whose
    rare jumps the overflow round absorbs)."""
    if sparsifier is None:
        return 0.0
    numel = 1 << 20
    target = sparsifier.target_k(numel)
    if not target:
        return 0.0
    return min(1.0, max(0.0, sparsifier.count_bounds(numel)[1] / target - 1.0))


def _check_lengths(lengths: Sequence[int], group: _Group) -> None:
    """Refuse announced payload lengths no codec could produce for this group (every rank sees
    the same lengths, so every rank refuses together) before allocating for them."""
    limit = MAX_PAYLOAD_BYTES_PER_ELEMENT * group.numel + (1 << 20)
    if max(lengths) > limit:
        source = max(range(len(lengths)), key=lambda r: lengths[r])
        raise DecodeError(f"rank {source} announced a payload of {max(lengths)} bytes; at most {limit} "
                          f"are possible for {group.numel} elements")


def _all_finite(tensor: torch.Tensor) -> bool:
    """True when no element is NaN or Inf. A plain sum is finite in the common case and costs
    ~20x less than ``isfinite().all()``; only a non-finite sum (NaN/Inf inside, or an overflow of
    huge finite values) pays for the exact check."""
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


def _output_buffer(group: _Group, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed flat tensor to sum the received gradients into: the bucket's own buffer when
    there is one of that dtype (every gradient was already copied out by compensation), so
    the result needs no further copy; else a new one."""
    if len(group.buffers) == 1 and group.buffers[0].dtype == dtype and group.buffers[0].is_contiguous():
        return group.buffers[0].view(-1).zero_()
    return torch.zeros(group.numel, dtype=dtype, device=group.buffers[0].device)


def _offset_in(buffer: torch.Tensor, view: torch.Tensor) -> int:
    """Element offset of ``view`` inside ``buffer`` (DDP's gradients are views of its bucket)."""
    offset, remainder = divmod(view.data_ptr() - buffer.data_ptr(), buffer.element_size())
    if remainder or not 0 <= offset <= buffer.numel() - view.numel():
        raise RuntimeError("gradient is not a view of its bucket buffer")
    return offset


_now = time.perf_counter


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
