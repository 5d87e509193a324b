"""The DDP hook on real gloo process groups (2 and 3 ranks).

Each worker runs many configurations in one spawn (spawning costs seconds); results come back
by rank and the test compares them across ranks and against DDP's own AllReduce.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import gradwire

from .distributed import run_workers

pytestmark = pytest.mark.distributed

COMPRESSORS = ["topk", "sampled-topk", "randomk", "randomblock", "threshold"]


def _model(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
        torch.nn.Linear(4 * 6 * 6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3),
    ).to(dtype)


def _batch(rank: int, step: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 1, 8, 8, generator=generator).to(dtype), torch.randint(0, 3, (8,), generator=generator)


def _amount(compressor: str, full: bool) -> dict:
    if compressor == "threshold":
        return {"threshold": 1e-30 if full else 1e-2}
    return {"density": 1.0 if full else 0.1}


def _grads_after_one_step(rank: int, options: dict | None, dtype: torch.dtype = torch.float32,
                          bucket_cap_mb: float = 25.0) -> list[torch.Tensor]:
    model = DDP(_model(dtype=dtype), bucket_cap_mb=bucket_cap_mb)
    if options is not None:
        model.register_comm_hook(gradwire.CommHookState(model=model, **options), gradwire.comm_hook)
    inputs, targets = _batch(rank, 0, dtype)
    torch.nn.functional.cross_entropy(model(inputs).float(), targets).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def _digest(model: torch.nn.Module) -> str:
    hasher = hashlib.sha256()
    for parameter in model.parameters():
        hasher.update(parameter.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()


def _train(rank: int, options: dict, steps: int, bucket_cap_mb: float = 0.001,
           accumulate: bool = False) -> tuple[str, dict]:
    model = DDP(_model(), bucket_cap_mb=bucket_cap_mb)  # tiny buckets: several per step, rebuilt after step 1
    state = gradwire.CommHookState(model=model, **options)
    model.register_comm_hook(state, gradwire.comm_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        optimizer.zero_grad()
        if accumulate:
            with model.no_sync():
                inputs, targets = _batch(rank, 100 + step)
                torch.nn.functional.cross_entropy(model(inputs), targets).backward()
        inputs, targets = _batch(rank, step)
        torch.nn.functional.cross_entropy(model(inputs), targets).backward()
        optimizer.step()
    return _digest(model), state.stats()


def worker_density_one(rank: int, world_size: int) -> dict:
    reference = _grads_after_one_step(rank, None)
    out = {}
    for compressor in COMPRESSORS:
        for collective in ("auto", "allgather") + (("allreduce",) if compressor.startswith("random") else ()):
            options = {"compressor": compressor, "collective": collective, **_amount(compressor, True)}
            grads = _grads_after_one_step(rank, options, bucket_cap_mb=0.001)
            out[(compressor, collective)] = max(float((g - r).abs().max()) for g, r in zip(grads, reference))
    grads = _grads_after_one_step(rank, {"compressor": "topk", "density": 1.0, "scope": "global"})
    out[("topk", "global")] = max(float((g - r).abs().max()) for g, r in zip(grads, reference))
    bf16_reference = _grads_after_one_step(rank, None, dtype=torch.bfloat16)
    grads = _grads_after_one_step(rank, {"compressor": "topk", "density": 1.0, "collective": "allgather"},
                                  dtype=torch.bfloat16)
    out[("topk", "bf16")] = max(float((g.float() - r.float()).abs().max()) for g, r in zip(grads, bf16_reference))
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_density_one_equals_ddp_allreduce(world_size: int) -> None:
    results = run_workers(worker_density_one, world_size, timeout=180)
    for rank_result in results:
        for config, error in rank_result.items():
            tolerance = 2e-2 if config[1] == "bf16" else 1e-6
            assert error <= tolerance, f"{config}: max |hook - DDP| = {error}"


def worker_training(rank: int, world_size: int) -> dict:
    out = {}
    for compressor in COMPRESSORS:
        for collective in ("auto", "allgather") + (("allreduce",) if compressor.startswith("random") else ()):
            options = {"compressor": compressor, "collective": collective, **_amount(compressor, False),
                       "index_codec": "raw", "value_codec": "fp16"}
            out[(compressor, collective)] = _train(rank, options, steps=4)[0]
    out[("topk", "global")] = _train(rank, {"compressor": "topk", "density": 0.05, "scope": "global"}, steps=4)[0]
    out[("topk", "no_sync")] = _train(rank, {"compressor": "topk", "density": 0.1}, steps=3, accumulate=True)[0]
    out[("topk", "dgc")] = _train(rank, {"compressor": "topk", "density": 0.1, "momentum_correction": 0.9}, steps=3)[0]
    out[("randomk", "warmup")] = _train(rank, {"compressor": "randomk", "density": 0.1, "warmup_steps": 2}, steps=4)[0]
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_parameters_identical_on_all_ranks_after_training(world_size: int) -> None:
    results = run_workers(worker_training, world_size, timeout=240)
    for config in results[0]:
        digests = {rank_result[config] for rank_result in results}
        assert len(digests) == 1, f"{config}: ranks diverged"
    # and the runs differ from each other, so the digest really reflects training
    assert results[0][("topk", "auto")] != results[0][("randomk", "auto")]


def worker_stats(rank: int, world_size: int) -> dict:
    _, sparse = _train(rank, {"compressor": "topk", "density": 0.01, "index_codec": "rice", "value_codec": "fp16"},
                       steps=2, bucket_cap_mb=25)
    _, full = _train(rank, {"compressor": "topk", "density": 1.0}, steps=2, bucket_cap_mb=25)
    return {"sparse": sparse, "full": full}


def test_stats_and_auto_collective() -> None:
    sparse, full = run_workers(worker_stats, 2, timeout=120)[0].values()
    assert sparse["step"] == 2
    assert 0 < sparse["bytes_sent"] < sparse["bytes_dense"] / 5
    assert sparse["compression_ratio"] > 5
    assert sparse.get("count_allgather_buckets", 0) >= 2
    # at density 1.0 the payload is larger than the dense AllReduce: auto must fall back
    assert full.get("count_dense_buckets", 0) >= 2 and full.get("count_allgather_buckets", 0) == 0
    assert full["bytes_sent"] <= full["bytes_dense"] + 64


def worker_mismatch(rank: int, world_size: int) -> None:
    model = DDP(_model())
    state = gradwire.CommHookState(compressor="topk", density=0.01 if rank == 0 else 0.02)
    model.register_comm_hook(state, gradwire.comm_hook)
    inputs, targets = _batch(rank, 0)
    torch.nn.functional.cross_entropy(model(inputs), targets).backward()


def test_config_mismatch_fails_fast() -> None:
    with pytest.raises(AssertionError, match="configuration differs between ranks"):
        run_workers(worker_mismatch, 2, timeout=60, pg_timeout=10)


def worker_nonfinite(rank: int, world_size: int, policy: str, nan_step: int) -> list[float]:
    """NaN on rank 1 at ``nan_step``: step 0 is the first (lengths exchanged first), later steps
    use the one-round frames."""
    model = DDP(_model())
    state = gradwire.CommHookState(compressor="topk", density=0.5, nonfinite=policy, model=model)
    model.register_comm_hook(state, gradwire.comm_hook)
    before: dict = {}
    for step in range(nan_step + 1):
        model.zero_grad()
        inputs, targets = _batch(rank, step)
        if rank == 1 and step == nan_step:
            inputs[0, 0, 0, 0] = float("nan")
        if step == nan_step:
            before = {key: value.clone() for key, value in state.feedback.residuals.items()}
        try:
            torch.nn.functional.cross_entropy(model(inputs), targets).backward()
        except Exception as error:  # DDP wraps errors raised inside the hook
            assert step == nan_step and "NaN or Inf" in str(error), str(error)
            return [-1.0]
    # skipped: every rank's memory is as it was before the step
    assert state.feedback.residuals.keys() == before.keys()
    assert all(torch.equal(state.feedback.residuals[key], value) for key, value in before.items())
    return [float(p.grad.abs().sum()) for p in model.parameters()]


@pytest.mark.parametrize("nan_step", [0, 2])
@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_nonfinite_gradients(policy: str, nan_step: int) -> None:
    results = run_workers(worker_nonfinite, 2, policy, nan_step, timeout=60, pg_timeout=10)
    if policy == "raise":
        assert results == [[-1.0], [-1.0]]
    else:
        assert all(total == 0.0 for rank_result in results for total in rank_result)


def worker_raw_dense(rank: int, world_size: int, policy: str, native_on_rank_1: bool) -> list[float]:
    """Warm-up (raw dense) steps: the sum is checked where it lands, not the input. A NaN on rank 1
    at step 2; rank 1 may run without the kernels (the digest's numpy twin must agree with them)."""
    import os

    from gradwire import kernels

    if rank == 1 and not native_on_rank_1:
        os.environ["GRADWIRE_NATIVE"] = "0"
        kernels._tried, kernels._compiled = False, None
    model = DDP(_model())
    state = gradwire.CommHookState(compressor="topk", density=0.5, warmup_steps=10, nonfinite=policy, model=model)
    model.register_comm_hook(state, gradwire.comm_hook)
    reference = DDP(_model())  # DDP's own AllReduce of the same batches
    for step in range(3):
        model.zero_grad()
        reference.zero_grad()
        inputs, targets = _batch(rank, step)
        torch.nn.functional.cross_entropy(reference(inputs), targets).backward()
        if rank == 1 and step == 2:
            inputs[0, 0, 0, 0] = float("nan")
        try:
            torch.nn.functional.cross_entropy(model(inputs), targets).backward()
        except Exception as error:  # DDP wraps errors raised inside the hook
            assert step == 2 and "NaN or Inf" in str(error), str(error)
            return [-1.0]
        if step < 2:
            for mine, theirs in zip(model.parameters(), reference.parameters()):
                assert torch.equal(mine.grad, theirs.grad)
    assert state.stats()["count_dense_buckets"] > 0
    return [float(p.grad.abs().sum()) for p in model.parameters()]


@pytest.mark.parametrize("policy, native_on_rank_1", [("raise", True), ("skip", True), ("skip", False)],
                         ids=["raise", "skip", "skip-rank-1-without-kernels"])
def test_a_raw_dense_step_checks_its_sum_and_every_rank_agrees(policy: str, native_on_rank_1: bool) -> None:
    results = run_workers(worker_raw_dense, 2, policy, native_on_rank_1, timeout=60, pg_timeout=10)
    if policy == "raise":
        assert results == [[-1.0], [-1.0]]
    else:
        assert all(total == 0.0 for rank_result in results for total in rank_result)


def worker_checkpoint(rank: int, world_size: int) -> tuple[str, str]:
    options = {"compressor": "topk", "density": 0.05, "momentum_correction": 0.9}

    def run(model: DDP, state, optimizer, steps: range) -> None:
        for step in steps:
            optimizer.zero_grad()
            inputs, targets = _batch(rank, step)
            torch.nn.functional.cross_entropy(model(inputs), targets).backward()
            optimizer.step()

    model = DDP(_model())
    state = gradwire.CommHookState(model=model, **options)
    model.register_comm_hook(state, gradwire.comm_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run(model, state, optimizer, range(3))
    checkpoint = {"model": {k: v.clone() for k, v in model.state_dict().items()}, "hook": state.state_dict()}
    run(model, state, optimizer, range(3, 6))
    straight = _digest(model)

    restored = DDP(_model(seed=99))
    restored.load_state_dict(checkpoint["model"])
    restored_state = gradwire.CommHookState(model=restored, **options)
    restored_state.load_state_dict(checkpoint["hook"])
    restored.register_comm_hook(restored_state, gradwire.comm_hook)
    run(restored, restored_state, torch.optim.SGD(restored.parameters(), lr=0.1), range(3, 6))
    return straight, _digest(restored)


def test_checkpoint_restore_continues_identically() -> None:
    for straight, restored in run_workers(worker_checkpoint, 2, timeout=90):
        assert straight == restored


def worker_plain(rank: int, world_size: int) -> float:
    """Error feedback telescopes: sum of received gradients + final residual == sum of gradients."""
    model = _model(dtype=torch.float64)
    exchange = gradwire.GradientExchange(model, compressor="topk", density=0.1, value_codec="fp32",
                                         bucket_cap_mb=0.001)
    received = [torch.zeros_like(p) for p in model.parameters()]
    total_local = [torch.zeros_like(p) for p in model.parameters()]
    for step in range(4):
        model.zero_grad()
        inputs, targets = _batch(rank, step, torch.float64)
        torch.nn.functional.cross_entropy(model(inputs), targets).backward()
        gathered = []
        for parameter, local in zip(model.parameters(), total_local):
            grad = parameter.grad.clone()
            all_grads = [torch.empty_like(grad) for _ in range(world_size)]
            dist.all_gather(all_grads, grad)
            local += sum(all_grads) / world_size
            gathered.append(grad)
        exchange.synchronize()
        for parameter, acc in zip(model.parameters(), received):
            acc += parameter.grad
    # with averaging, residuals of all ranks together carry what was not sent
    residual_sum = []
    for parameter in model.parameters():
        # a parameter whose bucket went dense (auto: tiny tensors) has no residual left
        residual = exchange.feedback.residuals.get(id(parameter), torch.zeros(parameter.numel(), dtype=torch.float64))
        residual = residual.reshape(parameter.shape).clone()
        dist.all_reduce(residual)
        residual_sum.append(residual / world_size)
    return max(float((r + res - t).abs().max()) for r, res, t in zip(received, residual_sum, total_local))


def test_error_feedback_telescopes_in_plain_api() -> None:
    for error in run_workers(worker_plain, 2, timeout=90):
        assert error < 1e-12


def worker_frames(rank: int, world_size: int) -> tuple[float, dict]:
    """Payload sizes that jump between steps, differently per rank: after step 0 the payloads
    travel in frames sized from earlier steps, so a jump overflows them and needs a second
    round. Error feedback must still telescope exactly (float64, lossless codecs)."""
    model = _model(dtype=torch.float64)
    exchange = gradwire.GradientExchange(model, compressor="threshold", threshold=1e-3, value_codec="fp32",
                                         index_codec="delta-varint", collective="allgather", bucket_cap_mb=0.001)
    scales = [1e-2, 1.0, 1e-2, 1.0, 30.0, 1.0] if rank == 1 else [1e-2, 1e-2, 1.0, 1.0, 1.0, 30.0]
    received = [torch.zeros_like(p) for p in model.parameters()]
    total = [torch.zeros_like(p) for p in model.parameters()]
    for step, scale in enumerate(scales):
        model.zero_grad()
        inputs, targets = _batch(rank, step, torch.float64)
        (scale * torch.nn.functional.cross_entropy(model(inputs), targets)).backward()
        for parameter, accumulated in zip(model.parameters(), total):
            every = [torch.empty_like(parameter.grad) for _ in range(world_size)]
            dist.all_gather(every, parameter.grad.clone())
            accumulated += sum(every) / world_size
        exchange.synchronize()
        for parameter, accumulated in zip(model.parameters(), received):
            accumulated += parameter.grad
    error = 0.0
    for parameter, got, want in zip(model.parameters(), received, total):
        residual = exchange.feedback.residuals[id(parameter)].reshape(parameter.shape).clone()
        dist.all_reduce(residual)
        error = max(error, float((got + residual / world_size - want).abs().max()))
    return error, exchange.stats()


def test_frames_overflow_and_error_feedback_stays_exact() -> None:
    for error, stats in run_workers(worker_frames, 2, timeout=90):
        assert error < 1e-12
        assert stats["step"] == 6
        assert stats.get("count_frame_overflows", 0) >= 1, stats


class _LyingBytes(bytes):
    """A payload whose announced length is absurd: what a broken or hostile peer might send."""

    def __len__(self) -> int:
        return 1 << 40


def worker_lying_length(rank: int, world_size: int, lie_step: int) -> str:
    import gradwire.codecs as codec_layer

    model = _model()
    exchange = gradwire.GradientExchange(model, compressor="topk", density=0.2, bucket_cap_mb=25)
    honest = codec_layer.encode_tensors

    def encode(*args, **kwargs):
        encoded = honest(*args, **kwargs)
        if rank == 1 and exchange.iteration == lie_step:
            encoded = type(encoded)(_LyingBytes(encoded.payload), encoded.tensors)
        return encoded

    codec_layer.encode_tensors = encode
    try:
        for step in range(lie_step + 1):
            model.zero_grad()
            inputs, targets = _batch(rank, step)
            torch.nn.functional.cross_entropy(model(inputs), targets).backward()
            exchange.synchronize()
    except gradwire.DecodeError as error:
        return f"{exchange.iteration}: {error}"
    finally:
        codec_layer.encode_tensors = honest
    return "no error"


@pytest.mark.parametrize("lie_step", [0, 2])
def test_absurd_announced_length_is_refused_on_every_rank(lie_step: int) -> None:
    """Step 0 announces lengths in a round of their own, later steps inside the frames: either
    way every rank refuses before allocating anything for the announced size."""
    for message in run_workers(worker_lying_length, 2, lie_step, timeout=60, pg_timeout=10):
        assert "announced a payload of 1099511627776 bytes" in message, message


def worker_counts(rank: int, world_size: int) -> dict:
    out = {}
    for name, options in (("allgather", {"compressor": "topk", "density": 0.1, "collective": "allgather"}),
                          ("sparse-allreduce", {"compressor": "topk", "density": 0.1,
                                                "collective": "sparse-allreduce"}),
                          ("shared-support", {"compressor": "randomk", "density": 0.1, "collective": "allreduce"}),
                          ("global", {"compressor": "topk", "density": 0.1, "scope": "global",
                                      "collective": "allgather"}),
                          ("momentum", {"compressor": "topk", "density": 0.1, "collective": "allgather",
                                        "momentum_correction": 0.9})):
        _, stats = _train(rank, options, 4)
        out[name] = (stats.get("count_selections"), stats.get("count_compensations"))
    return out


@pytest.mark.timeout(180)
def test_every_entry_is_compensated_and_selected_exactly_once_per_step() -> None:
    # the wave-2 hook selected twice per finite per-rank bucket (and compensated twice); the core counts
    # both per entry (one entry per parameter), so 4 steps of a 6-parameter model give 24 of each
    for counts in run_workers(worker_counts, 2, timeout=150):
        for name, (selections, compensations) in counts.items():
            assert (selections, compensations) == (24, 24), (name, selections, compensations)
