"""The simulator's DiLoCo (harness.diloco_sim) is the front-end's algorithm: the same global
parameters as real gloo ranks of gradwire.DiLoCo, bit for bit, on the same batches."""

from __future__ import annotations

import copy

import pytest
import torch

from gradwire.harness.diloco_sim import SimulatedDiLoCo
from gradwire.local_steps import DiLoCo

from .distributed import run_workers
from .test_local_steps import _batch, _digest, _global, _model

pytestmark = pytest.mark.distributed

STEPS = 12
CASES = {  # name -> (world size, DiLoCo options)
    "dense-warmup": (2, {"warmup_steps": 2}),
    "dense-norm": (2, {}),
    "allgather": (3, {"compressor": "topk", "density": 0.2, "collective": "allgather", "value_codec": "fp16",
                      "index_codec": "rice"}),
    "allgather-qsgd": (3, {"compressor": "topk", "density": 0.2, "collective": "allgather",
                           "value_codec": "qsgd-ans", "codec_options": {"rounding": "nearest"}}),
    "decay-fragments-overlap": (3, {"compressor": "topk", "density": 0.1, "collective": "allgather",
                                    "feedback_decay": 0.9, "fragments": 2, "overlap_steps": 1}),
    "unsent-model": (3, {"compressor": "topk", "density": 0.1, "collective": "allgather", "unsent": "model"}),
    "unsent-model-int4-overlap": (3, {"quantize": "int4", "unsent": "model", "overlap_steps": 2}),
    "fragments-overlap-carry": (2, {"fragments": 2, "overlap_steps": 1, "overlap_merge": "carry"}),
    "unsent-model-topk-overlap-carry": (2, {"compressor": "topk", "density": 0.2, "collective": "allgather",
                                            "unsent": "model", "overlap_steps": 1, "overlap_merge": "carry"}),
    "int8": (3, {"quantize": "int8"}),
    "int8-warmup": (3, {"quantize": "int8", "warmup_steps": 3, "warmup_quantize": "int8"}),
    # exact warm-up steps on 2 ranks: gloo's ring sums 3 ranks' dense buffers in another order
    "int8-warmup-exact-first": (2, {"quantize": "int8", "warmup_steps": 3, "warmup_quantize": "int8",
                                    "warmup_exact_steps": 2}),
    "int4": (3, {"quantize": "int4", "quantize_block": 16, "fragments": 2}),
    "randomblock": (2, {"compressor": "randomblock", "density": 0.25, "collective": "allreduce"}),
    "sparse-allreduce": (3, {"compressor": "topk", "density": 0.2, "collective": "sparse-allreduce",
                             "value_codec": "fp16", "index_codec": "rice"}),
    # lossy values: each owner's re-coding error is its carry; the model holds the unsent part
    "sparse-allreduce-qsgd-model": (3, {"compressor": "topk", "density": 0.1, "collective": "sparse-allreduce",
                                        "value_codec": "qsgd-ans", "codec_options": {"rounding": "nearest"},
                                        "unsent": "model"}),
    # two ranks: the quantized AllReduce swaps the whole quantized Δs (the replay must too)
    "int4-two": (2, {"quantize": "int4", "quantize_block": 16}),
    "momentum-correction": (3, {"compressor": "topk", "density": 0.2, "collective": "allgather", "outer_momentum": 0.0,
                                "momentum_correction": 0.9}),
}


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int, step: int) -> None:
    inputs, targets = _batch(rank, step)
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(inputs), targets).backward()


def worker_real(rank: int, world_size: int, names: list[str]) -> dict:
    out = {}
    for name in names:
        norm = name == "dense-norm"
        model = _model(norm=norm)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        local = DiLoCo(model, optimizer, sync_every=4, **CASES[name][1])
        for step in range(STEPS):
            _train(model, optimizer, rank, step)
            optimizer.step()
        local.synchronize()  # as the harness does before it evaluates
        out[name] = {"global": _global(local), "buffers": _digest(list(model.buffers())) if norm else None,
                     "bytes": local.stats()["bytes_sent"]}
        local.close()
    return out


def simulated(name: str) -> dict:
    workers, options = CASES[name]
    norm = name == "dense-norm"
    models = [_model(norm=norm) for _ in range(workers)]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    sim = SimulatedDiLoCo(workers, STEPS, sync_every=4, **copy.deepcopy(options))
    sim.bind(models)
    for step in range(STEPS):
        grads = []
        for rank, (model, optimizer) in enumerate(zip(models, optimizers)):
            _train(model, optimizer, rank, step)
            grads.append([p.grad for p in model.parameters()])
        reduced = sim.reduce(grads)
        if reduced is not None:
            for model in models:
                for parameter, gradient in zip(model.parameters(), reduced):
                    parameter.grad = gradient.clone()
        for optimizer in optimizers:
            optimizer.step()
        sim.after_step(step + 1, models, optimizers)
    evaluated = sim.eval_model(models)
    return {"global": _digest(torch.cat([p.detach().reshape(-1) for p in state_order(sim, evaluated)])),
            "buffers": _digest(list(models[0].buffers())) if norm else None, "bytes": sim.bytes_sent}


def state_order(sim: SimulatedDiLoCo, model: torch.nn.Module) -> list[torch.Tensor]:
    """The evaluated model's parameters in the order of θ's flat buffers (fragment by fragment)."""
    parameters = [p for p in model.parameters() if p.requires_grad]
    return [parameters[i] for members in sim.outer[0].fragments for i in members]


@pytest.mark.timeout(400)
def test_the_simulator_reaches_the_front_ends_global_parameters_bit_for_bit() -> None:
    for workers in sorted({w for w, _ in CASES.values()}):
        names = [name for name, (w, _) in CASES.items() if w == workers]
        real = run_workers(worker_real, workers, names, timeout=300)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as every worker runs (tests/distributed.py): the same reduction order
        try:
            mine_by_name = {name: simulated(name) for name in names}
        finally:
            torch.set_num_threads(threads)
        for name in names:
            mine = mine_by_name[name]
            assert all(r[name]["global"] == mine["global"] for r in real), name
            assert all(r[name]["buffers"] == mine["buffers"] for r in real), name
            # the simulator counts the bytes a worker sends with the strategies' rules (the mean over
            # the workers: the sparse AllReduce's differ by rank)
            real_bytes = sum(r[name]["bytes"] for r in real) / len(real)
            assert mine["bytes"] == pytest.approx(real_bytes, rel=0.02), (name, mine["bytes"], real_bytes)


def test_the_simulator_refuses_what_it_does_not_replay() -> None:
    with pytest.raises(ValueError, match="needs real ranks"):
        SimulatedDiLoCo(2, 10, sync_every=2, compressor="topk", collective="sparse-allreduce", hierarchy=2)
