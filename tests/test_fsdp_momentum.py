"""gradwire.fsdp's 1-bit Adam exchange (``compress(momentum=b1)`` + ``MomentumAdamW``).

On real gloo ranks: with a lossless exchange it is exactly 1-bit Adam over plain FSDP2's mean
gradient (a reference written out below); top-k trains and keeps every rank alike; a checkpoint
restores the ranks' bases; NaN on one rank skips (or fails) the step on every rank with the bases
and the optimizer untouched. In one process: the bases' bookkeeping and the refusals.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gradwire import ExchangeConfig
from gradwire.core.group import BufferTarget, Entry, Group
from gradwire.fsdp.momentum import MomentumAdamW, MomentumBases

from .distributed import run_workers
from .test_fsdp import LOSSLESS, _backward, _batch, _digest, _full, _shard

WARMUP, BETA1, BETA2, LR, DECAY, EPS = 3, 0.9, 0.999, 0.02, 0.01, 1e-8


def _model() -> torch.nn.Module:
    """test_fsdp's shapes (padded chunks at 3 ranks) with tanh: a ReLU unit dead through a short
    warm-up has v = 0, and 1-bit Adam's first step on it after the freeze is huge (m / eps)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 10), torch.nn.Tanh(), torch.nn.Linear(10, 6), torch.nn.Tanh(),
                               torch.nn.Linear(6, 3))


class _ReferenceOneBitAdam:
    """1-bit Adam on the exact mean gradient, as the lossless exchange must give it: AdamW for
    ``WARMUP`` steps; then ``v`` frozen and ``m = (1 - b1) g`` at the first step after (the bases
    start at zero), ``m = b1 m + (1 - b1) g`` later."""

    def __init__(self, parameters: list[torch.nn.Parameter]) -> None:
        self.parameters = parameters
        self.m = [torch.zeros_like(p) for p in parameters]
        self.v = [torch.zeros_like(p) for p in parameters]
        self.t = 0

    @torch.no_grad()
    def step(self) -> None:
        self.t += 1
        for p, m, v in zip(self.parameters, self.m, self.v):
            p.mul_(1 - LR * DECAY)
            if self.t <= WARMUP:
                m.lerp_(p.grad, 1 - BETA1)
                v.mul_(BETA2).addcmul_(p.grad, p.grad, value=1 - BETA2)
            elif self.t == WARMUP + 1:
                m.copy_(p.grad).mul_(1 - BETA1)
            else:
                m.mul_(BETA1).add_(p.grad, alpha=1 - BETA1)
            denominator = (v / (1 - BETA2 ** min(self.t, WARMUP))).sqrt_().add_(EPS)
            p.addcdiv_(m, denominator, value=-LR / (1 - BETA1 ** self.t))


def worker_lossless(rank: int, world_size: int, steps: int) -> dict:
    import gradwire.fsdp

    plain, ours = _shard(_model()), _shard(_model())
    state = gradwire.fsdp.compress(ours, **LOSSLESS, warmup_steps=WARMUP, momentum=BETA1)
    reference = _ReferenceOneBitAdam(list(plain.parameters()))
    optimizer = MomentumAdamW(ours.parameters(), state, lr=LR, weight_decay=DECAY, eps=EPS, beta2=BETA2)
    differences = []
    for step in range(steps):
        inputs, targets = _batch(rank, step)
        for model in (plain, ours):
            for p in model.parameters():
                p.grad = None
            torch.nn.functional.mse_loss(model(inputs), targets).backward()
        reference.step()
        optimizer.step()
        differences.append(max(float((a - b).abs().max()) for a, b in
                               zip(_full(plain.parameters()), _full(ours.parameters()))))
    bases = state.momentum_bases
    assert bases is not None
    return {"differences": differences, "parameters": _digest(_full(ours.parameters())),
            "based": sorted(bases.bases), "steps": optimizer.steps_taken}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 3])
def test_a_lossless_exchange_is_one_bit_adam_over_the_exact_mean(world_size: int) -> None:
    results = run_workers(worker_lossless, world_size, 8, timeout=240)
    for result in results:
        # before the warm-up ends the two are plain AdamW; after it, 1-bit Adam on the momentum
        assert max(result["differences"]) < 1e-5, result["differences"]
        assert result["steps"] == 8 and result["based"] == ["0", "2", "4"], result  # each Linear (the root has none)
    assert len({r["parameters"] for r in results}) == 1


def worker_topk(rank: int, world_size: int, steps: int) -> dict:
    import gradwire.fsdp

    spec = {"compressor": "topk", "density": 0.2, "value_codec": "fp16", "index_codec": "rice", "warmup_steps": 2}
    model, gradients = _shard(_model()), _shard(_model())
    state = gradwire.fsdp.compress(model, **spec, momentum=BETA1)
    plain_state = gradwire.fsdp.compress(gradients, **spec)  # the same top-k, sending gradients
    optimizers = [MomentumAdamW(model.parameters(), state, lr=LR), torch.optim.AdamW(gradients.parameters(), lr=LR)]
    losses = []
    for step in range(steps):
        inputs, targets = _batch(rank, step % 4)
        for trained, optimizer in zip((model, gradients), optimizers):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(trained(inputs), targets)
            loss.backward()
            optimizer.step()
            if trained is model:
                losses.append(float(loss.detach()))
    return {"losses": losses, "parameters": _digest(_full(model.parameters())),
            "bytes": [s.stats()["total_bytes_sent"] for s in (state, plain_state)],
            "bytes_dense": state.stats()["total_bytes_dense"]}


@pytest.mark.timeout(300)
def test_top_k_momentum_trains_and_keeps_every_rank_alike() -> None:
    results = run_workers(worker_topk, 3, 24, timeout=240)
    for result in results:
        assert sum(result["losses"][-4:]) < 0.5 * sum(result["losses"][:4]), result["losses"]
        # the frames are sized by the codecs' bounds: sending momenta costs what sending gradients does
        momentum_bytes, gradient_bytes = result["bytes"]
        assert momentum_bytes == gradient_bytes < result["bytes_dense"], result
    assert len({r["parameters"] for r in results}) == 1


def worker_checkpoint(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    import gradwire.fsdp

    model = _shard(_model())
    state = gradwire.fsdp.compress(model, compressor="topk", density=0.2, value_codec="fp32", index_codec="rice",
                                   warmup_steps=2, momentum=BETA1)
    optimizer = MomentumAdamW(model.parameters(), state, lr=LR)

    def train(steps: range) -> None:
        for step in steps:
            inputs, targets = _batch(rank, step)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(inputs), targets).backward()
            optimizer.step()

    train(range(5))
    saved = ([p.to_local().detach().clone() for p in model.parameters()], optimizer.state_dict(),
             state.state_dict())
    gathered_here = state.state_dict(gather=True)  # a collective; rank 0's holds every rank's bases
    every = [None] * world_size
    dist.all_gather_object(every, gathered_here)  # the test hands rank 0's file to every rank
    gathered = every[0]
    # rank 1's own gathered file holds only rank 1; for rank 1, rank 0's file cut to rank 0
    other_ranks_file = every[1] if rank == 0 else {**gathered,
                                                   "ranks": [e for e in gathered["ranks"] if e["rank"] == 0]}
    bases_at_save = {name: values.clone() for name, (_, values) in state.momentum_bases.bases.items()}
    train(range(5, 9))
    continued = _digest(_full(model.parameters()))

    def restore(hook_state: dict) -> None:
        with torch.no_grad():
            for parameter, local in zip(model.parameters(), saved[0]):
                parameter.to_local().copy_(local)
        optimizer.load_state_dict(saved[1])
        state.load_state_dict(hook_state)

    restore(saved[2])
    restored_bases = all(torch.equal(state.momentum_bases.bases[name][1], values)
                         for name, values in bases_at_save.items())
    train(range(5, 9))
    resumed = _digest(_full(model.parameters()))
    restore(gathered)
    restored_gathered = _same_bases(_bases(state), {name: (p, v) for name, (p, v) in _saved_bases(saved[2]).items()})
    train(range(5, 9))
    resumed_gathered = _digest(_full(model.parameters()))
    errors = {}
    plain_state = {key: value for key, value in saved[2].items() if key != "momentum_bases"}
    for case, bad in (("without bases", plain_state), ("another rank's gathered file", other_ranks_file),
                      ("positions outside", {**saved[2], "momentum_bases": {
                          name: {"positions": torch.tensor([10**6]), "values": torch.ones(1)}
                          for name in saved[2]["momentum_bases"]}})):
        try:
            state.load_state_dict(bad)
        except ValueError as error:
            errors[case] = str(error)
    return {"continued": continued, "resumed": resumed, "restored": restored_bases, "errors": errors,
            "resumed_gathered": resumed_gathered, "restored_gathered": restored_gathered,
            "gathered_ranks": [entry["rank"] for entry in gathered["ranks"]],
            "gathered_has_bases": all(entry["momentum_bases"] for entry in gathered["ranks"])}


def _saved_bases(hook_state: dict) -> dict:
    return {name: (base["positions"], base["values"]) for name, base in hook_state["momentum_bases"].items()}


@pytest.mark.timeout(300)
def test_a_checkpoint_restores_each_ranks_bases() -> None:
    results = run_workers(worker_checkpoint, 2, timeout=240)
    for result in results:
        assert result["restored"]
        assert result["resumed"] == result["continued"]  # the same 4 steps again, bit for bit
        assert result["gathered_ranks"] == [0, 1] and result["gathered_has_bases"], result
        assert result["restored_gathered"] and result["resumed_gathered"] == result["continued"]  # from rank 0's file
        assert "not rank" in result["errors"]["another rank's gathered file"], result["errors"]
        assert "saved without compress(momentum=...)" in result["errors"]["without bases"], result["errors"]
        assert "positions outside" in result["errors"]["positions outside"], result["errors"]


def _bases(state: Any) -> dict:
    return {name: (positions.clone(), values.clone())
            for name, (positions, values) in state.momentum_bases.bases.items()}


def _same_bases(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k][0], b[k][0]) and torch.equal(a[k][1], b[k][1]) for k in a)


def worker_nonfinite(rank: int, world_size: int, policy: str, bad_step: int) -> dict:
    """NaN in rank 1's gradients at ``bad_step`` (after the warm-up, while momenta are sent): under
    ``nonfinite=policy`` every rank must skip (or raise at) that step, with its bases and its
    optimizer untouched, and every rank must hold the same parameters afterwards."""
    import gradwire.fsdp

    model = _shard(_model())
    state = gradwire.fsdp.compress(model, compressor="topk", density=0.2, value_codec="fp16", index_codec="rice",
                                   warmup_steps=2, momentum=BETA1, nonfinite=policy)
    optimizer = MomentumAdamW(model.parameters(), state, lr=LR)
    outcome: dict[str, Any] = {}
    for step in range(bad_step + 3):
        inputs, targets = _batch(rank, step)
        if rank == 1 and step == bad_step:
            inputs = inputs * float("nan")
        optimizer.zero_grad()
        bases, taken = _bases(state), optimizer.steps_taken
        moments = [optimizer.state[p]["m"].clone() for p in model.parameters() if "m" in optimizer.state[p]]
        skipped = state.stats()["skipped_steps"]
        raised, error = _backward(state, model, inputs, targets)
        if raised:
            if error is not None:
                outcome["error"] = error
            outcome["step"] = step
            outcome["bases_kept"] = _same_bases(bases, _bases(state))
            break
        shards = [p.to_local().detach().clone() for p in model.parameters()]
        optimizer.step()
        if state.stats()["skipped_steps"] > skipped:
            outcome.setdefault("skipped_at", []).append(step)
            outcome["bases_kept"] = _same_bases(bases, _bases(state))
            # the round still counts (steps_taken follows the rounds), but nothing moved
            outcome["optimizer_kept"] = optimizer.steps_taken == taken + 1 and all(
                torch.equal(before, optimizer.state[p]["m"]) for before, p in zip(moments, model.parameters())
            ) and all(torch.equal(before, p.to_local()) for before, p in zip(shards, model.parameters()))
    full = _full(model.parameters())
    return {**outcome, "parameters": _digest(full), "finite": all(bool(t.isfinite().all()) for t in full),
            "steps_taken": optimizer.steps_taken, "based": len(state.momentum_bases.bases)}


@pytest.mark.timeout(300)
def test_a_nonfinite_momentum_step_is_skipped_on_every_rank_bases_and_optimizer_untouched() -> None:
    bad_step = 4  # two warm-up steps, then momenta: the bases are not empty by then
    results = run_workers(worker_nonfinite, 3, "skip", bad_step, timeout=240)
    for rank, result in enumerate(results):
        assert "error" not in result, (rank, result)
        assert result["skipped_at"] == [bad_step], (rank, result)
        assert result["bases_kept"] and result["optimizer_kept"], (rank, result)
        assert result["steps_taken"] == bad_step + 3 and result["finite"], (rank, result)  # training went on
        assert result["based"] == 3, result  # each Linear sends momenta again after the skipped step
    assert len({r["parameters"] for r in results}) == 1


@pytest.mark.timeout(300)
def test_a_nonfinite_momentum_step_raises_on_every_rank_bases_untouched() -> None:
    bad_step = 4
    results = run_workers(worker_nonfinite, 3, "raise", bad_step, timeout=240)
    for rank, result in enumerate(results):
        assert result.get("step") == bad_step, (rank, result)
        assert "NonFiniteGradientError" in result.get("error", ""), (rank, result)
        assert result["bases_kept"] and result["steps_taken"] == bad_step, (rank, result)
    assert len({r["parameters"] for r in results}) == 1


# ------------------------------------------------------------------------------------ one process
def test_bases_are_what_each_entry_sent_at_its_place_in_the_module() -> None:
    """Both of the core's records: per entry (positions local to it) and flat (positions in the
    entries laid end to end); blend adds ``b1`` times them to ``(1 - b1) g``."""
    entries = [Entry(("a", 0), 0, torch.zeros(4), 0), Entry(("b", 0), 1, torch.zeros(3), 4),
               Entry(("c", 1), 2, torch.zeros(5), 7)]
    group = Group(BufferTarget([torch.zeros(12)]), entries, divisor=1.0)
    group.feedback_updates.append((("b", 0), torch.zeros(3), torch.tensor([2]), torch.tensor([5.0])))
    # flat over entries a and c end to end (4 + 5): flat 1 is a's 1 (module 1), flat 6 is c's 2 (module 9)
    group.feedback_flat_updates.append(([("a", 0), ("c", 1)], [4, 5], torch.zeros(9), torch.tensor([1, 6]),
                                        torch.tensor([-1.0, 3.0])))
    bases = MomentumBases(0.5)
    bases.record("m", group)
    positions, values = bases.bases["m"]
    assert dict(zip(positions.tolist(), values.tolist())) == {6: 5.0, 1: -1.0, 9: 3.0}
    gradient = torch.full((12,), 2.0)
    bases.blend("m", gradient)
    expected = torch.full((12,), 1.0)
    expected[6], expected[1], expected[9] = 3.5, 0.5, 2.5
    assert torch.equal(gradient, expected)
    bases.record("m", Group(BufferTarget([torch.zeros(12)]), entries, divisor=1.0))  # sent nothing
    assert "m" not in bases.bases


@pytest.mark.parametrize("momentum, options, message", [
    (1.0, {"compressor": "topk", "density": 0.1, "warmup_steps": 5},
     "momentum=1.0: must be None or a number in (0, 1)"),
    (True, {"compressor": "topk", "density": 0.1, "warmup_steps": 5}, "momentum=True"),
    (0.9, {"compressor": "none", "quantize": "int8", "warmup_steps": 5}, "momentum= needs a sparsifier"),
    (0.9, {"compressor": "topk", "density": 0.1, "error_feedback": False, "warmup_steps": 5},
     "momentum= needs plain error feedback"),
    (0.9, {"compressor": "topk", "density": 0.1}, "momentum= needs warmup_steps >= 1"),
])
def test_momentum_refuses_what_it_cannot_run(momentum: Any, options: dict, message: str) -> None:
    from gradwire.fsdp.state import check_momentum

    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_momentum(momentum, ExchangeConfig(**options))


class _State:
    """What MomentumAdamW reads of the FSDP state: its options, bases, rounds and last verdict."""

    def __init__(self, momentum: bool = True) -> None:
        self.config = ExchangeConfig(compressor="topk", density=0.5, warmup_steps=1)
        self.momentum_bases = MomentumBases(0.9) if momentum else None
        self.iteration, self.last_action = 0, None


def test_the_optimizer_needs_the_momentum_state_and_one_step_per_round() -> None:
    parameter = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match="MomentumAdamW needs the state of gradwire.fsdp.compress"):
        MomentumAdamW([parameter], _State(momentum=False))
    with pytest.raises(ValueError, match="beta2=1.0 must be in"):
        MomentumAdamW([parameter], _State(), beta2=1.0)
    state = _State()
    optimizer = MomentumAdamW([parameter], state, lr=0.1)
    parameter.grad = torch.ones(3)
    with pytest.raises(RuntimeError, match="the reduce-scatter has completed 0 rounds"):
        optimizer.step()
    state.iteration, state.last_action = 1, "apply"
    optimizer.step()  # a warm-up step: AdamW
    moved = parameter.detach().clone()
    assert not torch.equal(moved, torch.ones(3))
    state.iteration, state.last_action = 2, "skip"
    optimizer.step()  # a skipped round: nothing moves, m and v kept
    assert torch.equal(parameter.detach(), moved) and optimizer.steps_taken == 2
    state.iteration, state.last_action = 3, "apply"
    parameter.grad = torch.full((3,), 0.5)  # the exchanged momentum, after the warm-up
    v = optimizer.state[parameter]["v"].clone()
    optimizer.step()
    assert torch.equal(optimizer.state[parameter]["v"], v)  # frozen
    assert torch.equal(optimizer.state[parameter]["m"], torch.full((3,), 0.5))



def test_a_warm_up_whose_every_round_was_skipped_raises_instead_of_stepping_by_m_over_eps() -> None:
    parameter = torch.nn.Parameter(torch.ones(3))
    state = _State()  # warmup_steps=1
    optimizer = MomentumAdamW([parameter], state, lr=0.1)
    parameter.grad = torch.full((3,), 2.0)
    state.iteration, state.last_action = 1, "skip"
    optimizer.step()
    state.iteration, state.last_action = 2, "apply"
    with pytest.raises(RuntimeError, match="every round of the warm-up .*was skipped"):
        optimizer.step()
    assert torch.equal(parameter.detach(), torch.ones(3))


def test_the_bias_corrections_count_applied_steps_only() -> None:
    """Rounds: 1 apply (warm-up, t = 1), 2 skip, 3 apply (frozen): t = 2, not 3, in m's correction."""
    parameter = torch.nn.Parameter(torch.ones(3))
    state = _State()  # warmup_steps=1
    lr, beta1, beta2, eps = 0.1, 0.9, 0.999, 1e-8
    optimizer = MomentumAdamW([parameter], state, lr=lr, weight_decay=0.0, eps=eps, beta2=beta2)
    parameter.grad = torch.full((3,), 2.0)
    state.iteration, state.last_action = 1, "apply"
    optimizer.step()
    v = (1 - beta2) * 4.0
    after_warmup = 1.0 - lr * ((1 - beta1) * 2.0 / (1 - beta1)) / ((v / (1 - beta2)) ** 0.5 + eps)
    assert parameter.detach() == pytest.approx(torch.full((3,), after_warmup), abs=1e-6)
    state.iteration, state.last_action = 2, "skip"
    optimizer.step()
    state.iteration, state.last_action = 3, "apply"
    parameter.grad = torch.full((3,), 0.5)  # the exchanged momentum
    optimizer.step()
    assert (optimizer.steps_taken, optimizer.steps_applied, optimizer.warmup_applied) == (3, 2, 1)
    expected = after_warmup - lr * (0.5 / (1 - beta1 ** 2)) / ((v / (1 - beta2)) ** 0.5 + eps)
    wrong = after_warmup - lr * (0.5 / (1 - beta1 ** 3)) / ((v / (1 - beta2)) ** 0.5 + eps)
    assert abs(expected - wrong) > 1e-3  # the two counts are told apart
    assert parameter.detach() == pytest.approx(torch.full((3,), expected), abs=1e-6)


def test_a_coordinate_unseen_in_the_warm_up_moves_like_its_tensor_not_by_m_over_eps() -> None:
    """v = 0 where the warm-up gave no gradient (an unseen token's embedding row): frozen as is,
    the first momentum there would move it by lr m / eps = 1e5 here."""
    parameter = torch.nn.Parameter(torch.zeros(4))
    state = _State()  # warmup_steps=1
    optimizer = MomentumAdamW([parameter], state, lr=0.01, weight_decay=0.0)
    parameter.grad = torch.tensor([1.0, 2.0, 0.0, 0.0])  # coordinates 2 and 3 unseen
    state.iteration, state.last_action = 1, "apply"
    optimizer.step()
    parameter.grad = torch.full((4,), 0.1)
    state.iteration = 2
    optimizer.step()
    v = optimizer.state[parameter]["v"]
    assert float(v[2]) == float(v[3]) == pytest.approx(float(v[:2].mean()))
    assert float(parameter.detach().abs().max()) < 0.1, parameter
