"""The collectives gradwire uses, over any torch.distributed backend (gloo on CPU, NCCL on GPU).

Byte strings travel as uint8 tensors, in one of two ways:

* :class:`ByteGather`, two rounds: an AllGather of their lengths (int64, blocking), then one
  AllGather of payloads padded to the longest. Needs no prior knowledge, but the first round
  makes every rank wait for the slowest before it can go on.
* :func:`gather_frames`, one round: every rank sends a frame of a size agreed beforehand
  (``capacity``), ``[int64 length | payload | zero padding]``. Nothing blocks; a payload longer
  than the frame sends its first ``capacity`` bytes and :func:`gather_overflow` sends the rest
  in a second round that every rank, having seen the same lengths, agrees to run.

Nothing is pickled; receivers parse the bytes with the codecs' checked decoder. When the hook
takes which form (a bucket layout's first step, then frames whose size follows the lengths) and
how it completes them: docs/architecture.md, "The path of one gradient", steps 5-6; the frames'
bytes: docs/wire-format.md, "How payloads travel between ranks".

Asynchronous rounds return a :class:`~.inflight.Launched`: its buffers are read only on the
caller's thread, after the wait succeeded, so a collective that failed (a peer died) surfaces as
that error, never as the contents of buffers it never wrote, and nothing of ours runs on a backend
thread (why that matters: :mod:`.inflight`). Blocking rounds wait with a ``timeout`` (seconds) well
below gloo's 30-minute default, so a dead or hook-less peer is reported in seconds or minutes
rather than half an hour.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..lifetime import wait_for
from .checked import group_size
from .inflight import Launched


def communication_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """Where collective buffers must live: the current CUDA device for NCCL, else the CPU."""
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


#: The group's size, 1 without an initialized process group (the name the front-ends import).
world_size_of = group_size


def allreduce_sum(tensor: torch.Tensor, group: Optional[dist.ProcessGroup] = None, *,
                  collective: str = "AllReduce") -> Launched[torch.Tensor]:
    """Start an in-place SUM AllReduce of ``tensor`` (on the group's device).

    Returns:
        A :class:`~.inflight.Launched` whose ``result()`` is ``tensor``, summed; ``collective``
        names it in errors.
    """
    if world_size_of(group) == 1:
        return Launched.ready(tensor, collective)
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return Launched(work, lambda: tensor, collective)


class ByteGather:
    """AllGather of one byte string per rank, in two rounds.

    ``lengths()`` exchanges the payload sizes (blocking: a few bytes); the caller may decide on
    that basis (every rank sees the same lengths, so every rank decides the same); ``start()``
    launches the padded AllGather; its ``result()`` is the list of per-rank ``memoryview``s.

    Args:
        payload: this rank's bytes.
        group: the process group (None: the default one).
        valid: False flags this rank's payload invalid (its gradient held NaN/Inf): it sends
            nothing and its length reads -1 on every rank.
        timeout: seconds the blocking lengths round waits at most (None: the group's own limit).
    """

    def __init__(self, payload: bytes, group: Optional[dist.ProcessGroup] = None, *, valid: bool = True,
                 timeout: Optional[float] = None) -> None:
        self.payload = payload if valid else b""
        self.valid = valid
        self.group = group
        self.timeout = timeout
        self.world_size = world_size_of(group)
        self.device = communication_device(group) if self.world_size > 1 else torch.device("cpu")
        self._lengths: Optional[list[int]] = None

    def lengths(self) -> list[int]:
        """Payload sizes by rank; -1 marks a rank that flagged its payload invalid (``valid=False``)."""
        if self._lengths is None:
            own = len(self.payload) if self.valid else -1
            if self.world_size == 1:
                self._lengths = [own]
            else:
                mine = torch.tensor([own], dtype=torch.int64, device=self.device)
                gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
                work = dist.all_gather(gathered, mine, group=self.group, async_op=True)
                wait_for(work, self.timeout, "AllGather of payload lengths")
                self._lengths = [int(t.item()) for t in gathered]
        return self._lengths

    def start(self) -> Launched[list[memoryview]]:
        """Launch the AllGather of the payloads padded to the longest; ``result()`` is one view per rank."""
        lengths = [max(n, 0) for n in self.lengths()]
        if self.world_size == 1:
            return Launched.ready([memoryview(self.payload)], "AllGather of payloads")
        longest = max(lengths)
        padded = _padded(self.payload, longest, self.device)
        gathered = [torch.empty(longest, dtype=torch.uint8, device=self.device) for _ in range(self.world_size)]
        work = dist.all_gather(gathered, padded, group=self.group, async_op=True)

        def unpad() -> list[memoryview]:
            return [memoryview(t[:n].cpu().numpy().tobytes()) for t, n in zip(gathered, lengths)]

        return Launched(work, unpad, "AllGather of payloads")


def _padded(data: bytes, size: int, device: torch.device) -> torch.Tensor:
    """``data`` followed by zeros, as a uint8 tensor of ``size`` (>= ``len(data)``) bytes on ``device``."""
    out = torch.zeros(size, dtype=torch.uint8)
    if data:
        out[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return out.to(device)


#: Bytes of the length field at the start of each frame (int64, little-endian; -1: invalid).
FRAME_HEADER_BYTES = 8


def gather_frames(payload: bytes, capacity: int, group: Optional[dist.ProcessGroup] = None, *,
                  valid: bool = True) -> Launched[tuple[list[int], list[memoryview]]]:
    """Start one AllGather of fixed-size frames (``FRAME_HEADER_BYTES + capacity`` bytes per rank).

    Where a length exceeds ``capacity`` the rest must be fetched with :func:`gather_overflow`, on
    every rank, in the same order.

    Args:
        payload: this rank's bytes.
        capacity: payload bytes per frame, >= 0, the same on every rank.
        group: the process group (None: the default one).
        valid: False flags this rank's payload invalid: its length reads -1 everywhere.

    Returns:
        A :class:`~.inflight.Launched` whose ``result()`` is ``(lengths, heads)``: the payload
        length of each rank (-1 where ``valid=False``) and a ``memoryview`` of the first
        ``min(length, capacity)`` bytes of its payload.

    Raises:
        ValueError: a negative ``capacity``.
    """
    if capacity < 0:
        raise ValueError(f"capacity={capacity} must be >= 0")
    own = len(payload) if valid else -1
    world_size = world_size_of(group)
    if world_size == 1:
        return Launched.ready(([own], [memoryview(payload if valid else b"")]), "AllGather of frames")
    head = payload[:capacity] if valid else b""
    frame = _padded(struct.pack("<q", own) + head, FRAME_HEADER_BYTES + capacity, communication_device(group))
    gathered = [torch.empty_like(frame) for _ in range(world_size)]
    work = dist.all_gather(gathered, frame, group=group, async_op=True)

    def split() -> tuple[list[int], list[memoryview]]:
        lengths, heads = [], []
        for received in gathered:
            array = received.cpu().numpy()
            length = int(array[:FRAME_HEADER_BYTES].view("<i8")[0])
            lengths.append(length)
            kept = min(max(length, 0), capacity)
            heads.append(memoryview(array)[FRAME_HEADER_BYTES: FRAME_HEADER_BYTES + kept])
        return lengths, heads

    return Launched(work, split, "AllGather of frames")


def gather_overflow(payload: bytes, capacity: int, lengths: list[int],
                    group: Optional[dist.ProcessGroup] = None, *, timeout: Optional[float] = None) -> list[memoryview]:
    """Blocking second round after :func:`gather_frames`: each rank's bytes beyond ``capacity``.

    Args:
        payload: this rank's whole payload.
        capacity: the frames' capacity.
        lengths: the frames' lengths, the same on every rank, so every rank sends and expects
            the same sizes.
        group: the process group (None: the default one).
        timeout: seconds to wait at most (None: the group's own limit).

    Returns:
        Per rank, in rank order, its bytes beyond ``capacity`` (empty where its payload fitted).

    Raises:
        RuntimeError: the AllGather failed or timed out.
    """
    world_size = world_size_of(group)
    rest = [max(n - capacity, 0) for n in lengths]
    if world_size == 1:
        return [memoryview(payload[capacity:])]
    mine = _padded(payload[capacity:], max(rest), communication_device(group))
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    wait_for(dist.all_gather(gathered, mine, group=group, async_op=True), timeout, "AllGather of frame overflow")
    return [memoryview(t.cpu().numpy())[:n] for t, n in zip(gathered, rest)]


def allgather_bytes(payload: bytes, group: Optional[dist.ProcessGroup] = None) -> list[memoryview]:
    """Blocking AllGather of one byte string per rank; returns them in rank order."""
    return ByteGather(payload, group).start().result()


def check_same_on_all_ranks(description: str, group: Optional[dist.ProcessGroup] = None,
                            on_mismatch: Callable[[list[int]], str] | None = None, *,
                            timeout: Optional[float] = None) -> None:
    """Raise ValueError on every rank unless ``description`` is identical on all ranks.

    Compares a 63-bit hash, so ranks configured differently fail with a clear message at first
    use instead of deadlocking in mismatched collectives later.

    Args:
        description: what must agree (the hook passes ``ExchangeConfig.describe()``).
        group: the process group (None: the default one).
        on_mismatch: builds extra detail for the message from every rank's hash.
        timeout: seconds to wait at most (None: the group's own limit).

    Raises:
        ValueError: some rank's description differs (every rank raises).
        RuntimeError: the AllGather did not complete: a rank is missing, dead, or runs without
            the hook.
    """
    if world_size_of(group) == 1:
        return
    digest = int.from_bytes(hashlib.sha256(description.encode()).digest()[:8], "little") >> 1
    device = communication_device(group)
    mine = torch.tensor([digest], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(world_size_of(group))]
    try:
        wait_for(dist.all_gather(gathered, mine, group=group, async_op=True), timeout, "configuration check")
    except RuntimeError as error:
        raise RuntimeError(
            f"gradwire's first collective (comparing options across ranks) did not complete: some rank is "
            f"missing, dead, or trains without the gradwire hook registered ({error})") from error
    hashes = [int(t.item()) for t in gathered]
    if len(set(hashes)) > 1:
        differing = [rank for rank, h in enumerate(hashes) if h != hashes[0]]
        detail = on_mismatch(hashes) if on_mismatch else ""
        raise ValueError(
            f"gradwire configuration differs between ranks (ranks {differing} differ from rank 0); "
            f"every rank must use the same options. This rank: {description}. {detail}".strip()
        )
