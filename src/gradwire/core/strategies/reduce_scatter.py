"""Reduce-scatters of shard groups (FSDP2): each rank gets its own shard of the sum, compressed.

A shard group's target is a :class:`~gradwire.core.group.ShardTarget`: the flat input ``(p s,)``
chunk by rank, rank j of the target's process group owning ``[j s, (j+1) s)``. Three strategies,
started like every other (``start(group)``): the start encodes and launches the collective, and
completing the returned exchange (on the front-end's thread, when it chooses) waits, decodes, sums,
divides and writes the shard; with HSDP's replicas both stages run at the start, blocking:

* :class:`DenseReduceScatter` — warm-up, ``compressor="none"``: ``reduce_scatter_tensor`` (SUM) of
  the raw gradients in their dtype, what plain FSDP2 sends;
* :class:`QuantizedReduceScatter` — ``quantize="int8" | "int4"`` (qgZ style): ``x = grad +
  residual``, :func:`~gradwire.exchange.quantized.quantized_reduce_scatter` (blockwise int8/int4
  with float32 scales over one all-to-all, blocks restarting at every entry of a chunk, i.e. at
  every parameter; the owner dequantizes and sums in float32 in rank order); the residual is this
  rank's quantization error ``x - D(Q(x))``;
* :class:`SparseReduceScatter` — a sparsifier: the pipeline's selection ran per entry, and the
  front-end's entries are one per (parameter, destination), so ``k`` holds per parameter and per
  destination region; :func:`~gradwire.exchange.sparse_reduce_scatter.sparse_reduce_scatter` with
  the shards as regions (DeepReduce-coded payloads in fixed frames sized by the sparsifier's
  largest counts and the codecs' bounds, one all-to-all with no round of counts where the codecs
  bound their sections; the owner sums in rank order);
  the residual is ``compensated - what the owners decoded of this rank's contribution``.

Every rank's error feedback telescopes: what no owner applied stays in its sender's residual.

**HSDP** (``target.replicas``): the shard sum (undivided, float32) is then summed across the
replicas of the shard with the AllReduce strategy of the same family — :class:`DenseAllReduce`,
:class:`QuantizedAllReduce` (its residual: one per module over the shard) or
:class:`SparseAllReduce` after its own selection from ``shard + residual`` (``k`` = the
sparsifier's target for ``s``) — over the replicate group, inside the same round. A rank whose
first stage failed or saw NaN still takes part, announcing NaN, so no replica is left waiting.

**Failures**: NaN/Inf on a rank is sent as NaN (to owner 0) and an owner that sums NaN marks the
group non-finite; a payload an owner cannot decode marks it failed; a failed collective raises
:class:`~gradwire.errors.CollectiveError`: each only on the ranks that saw it, and the round's
agreement makes every rank act alike. **Digest**: each rank's share of a balanced digest
(:func:`~gradwire.core.digest.balanced_share`) of what it sent (as the owner decodes it) and what
it decoded; HSDP's AllReduce adds a :func:`~gradwire.core.digest.chain_share` of its result. The
dense reduce-scatter sums inside the backend, so it has nothing to hash (its share is 0).
"""

from __future__ import annotations

import bisect
import math
from typing import Optional

import torch
import torch.distributed as dist

from ...errors import CollectiveError, DecodeError, collective_failed
from ...exchange.checked import reduce_scatter_single, wait_checked
from ...exchange.inflight import Launched
from ...exchange.quantized import QuantizedReduceScatterResult, start_quantized_reduce_scatter
from ...exchange.sparse_reduce_scatter import (RegionStatus, SparseReduceScatterResult,
                                               start_sparse_reduce_scatter)
from ...lifetime import track
from ...sparsify.base import Sparsifier
from ..digest import balanced_share, chain_share, digest_of
from ..feedback import ErrorFeedback, accumulation_dtype
from ...finite import all_finite
from ..group import BufferTarget, Entry, Group, ShardTarget, Status
from ..selection import Selection
from .base import Exchange, ExchangeContext, ExchangeStrategy, run_guarded
from .dense import DenseAllReduce
from .quantized import QuantizedAllReduce
from .sparse_allreduce import RegionCodecAdapter, SparseAllReduce, joined_contribution


class ShardStrategy(ExchangeStrategy):
    """The shared frame: the shard group's reduce-scatter (:meth:`reduce_scatter`, per family),
    then, with replicas, the AllReduce across them (:meth:`replica_strategy`), then the division
    and the write. Subclasses implement both hooks."""

    def __init__(self, context: ExchangeContext) -> None:
        super().__init__(context)
        #: per replicate group: its context and the family's AllReduce strategy over it
        self._replicas: dict[int, tuple[ExchangeContext, ExchangeStrategy]] = {}
        #: the last call's large collectives' Works (and so their buffers), held until the next
        #: call rather than in gradwire.lifetime's queue of recent works (16 calls' gradients)
        self.held: list = []

    def start(self, group: Group) -> Exchange:
        """Launch the reduce-scatter of ``group``. Without replicas the collective stays in flight:
        completing the returned :class:`Exchange` waits, decodes, divides and writes (a front-end
        may do other work meanwhile: FSDP2's backward of the next module). With replicas (HSDP)
        both stages run now, blocking: the second stage's collectives must start in the same
        order on every rank, which only the caller's thread at a fixed point guarantees."""
        self.held = []
        target = group.target
        assert isinstance(target, ShardTarget), "a reduce-scatter strategy needs a ShardTarget"
        if target.replicas is not None:
            run_guarded(group, lambda: self._run(group))
            return Exchange(self.context, group)
        launched: list[Launched[Optional[torch.Tensor]]] = []
        run_guarded(group, lambda: launched.append(self.launch(group)))
        if not launched:  # failed before anything was in flight (recorded on the group)
            return Exchange(self.context, group)
        # the front-end books the wait (FSDP2: at the step's end); launch to completion would count
        # the backward that ran meanwhile as communication
        return Exchange(self.context, group, launched[0], finish=lambda shard: self._write(group, shard),
                        book_seconds=False)

    def reset(self) -> None:
        for _, strategy in self._replicas.values():
            strategy.reset()

    def launch(self, group: Group) -> Launched[Optional[torch.Tensor]]:
        """Start the shard group's reduce-scatter; the result is this rank's shard summed over the
        shard group, float32 ``(s,)`` undivided, or None after marking the group (non-finite,
        failed). Raises what fails before or at the start."""
        raise NotImplementedError

    def reduce_scatter(self, group: Group) -> Optional[torch.Tensor]:
        """:meth:`launch`, waited for here (the blocking form, for HSDP's first stage)."""
        launched = self.launch(group)
        if launched.work is not None:
            self.held.append(launched.work)  # until the next call, not a backend thread's last reference
            with self.context.stats.timer("communicate"):  # the wait only: the finish books its decoding
                wait_checked(launched.work, f"{self.name} of step {self.context.step}", launched.collective,
                             keep=False)
        return launched.result()

    def replica_strategy(self, context: ExchangeContext) -> ExchangeStrategy:
        """The family's AllReduce over a replicate group's ``context``."""
        raise NotImplementedError

    def prepare_replicas(self, sub: Group) -> None:
        """Selection on the shard's group before its AllReduce (the sparse family's)."""

    # --------------------------------------------------------------------------------- frame
    def _run(self, group: Group) -> None:
        target = group.target
        assert isinstance(target, ShardTarget) and target.replicas is not None
        shard: Optional[torch.Tensor] = None
        try:
            shard = self.reduce_scatter(group)
        except BaseException as error:  # recorded; this rank still takes part in the replicas' stage
            group.mark_failed(error)
        self._write(group, self._across_replicas(group, shard))

    def _write(self, group: Group, shard: Optional[torch.Tensor]) -> None:
        """Divide the summed shard and write it (None, or a group already marked: nothing)."""
        if shard is None or group.status != Status.PENDING:
            return
        shard.div_(group.divisor)
        if not all_finite(shard):  # a sum that overflowed
            group.mark_nonfinite()
            return
        group.write(shard)

    def _across_replicas(self, group: Group, shard: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """HSDP's second stage on ``shard`` (None: this rank has nothing valid: it sends NaN)."""
        target = group.target
        assert isinstance(target, ShardTarget) and target.replicas is not None
        replicas = target.replicas
        context, strategy = self._replica(replicas.group)
        context.step = self.context.step
        valid = shard is not None and group.status == Status.PENDING
        buffer = shard if shard is not None else torch.zeros(target.shard_numel, device=target.device)
        sub = Group(BufferTarget([buffer]), [Entry(replicas.key, replicas.tensor_id, buffer, 0)], divisor=1.0)
        sub.finite = valid
        self.prepare_replicas(sub)
        strategy.start(sub).complete(self.context.timeout)
        strategy.settle()  # a strategy that defers to the round's end (the sparse AllReduce) runs here
        group.feedback_updates.extend(sub.feedback_updates)
        group.feedback_clears.extend(sub.feedback_clears)
        group.feedback_sets.extend(sub.feedback_sets)
        group.feedback_flat_updates.extend(sub.feedback_flat_updates)
        if sub.status == Status.FAILED:
            group.mark_failed(sub.error or RuntimeError("the AllReduce across replicas failed"))
        elif sub.status == Status.NONFINITE and group.status == Status.PENDING:
            group.mark_nonfinite()
        if sub.status != Status.WRITTEN:
            return None
        result = sub.digest if sub.digest is not None else digest_of([buffer])
        share = chain_share(result, position=context.rank, size=context.world_size, salt=target.index)
        group.digest = share ^ (group.digest or 0)
        return buffer

    def _replica(self, process_group: Optional[dist.ProcessGroup]) -> tuple[ExchangeContext, ExchangeStrategy]:
        key = id(process_group)
        if key not in self._replicas:
            base = self.context
            world = dist.get_world_size(process_group)
            context = ExchangeContext(base.value_codec, base.index_codec, process_group, world,
                                      dist.get_rank(process_group), base.stats, timeout=base.timeout)
            self._replicas[key] = (context, self.replica_strategy(context))
        return self._replicas[key]

    @staticmethod
    def _salt(group: Group) -> int:
        """Which replica this shard group is (0 without replicas): tells their digests apart."""
        target = group.target
        assert isinstance(target, ShardTarget)
        if target.replicas is None:
            return 0
        return dist.get_rank(target.replicas.group)


class DenseReduceScatter(ShardStrategy):
    """``reduce_scatter_tensor`` (SUM) of the raw gradients in their dtype: warm-up steps and
    ``compressor="none"``; residuals untouched. About ``(p-1) s`` elements per rank."""

    name = "dense-reduce-scatter"

    def launch(self, group: Group) -> Launched[Optional[torch.Tensor]]:
        target = group.target
        assert isinstance(target, ShardTarget)
        flat = target.flat_input()
        if not group.finite:  # NaN reaches owner 0 through the sum
            flat = flat.clone()
            flat[:1] = math.nan
        shard = torch.empty(target.shard_numel, dtype=flat.dtype, device=flat.device)
        self.context.stats.add("bytes_sent", float((target.shards - 1) * shard.numel() * flat.element_size()))
        self.context.stats.add("count_dense_reduce_scatter_buckets", 1)
        if target.shards > 1:  # blocking: gloo's Work for it never reports is_completed(), so it cannot be polled
            try:
                work = reduce_scatter_single(shard, flat, op=dist.ReduceOp.SUM, group=target.group, async_op=True)
            except RuntimeError as error:
                raise collective_failed("reduce_scatter_tensor (dense)", self.context.step, error) from error
            track(work)
            self.held.append(work)
            with self.context.stats.timer("communicate"):
                wait_checked(work, f"dense reduce-scatter of step {self.context.step}", "reduce_scatter_tensor",
                             keep=False)
        else:
            shard.copy_(flat)

        def finish() -> Optional[torch.Tensor]:
            group.balanced_digest, group.digest = True, 0
            summed = shard.to(torch.float32)
            if not all_finite(summed):
                group.mark_nonfinite()
                return None
            return summed

        return Launched(None, finish, "reduce_scatter_tensor")

    def replica_strategy(self, context: ExchangeContext) -> ExchangeStrategy:
        return DenseAllReduce(context)


class QuantizedReduceScatter(ShardStrategy):
    """Blockwise int8/int4 over one all-to-all, error feedback from the local quantization error
    (module docstring). About ``(p-1) s (bits/8 + 4/block_size)`` bytes per rank."""

    name = "quantized-reduce-scatter"

    def __init__(self, context: ExchangeContext, feedback: Optional[ErrorFeedback], *, bits: int,
                 block_size: int) -> None:
        super().__init__(context)
        self.feedback, self.bits, self.block_size = feedback, bits, block_size

    def launch(self, group: Group) -> Launched[Optional[torch.Tensor]]:
        context, target = self.context, group.target
        assert isinstance(target, ShardTarget)
        with context.stats.timer("encode"):
            flat = group.compensated_input(self.feedback)  # an unused entry keeps its residual whole
            if not group.finite:  # owner 0 decodes a NaN block: every rank learns it at the agreement
                flat[:1] = math.nan
            try:
                started = start_quantized_reduce_scatter(flat, bits=self.bits, block_size=self.block_size,
                                                         group=target.group, segments=_segments(group))
            except CollectiveError:
                raise
            except RuntimeError as error:
                raise collective_failed("quantized reduce-scatter", context.step, error) from error
            if self.feedback is not None:  # known now: held in the storage dtype while the exchange travels
                for entry in group.entries:
                    error = started.error[entry.offset: entry.offset + entry.numel]
                    group.keep_residual(entry, self.feedback.held_copy(error, accumulation_dtype(entry.grad)))
        return started.launched.map(lambda result: self._finish(group, result))

    def _finish(self, group: Group, result: QuantizedReduceScatterResult) -> Optional[torch.Tensor]:
        context, target = self.context, group.target
        assert isinstance(target, ShardTarget)
        context.stats.add("bytes_sent", float(result.bytes_sent))
        context.stats.add("count_quantized_reduce_scatter_buckets", 1)
        with context.stats.timer("decode"):
            assert result.chunks_sent is not None and result.chunks_received is not None
            group.balanced_digest = True
            group.digest = balanced_share([(j, [row]) for j, row in enumerate(result.chunks_sent)],
                                          [(r, [row]) for r, row in enumerate(result.chunks_received)],
                                          rank=target.index, salt=self._salt(group))
            if not bool(result.finite):  # (the residuals kept at the start apply only if the round does)
                group.mark_nonfinite()
                return None
            return result.shard

    def replica_strategy(self, context: ExchangeContext) -> ExchangeStrategy:
        return QuantizedAllReduce(context, self.feedback, bits=self.bits, block_size=self.block_size)


class SparseReduceScatter(ShardStrategy):
    """Per-destination selections, sent to their owners as region payloads, summed by the owner in
    rank order (module docstring). About ``(p-1)/p k`` coded entries per rank for ``k`` selected."""

    name = "sparse-reduce-scatter"

    def __init__(self, context: ExchangeContext, sparsifier: Sparsifier, feedback: Optional[ErrorFeedback]) -> None:
        super().__init__(context)
        self.codec = RegionCodecAdapter(index_codec=context.index_codec, value_codec=context.value_codec)
        self.sparsifier, self.feedback = sparsifier, feedback
        self._selection = Selection(sparsifier, feedback, "layer", context.stats)
        self._most: dict[tuple, Optional[list[int]]] = {}

    def most_per_shard(self, group: Group, bounds: list[int]) -> Optional[list[int]]:
        """The most entries any rank selects in each shard: the sparsifier's largest count per
        entry (``count_bounds``), summed over the entries of each shard, at least one in shard 0
        (where a non-finite rank sends its NaN). The same on every rank (the shapes are), so the
        payloads travel in fixed frames with no round of counts. None (counts first) when an
        entry straddles two shards (FSDP's layout never does), or when the data decides the
        count (``threshold``: its largest count is every position, a frame as large as the
        dense shard). Kept per layout."""
        key = (tuple((e.offset, e.numel) for e in group.entries), tuple(bounds))
        if key not in self._most:
            most = [0] * (len(bounds) - 1)
            for entry in group.entries:
                shard = bisect.bisect_right(bounds, entry.offset) - 1
                if entry.numel and (entry.offset + entry.numel > bounds[shard + 1]
                                    or self.sparsifier.target_k(entry.numel) is None):
                    self._most[key] = None
                    break
                most[shard] += self.sparsifier.count_bounds(entry.numel)[1] if entry.numel else 0
            else:
                most[0] = max(most[0], 1)
                self._most[key] = most
        return self._most[key]

    def launch(self, group: Group) -> Launched[Optional[torch.Tensor]]:
        context, target = self.context, group.target
        assert isinstance(target, ShardTarget)
        with context.stats.timer("encode"):
            positions, values = joined_contribution(group)
            if not group.finite:  # owner 0 sums a NaN: every rank learns it at the agreement
                positions = torch.zeros(1, dtype=torch.int64, device=target.device)
                values = torch.full((1,), math.nan, device=target.device)
            self.codec.error = None
            bounds = target.boundaries()
            try:
                started = start_sparse_reduce_scatter(indices=positions, values=values, numel=group.numel,
                                                      boundaries=bounds, group=target.group, codec=self.codec,
                                                      what=f"sparse reduce-scatter of step {context.step}",
                                                      most=self.most_per_shard(group, bounds))
            except (DecodeError, CollectiveError) as error:
                raise (self.codec.error or error)
            except RuntimeError as error:
                raise collective_failed("sparse reduce-scatter", context.step, error) from error
        # an encoder error sent bytes no owner decodes: its peers fail too, and this rank raises it
        # once the exchange is over (the next module's launch reuses the adapter)
        refused = self.codec.error
        return started.map(lambda result: self._finish(group, result, positions, bounds, refused))

    def _finish(self, group: Group, result: SparseReduceScatterResult, positions: torch.Tensor,
                bounds: list[int], refused: Optional[BaseException]) -> Optional[torch.Tensor]:
        context, target = self.context, group.target
        assert isinstance(target, ShardTarget)
        if refused is not None:
            raise refused
        context.stats.add("bytes_sent", float(result.bytes_sent))
        context.stats.add("count_sparse_reduce_scatter_buckets", 1)
        if "reduce-scatter counts" not in result.sent_by_collective and target.shards > 1:
            context.stats.add("count_framed_reduce_scatters", 1)  # one round, no counts first
        if result.status is RegionStatus.DECODE_FAILED:
            group.mark_failed(result.error or DecodeError("a region payload did not decode"))
            return None
        with context.stats.timer("decode"):
            starts = torch.tensor(bounds, dtype=torch.int64, device=positions.device)
            cuts = torch.searchsorted(positions, starts).tolist()
            sent = [(j, [positions[cuts[j]:cuts[j + 1]] - bounds[j], result.contributed[cuts[j]:cuts[j + 1]]])
                    for j in range(target.shards)]
            group.balanced_digest = True
            group.digest = balanced_share(sent, [(r, list(piece)) for r, piece in enumerate(result.received)],
                                          rank=target.index, salt=self._salt(group))
            if result.status is RegionStatus.NONFINITE:
                group.mark_nonfinite()
                return None
            _keep_contributed(group, positions, result.contributed)
            shard = torch.zeros(target.shard_numel, dtype=torch.float32, device=target.device)
            shard[result.indices.to(shard.device)] = result.values.to(shard.device)
            return shard

    def replica_strategy(self, context: ExchangeContext) -> ExchangeStrategy:
        return SparseAllReduce(context)

    def prepare_replicas(self, sub: Group) -> None:
        self._selection.run(sub, self.context.step)
        sub.k = self.sparsifier.target_k(sub.numel) or sub.numel


def _segments(group: Group) -> Optional[list[int]]:
    """Blocks restart at every entry of a chunk (one per parameter in FSDP's layout), so a small
    parameter's values are not scaled by a large neighbour's absmax (which rounds them to zero:
    LayerNorm gradients next to attention weights, measured in docs/fsdp.md). None when the
    entries do not tile the first chunk (one segment: blocks from each chunk's start)."""
    target = group.target
    assert isinstance(target, ShardTarget)
    first = [entry for entry in group.entries if entry.offset < target.shard_numel]
    offset = 0
    for entry in first:
        if entry.offset != offset:
            return None
        offset += entry.numel
    return [entry.numel for entry in first] if offset == target.shard_numel else None


def _keep_contributed(group: Group, positions: torch.Tensor, contributed: torch.Tensor) -> None:
    """Per entry, ``residual = compensated - what the owners decoded`` at its selected positions."""
    offsets = torch.tensor([e.offset for e in group.entries], dtype=torch.int64, device=positions.device)
    ends = offsets + torch.tensor([e.numel for e in group.entries], dtype=torch.int64, device=positions.device)
    lows = torch.searchsorted(positions, offsets).tolist()
    highs = torch.searchsorted(positions, ends).tolist()
    for entry, lo, hi in zip(group.entries, lows, highs):
        if entry.compensated is not None:
            group.keep(entry, positions[lo:hi] - entry.offset, contributed[lo:hi].to(entry.compensated.dtype))


def shard_strategies(context: ExchangeContext, *, sparsifier: Optional[Sparsifier],
                     feedback: Optional[ErrorFeedback], quantize_bits: Optional[int],
                     quantize_block: int) -> dict[str, ExchangeStrategy]:
    """The pipeline's strategies for shard groups, by the planner's names."""
    strategies: dict[str, ExchangeStrategy] = {"dense-reduce-scatter": DenseReduceScatter(context)}
    if quantize_bits is not None:
        strategies["quantized-reduce-scatter"] = QuantizedReduceScatter(context, feedback, bits=quantize_bits,
                                                                        block_size=quantize_block)
    if sparsifier is not None:
        strategies["sparse-reduce-scatter"] = SparseReduceScatter(context, sparsifier, feedback)
    return strategies

