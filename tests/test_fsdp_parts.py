"""The parts of gradwire.fsdp without FSDP: the flat layout, the divisor, balanced digests, the
simulated reduce-scatter, and the core's shard strategies on a hand-built group."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp  # noqa: F401  (registers torch.ops.fsdp.chunk_cat)

from gradwire.core.digest import agree, balanced_share, chain_share
from gradwire.fsdp import layout

from .distributed import run_workers

SHAPES = [(7, 5), (7,), (3, 2, 2), (1,), (10,)]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_the_layout_is_fsdp2s_chunk_cat(world: int) -> None:
    generator = torch.Generator().manual_seed(world)
    tensors = [torch.randn(shape, generator=generator) for shape in SHAPES]
    shard = layout.shard_numel(SHAPES, world)
    expected = torch.empty(world, shard)
    torch.ops.fsdp.chunk_cat(tensors, dim=0, num_chunks=world, out=expected)
    flat = layout.flatten(tensors, world)
    assert torch.equal(flat, expected.reshape(-1))
    assert all(torch.equal(a, b) for a, b in zip(layout.unflatten(flat, SHAPES, world), tensors))
    pieces = layout.pieces(SHAPES, world)
    assert [p.offset for p in pieces] == [0, *torch.cumsum(torch.tensor([p.numel for p in pieces]), 0).tolist()[:-1]]
    assert sum(p.numel for p in pieces) == world * shard
    assert {p.chunk for p in pieces if p.offset < shard} == {0}


def _unit(factor: "float | None", replicas: int = 1) -> SimpleNamespace:
    return SimpleNamespace(param_group=SimpleNamespace(gradient_divide_factor=factor), replica_size=replicas)


@pytest.mark.parametrize("op, factor, replicas, expected", [
    ("AVG", None, 1, 4.0),          # FSDP2's default: a mean over the 4 ranks
    ("SUM", None, 1, 1.0),          # set_force_sum_reduction_for_comms: FSDP divides by 4 itself
    ("AVG", 4.0, 1, 4.0),           # a factor equal to the group's size is asked for as AVG
    ("PREMUL", 3.0, 1, 3.0),        # any other factor: PREMUL_SUM(1/3)
    ("SUM", 3.0, 1, 1.0),           # force sum with a factor: FSDP divides by 3
    ("AVG", None, 2, 8.0),          # HSDP 2 x 4 seen as 1-D: a mean over all 8 ranks
    ("SUM", None, 2, 2.0),          # HSDP, force sum: FSDP divides by 4, gradwire by the replicas
])
def test_the_divisor_completes_fsdps_own_division(op: str, factor: "float | None", replicas: int,
                                                  expected: float) -> None:
    from gradwire.fsdp.state import FSDPCompressionState

    reduce_op = {"AVG": dist.ReduceOp.AVG, "SUM": dist.ReduceOp.SUM,
                 "PREMUL": dist.ReduceOp.PREMUL_SUM(1 / (factor or 1))}[op]
    assert FSDPCompressionState.divisor(None, _unit(factor, replicas), reduce_op, 4) == expected  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="supports SUM, AVG and PREMUL_SUM"):
        FSDPCompressionState.divisor(None, _unit(None), dist.ReduceOp.MAX, 4)  # type: ignore[arg-type]


def test_a_balanced_digest_is_zero_exactly_when_every_owner_decoded_what_was_sent() -> None:
    world = 3
    sent = {(i, j): [torch.full((4,), float(10 * i + j))] for i in range(world) for j in range(world)}

    def shares(received: dict) -> list[int]:
        return [balanced_share([(j, sent[(r, j)]) for j in range(world)], [(i, received[(i, r)]) for i in range(world)],
                               rank=r) for r in range(world)]

    assert agree(shares(sent), balanced=True)
    forged = dict(sent)
    forged[(1, 2)] = [sent[(1, 2)][0] + 1]
    assert not agree(shares(forged), balanced=True)
    swapped = dict(sent)  # what 0 sent 1 arrives at 2 and the other way round
    swapped[(0, 1)], swapped[(0, 2)] = sent[(0, 2)], sent[(0, 1)]
    assert not agree(shares(swapped), balanced=True)
    assert agree([chain_share(7, position=p, size=4) for p in range(4)], balanced=True)
    assert not agree([chain_share(7 if p != 2 else 8, position=p, size=4) for p in range(4)], balanced=True)
    assert agree([17, 17], balanced=False) and not agree([17, 18], balanced=False)


def _gpt_like() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.LayerNorm(9), torch.nn.Linear(9, 5))


def test_the_simulated_reduce_scatter_is_the_mean_when_lossless_and_telescopes_otherwise() -> None:
    from gradwire.harness.sharding import ShardedReduce
    from gradwire.harness.simulate import exact_mean

    model = _gpt_like()
    generator = torch.Generator().manual_seed(1)
    grads = [[torch.randn(p.shape, generator=generator) for p in model.parameters()] for _ in range(3)]
    mean = exact_mean(grads)
    for options in ({}, {"compressor": "topk", "density": 1.0}):
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(ShardedReduce(model, 3, **options)(grads), mean))
    for options in ({"quantize": "int4"}, {"compressor": "topk", "density": 0.2, "value_codec": "fp16"}):
        reduce = ShardedReduce(model, 3, **options)
        applied = reduce(grads)
        assert len(reduce.units) == 3  # one per layer; the root holds no parameter of its own
        for unit, members in enumerate(reduce.units):  # per FSDP unit: applied (3 x the mean) + kept = owed
            owed = sum(layout.flatten([g[i] for i in members], 3) for g in grads)
            kept = sum(r[unit] for r in reduce.residuals)
            together = 3 * layout.flatten([applied[i] for i in members], 3) + kept
            assert torch.allclose(together, owed, atol=1e-5), options


def test_the_simulated_momentum_exchange_averages_to_the_global_momentum_when_lossless() -> None:
    """Each worker sends ``(1 - b1) g_w + b1 s_w`` (``s_w``: what it sent the step before); lossless,
    the mean of the ``s_w`` is the step before's output, so the output is the momentum of the mean
    gradient, from zeros after the warm-up: ``(1 - b1) mean(g)``, then ``b1 out + (1 - b1) mean(g)``."""
    from gradwire.harness.sharding import ShardedReduce
    from gradwire.harness.simulate import exact_mean

    model = _gpt_like()
    generator = torch.Generator().manual_seed(2)
    reduce = ShardedReduce(model, 3, compressor="topk", density=1.0, warmup_steps=1, momentum=0.5)
    steps = [[[torch.randn(p.shape, generator=generator) for p in model.parameters()] for _ in range(3)]
             for _ in range(4)]
    previous = None
    for step, grads in enumerate(steps):
        out, mean = reduce(grads), exact_mean(grads)
        if step == 0:  # the warm-up: the exact mean gradient
            expected = mean
        elif step == 1:
            expected = [0.5 * m for m in mean]
        else:
            expected = [0.5 * o + 0.5 * m for o, m in zip(previous, mean)]
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(out, expected)), step
        previous = out
    for options in ({"quantize": "int8"}, {"compressor": "topk", "density": 0.1, "error_feedback": False},
                    {"compressor": "topk", "density": 0.1, "feedback_decay": 0.9}):
        with pytest.raises(ValueError, match="momentum=0.9 needs a sparsifier with plain error feedback"):
            ShardedReduce(model, 3, momentum=0.9, **options)


def test_the_simulated_reduce_scatter_counts_the_dense_steps_bytes_too() -> None:
    """Plain FSDP2's steps and a warm-up's cost (p-1)/p of the padded float32 gradient per worker:
    a run's bytes per step are then the whole run's, not only its compressed steps'."""
    from gradwire.harness.sharding import ShardedReduce

    model = _gpt_like()
    workers = 3
    padded = sum(layout.shard_numel([tuple(p.shape) for p in layer.parameters()], workers) * workers
                 for layer in model if any(True for _ in layer.parameters()))
    grads = [[torch.ones(p.shape) for p in model.parameters()] for _ in range(workers)]
    plain = ShardedReduce(model, workers)
    plain(grads)
    assert plain.bytes_sent == 4 * (workers - 1) * padded  # summed over the workers
    assert plain.plain_bytes_per_worker() * workers == plain.bytes_sent  # the budgets' denominator
    warming = ShardedReduce(model, workers, quantize="int8", warmup_steps=1)
    warming(grads)
    assert warming.bytes_sent == plain.bytes_sent
    warming(grads)  # the first quantized step: int8 blocks cost about a quarter of the dense bytes
    assert plain.bytes_sent * 1.1 < warming.bytes_sent < plain.bytes_sent * 1.5


def test_the_simulated_all_gather_is_exact_during_the_warm_up_as_the_library_s() -> None:
    from gradwire.harness.sharding import ShardedReduce

    model = _gpt_like()
    parameters = list(model.parameters())
    reduce = ShardedReduce(model, 3, quantize="int4", all_gather="int8", warmup_steps=1)
    assert all(torch.equal(a, b) for a, b in zip(reduce.gathered_weights(parameters), parameters))
    padded = sum(layout.shard_numel([tuple(p.shape) for p in layer.parameters()], 3)
                 for layer in model if any(True for _ in layer.parameters()))
    assert reduce.gather_bytes_sent == 4 * 2 * padded  # counted as an exact float32 gather: (p-1) shards
    reduce([[torch.zeros(p.shape) for p in parameters] for _ in range(3)])  # the warm-up's one step
    rounded = reduce.gathered_weights(parameters)
    assert not all(torch.equal(a, b) for a, b in zip(rounded, parameters))
    assert all(torch.allclose(a, b, atol=0.02) for a, b in zip(rounded, parameters))


# ------------------------------------------------------------------- the core, without FSDP
def worker_shard_group(rank: int, world_size: int, options: dict, release: bool = False) -> dict:
    """A hand-built shard group through the core's pipeline, checked against a float64 sum.

    ``release``: as the FSDP front-end does, complete the group, release its gradients, then
    agree; the input is overwritten with NaN in between (FSDP frees and reuses that memory), so
    anything after the release that still read it would show in the result or the residuals."""
    from gradwire.core.config import ExchangeConfig
    from gradwire.core.group import Entry, Group, ShardTarget
    from gradwire.core.pipeline import Pipeline

    shapes = [(5, 3), (4,), (2,)]
    pipeline = Pipeline(ExchangeConfig(**options), spare_buffers=False)
    out = {"errors": [], "telescopes": []}
    owed = None
    for step in range(3):
        generator = torch.Generator().manual_seed(100 * rank + step)
        flat = layout.flatten([torch.randn(s, generator=generator) for s in shapes], world_size)
        owed = flat.double() if owed is None else owed + flat.double()
        output = torch.empty(flat.numel() // world_size)
        entries = [Entry((p.parameter, p.chunk), p.parameter * world_size + p.chunk, flat[p.offset: p.offset + p.numel],
                         p.offset) for p in layout.pieces(shapes, world_size)]
        group = Group(ShardTarget(flat, output, group=None), entries, divisor=1.0)
        exact = torch.zeros_like(flat, dtype=torch.float64)
        gathered = [torch.empty_like(flat) for _ in range(world_size)]
        dist.all_gather(gathered, flat, async_op=True).wait()
        for other in gathered:
            exact += other.double()
        if release:
            pipeline.complete([group], [pipeline.start(group, step)], step)
            group.release_exchange_inputs()
            assert all(e.grad.numel() == p.numel and e.grad.untyped_storage().data_ptr() != flat.data_ptr()
                       for e, p in zip(entries, layout.pieces(shapes, world_size)))
            flat.fill_(float("nan"))
            verdict = pipeline.agree([group], step)
        else:
            verdict = pipeline.finish([group], [pipeline.start(group, step)], step)
        assert verdict.action == "apply", verdict
        mine = exact.reshape(world_size, -1)[rank]
        out["errors"].append(float((output.double() - mine).norm() / mine.norm()))
        # error feedback: the sum of what every rank applied and still owes is what every rank had
        residual = torch.zeros_like(flat)
        for entry in entries:
            kept = pipeline.feedback.residual(entry.key) if pipeline.feedback is not None else None
            if kept is not None:
                residual[entry.offset: entry.offset + entry.numel] = kept.float()
        applied = torch.zeros_like(flat)
        applied.reshape(world_size, -1)[rank] = output
        for tensor in (residual, applied):
            dist.all_reduce(tensor, async_op=True).wait()
        if step == 0:
            owed_everywhere = owed.clone().float()
            dist.all_reduce(owed_everywhere, async_op=True).wait()
            out["telescopes"].append(float((residual + applied - owed_everywhere).abs().max()))
    out["bytes"] = pipeline.stats.snapshot()["total_bytes_sent"]
    return out


@pytest.mark.timeout(200)
@pytest.mark.parametrize("options", [{"compressor": "topk", "density": 1.0}, {"compressor": "none", "quantize": "int8"},
                                     {"compressor": "topk", "density": 0.3, "value_codec": "fp16"}],
                         ids=["lossless", "int8", "topk"])
@pytest.mark.parametrize("release", [False, True], ids=["finish", "released-before-agreeing"])
def test_a_hand_built_shard_group_reduce_scatters_and_its_error_feedback_telescopes(options: dict,
                                                                                     release: bool) -> None:
    for result in run_workers(worker_shard_group, 3, options, release, timeout=150):
        if options.get("density") == 1.0:
            assert max(result["errors"]) < 1e-6, result
        elif "quantize" in options:
            assert max(result["errors"]) < 0.05, result
        assert result["telescopes"][0] < 1e-5, result
        assert result["bytes"] > 0 and math.isfinite(result["bytes"])


def test_frames_are_sized_from_the_shapes_only_where_the_sparsifier_fixes_its_count() -> None:
    """The most entries per shard is the sum of each piece's budget (at least one in shard 0, for
    a non-finite rank's NaN); a data-sized sparsifier (threshold) or a piece across two shards
    sends its counts first instead (None)."""
    from gradwire.codecs import get_index_codec, get_value_codec
    from gradwire.core.group import Entry
    from gradwire.core.stats import ExchangeStats
    from gradwire.core.strategies.base import ExchangeContext
    from gradwire.core.strategies.reduce_scatter import SparseReduceScatter
    from gradwire.sparsify import get_sparsifier

    shapes, world = [(7, 5), (7,), (3, 2, 2), (1,), (10,)], 3
    flat = layout.flatten([torch.randn(s) for s in shapes], world)
    entries = [Entry((p.parameter, p.chunk), p.parameter * world + p.chunk, flat[p.offset: p.offset + p.numel],
                     p.offset) for p in layout.pieces(shapes, world)]
    bounds = [j * (flat.numel() // world) for j in range(world + 1)]
    context = ExchangeContext(get_value_codec("fp16"), get_index_codec("rice"), None, world, 0, ExchangeStats(), 10.0)

    def most(sparsifier: object, entries: list = entries) -> "list[int] | None":
        strategy = SparseReduceScatter(context, sparsifier, None)
        return strategy.most_per_shard(SimpleNamespace(entries=entries), bounds)  # it reads the entries only

    topk = get_sparsifier("topk", density=0.3)
    expected = [0] * world
    for piece in layout.pieces(shapes, world):
        expected[piece.offset // (flat.numel() // world)] += topk.target_k(piece.numel)
    expected[0] = max(expected[0], 1)
    assert most(topk) == expected and sum(expected) < flat.numel()
    assert most(get_sparsifier("threshold", threshold=0.5)) is None
    straddling = [Entry("x", 0, flat[: bounds[1] + 1], 0)]
    assert most(topk, straddling) is None
