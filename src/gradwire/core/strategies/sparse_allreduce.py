"""Sparse AllReduce of per-rank supports: per-worker volume that does not grow with the workers."""

from __future__ import annotations

import time
from typing import Optional

import torch

from ... import codecs as codec_layer
from ...codecs.base import IndexCodec, ValueCodec
from ...errors import CollectiveError, DecodeError, collective_failed
from ...exchange.regions import balanced_boundaries, equal_boundaries
from ...exchange.sparse_allreduce import SparseAllreduceResult, sparse_allreduce
from ...exchange.sparse_reduce_scatter import reduce_in_rank_order
from ..digest import digest_of
from ...finite import all_finite
from ..group import Group
from .base import DeferredStrategy, ExchangeContext

#: Steps between refreshes of a layout's regions (one small AllReduce each; Ok-Topk uses 64).
REGION_REFRESH_STEPS = 64


class RegionCodecAdapter:
    """DeepReduce codecs for region payloads (indices relative to the region start)."""

    def __init__(self, *, index_codec: IndexCodec, value_codec: ValueCodec) -> None:
        self.index_codec, self.value_codec = index_codec, value_codec
        self.error: Optional[BaseException] = None
        self._bounds: dict[tuple[int, int], Optional[int]] = {}

    def max_payload_bytes(self, *, most: int, numel: int) -> Optional[int]:
        """The codecs' bound on one region's payload (``codecs.max_payload_bytes``), kept per
        ``(most, numel)``: a layout asks for the same few every step."""
        key = (most, numel)
        if key not in self._bounds:
            self._bounds[key] = codec_layer.max_payload_bytes([(most, numel)], self.index_codec, self.value_codec)
        return self._bounds[key]

    def encode(self, *, indices: torch.Tensor, values: torch.Tensor, numel: int) -> tuple[bytes, torch.Tensor]:
        """Never raises: an encoder error here would leave the peers waiting in the exchange, so
        it sends bytes no receiver can decode instead (every rank then raises together) and keeps
        the error for this rank to raise."""
        try:
            encoded = codec_layer.encode_tensors([(values, indices, numel)], self.index_codec, self.value_codec,
                                                 check=False)
        except Exception as error:
            self.error = error
            return b"\x00", values.clone()
        return encoded.payload, encoded.tensors[0].values.to(values.dtype)

    def decode(self, data: bytes, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        ((values, indices, _),) = codec_layer.decode_tensors(memoryview(data), expected_numels=[numel])
        return indices, values.to(torch.float32)


class SparseAllReduce(DeferredStrategy):
    """1. Join the group's selections into one sparse contribution over its flat space;
    2. ``exchange.sparse_allreduce``: a sparse reduce-scatter by index region (regions balanced
       from the ranks' selected positions, refreshed every ``REGION_REFRESH_STEPS`` steps), each
       owner sums its region, every rank derives the same threshold leaving about ``k`` entries
       (``group.k``: the sum of the sparsifier's per-parameter targets; the layout's previous
       threshold is the hint that usually settles it in one histogram round), then an AllGather
       of the reduced regions,
       DeepReduce-coded. About ``2k`` entries per worker, whatever the number of workers;
    3. write the average; each rank's residual is its compensated gradient minus what of its own
       contribution survived the second selection (plus, for lossy values, the owner's coding
       error), so ``sum of residuals = sum of compensated - applied``: error feedback telescopes.
    Deferred (:class:`.base.DeferredStrategy`): its rounds run at the round's end, group after
    group; inside the backward they made 2 loopback ranks of ResNet-18 wait for one another 9-86 ms
    per step, against 17-21 ms of CPU in the exchange (docs/benchmarks.md).
    """

    name = "sparse-allreduce"

    def __init__(self, context: ExchangeContext) -> None:
        super().__init__(context)
        self.codec = RegionCodecAdapter(index_codec=context.index_codec, value_codec=context.value_codec)
        self._regions: dict[tuple[int, ...], tuple[int, list[int]]] = {}
        #: the last agreed threshold per layout (the same on every rank): the next step's hint
        self._thresholds: dict[tuple[int, ...], float] = {}

    def reset(self) -> None:
        super().reset()
        self._regions = {}
        self._thresholds = {}

    def _run(self, group: Group) -> None:
        context = self.context
        k = group.k
        with context.stats.timer("encode"):
            positions, values = joined_contribution(group)
            if not group.finite:  # one NaN entry makes every rank see a non-finite sum, together
                positions = torch.zeros(1, dtype=torch.int64, device=group.device)
                values = torch.full((1,), float("nan"), device=group.device)
        boundaries = self._boundaries(group, positions)
        self.codec.error = None
        signature = group.signature()
        started = time.perf_counter()
        try:
            result = sparse_allreduce(indices=positions, values=values, numel=group.numel,
                                      k=k if k is not None else group.numel, boundaries=boundaries,
                                      group=context.process_group, codec=self.codec,
                                      threshold_hint=self._thresholds.get(signature))
        except (DecodeError, CollectiveError) as error:
            raise (self.codec.error or error)
        except RuntimeError as error:
            raise collective_failed("sparse AllReduce", context.step, error) from error
        # blocking: the wall time of its rounds, the coding and merges inside them included
        context.stats.add("seconds_communicate", time.perf_counter() - started)
        if result.finite:  # every rank returned the same threshold, or raised: the hints stay alike
            self._thresholds[signature] = result.threshold
        context.stats.add("bytes_sent", float(result.bytes_sent))
        context.stats.add("count_sparse_allreduce_buckets", 1)
        with context.stats.timer("decode"):
            out = averaged_output(group, result.indices, result.values, finite=result.finite)
            if out is not None:
                keep_own_share(group, positions, result)
                group.write(out)

    def _boundaries(self, group: Group, positions: torch.Tensor) -> list[int]:
        """The layout's regions, refreshed every REGION_REFRESH_STEPS steps (the same steps on
        every rank, so the refresh's collective is issued alike)."""
        signature = group.signature()
        known = self._regions.get(signature)
        step = self.context.step
        if known is None or step - known[0] >= REGION_REFRESH_STEPS:
            if self.context.world_size == 1:
                bounds = equal_boundaries(group.numel, 1)
            else:
                bounds = balanced_boundaries(positions, group.numel, self.context.process_group)
            known = (step, bounds)
            self._regions[signature] = known
        return known[1]


def averaged_output(group: Group, indices: torch.Tensor, values: torch.Tensor, *,
                    finite: bool) -> Optional[torch.Tensor]:
    """The group's flat output holding ``values / group.divisor`` at ``indices`` (a sparse sum over
    ranks), or None after marking the group non-finite (a rank announced NaN/Inf, or the sum has it)."""
    if finite:
        landed = (values / group.divisor).to(group.dtype)
        if all_finite(landed):  # the rest of the output is zeros
            out = group.output_buffer(group.dtype)
            out[indices.to(out.device)] = landed.to(out.device)
            group.digest = digest_of([indices, values])  # identical on every rank by construction
            return out
    group.mark_nonfinite()
    return None


def joined_contribution(group: Group) -> tuple[torch.Tensor, torch.Tensor]:
    """The group's selections as one ascending sparse contribution over its flat space (float32)."""
    device = group.device
    # entries do not overlap and each one's positions ascend, so joining them in the order of their
    # offsets is ascending with no sort; the values the selection read on its way spare a gather
    selected = sorted((e for e in group.entries if e.indices is not None), key=lambda e: e.offset)
    if not selected:
        return torch.zeros(0, dtype=torch.int64, device=device), torch.zeros(0, device=device)
    positions = torch.cat([e.indices + e.offset for e in selected]).to(device)
    values = torch.cat([e.values if e.values is not None else e.compensated[e.indices] for e in selected])
    return positions, values.to(device=device, dtype=torch.float32)


def keep_own_share(group: Group, positions: torch.Tensor, result: SparseAllreduceResult) -> None:
    """Per entry: what of this rank's contribution counts as sent (kept where it survived, minus
    the owner's coding error where this rank owns a region), for ``residual = compensated - sent``."""
    sent_positions = positions[result.survived]
    sent_values = result.contributed[result.survived]
    if result.carry_indices.numel():  # the two ascending lists summed in order, as adding into zeros
        sent_positions, sent_values = reduce_in_rank_order(
            [(sent_positions, sent_values), (result.carry_indices.to(sent_positions.device),
                                             -result.carry_values.to(sent_values.device))],
            sent_positions.device, group.numel)
    starts = torch.tensor([e.offset for e in group.entries], dtype=torch.int64, device=sent_positions.device)
    cuts_lo = torch.searchsorted(sent_positions, starts).tolist()
    cuts_hi = torch.searchsorted(sent_positions, starts + torch.tensor([e.numel for e in group.entries],
                                                                       device=starts.device)).tolist()
    for entry, lo, hi in zip(group.entries, cuts_lo, cuts_hi):
        local = sent_positions[lo:hi] - entry.offset
        group.keep(entry, local, sent_values[lo:hi].to(entry.compensated.dtype))
