"""Source rules behind clean exits (gradwire.lifetime): nothing of gradwire runs on a backend
thread, and no collective's Work is left for a backend thread to free.

The abort they prevent is a race at interpreter exit (about 1 run in 30 before the fix, see
``scripts/exit_trials.py``); it is too rare for a test to catch, so these check the cause instead.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
import torch

from gradwire.exchange.inflight import Launched
from gradwire.lifetime import RECENT_WORKS, _never_free_at_exit, _recent, keep_alive

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "gradwire"

#: torch.distributed calls that start a collective (and return a Work with async_op=True)
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "all_to_all", "all_to_all_single",
               "barrier", "broadcast", "gather", "scatter", "reduce", "reduce_scatter", "reduce_scatter_tensor",
               "send", "recv", "isend", "irecv", "all_gather_object", "broadcast_object_list", "gather_object"}


def _calls(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            yield node


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_callback_is_ever_handed_to_a_backend_future() -> None:
    offenders = [f"{path.relative_to(PACKAGE)}:{call.lineno}" for path in _sources() for call in _calls(path)
                 if call.func.attr in ("then", "add_done_callback")]
    assert offenders == [], f"Future.then/add_done_callback runs Python on a backend thread: {offenders}"


def test_every_collective_is_started_async_and_so_its_work_can_be_kept() -> None:
    """A blocking ``dist.all_reduce(t)`` drops its Work inside the call: the backend thread may free
    it (taking the GIL) after the interpreter began shutting down."""
    offenders = []
    for path in _sources():
        for call in _calls(path):
            if (isinstance(call.func.value, ast.Name) and call.func.value.id == "dist"
                    and call.func.attr in COLLECTIVES):
                asynchronous = any(k.arg == "async_op" and isinstance(k.value, ast.Constant) and k.value.value is True
                                   for k in call.keywords)
                if not asynchronous:
                    offenders.append(f"{path.relative_to(PACKAGE)}:{call.lineno} dist.{call.func.attr}")
    assert offenders == [], f"collectives started without async_op=True (use gradwire.lifetime): {offenders}"


def test_keep_alive_holds_the_most_recent_works_only() -> None:
    works = [torch.zeros(1) for _ in range(RECENT_WORKS + 3)]  # stand-ins: anything referenced
    for work in works:
        keep_alive(work)
    held = list(_recent)
    assert held == works[-RECENT_WORKS:]
    assert all(work is not works[0] for work in held)


class _Work:
    """A stand-in for a dist Work: referenced, weakly referenceable, completed."""

    def is_completed(self) -> bool:
        return True

    def wait(self, timeout=None) -> bool:
        return True


def test_exit_never_frees_a_work_still_held() -> None:
    held, recent = _Work(), _Work()
    launched = Launched(held, lambda: None, "test")  # tracks its work
    keep_alive(recent)
    counts = sys.getrefcount(held), sys.getrefcount(recent)
    _never_free_at_exit()  # what atexit runs: one reference each that is never given back (a leak of two tiny objects)
    assert (sys.getrefcount(held), sys.getrefcount(recent)) == (counts[0] + 1, counts[1] + 1)
    assert launched.work is held


def test_launched_finishes_on_the_calling_thread_once() -> None:
    calls = []
    launched = Launched(None, lambda: calls.append("finish") or 7, "test")
    doubled = launched.map(lambda value: value * 2)
    assert launched.done()
    assert doubled.result() == 14 and launched.result() == 7
    assert calls == ["finish"]


def test_launched_ready_needs_no_collective() -> None:
    assert Launched.ready([1, 2]).result() == [1, 2]


@pytest.mark.parametrize("name", ["then", "add_done_callback"])
def test_the_callback_rule_would_catch_an_offender(tmp_path: Path, name: str) -> None:
    source = tmp_path / "offender.py"
    source.write_text(f"def f(work):\n    return work.get_future().{name}(print)\n")
    assert [call.func.attr for call in _calls(source)].count(name) == 1


def _timeout_worker(rank: int, world_size: int) -> dict:
    """Rank 0 waits on collectives that rank 1 joins late or never: under its own limit, with no
    limit, and under a limit longer than the group's own 2 s timeout."""
    import datetime
    import time

    import torch.distributed as dist

    from gradwire.exchange.checked import time_limit, wait_checked
    from gradwire.lifetime import wait_for

    # every rank builds the groups (a collective); only rank 0 ever calls a collective in them
    short = [dist.new_group(timeout=datetime.timedelta(seconds=2)) for _ in range(3)]
    if rank == 1:
        time.sleep(2.0)
        dist.all_reduce(torch.ones(1), async_op=True).wait()  # the late join of rank 0's first wait
        time.sleep(9.0)  # alive while rank 0's short groups time out
        return {}

    def message(run) -> str:
        try:
            run()
        except RuntimeError as error:
            return str(error)
        return ""

    late = dist.all_reduce(torch.ones(1), async_op=True)
    messages = {"own limit": message(lambda: wait_for(late, 0.5, "AllReduce"))}
    late.wait()
    messages["no limit"] = message(lambda: wait_for(
        dist.all_reduce(torch.ones(1), group=short[0], async_op=True), None, "AllReduce"))
    messages["group first"] = message(lambda: wait_for(
        dist.all_reduce(torch.ones(1), group=short[1], async_op=True), 30.0, "AllReduce"))
    with time_limit(30.0):
        messages["checked"] = message(lambda: wait_checked(
            dist.all_reduce(torch.ones(1), group=short[2], async_op=True), "step 3", "AllReduce"))
    return messages


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_timeout_messages_state_the_limit_that_applied() -> None:
    """Not "within None s" without a limit, nor "within 30 s" when the group's own 2 s fired."""
    import re

    from tests.distributed import run_workers

    messages = run_workers(_timeout_worker, 2, timeout=50, pg_timeout=30)[0]
    assert messages["own limit"].startswith("AllReduce did not complete within the 0.5 s limit set for it: ")
    for case, limit in (("no limit", "no time limit was set here"), ("group first", "before its 30 s limit")):
        found = re.match(r"AllReduce failed after ([0-9.]+) s \((.*?):", messages[case])
        assert found and found.group(2) == limit, messages[case]
        assert 1.5 <= float(found.group(1)) < 30  # the group's 2 s timeout, not a limit set here
        assert "within" not in messages[case] and "None" not in messages[case]
    assert messages["checked"].startswith("step 3: AllReduce failed after ")
    assert "before its 30 s limit" in messages["checked"] and "time limit 30" not in messages["checked"]


class _RecordingWork(_Work):
    """A stand-in that records the limit it was asked to wait under."""

    def wait(self, timeout=None) -> bool:
        self.timeout = timeout
        return True


@pytest.mark.parametrize("seconds", [0.0, 0.0004])
def test_a_limit_under_a_millisecond_is_still_a_limit(seconds: float) -> None:
    """c10d counts whole milliseconds and reads 0 ms as "no limit": what is left of a deadline
    (a fraction of a millisecond) must not turn into an unbounded wait."""
    import datetime

    from gradwire.lifetime import wait_for

    work = _RecordingWork()
    wait_for(work, seconds, "AllReduce", keep=False)
    assert work.timeout >= datetime.timedelta(milliseconds=1)


def _late_peer_worker(rank: int, world_size: int) -> dict:
    """A dense round whose peer starts 1 s late: rank 0 waits for it at the round's end."""
    import time

    from gradwire.core.config import ExchangeConfig
    from gradwire.core.group import BufferTarget, Entry, Group
    from gradwire.core.pipeline import Pipeline

    polls = []
    done = Launched.done

    def counted(self: Launched) -> bool:  # this process only: counts how often the round asks
        polls.append(1)
        return done(self)

    Launched.done = counted  # type: ignore[method-assign]
    pipeline = Pipeline(ExchangeConfig(compressor="topk", density=0.05, collective="dense",
                                       collective_timeout=20.0))
    pipeline.check_config()
    buffer = torch.full((50_000,), float(rank + 1))
    group = Group(BufferTarget([buffer]), [Entry(0, 0, buffer, 0)], divisor=2.0)
    if rank == 1:
        time.sleep(1.0)
    started = time.perf_counter()
    exchange = pipeline.start(group, 0)
    pipeline.complete([group], [exchange], 0)
    waited = time.perf_counter() - started
    verdict = pipeline.agree([group], 0)
    return {"polls": len(polls), "waited": waited, "action": verdict.action, "first": buffer[0].item()}


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_the_round_waits_for_a_late_peer_in_the_backend_not_by_polling() -> None:
    """Polling every 0.5 ms asked ~2000 times over the late peer's second (each wake-up CPU that
    4 ranks on 2 cores take from one another); waiting in gloo asks a few times."""
    from tests.distributed import run_workers

    results = run_workers(_late_peer_worker, 2, timeout=50)
    assert [r["action"] for r in results] == ["apply", "apply"]
    assert [r["first"] for r in results] == [1.5, 1.5]
    assert results[0]["waited"] >= 0.8  # rank 0 did wait for its peer
    assert results[0]["polls"] < 20, results[0]
