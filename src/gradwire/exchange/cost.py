"""Bytes each worker sends per collective, and the choice between the payload AllGather and dense.

Ring AllReduce of ``n`` elements of ``s`` bytes: ``2 (p-1)/p * n s`` bytes per worker.
AllGather of payloads padded to the largest, ``B_max``: ``(p-1) * B_max`` per worker (ring), plus
a tiny AllGather of the lengths (``rounds=2``), or none for frames of a known size (``rounds=1``).
A fixed per-collective latency term (``latency_bytes``, the bytes one could have sent in the time
of one extra collective round) keeps ``auto`` from trading one collective for two when the byte
saving is marginal. Where the AllGather strategy asks (first sight of a layout, then every
step's frame size): docs/architecture.md, "The path of one gradient", step 5; the α–β–γ model of
every strategy is :mod:`.alphabeta`.
"""

from __future__ import annotations

from dataclasses import dataclass

COLLECTIVES = ("auto", "allreduce", "allgather", "sparse-allreduce", "dense")


def ring_allreduce_bytes(numel: int, element_size: int, world_size: int) -> float:
    """Bytes one worker sends in a ring AllReduce of ``numel`` elements."""
    if world_size <= 1:
        return 0.0
    return 2.0 * (world_size - 1) / world_size * numel * element_size


def allgather_bytes_sent(max_payload_bytes: int, world_size: int) -> float:
    """Bytes one worker sends in a ring AllGather of payloads padded to ``max_payload_bytes``."""
    return float((world_size - 1) * max_payload_bytes) if world_size > 1 else 0.0


@dataclass(frozen=True)
class CostModel:
    """Predicts per-worker bytes; ``latency_bytes`` charges each extra collective round.

    Attributes:
        world_size: ranks in the group.
        latency_bytes: bytes one extra collective round is worth (default 4096).
    """

    world_size: int
    latency_bytes: float = 4096.0

    def dense(self, numel: int, element_size: int) -> float:
        """Bytes one worker sends in a ring AllReduce of ``numel`` elements of ``element_size`` bytes."""
        return ring_allreduce_bytes(numel, element_size, self.world_size)

    def allgather(self, max_payload_bytes: int, rounds: int = 2) -> float:
        """Bytes (and latency, in bytes) one worker spends in the payload AllGather.

        Args:
            max_payload_bytes: the longest payload (or the frame size), in bytes.
            rounds: 2 for lengths then payloads (one round more than a dense AllReduce), 1 for
                fixed-size frames.
        """
        return allgather_bytes_sent(max_payload_bytes, self.world_size) + (rounds - 1) * self.latency_bytes

    def prefer_allgather(self, max_payload_bytes: int, numel: int, element_size: int, rounds: int = 2) -> bool:
        """True only when the sparse AllGather is predicted cheaper than the dense AllReduce.

        Every rank passes the same lengths (they are all-gathered or agreed), so every rank
        decides alike. Arguments as for :meth:`allgather` and :meth:`dense`.
        """
        return self.allgather(max_payload_bytes, rounds) < self.dense(numel, element_size)
