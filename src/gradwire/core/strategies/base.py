"""What every exchange strategy shares: its context, its entry point, and the exchange in flight.

A strategy takes a :class:`~gradwire.core.group.Group` whose gradients are selected (or not, for
dense ones), moves it between ranks and writes the reduced result into the group's target.
Every strategy has the same entry point, ``start(group)``: what differs between groups (this
rank's input is finite, the second selection's ``k``, whether selection ran) is state of the
group, and what differs between strategies is state of the strategy. ``start`` returns an
:class:`Exchange`: the collective in flight and what to do with its result. Completing it
(:meth:`Exchange.complete`, on the front-end's thread: as soon as it has arrived, else at the
round's end) finishes the group on this rank: written, found non-finite, or failed. It never
raises for a communication error and never resolves anything itself — the round's end decides,
on every rank alike (:mod:`gradwire.core.round`), and the front-end acts on the verdict.

Rules every strategy keeps:

* collectives are launched from ``start`` (the front-end's thread, in group order) or from
  ``settle`` (the same thread, at the round's end): ranks must issue them in one order;
* nothing runs on a backend thread (no ``Future.then``): a callback there can kill the process
  at interpreter exit (:mod:`gradwire.lifetime`);
* a collective's buffers are read only after its wait succeeded, so a failed collective is seen
  as a :class:`~gradwire.errors.CollectiveError` naming it and the step, recorded on the group.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch.distributed as dist

from ...codecs.base import IndexCodec, ValueCodec
from ...errors import CollectiveError, collective_failed
from ...exchange.checked import time_limit
from ...exchange.inflight import POLL_SECONDS, Launched
from ..group import Group, Status
from ..stats import ExchangeStats


@dataclass
class ExchangeContext:
    """What strategies read: the codecs, the group of ranks, the counters and the few options
    that change how an exchange runs (not the whole config).

    Args:
        timeout: seconds each blocking round may take (``collective_timeout``).
        dense_fallback: a payload exchange may fall back to dense when its real payloads turn out
            larger than a dense AllReduce would send (``collective="auto"``).
        hierarchy: ranks per node for the hierarchical exchange (None, ``"auto"`` or an int).
    """

    value_codec: ValueCodec
    index_codec: IndexCodec
    process_group: Optional[dist.ProcessGroup]
    world_size: int
    rank: int
    stats: ExchangeStats
    timeout: float
    dense_fallback: bool = False
    hierarchy: Any = None
    step: int = 0


class ExchangeStrategy(ABC):
    """One way of averaging a group over ranks. Subclasses set ``name`` (used in stats and errors)."""

    name: str = "exchange"

    def __init__(self, context: ExchangeContext) -> None:
        self.context = context

    @abstractmethod
    def start(self, group: Group) -> "Exchange":
        """Launch the exchange of ``group``; completing the result finishes the group here."""

    def settle(self) -> None:
        """At the round's end, after every exchange of the round completed: any second round."""

    def reset(self) -> None:
        """Forget what carries across steps (e.g. after loading a checkpoint on every rank)."""


class DeferredStrategy(ExchangeStrategy):
    """A strategy whose rounds depend on one another's results, so each waits on the wire before the
    next can start (the sparse AllReduce, the hierarchical exchange). ``start`` only records the group
    (it stays pending and nothing moves); :meth:`settle` runs the round's groups at its end, in start
    order, blocking on the front-end's thread. Inside the backward, such rounds made the ranks wait
    for one another at every bucket (the time one rank's backward ran ahead of the other's); at the
    round's end they wait once, as the asynchronous strategies' ranks do at the agreement.
    Subclasses implement :meth:`_run`, which exchanges one group and raises on failure."""

    def __init__(self, context: ExchangeContext) -> None:
        super().__init__(context)
        #: the groups started in this round, exchanged by settle() in this order
        self._deferred: list[Group] = []

    def start(self, group: Group) -> "Exchange":
        """Record ``group`` for :meth:`settle`; nothing moves yet."""
        self._deferred.append(group)
        return Exchange(self.context, group)

    def settle(self) -> None:
        """Exchange the round's groups in start order (the same on every rank), each within
        ``collective_timeout``. Every started group runs its rounds, so every rank issues the same
        collectives, unless one failed on the wire: the rest are then failed with its error without
        running (their peers see the failure too, or time out once, not once per group). A group
        the round already failed (its wait timed out) exchanges but stays failed."""
        groups, self._deferred = self._deferred, []
        broken: Optional[BaseException] = None
        with time_limit(self.context.timeout):
            for group in groups:
                if broken is not None:
                    group.mark_failed(broken)
                    continue
                failed_before = group.error if group.status == Status.FAILED else None
                run_guarded(group, lambda: self._run(group))
                if failed_before is not None:  # written or not, what the round decided stands
                    group.status, group.error = Status.FAILED, failed_before
                elif group.status == Status.FAILED and isinstance(group.error, CollectiveError):
                    broken = group.error

    def reset(self) -> None:
        self._deferred = []

    @abstractmethod
    def _run(self, group: Group) -> None:
        """Exchange ``group`` and write it (or mark it non-finite); raise on failure."""


class Exchange:
    """One group's exchange in flight: ``launched`` (None: nothing in flight, the group is already
    finished or failed) and ``finish(value)``, which averages its result into the group.

    Holding an Exchange holds its collective's ``Work``; the front-end lets go of a round's
    exchanges when the next round starts, so a backend thread never frees their tensors (see
    :mod:`gradwire.lifetime`)."""

    def __init__(self, context: ExchangeContext, group: Group, launched: Optional[Launched] = None,
                 finish: Optional[Callable[[Any], None]] = None, *, book_seconds: bool = True) -> None:
        self.context, self.group, self.launched, self.finish = context, group, launched, finish
        #: whether completing books launch-to-completion as ``seconds_communicate`` (False: the
        #: front-end books the wait itself, when other work ran between launch and completion)
        self.book_seconds = book_seconds
        self.step = context.step
        self.started = time.perf_counter()
        self.completed = launched is None

    def works(self) -> list[Any]:
        """The collective ``Work`` this exchange started asynchronously (none for a blocking one,
        whose works :func:`gradwire.lifetime.keep_alive` holds). What a front-end keeps after its
        round instead of the exchange: the ``Work`` must outlive the backend's reference to it
        (:mod:`gradwire.lifetime`), while the group, the decoded result and the error-feedback
        records need not (top-k 10% under FSDP2 held about 55 MB more per rank for them until the
        next step's end: docs/fsdp.md, "Peak memory per rank")."""
        launched = self.launched
        return [launched.work] if launched is not None and launched.work is not None else []

    def done(self) -> bool:
        """Whether :meth:`complete` would return without waiting on the wire."""
        return self.completed or self.launched.done()

    def block(self, seconds: float) -> None:
        """Sleep until the collective completes or fails, at most ``seconds``; finishes nothing.
        On the CPU it blocks in the backend (:meth:`~gradwire.exchange.inflight.Launched.block`);
        elsewhere it sleeps one poll interval, as before (NCCL's ``Work.wait`` only orders streams
        unless blocking waits are configured, so there the poll is what waits)."""
        if self.completed:
            return
        if self.group.device.type == "cpu":
            self.launched.block(seconds)
        else:
            time.sleep(min(seconds, POLL_SECONDS))

    def complete(self, timeout: Optional[float] = None) -> None:
        """Wait up to ``timeout`` seconds, then finish the group; a failed or late collective
        marks the group failed (the round's end then fails every rank together), never raises."""
        if self.completed:
            return
        self.completed = True
        launched = self.launched
        try:
            try:
                value = launched.result(timeout)
            except BaseException as error:
                raise collective_failed(launched.collective, self.step, error) from error
            if self.book_seconds:  # launch to completion as the hook's thread saw it: an upper bound on the wire
                self.context.stats.add("seconds_communicate", time.perf_counter() - self.started)
            if self.finish is not None:
                self.finish(value)
        except BaseException as error:  # recorded; the round's end makes every rank fail together
            self.group.mark_failed(error)
        finally:
            # the result is in the group now; a front-end holding the exchange until its round's
            # agreement (FSDP2: every module's, the step long) must not hold its buffers too
            launched.drop_result()


def run_guarded(group: Group, action: Callable[[], None]) -> None:
    """Run ``action`` on the front-end's thread, recording (not raising) what it raises."""
    try:
        action()
    except BaseException as error:
        group.mark_failed(error)
