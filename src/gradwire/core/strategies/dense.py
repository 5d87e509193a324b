"""Dense AllReduce of a group: warm-up, ``compressor="none"``, ``collective="dense"``, and the
fallback of ``auto`` when the cost model predicts no saving."""

from __future__ import annotations

import math

import torch

from ... import kernels
from ...exchange import allreduce_sum, ring_allreduce_bytes
from ..digest import lanes_digest
from ...finite import all_finite
from ..group import Group
from .base import Exchange, ExchangeStrategy


class DenseAllReduce(ExchangeStrategy):
    """1. Flatten the group: the raw gradients, or, when selection ran (``group.compensated``),
       the compensated ones — everything that is owed;
    2. SUM AllReduce it;
    3. divide by ``group.divisor``; a non-finite quotient marks the group non-finite (NaN anywhere
       reaches every rank through the sum, so a raw send's input is not checked before, see
       :meth:`~..pipeline.Pipeline.start`); on the CPU the division, that test and the digest
       are one pass (:func:`~gradwire.kernels.divide_and_hash`);
    4. write; after a compensated send nothing stays behind, so
       the residuals are cleared (at the round's end, once every rank agreed)."""

    name = "dense"

    def start(self, group: Group) -> Exchange:
        context = self.context
        compensated = group.compensated
        flat = self._compensated_flat(group) if compensated else group.flat_gradient()
        context.stats.add("bytes_sent", ring_allreduce_bytes(group.numel, group.element_size, context.world_size))
        context.stats.add("count_dense_buckets", 1)
        divisor = group.divisor

        def finish(summed: torch.Tensor) -> None:
            if summed.device.type == "cpu" and summed.dtype in (torch.float32, torch.float64) \
                    and summed.is_contiguous():
                # one pass: divide, test finiteness and hash the quotients (the round's digest)
                finite, lanes = kernels.divide_and_hash(summed.detach().numpy(), divisor)
                if not finite:
                    group.mark_nonfinite()
                    return
                group.digest = lanes_digest(summed, lanes)
            else:
                if not all_finite(summed):
                    group.mark_nonfinite()
                    return
                summed.div_(divisor)
            if compensated:
                group.clear_all()
            group.write(summed)

        summed = allreduce_sum(flat, context.process_group, collective="AllReduce (dense)")
        return Exchange(context, group, summed, finish)

    @staticmethod
    def _compensated_flat(group: Group) -> torch.Tensor:
        """Send everything that is owed: the compensated gradients (zeros for unused entries,
        whose residual stays)."""
        flat = torch.zeros(group.numel, dtype=group.dtype, device=group.device)
        for entry in group.entries:
            if entry.compensated is not None and not entry.unused:
                flat[entry.offset: entry.offset + entry.numel] = entry.compensated
        if not group.finite:  # compensated holds zeros here: a NaN tells every rank, through the sum
            flat[0] = math.nan
        return flat
