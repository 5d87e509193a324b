"""The sparse AllReduce strategy exchanges at the round's end, on 2 real gloo ranks: ``start`` moves
nothing (the group stays pending, no byte sent), the round's completion exchanges every started
group in start order with identical results on both ranks, and a collective that fails there
fails the later groups without running them."""

from __future__ import annotations

import pytest
import torch

from .distributed import run_workers

pytestmark = pytest.mark.distributed


def _groups(rank: int) -> list:
    from gradwire.core.group import BufferTarget, Entry, Group

    groups = []
    for size in (3000, 1200):  # two buckets, as a backward would hand them over
        generator = torch.Generator().manual_seed(10 * rank + size)
        buffer = torch.randn(size, generator=generator)
        groups.append(Group(BufferTarget([buffer]), [Entry(size, size, buffer, 0)], divisor=2.0))
    return groups


def _pipeline():
    from gradwire.core.config import ExchangeConfig
    from gradwire.core.pipeline import Pipeline

    return Pipeline(ExchangeConfig(compressor="topk", density=0.05, collective="sparse-allreduce",
                                   index_codec="rice", value_codec="fp16", collective_timeout=10.0))


def worker_deferred(rank: int, world_size: int) -> dict:
    from gradwire.core.group import Status

    pipeline = _pipeline()
    pipeline.check_config()
    groups = _groups(rank)
    exchanges = [pipeline.start(group, 0) for group in groups]
    started = {"pending": [g.status == Status.PENDING for g in groups],
               "bytes": pipeline.stats.current.get("bytes_sent", 0.0)}
    pipeline.complete(groups, exchanges, 0)
    verdict = pipeline.agree(groups, 0)
    return {**started, "written": [g.status == Status.WRITTEN for g in groups], "action": verdict.action,
            "results": [g.target.buffers[0].tolist() for g in groups],  # plain lists: the worker exits at once
            "bytes_after": pipeline.stats.current.get("bytes_sent", 0.0)}


def test_the_sparse_allreduce_moves_nothing_until_the_rounds_end() -> None:
    results = run_workers(worker_deferred, 2, timeout=120)
    for result in results:
        assert result["pending"] == [True, True] and result["bytes"] == 0.0
        assert result["written"] == [True, True] and result["action"] == "apply"
        assert result["bytes_after"] > 0
    for mine, theirs in zip(results[0]["results"], results[1]["results"]):
        assert mine == theirs and 0 < sum(value != 0 for value in mine) < len(mine)


def worker_failure(rank: int, world_size: int) -> dict:
    from gradwire.core.group import Status
    from gradwire.core.strategies import sparse_allreduce as strategy_module
    from gradwire.errors import CollectiveError

    calls = []

    def broken(**kwargs: object) -> None:
        calls.append(kwargs["numel"])
        raise CollectiveError("sparse_allreduce: the peer went away (a test)")

    strategy_module.sparse_allreduce = broken  # this process only: the worker exits after
    pipeline = _pipeline()
    pipeline.check_config()
    groups = _groups(rank)
    exchanges = [pipeline.start(group, 0) for group in groups]
    pipeline.complete(groups, exchanges, 0)
    verdict = pipeline.agree(groups, 0)
    return {"calls": calls, "failed": [g.status == Status.FAILED for g in groups],
            "messages": [str(g.error) for g in groups], "action": verdict.action}


def test_a_failed_collective_fails_the_later_sparse_groups_without_running_them() -> None:
    for result in run_workers(worker_failure, 2, timeout=120):
        assert result["calls"] == [3000]  # the second group never ran its rounds
        assert result["failed"] == [True, True] and result["action"] == "raise"
        assert all("went away" in message for message in result["messages"])
