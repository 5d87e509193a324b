"""``stats()`` is read after every step by our own harness (``gradwire train``, ``bench e2e``),
so whatever it does sits inside every timed step, and inside ``auto``'s trial rounds.

A float64 copy of every residual there once cost as much as the step itself on the 4.7M MLP and
made ``auto``'s trial prefer dense (docs/benchmarks.md, "What inflated the trial"). This test
records every aten op ``stats()`` runs on real gloo ranks after real steps with residuals, and
allows one read of the parameter-sized tensors: the fused residual norm.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import gradwire

from .distributed import run_workers

pytestmark = pytest.mark.distributed

#: an op that touches a tensor this large reads parameter-sized memory (the model's smallest
#: parameter with residuals has 4,096 entries; counters and scalars are far below)
LARGE = 1_000


class _LargeOps(TorchDispatchMode):
    """Records the name of every aten op with a tensor of ``LARGE`` or more elements among its
    inputs or outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        result = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_flatten((args, kwargs or {}, result))[0] if isinstance(t, torch.Tensor)]
        if any(t.numel() >= LARGE for t in tensors):
            self.names.append(str(func))
        return result


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 16))


def _train(model: torch.nn.Module, step: Any, rank: int) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(8, 64, generator=generator)).square().mean().backward()
        step()
        optimizer.step()


def worker_exchange(rank: int, world_size: int) -> dict[str, Any]:
    model = _model()
    exchange = gradwire.GradientExchange(model, compressor="topk", density=0.01)
    _train(model, exchange.synchronize, rank)
    with _LargeOps() as recorded:
        stats = exchange.stats()
    return {"ops": recorded.names, "residual_norm": stats["residual_norm"]}


def worker_hook(rank: int, world_size: int) -> dict[str, Any]:
    model = torch.nn.parallel.DistributedDataParallel(_model())
    state = gradwire.CommHookState(compressor="topk", density=0.01, process_group=dist.group.WORLD)
    model.register_comm_hook(state, gradwire.comm_hook)
    _train(model, lambda: None, rank)
    with _LargeOps() as recorded:
        stats = state.stats()
    return {"ops": recorded.names, "residual_norm": stats["residual_norm"]}


@pytest.mark.parametrize("worker", [worker_exchange, worker_hook], ids=["GradientExchange", "ddp-hook"])
def test_stats_reads_the_residuals_once_and_nothing_else_of_parameter_size(worker: Any) -> None:
    for result in run_workers(worker, 2, timeout=90):
        assert result["residual_norm"] > 0  # residuals exist: there was something to read
        assert result["ops"] == ["aten._foreach_norm.Scalar"], result["ops"]
