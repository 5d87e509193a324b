"""sparse_reduce_scatter alone and the exact AllReduce under it, on real gloo groups (p = 2, 3; one spawn).

Every check recomputes the expected result here from the inputs the workers report (plain lists).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gradwire.errors import DecodeError
from gradwire.exchange.checked import allreduce_sum_exact, exact_allreduce_bytes
from gradwire.exchange.regions import equal_boundaries
from gradwire.exchange.region_payload import frame_capacity, from_frame, to_frame
from gradwire.exchange.sparse_reduce_scatter import RegionStatus, agree_status, sparse_reduce_scatter

from ..distributed import run_workers
from .codec_adapters import FailingOnRank, Fp16Adapter

NUMEL = 1000


def _uneven(world_size: int) -> list[int]:
    """Regions of uneven lengths, the first one empty for p = 3 (shards the caller chose)."""
    return {2: [0, 300, NUMEL], 3: [0, 0, 400, NUMEL]}[world_size]


def _scatter(**kwargs) -> dict:
    r = sparse_reduce_scatter(**kwargs)
    return {"indices": r.indices.tolist(), "values": r.values.tolist(), "start": r.start, "length": r.length,
            "contributed": r.contributed.tolist(), "status": r.status.value, "sent": r.sent_by_collective,
            "error": str(r.error) if r.error else None}


def _scenarios(rank: int, world_size: int, group: dist.ProcessGroup) -> dict:
    g = torch.Generator().manual_seed(50 + rank)
    idx = torch.randperm(NUMEL, generator=g)[:120].sort().values
    idx = torch.cat([idx[idx % 7 != 0], torch.arange(0, NUMEL, 7)]).unique()  # every 7th position: all ranks add
    vals = torch.randn(idx.numel(), generator=g) * 10 ** torch.randint(-3, 4, (idx.numel(),), generator=g)
    bounds = _uneven(world_size)
    out = {"in_indices": idx.tolist(), "in_values": vals.tolist(), "boundaries": bounds}
    out["raw"] = _scatter(indices=idx, values=vals, numel=NUMEL, boundaries=bounds, group=group)
    out["fp16"] = _scatter(indices=idx, values=vals, numel=NUMEL, boundaries=bounds, group=group, codec=Fp16Adapter())
    # fixed frames: every region's length is a bound on what any rank sends into it
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    out["framed"] = _scatter(indices=idx, values=vals, numel=NUMEL, boundaries=bounds, group=group, most=lengths)
    out["framed_fp16"] = _scatter(indices=idx, values=vals, numel=NUMEL, boundaries=bounds, group=group,
                                  codec=Fp16Adapter(), most=lengths)
    # a bound too small for what the ranks send: their frames say so and every owner fails to decode
    out["overflow"] = _scatter(indices=idx, values=vals, numel=NUMEL, boundaries=bounds, group=group,
                               most=[1] * world_size)
    empty = torch.empty(0, dtype=torch.int64)
    out["empty"] = _scatter(indices=empty if rank else idx, values=torch.empty(0) if rank else vals, numel=NUMEL,
                            boundaries=bounds, group=group)
    # statuses come back per rank, no exception; agree_status gives all the same verdict
    nan = vals.clone()
    if rank == world_size - 1:
        nan[-1] = float("nan")  # lands in the last region: only its owner sees it
    nonfinite = sparse_reduce_scatter(indices=idx, values=nan, numel=NUMEL, boundaries=bounds, group=group)
    failing = sparse_reduce_scatter(indices=idx, values=vals, numel=NUMEL, boundaries=bounds, group=group,
                                    codec=FailingOnRank(world_size - 1))
    out["statuses"] = (nonfinite.status.value, failing.status.value, isinstance(failing.error, DecodeError))
    agreed = [agree_status(nonfinite.status, group), agree_status(failing.status, group)]
    out["agreed"] = [(a.decode_failed, a.nonfinite, a.ok) for a in agreed]
    # the exact AllReduce: int16 / int64, fewer words than ranks, and its bytes
    sums = {}
    for dtype, words in [(torch.int16, 5), (torch.int64, 7), (torch.int32, 1)]:
        tensor = (torch.arange(words, dtype=torch.int64) * (rank + 1) + 1000 * rank).to(dtype)
        sums[str(dtype)] = allreduce_sum_exact(tensor, group, what="test", collective="sum").tolist()
    out["sums"] = sums
    # its rounds, counted on the real collective: two ranks swap their tensors in one
    rounds, real = [], dist.all_to_all_single
    dist.all_to_all_single = lambda *args, **kwargs: rounds.append(1) or real(*args, **kwargs)
    try:
        out["sum_of_64"] = allreduce_sum_exact(torch.arange(64, dtype=torch.int32) * (rank + 1), group, what="test",
                                               collective="sum").tolist()
    finally:
        dist.all_to_all_single = real
    out["sum_rounds"] = len(rounds)
    return out


def _every_size(rank: int, world_size: int) -> dict:
    groups = {size: dist.new_group(list(range(size))) for size in range(2, world_size + 1)}  # before any waits
    return {size: _scenarios(rank, size, group) for size, group in groups.items() if rank < size}


@pytest.fixture(scope="module")
def every_size() -> list[dict]:
    return run_workers(_every_size, 3, timeout=120)


def _rank_order_sum(inputs: list[tuple[list[int], list[float]]], start: int, stop: int) -> tuple[list, list]:
    """Positions of ``[start, stop)`` anyone contributed (relative, ascending) and their float32 sums,
    added in rank order, as the owner must."""
    total, support = torch.zeros(NUMEL), torch.zeros(NUMEL, dtype=torch.bool)
    for idx, vals in inputs:
        i = torch.tensor(idx, dtype=torch.int64)
        total[i] = total[i] + torch.tensor(vals, dtype=torch.float32)
        support[i] = True
    where = torch.nonzero(support[start:stop]).reshape(-1)
    return where.tolist(), total[start:stop][where].tolist()


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
def test_each_owner_gets_the_rank_order_sum_of_its_region(every_size: list[dict], world_size: int) -> None:
    results = [r[world_size] for r in every_size[:world_size]]
    bounds = results[0]["boundaries"]
    assert any(a == b for a, b in zip(bounds, bounds[1:])) or world_size == 2  # an empty region is covered
    inputs = [(r["in_indices"], r["in_values"]) for r in results]
    for rank, r in enumerate(results):
        raw = r["raw"]
        assert (raw["start"], raw["length"], raw["status"]) == (bounds[rank], bounds[rank + 1] - bounds[rank], "ok")
        assert (raw["indices"], raw["values"]) == _rank_order_sum(inputs, bounds[rank], bounds[rank + 1])  # bits
        assert raw["contributed"] == r["in_values"]
        own = torch.tensor(r["in_indices"])
        outside = int(((own < bounds[rank]) | (own >= bounds[rank + 1])).sum())
        assert raw["sent"] == {"reduce-scatter counts": 8 * (world_size - 1), "reduce-scatter": 8 * outside}
        # lossy values: the owner sums what it decoded, and the sender knows what that was
        fp16 = r["fp16"]
        assert fp16["contributed"] == torch.tensor(r["in_values"]).half().float().tolist()
        decoded = [(res["in_indices"], res["fp16"]["contributed"]) for res in results]
        assert (fp16["indices"], fp16["values"]) == _rank_order_sum(decoded, bounds[rank], bounds[rank + 1])
        per_owner = torch.bucketize(own, torch.tensor(bounds[1:-1]), right=True).bincount(minlength=world_size)
        payloads = [8 + 10 * int(n) for j, n in enumerate(per_owner) if n and j != rank]  # Fp16Adapter's sizes
        assert fp16["sent"]["reduce-scatter"] == sum(payloads)
        # fixed frames: the same bits, one round, the frames' capacities on the wire
        lengths = [b - a for a, b in zip(bounds, bounds[1:])]
        for name, entry in (("raw", 8), ("fp16", 10)):
            framed = r["framed" if name == "raw" else "framed_fp16"]
            assert {k: framed[k] for k in ("indices", "values", "contributed", "status")} == \
                {k: r[name][k] for k in ("indices", "values", "contributed", "status")}
            header = 0 if name == "raw" else 8
            capacity = [4 + (header + entry * n if n else 0) for n in lengths]
            assert framed["sent"] == {"reduce-scatter": sum(capacity) - capacity[rank]}
        overflow = r["overflow"]
        if lengths[rank]:  # every rank sends more than one entry into every non-empty region
            assert overflow["status"] == "decode failed" and "did not fit" in overflow["error"]
        else:
            assert overflow["status"] == "ok"
        # only rank 0 contributed: every owner holds exactly rank 0's entries of its region
        assert (r["empty"]["indices"], r["empty"]["values"]) == \
            _rank_order_sum([inputs[0]], bounds[rank], bounds[rank + 1])


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
def test_statuses_are_returned_and_agreed_by_every_rank(every_size: list[dict], world_size: int) -> None:
    results = [r[world_size] for r in every_size[:world_size]]
    for rank, r in enumerate(results):
        nonfinite, failing, typed = r["statuses"]
        assert nonfinite == ("non-finite" if rank == world_size - 1 else "ok")
        last = rank == world_size - 1
        assert failing == ("decode failed" if last else "ok") and typed == last
        assert r["agreed"] == [((), (world_size - 1,), False), ((world_size - 1,), (), False)]


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
def test_the_exact_allreduce_sums_any_integer_type(every_size: list[dict], world_size: int) -> None:
    results = [r[world_size]["sums"] for r in every_size[:world_size]]
    for dtype, words in [("torch.int16", 5), ("torch.int64", 7), ("torch.int32", 1)]:
        expected = sum(torch.arange(words) * (rank + 1) + 1000 * rank for rank in range(world_size)).tolist()
        assert all(r[dtype] == expected for r in results)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size, rounds", [(2, 1), (3, 2)])
def test_the_exact_allreduce_takes_one_round_for_two_ranks(every_size: list[dict], world_size: int,
                                                           rounds: int) -> None:
    """p = 2: each rank's whole tensor to the other (the bytes of a reduce-scatter and an AllGather
    at p = 2, in one round); more ranks: the reduce-scatter, then the AllGather."""
    results = [r[world_size] for r in every_size[:world_size]]
    expected = (torch.arange(64) * sum(range(1, world_size + 1))).tolist()
    assert all(r["sum_of_64"] == expected and r["sum_rounds"] == rounds for r in results)


def test_exact_allreduce_bytes_add_up_to_a_ring() -> None:
    for words, p in [(130, 2), (162, 5), (3, 8), (2048 + 34, 64)]:
        per_rank = [exact_allreduce_bytes(words, 4, rank, p) for rank in range(p)]
        assert sum(per_rank) == 2 * (p - 1) * words * 4  # every word reduced once and sent to p-1 peers
    assert exact_allreduce_bytes(100, 4, 0, 1) == 0


def test_a_frame_is_read_only_within_its_capacity() -> None:
    payload = torch.arange(10, dtype=torch.uint8)
    frame = to_frame(payload, entries=3, most=3, capacity=20)
    assert frame.numel() == 20 and torch.equal(from_frame(frame, "test"), payload)
    unaligned = torch.cat([torch.zeros(1, dtype=torch.uint8), frame])[1:]  # frames follow each other unaligned
    assert torch.equal(from_frame(unaligned, "test"), payload)
    with pytest.raises(DecodeError, match="did not fit"):
        from_frame(to_frame(payload, entries=4, most=3, capacity=20), "test")  # more entries than agreed
    with pytest.raises(DecodeError, match="did not fit"):
        from_frame(to_frame(payload, entries=3, most=3, capacity=13), "test")  # more bytes than the frame
    hostile = frame.clone()
    hostile[:4] = torch.tensor([17], dtype=torch.int32).view(torch.uint8)  # one byte more than it holds
    with pytest.raises(DecodeError, match="declares"):
        from_frame(hostile, "test")
    hostile[:4] = torch.tensor([-7], dtype=torch.int32).view(torch.uint8)
    with pytest.raises(DecodeError, match="declares"):
        from_frame(hostile, "test")
    with pytest.raises(DecodeError, match="no length"):
        from_frame(frame[:3], "test")
    assert frame_capacity(None, 0, 100, False) == 4 and frame_capacity(None, 5, 100, True) == 4 + 60
    assert frame_capacity(FailingOnRank(0), 5, 100, False) == 4 + 58  # the adapter's bound
    assert frame_capacity(object(), 5, 100, False) is None  # a codec without a bound: counts first


def test_world_of_one_and_bad_arguments() -> None:
    idx, vals = torch.tensor([3, 9]), torch.tensor([1.0, float("inf")])
    r = sparse_reduce_scatter(indices=idx, values=vals, numel=10, boundaries=equal_boundaries(10, 1))
    assert r.indices.tolist() == [3, 9] and r.status is RegionStatus.NONFINITE and r.bytes_sent == 0
    assert agree_status(r.status).nonfinite == (0,)
    with pytest.raises(ValueError, match="ascending"):
        sparse_reduce_scatter(indices=idx.flip(0), values=vals, numel=10, boundaries=[0, 10])
    with pytest.raises(ValueError, match="boundaries"):
        sparse_reduce_scatter(indices=idx, values=vals, numel=10, boundaries=[0, 5])
    with pytest.raises(ValueError, match="integer"):
        allreduce_sum_exact(torch.zeros(3), None, what="test", collective="sum")


@pytest.mark.parametrize(("dense_ratio", "native_pieces"), [(0, 16), (0, 0), (10**9, 16)],
                         ids=["merged-entries", "sorted-entries", "dense-scratch"])
def test_the_owners_sum_adds_in_rank_order_whichever_way_it_reduces(monkeypatch, dense_ratio: int,
                                                                     native_pieces: int) -> None:
    # float32 addition does not associate: 1e8 + 1 rounds back to 1e8, so position 3 sums to 0 in
    # rank order ((0 + 1) + 1e8) - 1e8 and to 1 in reverse order ((0 - 1e8) + 1e8) + 1; both ways start from
    # +0.0, so a lone -0.0 sums to +0.0 (a copy instead of a sum would keep the sign)
    from gradwire.exchange import sparse_reduce_scatter as module

    monkeypatch.setattr(module, "DENSE_REDUCE_RATIO", dense_ratio)
    monkeypatch.setattr(module, "NATIVE_MERGE_PIECES", native_pieces)  # 0: torch's sort (the native merge's twin)
    pieces = [(torch.tensor([3, 5]), torch.tensor([1.0, -0.0])),
              (torch.tensor([0, 3]), torch.tensor([2.5, 1e8])),
              (torch.tensor([3, 9]), torch.tensor([-1e8, 4.0]))]
    positions, sums = module.reduce_in_rank_order(pieces, torch.device("cpu"), 10)
    assert positions.tolist() == [0, 3, 5, 9]
    assert torch.equal(sums.view(torch.int32), torch.tensor([2.5, 0.0, 0.0, 4.0]).view(torch.int32))
