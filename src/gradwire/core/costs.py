"""``collective="auto"``'s cost model: what each strategy would take for a group, in seconds.

For each candidate — dense AllReduce, payload AllGather, sparse AllReduce (lossless index codecs
only), hierarchical (when ``hierarchy`` is set) — :mod:`gradwire.exchange.alphabeta` predicts
``α·rounds + β·bytes + γ·decoded entries + cpu`` from numbers every rank holds alike:

* the group's numel and ``k``, the sum of the sparsifier's per-parameter targets (shapes only);
* bytes per coded entry, estimated from the codecs (:func:`entry_bytes`), not from this rank's
  payload, which differs between ranks;
* the link's α and β: configured (``link_gbit``, ``link_alpha``) or measured at the first step
  by timed AllReduces whose results all ranks agree on (the maximum);
* γ, seconds per decoded entry, and the CPU a sparse strategy spends before anything travels —
  compensation and selection per element, encoding per entry —: measured at the first step on
  synthetic data with the configured sparsifier and codecs, on the gradients' device, agreed the
  same way (the maximum over ranks). Dense pays none of that (its compensation is one add).

So every rank makes the same prediction, and a strategy is chosen only when it is predicted
strictly faster than dense. The prediction is then checked on real steps
(:mod:`gradwire.core.online`), and the AllGather still checks the real payload lengths and falls
back to dense when they turn out larger than predicted.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from .. import codecs as codec_layer
from ..codecs.base import IndexCodec, ValueCodec
from ..exchange.alphabeta import (
    Cost,
    Link,
    allgather_payloads,
    choose,
    dense_allreduce,
    hierarchical_cost,
    sparse_allreduce_cost,
)
from ..exchange.calibrate import measure_link
from ..exchange.checked import wait_checked
from ..exchange.collectives import communication_device
from ..exchange.threshold_search import count_dtype
from ..sparsify.base import Sparsifier

#: Nominal bytes per value of the cast codecs; other value codecs are measured.
_VALUE_BYTES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "fp16-scaled": 2.0}


def entry_bytes(index_codec: IndexCodec, value_codec: ValueCodec, *, numel: int, k: int) -> float:
    """Estimated bytes per sent entry: index bits near ``log2(numel/k) + 2`` for a compressed
    index codec (Rice/Elias-Fano sit there), 8 for raw positions; the value codec's nominal bytes."""
    density = max(k, 1) / max(numel, 1)
    index = 8.0 if index_codec.name == "raw" else (math.log2(1.0 / density) + 2.0) / 8.0
    return index + _VALUE_BYTES.get(value_codec.name, 4.0)


@dataclass(frozen=True)
class Calibration:
    """What the choice needs besides shapes, agreed by all ranks: the link, seconds per decoded
    entry, and the CPU of a sparse strategy before anything travels (seconds per element
    compensated and selected, per entry encoded)."""

    link: Link
    decode_seconds_per_entry: float
    select_seconds_per_element: float = 0.0
    encode_seconds_per_entry: float = 0.0


def calibrate(group: Optional[dist.ProcessGroup], world_size: int, *, index_codec: IndexCodec,
              value_codec: ValueCodec, link_gbit: Optional[float], link_alpha: Optional[float],
              sparsifier: Optional[Sparsifier] = None, device: "torch.device | str" = "cpu") -> Calibration:
    """Measure (or take from the config) α, β; measure γ and the sparse strategies' CPU on
    ``device`` (best of 3 on synthetic data); the same numbers on every rank. Blocking."""
    if link_gbit is not None:
        link = Link.from_rate(link_gbit, alpha=20e-6 if link_alpha is None else link_alpha)
    else:
        link = measure_link(group)
        if link_alpha is not None:
            link = Link(link_alpha, link.beta)
    measured = [_decode_seconds_per_entry(index_codec, value_codec),
                *_select_and_encode_seconds(sparsifier, index_codec, value_codec, torch.device(device))]
    if world_size > 1:
        agreed = torch.tensor(measured, dtype=torch.float64, device=communication_device(group))
        wait_checked(dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group, async_op=True),
                     "auto calibration", "all_reduce (decode, select and encode costs)")
        measured = agreed.cpu().tolist()
    return Calibration(link, *measured)


def _select_and_encode_seconds(sparsifier: Optional[Sparsifier], index_codec: IndexCodec, value_codec: ValueCodec,
                               device: torch.device, numel: int = 1 << 20) -> tuple[float, float]:
    """Seconds per element of ``grad + residual`` and the sparsifier's selection on it, and per
    entry of encoding the selection (0, 0 without a sparsifier)."""
    if sparsifier is None:
        return 0.0, 0.0
    generator = torch.Generator().manual_seed(1)
    grad = torch.randn(numel, generator=generator).to(device)
    residual = torch.randn(numel, generator=generator).to(device) * 0.1
    out = torch.empty_like(grad)
    select, encode = math.inf, math.inf
    for step in range(3):
        start = time.perf_counter()
        indices = sparsifier.select_compensated(grad, residual, out, step=step, tensor_id=0)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        middle = time.perf_counter()
        if indices.numel():
            codec_layer.encode_tensors([(out[indices].cpu(), indices.cpu(), numel)], index_codec, value_codec,
                                       check=False)
        select, encode = min(select, middle - start), min(encode, time.perf_counter() - middle)
    return select / numel, encode / max(1, indices.numel())


def _decode_seconds_per_entry(index_codec: IndexCodec, value_codec: ValueCodec, numel: int = 1 << 20,
                              k: int = 1 << 14) -> float:
    generator = torch.Generator().manual_seed(0)
    indices = torch.sort(torch.randperm(numel, generator=generator)[:k]).values
    values = torch.randn(k, generator=generator)
    payload = codec_layer.encode_tensors([(values, indices, numel)], index_codec, value_codec, check=False).payload
    best = math.inf
    for _ in range(3):
        start = time.perf_counter()
        codec_layer.decode_tensors(memoryview(payload), expected_numels=[numel])
        best = min(best, time.perf_counter() - start)
    return best / k


def candidates(*, numel: int, k: int, world_size: int, bytes_per_entry: float, sparse_allreduce: bool,
               local_size: Optional[int], calibration: Optional[Calibration] = None) -> list[Cost]:
    """The strategies a per-rank support may take for a group, with their predicted costs (with a
    ``calibration``, the sparse ones carry their measured selection and encoding CPU)."""
    costs = [allgather_payloads(k, world_size, bytes_per_entry, length_round=False)]
    if sparse_allreduce:
        costs.append(sparse_allreduce_cost(k, world_size, bytes_per_entry,
                                           count_bytes=count_dtype(numel).itemsize))
        if local_size and local_size > 1 and world_size % local_size == 0:
            costs.append(hierarchical_cost(numel, k, world_size // local_size, local_size, bytes_per_entry))
    if calibration is not None:
        cpu = calibration.select_seconds_per_element * numel + calibration.encode_seconds_per_entry * k
        costs = [dataclasses.replace(cost, cpu_seconds=cpu) for cost in costs]
    return [dense_allreduce(numel, world_size), *costs]


def choose_strategy(calibration: Calibration, costs: list[Cost], intra: Optional[Link] = None) -> str:
    return choose(costs, calibration.link, decode_per_entry=calibration.decode_seconds_per_entry, intra=intra)


def predicted_seconds(calibration: Calibration, costs: list[Cost], intra: Optional[Link] = None) -> dict[str, float]:
    """Each candidate's predicted seconds (what :func:`choose_strategy` compares)."""
    return {cost.strategy: cost.seconds(calibration.link, decode_per_entry=calibration.decode_seconds_per_entry,
                                        intra=intra) for cost in costs}
