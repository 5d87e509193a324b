"""The end of a step: every rank finishes, agrees, and only then hands DDP its gradients.

At the step's last bucket, on the hook's thread (:meth:`StepEnd.finish`):

1. wait for every exchange the step started, up to ``collective_timeout`` seconds, and finish
   each (decode, average, write) on this thread, so nothing the hook started outlives the step;
2. let each strategy run its second rounds (frame overflow), in launch order;
3. **agree**: one AllGather of ``[status, digest]`` per rank (16 bytes each). ``status`` is the
   worst outcome of this rank's groups (0 written, 1 non-finite, 2 failed); ``digest`` is a
   63-bit hash of the averaged gradients it is about to hand DDP (``verify="digest"``);
4. decide the same way on every rank:
   * some rank failed (a payload it could not decode, a collective that failed or timed out)
     -> every rank raises (its own error, or :class:`StepFailedError` naming the failed ranks);
   * the digests differ -> every rank raises :class:`DivergenceError` (e.g. a value corrupted in
     flight that still passed its checksum: the sender applied what it meant to send, the
     receivers what arrived);
   * some rank saw NaN/Inf -> every rank raises :class:`NonFiniteGradientError`
     (``nonfinite="raise"``) or zeroes the step's gradients (``"skip"``);
   * else the error-feedback updates are applied and DDP's Futures resolved.
   Residuals change only in the last case, so a failed or skipped step leaves every rank's
   memory as it was.
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

import torch
import torch.distributed as dist
import xxhash

from ..errors import CollectiveError, DivergenceError, StepFailedError
from ..exchange.collectives import communication_device
from ..lifetime import wait_for
from ..feedback import ErrorFeedback
from ..stats import ExchangeStats
from .config import HookConfig
from .group import BucketGroup
from .strategies.base import Exchange

STATUS_WRITTEN, STATUS_NONFINITE, STATUS_FAILED = 0, 1, 2
_STATUS = {"written": STATUS_WRITTEN, "nonfinite": STATUS_NONFINITE, "failed": STATUS_FAILED}
_POLL_SECONDS = 0.0005


class NonFiniteGradientError(FloatingPointError):
    """A gradient held NaN or Inf on some rank (raised on every rank, together)."""


class StepEnd:
    """Finishes a step's groups on every rank alike (see the module docstring)."""

    def __init__(self, config: HookConfig, process_group: Optional[dist.ProcessGroup], world_size: int,
                 stats: ExchangeStats, feedback: Optional[ErrorFeedback]) -> None:
        self.config = config
        self.process_group = process_group
        self.world_size = world_size
        self.stats = stats
        self.feedback = feedback

    def wait(self, groups: Sequence[BucketGroup], in_flight: Sequence[Exchange], step: int) -> None:
        """Step 1: every exchange of the step completes (or the step fails) within the timeout."""
        deadline = time.monotonic() + self.config.collective_timeout
        for exchange in in_flight:
            while not exchange.done():
                if time.monotonic() > deadline:
                    error = CollectiveError(
                        f"an exchange of step {step} did not complete within collective_timeout="
                        f"{self.config.collective_timeout} s: a peer may be dead, stuck, or training without "
                        "the gradwire hook")
                    for group in groups:
                        if group.status == "pending":
                            group.mark_failed(error)
                    return
                time.sleep(_POLL_SECONDS)
            exchange.complete()

    def finish(self, groups: Sequence[BucketGroup], step: int) -> None:
        """Steps 3-4: agree with the other ranks, then resolve or fail DDP's Futures."""
        for group in groups:
            if group.status == "pending":  # a strategy that never finished its group is a bug
                group.mark_failed(RuntimeError(f"step {step}: an exchange ended without a result"))
        status = max((_STATUS[g.status] for g in groups), default=STATUS_WRITTEN)
        digest = self._digest(groups) if status == STATUS_WRITTEN and self.config.verify == "digest" else 0
        try:
            statuses, digests = self._agree(status, digest, step)
        except BaseException as error:
            self._fail_all(groups, error)
            return
        if max(statuses) == STATUS_FAILED:
            failed = [rank for rank, s in enumerate(statuses) if s == STATUS_FAILED]
            own = next((g.error for g in groups if g.status == "failed"), None)
            self._fail_all(groups, own if own is not None else StepFailedError(
                f"step {step} failed on rank(s) {failed} (see their errors); no rank applies this step"))
            return
        if max(statuses) == STATUS_WRITTEN and self.config.verify == "digest" and len(set(digests)) > 1:
            differing = [rank for rank, d in enumerate(digests) if d != digests[0]]
            self._fail_all(groups, DivergenceError(
                f"step {step}: the averaged gradients differ between ranks (ranks {differing} differ from "
                "rank 0), e.g. a payload corrupted in flight; no rank applies this step"))
            return
        if max(statuses) == STATUS_NONFINITE:
            self.stats.skipped_steps += 1
            if self.config.nonfinite == "raise":
                self._fail_all(groups, NonFiniteGradientError(
                    f"NaN or Inf in gradients at step {step} on at least one rank "
                    "(nonfinite='raise'; use nonfinite='skip' to drop such steps)"))
                return
            for group in groups:
                group.resolve_zero()
            return
        self._apply_feedback(groups)
        for group in groups:
            group.resolve()

    # ------------------------------------------------------------------------------ pieces
    def _agree(self, status: int, digest: int, step: int) -> tuple[list[int], list[int]]:
        if self.world_size == 1:
            return [status], [digest]
        device = communication_device(self.process_group)
        mine = torch.tensor([status, digest], dtype=torch.int64, device=device)
        gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
        try:
            work = dist.all_gather(gathered, mine, group=self.process_group, async_op=True)
            wait_for(work, self.config.collective_timeout, f"step-end agreement of step {step}")
        except Exception as error:
            raise CollectiveError(f"step-end agreement failed at step {step}: {error}") from error
        rows = torch.stack(gathered).cpu().tolist()
        return [int(r[0]) for r in rows], [int(r[1]) for r in rows]

    @staticmethod
    def _digest(groups: Sequence[BucketGroup]) -> int:
        """63 bits of xxh3 over the step's averaged gradients, in bucket order (CPU buffers are
        hashed in place; CUDA ones by an exact integer checksum of their bit patterns)."""
        hasher = xxhash.xxh3_64()
        for group in groups:
            for buffer in group.buffers:
                flat = buffer.detach().reshape(-1)
                if flat.device.type == "cpu":
                    hasher.update(memoryview(flat.contiguous().view(torch.uint8).numpy()))
                else:
                    words = flat.contiguous().view(torch.uint8)
                    pad = (-words.numel()) % 4
                    if pad:
                        words = torch.cat([words, words.new_zeros(pad)])
                    ints = words.view(torch.int32).to(torch.int64)
                    weights = torch.arange(1, ints.numel() + 1, device=ints.device, dtype=torch.int64) % 65521 + 1
                    hasher.update(int((ints * weights).sum()).to_bytes(16, "little", signed=True))
        return hasher.intdigest() >> 1

    def _apply_feedback(self, groups: Sequence[BucketGroup]) -> None:
        if self.feedback is None:
            return
        for group in groups:
            for key in group.feedback_clears:
                self.feedback.clear(key)
            for key, residual in group.feedback_sets:
                self.feedback.replace(key, residual)
            for key, compensated, indices, sent in group.feedback_updates:
                self.feedback.update(key, compensated, indices, sent)

    @staticmethod
    def _fail_all(groups: Sequence[BucketGroup], error: BaseException) -> None:
        for group in groups:
            group.fail(error)
