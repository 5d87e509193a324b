"""What every exchange strategy shares: its context, its entry point, and the callback guard.

A strategy takes a :class:`~gradwire.hook.group.BucketGroup` whose gradients are selected (or
not, for dense ones), moves it between ranks and writes the averaged result into the group's
buffers. ``start(group)`` returns a Future that completes once the group is finished on this
rank: written, found non-finite, or failed. It never raises for a communication error and never
resolves DDP's Futures itself — the step's end does both, on every rank alike
(:mod:`gradwire.hook.step`).

Rules every strategy keeps, because ranks must issue collectives in the same order:

* collectives are launched from ``start`` (the hook's thread, in bucket order) or from
  ``settle`` (the same thread, at the step's last bucket), never from a completion callback;
* a completion callback calls ``future.value()`` first, so a failed collective is seen
  (:func:`guarded`), and records its outcome on the group instead of raising.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ...codecs.base import IndexCodec, ValueCodec
from ...errors import CollectiveError
from ...stats import ExchangeStats
from ..config import HookConfig
from ..group import BucketGroup


@dataclass
class ExchangeContext:
    """What strategies read: the options, the codecs, the group of ranks, the counters."""

    config: HookConfig
    value_codec: ValueCodec
    index_codec: IndexCodec
    process_group: Optional[dist.ProcessGroup]
    world_size: int
    rank: int
    stats: ExchangeStats
    step: int = 0


class ExchangeStrategy(ABC):
    """One way of averaging a group over ranks. Subclasses set ``name`` (used in stats and errors)."""

    name: str = "exchange"

    def __init__(self, context: ExchangeContext) -> None:
        self.context = context

    @abstractmethod
    def start(self, group: BucketGroup) -> torch.futures.Future:
        """Launch the exchange of ``group``; the Future completes when the group is finished here."""

    def settle(self) -> None:
        """At the step's last bucket, after every Future of the step completed: any second round."""

    def reset(self) -> None:
        """Forget what carries across steps (e.g. after loading a checkpoint on every rank)."""


def done_future(value: Any = None) -> torch.futures.Future:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(value)
    return future


def guarded(context: ExchangeContext, group: BucketGroup, collective: str, started: float,
            finish: Callable[[Any], None]) -> Callable[[torch.futures.Future], None]:
    """A completion callback for ``collective``: re-raise a failed collective as a
    :class:`CollectiveError` naming it and the step, run ``finish(value)`` otherwise; either
    way the outcome is recorded on ``group``, never raised into the backend's thread."""

    step = context.step

    def callback(future: torch.futures.Future) -> None:
        try:
            try:
                value = future.value()
            except BaseException as error:
                raise CollectiveError(f"{collective} failed at step {step}: {error}") from error
            context.stats.add("seconds_communicate", time.perf_counter() - started)
            finish(value)
        except BaseException as error:  # recorded; the step's end makes every rank fail together
            group.mark_failed(error)

    return callback


def run_guarded(group: BucketGroup, action: Callable[[], None]) -> None:
    """Run ``action`` on the hook's thread, recording (not raising) what it raises."""
    try:
        action()
    except BaseException as error:
        group.mark_failed(error)
