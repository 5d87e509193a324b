"""Every exchange strategy through DDP on real gloo groups of 2-5 ranks: ranks end with identical
parameters, density 1.0 equals DDP's own AllReduce, and ``auto`` chooses alike on every rank."""

from __future__ import annotations

import hashlib

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradwire

from .distributed import run_workers

pytestmark = pytest.mark.distributed

STRATEGIES = {
    "dense": {"compressor": "topk", "density": 0.1, "collective": "dense"},
    "allreduce": {"compressor": "randomblock", "density": 0.1, "collective": "allreduce"},
    "allgather": {"compressor": "topk", "density": 0.1, "collective": "allgather", "index_codec": "rice"},
    "sparse-allreduce": {"compressor": "topk", "density": 0.1, "collective": "sparse-allreduce",
                         "index_codec": "rice", "value_codec": "fp16"},
    "auto": {"compressor": "topk", "density": 0.1, "collective": "auto", "link_gbit": 0.1},
    "quantized": {"compressor": "none", "quantize": "int4", "quantize_block": 32},
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.ReLU(), torch.nn.Linear(48, 5))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(8, 24, generator=generator), torch.randint(0, 5, (8,), generator=generator)


def _train(rank: int, options: dict | None, steps: int) -> tuple[str, dict, DDP]:
    model = DDP(_model(), bucket_cap_mb=0.002)  # several buckets
    state = None
    if options is not None:
        state = gradwire.CommHookState(model=model, **options)
        model.register_comm_hook(state, gradwire.comm_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        optimizer.zero_grad()
        inputs, targets = _batch(rank, step)
        torch.nn.functional.cross_entropy(model(inputs), targets).backward()
        optimizer.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    stats = state.stats() if state is not None else {}
    if state is not None:
        stats["choices"] = sorted(set(state.pipeline.planner.choices.values())) if state.pipeline.planner else []
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest(), stats, model


def worker_strategies(rank: int, world_size: int) -> dict:
    out = {name: _train(rank, options, 4)[:2] for name, options in STRATEGIES.items()}
    # density 1.0: the sparse AllReduce keeps every entry, so it equals DDP's AllReduce
    *_, reference = _train(rank, None, 1)
    *_, full = _train(rank, {**STRATEGIES["sparse-allreduce"], "density": 1.0, "value_codec": "fp32"}, 1)
    out["full_matches_dense"] = max(float((a - b).detach().abs().max())
                                    for a, b in zip(reference.parameters(), full.parameters()))
    return out


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world_size", [2, 3, 4, 5])
def test_every_strategy_keeps_ranks_identical(world_size: int) -> None:
    results = run_workers(worker_strategies, world_size, timeout=240, pg_timeout=60)
    for name in STRATEGIES:
        digests = {result[name][0] for result in results}
        assert len(digests) == 1, f"{name}: ranks differ at p={world_size}"
        assert results[0][name][1]["step"] == 4, name
        choices = {tuple(result[name][1]["choices"]) for result in results}
        assert len(choices) == 1, f"{name}: ranks chose differently: {choices}"
    assert all(result["full_matches_dense"] < 1e-6 for result in results), [r["full_matches_dense"] for r in results]
    assert results[0]["sparse-allreduce"][1]["count_sparse_allreduce_buckets"] > 0


def worker_hierarchical(rank: int, world_size: int) -> dict:
    options = {**STRATEGIES["sparse-allreduce"], "hierarchy": 2}
    digest, stats, _ = _train(rank, options, 3)
    *_, reference = _train(rank, None, 1)
    *_, full = _train(rank, {**options, "density": 1.0, "value_codec": "fp32"}, 1)
    gap = max(float((a - b).detach().abs().max()) for a, b in zip(reference.parameters(), full.parameters()))
    return {"digest": digest, "stats": stats, "gap": gap}


@pytest.mark.timeout(400)
def test_hierarchical_two_nodes_of_two() -> None:
    results = run_workers(worker_hierarchical, 4, timeout=240, pg_timeout=60)
    assert len({r["digest"] for r in results}) == 1
    assert all(r["stats"]["count_hierarchical_buckets"] > 0 for r in results)
    assert all(r["gap"] < 1e-6 for r in results), [r["gap"] for r in results]


def _applied_and_wanted(model: torch.nn.Module, exchange: "gradwire.GradientExchange", rank: int,
                        world_size: int, *, steps: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Train ``steps`` steps through ``exchange``; per parameter, the float64 sums of what it applied
    and of the exact mean gradient (an uncompressed AllReduce beside it), for telescoping checks."""
    import torch.distributed as dist

    applied = [torch.zeros_like(p, dtype=torch.float64) for p in model.parameters()]
    wanted = [torch.zeros_like(p, dtype=torch.float64) for p in model.parameters()]
    for step in range(steps):
        model.zero_grad()
        inputs, targets = _batch(rank, step)
        torch.nn.functional.cross_entropy(model(inputs), targets).backward()
        for parameter, total in zip(model.parameters(), wanted):
            grad = parameter.grad.clone()
            dist.all_reduce(grad)
            total += grad.double() / world_size
        exchange.synchronize()
        for parameter, total in zip(model.parameters(), applied):
            total += parameter.grad.double()
    return applied, wanted


def worker_hierarchical_feedback(rank: int, world_size: int, residual_dtype: str) -> dict:
    """The hierarchical exchange's error feedback through GradientExchange (2 nodes x 2 ranks): what
    was applied + the mean residual == the mean gradient over steps, residuals held and stored in
    ``residual_dtype``."""
    import torch.distributed as dist

    model = _model()
    exchange = gradwire.GradientExchange(model, compressor="topk", density=0.1, collective="sparse-allreduce",
                                         hierarchy=2, index_codec="rice", value_codec="fp32",
                                         residual_dtype=residual_dtype, bucket_cap_mb=0.001)
    applied, wanted = _applied_and_wanted(model, exchange, rank, world_size, steps=4)
    gap, dtypes = 0.0, set()
    for parameter, got, want in zip(model.parameters(), applied, wanted):
        residual = exchange.feedback.residual(id(parameter))
        dtypes.add(str(residual.dtype))
        residual = residual.reshape(parameter.shape).double()
        dist.all_reduce(residual)
        gap = max(gap, float((got + residual / world_size - want).abs().max()))
    return {"gap": gap, "scale": max(float(w.abs().max()) for w in wanted), "dtypes": sorted(dtypes),
            "buckets": exchange.stats()["count_hierarchical_buckets"]}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("residual_dtype, tolerance", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_hierarchical_feedback_telescopes_in_its_storage_dtype(residual_dtype: str, tolerance: float) -> None:
    for result in run_workers(worker_hierarchical_feedback, 4, residual_dtype, timeout=200, pg_timeout=60):
        assert result["buckets"] > 0, result
        assert result["dtypes"] == [f"torch.{residual_dtype}"], result
        assert result["gap"] < tolerance * result["scale"], result


def worker_held_after_a_round(rank: int, world_size: int) -> dict:
    """What a front-end keeps of a finished round: the collectives' Work (so no backend thread frees
    their tensors), not the exchanges with their groups, results and feedback records."""
    from torch.distributed import Work

    held = {}
    for collective in ("allgather", "sparse-allreduce"):  # asynchronous, then blocking
        model = _model()
        exchange = gradwire.GradientExchange(model, compressor="topk", density=0.1, collective=collective,
                                             index_codec="rice", bucket_cap_mb=0.001)
        inputs, targets = _batch(rank, 0)
        torch.nn.functional.cross_entropy(model(inputs), targets).backward()
        exchange.synchronize()
        held[f"tensors-{collective}"] = [type(item).__name__ for item in exchange._last_round
                                         if not isinstance(item, Work)], len(exchange._last_round)
    model = DDP(_model(), bucket_cap_mb=0.002)
    state = gradwire.CommHookState(model=model, **STRATEGIES["allgather"])
    model.register_comm_hook(state, gradwire.comm_hook)
    inputs, targets = _batch(rank, 0)
    torch.nn.functional.cross_entropy(model(inputs), targets).backward()
    held["ddp-allgather"] = [type(item).__name__ for item in state._last_step
                             if not isinstance(item, Work)], len(state._last_step)
    return {"held": held}


def test_a_front_end_keeps_only_the_works_of_its_last_round() -> None:
    for result in run_workers(worker_held_after_a_round, 2, timeout=120):
        not_works, count = result["held"]["tensors-allgather"]
        assert not_works == [] and count > 0, result  # one Work per asynchronous bucket
        assert result["held"]["tensors-sparse-allreduce"] == ([], 0), result  # blocking: kept by lifetime
        not_works, count = result["held"]["ddp-allgather"]
        assert not_works == [] and count > 0, result


def worker_quantized(rank: int, world_size: int, bits: int) -> dict:
    """GradientExchange with the int8/int4 AllReduce: sum of what was applied + the mean residual ==
    the mean gradient, over steps (error feedback telescopes); then a NaN on rank 1 raises on all."""
    import torch.distributed as dist

    model = _model()
    exchange = gradwire.GradientExchange(model, compressor="none", quantize=f"int{bits}", quantize_block=16,
                                         bucket_cap_mb=0.001)
    applied, wanted = _applied_and_wanted(model, exchange, rank, world_size, steps=4)
    gap = 0.0
    for parameter, got, want in zip(model.parameters(), applied, wanted):
        residual = exchange.feedback.residual(id(parameter)).reshape(parameter.shape).clone()
        dist.all_reduce(residual)
        gap = max(gap, float((got + residual.double() / world_size - want).abs().max()))
    scale = max(float(w.abs().max()) for w in wanted)
    model.zero_grad()
    inputs, targets = _batch(rank, 9)
    torch.nn.functional.cross_entropy(model(inputs), targets).backward()
    if rank == 1:
        next(model.parameters()).grad[0, 0] = float("nan")
    try:
        exchange.synchronize()
        raised = ""
    except gradwire.NonFiniteGradientError as error:
        raised = str(error)
    return {"gap": gap, "scale": scale, "raised": raised, "sent": exchange.stats()["total_bytes_sent"],
            "dense": exchange.stats()["total_bytes_dense"]}


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_allreduce_telescopes_and_fails_together(bits: int) -> None:
    for result in run_workers(worker_quantized, 3, bits, timeout=120):
        assert result["gap"] < 1e-5 * result["scale"], result  # float32 roundings only
        assert "NaN or Inf" in result["raised"], result  # the typed error, on every rank
        assert result["sent"] < (0.6 if bits == 8 else 0.4) * result["dense"], result


def worker_quantized_unused(rank: int, world_size: int) -> dict:
    """A parameter with no gradient in a step (all zeros on every rank) after a step that left it a
    residual: the quantized AllReduce sends nothing of it and keeps its residual whole."""
    model = _model()
    exchange = gradwire.GradientExchange(model, compressor="none", quantize="int4", quantize_block=16)
    last = list(model.parameters())[-1]
    for step in range(2):
        model.zero_grad()
        inputs, targets = _batch(rank, step)
        torch.nn.functional.cross_entropy(model(inputs), targets).backward()
        if step == 1:
            before = exchange.feedback.residual(id(last)).clone()
            last.grad.zero_()
        exchange.synchronize()
    after = exchange.feedback.residual(id(last))
    return {"residual_before": float(before.abs().sum()), "residual_kept": bool(torch.equal(after, before)),
            "applied": float(last.grad.abs().sum())}


def test_an_unused_parameter_keeps_its_quantization_residual_whole() -> None:
    for result in run_workers(worker_quantized_unused, 2, timeout=120):
        assert result["residual_before"] > 0, result  # int4 left something behind in step 0
        assert result["residual_kept"] and result["applied"] == 0.0, result  # not sent, not replaced
