"""The frame-size protocol of the one-round payload AllGather.

Once a group layout has been seen, its payloads travel in frames of an agreed size (length and
payload together, no length round). Every rank must use the same size, so sizes derive only
from lengths every rank has seen (the gathered lengths), never from a rank's own payload:

* the first time, sizes are unknown (``capacity`` is None): the caller exchanges lengths first;
* after each exchange, :meth:`FrameSizes.learn` sets the next size to the longest payload plus
  ``headroom`` (ordinary step-to-step variation plus the sparsifier's own count tolerance) and
  ``slack_bytes``; a smaller need shrinks the frame by at most ``1 - shrink`` per step, so a
  lucky step does not cause overflows on the next;
* :meth:`forget` (a layout that went dense) and :meth:`reset` (a checkpoint was loaded: every
  rank restarts from a length round together).
"""

from __future__ import annotations

import math
from typing import Hashable, Optional, Sequence

#: Frame size relative to the longest payload seen (before the sparsifier's count tolerance).
FRAME_HEADROOM = 0.1
FRAME_SLACK_BYTES = 64
#: An oversized frame shrinks by this factor per step toward its payloads.
FRAME_SHRINK = 0.95


class FrameSizes:
    """Agreed frame capacity (payload bytes, excluding the length header) per group layout."""

    def __init__(self, headroom: float = FRAME_HEADROOM, slack_bytes: int = FRAME_SLACK_BYTES,
                 shrink: float = FRAME_SHRINK) -> None:
        if headroom < 0 or slack_bytes < 0 or not 0 < shrink <= 1:
            raise ValueError(f"headroom={headroom} and slack_bytes={slack_bytes} must be >= 0 and "
                             f"shrink={shrink} in (0, 1]")
        self.headroom, self.slack_bytes, self.shrink = headroom, slack_bytes, shrink
        self._capacity: dict[Hashable, int] = {}

    def capacity(self, layout: Hashable) -> Optional[int]:
        """The agreed size for ``layout``, or None before its first length round."""
        return self._capacity.get(layout)

    def learn(self, layout: Hashable, lengths: Sequence[int]) -> int:
        """Next size for ``layout`` from the lengths of all ranks (the same on every rank)."""
        wanted = math.ceil(max(lengths) * (1.0 + self.headroom)) + self.slack_bytes
        current = self._capacity.get(layout)
        if current is not None and wanted < current:
            wanted = max(wanted, int(current * self.shrink))
        self._capacity[layout] = wanted
        return wanted

    def forget(self, layout: Hashable) -> None:
        self._capacity.pop(layout, None)

    def reset(self) -> None:
        self._capacity.clear()

    def __len__(self) -> int:
        return len(self._capacity)
