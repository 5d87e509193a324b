"""Collectives over torch.distributed and the cost model that chooses between them.

Knows nothing of sparsifiers or codecs: it moves tensors and byte strings between ranks. Which
module does what, and where each collective sits on the path of one gradient through the hook:
docs/architecture.md ("Layers", "The path of one gradient", "Sparse AllReduce and hierarchical
exchange").
"""

from .collectives import (
    FRAME_HEADER_BYTES,
    ByteGather,
    allgather_bytes,
    allreduce_sum,
    check_same_on_all_ranks,
    communication_device,
    gather_frames,
    gather_overflow,
)
from .cost import COLLECTIVES, CostModel, ring_allreduce_bytes

__all__ = [
    "COLLECTIVES",
    "FRAME_HEADER_BYTES",
    "ByteGather",
    "CostModel",
    "allgather_bytes",
    "allreduce_sum",
    "check_same_on_all_ranks",
    "communication_device",
    "gather_frames",
    "gather_overflow",
    "ring_allreduce_bytes",
]
