"""The core's sparse AllReduce (``collective="sparse-allreduce"``) replayed across W workers in one process.

:class:`SimulatedSparseAllReduce` runs what :class:`gradwire.core.strategies.SparseAllReduce` and
:func:`gradwire.exchange.sparse_allreduce.sparse_allreduce` do on W ranks, with their own pieces
wherever a piece is local to one rank, and replays only what crosses ranks:

1. each worker joins its selections into one contribution (``joined_contribution``) and, every
   ``REGION_REFRESH_STEPS`` rounds, casts its ballot for the regions (``boundary_votes``); the
   ballots are summed (an exact integer sum: any order) into the same boundaries;
2. reduce-scatter: each worker codes its entries of region j (``encode_region``, the hook's
   ``RegionCodecAdapter``); owner j decodes every worker's payload and sums them in rank order
   (``reduce_in_rank_order``, the owner's own code);
3. threshold: the owners' histograms (``ThresholdSearch.local_counts``) summed level by level
   (integers again), each level refined by ``ThresholdSearch.refine``, the previous round's
   threshold of the same layout as the hint;
4. AllGather: each owner codes the entries of its region at or above the threshold; every worker
   applies the decoded bytes; the owner's re-coding error is its carry;
5. each worker's error feedback: ``keep_own_share`` (the strategy's own function) on a result
   holding what the owners decoded of its contribution, then the same ``ErrorFeedback.update``
   calls the core's round makes.

So the average and every residual are the same bits as on real ranks
(``tests/test_diloco_sim.py`` checks the global parameters at p = 3 against gloo ranks of
``gradwire.DiLoCo``). **Bytes**: each worker's are counted with the exchange's rules
(``sent_by_collective``: counts and lengths 8 (p-1) each, its coded entries for other owners,
``exact_allreduce_bytes`` per histogram level, its region's payload to p - 1 peers); they differ by
rank, and :meth:`SimulatedSparseAllReduce.average` reports their mean. The regions' ballot (one
int64 AllReduce of p words every 64 rounds) is not counted, as the front-end's statistics do not.
"""

from __future__ import annotations

from typing import Hashable, Optional, Sequence

import torch
from torch import Tensor

from ..core.config import ExchangeConfig
from ..core.feedback import ErrorFeedback
from ..core.group import Group
from ..core.strategies.sparse_allreduce import (REGION_REFRESH_STEPS, RegionCodecAdapter, averaged_output,
                                                joined_contribution, keep_own_share)
from ..exchange.checked import exact_allreduce_bytes
from ..exchange.region_payload import decode_region, encode_region, is_wide
from ..exchange.regions import boundaries_from_votes, boundary_votes
from ..exchange.sparse_allreduce import SparseAllreduceResult, coding_carry, positions_in
from ..exchange.sparse_reduce_scatter import RegionStatus, reduce_in_rank_order, status_words
from ..exchange.threshold_search import ThresholdSearch, count_dtype, magnitude_keys

__all__ = ["SimulatedSparseAllReduce"]


class SimulatedSparseAllReduce:
    """The sparse AllReduce of W workers' selected groups (module docstring).

    Args:
        config: the exchange's options (its codecs code the region payloads).
        workers: W >= 2.
    """

    def __init__(self, config: ExchangeConfig, workers: int) -> None:
        self.workers = workers
        self.codec = RegionCodecAdapter(index_codec=config.index_codec, value_codec=config.value_codec)
        self._regions: dict[Hashable, tuple[int, list[int]]] = {}
        self._thresholds: dict[Hashable, float] = {}

    def average(self, groups: Sequence[Group], k: int, step: int,
                feedback: Sequence[Optional[ErrorFeedback]]) -> tuple[Tensor, float]:
        """The average every worker writes, and the mean bytes a worker sends; residuals updated.

        Args:
            groups: worker w's group (selection done) at ``groups[w]``, every one finite.
            k: the entries to keep of the sum (the planner's ``target_k``).
            step: the round (for the regions' refresh, as the strategy's ``context.step``).
            feedback: worker w's error feedback (or None) at ``feedback[w]``.

        Returns:
            The flat average (float32, zeros off the support) and the mean bytes per worker.

        Raises:
            FloatingPointError: a sum is NaN or Inf (every real rank would skip the round).
        """
        # 1. each worker's contribution; the regions from the summed ballots
        p, numel = self.workers, groups[0].numel
        contributions = [joined_contribution(group) for group in groups]
        signature = groups[0].signature()
        bounds = self._boundaries(signature, [positions for positions, _ in contributions], numel, step)
        lengths = [b - a for a, b in zip(bounds, bounds[1:])]
        wide = is_wide(bounds)
        sent = [8.0 * (p - 1)] * p  # the reduce-scatter's counts

        # 2. reduce-scatter: worker r's payload for owner j, decoded by j, summed in rank order
        received: list[list[tuple[Tensor, Tensor]]] = [[] for _ in range(p)]
        contributed = []
        for worker, (positions, values) in enumerate(contributions):
            cuts = torch.searchsorted(positions, torch.tensor(bounds, dtype=torch.int64)).tolist()
            decoded = []
            for owner in range(p):
                data, own_view = encode_region(self.codec, positions[cuts[owner]:cuts[owner + 1]] - bounds[owner],
                                               values[cuts[owner]:cuts[owner + 1]], lengths[owner], wide)
                decoded.append(own_view)
                received[owner].append(decode_region(self.codec, data, lengths[owner], wide, "simulated region"))
                if owner != worker:
                    sent[worker] += data.numel()
            contributed.append(torch.cat(decoded))
        sums = [reduce_in_rank_order(received[owner], torch.device("cpu"), lengths[owner]) for owner in range(p)]
        if not all(bool(torch.isfinite(values).all()) for _, values in sums):
            raise FloatingPointError(f"NaN or Inf in a sparse AllReduce's sum at round {step}")

        # 3. the threshold, level by level; level 1 carries the fingerprint and status words
        keys = [magnitude_keys(values) for _, values in sums]
        search = ThresholdSearch.start(k, None, self._thresholds.get(signature))
        dtype = count_dtype(numel)
        head = search.fingerprint_words(dtype).numel() + status_words(RegionStatus.OK, 0, p, dtype).numel()
        while not search.done:
            counts = [search.local_counts(owner_keys) for owner_keys in keys]
            words = counts[0].numel() + (head if search.level == 0 else 0)
            for worker in range(p):
                sent[worker] += exact_allreduce_bytes(words, dtype.itemsize, worker, p)
            search = search.refine(torch.stack(counts).sum(0))
        self._thresholds[signature] = search.threshold

        # 4. the AllGather of each region's survivors; everyone applies the decoded bytes
        out_indices, out_values, carries = [], [], []
        for owner, ((region, region_sums), owner_keys) in enumerate(zip(sums, keys)):
            keep = owner_keys >= search.threshold_key
            kept, kept_sums = region[keep], region_sums[keep]
            data, _ = encode_region(self.codec, kept, kept_sums, lengths[owner], wide)
            sent[owner] += 8.0 * (p - 1) + data.numel() * (p - 1)
            relative, applied = decode_region(self.codec, data, lengths[owner], wide, "simulated region")
            out_indices.append(relative + bounds[owner])
            out_values.append(applied)
            carries.append(coding_carry(kept, kept_sums, applied, bounds[owner]))
        indices, values = torch.cat(out_indices), torch.cat(out_values)

        # 5. each worker's share of what survived, into its residuals as the core's round keeps them
        for worker, (group, (positions, _)) in enumerate(zip(groups, contributions)):
            carry_indices, carry_values = carries[worker]
            result = SparseAllreduceResult(indices, values, positions_in(positions, indices), contributed[worker],
                                           carry_indices, carry_values, search.threshold, True)
            keep_own_share(group, positions, result)
            if feedback[worker] is not None:
                for key, compensated, kept_at, kept_values in group.feedback_updates:
                    feedback[worker].update(key, compensated, kept_at, kept_values)
        out = averaged_output(groups[0], indices, values, finite=True)
        if out is None:
            raise FloatingPointError(f"NaN or Inf in a sparse AllReduce's average at round {step}")
        return out.to(torch.float32), sum(sent) / p

    def _boundaries(self, signature: Hashable, positions: list[Tensor], numel: int, step: int) -> list[int]:
        """The layout's regions from the summed ballots, refreshed every REGION_REFRESH_STEPS rounds."""
        known = self._regions.get(signature)
        if known is None or step - known[0] >= REGION_REFRESH_STEPS:
            votes = torch.stack([boundary_votes(own, self.workers) for own in positions]).sum(0)
            known = (step, boundaries_from_votes(votes, numel, self.workers))
            self._regions[signature] = known
        return known[1]
