"""Dense AllReduce of blockwise-quantized values (``quantize="int8" | "int4"``), with error feedback."""

from __future__ import annotations

import math
from typing import Optional

import torch

from ...errors import CollectiveError, collective_failed
from ...exchange.quantized import quantized_allreduce
from ..digest import digest_of
from ..feedback import ErrorFeedback, accumulation_dtype
from ..group import Group
from .base import Exchange, ExchangeContext, ExchangeStrategy, run_guarded


class QuantizedAllReduce(ExchangeStrategy):
    """1. ``x = grad + residual`` over the group's flat space (float32; the residual is what
       earlier rounds' quantization left out, per entry; an unused entry, no gradient this round,
       sends zeros and keeps its residual whole: :meth:`~..group.Group.compensated_input`);
    2. ``exchange.quantized_allreduce``: every rank quantizes its chunks in blocks of
       ``block_size`` (int8/int4, one float32 scale per block), an all-to-all reduce-scatter, the
       owner sums in float32 in rank order and re-quantizes, an all-to-all AllGather; every rank
       dequantizes the same bytes, so every rank applies the same result (two ranks swap their
       quantized inputs in one round and each adds both decodings, re-quantizing nothing);
    3. NaN/Inf on any rank travels as NaN scales: every rank marks the group non-finite together;
    4. write the result divided by ``group.divisor``; each rank keeps its residual (its
       quantization error, plus the owner's re-quantization error on the chunk it owns), so what
       no rank applied stays in some rank's residual (:mod:`gradwire.exchange.quantized`).
    Blocking, on the front-end's thread. About ``2(p-1)/p · n · (bits/8 + 4/block_size)`` bytes.
    """

    name = "quantized"

    def __init__(self, context: ExchangeContext, feedback: Optional[ErrorFeedback], *, bits: int,
                 block_size: int) -> None:
        super().__init__(context)
        self.feedback, self.bits, self.block_size = feedback, bits, block_size

    def start(self, group: Group) -> Exchange:
        run_guarded(group, lambda: self._run(group))
        return Exchange(self.context, group)

    def _run(self, group: Group) -> None:
        context = self.context
        with context.stats.timer("encode"):
            flat = group.compensated_input(self.feedback)  # unused entries keep their residual whole
            if not group.finite:  # one NaN block tells every rank, through the owner's sum
                flat[:1] = math.nan
        try:
            result = quantized_allreduce(flat, bits=self.bits, block_size=self.block_size,
                                         group=context.process_group)
        except CollectiveError:
            raise
        except RuntimeError as error:
            raise collective_failed("quantized AllReduce", context.step, error) from error
        context.stats.add("bytes_sent", float(result.bytes_sent))
        context.stats.add("count_quantized_buckets", 1)
        with context.stats.timer("decode"):
            if not bool(result.finite):
                group.mark_nonfinite()
                return
            group.digest = digest_of([result.values])  # identical on every rank by construction
            if self.feedback is not None:
                for entry in group.entries:
                    piece = result.residual[entry.offset: entry.offset + entry.numel]  # the exchange's own
                    group.keep_residual(entry, self.feedback.held_copy(piece, accumulation_dtype(entry.grad),
                                                                       owned=True))
            # every element is written: the output needs no zero-fill, and the division writes it
            out = group.output_buffer(group.dtype, zeroed=False)
            torch.div(result.values.to(out.dtype), group.divisor, out=out)
            group.write(out)
