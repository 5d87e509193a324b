"""α–β–γ projection of the exchange strategies to many workers, from measured constants.

``gradwire bench scaling`` measures, on the emulated cluster, the bytes one coded entry costs on
the wire and the CPU seconds the hook spends decoding one entry; this module feeds them to the
cost model of :mod:`gradwire.exchange.alphabeta` for models and worker counts no machine here can
run (p = 16 … 1024 at 10 / 25 / 100 Gbit/s) and asks, per point:

* which strategy the model predicts fastest (``winner``), with the measured constants;
* what ``collective="auto"`` would choose there (:func:`gradwire.core.costs.candidates` and
  :func:`~gradwire.core.costs.choose_strategy`, with the hook's own *estimate* of the bytes per
  entry from the codecs, not the measured one): ``auto_ok`` says whether it picks the winner;
* the sparse AllReduce's per-worker volume in units of ``k`` (target: ≤ :data:`SPARSE_VOLUME_TARGET_K`
  for every p), in the hook's steady state (one histogram level: the previous threshold as hint) and
  without a hint (two levels, a first step);
* the smallest p at which the payload AllGather of top-k becomes slower than dense AllReduce.

α cannot be measured here (no latency emulation): it is a modelled constant (``alpha``).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch

from .. import codecs as codec_layer
from ..exchange.alphabeta import (
    Cost,
    Link,
    allgather_payloads,
    dense_allreduce,
    hierarchical_cost,
    sparse_allreduce_cost,
)
from ..core.costs import Calibration, candidates, choose_strategy, entry_bytes
from ..core.config import ExchangeConfig

#: model name -> parameters (ResNet-50: torchvision's 25,557,032)
PROJECTED_MODELS = {"resnet50": 25_557_032, "1b": 1_000_000_000}
PROJECTED_WORKERS = (16, 32, 64, 128, 256, 512, 1024)
PROJECTED_LINKS_GBIT = (10.0, 25.0, 100.0)
#: the sparse AllReduce's per-worker volume, in entries of k, that must hold for every projected p
SPARSE_VOLUME_TARGET_K = 2.2
#: the strategies drawn and compared, in the model's names
STRATEGY_NAMES = ("dense", "allgather", "sparse-allreduce", "hierarchical")


@dataclass(frozen=True)
class Constants:
    """What the projection takes from measurements (or defaults).

    Attributes:
        bytes_per_entry: wire bytes per sent sparse entry (index + value + framing + TCP/IP).
        decode_seconds_per_entry: the hook's decode CPU seconds per received entry.
        alpha: seconds per message round (modelled: the cluster here emulates no latency).
        local_size: workers per node for the hierarchical exchange.
        intra_gbit: the in-node link's rate in Gbit/s (NVLink-class by default).
        intra_alpha: the in-node link's seconds per round.
        values: the value codec auto's own estimate assumes.
        indices: the index codec auto's own estimate assumes.
        source: where the numbers came from.
    """

    bytes_per_entry: float = 3.2
    decode_seconds_per_entry: float = 20e-9
    alpha: float = 20e-6
    local_size: int = 8
    intra_gbit: float = 800.0
    intra_alpha: float = 5e-6
    values: str = "fp16"
    indices: str = "rice"
    source: str = "defaults"


def decode_seconds_per_entry(values: str, indices: str, *, numel: int = 1 << 22, density: float = 0.01,
                             repeats: int = 5) -> float:
    """CPU seconds to decode one entry of a payload coded with ``values``/``indices`` (best of
    ``repeats``, one thread: what one worker of a busy machine gets at best)."""
    value_codec, index_codec = ExchangeConfig(value_codec=values, index_codec=indices).build_codecs()
    generator = torch.Generator().manual_seed(0)
    k = max(1, round(density * numel))
    positions = torch.sort(torch.randperm(numel, generator=generator)[:k]).values
    payload = codec_layer.encode_tensors([(torch.randn(k, generator=generator), positions, numel)], index_codec,
                                         value_codec, check=False).payload
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        best = math.inf
        for _ in range(repeats):
            start = time.perf_counter()
            codec_layer.decode_tensors(memoryview(payload), expected_numels=[numel])
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return best / k


def _local(world_size: int, local_size: int) -> Optional[int]:
    return local_size if local_size > 1 and world_size % local_size == 0 and world_size > local_size else None


def strategy_costs(numel: int, k: int, world_size: int, constants: Constants, local_size: int = 1) -> list[Cost]:
    """The strategies' costs for one flat gradient of ``numel`` elements, ``k`` kept; the
    hierarchical one only with ``local_size`` > 1 workers per node."""
    e = constants.bytes_per_entry
    costs = [dense_allreduce(numel, world_size), allgather_payloads(k, world_size, e, length_round=False),
             sparse_allreduce_cost(k, world_size, e)]
    local = _local(world_size, local_size)
    if local:
        costs.append(hierarchical_cost(numel, k, world_size // local, local, e))
    return costs


def project_point(numel: int, density: float, world_size: int, gbit: float, constants: Constants,
                  local_size: int = 1) -> dict[str, Any]:
    """One (model, p, link, layout) point: seconds per strategy, the winner, auto's choice,
    volumes. ``local_size`` > 1: nodes of that many workers (adds the hierarchical exchange)."""
    k = max(1, round(density * numel))
    link = Link.from_rate(gbit, alpha=constants.alpha)
    intra = Link.from_rate(constants.intra_gbit, alpha=constants.intra_alpha)
    costs = strategy_costs(numel, k, world_size, constants, local_size)
    seconds = {c.strategy: c.seconds(link, decode_per_entry=constants.decode_seconds_per_entry, intra=intra)
               for c in costs}
    order = {name: i for i, name in enumerate(STRATEGY_NAMES)}
    winner = min(seconds, key=lambda name: (seconds[name], order[name]))
    # auto as the hook runs it: its own bytes-per-entry estimate from the codecs
    config = ExchangeConfig(value_codec=constants.values, index_codec=constants.indices)
    value_codec, index_codec = config.build_codecs()
    estimate = entry_bytes(index_codec, value_codec, numel=numel, k=k)
    auto_costs = candidates(numel=numel, k=k, world_size=world_size, bytes_per_entry=estimate,
                            sparse_allreduce=True, local_size=_local(world_size, local_size))
    auto = choose_strategy(Calibration(link, constants.decode_seconds_per_entry), auto_costs, intra=intra)
    sparse = next(c for c in costs if c.strategy == "sparse-allreduce")
    allgather = next(c for c in costs if c.strategy == "allgather")
    return {
        "numel": numel, "k": k, "world_size": world_size, "gbit": gbit, "local_size": local_size,
        "seconds": seconds, "winner": winner,
        "auto": auto, "auto_ok": auto == winner or seconds[auto] <= seconds[winner] * 1.0001,
        "bytes": {c.strategy: c.bytes_sent + c.intra_bytes for c in costs},
        "sparse_allreduce_volume_k": sparse.bytes_sent / constants.bytes_per_entry / k,
        "sparse_allreduce_volume_k_unhinted": (sparse_allreduce_cost(k, world_size, constants.bytes_per_entry, levels=2)
                                               .bytes_sent / constants.bytes_per_entry / k),
        "allgather_volume_k": allgather.bytes_sent / constants.bytes_per_entry / k,
    }


def allgather_loses_at(numel: int, density: float, gbit: Optional[float], constants: Constants,
                       limit: int = 1 << 20) -> Optional[int]:
    """Smallest p ≥ 2 at which the payload AllGather is predicted slower than dense AllReduce
    (``gbit=None``: in bytes per worker only); None if not up to ``limit``. Bisection: the
    AllGather's excess over dense grows with p."""
    k = max(1, round(density * numel))
    e = constants.bytes_per_entry

    def loses(p: int) -> bool:
        dense, gather = dense_allreduce(numel, p), allgather_payloads(k, p, e, length_round=False)
        if gbit is None:
            return gather.bytes_sent > dense.bytes_sent
        link = Link.from_rate(gbit, alpha=constants.alpha)
        gamma = constants.decode_seconds_per_entry
        return gather.seconds(link, decode_per_entry=gamma) > dense.seconds(link, decode_per_entry=gamma)

    if loses(2):
        return 2
    if not loses(limit):
        return None
    low, high = 2, limit  # loses(low) is False, loses(high) is True
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if loses(middle) else (middle, high)
    return high


def project(constants: Constants, *, density: float = 0.01, models: dict[str, int] = PROJECTED_MODELS,
            workers: tuple[int, ...] = PROJECTED_WORKERS,
            links_gbit: tuple[float, ...] = PROJECTED_LINKS_GBIT) -> dict[str, Any]:
    """Every point of models x links x workers x layouts (flat, and nodes of ``constants.local_size``),
    and the AllGather/dense crossing per model and link."""
    layouts = (1, constants.local_size) if constants.local_size > 1 else (1,)
    points = [dict(project_point(numel, density, p, gbit, constants, local), model=name)
              for name, numel in models.items() for gbit in links_gbit for local in layouts for p in workers]
    crossings = {name: {"bytes": allgather_loses_at(numel, density, None, constants),
                        **{f"{gbit:g}gbit": allgather_loses_at(numel, density, gbit, constants) for gbit in links_gbit}}
                 for name, numel in models.items()}
    return {"constants": asdict(constants), "density": density, "points": points, "allgather_loses_at": crossings,
            "max_sparse_allreduce_volume_k": max(point["sparse_allreduce_volume_k"] for point in points),
            "max_sparse_allreduce_volume_k_unhinted": max(point["sparse_allreduce_volume_k_unhinted"]
                                                          for point in points),
            "auto_picks_winner": all(point["auto_ok"] for point in points)}
