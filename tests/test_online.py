"""``collective="auto"`` checks its choice on real rounds: the trial schedule, the decision rule,
and the switch on the same round on every rank when the ranks measure different times."""

from __future__ import annotations

import time

import pytest
import torch

import gradwire
from gradwire.core.online import DENSE, MODEL, OnlineChoice, trial_schedule

from .distributed import run_workers


def test_a_trial_runs_each_candidate_in_two_mirrored_passes_of_blocks_after_one_warm_in_round() -> None:
    online = OnlineChoice(trial_rounds=2)
    assert online.due(10) and online.policy(10) == MODEL
    online.start_trial(10, [MODEL, DENSE])
    # pass 1: M(warm-in) M M D(warm-in) D D; pass 2 mirrored: D D (no warm-in: D ran on) M(warm-in) M M
    assert [online.policy(r) for r in range(10, 22)] == [MODEL] * 3 + [DENSE] * 5 + [MODEL] * 3 + [MODEL]
    assert not online.due(11)
    schedule = trial_schedule(["a", "b", "c"], 3)
    assert schedule == ["a"] * 4 + ["b"] * 4 + ["c"] * 4 + ["c"] * 3 + ["b"] * 4 + ["a"] * 4


def _run_trial(online: OnlineChoice, start: int, counted: dict[str, float], warm_in: float = 9.0,
               drift: float = 0.0) -> None:
    """Feed every round of a trial: a block's first round (the warm-in) takes ``warm_in`` seconds,
    a counted round its candidate's ``counted`` time plus ``drift`` seconds per round since the
    trial's start (every rank reports the same)."""
    online.start_trial(start, list(counted))
    rounds = len(trial_schedule(list(counted), online.trial_rounds))
    for round_index in range(start, start + rounds):
        name = online.policy(round_index)
        warm = round_index == start or online.policy(round_index - 1) != name
        online.observe(round_index, [warm_in if warm else counted[name] + drift * (round_index - start)])


def test_the_faster_policy_wins_only_by_the_margin_and_warm_ins_do_not_count() -> None:
    online = OnlineChoice(trial_rounds=3, margin=0.05)
    _run_trial(online, 0, {MODEL: 1.0, DENSE: 0.97})  # the slow warm-ins must not count
    assert online.current == MODEL and online.measured == {MODEL: 1.0, DENSE: 0.97}  # 3% faster: no switch
    online2 = OnlineChoice(trial_rounds=3, margin=0.05)
    _run_trial(online2, 0, {MODEL: 1.25, DENSE: 1.0})
    assert online2.current == DENSE and online2.switches == [(15, DENSE)]  # 4 + 4 + 3 + 4 rounds
    assert online2.summary()["auto_policy"] == DENSE and online2.summary()["auto_seconds_model"] == 1.25
    assert online2.summary()["auto_rounds_dense"] == [1.0] * 6  # 3 counted rounds in each pass, no warm-in


@pytest.mark.parametrize("announce", [True, False])
def test_dense_winning_is_said_once_and_only_by_the_announcing_rank(announce: bool,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    online = OnlineChoice(trial_rounds=2, announce=announce)
    with caplog.at_level("WARNING", logger="gradwire"):
        _run_trial(online, 0, {MODEL: 1.25, DENSE: 1.0})
        _run_trial(online, 400, {DENSE: 1.0, MODEL: 1.25})  # a recheck keeps dense: nothing more to say
    said = [r.getMessage() for r in caplog.records if "compression cannot win" in r.getMessage()]
    assert online.current == DENSE and len(said) == (1 if announce else 0)


def test_a_drift_over_the_trial_does_not_decide_it() -> None:
    """The machine slows by 2% of a step per round: in one pass of blocks the later candidate would
    measure slower by more than the margin (6-10%, as it has 2 or 4 counted rounds); mirrored, both
    centre on the same round and measure alike."""
    online = OnlineChoice(trial_rounds=2, margin=0.05)
    _run_trial(online, 0, {MODEL: 1.0, DENSE: 1.0}, drift=0.02)
    assert online.current == MODEL and online.measured[MODEL] == pytest.approx(online.measured[DENSE])
    online = OnlineChoice(trial_rounds=2, margin=0.05)  # dense, 10% faster, still wins against the drift
    _run_trial(online, 0, {MODEL: 1.0, DENSE: 0.9}, drift=0.02)
    assert online.current == DENSE and online.measured[MODEL] - online.measured[DENSE] == pytest.approx(0.1)


def test_a_round_counts_at_its_slowest_rank() -> None:
    online = OnlineChoice(trial_rounds=1, margin=0.05)
    online.start_trial(0, [MODEL, DENSE])  # M(warm-in) M D(warm-in) D D M(warm-in) M
    fast_on_rank_0_only = [0.5, 2.0]
    for round_index, times in enumerate([[1, 1], fast_on_rank_0_only, [1, 1], [1.0, 1.1], [1.0, 1.1], [1, 1],
                                         fast_on_rank_0_only]):
        online.observe(round_index, times)
    assert online.measured == {MODEL: 2.0, DENSE: 1.1} and online.current == DENSE


def test_the_online_state_survives_a_checkpoint_and_refuses_garbage() -> None:
    online = OnlineChoice(trial_rounds=2)
    online.start_trial(5, [MODEL, DENSE])
    online.observe(5, [1.0])
    online.observe(7, [2.0])
    restored = OnlineChoice()
    restored.load_state_dict(online.state_dict())
    assert [restored.policy(r) for r in range(5, 11)] == [online.policy(r) for r in range(5, 11)]
    assert restored.state_dict() == online.state_dict()
    with pytest.raises(ValueError, match="'planner' online state is malformed"):
        OnlineChoice().load_state_dict({"current": "model"})


def worker_switch(rank: int, world_size: int, slow_rank: int, fast_under: str) -> dict:
    """``slow_rank`` sleeps 80 ms in every step that runs under another policy than ``fast_under``:
    only that rank measures the difference, and every rank must still switch on the same round."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    exchange = gradwire.GradientExchange(model, compressor="topk", density=0.05, collective="auto", link_gbit=0.001)
    planner_policies, reported = [], []
    for step in range(26):  # the trial: rounds 8 to 24 (three candidates, two passes of 1 + 2 rounds)
        model.zero_grad()
        generator = torch.Generator().manual_seed(100 * rank + step)
        model(torch.randn(16, 64, generator=generator)).square().mean().backward()
        planner = exchange.pipeline.planner
        policy = planner.online.policy(step) if planner is not None and planner.online is not None else MODEL
        if rank == slow_rank and policy != fast_under:
            time.sleep(0.08)
        planner_policies.append(policy)
        exchange.synchronize()
        reported.append(exchange.stats().get("auto_ran"))
    stats = exchange.stats()
    return {"policies": planner_policies, "reported": reported, "switches": exchange.pipeline.planner.online.switches,
            "policy": stats["auto_policy"], "choices": sorted(set(exchange.pipeline.planner.choices.values()))}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("expected", [DENSE, MODEL, "allgather"])  # allgather: the runner-up
def test_the_online_switch_happens_on_the_same_round_on_every_rank(expected: str) -> None:
    results = run_workers(worker_switch, 3, 1, expected, timeout=100)
    assert all(r["choices"] and "dense" not in r["choices"] for r in results), results  # the model chose compression
    assert len({tuple(r["policies"]) for r in results}) == 1  # every rank ran the same policy every round
    # stats() says which policy each round ran (a trial's candidates, then the one kept)
    assert all(r["reported"] == r["policies"] for r in results), results
    assert {DENSE, MODEL} <= set(results[0]["reported"][8:25])
    assert len({tuple(map(tuple, r["switches"])) for r in results}) == 1
    assert all(r["policy"] == expected for r in results), results
    if expected == DENSE:  # the slow rank's model rounds decided it for everyone
        assert results[0]["switches"] and results[0]["switches"][0][1] == DENSE
        assert results[0]["policies"][-1] == DENSE


def test_a_planners_choices_and_online_state_come_back_from_its_state_dict() -> None:
    """A resumed ``auto`` run continues with the choices it had, not a new calibration's."""
    from gradwire.core.config import ExchangeConfig
    from gradwire.core.planner import Planner

    config = ExchangeConfig(compressor="topk", density=0.01, collective="auto")
    planner = Planner(config, config.build_sparsifier(), None, 4)
    planner.choices = {(1000, 3, 4): "sparse-allreduce", (50, 5): "dense"}
    planner.predictions = {(1000, 3, 4): {"dense": 0.2, "sparse-allreduce": 0.1}}
    planner.online.start_trial(12, [MODEL, DENSE])
    saved = planner.state_dict()
    restored = Planner(config, config.build_sparsifier(), None, 4)
    restored.load_state_dict(saved)
    assert restored.choices == planner.choices and restored.predictions == planner.predictions
    assert [restored.online.policy(r) for r in range(12, 20)] == [planner.online.policy(r) for r in range(12, 20)]
    assert Planner(config.replace(collective="allgather"), config.build_sparsifier(), None, 4).state_dict() is None
    with pytest.raises(ValueError, match="'planner' is malformed"):
        restored.load_state_dict({"choices": [["x", "dense"]]})


def test_a_trial_tries_each_strategy_of_a_mix_forced_on_every_layout() -> None:
    """The model prices layouts one by one; where it mixed the AllGather and the sparse AllReduce,
    each forced everywhere is a candidate (a mix pays both kinds of rounds in one step). A choice of
    one sparse strategy (and dense for small layouts) keeps the runner-up alone."""
    from gradwire.core.config import ExchangeConfig
    from gradwire.core.planner import Planner

    config = ExchangeConfig(compressor="topk", density=0.01, collective="auto")
    planner = Planner(config, config.build_sparsifier(), None, 4)
    seconds = {"dense": 0.3, "allgather": 0.1, "sparse-allreduce": 0.12}
    planner.predictions = {(1000, 3, 4): dict(seconds), (5000, 2): dict(seconds), (50, 5): dict(seconds)}
    planner.choices = {(1000, 3, 4): "allgather", (5000, 2): "sparse-allreduce", (50, 5): "dense"}
    assert planner._candidates(MODEL) == [MODEL, DENSE, "allgather", "sparse-allreduce"]
    planner.choices = {(1000, 3, 4): "allgather", (5000, 2): "allgather", (50, 5): "dense"}
    assert planner._candidates(MODEL) == [MODEL, DENSE, "sparse-allreduce"]
    planner.choices = {signature: "dense" for signature in planner.predictions}
    assert planner._candidates(DENSE) == [DENSE, "allgather"]
