"""The hook's per-rank state dict: whose state it is, checks on load, and the gathered form."""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import gradwire

from .distributed import run_workers


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def _steps(model: torch.nn.Module, rank: int, steps: int) -> None:
    for step in range(steps):
        generator = torch.Generator().manual_seed(100 * rank + step)
        inputs = torch.randn(6, 12, generator=generator)
        model.zero_grad()
        model(inputs).square().sum().backward()


def _trained_state(options: dict | None = None) -> tuple[torch.nn.Module, gradwire.GradientExchange]:
    """World size 1 without a process group: the hook runs as one rank."""
    model = _model()
    exchange = gradwire.GradientExchange(model, **(options or {"compressor": "topk", "density": 0.1,
                                                               "collective": "allgather"}))
    for step in range(2):
        _steps(model, 0, 1)
        exchange.synchronize()
    return model, exchange


def _roundtrip(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_state_dict_records_whose_state_it_is_and_roundtrips_through_weights_only_load() -> None:
    model, state = _trained_state()
    saved = _roundtrip(state.state_dict())
    assert (saved["rank"], saved["world_size"], saved["iteration"]) == (0, 1, 2)
    assert saved["residuals"] and len(saved["config_hash"]) == 16
    fresh = gradwire.CommHookState(model=model, compressor="topk", density=0.1, collective="allgather")
    fresh.load_state_dict(saved)
    assert fresh.iteration == 2
    assert fresh.stats()["residual_norm"] == pytest.approx(state.stats()["residual_norm"])


def _load_error(state: gradwire.CommHookState, saved: dict) -> str:
    with pytest.raises(ValueError) as error:
        state.load_state_dict(saved)
    return str(error.value)


@pytest.mark.parametrize("change, message", [
    (lambda s: s.update(rank=1), "belongs to rank 1, this is rank 0"),
    (lambda s: s.update(world_size=4), "world size 4, this job has 1"),
    (lambda s: s.pop("format"), "not a gradwire hook state"),
    (lambda s: s.pop("residuals"), "lacks 'residuals'"),
    (lambda s: s.update(iteration="3"), "'iteration' must be an integer"),
    (lambda s: s["residuals"].update({"nope.weight": torch.zeros(3)}), "parameters this model lacks: nope.weight"),
    (lambda s: s["residuals"].update({"0.weight": torch.zeros(1)}), "has shape (1,), expected (96,)"),
    (lambda s: s["residuals"].update({"0.weight": torch.zeros(8, 12)}), "has shape (8, 12), expected (96,)"),
    (lambda s: s["residuals"].update({"0.weight": torch.zeros(96, dtype=torch.float16)}), "expected torch.float32"),
    (lambda s: s["residuals"].update({"0.weight": torch.full((96,), float("nan"))}), "holds NaN or Inf"),
    (lambda s: s["residuals"].update({"0.weight": [0.0] * 96}), "is a list, not a tensor"),
])
def test_load_refuses_bad_state_with_one_clear_error(change, message) -> None:
    model, state = _trained_state()
    saved = state.state_dict()
    before = {k: v.clone() for k, v in state.feedback.residuals.items()}
    change(saved)
    assert message in _load_error(state, saved)
    # nothing was changed by the refused load
    assert all(torch.equal(before[k], v) for k, v in state.feedback.residuals.items())


def test_load_refuses_other_options() -> None:
    model, state = _trained_state()
    other = gradwire.CommHookState(model=model, compressor="topk", density=0.2, collective="allgather")
    error = _load_error(other, state.state_dict())
    assert "other options" in error and "density=0.1" in error


def test_momentum_correction_state_needs_velocities() -> None:
    options = {"compressor": "topk", "density": 0.1, "momentum_correction": 0.9, "collective": "allgather"}
    model, state = _trained_state(options)
    saved = _roundtrip(state.state_dict())
    assert saved["velocities"]
    gradwire.CommHookState(model=model, **options).load_state_dict(saved)
    saved.pop("velocities")
    assert "lacks 'velocities'" in _load_error(gradwire.CommHookState(model=model, **options), saved)


def worker_gather(rank: int, world_size: int) -> dict:
    model = DDP(_model())
    options = {"compressor": "topk", "density": 0.1, "collective": "allgather"}
    state = gradwire.CommHookState(model=model, **options)
    model.register_comm_hook(state, gradwire.comm_hook)
    _steps(model, rank, 3)
    own = state.state_dict()
    gathered = _roundtrip(state.state_dict(gather=True))
    # "every rank loads rank 0's file": broadcast rank 0's dict as raw bytes of a tensor-only save
    buffer = io.BytesIO()
    torch.save(gathered, buffer)
    data = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8) if rank == 0 else None
    size = torch.tensor([data.numel() if rank == 0 else 0])
    dist.broadcast(size, 0)
    received = data if rank == 0 else torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(received, 0)
    from_rank0 = torch.load(io.BytesIO(received.numpy().tobytes()), weights_only=True)

    fresh_model = DDP(_model())
    fresh = gradwire.CommHookState(model=fresh_model, **options)
    fresh.load_state_dict(from_rank0)
    same = all(torch.equal(fresh.feedback.residuals[id(p)], state.feedback.residuals[id(q)])
               for p, q in zip(fresh_model.parameters(), model.parameters()) if id(q) in state.feedback.residuals)
    errors = {}
    for label, bad in (("own-of-other", {**own, "rank": 1 - rank}), ("non-root-gather", gathered)):
        try:
            fresh.load_state_dict(bad)
        except ValueError as error:
            errors[label] = str(error)
    return {"same": same, "ranks_held": len(gathered["ranks"]), "norm": state.stats()["residual_norm"],
            "restored_norm": fresh.stats()["residual_norm"], "errors": errors}


def test_gathered_state_gives_each_rank_its_own_residuals() -> None:
    results = run_workers(worker_gather, 2, timeout=90)
    assert [r["ranks_held"] for r in results] == [2, 1]
    assert results[0]["norm"] != results[1]["norm"]  # the ranks really hold different residuals
    for r in results:
        assert r["same"] and r["restored_norm"] == r["norm"]
        assert "belongs to rank" in r["errors"]["own-of-other"]
        assert "non-root-gather" not in r["errors"]  # each rank's own gathered dict holds its own entry


def test_gathered_dict_without_this_rank_says_which_file_to_save() -> None:
    model, state = _trained_state()
    saved = state.state_dict(gather=True)
    saved["ranks"][0]["rank"] = 1  # as rank 1's return value would be
    assert "holds ranks [1], not rank 0: save the dict" in _load_error(state, saved)
