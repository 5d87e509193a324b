"""Hierarchical sparse AllReduce on real gloo groups: 2x2, 2x1 and 1x2 (one spawn of 4 ranks)."""

from __future__ import annotations

import pytest
import torch

from gradwire.exchange.hierarchy import build_hierarchy, hierarchical_sparse_allreduce
from gradwire.exchange.threshold_search import count_slack

from ..distributed import run_workers

NUMEL, K = 1000, 60
#: name -> (local_size, global ranks)
LAYOUTS = {"2x2": (2, [0, 1, 2, 3]), "2x1": (1, [0, 1]), "1x2": (2, [2, 3])}


def _select_twice_k(shard_sum: torch.Tensor) -> torch.Tensor:
    """More than the shard's share of k, so the cross-node selection has to drop some."""
    return torch.topk(shard_sum.abs(), min(2 * K, shard_sum.numel())).indices.sort().values


def _layouts(rank: int, world_size: int) -> dict:
    # every rank builds every layout, in the same order
    hierarchies = {name: build_hierarchy(local, ranks) for name, (local, ranks) in LAYOUTS.items()}
    out = {}
    for name, hierarchy in hierarchies.items():
        if hierarchy is None:
            continue
        g = torch.Generator().manual_seed(7 + rank)
        x = torch.randn(NUMEL, generator=g)
        r = hierarchical_sparse_allreduce(dense=x, k=K, hierarchy=hierarchy, select=_select_twice_k)
        dense = hierarchical_sparse_allreduce(dense=x, k=NUMEL, hierarchy=hierarchy,
                                              select=lambda s: torch.arange(s.numel()))
        nan = x.clone()
        if hierarchy.node == 0 and hierarchy.local_rank == hierarchy.local_size - 1:
            nan[0] = float("nan")
        finite = hierarchical_sparse_allreduce(dense=nan, k=K, hierarchy=hierarchy, select=_select_twice_k).finite
        start, _ = r.shard
        out[name] = {"x": x.tolist(), "indices": r.indices.tolist(), "values": r.values.tolist(),
                     "residual": r.residual(NUMEL).tolist(), "node": hierarchy.node, "local_rank": hierarchy.local_rank,
                     "chosen": (r.shard_indices + start).tolist(), "chosen_sum": r.shard_sum[r.shard_indices].tolist(),
                     "dense_indices": dense.indices.tolist(), "dense_values": dense.values.tolist(),
                     "finite": (r.finite, dense.finite, finite), "cross": r.sent_cross, "intra": r.sent_intra}
    return out


@pytest.fixture(scope="module")
def layouts() -> list[dict]:
    return run_workers(_layouts, 4, timeout=240)


@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_hierarchical_sparse_allreduce(layouts: list[dict], name: str) -> None:
    local_size, ranks = LAYOUTS[name]
    results = [layouts[rank][name] for rank in ranks]
    first = results[0]
    for r in results[1:]:  # identical bits on every rank
        assert (r["indices"], r["values"]) == (first["indices"], first["values"])
        assert (r["dense_indices"], r["dense_values"]) == (first["dense_indices"], first["dense_values"])
    assert all(r["finite"] == (True, True, False) for r in results)
    indices = torch.tensor(first["indices"], dtype=torch.int64)
    assert bool((indices[1:] > indices[:-1]).all())
    # each shard keeps k_j <= n_j <= k_j + count_slack(k_j) (no ties here), sum_j k_j = K
    assert K <= indices.numel() <= K + local_size * count_slack(K)
    # the values are the sum over nodes of what each node selected of its node sum
    expected = torch.zeros(NUMEL)
    for r in results:
        expected[torch.tensor(r["chosen"], dtype=torch.int64)] += torch.tensor(r["chosen_sum"])
    torch.testing.assert_close(torch.tensor(first["values"]), expected[indices])
    # density 1.0: the dense sum
    total = torch.stack([torch.tensor(r["x"]) for r in results]).sum(0)
    assert first["dense_indices"] == list(range(NUMEL))
    torch.testing.assert_close(torch.tensor(first["dense_values"]), total)
    # EF over shards of the node sums telescopes: applied + sum of residuals == sum of gradients
    applied = torch.zeros(NUMEL)
    applied[indices] = torch.tensor(first["values"])
    residuals = torch.stack([torch.tensor(r["residual"]) for r in results]).sum(0)
    torch.testing.assert_close(applied + residuals, total, rtol=0, atol=1e-5)
    # cross-node bytes only where there is more than one node; node bytes only with local peers
    nodes = len(ranks) // local_size
    assert all((r["cross"]["reduce-scatter"] > 0) == (nodes > 1) for r in results)
    assert all((r["intra"]["intra-node reduce-scatter"] > 0) == (local_size > 1) for r in results)


def test_local_size_must_divide_the_ranks() -> None:
    with pytest.raises(ValueError, match="local_size=3"):
        build_hierarchy(3)
