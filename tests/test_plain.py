"""GradientExchange (custom loops) starts every rank from rank 0's weights, as DDP does."""

from __future__ import annotations

import pytest
import torch

import gradwire

from .distributed import run_workers

pytestmark = pytest.mark.distributed


def worker_start(rank: int, world_size: int, broadcast: bool) -> list[list[float]]:
    torch.manual_seed(rank)  # different initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    model[1].running_mean.fill_(rank)
    exchange = gradwire.GradientExchange(model, compressor="topk", density=0.5, broadcast_parameters=broadcast)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        optimizer.zero_grad()
        model(torch.randn(5, 6, generator=torch.Generator().manual_seed(10 * rank + step))).sum().backward()
        exchange.synchronize()
        optimizer.step()
    return [p.detach().reshape(-1).tolist() for p in model.parameters()] + [model[1].running_mean.tolist()]


def test_ranks_start_from_rank_zeros_weights() -> None:
    first, second = run_workers(worker_start, 2, True, timeout=90)
    assert first[:-1] == second[:-1]  # (running stats then follow each rank's own batches)
    # without the broadcast the ranks would stay apart: the test can fail
    first, second = run_workers(worker_start, 2, False, timeout=90)
    assert not all(a == b for a, b in zip(first[:-1], second[:-1]))
