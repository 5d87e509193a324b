"""AllReduce of the values at a support every rank shares (``randomk``, ``randomblock``)."""

from __future__ import annotations

import torch

from ...exchange import allreduce_sum, ring_allreduce_bytes
from ..config import CAST_VALUE_CODECS
from ..digest import digest_of
from ...finite import all_finite
from ..group import Group, flat_positions
from .base import Exchange, ExchangeStrategy

_WIRE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
assert set(_WIRE_DTYPES) == set(CAST_VALUE_CODECS)


class SharedSupportAllReduce(ExchangeStrategy):
    """1. Gather the compensated values at the shared positions (zeros for unused entries), cast
       to the wire dtype, and append one element that flags NaN/Inf on this rank;
    2. SUM AllReduce (no indices travel: every rank drew the same positions from the seed);
    3. a raised flag marks the group non-finite on every rank alike;
    4. scatter the values divided by ``group.divisor`` into the output and keep ``compensated - sent`` as residual."""

    name = "allreduce"

    def start(self, group: Group) -> Exchange:
        context = self.context
        wire_dtype = _WIRE_DTYPES.get(context.value_codec.name, torch.float32)
        device = group.device
        with context.stats.timer("encode"):
            positions = flat_positions([e.indices for e in group.entries], [e.offset for e in group.entries]) \
                if group.entries else torch.zeros(0, dtype=torch.int64, device=device)  # in the group's flat space
            sent = _gathered(group, positions).to(wire_dtype)
            flag = torch.tensor([0.0 if group.finite else 1.0], dtype=wire_dtype, device=sent.device)
            message = torch.cat([sent, flag]).to(device)
        context.stats.add("bytes_sent", ring_allreduce_bytes(message.numel(), message.element_size(),
                                                             context.world_size))

        def finish(summed: torch.Tensor) -> None:
            if float(summed[-1]) != 0 or not group.finite:
                group.mark_nonfinite()
                return
            with context.stats.timer("decode"):
                dtype = group.dtype
                if not all_finite(summed[:-1]):  # the sum of finite values overflowed
                    group.mark_nonfinite()
                    return
                group.digest = digest_of([summed])
                averaged = summed[:-1].to(dtype) / group.divisor
                out = group.output_buffer(dtype)
                # one scatter into the output and one cast of what was sent for the whole group (and
                # one residual update when the selection laid the entries end to end, else one each)
                out[positions] = averaged
                kept = sent.to(device=device, dtype=dtype)
                if group.compensated_flat is not None:  # the residual's update too, once for the group
                    group.keep_flat(positions, kept)
                else:
                    position = 0
                    for entry in group.entries:
                        k = entry.indices.numel()
                        group.keep(entry, entry.indices, kept[position: position + k])
                        position += k
                group.write(out)

        summed = allreduce_sum(message, context.process_group, collective="AllReduce (shared support)")
        return Exchange(context, group, summed, finish)


def _gathered(group: Group, positions: torch.Tensor) -> torch.Tensor:
    """The compensated values at ``positions`` (the entries' shared positions in the group's flat
    space, end to end), zeros for unused entries: one gather from ``group.compensated_flat`` when
    the selection set it, else one per entry."""
    if group.compensated_flat is not None:
        return group.compensated_flat[positions]
    if not group.entries:
        return torch.zeros(0, dtype=group.dtype, device=group.device)
    return torch.cat([torch.zeros(e.indices.numel(), dtype=e.compensated.dtype, device=e.compensated.device)
                      if e.unused else e.compensated[e.indices] for e in group.entries])
