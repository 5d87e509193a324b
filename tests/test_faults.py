"""Failure behaviour on real gloo process groups: a dead peer, a corrupted or non-finite payload.

Every rank must raise (or skip) the same step, within seconds, and no rank may step on
unreduced or unagreed gradients. ``scripts/fault_trials.py`` repeats the kill test many times.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradwire

from .distributed import run_workers, run_workers_some_die, tamper_payload

pytestmark = pytest.mark.distributed

#: collective name -> hook options that exercise it
KILL_CASES = {
    "dense": {"compressor": "topk", "density": 0.05, "collective": "dense"},
    "allreduce": {"compressor": "randomblock", "density": 0.05, "collective": "allreduce"},
    "allgather": {"compressor": "topk", "density": 0.05, "collective": "allgather"},
    "auto": {"compressor": "topk", "density": 0.05, "collective": "auto"},
    "sparse-allreduce": {"compressor": "topk", "density": 0.05, "collective": "sparse-allreduce"},
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(16, 32, generator=generator), torch.randint(0, 4, (16,), generator=generator)


def worker_killed_peer(rank: int, world_size: int, options: dict, victim: int, death_step: int,
                       stamp_dir: str, typed: bool = False) -> dict:
    """Train; ``victim`` SIGKILLs itself at the start of ``death_step`` (after writing the time).
    Survivors report what they raised, when, and how many optimizer steps they took."""
    model = DDP(_model(), bucket_cap_mb=0.01)  # several buckets: failures mid-step
    state = gradwire.CommHookState(model=model, **options)
    model.register_comm_hook(state, gradwire.comm_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    steps_taken = 0
    for step in range(death_step + 50):
        if rank == victim and step == death_step:
            Path(stamp_dir, "death").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        optimizer.zero_grad()
        inputs, targets = _batch(rank, step)
        try:
            with state.typed_errors() if typed else contextlib.nullcontext():
                torch.nn.functional.cross_entropy(model(inputs), targets).backward()
        except Exception as error:  # DDP re-raises the hook's error from backward (as RuntimeError)
            return {"raised_at": time.time(), "error": f"{type(error).__name__}: {error}", "steps": steps_taken,
                    "step": step, "collective_error": isinstance(error, gradwire.CollectiveError)}
        optimizer.step()
        steps_taken += 1
    return {"raised_at": None, "error": None, "steps": steps_taken, "step": None}


def kill_trial(case: str, world_size: int = 3, victim: int = 1, death_step: int = 3,
               tmp: Path | None = None, typed: bool = False) -> list[dict]:
    """One trial: per survivor, its report plus ``seconds_after_death``."""
    import tempfile

    with tempfile.TemporaryDirectory(dir=tmp) as stamp_dir:
        results, exit_codes = run_workers_some_die(worker_killed_peer, world_size, KILL_CASES[case], victim,
                                                   death_step, stamp_dir, typed, timeout=240, pg_timeout=60)
        died_at = float(Path(stamp_dir, "death").read_text())
    assert exit_codes[victim] == -signal.SIGKILL, exit_codes
    reports = []
    for rank in range(world_size):
        if rank == victim:
            continue
        ok, report = results.get(rank, (False, "no report"))
        assert ok, f"rank {rank}: {report}"
        report["rank"] = rank
        report["seconds_after_death"] = report["raised_at"] - died_at if report["raised_at"] else None
        reports.append(report)
    return reports


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", sorted(KILL_CASES))
def test_every_survivor_raises_within_seconds_when_a_peer_dies(case: str, tmp_path: Path) -> None:
    for report in kill_trial(case, tmp=tmp_path):
        assert report["error"] is not None, f"rank {report['rank']} trained on: {report}"
        assert report["step"] == 3 and report["steps"] == 3, report  # no optimizer step after the death
        assert report["seconds_after_death"] < 10, report


class _Tamper:
    """Makes rank ``rank``'s encoder send a payload other than the one it reconstructs for itself."""

    def __init__(self, rank: int, step_of, mode: str) -> None:
        self.rank, self.step_of, self.mode = rank, step_of, mode

    def install(self, my_rank: int) -> None:
        import gradwire.codecs as codec_layer

        honest = codec_layer.encode_tensors
        tamper = self

        def encode(tensors, *args, **kwargs):
            encoded = honest(tensors, *args, **kwargs)
            if my_rank != tamper.rank or tamper.step_of() != 1:
                return encoded
            if tamper.mode == "encoder":  # a codec bug on one rank: it must not leave its peers waiting
                raise RuntimeError("encoder failed (test)")
            return tamper_payload(tamper.mode, encoded, tensors, honest, *args, **kwargs)

        codec_layer.encode_tensors = encode


def worker_tampered(rank: int, world_size: int, mode: str, policy: str, collective: str = "allgather",
                    typed: bool = False) -> dict:
    model = DDP(_model())
    state = gradwire.CommHookState(compressor="topk", density=0.1, collective=collective, nonfinite=policy,
                                   model=model)
    model.register_comm_hook(state, gradwire.comm_hook)
    _Tamper(1, lambda: state.iteration, mode).install(rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    outcome = {}
    for step in range(3):
        optimizer.zero_grad()
        inputs, targets = _batch(rank, step)
        before = {key: value.clone() for key, value in state.feedback.residuals.items()}
        try:
            with state.typed_errors() if typed else contextlib.nullcontext():
                torch.nn.functional.cross_entropy(model(inputs), targets).backward()
        except Exception as error:
            outcome = {"step": step, "error": type(error).__name__ + ": " + str(error)[:300],
                       "type": type(error).__name__}
            unchanged = all(torch.equal(state.feedback.residuals[k], v) for k, v in before.items())
            outcome["residuals_unchanged"] = unchanged and state.feedback.residuals.keys() == before.keys()
            break
        optimizer.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    outcome["parameters"] = hashlib.sha256(flat.numpy().tobytes()).hexdigest()
    outcome["skipped"] = state.stats()["skipped_steps"]
    return outcome


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode, expected", [("checksum", r"checksum mismatch|step 1 failed on rank\(s\) \[0, 2\]"),
                                            ("value", "averaged gradients differ between ranks"),
                                            ("nan", "NaN or Inf in gradients at step 1")])
def test_a_tampered_payload_fails_the_same_step_on_every_rank(mode: str, expected: str) -> None:
    import re

    outcomes = run_workers(worker_tampered, 3, mode, "raise", timeout=240)
    for rank, outcome in enumerate(outcomes):
        assert outcome.get("step") == 1, (rank, outcome)
        assert re.search(expected, outcome["error"]), (rank, outcome["error"])  # DDP re-wraps the type
        assert outcome["residuals_unchanged"], rank
    assert len({o["parameters"] for o in outcomes}) == 1


def test_a_nonfinite_payload_is_skipped_on_every_rank() -> None:
    outcomes = run_workers(worker_tampered, 2, "nan", "skip", timeout=120)
    assert [o["skipped"] for o in outcomes] == [1, 1]
    assert all("step" not in o for o in outcomes), outcomes
    assert outcomes[0]["parameters"] == outcomes[1]["parameters"]


def worker_one_rank_without_hook(rank: int, world_size: int) -> dict:
    model = DDP(_model())
    if rank == 0:
        model.register_comm_hook(gradwire.CommHookState(compressor="topk", density=0.1, collective_timeout=5.0,
                                                        model=model), gradwire.comm_hook)
    inputs, targets = _batch(rank, 0)
    started = time.time()
    try:
        torch.nn.functional.cross_entropy(model(inputs), targets).backward()
    except Exception as error:
        return {"error": str(error)[:400], "seconds": time.time() - started}
    return {"error": None, "seconds": time.time() - started}


def test_a_rank_without_the_hook_is_reported_in_seconds() -> None:
    results, _ = run_workers_some_die(worker_one_rank_without_hook, 2, timeout=120, pg_timeout=12)
    ok, report = results[0]
    assert ok, report
    assert report["error"] is not None and report["seconds"] < 20, report
    assert ("without the gradwire hook" in report["error"] or "configuration differs" in report["error"]), report


def worker_stuck_peer(rank: int, world_size: int, collective: str) -> dict:
    """Rank 1 stops calling for 12 s at step 2 (alive, connections open); rank 0 must give up
    after about ``collective_timeout`` seconds a round, not the process group's timeout."""
    model = DDP(_model(), bucket_cap_mb=0.01)
    model.register_comm_hook(gradwire.CommHookState(model=model, compressor="topk", density=0.05,
                                                    collective=collective, collective_timeout=2.0), gradwire.comm_hook)
    for step in range(4):
        if rank == 1 and step == 2:
            time.sleep(12)
        inputs, targets = _batch(rank, step)
        started = time.time()
        try:
            torch.nn.functional.cross_entropy(model(inputs), targets).backward()
        except Exception as error:
            return {"step": step, "error": str(error)[:600], "seconds": time.time() - started}
    return {"step": None, "error": None, "seconds": None}


@pytest.mark.timeout(200)
def test_a_stuck_peer_fails_the_step_after_the_collective_timeout() -> None:
    """The sparse AllReduce's blocking rounds (the AllGather's are bounded by the step's end)."""
    results, _ = run_workers_some_die(worker_stuck_peer, 2, "sparse-allreduce", timeout=150, pg_timeout=60)
    ok, report = results[0]
    assert ok, report
    assert report["step"] == 2 and report["error"] is not None, report
    # 2 s per blocking round (a bucket's first round, the step-end agreement), not the group's 60 s;
    # without the limit step 2 would wait for the sleeper and succeed
    assert report["seconds"] < 10, report


@pytest.mark.timeout(300)
@pytest.mark.parametrize("collective", ["allgather", "sparse-allreduce"])
def test_an_encoder_error_on_one_rank_fails_the_step_everywhere(collective: str) -> None:
    outcomes = run_workers(worker_tampered, 3, "encoder", "raise", collective, timeout=240)
    for rank, outcome in enumerate(outcomes):
        assert outcome.get("step") == 1, (rank, outcome)
        assert "encoder failed (test)" in outcome["error"] or "failed on rank(s) [1]" in outcome["error"] \
            or "could not decode" in outcome["error"], (rank, outcome["error"])
        assert outcome["residuals_unchanged"], rank
    assert len({o["parameters"] for o in outcomes}) == 1


# ------------------------------------------------------------------ typed errors reach the caller
@pytest.mark.timeout(200)
@pytest.mark.parametrize("mode, expected", [("nan", "NonFiniteGradientError"), ("value", "DivergenceError")])
def test_typed_errors_reach_the_caller_around_backward(mode: str, expected: str) -> None:
    """DDP's reducer re-raises a hook's error as RuntimeError; ``state.typed_errors()`` around
    backward gives the caller gradwire's own type, on every rank, so ``except gradwire.X`` works."""
    outcomes = run_workers(worker_tampered, 2, mode, "raise", "allgather", True, timeout=150)
    for rank, outcome in enumerate(outcomes):
        assert outcome.get("step") == 1 and outcome["type"] == expected, (rank, outcome)
        assert outcome["residuals_unchanged"], rank


@pytest.mark.timeout(300)
def test_a_dead_peer_reaches_the_caller_as_a_collective_error(tmp_path: Path) -> None:
    for report in kill_trial("allgather", tmp=tmp_path, typed=True):
        assert report["collective_error"], report
        assert report["step"] == 3 and report["steps"] == 3, report


def worker_raise_if_failed(rank: int, world_size: int) -> dict:
    """Without the context manager: DDP's RuntimeError, then ``raise_if_failed`` gives the type."""
    model = DDP(_model())
    state = gradwire.CommHookState(compressor="topk", density=0.1, collective="allgather", model=model)
    model.register_comm_hook(state, gradwire.comm_hook)
    inputs, targets = _batch(rank, 0)
    loss = torch.nn.functional.cross_entropy(model(inputs), targets) * (float("nan") if rank == 1 else 1.0)
    try:
        loss.backward()
    except RuntimeError as error:
        wrapped = type(error).__name__
    try:
        state.raise_if_failed()
    except gradwire.NonFiniteGradientError:
        return {"wrapped": wrapped, "typed": True, "again": _raises(state.raise_if_failed)}
    return {"wrapped": wrapped, "typed": False}


def _raises(call) -> bool:
    try:
        call()
    except Exception:
        return True
    return False


def test_raise_if_failed_gives_the_typed_error_once() -> None:
    for result in run_workers(worker_raise_if_failed, 2, timeout=90):
        assert result == {"wrapped": "RuntimeError", "typed": True, "again": False}, result


def test_the_ddp_hook_refuses_fsdp_models_in_one_line() -> None:
    from torch.distributed.fsdp import FSDPModule

    layer = torch.nn.Linear(4, 4)
    layer.__class__ = type("FSDPLinear", (FSDPModule, torch.nn.Linear), {})  # what fully_shard does to a module
    model = torch.nn.Sequential(layer)
    import gradwire.integrations.accelerate as accelerate_helper

    for make in (lambda: gradwire.CommHookState(model=model), lambda: gradwire.GradientExchange(model),
                 lambda: accelerate_helper.register(None, model)):
        with pytest.raises(ValueError, match="use gradwire.fsdp.compress"):
            make()
    with pytest.raises(TypeError, match="use gradwire.fsdp.compress"):
        gradwire.comm_hook(gradwire.CommHookState(), torch.zeros(3), torch.zeros(3))  # FSDP1's call
