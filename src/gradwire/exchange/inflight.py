"""Collectives in flight, finished on the caller's thread.

:class:`Launched` is gradwire's answer to ``work.get_future().then(callback)``: it waits for its
``Work`` and runs the finishing function on the thread that asks for the result (the hook's), so
nothing of ours runs on a backend thread, and it holds the ``Work`` for as long as it is held
itself. Why both matter (a SIGABRT at interpreter exit otherwise): :mod:`gradwire.lifetime`; when
the hook completes what it launched: docs/architecture.md, "Rules the code keeps".
"""

from __future__ import annotations

import time
from typing import Any, Callable, Generic, Optional, TypeVar

from ..lifetime import track, wait_for

#: how long a waiter sleeps between two polls of a collective it cannot block on (off the CPU), or
#: after a blocking wait that returned early without completing (:meth:`Launched.block`)
POLL_SECONDS = 0.0005

T = TypeVar("T")
U = TypeVar("U")


class Launched(Generic[T]):
    """A collective started with ``async_op=True`` and what to make of its buffers once it completed.

    ``done()`` polls; ``result(timeout)`` waits (raising ``RuntimeError`` naming the collective if it
    failed or timed out, never reading buffers it did not write), then runs ``finish`` once, on the
    calling thread, and returns its value. ``map(fn)`` composes on the calling thread too.

    Args:
        work: the ``Work`` (None: nothing to wait for); held, and tracked for exit.
        finish: reads the buffers into the result, on the thread calling :meth:`result`.
        collective: its name, for errors.
    """

    def __init__(self, work: Any, finish: Callable[[], T], collective: str) -> None:
        self.work = work  # kept after completion: see the module docstring
        if work is not None:
            track(work)
        self.collective = collective
        self._finish: Optional[Callable[[], T]] = finish
        self._value: Any = None

    @classmethod
    def ready(cls, value: T, collective: str = "no collective") -> "Launched[T]":
        """Nothing to wait for (a world of one): ``result()`` is ``value``."""
        return cls(None, lambda: value, collective)

    def done(self) -> bool:
        """Whether the collective completed (polls; never waits)."""
        return self.work is None or bool(self.work.is_completed())

    def block(self, seconds: float) -> None:
        """Sleep until the collective completes (or fails), or ``seconds`` pass, whichever is first;
        never raises and never finishes: :meth:`result` reports a failure. A waiter that must
        keep a deadline of its own (the round's ``collective_timeout``) blocks in the backend
        (gloo's condition variable) instead of polling :meth:`done` with sleeps: on 2 cores shared
        by 4 ranks, ~60 wake-ups per step cost each rank 1.7-3.5 ms of CPU per step on the MLP
        (docs/benchmarks.md, "The round's wait")."""
        if self.work is None:
            return
        try:
            wait_for(self.work, seconds, self.collective, keep=False)
        except RuntimeError:  # failed, or still running after `seconds`: done() and result() tell which
            if not self.done():  # a wait that ends early without completing must not make its caller spin
                time.sleep(min(seconds, POLL_SECONDS))

    def result(self, timeout: Optional[float] = None) -> T:
        """Wait for the collective, then finish it once, on this thread.

        Args:
            timeout: seconds to wait at most (None: only the process group's own timeout).

        Returns:
            What ``finish`` returned; later calls return the same value without waiting.

        Raises:
            RuntimeError: the collective failed or outlasted ``timeout``, naming it; its buffers
                are then never read.
        """
        if self._finish is not None:
            if self.work is not None:
                wait_for(self.work, timeout, self.collective, keep=False)  # we hold it
            finish, self._finish = self._finish, None
            self._value = finish()
        return self._value

    def drop_result(self) -> None:
        """Forget the finished result (and so its tensors), keeping the ``Work``: for a holder that
        keeps this past its completion only for the Work (:mod:`gradwire.lifetime`). A later
        :meth:`result` returns None."""
        self._value = None

    def map(self, fn: Callable[[T], U]) -> "Launched[U]":
        """The same collective, its result passed through ``fn`` (on the thread calling ``result``)."""
        return Launched(self.work, lambda: fn(self.result()), self.collective)
