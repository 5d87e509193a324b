"""A round's digest: a hash of what this rank summed, equal on every rank unless something was
corrupted in flight (:mod:`.round` compares it across ranks).

Strategies hash what they summed where it is small — each source's decoded ``(positions,
values)`` for the payload AllGather, the reduced sparse result for the sparse AllReduce —, so the
check reads ``k`` entries per rank rather than the dense result; a dense AllReduce's result is
hashed whole (it is dense; on the CPU by the 64 lane hashes its division computes on its way,
:func:`lanes_digest`). On the CPU a tensor's bytes are hashed in place (xxh3, ~1 ms per
45 MB here); on a GPU by one integer reduction of its bit patterns, which stays on the device
until the round's agreement reads every group's at once.

A shard group (FSDP2's reduce-scatter) has no result two ranks share: each owner alone decodes
and sums its region. Its digest is this rank's share of a *balanced* set instead
(:func:`balanced_share`): for every contribution it sent, a hash of it as the owner will decode it,
tagged (sender, receiver); for every contribution it decoded, the same tagged hash of what it
decoded. Each tag appears twice over all ranks, so the XOR of every rank's share is 0 exactly
when every owner decoded what its senders sent (a corrupted or forged contribution leaves its
pair unmatched, with probability 1 - 2^-63). HSDP's second exchange, whose result is identical
across the replicas of a shard, adds :func:`chain_share`. :func:`agree` is the round's test.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence, Union

import torch
import xxhash

if TYPE_CHECKING:
    import numpy

#: a digest: an int (CPU) or a 0-dim int64 tensor still on its device
Digest = Union[int, torch.Tensor]
_MASK63 = (1 << 63) - 1


def digest_of(tensors: Sequence[torch.Tensor]) -> Digest:
    """63 bits identifying ``tensors``' values in order (their dtypes and shapes included)."""
    if tensors and all(t.device.type != "cpu" for t in tensors):
        total = torch.zeros((), dtype=torch.int64, device=tensors[0].device)
        for position, tensor in enumerate(tensors, start=1):
            total = total + position * _bit_sum(tensor)  # position: a reordering changes the digest
        return total
    hasher = xxhash.xxh3_64()
    for tensor in tensors:
        flat = _dense(tensor)
        hasher.update(f"{flat.dtype}:{flat.numel()};".encode())
        if flat.device.type != "cpu":
            hasher.update(int(_bit_sum(flat)).to_bytes(8, "little", signed=True))
        else:
            hasher.update(memoryview(flat.view(torch.uint8).numpy()))
    return hasher.intdigest() & _MASK63


def lanes_digest(tensor: torch.Tensor, lanes: "numpy.ndarray") -> int:
    """63 bits of a dense CPU result from the 64 lane hashes :func:`gradwire.kernels.divide_and_hash`
    computed on its way (its dtype and size included, as :func:`digest_of` includes them)."""
    hasher = xxhash.xxh3_64()
    hasher.update(f"lanes:{tensor.dtype}:{tensor.numel()};".encode())
    hasher.update(memoryview(lanes))
    return hasher.intdigest() & _MASK63


def pair_hash(tensors: Sequence[torch.Tensor], *, tag: Sequence[int]) -> int:
    """63 bits of ``tensors`` (as :func:`digest_of`) and an integer ``tag`` together."""
    hasher = xxhash.xxh3_64()
    hasher.update(repr(tuple(tag)).encode())
    hasher.update(int(_as_int(digest_of(tensors))).to_bytes(8, "little", signed=False))
    return hasher.intdigest() & _MASK63


def balanced_share(sent: Sequence[tuple[int, Sequence[torch.Tensor]]],
                   received: Sequence[tuple[int, Sequence[torch.Tensor]]], *, rank: int, salt: int = 0) -> int:
    """This rank's share of a balanced digest of a reduce-scatter (module docstring).

    Args:
        sent: ``(receiver, tensors)`` per contribution this rank sent, as the receiver decodes it.
        received: ``(sender, tensors)`` per contribution this rank decoded.
        rank: this rank (in the exchange's group).
        salt: tells exchanges apart (e.g. which replica group), the same on every rank of one.

    Returns:
        The XOR of the tagged hashes (63 bits).
    """
    share = 0
    for receiver, tensors in sent:
        share ^= pair_hash(tensors, tag=(0, salt, rank, receiver))
    for sender, tensors in received:
        share ^= pair_hash(tensors, tag=(0, salt, sender, rank))
    return share


def chain_share(result: Digest, *, position: int, size: int, salt: int = 0) -> int:
    """This rank's share of a balanced digest of a result meant to be identical on ``size`` ranks
    (an AllReduce): the result's hash tagged with this rank's ``position`` and with the next one's,
    so the XOR over those ranks is 0 exactly when all hold the same result."""
    value = int(_as_int(result))
    tags = ((1, salt, position), (1, salt, (position + 1) % size))
    share = 0
    for tag in tags:
        hasher = xxhash.xxh3_64()
        hasher.update(repr(tag).encode())
        hasher.update(value.to_bytes(8, "little", signed=False))
        share ^= hasher.intdigest() & _MASK63
    return share


def agree(digests: Sequence[int], *, balanced: bool) -> bool:
    """The round's test: every rank's digest equal, or (``balanced``) their XOR 0."""
    if not balanced:
        return len(set(digests)) <= 1
    total = 0
    for digest in digests:
        total ^= digest
    return total == 0


def xor(digests: Sequence[Digest]) -> int:
    """A rank's balanced shares of several groups as one (XOR keeps the balance)."""
    total = 0
    for digest in digests:
        total ^= int(_as_int(digest))
    return total


def _as_int(digest: Digest) -> int:
    return int(digest.item()) if isinstance(digest, torch.Tensor) else int(digest)


def combine(digests: Sequence[Digest]) -> int:
    """One 63-bit digest of the round's group digests, in order (one host sync for device ones)."""
    on_device = [d for d in digests if isinstance(d, torch.Tensor)]
    values = iter(torch.stack(on_device).tolist()) if on_device else iter(())
    hasher = xxhash.xxh3_64()
    for digest in digests:
        value = next(values) if isinstance(digest, torch.Tensor) else digest
        hasher.update(int(value).to_bytes(8, "little", signed=True))
    return hasher.intdigest() & _MASK63


def _dense(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` flat with unit stride (``contiguous()`` keeps a broadcast one-element tensor's
    stride 0, which a byte view refuses; so may an empty one's)."""
    flat = tensor.detach().reshape(-1)
    if flat.stride(0) != 1:  # also an empty tensor's stride may be 0
        flat = torch.empty(flat.numel(), dtype=flat.dtype, device=flat.device).copy_(flat)
    return flat


def _bit_sum(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of the tensor's bit patterns as integers (one reduction, on its device)."""
    flat = _dense(tensor)
    nbytes = flat.numel() * flat.element_size()
    words = flat.view(torch.uint8)
    for dtype, size in ((torch.int32, 4), (torch.int16, 2)):
        if nbytes % size == 0:
            words = words.view(dtype)
            break
    return words.sum(dtype=torch.int64)
