"""One payload per group of buckets: the sparse gradients of all its parameters, and back.

The hook selects per parameter (each keeps its density) but need not encode per parameter.
ResNet-18 has 60 parameter tensors, most of them BatchNorm vectors with a handful of selected
elements, and every tensor costs a record and a pair of codec calls on each side: per-tensor
overhead, not the indices, dominated the codec time (``scripts/bucket_payload_timing.py``, top-k
1%, fp16/Rice: encode 15.9 -> 6.7 ms, decode 18.0 -> 2.6 ms per peer payload, joined).
So with a lossless index codec the group travels **joined**: one sparse tensor over the
concatenation of the group's buffers (positions shifted by each parameter's offset, values in
the same order), one record, one call per codec. Its size in bits is within a few bytes of the
per-tensor encoding (same density everywhere, so the same gap statistics).

A lossy index codec (Bloom) sends positions outside the selection, whose values it reads from
the dense tensor; that needs per-parameter dense tensors, so such codecs get one record per
parameter as before. Sender and receiver derive the form from the codec alone, so they agree.

Knows codecs and tensors; nothing of ranks or collectives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .. import codecs as codec_layer
from ..codecs.base import IndexCodec, ValueCodec
from ..sparse import SparseTensor
from .group import flat_positions


@dataclass
class Part:
    """One parameter's selection: ``compensated`` (flat float, its numel), ascending int64
    ``indices`` into it, and ``offset``, where the parameter starts in the group's flat space;
    ``values``: ``compensated[indices]`` when the selection has them already (None: gathered here)."""

    compensated: torch.Tensor
    indices: torch.Tensor
    offset: int
    values: Optional[torch.Tensor] = None

    def selected(self) -> torch.Tensor:
        """``compensated`` at ``indices``."""
        return self.values if self.values is not None else torch.index_select(self.compensated, 0, self.indices)


@dataclass
class EncodedBucket:
    """The payload and what every receiver reconstructs from it.

    ``positions`` (int64, ascending within each part) and ``values`` (the parts' dtype): the
    reconstruction in the group's flat space, what this rank adds for itself. ``sent``: per part,
    what its receivers reconstruct, in that part's own space, for error feedback.
    """

    payload: bytes
    positions: torch.Tensor
    values: torch.Tensor
    sent: list[SparseTensor]


def joins(index_codec: IndexCodec) -> bool:
    """Whether a group travels as one joined sparse tensor (see the module docstring)."""
    return index_codec.lossless


def encode_bucket(parts: Sequence[Part], group_numel: int, *, index_codec: IndexCodec,
                  value_codec: ValueCodec) -> EncodedBucket:
    """Encode the parts of one group (``group_numel`` elements in its flat space)."""
    if parts and joins(index_codec):
        positions, values = _flatten([(p.selected(), p.indices) for p in parts], [p.offset for p in parts])
        order = None
        if any(b.offset < a.offset for a, b in zip(parts, parts[1:])):
            order = torch.argsort(positions)  # the wire wants ascending positions
            values, positions = values[order], positions[order]
        encoded = codec_layer.encode_tensors([(values, positions, group_numel)], index_codec, value_codec, check=False)
        received = encoded.tensors[0].values
        if order is not None:  # back to the parts' order to split per part
            unsorted = torch.empty_like(received)
            unsorted[order.to(received.device)] = received
            part_values = unsorted
        else:
            part_values = received
        counts = [p.indices.numel() for p in parts]
        sent = [SparseTensor(values, p.indices, p.compensated.numel())
                for p, values in zip(parts, torch.split(part_values, counts))]
        return EncodedBucket(encoded.payload, positions, received, sent)
    encoded = codec_layer.encode_tensors(
        [(p.selected(), p.indices, p.compensated.numel()) for p in parts],
        index_codec, value_codec, check=False, dense=[p.compensated for p in parts],
    )
    sent = [SparseTensor(t.values, t.indices, p.compensated.numel()) for t, p in zip(encoded.tensors, parts)]
    positions, values = _flatten([(t.values, t.indices) for t in encoded.tensors], [p.offset for p in parts])
    return EncodedBucket(encoded.payload, positions, values, sent)


def decode_bucket(data: memoryview, numels: Sequence[int], offsets: Sequence[int], group_numel: int, *,
                  index_codec: IndexCodec) -> tuple[torch.Tensor, torch.Tensor]:
    """A peer's payload as ``(positions, values)`` in the group's flat space.

    ``numels`` / ``offsets``: each part's size and start, known to the receiver beforehand, so a
    payload of other sizes is refused (:class:`~gradwire.errors.DecodeError`) before decoding.
    """
    if joins(index_codec):
        ((values, positions, _),) = codec_layer.decode_tensors(data, expected_numels=[group_numel])
        return positions, values
    tensors = codec_layer.decode_tensors(data, expected_numels=list(numels))
    return _flatten([(values, indices) for values, indices, _ in tensors], offsets)


def _flatten(pieces: Sequence[tuple[torch.Tensor, torch.Tensor]],
             offsets: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-part (values, local indices) -> (positions, values) in the group's flat space."""
    if not pieces:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0)
    positions = flat_positions([indices for _, indices in pieces], list(offsets))
    return positions, torch.cat([values for values, _ in pieces])
