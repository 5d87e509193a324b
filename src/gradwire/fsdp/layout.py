"""FSDP2's flat reduce-scatter layout: where each parameter's chunk lies in the flat gradient.

FSDP2 copies a module's unsharded gradients into one flat tensor of ``p s`` elements laid out
chunk by rank (``torch.ops.fsdp.chunk_cat``): each gradient is padded with zeros along dim 0 to a
multiple of ``p`` rows and cut into ``p`` chunks of equal rows; row ``j`` of the flat tensor, viewed
as ``(p, s)``, is chunk ``j`` of every gradient in parameter order, and rank ``j`` of the
reduce-scatter group owns it. So parameter ``i``'s chunk ``j`` is the contiguous range
``[j s + o_i, j s + o_i + c_i)``, ``c_i = ceil(d0_i / p) * prod(shape_i[1:])``, ``o_i = sum of
c_l for l < i``, ``s = sum of c_i``; the last rows of the last chunks are padding (zeros).

:func:`pieces` lists those ranges (the front-end's entries: one per parameter and destination, so
a sparsifier's density holds per parameter, as in the DDP hook, and per destination shard);
:func:`flatten` and :func:`unflatten` build and undo the layout for whole tensors (the
single-process simulation of the reduce-scatter, tests).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class Piece:
    """Parameter ``parameter``'s chunk ``chunk`` (the part rank ``chunk`` owns) inside the flat
    gradient: ``numel`` elements from ``offset`` (padding included)."""

    parameter: int
    chunk: int
    offset: int
    numel: int


def chunk_numel(shape: Sequence[int], world_size: int) -> int:
    """Elements of one rank's chunk of a gradient of ``shape`` (dim 0 padded to a multiple of
    ``world_size``); a 0-dim tensor counts as shape ``(1,)``."""
    if len(shape) == 0:
        shape = (1,)
    return math.ceil(shape[0] / world_size) * math.prod(shape[1:])


def shard_numel(shapes: Sequence[Sequence[int]], world_size: int) -> int:
    """``s``: elements of one rank's shard of the flat gradient of tensors of ``shapes``."""
    return sum(chunk_numel(shape, world_size) for shape in shapes)


def pieces(shapes: Sequence[Sequence[int]], world_size: int) -> list[Piece]:
    """Every (parameter, destination) range of the flat gradient, in flat order (chunk major).

    Args:
        shapes: the parameters' shapes, in FSDP's parameter order.
        world_size: ``p``, the reduce-scatter group's size.

    Returns:
        ``p * len(shapes)`` pieces covering ``[0, p s)`` without gaps.
    """
    chunks = [chunk_numel(shape, world_size) for shape in shapes]
    shard = sum(chunks)
    out = []
    for j in range(world_size):
        offset = j * shard
        for i, numel in enumerate(chunks):
            out.append(Piece(i, j, offset, numel))
            offset += numel
    return out


def flatten(tensors: Sequence[torch.Tensor], world_size: int) -> torch.Tensor:
    """The flat ``(p s,)`` gradient FSDP2 builds from ``tensors`` (zero padding included).

    Args:
        tensors: gradients in parameter order, any float dtype (the result has the first one's).
        world_size: ``p``.

    Returns:
        A new 1-D tensor of ``p * shard_numel(shapes, p)`` elements, chunk by rank.
    """
    rows = []
    for tensor in tensors:
        flat = tensor.reshape(tensor.shape[0] if tensor.dim() else 1, -1)
        padded_rows = math.ceil(flat.shape[0] / world_size) * world_size
        padded = torch.nn.functional.pad(flat, (0, 0, 0, padded_rows - flat.shape[0]))
        rows.append(padded.reshape(world_size, -1))
    return torch.cat(rows, dim=1).reshape(-1)


def unflatten(flat: torch.Tensor, shapes: Sequence[Sequence[int]], world_size: int) -> list[torch.Tensor]:
    """Undo :func:`flatten`: the tensors of ``shapes`` (padding dropped), copied out of ``flat``.

    Args:
        flat: ``(p s,)`` laid out chunk by rank.
        shapes: the tensors' shapes, in parameter order.
        world_size: ``p``.
    """
    chunks = [chunk_numel(shape, world_size) for shape in shapes]
    matrix = flat.reshape(world_size, -1)
    out, start = [], 0
    for shape, numel in zip(shapes, chunks):
        full_shape = tuple(shape) if len(shape) else (1,)
        part = matrix[:, start: start + numel].reshape(-1, *full_shape[1:])[: full_shape[0]]
        out.append(part.reshape(tuple(shape)).clone())
        start += numel
    return out
