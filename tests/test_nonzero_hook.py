"""``compressor="nonzero"`` through the DDP hook: lossless, so bit-exact against DDP's AllReduce.

The hook averages as ``sum_r (g_r / world)`` in rank order; DDP divides by the world size then
lets gloo sum in its own order. With 2 ranks both are exact for any floats (x / 2 is exact, a
sum of two is commutative). With 3 ranks the orders differ, so the exact test uses gradients
that are small multiples of 3 (a linear loss with integer weights): every quotient and partial
sum is then exact and any rounding difference in the path would show as a mismatch.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradwire

from .distributed import run_workers

pytestmark = pytest.mark.distributed

HOOK = {"compressor": "nonzero", "value_codec": "fp32", "collective": "allgather"}


class TwoTables(torch.nn.Module):
    """Two embedding tables and a dense head; ``linear=True`` makes the loss linear in the
    tables with integer weights (exact gradients), else a small classifier."""

    def __init__(self, linear: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Embedding(40, 8)
        self.b = torch.nn.Embedding(30, 8)
        self.head = torch.nn.Linear(8, 3)
        self.linear = linear

    def forward(self, tokens_a: torch.Tensor, tokens_b: torch.Tensor) -> torch.Tensor:
        if self.linear:
            weights_a = 3.0 * torch.arange(1, 9, dtype=torch.float32)
            weights_b = -6.0 * torch.arange(1, 9, dtype=torch.float32)
            head = 3.0 * self.head.weight.sum() + 3.0 * self.head.bias.sum()
            return (self.a(tokens_a) * weights_a).sum() + (self.b(tokens_b) * weights_b).sum() + head
        features = self.a(tokens_a).mean(1) + self.b(tokens_b).sum(1)
        return self.head(features)


def _tokens(rank: int, world_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * rank + step)
    tokens_a = torch.randint(0, 10 + 10 * rank, (4, 5), generator=generator)  # overlapping row ranges
    # the last rank's batch touches no row of table b
    width_b = 0 if rank == world_size - 1 else 3
    tokens_b = torch.randint(0, 30, (4, width_b), generator=generator)
    return tokens_a, tokens_b


def _digest(model: torch.nn.Module) -> str:
    return hashlib.sha256(b"".join(p.detach().contiguous().view(torch.uint8).numpy().tobytes()
                                   for p in model.parameters())).hexdigest()


def _train(rank: int, world_size: int, linear: bool, hook: "dict | None", steps: int = 3) -> tuple[str, list, float]:
    model = DDP(TwoTables(linear), bucket_cap_mb=0.0005)  # several buckets, rebuilt after step 1
    state = None
    if hook is not None:
        state = gradwire.CommHookState(model=model, **hook)
        model.register_comm_hook(state, gradwire.comm_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    grads = []
    for step in range(steps):
        optimizer.zero_grad()
        tokens_a, tokens_b = _tokens(rank, world_size, step)
        out = model(tokens_a, tokens_b)
        if linear:
            out.backward()
        else:
            torch.nn.functional.cross_entropy(out, torch.arange(4) % 3).backward()
        grads.append([p.grad.detach().clone() for p in model.parameters()])
        optimizer.step()
    residual = state.stats()["residual_norm"] if state is not None else 0.0
    return _digest(model), grads, residual


def worker(rank: int, world_size: int, linear: bool, index_codec: str) -> dict:
    reference_digest, reference_grads, _ = _train(rank, world_size, linear, None)
    digest, grads, residual = _train(rank, world_size, linear, {**HOOK, "index_codec": index_codec})
    exact = all(torch.equal(g.view(torch.int32), r.view(torch.int32))
                for step_g, step_r in zip(grads, reference_grads) for g, r in zip(step_g, step_r))
    untouched_b = [bool((step[1] == 0).all()) for step in grads]
    return {"same_params": digest == reference_digest, "exact_grads": exact, "residual": residual,
            "b_untouched_everywhere": any(untouched_b)}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("index_codec", ["rle", "rice"])
def test_nonzero_is_bit_exact_against_ddp_allreduce(world_size: int, index_codec: str) -> None:
    for result in run_workers(worker, world_size, True, index_codec, timeout=180):
        assert result == {"same_params": True, "exact_grads": True, "residual": 0.0, "b_untouched_everywhere": False}


def test_nonzero_real_model_two_ranks_bit_exact() -> None:
    for result in run_workers(worker, 2, False, "rle", timeout=180):
        assert result["same_params"] and result["exact_grads"] and result["residual"] == 0.0
