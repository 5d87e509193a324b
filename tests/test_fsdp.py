"""gradwire.fsdp on real gloo ranks: the compressed reduce-scatter against plain FSDP2.

Each worker builds two copies of one model from one seed, ``fully_shard``s both the same way
(per Linear, then the root), installs gradwire's reduce-scatter on one, and trains both on the
same batches, comparing the gathered gradients and parameters every step.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist

from .distributed import run_workers, run_workers_some_die, tamper_payload

pytestmark = pytest.mark.distributed

LOSSLESS = {"compressor": "topk", "density": 1.0, "value_codec": "fp32"}
SETTINGS = {
    "int8": {"quantize": "int8"},
    "int4": {"quantize": "int4"},
    "topk": {"compressor": "topk", "density": 0.2, "value_codec": "fp16", "index_codec": "rice"},
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)  # dims 10, 6, 3: padded chunks for 3 and 4 ranks (rank 3 holds no row of the last layer)
    return torch.nn.Sequential(torch.nn.Linear(12, 10), torch.nn.ReLU(), torch.nn.Linear(10, 6), torch.nn.ReLU(),
                               torch.nn.Linear(6, 3))


def _shard(model: torch.nn.Module, mesh: Any = None, **options: Any) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, **options)
    fully_shard(model, mesh=mesh, **options)
    return model


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    inputs = torch.randn(8, 12, generator=generator)
    teacher = torch.Generator().manual_seed(7)
    weights = torch.randn(12, 3, generator=teacher)
    return inputs, torch.tanh(inputs @ weights)


def _backward(state: Any, model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor
              ) -> "tuple[bool, str | None]":
    """The MSE loss's backward: whether it raised, and the state's typed error ("Type: message",
    300 characters at most) when it kept one."""
    try:
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
    except Exception:
        try:
            state.raise_if_failed()
        except Exception as typed:
            return True, f"{type(typed).__name__}: {typed}"[:300]
        return True, None
    return False, None


def _full(tensors: Any) -> list[torch.Tensor]:
    return [t.full_tensor().detach().float().clone() for t in tensors]


def _digest(tensors: list[torch.Tensor]) -> str:
    return hashlib.sha256(torch.cat([t.reshape(-1) for t in tensors]).numpy().tobytes()).hexdigest()


def _mesh(hsdp: bool) -> Any:
    if not hsdp:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("replicate", "shard"))


def worker_compare(rank: int, world_size: int, options: dict, steps: int, setting: dict) -> dict:
    """Train plain FSDP2 and gradwire's side by side; report per-step differences and the losses."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import gradwire.fsdp

    fsdp_options: dict[str, Any] = {}
    if setting.get("bf16"):
        fsdp_options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    mesh = _mesh(setting.get("hsdp", False))
    plain, ours = _shard(_model(), mesh, **fsdp_options), _shard(_model(), mesh, **fsdp_options)
    # gloo has no PREMUL_SUM (what FSDP2 asks for with a factor and AVG): then plain runs without the
    # factor and its mean is scaled by world / factor for the comparison
    scale = 1.0
    for model in (plain, ours):
        modules = [m for m in model.modules() if hasattr(m, "set_gradient_divide_factor")]
        for module in modules:
            if setting.get("force_sum"):
                module.set_force_sum_reduction_for_comms(True)
            if setting.get("divide_factor") and (model is ours or setting.get("force_sum")):
                module.set_gradient_divide_factor(setting["divide_factor"])
        if setting.get("divide_factor") and not setting.get("force_sum"):
            scale = world_size / setting["divide_factor"]
    state = gradwire.fsdp.compress(ours, **options)
    optimizers = [torch.optim.Adam(m.parameters(), lr=0.02) for m in (plain, ours)]
    native_allreduces = []
    original = dist.all_reduce

    def counting(*args: Any, **kwargs: Any) -> Any:
        if sys._getframe(1).f_globals.get("__name__", "").endswith("_fsdp_collectives"):
            native_allreduces.append(1)
        return original(*args, **kwargs)

    grad_diffs, param_diffs, losses, plain_losses = [], [], [], []
    for step in range(steps):
        inputs, targets = _batch(rank, step)
        for model, optimizer in zip((plain, ours), optimizers):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(inputs).float(), targets)
            dist.all_reduce = counting if model is ours else original  # type: ignore[assignment]
            try:
                loss.backward()
            finally:
                dist.all_reduce = original  # type: ignore[assignment]
            (losses if model is ours else plain_losses).append(float(loss))
        grad_diffs.append(max(float((a * scale - b).abs().max()) for a, b in
                              zip(_full(p.grad for p in plain.parameters()), _full(p.grad for p in ours.parameters()))))
        for optimizer in optimizers:
            optimizer.step()
        param_diffs.append(max(float((a - b).abs().max()) for a, b in
                               zip(_full(plain.parameters()), _full(ours.parameters()))))
    stats = state.stats()
    return {"grad_diffs": grad_diffs, "param_diffs": param_diffs, "losses": losses, "plain_losses": plain_losses,
            "parameters": _digest(_full(ours.parameters())), "native_allreduces": len(native_allreduces),
            "steps": state.iteration, "bytes_sent": stats["bytes_sent"], "bytes_dense": stats["bytes_dense"],
            "residual_bytes": stats["residual_bytes"],
            "framed": stats.get("count_framed_reduce_scatters", 0.0),
            "sparse": stats.get("count_sparse_reduce_scatter_buckets", 0.0)}


def worker_cases(rank: int, world_size: int, cases: list[tuple[dict, int, dict]]) -> list[dict]:
    """:func:`worker_compare` for several (options, steps, setting) cases in one launch."""
    return [worker_compare(rank, world_size, options, steps, setting) for options, steps, setting in cases]


def _same_parameters(results: list[dict]) -> None:
    assert len({r["parameters"] for r in results}) == 1, "the gathered parameters differ between ranks"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_lossless_setting_equals_plain_fsdp2(world_size: int) -> None:
    results = run_workers(worker_compare, world_size, LOSSLESS, 2, {}, timeout=240)
    for result in results:
        assert max(result["grad_diffs"]) < 1e-6 and max(result["param_diffs"]) < 1e-6, result
        assert result["steps"] == 2
    _same_parameters(results)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_compressed_settings_train_and_keep_every_rank_alike(name: str) -> None:
    results = run_workers(worker_compare, 3, SETTINGS[name], 20, {}, timeout=240)
    for result in results:
        losses, plain = result["losses"], result["plain_losses"]
        # it learns, about as plain FSDP2 does: at least half of plain's fall over the same batches (on
        # each rank's own data; an absolute ratio is too tight for the ranks whose batches fall less)
        fall, plain_fall = sum(losses[:5]) - sum(losses[-5:]), sum(plain[:5]) - sum(plain[-5:])
        assert plain_fall > 0 and fall > 0.5 * plain_fall, (losses, plain)
        assert sum(losses[-5:]) < 1.5 * sum(plain[-5:]) + 0.05, (losses, plain)
        assert 0 < result["bytes_sent"] < 0.7 * result["bytes_dense"], result  # tiny tensors: headers count
        assert result["residual_bytes"] > 0
        if name == "topk":  # Rice and fp16 bound their sections: every module's exchange is one round
            assert result["framed"] == result["sparse"] > 0, result
    _same_parameters(results)


FACTORS = [{"force_sum": True}, {"divide_factor": 3.0}, {"force_sum": True, "divide_factor": 5.0}]


@pytest.mark.timeout(300)
def test_sum_divide_factors_and_a_bf16_reduce_dtype_match_plain_fsdp2() -> None:
    """op SUM (FSDP divides), PREMUL_SUM (a factor: gradwire divides), both; and bf16 reduction."""
    cases = [(LOSSLESS, 2, setting) for setting in FACTORS] + [(LOSSLESS, 3, {"bf16": True})]
    results = run_workers(worker_cases, 3, cases, timeout=280)
    for per_rank in results:
        for setting, result in zip(FACTORS, per_rank):
            assert max(result["grad_diffs"]) < 1e-6, (setting, result)
        bf16 = per_rank[-1]  # plain sums in bf16, gradwire in float32: a few bf16 ulps apart
        assert max(bf16["grad_diffs"]) < 2e-2 and max(bf16["param_diffs"]) < 2e-2, bf16
    for case in range(len(cases)):
        _same_parameters([per_rank[case] for per_rank in results])


HSDP_CASES = {"lossless": LOSSLESS, "int8": SETTINGS["int8"], "topk": SETTINGS["topk"],
              "int8-gather": {**SETTINGS["int8"], "all_gather": "int8"}}


@pytest.mark.timeout(300)
def test_hsdp_on_a_2x2_mesh_compresses_the_allreduce_across_replicas() -> None:
    cases = [(options, 3 if name == "lossless" else 12, {"hsdp": True}) for name, options in HSDP_CASES.items()]
    results = run_workers(worker_cases, 4, cases, timeout=280)
    for per_rank in results:
        for name, result in zip(HSDP_CASES, per_rank):
            assert result["native_allreduces"] == 0, f"{name}: FSDP2's dense HSDP all-reduce still ran"
            if name == "lossless":
                assert max(result["grad_diffs"]) < 1e-6 and max(result["param_diffs"]) < 1e-6, result
            else:
                assert sum(result["losses"][-3:]) < sum(result["losses"][:3]), (name, result["losses"])
            if name == "int8":  # (a sparse exchange of these tiny tensors is mostly headers)
                assert result["bytes_sent"] < 0.5 * result["bytes_dense"], result
    for case in range(len(cases)):
        _same_parameters([per_rank[case] for per_rank in results])


# ------------------------------------------------------------------------------ failures
def worker_killed_peer(rank: int, world_size: int, options: dict, victim: int, death_step: int, stamp_dir: str) -> dict:
    import gradwire.fsdp

    model = _shard(_model())
    state = gradwire.fsdp.compress(model, collective_timeout=30.0, **options)
    honest = state.reduce_scatter

    def dying(unit: Any, *args: Any) -> None:  # mid-backward: the first module was reduced, the next one is not
        if rank == victim and state.iteration == death_step and state.units.index(unit) != len(state.units) - 1:
            Path(stamp_dir, "death").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        honest(unit, *args)

    state.reduce_scatter = dying  # type: ignore[method-assign]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(death_step + 20):
        optimizer.zero_grad()
        inputs, targets = _batch(rank, step)
        try:
            torch.nn.functional.mse_loss(model(inputs), targets).backward()
        except Exception as error:
            typed = None
            try:
                state.raise_if_failed()
            except Exception as kept:
                typed = type(kept).__name__
            return {"raised_at": time.time(), "step": step, "error": f"{type(error).__name__}: {error}"[:300],
                    "typed": typed}
        optimizer.step()
    return {"raised_at": None, "step": None, "error": None, "typed": None}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["int8", "topk"])
def test_every_survivor_raises_within_seconds_when_a_peer_dies(name: str, tmp_path: Path) -> None:
    results, exit_codes = run_workers_some_die(worker_killed_peer, 3, SETTINGS[name], 1, 3, str(tmp_path),
                                               timeout=200, pg_timeout=60)
    died_at = float(Path(tmp_path, "death").read_text())
    assert exit_codes[1] == -signal.SIGKILL, exit_codes
    for rank in (0, 2):
        ok, report = results[rank]
        assert ok, report
        assert report["step"] == 3, report  # no optimizer step after the death
        assert report["raised_at"] - died_at < 15, report
        assert report["typed"] in ("CollectiveError", "StepFailedError"), report


class _Tamper:
    """On rank 1 at step 1: make the sparse encoder send other bytes than it reconstructs, or
    (quantized) flip a byte of the all-to-all's input after it was quantized."""

    def __init__(self, mode: str, state: Any) -> None:
        self.mode, self.state = mode, state

    def install(self, rank: int) -> None:
        import gradwire.codecs as codec_layer
        from gradwire.exchange import quantized as quantized_module

        tamper = self
        if self.mode == "bytes":  # a byte flipped in flight (no checksum on quantized chunks)
            honest_alltoall = dist.all_to_all_single

            def alltoall(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                if rank == 1 and tamper.state.iteration == 1 and input.dtype == torch.uint8 and input.numel() > 64:
                    input = input.clone()
                    input[input.numel() // 2] ^= 0x11
                return honest_alltoall(output, input, *args, **kwargs)

            quantized_module.dist.all_to_all_single = alltoall  # type: ignore[attr-defined]
            return
        honest = codec_layer.encode_tensors

        def encode(tensors: Any, *args: Any, **kwargs: Any) -> Any:
            encoded = honest(tensors, *args, **kwargs)
            if rank != 1 or tamper.state.iteration != 1:
                return encoded
            return tamper_payload(tamper.mode, encoded, tensors, honest, *args, **kwargs)

        codec_layer.encode_tensors = encode


def worker_tampered(rank: int, world_size: int, mode: str, policy: str, bf16: bool = False) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import gradwire.fsdp

    options = SETTINGS["int8"] if mode == "bytes" else {**SETTINGS["topk"], "value_codec": "fp32"}
    # bf16 reduction: FSDP casts each shard into a float32 gradient (a copy, not a view of the output)
    model = _shard(_model(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)) \
        if bf16 else _shard(_model())
    state = gradwire.fsdp.compress(model, nonfinite=policy, **options)
    _Tamper(mode, state).install(rank)
    honest = state.reduce_scatter
    failed_round: dict[str, bool] = {}

    def watched(unit: Any, *args: Any) -> None:
        """A round that raises leaves its module's residuals as they were (a round is one module's
        reduce-scatter: modules reduced earlier in the backward have applied theirs)."""
        mine = {k: v.clone() for k, v in state.feedback.residuals.items() if k[0] in unit.keys}
        try:
            honest(unit, *args)
        except Exception:
            now = {k: v for k, v in state.feedback.residuals.items() if k[0] in unit.keys}
            failed_round["unchanged"] = now.keys() == mine.keys() and all(torch.equal(now[k], v)
                                                                          for k, v in mine.items())
            raise

    state.reduce_scatter = watched  # type: ignore[method-assign]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    outcome: dict[str, Any] = {}
    for step in range(3):
        optimizer.zero_grad()
        inputs, targets = _batch(rank, step)
        skipped = state.stats()["skipped_steps"]
        raised, error = _backward(state, model, inputs, targets)
        if raised:
            if error is not None:
                outcome = {"step": step, "error": error}
            outcome["residuals_unchanged"] = failed_round.get("unchanged", False)
            break
        if state.stats()["skipped_steps"] > skipped:  # a skipped step: no module's gradient survives
            outcome["skipped_grads_zero"] = all(not bool(p.grad.full_tensor().any()) for p in model.parameters())
        optimizer.step()
    outcome["parameters"] = _digest(_full(model.parameters()))
    outcome["skipped"] = state.stats()["skipped_steps"]
    return outcome


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode, expected", [
    ("checksum", r"DecodeError|StepFailedError: step 1 failed on rank"),
    ("value", r"DivergenceError: step 1: some owner's shard differs"),
    ("bytes", r"DivergenceError: step 1: some owner's shard differs"),
    ("nan", r"NonFiniteGradientError: NaN or Inf in gradients at step 1")])
def test_a_tampered_contribution_fails_the_same_step_on_every_rank(mode: str, expected: str) -> None:
    import re

    outcomes = run_workers(worker_tampered, 3, mode, "raise", timeout=240)
    for rank, outcome in enumerate(outcomes):
        assert outcome.get("step") == 1, (rank, outcome)
        assert re.search(expected, outcome["error"]), (rank, outcome["error"])
        assert outcome["residuals_unchanged"], rank
    assert len({o["parameters"] for o in outcomes}) == 1


@pytest.mark.timeout(300)
@pytest.mark.parametrize("bf16", [False, True])
def test_a_nonfinite_contribution_is_skipped_on_every_rank(bf16: bool) -> None:
    outcomes = run_workers(worker_tampered, 2, "nan", "skip", bf16, timeout=200)
    assert all("step" not in o for o in outcomes), outcomes
    assert all(o["skipped"] >= 1 for o in outcomes), outcomes
    assert all(o["skipped_grads_zero"] for o in outcomes), outcomes  # the earlier modules' too
    assert outcomes[0]["parameters"] == outcomes[1]["parameters"]


# ------------------------------------------------------------------ quantized all-gather
def _expected_gathered(parameter: torch.Tensor, world_size: int, bits: int) -> torch.Tensor:
    """What every rank should compute with: each rank's padded chunk of ``parameter`` quantized on
    its own (blocks of 128 restarting at the parameter), dequantized, the padding dropped."""
    from gradwire.exchange import blockquant
    from gradwire.fsdp import layout

    rows = -(-parameter.shape[0] // world_size)
    padded = torch.zeros((rows * world_size, *parameter.shape[1:]))
    padded[: parameter.shape[0]] = parameter
    chunks = padded.reshape(world_size, -1)
    assert chunks.shape[1] == layout.chunk_numel(tuple(parameter.shape), world_size)
    _, values = blockquant.roundtrip(chunks, bits=bits, block_size=128)
    return values.reshape(padded.shape)[: parameter.shape[0]]


def worker_all_gather(rank: int, world_size: int, name: str, steps: int, corrupt: bool, warmup: int = 0) -> dict:
    """Train with compress(..., all_gather=name, warmup_steps=warmup): the parameters each Linear
    computes with (captured in a forward pre-hook, after FSDP's unshard) against the quantized exact
    shards, or the exact ones during the warm-up."""
    import gradwire.fsdp
    from gradwire.fsdp import all_gather as all_gather_module

    model = _shard(_model())
    state = gradwire.fsdp.compress(model, quantize="int8", all_gather=name, warmup_steps=warmup)
    bits = {"int8": 8, "int4": 4}[name]
    linears = [m for m in model if isinstance(m, torch.nn.Linear)]
    seen: dict[int, torch.Tensor] = {}
    for index, linear in enumerate(linears):
        linear.register_forward_pre_hook(lambda module, args, index=index: seen.__setitem__(
            index, module.weight.detach().float().clone()))
    if corrupt and rank == 1:  # a byte of rank 0's codes changed on its way to rank 1, at step 1
        honest = all_gather_module.received_codes

        def flipping(gathered: torch.Tensor, ranks: int) -> torch.Tensor:
            rows = honest(gathered, ranks)
            if state.iteration == 1:
                rows[0, -1] ^= 0x10
            return rows

        all_gather_module.received_codes = flipping
    optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
    worst, losses, outcome = 0.0, [], {}
    for step in range(steps):
        exact = [linear.weight.full_tensor().detach().clone() for linear in linears]
        optimizer.zero_grad()
        inputs, targets = _batch(rank, step)
        try:
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            loss.backward()
        except Exception:
            try:
                state.raise_if_failed()
            except Exception as typed:
                outcome = {"step": step, "error": f"{type(typed).__name__}: {typed}"[:300]}
            break
        losses.append(float(loss.detach()))
        for index, weight in enumerate(exact):
            expected = weight if step < warmup else _expected_gathered(weight, world_size, bits)
            worst = max(worst, float((seen[index] - expected).abs().max()))
            assert not torch.equal(seen[index], weight) or bits == 8 or step < warmup  # int4 rounds visibly
        optimizer.step()
    stats = state.stats()
    ratio = stats.get("all_gather_bytes_sent_total", 0.0) / max(1.0, stats.get("all_gather_bytes_dense_total", 0.0))
    return {**outcome, "worst": worst, "losses": losses, "seen": _digest([seen[i] for i in sorted(seen)]),
            "parameters": _digest(_full(model.parameters())), "ratio": ratio}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name, world_size, warmup", [("int8", 2, 0), ("int4", 3, 0), ("int4", 2, 4)])
def test_quantized_all_gather_computes_with_the_dequantized_shards_on_every_rank(name: str, world_size: int,
                                                                                 warmup: int) -> None:
    """Bit for bit the dequantized shards, or during ``warmup_steps`` the exact parameters."""
    steps = 12
    results = run_workers(worker_all_gather, world_size, name, steps, False, warmup, timeout=240)
    # the warm-up's gathers send float32: 1 x the dense bytes for warmup of the steps
    ceiling = (0.35 if name == "int8" else 0.22) * (steps - warmup) / steps + warmup / steps
    for result in results:
        assert "step" not in result, result
        assert result["worst"] == 0.0, result  # bit for bit: every rank's chunk quantized on its own
        assert sum(result["losses"][-3:]) < sum(result["losses"][:3]), result["losses"]
        assert warmup / steps < result["ratio"] < ceiling, result["ratio"]  # tiny: scales count
    assert len({r["seen"] for r in results}) == 1, "ranks computed with different parameters"
    _same_parameters(results)


@pytest.mark.timeout(300)
def test_a_corrupted_all_gather_fails_the_step_on_every_rank() -> None:
    outcomes = run_workers(worker_all_gather, 3, "int8", 4, True, timeout=240)
    for rank, outcome in enumerate(outcomes):
        assert outcome.get("step") == 1, (rank, outcome)
        assert "DivergenceError" in outcome["error"], (rank, outcome["error"])
    assert len({o["parameters"] for o in outcomes}) == 1  # no rank stepped on the corrupted step


def worker_killed_in_gather(rank: int, world_size: int, victim: int, death_step: int, stamp_dir: str) -> dict:
    import gradwire.fsdp

    model = _shard(_model())
    gradwire.fsdp.compress(model, quantize="int8", all_gather="int8", collective_timeout=30.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(death_step + 20):
        if rank == victim and step == death_step:  # between steps: the survivors' next gather waits on it
            Path(stamp_dir, "death").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        optimizer.zero_grad()
        inputs, targets = _batch(rank, step)
        try:
            torch.nn.functional.mse_loss(model(inputs), targets).backward()
        except Exception as error:
            return {"raised_at": time.time(), "step": step, "typed": type(error).__name__, "error": str(error)[:300]}
        optimizer.step()
    return {"raised_at": None, "step": None, "typed": None}


@pytest.mark.timeout(300)
def test_every_survivor_raises_within_seconds_when_a_peer_dies_before_a_gather(tmp_path: Path) -> None:
    results, exit_codes = run_workers_some_die(worker_killed_in_gather, 3, 1, 3, str(tmp_path), timeout=200,
                                               pg_timeout=60)
    died_at = float(Path(tmp_path, "death").read_text())
    assert exit_codes[1] == -signal.SIGKILL, exit_codes
    for rank in (0, 2):
        ok, report = results[rank]
        assert ok, report
        assert report["step"] == 3, report
        assert report["raised_at"] - died_at < 15, report
        assert report["typed"] == "CollectiveError", report


# --------------------------------------------------------------------------- checkpoints
def worker_checkpoint(rank: int, world_size: int, options: dict) -> dict:
    import io

    import gradwire.fsdp

    def trained(steps: int) -> tuple[torch.nn.Module, Any]:
        model = _shard(_model())
        state = gradwire.fsdp.compress(model, **options)
        for step in range(steps):
            inputs, targets = _batch(rank, step)
            model.zero_grad()
            torch.nn.functional.mse_loss(model(inputs), targets).backward()
        return model, state

    _, state = trained(2)
    buffer = io.BytesIO()
    torch.save(state.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    _, fresh = trained(0)
    fresh.load_state_dict(saved)

    def same_as_saved(other: Any) -> bool:
        mine = other.state_dict()["residuals"]
        return mine.keys() == saved["residuals"].keys() and all(torch.equal(mine[k], v)
                                                                for k, v in saved["residuals"].items())

    same = same_as_saved(fresh)
    others = [None] * world_size
    dist.all_gather_object(others, saved)
    try:
        fresh.load_state_dict(others[(rank + 1) % world_size])
        refused = None
    except ValueError as error:
        refused = str(error)
    gathered = [None] * world_size
    dist.all_gather_object(gathered, state.state_dict(gather=True))  # a collective: every rank calls it
    _, again = trained(0)
    again.load_state_dict(gathered[0])  # rank 0's file holds every rank's state
    same = same and same_as_saved(again)
    return {"iteration": fresh.iteration, "same": same, "refused": refused,
            "dtypes": sorted({str(t.dtype) for t in saved["residuals"].values()}), "names": sorted(saved["residuals"])}


def worker_checkpoints(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    return [worker_checkpoint(rank, world_size, options) for options in cases]


@pytest.mark.timeout(300)
def test_checkpoint_round_trips_per_rank_and_refuses_another_ranks() -> None:
    cases = [SETTINGS["int8"], {**SETTINGS["topk"], "residual_dtype": "bfloat16"}]
    for per_rank in run_workers(worker_checkpoints, 2, cases, timeout=240):
        for options, result in zip(cases, per_rank):
            dtype = "torch.bfloat16" if options.get("residual_dtype") == "bfloat16" else "torch.float32"
            assert result["iteration"] == 2 and result["same"], result
            assert result["refused"] is not None and "belongs to rank" in result["refused"], result
            assert result["dtypes"] == [dtype]
            assert "0.weight#0" in result["names"] and "0.weight#1" in result["names"]


# -------------------------------------------------------------------------------- the API
def worker_api(rank: int, world_size: int) -> dict:
    import gradwire.fsdp
    from gradwire.fsdp import layout

    out: dict[str, Optional[str]] = {}
    try:
        gradwire.fsdp.compress(_model(), quantize="int8")
    except ValueError as error:
        out["unsharded"] = str(error)
    for name, options in (("global", {"scope": "global"}), ("bloom", {"index_codec": "bloom"}),
                          ("collective", {"collective": "allgather"}), ("gather", {"all_gather": "int2"})):
        try:
            gradwire.fsdp.compress(_shard(_model()), **options)
        except ValueError as error:
            out[name] = str(error)
    model = _shard(_model())
    state = gradwire.fsdp.compress(model, quantize="int8")
    layer = model[0]
    comm = layer._get_fsdp_state()._fsdp_param_groups[0]._reduce_scatter_comm
    size = layout.shard_numel([(10, 12), (10,)], world_size)
    flat = torch.ones(world_size * size)
    output = comm.allocate((size,), dtype=torch.float32, device=torch.device("cpu"))
    work = comm(output, flat, dist.group.WORLD, dist.ReduceOp.AVG, async_op=True)
    out["async"] = f"{work.is_completed()} {work.wait()} {bool(torch.allclose(output, torch.ones(size), atol=1e-2))}"
    out["steps"] = str(state.iteration)
    return out


@pytest.mark.timeout(200)
def test_compress_refuses_what_it_cannot_do_and_honours_async_op() -> None:
    for out in run_workers(worker_api, 2, timeout=150):
        assert "call fully_shard first" in out["unsharded"]
        assert "scope='global' does not apply" in out["global"]
        assert "index_codec must be lossless" in out["bloom"]
        assert "does not apply to a reduce-scatter" in out["collective"]
        assert "all_gather='int2' is not supported; allowed: None, int8, int4" in out["gather"]
        assert out["async"] == "True True True", out


def worker_deferral(rank: int, world_size: int, options: dict, steps: int, gather: Optional[str],
                    accumulate: bool) -> dict:
    """Train two copies of one model, one with ``defer=True`` and one with ``defer=False``, on the
    same batches: what each step applied, and how many reduce-scatters stayed in flight. With
    ``accumulate`` the gradients are zeroed, not set to None, so FSDP2 adds the reduced shard to
    them and no exchange may stay in flight."""
    import gradwire.fsdp

    models = [_shard(_model()), _shard(_model())]
    states = [gradwire.fsdp.compress(model, all_gather=gather, defer=defer, **options)
              for model, defer in zip(models, (True, False))]
    optimizers = [torch.optim.Adam(model.parameters(), lr=0.02) for model in models]
    before_step: list[list[str]] = []
    for step in range(steps):
        inputs, targets = _batch(rank, step)
        grads = []
        for model, state, optimizer in zip(models, states, optimizers):
            optimizer.zero_grad(set_to_none=not accumulate)
            raised, error = _backward(state, model, inputs, targets)
            assert not raised, error
            grads.append(_digest(_full(p.grad for p in model.parameters())))
            optimizer.step()
        before_step.append(grads)
    deferred = [state.stats().get("count_deferred_reduce_scatters", 0.0) for state in states]
    return {"grads": before_step, "deferred": deferred, "parameters": [_digest(_full(m.parameters())) for m in models],
            "modules": len(states[0].units)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name, world_size, gather", [("int8", 2, "int8"), ("topk", 3, None), ("int4", 4, "int4")])
def test_deferred_reduce_scatters_write_what_completed_ones_write(name: str, world_size: int,
                                                                 gather: Optional[str]) -> None:
    """defer=True (the default) leaves every module's exchange in flight until the step's last
    module's call, and the gradients the optimizer reads are bit for bit those of completing each
    exchange inside FSDP2's call (defer=False)."""
    steps = 5
    for result in run_workers(worker_deferral, world_size, SETTINGS[name], steps, gather, False, timeout=240):
        assert all(deferred == completed for deferred, completed in result["grads"]), result["grads"]
        assert result["parameters"][0] == result["parameters"][1]
        # every module's, each step (the last module's too, completed at once with the others)
        assert result["deferred"] == [float(steps * result["modules"]), 0.0], result["deferred"]


@pytest.mark.timeout(300)
def test_accumulating_gradients_complete_every_exchange_inside_fsdps_call() -> None:
    """FSDP2 adds the reduced shard to gradients that exist, right after the call: nothing may stay
    in flight then (after the first step, which has no gradients yet), and the result is the same
    as completing at once."""
    for result in run_workers(worker_deferral, 2, SETTINGS["int8"], 3, None, True, timeout=240):
        assert all(deferred == completed for deferred, completed in result["grads"]), result["grads"]
        assert result["deferred"] == [float(result["modules"]), 0.0], result["deferred"]



def worker_unclosed_step(rank: int, world_size: int, steps: int) -> dict:
    """defer=True against defer=False when a step's round never reaches its last module (the state
    is told of one module more than FSDP2 has, so no call closes the step): only the callback at
    the backward's end completes what is in flight before the optimizer reads the gradients; the
    agreement then comes at the next step's first call."""
    import dataclasses

    import gradwire.fsdp

    models = [_shard(_model()), _shard(_model())]
    states = [gradwire.fsdp.compress(model, defer=defer, **SETTINGS["int8"])
              for model, defer in zip(models, (True, False))]
    for state in states:
        state.units.append(dataclasses.replace(state.units[0], name="never-called"))
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.05) for model in models]
    grads, errors = [], []
    for step in range(steps):
        inputs, targets = _batch(rank, step)
        row = []
        for model, state, optimizer in zip(models, states, optimizers):
            optimizer.zero_grad()
            raised, error = _backward(state, model, inputs, targets)
            errors.append(error if raised else None)
            row.append(_digest(_full(p.grad for p in model.parameters())))
            optimizer.step()
        grads.append(row)
    return {"grads": grads, "errors": errors, "iterations": [state.iteration for state in states],
            "deferred": states[0].stats().get("count_deferred_reduce_scatters", 0.0)}


@pytest.mark.timeout(300)
def test_a_step_that_never_reaches_its_last_module_still_writes_every_gradient() -> None:
    steps = 4
    for result in run_workers(worker_unclosed_step, 2, steps, timeout=240):
        assert result["errors"] == [None] * (2 * steps), result["errors"]
        assert result["iterations"] == [steps - 1, steps - 1], result  # each step agreed at the next one's start
        assert result["deferred"] > 0, result
        assert all(deferred == completed for deferred, completed in result["grads"]), result["grads"]
