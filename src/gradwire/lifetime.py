"""Collectives whose ``Work`` stays referenced from Python after it completed, and why.

A backend thread (gloo's ``pt_gloo_runloop`` workers, NCCL's watchdog) drops its own reference to a
``Work`` just after marking it complete. If that is the last reference, the ``Work`` is destroyed
on that thread, and with it the launching thread's saved state and the collective's tensors, which
hold Python objects: freeing them takes the GIL. A backend thread that needs the GIL while the
interpreter shuts down (a script that returns right after ``destroy_process_group()``) is stopped
by Python inside a C++ destructor, and the process dies with SIGABRT ("terminate called without an
active exception") instead of exiting 0. A ``Future.then`` callback is worse: it runs on that
thread and is destroyed there, taking the GIL, every time.

The backtrace of such an abort (a core dump of ``scripts/exit_trials.py`` before this module):
``ProcessGroupGloo::runLoop`` -> ``~AsyncAllgatherWork`` -> ``at::ThreadLocalState::~ThreadLocalState``
-> ``SafePyObject`` decref -> ``gil_scoped_acquire`` -> ``take_gil`` -> ``PyThread_exit_thread``
(the interpreter is finalizing) -> forced unwind through a destructor -> ``std::terminate``.

So gradwire never passes a callback to a backend (see :mod:`gradwire.exchange.inflight`) and keeps
every ``Work`` it starts referenced from Python: asynchronous ones by whoever holds them (the hook
lets go of a step's at the next step's first bucket; :func:`track` notes them), blocking ones by
:func:`keep_alive`'s short queue of recent works. The backend thread's release is then never the
last one, and Python frees the ``Work`` on its own thread, while it is alive. At exit, before the
interpreter starts finalizing, an ``atexit`` handler gives each work still held one reference that
is never released: Python's own teardown must not be the one that leaves the last reference to a
backend thread still letting go of it. The process is ending; the OS takes the memory back.
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import datetime
import time
import weakref
from typing import Any, Deque, Optional

import torch.distributed as dist

#: Blocking rounds' works kept after completion (mostly small: lengths, counts, statuses, the
#: sparse exchange's regions); once this many later ones were waited for, an old one's backend thread
#: has long let go of it.
RECENT_WORKS = 16
#: the shortest limit :func:`wait_for` passes to ``Work.wait`` (c10d's unit, and its 0 means none)
_SHORTEST_WAIT_SECONDS = 1e-3

_recent: Deque[Any] = collections.deque(maxlen=RECENT_WORKS)
#: asynchronous works, held by their owners (weakly here: only to find them at exit)
_tracked: "weakref.WeakSet[Any]" = weakref.WeakSet()


def keep_alive(work: Any) -> None:
    """Hold a reference to ``work`` (and so to its tensors) until :data:`RECENT_WORKS` later ones
    were kept: the backend thread that ran it must not be the one to free them (module docstring)."""
    _recent.append(work)


def track(work: Any) -> None:
    """Note an asynchronous ``work`` its caller holds, so that exit never frees it (module docstring)."""
    _tracked.add(work)


@atexit.register
def _never_free_at_exit() -> None:
    for work in [*_recent, *_tracked]:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(work))


def wait_for(work: Any, timeout: Optional[float], collective: str, *, keep: bool = True) -> Any:
    """Block until ``work`` (a ``dist`` Work) completes.

    Args:
        work: what a ``dist`` collective started with ``async_op=True`` returned.
        timeout: seconds to wait at most (None: no limit here, only the process group's own).
        collective: its name, for the error message.
        keep: False when the caller holds ``work`` itself (no place in the recent queue).

    Returns:
        What ``work.wait()`` returned (some backends report failure as False).

    Raises:
        RuntimeError: the collective failed or outlasted ``timeout``; the message says which
            limit ended it (see :func:`describe_failure`).
    """
    if keep:
        keep_alive(work)
    started = time.monotonic()
    try:
        if timeout is None:
            return work.wait()
        # c10d counts the limit in whole milliseconds and reads 0 ms as "no limit": a limit under
        # 1 ms (what is left of a deadline) must not become an unbounded wait
        return work.wait(timeout=datetime.timedelta(seconds=max(timeout, _SHORTEST_WAIT_SECONDS)))
    except Exception as error:
        raise RuntimeError(f"{collective} {describe_failure(timeout, time.monotonic() - started)}: {error}") from error


def describe_failure(timeout: Optional[float], elapsed: float) -> str:
    """What ended a wait of ``elapsed`` seconds under ``timeout``, as far as the clock can tell.

    The limit set here is only one of the limits: the process group's own timeout (gloo's default
    30 minutes, often set lower) fires on its own, and a dead peer fails a collective at once. A
    message that named ``timeout`` whatever happened read "within None s", or "within 120.0 s"
    when gloo's 60 s had fired; the backend's own error, appended by the caller, says the rest.

    Args:
        timeout: the limit the wait had, in seconds (None: none set here).
        elapsed: how long it waited, in seconds.

    Returns:
        A phrase to follow the collective's name, e.g. "did not complete within the 30 s limit
        set for it".
    """
    if timeout is not None and elapsed >= timeout:
        return f"did not complete within the {timeout:g} s limit set for it"
    limit = "no time limit was set here" if timeout is None else f"before its {timeout:g} s limit"
    return (f"failed after {elapsed:.1f} s ({limit}: the process group's own timeout or a failed peer "
            "ended it)")


def barrier(group: Any = None, timeout: Optional[float] = None) -> None:
    """``dist.barrier`` whose ``Work`` is kept alive (see the module docstring).

    Args:
        group: the process group (None: the default one).
        timeout: seconds to wait at most (None: only the process group's own timeout).

    Raises:
        RuntimeError: the barrier failed or outlasted ``timeout`` (:func:`wait_for`).
    """
    wait_for(dist.barrier(group=group, async_op=True), timeout, "barrier")
