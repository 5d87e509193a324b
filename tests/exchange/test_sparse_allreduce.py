"""Sparse AllReduce on real gloo groups: p = 2..5, imbalance, empty ranks, density 1, EF, failures.

Workers return plain lists (tensors through the result queue would need shared memory that dies
with the worker). Every check recomputes the expected result in this process from the inputs.
"""

from __future__ import annotations

import os
import queue as queue_module
import time

import pytest
import torch
import torch.distributed as dist

from gradwire.errors import DecodeError
from gradwire.exchange.calibrate import measure_link
from gradwire.exchange.checked import CollectiveError
from gradwire.exchange.regions import balanced_boundaries, check_boundaries, equal_boundaries
from gradwire.exchange.checked import exact_allreduce_bytes
from gradwire.exchange.threshold_search import count_slack
from gradwire.exchange.sparse_allreduce import sparse_allreduce

from ..distributed import _entry, free_port, run_workers, worker_context
from .codec_adapters import DyingOnRank, FailingOnRank, Fp16Adapter

NUMEL = 2000


def _topk(x: torch.Tensor, k: int) -> torch.Tensor:
    return torch.topk(x.abs(), k).indices.sort().values


def _run(indices, values, numel, k, boundaries, **kw) -> dict:
    result = sparse_allreduce(indices=indices, values=values, numel=numel, k=k, boundaries=boundaries, **kw)
    return {"in_indices": indices.tolist(), "in_values": values.tolist(), "indices": result.indices.tolist(),
            "values": result.values.tolist(), "threshold": result.threshold, "survived": result.survived.tolist(),
            "contributed": result.contributed.tolist(), "finite": result.finite, "sent": result.sent_by_collective,
            "boundaries": list(boundaries), "carry": result.carry_indices.numel()}


def _scenarios(rank: int, world_size: int, group: dist.ProcessGroup) -> dict:
    g = torch.Generator().manual_seed(100 + rank)
    out = {}
    # random supports, balanced regions
    x = torch.randn(NUMEL, generator=g)
    idx = _topk(x, 100)
    out["random"] = _run(idx, x[idx], NUMEL, 100, balanced_boundaries(idx, NUMEL, group), group=group)
    # every rank's big entries fall in the last region; small ones spread out
    equal = equal_boundaries(NUMEL, world_size)
    hot = torch.randperm(NUMEL - equal[-2], generator=g)[:40] + equal[-2]
    cold = torch.randperm(NUMEL, generator=g)[:40]
    idx = torch.unique(torch.cat([hot, cold]))
    vals = torch.rand(idx.numel(), generator=g) * 0.1
    vals[idx >= equal[-2]] += 10.0
    out["hot"] = _run(idx, vals, NUMEL, 50, equal, group=group)
    # balancing follows the selections: all of them in the last tenth of the space
    idx = torch.randperm(NUMEL // 10, generator=g)[:50].sort().values + NUMEL - NUMEL // 10
    out["crowded"] = _run(idx, torch.randn(50, generator=g), NUMEL, 50, balanced_boundaries(idx, NUMEL, group),
                          group=group)
    # empty contributions on rank 0 (and the last rank when p > 2)
    idx = torch.empty(0, dtype=torch.int64) if rank in (0, max(world_size - 1, 2)) else _topk(x, 40)
    out["empty"] = _run(idx, x[idx], NUMEL, 50, equal, group=group)
    # density 1.0 must equal the dense AllReduce
    dense = torch.randn(500, generator=g)
    out["dense"] = _run(torch.arange(500), dense, 500, 500, equal_boundaries(500, world_size), group=group)
    reference = dense.clone()
    dist.all_reduce(reference, group=group)
    out["dense"]["allreduce"] = reference.tolist()
    # lossy codec: identical bits everywhere, EF telescopes with the carry (a shared support, so that
    # the fp16 of a sum of fp16 values differs from the sum somewhere)
    idx = torch.arange(0, NUMEL, 25)
    out["fp16"] = _run(idx, x[idx], NUMEL, 60, equal, codec=Fp16Adapter(), summary_size=16, group=group)
    result = sparse_allreduce(indices=idx, values=x[idx], numel=NUMEL, k=60, boundaries=equal,
                              codec=Fp16Adapter(), summary_size=16, group=group)
    out["fp16"]["residual"] = result.residual(x, indices=idx).tolist()
    out["fp16"]["compensated"] = x.tolist()
    out["fp16"]["carry"] = result.carry_indices.numel()
    raw = sparse_allreduce(indices=idx, values=x[idx], numel=NUMEL, k=60, boundaries=equal, summary_size=16,
                           group=group)
    out["raw_ef"] = {"residual": raw.residual(x, indices=idx).tolist(), "indices": raw.indices.tolist(),
                     "values": raw.values.tolist()}
    # nothing asked for; and a NaN on one rank makes every rank report non-finite
    out["k0"] = _run(idx, x[idx], NUMEL, 0, equal, group=group)["indices"]
    nan_values = x[idx].clone()
    if rank == world_size - 1:
        nan_values[0] = float("nan")
    out["nan"] = _run(idx, nan_values, NUMEL, 60, equal, group=group)["finite"]
    if world_size == 3:
        out["decode_failure"] = _decode_failure(rank, group)
    if world_size == 2:
        link = measure_link(group, large_bytes=1 << 16, repeats=2)
        out["link"] = (link.alpha, link.beta)
    return out


def _every_size(rank: int, world_size: int) -> dict:
    """One spawn for p = 2..5: subgroups of the first p ranks (every rank creates every group)."""
    groups = {size: dist.new_group(list(range(size))) for size in range(2, world_size + 1)}  # before any waits
    return {size: _scenarios(rank, size, group) for size, group in groups.items() if rank < size}


@pytest.fixture(scope="module")
def every_size() -> list[dict]:
    return run_workers(_every_size, 5, timeout=240)


def _reference_sum(results: list[dict], numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-order float32 sum of the contributions and the mask of contributed positions."""
    total = torch.zeros(numel)
    support = torch.zeros(numel, dtype=torch.bool)
    for r in results:
        idx = torch.tensor(r["in_indices"], dtype=torch.int64)
        total[idx] = total[idx] + torch.tensor(r["in_values"])
        support[idx] = True
    return total, support


def _check_exchange(results: list[dict], numel: int, world_size: int) -> torch.Tensor:
    first = results[0]
    for r in results[1:]:
        assert r["indices"] == first["indices"] and r["values"] == first["values"]  # same bits on every rank
    indices = torch.tensor(first["indices"], dtype=torch.int64)
    assert bool((indices[1:] > indices[:-1]).all())
    total, support = _reference_sum(results, numel)
    assert torch.equal(torch.tensor(first["values"]), total[indices])  # rank-order sum, bit for bit
    expected = torch.nonzero(support & (total.abs().double() >= first["threshold"])).reshape(-1)
    assert torch.equal(indices, expected)
    bounds = first["boundaries"]
    for rank, r in enumerate(results):
        own = torch.tensor(r["in_indices"], dtype=torch.int64)
        assert r["survived"] == torch.isin(own, indices).tolist()
        outside = int(((own < bounds[rank]) | (own >= bounds[rank + 1])).sum())
        assert r["sent"]["reduce-scatter"] == 8 * outside
        in_region = int(((indices >= bounds[rank]) & (indices < bounds[rank + 1])).sum())
        assert r["sent"]["allgather"] == 8 * (world_size - 1) * in_region
        # level 1: 16 fingerprint words, two 15-bit status bitmaps, 64 int16 bins (numel < 2^15)
        levels = [name for name in r["sent"] if name.startswith("threshold histogram")]
        assert r["sent"]["threshold histogram 1"] == exact_allreduce_bytes(16 + 2 + 64, 2, rank, world_size)
        for name in levels[1:]:
            assert r["sent"][name] == exact_allreduce_bytes(64, 2, rank, world_size)
    return indices


def _survivors_within_bound(indices: torch.Tensor, k: int, results: list[dict], numel: int) -> None:
    """min(k, N) <= survivors <= k + slack when no magnitudes tie (random data)."""
    support = int(_reference_sum(results, numel)[1].sum())
    assert min(k, support) <= indices.numel() <= (k + count_slack(k) if k < support else support)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3, 4, 5])
def test_sparse_allreduce_on_gloo(every_size: list[dict], world_size: int) -> None:
    results = [r[world_size] for r in every_size[:world_size]]
    random = _check_exchange([r["random"] for r in results], NUMEL, world_size)
    _survivors_within_bound(random, 100, [r["random"] for r in results], NUMEL)
    hot = _check_exchange([r["hot"] for r in results], NUMEL, world_size)
    _survivors_within_bound(hot, 50, [r["hot"] for r in results], NUMEL)
    assert bool((hot >= equal_boundaries(NUMEL, world_size)[-2]).all())
    crowded = [r["crowded"] for r in results]
    _check_exchange(crowded, NUMEL, world_size)
    cuts = crowded[0]["boundaries"][1:-1]
    assert all(c >= NUMEL - NUMEL // 10 for c in cuts)  # equal regions would leave p-1 owners idle
    per_region = [r["sent"]["allgather"] // (8 * (world_size - 1)) for r in crowded]
    assert max(per_region) <= 2 * 50 / world_size + 10, per_region
    empty = _check_exchange([r["empty"] for r in results], NUMEL, world_size)
    _survivors_within_bound(empty, 50, [r["empty"] for r in results], NUMEL)
    assert [r["empty"]["sent"]["reduce-scatter"] for r in results][0] == 0
    dense = [r["dense"] for r in results]
    _check_exchange(dense, 500, world_size)
    assert dense[0]["indices"] == list(range(500)) and dense[0]["threshold"] == float("-inf")
    torch.testing.assert_close(torch.tensor(dense[0]["values"]), torch.tensor(dense[0]["allreduce"]))
    for r in results:
        assert r["k0"] == [] and r["nan"] is False
    _check_lossy_and_feedback(results)


def _check_lossy_and_feedback(results: list[dict]) -> None:
    lossy = [r["fp16"] for r in results]
    for r in lossy[1:]:
        assert r["indices"] == lossy[0]["indices"] and r["values"] == lossy[0]["values"]
    indices = torch.tensor(lossy[0]["indices"], dtype=torch.int64)
    assert 60 <= indices.numel() <= 60 + count_slack(60)  # 16 bins a level: more levels, the same bound
    for r in lossy:  # the sender's own contribution is what the owners decoded: fp16
        assert r["contributed"] == torch.tensor(r["in_values"]).half().float().tolist()
    # EF telescopes: applied + sum of residuals == sum of compensated gradients
    for name in ("fp16", "raw_ef"):
        applied = torch.zeros(NUMEL)
        entry = results[0][name]
        applied[torch.tensor(entry["indices"], dtype=torch.int64)] = torch.tensor(entry["values"])
        residuals = torch.stack([torch.tensor(r[name]["residual"]) for r in results]).sum(0)
        compensated = torch.stack([torch.tensor(r["fp16"]["compensated"]) for r in results]).sum(0)
        torch.testing.assert_close(applied + residuals, compensated, rtol=0, atol=1e-5)
    assert sum(r["fp16"]["carry"] for r in results) > 0  # fp16 of a sum differs from the sum somewhere


def test_world_of_one_and_wide_regions() -> None:
    numel = 2**32 + 10  # region of 2^31 or more: indices travel as two int32 words
    indices = torch.tensor([0, 5, 2**31 + 7, 2**32 + 9])
    values = torch.tensor([1.0, -3.0, 2.0, 0.5])
    result = sparse_allreduce(indices=indices, values=values, numel=numel, k=2, boundaries=[0, numel])
    assert result.indices.tolist() == [5, 2**31 + 7] and result.values.tolist() == [-3.0, 2.0]
    assert result.survived.tolist() == [False, True, True, False] and result.bytes_sent == 0
    with pytest.raises(ValueError, match="boundaries"):
        sparse_allreduce(indices=indices, values=values, numel=numel, k=2, boundaries=[0, 5])
    with pytest.raises(ValueError, match="ascending"):
        sparse_allreduce(indices=indices.flip(0), values=values, numel=numel, k=2, boundaries=[0, numel])
    with pytest.raises(ValueError, match="boundaries"):
        check_boundaries([0, 7, 5, 10], 10, 3)


@pytest.mark.distributed
def test_measured_link_is_the_same_on_every_rank(every_size: list[dict]) -> None:
    links = [r[2]["link"] for r in every_size[:2]]
    assert links[0] == links[1] and links[0][0] > 0 and links[0][1] >= 0
    assert measure_link(None).alpha == 0.0  # a world of one: nothing to measure


def _decode_failure(rank: int, group: dist.ProcessGroup) -> str:
    idx = torch.arange(rank, 100, 3)
    try:
        sparse_allreduce(indices=idx, values=torch.ones(idx.numel()), numel=100, k=10,
                         boundaries=equal_boundaries(100, 3), codec=FailingOnRank(1), group=group)
    except DecodeError as error:
        return str(error)
    return "no error"


@pytest.mark.distributed
def test_an_undecodable_payload_fails_every_rank_together(every_size: list[dict]) -> None:
    messages = [r[3]["decode_failure"] for r in every_size[:3]]
    assert all("rank(s) [1] could not decode" in m for m in messages), messages


def _peer_dies(rank: int, world_size: int, results, when: str) -> None:
    idx = torch.arange(rank, 1000, world_size)
    kwargs = dict(indices=idx, values=torch.ones(idx.numel()), numel=1000, k=50,
                  boundaries=equal_boundaries(1000, world_size))
    if when == "between steps":
        sparse_allreduce(**kwargs)
        if rank == world_size - 1:
            os._exit(1)
    else:  # the last rank dies when it decodes what it received, after the reduce-scatter
        kwargs["codec"] = DyingOnRank(world_size - 1)
    start = time.monotonic()
    try:
        sparse_allreduce(**kwargs)
        results.put((rank, "no error", time.monotonic() - start))
    except CollectiveError as error:
        results.put((rank, str(error), time.monotonic() - start))


def _dying_entry(rank, world_size, port, results, when, environment, cwd):
    _entry(_peer_dies, rank, world_size, port, queue_module.SimpleQueue(), (results, when), 20.0,
           environment, cwd)


@pytest.mark.distributed
@pytest.mark.parametrize("when, collective", [
    ("between steps", "reduce-scatter all_to_all_single (counts)"),
    ("mid-exchange", "threshold histogram 1 all_to_all_single (reduce-scatter)")])
def test_a_dead_peer_makes_every_survivor_raise_within_seconds(when: str, collective: str) -> None:
    context = worker_context()
    results = context.Queue()
    port = free_port()
    environment, cwd = dict(os.environ), os.getcwd()
    processes = [context.Process(target=_dying_entry, daemon=True,
                                 args=(rank, 3, port, results, when, environment, cwd))
                 for rank in range(3)]
    for process in processes:
        process.start()
    try:
        got = [results.get(timeout=90) for _ in range(2)]
    finally:
        for process in processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
    for rank, message, elapsed in got:
        assert message.startswith(f"sparse_allreduce: {collective} failed"), message
        assert elapsed < 10, (rank, elapsed)
