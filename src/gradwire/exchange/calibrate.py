"""Measure a group's α (seconds per round) and β (seconds per byte) at start-up, agreed by all ranks.

Two AllReduces of float32 tensors, a tiny one and one of ``large_bytes``, timed ``repeats`` times
each (best of, after a warm-up); a ring AllReduce over p ranks takes ``2(p-1) α + 2(p-1)/p · m β``
for ``m`` bytes, which gives α from the tiny one and β from the difference. Every rank's estimate
differs, so the ranks take the maximum of each (one more AllReduce): every rank then holds the same
:class:`~.alphabeta.Link` and :func:`~.alphabeta.choose` picks the same strategy everywhere.
Blocking; every rank of ``group`` must call it at the same point. Times are wall-clock: on a loaded
machine they are noisy, which is why the choice they feed never trades dense for a near tie.
"""

from __future__ import annotations

import time
from typing import Optional

import torch
import torch.distributed as dist

from .alphabeta import Link
from .checked import group_size, wait_checked
from .collectives import communication_device

WHAT = "measure_link"


def _timed_allreduce(tensor: torch.Tensor, group: Optional[dist.ProcessGroup], repeats: int) -> float:
    best = float("inf")
    for attempt in range(repeats + 1):  # the first is a warm-up (connections, allocations)
        start = time.perf_counter()
        work = dist.all_reduce(tensor, group=group, async_op=True)
        wait_checked(work, WHAT, "all_reduce (timing)")
        if tensor.is_cuda:
            torch.cuda.synchronize()
        if attempt:
            best = min(best, time.perf_counter() - start)
    return best


def measure_link(group: Optional[dist.ProcessGroup] = None, *, large_bytes: int = 1 << 20, repeats: int = 3) -> Link:
    """The group's :class:`Link`, identical on every rank (``Link(0, 0)`` for a group of one).

    Args:
        group: the process group (None: the default one); every member must call.
        large_bytes: the large AllReduce's size in bytes, >= 64 (default 1 MiB).
        repeats: timed repetitions of each AllReduce, best taken, >= 1.

    Returns:
        α and β, the maximum over the ranks of each.

    Raises:
        ValueError: ``large_bytes`` or ``repeats`` out of range.
        CollectiveError: an AllReduce failed.
    """
    size = group_size(group)
    if size == 1:
        return Link(0.0, 0.0)
    if large_bytes < 64 or repeats < 1:
        raise ValueError(f"large_bytes={large_bytes} must be >= 64 and repeats={repeats} >= 1")
    device = communication_device(group)
    small = _timed_allreduce(torch.zeros(1, device=device), group, repeats)
    large = _timed_allreduce(torch.zeros(large_bytes // 4, device=device), group, repeats)
    alpha = small / (2 * (size - 1))
    beta = max(large - small, 0.0) / (2 * (size - 1) / size * (large_bytes - 4))
    agreed = torch.tensor([alpha, beta], dtype=torch.float64, device=device)
    wait_checked(dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group, async_op=True), WHAT, "all_reduce (agree)")
    alpha, beta = (float(v) for v in agreed.cpu().tolist())
    return Link(alpha, beta)
