"""DiLoCo (gradwire.local_steps): identical global parameters on every rank after every sync, the
H = 1 equivalence with DDP, error feedback over syncs, fragments, overlap, failures, checkpoints,
and DDP inside the outer group. Real gloo ranks, each test within its timeout."""

from __future__ import annotations

import hashlib
import io
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from gradwire.local_steps import DiLoCo, assign_fragments, fragment_due, layers_of

from .distributed import run_workers, run_workers_some_die

pytestmark = pytest.mark.distributed

#: the outer exchanges every compressor x collective test runs (name -> DiLoCo keywords)
EXCHANGES = {
    "dense": {},
    "int8": {"quantize": "int8"},
    "int4": {"quantize": "int4", "quantize_block": 32},
    "topk-allgather": {"compressor": "topk", "density": 0.2, "collective": "allgather", "value_codec": "fp16",
                       "index_codec": "rice"},
    "topk-allgather-qsgd": {"compressor": "topk", "density": 0.2, "collective": "allgather",
                            "value_codec": "qsgd-ans"},
    "topk-sparse-allreduce": {"compressor": "topk", "density": 0.2, "collective": "sparse-allreduce"},
    "topk-auto": {"compressor": "topk", "density": 0.2, "collective": "auto", "link_gbit": 1.0},
    "randomblock-allreduce": {"compressor": "randomblock", "density": 0.25, "collective": "allreduce"},
    "topk-decay": {"compressor": "topk", "density": 0.1, "collective": "allgather", "feedback_decay": 0.9},
    "topk-unsent-model": {"compressor": "topk", "density": 0.1, "collective": "allgather", "unsent": "model",
                          "value_codec": "qsgd-ans", "index_codec": "rice"},
}


def _model(seed: int = 0, norm: bool = True) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(12, 16), torch.nn.ReLU()]
    if norm:
        layers.append(torch.nn.BatchNorm1d(16))
    return torch.nn.Sequential(*layers, torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 12, generator=generator), torch.randint(0, 3, (8,), generator=generator)


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int, step: int) -> None:
    inputs, targets = _batch(rank, step)
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(inputs), targets).backward()
    optimizer.step()


def _digest(tensors: list[torch.Tensor]) -> str:
    flat = torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]


def _global(local: DiLoCo) -> str:
    return _digest(local.outer.global_flat)


def _plain(tensors: list[torch.Tensor]) -> list[list[float]]:
    """Tensors as lists: a tensor in the results queue would travel as a shared-memory handle that
    dies with the worker (which leaves with os._exit)."""
    return [t.detach().reshape(-1).tolist() for t in tensors]


def _close(mine: list[list[float]], reference: list[list[float]]) -> None:
    for a, b in zip(mine, reference):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ fragments (no process group)
def test_fragments_cover_every_parameter_exactly_once_per_period() -> None:
    model = _model()
    named = list(model.named_parameters())
    for fragments in (1, 2, 3):
        members = assign_fragments(layers_of(named), fragments)
        flat = sorted(i for m in members for i in m)
        assert flat == list(range(len(named)))  # every parameter in exactly one fragment
        sync_every = 6
        for period in range(3):
            due = [fragment_due(period * sync_every + s, sync_every, fragments) for s in range(1, sync_every + 1)]
            assert sorted(f for f in due if f is not None) == list(range(fragments)), (fragments, due)
    with pytest.raises(ValueError, match="fragments=9 is more than"):
        assign_fragments(layers_of(named), 9)


def test_fragments_stride_equal_layers_and_balance_unequal_ones() -> None:
    equal = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(8)])
    assert assign_fragments(layers_of(list(equal.named_parameters())), 4) == [[0, 1, 8, 9], [2, 3, 10, 11],
                                                                               [4, 5, 12, 13], [6, 7, 14, 15]]
    from gradwire.harness.models import build_model

    named = list(build_model("gpt").named_parameters())
    total = sum(p.numel() for _, p in named)
    sizes = [sum(named[i][1].numel() for i in m) / total for m in assign_fragments(layers_of(named), 4)]
    assert max(sizes) < 0.28 and min(sizes) > 0.2, sizes


@pytest.mark.parametrize("options, message", [
    ({"sync_every": 0}, "sync_every=0 must be an integer >= 1"),
    ({"sync_every": 6, "fragments": 4}, "sync_every=6 must be a multiple of fragments=4"),
    ({"sync_every": 8, "fragments": 4, "overlap_steps": 3}, "overlap_steps=3 must be at most"),
    ({"sync_every": 4, "outer_lr": 0}, "outer_lr=0 must be"),
    ({"sync_every": 4, "feedback_decay": 1.5}, r"feedback_decay=1.5 must be a number in \[0, 1\]"),
    ({"sync_every": 4, "collective": "ring"}, "collective='ring' is not supported"),
    ({"sync_every": 4, "quantize": "int2"}, "quantize='int2' is not supported"),
    ({"sync_every": 4, "warmup_steps": 5, "warmup_quantize": "int8", "warmup_exact_steps": 6},
     r"warmup_exact_steps=6 must be an integer in \[0, warmup_steps=5\]"),
    ({"sync_every": 4, "warmup_steps": 5, "warmup_exact_steps": 2}, "warmup_exact_steps needs warmup_quantize"),
    ({"sync_every": 4, "overlap_merge": "blend"}, "overlap_merge='blend' is not supported; allowed: mix, carry"),
])
def test_invalid_options_name_the_option(options: dict, message: str) -> None:
    model = _model()
    with pytest.raises(ValueError, match=message):
        DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), **options)


@pytest.mark.parametrize("options, unsent", [
    ({"compressor": "topk", "density": 0.1}, "model"),  # a sparsifier with plain error feedback
    ({"compressor": "randomblock", "density": 0.1, "value_codec": "fp16"}, "model"),
    ({}, "residual"),  # dense outer steps
    ({"quantize": "int8"}, "residual"),
    ({"compressor": "topk", "density": 0.1, "momentum_correction": 0.9}, "residual"),  # velocities stay
    ({"compressor": "topk", "density": 0.1, "error_feedback": False}, "residual"),
    ({"compressor": "topk", "density": 0.1, "unsent": "residual"}, "residual"),  # given: kept
])
def test_unsent_defaults_to_the_model_for_sparsifiers_with_error_feedback(options: dict, unsent: str) -> None:
    from gradwire.local_steps import split_options

    model = _model()
    local = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=4, **options)
    assert local.local.unsent == unsent
    assert split_options(sync_every=4, **options)[0].unsent == unsent  # the CLI's check resolves it alike
    local.close()


@pytest.mark.parametrize("carry", [False, True])
def test_the_overlap_merges_mix_or_carry_the_steps_taken_in_flight(carry: bool) -> None:
    from gradwire.local_steps.outer import OuterState, sgd_factory

    local = [torch.nn.Parameter(torch.tensor([1.0, 2.0])), torch.nn.Parameter(torch.tensor([[3.0]]))]
    state = OuterState(local, [[0, 1]], sgd_factory(1.0, 0.0, False))  # θ = (1, 2, 3)
    with torch.no_grad():
        local[0].sub_(torch.tensor([0.5, 0.5]))  # the period's local steps: θ_local = (0.5, 1.5, 3)
    delta = state.pseudo_gradient(0, torch.zeros(3), keep_start=carry)
    assert delta.tolist() == [0.5, 0.5, 0.0]
    with torch.no_grad():
        local[1].add_(1.0)  # one inner step while the exchange is in flight: θ_local = (0.5, 1.5, 4)
    state.apply(0, torch.tensor([0.25, 0.25, 0.25]))  # the average; SGD lr 1: θ = (0.75, 1.75, 2.75)
    state.merge(0, 0.5, carry=carry)
    if carry:  # θ plus the in-flight step, whole; the start is dropped
        assert torch.cat([p.detach().reshape(-1) for p in local]).tolist() == [0.75, 1.75, 3.75]
        assert state.starts == {}
    else:  # Streaming DiLoCo's mix, α = 0.5
        assert torch.cat([p.detach().reshape(-1) for p in local]).tolist() == [0.625, 1.625, 3.375]


def test_one_rank_without_a_process_group() -> None:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    local = DiLoCo(model, optimizer, sync_every=3, warmup_steps=2)
    for step in range(9):
        _step(model, optimizer, 0, step)
    stats = local.stats()
    assert (stats["inner_steps"], stats["local_steps"], stats["outer_steps"]) == (9, 7, 2)
    assert _digest(list(model.parameters())) != _global(local)  # one local step since the last sync
    local.synchronize()
    assert _digest(list(model.parameters())) == _global(local)


def test_a_forced_sync_averages_plainly_and_leaves_the_outer_optimizer_alone() -> None:
    model = _model(norm=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    local = DiLoCo(model, optimizer, sync_every=4, outer_lr=0.7, outer_momentum=0.9)
    for step in range(6):  # one outer step (a momentum buffer), then two local steps
        _step(model, optimizer, 0, step)
    momentum = [local.outer.optimizer.state[v]["momentum_buffer"].clone() for v in local.outer.global_views[0]]
    local_model = [p.detach().clone() for p in model.parameters()]
    local.synchronize()
    # one rank: the average of the local models is the local model (θ - (θ - local), rounded),
    # whatever the momentum held; an outer SGD step would have added 0.7 * 0.9^2 of its buffer
    assert all(torch.allclose(v, p, rtol=0, atol=1e-6) for v, p in zip(local.outer.global_views[0], local_model))
    assert all(torch.equal(local.outer.optimizer.state[v]["momentum_buffer"], m)
               for v, m in zip(local.outer.global_views[0], momentum))
    assert local.outer_steps == 1
    after = [v.detach().clone() for v in local.outer.global_views[0]]
    local.synchronize()  # nothing new: a no-op
    assert all(torch.equal(v, a) for v, a in zip(local.outer.global_views[0], after))


def test_any_torch_optimizer_as_the_outer_one() -> None:
    model = _model(norm=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    built = []

    def adam(parameters):
        built.append([tuple(p.shape) for p in parameters])
        return torch.optim.Adam(parameters, lr=0.01)

    local = DiLoCo(model, optimizer, sync_every=2, outer_optimizer=adam)
    before = [v.detach().clone() for v in local.outer.global_views[0]]
    for step in range(4):
        _step(model, optimizer, 0, step)
    assert built == [[tuple(p.shape) for p in model.parameters()]]  # float32 tensors shaped like the model's
    assert isinstance(local.outer.optimizer, torch.optim.Adam) and local.outer_steps == 2
    # Adam's first steps move every parameter by about lr, whatever the pseudo-gradient's scale
    moved = [float((v.detach() - b).abs().max()) for v, b in zip(local.outer.global_views[0], before)]
    assert all(0.005 < m < 0.03 for m in moved), moved


# ------------------------------------------------------------------ ranks identical after every sync
def worker_identical(rank: int, world_size: int, names: list[str]) -> dict:
    out = {}
    for name in names:
        model = _model(seed=rank)  # different weights: the construction broadcasts rank 0's
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        local = DiLoCo(model, optimizer, sync_every=2, **EXCHANGES[name])
        digests = []
        for step in range(6):
            _step(model, optimizer, rank, step)
            if step % 2 == 1:  # with unsent="model" each rank's model holds its own unsent part
                own = None if local.local.unsent == "model" else _digest(list(model.parameters()))
                digests.append((_global(local), own, _digest(list(model.buffers()))))
        out[name] = {"digests": digests, "outer_steps": local.stats()["outer_steps"],
                     "bytes": local.stats()["bytes_outer"]}
        local.close()
    return out


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_rank_ends_each_sync_with_identical_global_parameters(world_size: int) -> None:
    results = run_workers(worker_identical, world_size, sorted(EXCHANGES), timeout=360)
    for name in EXCHANGES:
        runs = [r[name] for r in results]
        assert all(r["outer_steps"] == 3 for r in runs), name
        assert all(r["bytes"] > 0 for r in runs), name
        for sync in range(3):
            assert len({r["digests"][sync] for r in runs}) == 1, (name, sync, [r["digests"][sync] for r in runs])
        assert runs[0]["digests"][0][0] != runs[0]["digests"][2][0]  # θ moved


# ------------------------------------------------------------------ H = 1 equals DDP
def worker_h1_vs_ddp(rank: int, world_size: int) -> dict:
    model = _model(norm=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    DiLoCo(model, optimizer, sync_every=1, outer_lr=1.0, outer_momentum=0.0)
    reference = DDP(_model(norm=False))
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(5):
        _step(model, optimizer, rank, step)
        _step(reference, reference_optimizer, rank, step)
    return {"diloco": _plain(list(model.parameters())), "ddp": _plain(list(reference.module.parameters()))}


@pytest.mark.timeout(120)
def test_h1_outer_lr1_no_momentum_no_compression_equals_synchronous_ddp() -> None:
    for result in run_workers(worker_h1_vs_ddp, 2, timeout=90):
        _close(result["diloco"], result["ddp"])
        assert result["diloco"][0] != _plain([_model(norm=False)[0].weight])[0]  # it trained


# ------------------------------------------------------------------ error feedback over syncs
def worker_ef(rank: int, world_size: int, options: dict) -> dict:
    model = _model(norm=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    snapshot: dict = {}
    moved = []  # what every inner step moved the local parameters by (syncs excluded)

    def flat() -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def before(optimizer, args, kwargs) -> None:
        snapshot["x"] = flat()

    def after(optimizer, args, kwargs) -> None:  # registered first: runs before DiLoCo's hook syncs
        moved.append(snapshot["x"] - flat())

    optimizer.register_step_pre_hook(before)
    optimizer.register_step_post_hook(after)
    # outer lr 1 without momentum: θ moves by exactly the applied average
    local = DiLoCo(model, optimizer, sync_every=2, outer_lr=1.0, outer_momentum=0.0, **options)
    start = local.outer.global_flat[0].clone()
    for step in range(10):
        _step(model, optimizer, rank, step)
    feedback = local.pipeline.feedback
    residual = torch.cat([feedback.residual(key) if feedback.residual(key) is not None else torch.zeros(p.numel())
                          for key, p in zip(local._keys, local.parameters)])
    held = residual + (local.outer.global_flat[0] - flat())  # unsent="model": the model holds it
    return {"applied": (start - local.outer.global_flat[0]).tolist(), "held": held.tolist(),
            "moved": torch.stack(moved).sum(0).tolist(), "outer": local.outer_steps}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("options", [
    {"compressor": "topk", "density": 0.1, "collective": "allgather"},
    {"compressor": "topk", "density": 0.1, "collective": "sparse-allreduce"},
    {"compressor": "topk", "density": 0.1, "collective": "allgather", "unsent": "model"},
], ids=["allgather", "sparse-allreduce", "allgather-unsent-model"])
def test_error_feedback_telescopes_over_syncs(options: dict) -> None:
    """p x (what θ moved) + what every rank holds back = what every rank's inner steps moved, summed
    over the syncs: nothing a sync left out is lost, it waits in some rank's residual (or model)."""
    results = run_workers(worker_ef, 3, options, timeout=150)
    assert all(r["outer"] == 5 for r in results)
    moved = sum(torch.tensor(r["moved"]) for r in results)
    held = sum(torch.tensor(r["held"]) for r in results)
    applied = torch.tensor(results[0]["applied"])
    assert all(r["applied"] == results[0]["applied"] for r in results)
    torch.testing.assert_close(3 * applied + held, moved, rtol=1e-4, atol=1e-6)
    assert float(held.abs().sum()) > 1e-3  # something was held back: the test can fail


def test_feedback_decay_compensates_delta_plus_beta_times_residual() -> None:
    from gradwire.core.feedback import ErrorFeedback
    from gradwire.local_steps.outer import feedback_input

    feedback = ErrorFeedback()
    residual = torch.tensor([1.0, -2.0, 0.5])
    feedback.residuals["w"] = residual.clone()
    delta = torch.tensor([0.1, 0.2, 0.3])
    adjusted = delta.clone()
    feedback_input(adjusted, feedback, 0.9, [0], [0], ["w"])
    torch.testing.assert_close(feedback.compensate("w", adjusted), delta + 0.9 * residual)
    unchanged = delta.clone()
    feedback_input(unchanged, feedback, 1.0, [0], [0], ["w"])
    assert torch.equal(unchanged, delta)


# ------------------------------------------------------------------ fragments and overlap over gloo
def worker_overlap(rank: int, world_size: int) -> dict:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    local = DiLoCo(model, optimizer, sync_every=4, fragments=2, overlap_steps=1, warmup_steps=2)
    merged_at, changed, previous = [], [], []
    for step in range(14):
        outer_before = local.outer_steps
        _step(model, optimizer, rank, step)
        if local.inner_steps == 2:  # the warm-up's end: θ is its result
            previous = [f.clone() for f in local.outer.global_flat]
        if local.outer_steps != outer_before:
            merged_at.append(local.inner_steps)
            changed.append([i for i, (a, b) in enumerate(zip(previous, local.outer.global_flat))
                            if not torch.equal(a, b)])
            previous = [f.clone() for f in local.outer.global_flat]
    return {"merged_at": merged_at, "changed": changed, "global": _global(local),
            "model": _digest(list(model.parameters()))}


@pytest.mark.timeout(120)
def test_overlap_merges_on_the_same_step_on_every_rank_and_fragments_take_turns() -> None:
    results = run_workers(worker_overlap, 3, timeout=90)
    # warm-up 2 steps; fragment 0 starts at local step 2 (inner 4) and merges one step later, ...
    assert results[0]["merged_at"] == [5, 7, 9, 11, 13]
    assert results[0]["changed"] == [[0], [1], [0], [1], [0]]
    assert len({(tuple(r["merged_at"]), r["global"]) for r in results}) == 1
    # the merge mixes each rank's own local progress back in: models differ, θ does not
    assert len({r["model"] for r in results}) == 3


# ------------------------------------------------------------------ failures
def worker_killed(rank: int, world_size: int, options: dict, victim: int, stamp_dir: str) -> dict:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    local = DiLoCo(model, optimizer, sync_every=3, collective_timeout=30.0, **options)
    for step in range(9):
        if rank == victim and step == 5:  # dies before the second sync's step
            Path(stamp_dir, "death").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        theta = _global(local)
        try:
            _step(model, optimizer, rank, step)
        except Exception as error:
            return {"raised_at": time.time(), "error": f"{type(error).__name__}: {error}"[:300], "step": step,
                    "outer_steps": local.outer_steps, "theta_unchanged": theta == _global(local)}
    return {"raised_at": None, "error": None, "step": None, "outer_steps": local.outer_steps}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("options", [{"compressor": "topk", "density": 0.1, "collective": "allgather"},
                                     {"quantize": "int8", "overlap_steps": 2}],
                         ids=["allgather", "int8-overlap"])
def test_a_killed_peer_during_a_sync_makes_every_survivor_raise_within_seconds(options: dict,
                                                                               tmp_path: Path) -> None:
    results, codes = run_workers_some_die(worker_killed, 3, options, 1, str(tmp_path), timeout=240, pg_timeout=60)
    died = float(Path(tmp_path, "death").read_text())
    assert codes[1] == -signal.SIGKILL
    expected_step = 7 if options.get("overlap_steps") else 5  # the step that ends the second sync
    for rank in (0, 2):
        ok, report = results[rank]
        assert ok, report
        assert report["error"] is not None and report["step"] == expected_step, report
        assert report["outer_steps"] == 1 and report["theta_unchanged"], report  # no outer step applied
        assert report["raised_at"] - died < 15, report


def worker_nonfinite(rank: int, world_size: int, policy: str) -> dict:
    model = _model(norm=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    local = DiLoCo(model, optimizer, sync_every=2, compressor="topk", density=0.2, collective="allgather",
                   nonfinite=policy)
    outcome: dict = {}
    for step in range(6):
        if rank == 1 and step == 3:  # a NaN weight on one rank: its Δ is not finite at the next sync
            with torch.no_grad():
                model[0].weight[0, 0] = float("nan")
        theta = _global(local)
        try:
            _step(model, optimizer, rank, step)
        except Exception as error:
            outcome = {"step": step, "error": type(error).__name__, "theta_unchanged": theta == _global(local)}
            break
    outcome.update(skipped=local.stats()["skipped_outer_steps"], outer=local.outer_steps, theta=_global(local),
                   finite=all(bool(torch.isfinite(p).all()) for p in model.parameters()))
    return outcome


@pytest.mark.timeout(200)
def test_a_nonfinite_delta_on_one_rank_raises_or_skips_on_every_rank() -> None:
    for outcome in run_workers(worker_nonfinite, 3, "raise", timeout=90):
        assert (outcome["step"], outcome["error"]) == (3, "NonFiniteGradientError"), outcome
        assert outcome["theta_unchanged"] and outcome["outer"] == 1, outcome
    outcomes = run_workers(worker_nonfinite, 3, "skip", timeout=90)
    assert [o["skipped"] for o in outcomes] == [1, 1, 1] and all(o["outer"] == 2 for o in outcomes)
    assert len({o["theta"] for o in outcomes}) == 1 and all(o["finite"] for o in outcomes)


def worker_undecodable(rank: int, world_size: int) -> dict:
    import gradwire.codecs as codec_layer

    model = _model(norm=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    local = DiLoCo(model, optimizer, sync_every=2, compressor="topk", density=0.2, collective="allgather",
                   index_codec="rice")
    honest = codec_layer.encode_tensors

    def tampered(*args, **kwargs):
        encoded = honest(*args, **kwargs)
        if rank == 1 and local.rounds == 1:  # the second sync's payload: one flipped byte
            payload = bytearray(encoded.payload)
            payload[len(payload) // 2] ^= 0x40
            return type(encoded)(bytes(payload), encoded.tensors)
        return encoded

    codec_layer.encode_tensors = tampered
    for step in range(6):
        theta = _global(local)
        try:
            _step(model, optimizer, rank, step)
        except Exception as error:
            return {"step": step, "error": f"{type(error).__name__}: {error}"[:200],
                    "theta_unchanged": theta == _global(local), "outer": local.outer_steps}
    return {"step": None}


@pytest.mark.timeout(120)
def test_an_undecodable_payload_makes_every_rank_raise_the_same_sync() -> None:
    for outcome in run_workers(worker_undecodable, 3, timeout=90):
        assert outcome["step"] == 3 and outcome["theta_unchanged"] and outcome["outer"] == 1, outcome
        assert "DecodeError" in outcome["error"] or "StepFailedError" in outcome["error"], outcome


# ------------------------------------------------------------------ checkpoints
def _roundtrip(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def worker_resume(rank: int, world_size: int, options: dict, stop: int) -> dict:
    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer, DiLoCo]:
        model = _model(seed=rank)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, optimizer, DiLoCo(model, optimizer, sync_every=4, warmup_steps=2, **options)

    model, optimizer, local = build()
    for step in range(14):
        _step(model, optimizer, rank, step)
    uninterrupted = (_global(local), _digest(list(model.parameters())), _digest(list(model.buffers())))
    local.close()
    model, optimizer, local = build()
    for step in range(stop):
        _step(model, optimizer, rank, step)
    saved = _roundtrip({"model": model.state_dict(), "diloco": local.state_dict()})
    local.close()
    model, optimizer, local = build()  # a fresh start, as after a restart
    model.load_state_dict(saved["model"])
    local.load_state_dict(saved["diloco"])
    for step in range(stop, 14):
        _step(model, optimizer, rank, step)
    resumed = (_global(local), _digest(list(model.parameters())), _digest(list(model.buffers())))
    return {"uninterrupted": uninterrupted, "resumed": resumed, "outer": local.outer_steps}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("options, stop", [
    ({"compressor": "topk", "density": 0.2, "collective": "allgather"}, 5),
    ({"quantize": "int8", "fragments": 2}, 7),
    ({"fragments": 2, "overlap_steps": 1}, 6),  # saved while fragment 1's exchange is in flight
    ({"fragments": 2, "overlap_steps": 1, "overlap_merge": "carry"}, 6),  # the same, with the start kept
], ids=["allgather-mid-period", "int8-fragments", "overlap-in-flight", "overlap-carry-in-flight"])
def test_a_checkpoint_mid_period_resumes_exactly(options: dict, stop: int) -> None:
    results = run_workers(worker_resume, 2, options, stop, timeout=150)
    for result in results:
        assert result["resumed"] == result["uninterrupted"], result
    assert results[0]["uninterrupted"][0] == results[1]["uninterrupted"][0]


def test_state_of_another_rank_or_options_is_refused() -> None:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    local = DiLoCo(model, optimizer, sync_every=2, compressor="topk", density=0.2, collective="allgather")
    for step in range(3):
        _step(model, optimizer, 0, step)
    state = _roundtrip(local.state_dict())
    other = DiLoCo(model, optimizer, sync_every=3, compressor="topk", density=0.2, collective="allgather")
    with pytest.raises(ValueError, match="saved with other options"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="belongs to rank 1"):
        local.load_state_dict({**state, "rank": 1})
    with pytest.raises(ValueError, match="not a gradwire DiLoCo state"):
        local.load_state_dict({"format": "gradwire.commhook/1"})


# ------------------------------------------------------------------ DDP inside the outer group
def worker_nodes(rank: int, world_size: int, unsent: str) -> dict:
    from gradwire.exchange.hierarchy import build_hierarchy

    hierarchy = build_hierarchy(2)  # 2 nodes x 2 ranks: DDP inside a node, DiLoCo across nodes
    model = DDP(_model(norm=False), process_group=hierarchy.intra)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    DiLoCo(model, optimizer, sync_every=1, outer_lr=1.0, outer_momentum=0.0, process_group=hierarchy.cross)
    reference = DDP(_model(norm=False))  # DDP over all four ranks
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    compressed = DDP(_model(norm=False), process_group=hierarchy.intra)
    compressed_optimizer = torch.optim.AdamW(compressed.parameters(), lr=1e-2)
    local = DiLoCo(compressed, compressed_optimizer, sync_every=2, compressor="topk", density=0.2,
                   collective="allgather", process_group=hierarchy.cross, unsent=unsent)
    for step in range(4):
        _step(model, optimizer, rank, step)
        _step(reference, reference_optimizer, rank, step)
        _step(compressed, compressed_optimizer, rank, step)
    return {"diloco": _plain(list(model.parameters())), "ddp": _plain(list(reference.module.parameters())),
            "compressed": _global(local), "compressed_model": _digest(list(compressed.parameters()))}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("unsent", ["residual", "model"])
def test_ddp_inside_the_outer_group_two_nodes_of_two_ranks(unsent: str) -> None:
    results = run_workers(worker_nodes, 4, unsent, timeout=120)
    for result in results:  # H = 1 DiLoCo across nodes over DDP inside them is DDP over all four ranks
        _close(result["diloco"], result["ddp"])
    assert len({r["compressed"] for r in results}) == 1  # the global parameters, on every rank
    if unsent == "residual":  # every rank restarts from them
        assert len({r["compressed_model"] for r in results}) == 1
    else:  # each node restarts from them minus its own unsent part: the same within a node, not across
        models = [r["compressed_model"] for r in results]
        assert models[0] == models[1] and models[2] == models[3] and models[0] != models[2]


# ------------------------------------------------------------------ the synchronous warm-up
def worker_warmup(rank: int, world_size: int) -> dict:
    model = _model(norm=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    local = DiLoCo(model, optimizer, sync_every=4, warmup_steps=3)
    reference = DDP(_model(norm=False))
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step in range(3):
        _step(model, optimizer, rank, step)
        _step(reference, reference_optimizer, rank, step)
    warm = _plain(list(model.parameters()))
    theta_is_model = _global(local) == _digest(list(model.parameters()))
    _step(model, optimizer, rank, 3)
    return {"warm": warm, "ddp": _plain(list(reference.module.parameters())),
            "theta_is_model": theta_is_model, "outer": local.outer_steps,
            "bytes_warmup": local.stats()["bytes_warmup"]}


@pytest.mark.timeout(120)
def test_warmup_steps_are_synchronous_then_theta_is_their_result() -> None:
    for result in run_workers(worker_warmup, 2, timeout=90):
        _close(result["warm"], result["ddp"])
        assert result["theta_is_model"] and result["outer"] == 0 and result["bytes_warmup"] > 0
