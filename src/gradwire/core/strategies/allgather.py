"""AllGather of encoded payloads: per-rank supports (top-k and friends) with DeepReduce codecs."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from ..payload import EncodedBucket, Part, decode_bucket, encode_bucket
from ...errors import DecodeError, collective_failed
from ...exchange import FRAME_HEADER_BYTES, ByteGather, CostModel, gather_frames, gather_overflow
from ..digest import digest_of
from ..frames import FRAME_HEADROOM, FrameSizes
from ...finite import all_finite
from ..group import Group
from ..scatter import scatter_add
from .base import Exchange, ExchangeContext, ExchangeStrategy
from .dense import DenseAllReduce

#: No codec needs more than this many bytes per dense element (raw uint64 positions + float64
#: values take 16): a longer announced payload is refused before anything is allocated for it.
MAX_PAYLOAD_BYTES_PER_ELEMENT = 32


@dataclass
class _InFlight:
    """A framed AllGather of one group, and what finishing it may still need at the step's end."""

    group: Group
    payload: bytes
    capacity: int
    encoded: Optional[EncodedBucket]
    #: (lengths, heads) when some rank's payload did not fit its frame
    overflow: Optional[tuple[list[int], list[memoryview]]] = None


class PayloadAllGather(ExchangeStrategy):
    """1. Encode the group's selections into one payload (:func:`gradwire.core.payload.encode_bucket`);
    2. first sight of the group's layout: all-gather the lengths (blocking; -1 from a rank whose
       gradient was not finite), let the cost model choose dense if it is predicted cheaper
       (``context.dense_fallback``; same lengths on every rank, so the same choice), then
       all-gather the padded payloads. Known layout: one AllGather of frames of the agreed size
       (:class:`~gradwire.core.frames.FrameSizes`), so backward never waits on a length round;
    3. on completion, decode every peer's payload (checked against the sizes this rank expects),
       adds this rank's own reconstruction, divides by ``group.divisor``, sums in rank order
       (identical bits on every rank) and keeps ``compensated - sent`` as residual;
    4. a payload longer than its frame is noted; :meth:`settle` fetches the rest in a second
       round at the round's end, in launch order (completing must not start a collective).
    """

    name = "allgather"

    def __init__(self, context: ExchangeContext, dense: DenseAllReduce, count_slack: float = 0.0) -> None:
        super().__init__(context)
        self.dense = dense
        self.frames = FrameSizes(headroom=FRAME_HEADROOM + count_slack)
        self._in_flight: list[_InFlight] = []

    def reset(self) -> None:
        self.frames.reset()
        self._in_flight = []

    def start(self, group: Group) -> Exchange:
        context = self.context
        finite = group.finite
        encoded, failure = None, None
        if finite:
            try:
                with context.stats.timer("encode"):
                    parts = [Part(e.compensated, e.indices, e.offset, e.values) for e in group.entries]
                    encoded = encode_bucket(parts, group.numel, index_codec=context.index_codec,
                                            value_codec=context.value_codec)
            except Exception as error:  # still take part (as "invalid"): peers must not wait on us
                failure = error
        payload = encoded.payload if encoded is not None else b""
        valid = finite and failure is None
        capacity = self.frames.capacity(group.signature()) if context.world_size > 1 else None
        if capacity is None:
            started = self._start_measured(group, valid, encoded, payload)
        else:
            started = self._start_framed(group, valid, encoded, payload, capacity)
        if failure is not None:  # this rank fails the step; its peers saw an invalid payload
            group.mark_failed(failure)
        return started

    # ------------------------------------------------------------------- first sight: lengths
    def _start_measured(self, group: Group, finite: bool, encoded: Optional[EncodedBucket],
                        payload: bytes) -> Exchange:
        context = self.context
        world = context.world_size
        gather = ByteGather(payload, context.process_group, valid=finite, timeout=context.timeout)
        started = time.perf_counter()
        try:
            lengths = gather.lengths()
        except Exception as error:
            group.mark_failed(collective_failed("AllGather of payload lengths", context.step, error))
            return Exchange(context, group)
        context.stats.add("seconds_communicate", time.perf_counter() - started)
        if min(lengths) < 0:
            group.mark_nonfinite()
            return Exchange(context, group)
        try:
            _check_lengths(lengths, group)
        except DecodeError as error:
            group.mark_failed(error)
            return Exchange(context, group)
        if (context.dense_fallback and world > 1
                and not CostModel(world).prefer_allgather(max(lengths), group.numel, group.element_size)):
            context.stats.add("bytes_sent", 8.0 * (world - 1))
            return self.dense.start(group)
        self.frames.learn(group.signature(), lengths)
        context.stats.add("bytes_sent", 8.0 * (world - 1) + (world - 1) * max(lengths))
        context.stats.add("count_allgather_buckets", 1)
        return Exchange(context, group, gather.start(), lambda payloads: self._combine(group, payloads, encoded))

    # ------------------------------------------------------------------- known layout: frames
    def _start_framed(self, group: Group, finite: bool, encoded: Optional[EncodedBucket], payload: bytes,
                      capacity: int) -> Exchange:
        context = self.context
        world = context.world_size
        frame_bytes = FRAME_HEADER_BYTES + capacity
        signature = group.signature()
        if context.dense_fallback and not CostModel(world).prefer_allgather(
                frame_bytes, group.numel, group.element_size, rounds=1):
            # every rank holds the same capacity, so every rank falls back together; forgetting
            # it makes the next step measure again instead of staying dense for good
            self.frames.forget(signature)
            return self.dense.start(group)
        context.stats.add("bytes_sent", float((world - 1) * frame_bytes))
        context.stats.add("count_allgather_buckets", 1)
        record = _InFlight(group, payload, capacity, encoded)

        def finish(gathered: tuple[list[int], list[memoryview]]) -> None:
            lengths, heads = gathered
            if min(lengths) < 0:
                group.mark_nonfinite()
                return
            _check_lengths(lengths, group)
            self.frames.learn(signature, lengths)
            if max(lengths) > capacity:
                record.overflow = (lengths, heads)  # settled by the front-end's thread: see settle()
                return
            self._combine(group, heads, encoded)

        self._in_flight.append(record)
        return Exchange(context, group, gather_frames(payload, capacity, context.process_group, valid=finite), finish)

    def settle(self) -> None:
        """Fetch what did not fit the frames, in launch order (every rank saw the same lengths,
        so every rank runs the same second rounds)."""
        records, self._in_flight = self._in_flight, []
        context = self.context
        for record in records:
            if record.overflow is None or record.group.status == "failed":
                continue
            lengths, heads = record.overflow
            try:
                started = time.perf_counter()
                try:
                    tails = gather_overflow(record.payload, record.capacity, lengths, context.process_group,
                                            timeout=context.timeout)
                except Exception as error:
                    raise collective_failed("AllGather of frame overflow", context.step, error) from error
                context.stats.add("seconds_communicate", time.perf_counter() - started)
                context.stats.add("bytes_sent", float((context.world_size - 1) * (max(lengths) - record.capacity)))
                context.stats.add("count_frame_overflows", 1)
                payloads = [memoryview(bytes(head) + bytes(tail)) for head, tail in zip(heads, tails)]
                self._combine(record.group, payloads, record.encoded)
            except BaseException as error:
                record.group.mark_failed(error)

    # ------------------------------------------------------------------------------ decoding
    def _combine(self, group: Group, payloads: Sequence[memoryview], encoded: Optional[EncodedBucket]) -> None:
        """Decode every rank's payload and reduce into the group's target (summing in rank order,
        so every rank gets the same bits); a non-finite sum marks the group.

        The round's digest covers each source's ``(positions, values)`` as this rank summed them
        (its own reconstruction for itself, the decoded payload for each peer): every rank sums
        the same entries unless a payload changed in flight or an encoder sent other values than
        it reconstructed. Finiteness is checked where values landed, not over the whole buffer."""
        context = self.context
        assert encoded is not None
        divisor = group.divisor
        with context.stats.timer("decode"):
            dtype = group.dtype
            device = group.device
            out = group.output_buffer(dtype)
            summed: list[torch.Tensor] = []
            finite, unchecked = True, []
            for source, data in enumerate(payloads):
                if source == context.rank:  # our own reconstruction is bit-identical to decoding it
                    positions, values = encoded.positions, encoded.values
                else:
                    positions, values = self._decode_from(source, data, group)
                positions = positions.to(device)
                values = values.to(device=device, dtype=dtype)  # a copy unless the codec returned the sent tensor
                summed.extend((positions, values))
                if divisor != 1:  # divide the few sent values, not the whole buffer afterwards
                    values = values / divisor
                # a non-finite sum stays so under further additions: checking each source's writes
                # as they land (the native scatter does it on its way) is checking the final values
                landed_finite = scatter_add(out, positions, values)
                if landed_finite is None:
                    unchecked.append(positions)
                else:
                    finite &= landed_finite
            if unchecked:  # one gather and one host sync for what index_add_ wrote
                finite &= all_finite(out.index_select(0, torch.cat(unchecked)))
            if not finite:  # a peer's payload held NaN/Inf (or the sum overflowed)
                group.mark_nonfinite()
                return
            group.digest = digest_of(summed)
            for entry, sent in zip(group.entries, encoded.sent):
                group.keep(entry, sent.indices.to(device), sent.values.to(device))
            group.write(out)

    def _decode_from(self, source: int, data: memoryview, group: Group) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            return decode_bucket(data, [e.numel for e in group.entries], [e.offset for e in group.entries],
                                 group.numel, index_codec=self.context.index_codec)
        except DecodeError as error:
            raise DecodeError(f"payload from rank {source} at step {self.context.step}: {error}") from error


def _check_lengths(lengths: Sequence[int], group: Group) -> None:
    """Refuse announced payload lengths no codec could produce for this group (every rank sees
    the same lengths, so every rank refuses together) before allocating for them."""
    limit = MAX_PAYLOAD_BYTES_PER_ELEMENT * group.numel + (1 << 20)
    if max(lengths) > limit:
        source = max(range(len(lengths)), key=lambda r: lengths[r])
        raise DecodeError(f"rank {source} announced a payload of {max(lengths)} bytes; at most {limit} "
                          f"are possible for {group.numel} elements")


def count_slack(sparsifier: Any) -> float:
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
