"""The deferred strategies (the sparse AllReduce on 2 real gloo ranks, the hierarchical exchange on
2 nodes of 2) exchange at the round's end: ``start`` moves nothing (the group stays pending, no
byte sent), the round's completion exchanges every started group in start order with identical
results on every rank, and a collective that fails there fails the later groups without running
them."""

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


#: strategy -> (world size, extra options)
SETTINGS = {"sparse-allreduce": (2, {}), "hierarchical": (4, {"hierarchy": 2})}
#: strategy -> the exchange function its module calls (what the failure test breaks)
EXCHANGES = {"sparse-allreduce": ("sparse_allreduce", "sparse_allreduce"),
             "hierarchical": ("hierarchical", "hierarchical_sparse_allreduce")}


def _pipeline(strategy: str):
    from gradwire.core.config import ExchangeConfig
    from gradwire.core.pipeline import Pipeline

    return Pipeline(ExchangeConfig(compressor="topk", density=0.05, collective="sparse-allreduce",
                                   index_codec="rice", value_codec="fp16", collective_timeout=10.0,
                                   **SETTINGS[strategy][1]))


def worker_deferred(rank: int, world_size: int, strategy: str) -> dict:
    from gradwire.core.group import Status

    pipeline = _pipeline(strategy)
    pipeline.check_config()
    groups = _groups(rank)
    exchanges = [pipeline.start(group, 0) for group in groups]
    started = {"pending": [g.status == Status.PENDING for g in groups],
               "bytes": pipeline.stats.current.get("bytes_sent", 0.0)}
    pipeline.complete(groups, exchanges, 0)
    verdict = pipeline.agree(groups, 0)
    return {**started, "written": [g.status == Status.WRITTEN for g in groups], "action": verdict.action,
            "results": [g.target.buffers[0].tolist() for g in groups],  # plain lists: the worker exits at once
            "bytes_after": pipeline.stats.current.get("bytes_sent", 0.0),
            "counted": pipeline.stats.current.get(f"count_{strategy.replace('-', '_')}_buckets", 0.0)}


@pytest.mark.parametrize("strategy", sorted(SETTINGS))
def test_a_deferred_strategy_moves_nothing_until_the_rounds_end(strategy: str) -> None:
    results = run_workers(worker_deferred, SETTINGS[strategy][0], strategy, timeout=120)
    for result in results:
        assert result["counted"] == 2  # this strategy ran both groups
        assert result["pending"] == [True, True] and result["bytes"] == 0.0
        assert result["written"] == [True, True] and result["action"] == "apply"
        assert result["bytes_after"] > 0
    for result in results[1:]:
        for mine, theirs in zip(results[0]["results"], result["results"]):
            assert mine == theirs and 0 < sum(value != 0 for value in mine) < len(mine)


def worker_failure(rank: int, world_size: int, strategy: str) -> dict:
    import importlib

    from gradwire.core.group import Status
    from gradwire.errors import CollectiveError

    module_name, function = EXCHANGES[strategy]
    module = importlib.import_module(f"gradwire.core.strategies.{module_name}")
    calls = []

    def broken(**kwargs: object) -> None:
        calls.append(1)
        raise CollectiveError(f"{function}: the peer went away (a test)")

    setattr(module, function, broken)  # this process only: the worker exits after
    pipeline = _pipeline(strategy)
    pipeline.check_config()
    groups = _groups(rank)
    exchanges = [pipeline.start(group, 0) for group in groups]
    pipeline.complete(groups, exchanges, 0)
    verdict = pipeline.agree(groups, 0)
    return {"calls": calls, "failed": [g.status == Status.FAILED for g in groups],
            "messages": [str(g.error) for g in groups], "action": verdict.action}


@pytest.mark.parametrize("strategy", sorted(SETTINGS))
def test_a_failed_collective_fails_the_later_groups_without_running_them(strategy: str) -> None:
    for result in run_workers(worker_failure, SETTINGS[strategy][0], strategy, timeout=120):
        assert result["calls"] == [1]  # the second group never ran its rounds
        assert result["failed"] == [True, True] and result["action"] == "raise"
        assert all("went away" in message for message in result["messages"])
