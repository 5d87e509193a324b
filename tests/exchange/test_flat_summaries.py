"""The sparse AllReduce's histogram threshold on real gloo groups, p = 2..6 (one spawn of 6 ranks).

Adversarial magnitudes (all equal, 1e-30..1e30, denormals and zeros, one huge outlier, empty regions,
one rank holding everything): every rank gets the same threshold and result, the threshold is the
one the search computes here from the reference sums, survivors stay within the documented bound,
each histogram round sends the bytes of the formula; error feedback telescopes (raw and fp16); a
NaN, an undecodable payload or mismatched arguments make every rank report or raise together.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from gradwire.errors import DecodeError
from gradwire.exchange.checked import exact_allreduce_bytes
from gradwire.exchange.regions import equal_boundaries
from gradwire.exchange.sparse_allreduce import sparse_allreduce
from gradwire.exchange.threshold_search import FINGERPRINT_WORDS, ThresholdSearch, count_slack, magnitude_keys

from ..distributed import run_workers
from .codec_adapters import FailingOnRank, Fp16Adapter

NUMEL, K = 3000, 37
SCENARIOS = ("equal", "range", "denormal", "outlier", "empty regions", "one rank", "random", "hinted")


def _contribution(name: str, rank: int, p: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    g = torch.Generator().manual_seed(1000 * p + 10 * rank + SCENARIOS.index(name))
    idx = torch.randperm(NUMEL, generator=g)[:80].sort().values
    bounds = equal_boundaries(NUMEL, p)
    if name == "equal":  # disjoint positions, every sum the same magnitude
        idx = torch.arange(rank, NUMEL, p)[:60]
        return idx, torch.full((idx.numel(),), -0.37), bounds
    if name == "range":
        exponent = torch.rand(idx.numel(), generator=g) * 60 - 30
        sign = torch.randint(0, 2, (idx.numel(),), generator=g) * 2 - 1
        return idx, (sign * 10.0 ** exponent).float(), bounds
    if name == "denormal":
        vals = torch.rand(idx.numel(), generator=g) * 1e-40
        return idx, torch.where(torch.rand(idx.numel(), generator=g) < 0.2, 0.0, vals), bounds
    vals = torch.randn(idx.numel(), generator=g)
    if name == "outlier":
        vals = vals * 1e-3
        if rank == 0:
            vals[0] = 3.0e38
    if name == "empty regions":  # every region empty but the last: one owner reduces everything
        bounds = [0] * p + [NUMEL]
    if name == "one rank" and rank != p - 1:
        idx, vals = idx[:0], vals[:0]
    return idx, vals, bounds


def _run(idx: torch.Tensor, vals: torch.Tensor, bounds: list[int], group, **kwargs) -> dict:
    result = sparse_allreduce(indices=idx, values=vals, numel=NUMEL, k=kwargs.pop("k", K), boundaries=bounds,
                              group=group, **kwargs)
    return {"in_indices": idx.tolist(), "in_values": vals.tolist(), "boundaries": bounds,
            "indices": result.indices.tolist(), "values": result.values.tolist(), "threshold": result.threshold,
            "survived": result.survived.tolist(), "sent": result.sent_by_collective, "finite": result.finite,
            "hint": kwargs.get("threshold_hint")}


def _raises(call) -> str:
    try:
        call()
    except (DecodeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def _scenarios(rank: int, p: int, group: dist.ProcessGroup) -> dict:
    out = {}
    for name in SCENARIOS[:-1]:
        out[name] = _run(*_contribution(name, rank, p), group)
    idx, vals, bounds = _contribution("hinted", rank, p)  # the next step of "random": its threshold as hint
    out["hinted"] = _run(idx, vals, bounds, group, threshold_hint=out["random"]["threshold"])
    # error feedback: a dense compensated gradient, its top entries sent, raw and fp16
    g = torch.Generator().manual_seed(7 + rank)
    dense = torch.randn(NUMEL, generator=g)
    top = torch.topk(dense.abs(), 80).indices.sort().values
    out["ef"] = {"dense": dense.tolist()}
    for codec_name, codec in (("raw", None), ("fp16", Fp16Adapter())):
        r = sparse_allreduce(indices=top, values=dense[top], numel=NUMEL, k=K, boundaries=equal_boundaries(NUMEL, p),
                             group=group, codec=codec)
        out["ef"][codec_name] = {"indices": r.indices.tolist(), "values": r.values.tolist(),
                                 "residual": r.residual(dense, indices=top).tolist(), "carry": r.carry_indices.numel()}
    # failures reach every rank together
    bounds = equal_boundaries(NUMEL, p)
    for name, bad_rank, bad in (("nan", p - 1, float("nan")), ("inf", 0, float("inf"))):
        poisoned = dense[top].clone()
        if rank == bad_rank:
            poisoned[3] = bad
        out[name] = _run(top, poisoned, bounds, group)["finite"]
    out["decode"] = _raises(lambda: sparse_allreduce(indices=top, values=dense[top], numel=NUMEL, k=K,
                                                     boundaries=bounds, group=group, codec=FailingOnRank(p - 1)))
    out["hint mismatch"] = _raises(lambda: sparse_allreduce(indices=top, values=dense[top], numel=NUMEL, k=K,
                                                            boundaries=bounds, group=group,
                                                            threshold_hint=1.0 if rank == 0 else 2.0))
    out["k mismatch"] = _raises(lambda: sparse_allreduce(indices=top, values=dense[top], numel=NUMEL,
                                                         k=K - (rank == 0), boundaries=bounds, group=group))
    return out


def _every_size(rank: int, world_size: int) -> dict:
    groups = {size: dist.new_group(list(range(size))) for size in range(2, world_size + 1)}  # before any waits
    return {size: _scenarios(rank, size, group) for size, group in groups.items() if rank < size}


@pytest.fixture(scope="module")
def every_size() -> list[dict]:
    return run_workers(_every_size, 6, timeout=120)


def _reference(results: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    total, support = torch.zeros(NUMEL), torch.zeros(NUMEL, dtype=torch.bool)
    for r in results:  # rank order, float32, as the owners add
        idx = torch.tensor(r["in_indices"], dtype=torch.int64)
        total[idx] = total[idx] + torch.tensor(r["in_values"], dtype=torch.float32)
        support[idx] = True
    return total, support


def _expected_search(magnitudes: torch.Tensor, hint) -> tuple[ThresholdSearch, list[int]]:
    """The search over the reference sums (their split among owners does not matter) and the bins of
    each level it runs."""
    search, bins = ThresholdSearch.start(K, None, hint), []
    keys = magnitude_keys(magnitudes)
    while not search.done:
        bins.append(search.edges().numel() - 1)
        search = search.refine(search.local_counts(keys))
    return search, bins


def _check(results: list[dict]) -> int:
    """Checks one scenario on p ranks; returns the number of histogram levels it ran."""
    p, first = len(results), results[0]
    for r in results[1:]:  # the same bits on every rank
        assert (r["indices"], r["values"], r["threshold"]) == (first["indices"], first["values"], first["threshold"])
    total, support = _reference(results)
    search, bins = _expected_search(total[support], first["hint"])
    assert first["threshold"] == search.threshold  # what the search computes from the sums, exactly
    indices = torch.tensor(first["indices"], dtype=torch.int64)
    assert torch.equal(indices, torch.nonzero(support & (total.abs().double() >= search.threshold)).reshape(-1))
    assert first["values"] == total[indices].tolist()
    n = int(support.sum())
    magnitudes = torch.sort(total[support].abs().double(), descending=True).values
    if K < n:  # k <= survivors <= k + max(slack, ties - 1); the exact top-k kept
        ties = int((magnitudes == magnitudes[K - 1]).sum())
        assert K <= indices.numel() <= K + max(count_slack(K), ties - 1)
        assert search.threshold <= float(magnitudes[K - 1])
    else:
        assert indices.numel() == n
    bounds = first["boundaries"]
    for rank, r in enumerate(results):
        own = torch.tensor(r["in_indices"], dtype=torch.int64)
        assert r["survived"] == torch.isin(own, indices).tolist()
        outside = int(((own < bounds[rank]) | (own >= bounds[rank + 1])).sum())
        in_region = int(((indices >= bounds[rank]) & (indices < bounds[rank + 1])).sum())
        assert r["sent"]["reduce-scatter"] == 8 * outside and r["sent"]["allgather"] == 8 * (p - 1) * in_region
        levels = [name for name in r["sent"] if name.startswith("threshold histogram")]
        assert len(levels) == len(bins)
        status = 2 * math.ceil(p / 15)  # int16 counts (numel < 2^15): 15 ranks per bitmap word
        for level, words in enumerate(bins):
            words += FINGERPRINT_WORDS + status if level == 0 else 0
            assert r["sent"][f"threshold histogram {level + 1}"] == exact_allreduce_bytes(words, 2, rank, p)
    return len(bins)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 6])
def test_every_rank_agrees_on_adversarial_magnitudes(every_size: list[dict], world_size: int) -> None:
    results = [r[world_size] for r in every_size[:world_size]]
    levels = {name: _check([r[name] for r in results]) for name in SCENARIOS}
    assert levels["hinted"] == 1  # the previous step's threshold settles it in one histogram round
    assert levels["equal"] >= 4  # one value, no slack: down to the single key (31 bits, 7 a level)
    assert results[0]["equal"]["indices"] and len(results[0]["equal"]["indices"]) == 60 * world_size  # ties all kept


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 6])
def test_error_feedback_telescopes(every_size: list[dict], world_size: int) -> None:
    results = [r[world_size]["ef"] for r in every_size[:world_size]]
    compensated = torch.stack([torch.tensor(r["dense"]) for r in results]).sum(0)
    for codec in ("raw", "fp16"):
        first = results[0][codec]
        assert all((r[codec]["indices"], r[codec]["values"]) == (first["indices"], first["values"]) for r in results)
        applied = torch.zeros(NUMEL)
        applied[torch.tensor(first["indices"], dtype=torch.int64)] = torch.tensor(first["values"])
        residuals = torch.stack([torch.tensor(r[codec]["residual"]) for r in results]).sum(0)
        torch.testing.assert_close(applied + residuals, compensated, rtol=0, atol=1e-5)
    assert all(r["raw"]["carry"] == 0 for r in results)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 6])
def test_failures_reach_every_rank_together(every_size: list[dict], world_size: int) -> None:
    results = [r[world_size] for r in every_size[:world_size]]
    assert all(r["nan"] is False and r["inf"] is False for r in results)
    assert all(r["decode"].startswith(f"DecodeError: sparse_allreduce: rank(s) [{world_size - 1}] could not decode")
               for r in results), [r["decode"] for r in results]
    for case in ("hint mismatch", "k mismatch"):
        assert all(r[case].startswith("ValueError: sparse_allreduce: the ranks started different threshold searches")
                   for r in results), [r[case] for r in results]
