"""The end of a round: every rank finishes, agrees, and only then is the result used.

A round is what one front-end call covers: a DDP step's buckets, a ``GradientExchange``
synchronize, an FSDP module's reduce-scatter, a local-steps sync. At its end, on the
front-end's thread (:meth:`Round.wait`, then :meth:`Round.agree`):

1. wait for every exchange the round started, up to ``collective_timeout`` seconds, and finish
   each (decode, reduce, write) on this thread, so nothing the round started outlives it;
2. (the pipeline lets each strategy run its second rounds, e.g. frame overflow, in launch order;)
3. **agree**: one AllGather of ``[status, digest, *extras]`` per rank (int64 each). ``status`` is
   the worst outcome of this rank's groups (:class:`~gradwire.core.group.Status`); ``digest`` a
   63-bit hash of what it summed (``verify="digest"``, :mod:`.digest`: each group's own digest
   when its strategy set one, else its written result), equal on every rank unless something
   was corrupted in flight; ``extras`` whatever the front-end or planner wants every rank to see (measured times);
4. decide the same way on every rank (:class:`Verdict`):
   * some rank failed (a payload it could not decode, a collective that failed or timed out)
     -> every rank raises (its own error, or :class:`StepFailedError` naming the failed ranks);
   * the digests differ -> every rank raises :class:`DivergenceError` (e.g. a value corrupted in
     flight that still passed its checksum: the sender applied what it meant to send, the
     receivers what arrived);
   * some rank saw NaN/Inf -> every rank raises :class:`NonFiniteGradientError`
     (``nonfinite="raise"``) or skips the round (``"skip"``: the front-end zeroes its result);
   * else the error-feedback updates are applied and the verdict says apply.
   Residuals change only in the last case, so a failed or skipped round leaves every rank's
   memory as it was. The front-end resolves (DDP's Futures), raises or zeroes by the verdict.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..errors import CollectiveError, DivergenceError, NonFiniteGradientError, StepFailedError, collective_failed
from ..exchange.collectives import communication_device
from ..lifetime import wait_for
from .config import ExchangeConfig
from .digest import agree as digests_agree, combine, digest_of, xor
from .feedback import ErrorFeedback
from .group import Group, Status
from .stats import ExchangeStats
from .strategies.base import Exchange

APPLY, SKIP, RAISE = "apply", "skip", "raise"


@dataclass(frozen=True)
class Verdict:
    """What every rank does with a round: ``"apply"`` the result, ``"skip"`` it (zero it), or
    ``"raise"`` ``error``. ``extras``: every rank's extras from the agreement, by rank."""

    action: str
    error: Optional[BaseException] = None
    extras: list[list[int]] = field(default_factory=list)


class Round:
    """Finishes a round's groups on every rank alike (see the module docstring)."""

    def __init__(self, config: ExchangeConfig, process_group: Optional[dist.ProcessGroup], world_size: int,
                 stats: ExchangeStats, feedback: Optional[ErrorFeedback]) -> None:
        self.config = config
        self.process_group = process_group
        self.world_size = world_size
        self.stats = stats
        self.feedback = feedback

    def wait(self, groups: Sequence[Group], in_flight: Sequence[Exchange], step: int) -> None:
        """Step 1: every exchange of the round completes (or the round fails) within the timeout."""
        deadline = time.monotonic() + self.config.collective_timeout
        for exchange in in_flight:
            while not exchange.done():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    error = CollectiveError(
                        f"an exchange of step {step} did not complete within collective_timeout="
                        f"{self.config.collective_timeout} s: a peer may be dead, stuck, or training without "
                        "the gradwire hook")
                    for group in groups:
                        if group.status == Status.PENDING:
                            group.mark_failed(error)
                    return
                exchange.block(remaining)  # in the backend on the CPU: no wake-ups while gloo runs
            exchange.complete()

    def agree(self, groups: Sequence[Group], step: int, extras: Sequence[int] = ()) -> Verdict:
        """Steps 3-4: agree with the other ranks; apply error feedback only on success."""
        for group in groups:
            if group.status == Status.PENDING:  # a strategy that never finished its group is a bug
                group.mark_failed(RuntimeError(f"step {step}: an exchange ended without a result"))
        status = max((g.status for g in groups), default=Status.WRITTEN)
        balanced = any(g.balanced_digest for g in groups)  # shard groups (see .digest)
        digest = self._digest(groups) if status == Status.WRITTEN and self.config.verify == "digest" else 0
        try:
            statuses, digests, gathered_extras = self._agree(int(status), digest, list(extras), step)
        except BaseException as error:
            return Verdict(RAISE, error)
        if max(statuses) == Status.FAILED:
            failed = [rank for rank, s in enumerate(statuses) if s == Status.FAILED]
            own = next((g.error for g in groups if g.status == Status.FAILED), None)
            return Verdict(RAISE, own if own is not None else StepFailedError(
                f"step {step} failed on rank(s) {failed} (see their errors); no rank applies this step"),
                gathered_extras)
        if max(statuses) == Status.WRITTEN and self.config.verify == "digest" and balanced \
                and not digests_agree(digests, balanced=True):
            return Verdict(RAISE, DivergenceError(
                f"step {step}: some owner's shard differs from what its senders sent (a contribution corrupted "
                "in flight); no rank applies this step"), gathered_extras)
        if max(statuses) == Status.WRITTEN and self.config.verify == "digest" and not balanced \
                and len(set(digests)) > 1:
            differing = [rank for rank, d in enumerate(digests) if d != digests[0]]
            return Verdict(RAISE, DivergenceError(
                f"step {step}: the averaged gradients differ between ranks (ranks {differing} differ from "
                "rank 0), e.g. a payload corrupted in flight; no rank applies this step"), gathered_extras)
        if max(statuses) == Status.NONFINITE:
            self.stats.skipped_steps += 1
            if self.config.nonfinite == "raise":
                return Verdict(RAISE, NonFiniteGradientError(
                    f"NaN or Inf in gradients at step {step} on at least one rank "
                    "(nonfinite='raise'; use nonfinite='skip' to drop such steps)"), gathered_extras)
            return Verdict(SKIP, None, gathered_extras)
        self._apply_feedback(groups)
        return Verdict(APPLY, None, gathered_extras)

    # ------------------------------------------------------------------------------ pieces
    def _agree(self, status: int, digest: int, extras: list[int],
               step: int) -> tuple[list[int], list[int], list[list[int]]]:
        if self.world_size == 1:
            return [status], [digest], [extras]
        device = communication_device(self.process_group)
        mine = torch.tensor([status, digest, *extras], dtype=torch.int64, device=device)
        gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
        try:
            work = dist.all_gather(gathered, mine, group=self.process_group, async_op=True)
            wait_for(work, self.config.collective_timeout, f"step-end agreement of step {step}")
        except Exception as error:
            raise collective_failed("step-end agreement", step, error) from error
        rows = torch.stack(gathered).cpu().tolist()
        return [int(r[0]) for r in rows], [int(r[1]) for r in rows], [[int(x) for x in r[2:]] for r in rows]

    @staticmethod
    def _digest(groups: Sequence[Group]) -> int:
        """63 bits over the round's groups in order: a group's own ``digest`` when its strategy
        set one (what it summed, see :mod:`.digest`), else its written result; balanced shares
        (shard groups) are XORed, which keeps them balanced."""
        if any(group.balanced_digest for group in groups):
            return xor([group.digest if group.digest is not None else 0 for group in groups])
        return combine([group.digest if group.digest is not None else digest_of(group.target.results())
                        for group in groups])

    def _apply_feedback(self, groups: Sequence[Group]) -> None:
        if self.feedback is None:
            return
        for group in groups:
            for key in group.feedback_clears:
                self.feedback.clear(key)
            for key, residual in group.feedback_sets:
                self.feedback.replace(key, residual)
            for key, compensated, indices, sent in group.feedback_updates:
                self.feedback.update(key, compensated, indices, sent)
            for keys, numels, flat, positions, sent in group.feedback_flat_updates:
                self.feedback.update_pieces(keys, numels, flat, positions, sent)

