"""One index region's sparse entries as bytes, and back: the payloads of the sparse exchanges.

A payload holds entries of one region ``[start, start + length)``, indices relative to ``start``.
A :class:`RegionCodec` adapter (the hook's, built on the codecs: the exchange layer imports none)
codes it; without one, entries travel raw: the int32 relative index (two int32 words when a region
is ``2^31`` or more long, :func:`is_wide`) and the float32 value's bits, 8 (12) bytes per entry.
Nothing to send is zero bytes, whatever the codec. Every decoded payload is checked (indices
strictly ascending inside the region), so a corrupt one raises :class:`~gradwire.errors.DecodeError`.

**Frames.** Where every rank knows the most entries any rank sends into a region and the codec
can bound a payload of that many (:meth:`RegionCodec.max_payload_bytes`; raw entries always
can), payloads travel in fixed frames: an int32 length, the payload, zero padding to the
frame's capacity (:func:`frame_capacity`). Every receiver then knows its buffer's size before
anything arrives and the exchange needs no round of lengths first. A payload that does not fit
(a caller's count was wrong) is sent as a frame of length -1, which no receiver decodes.
"""

from __future__ import annotations

from typing import Optional, Protocol, Sequence

import torch

from ..errors import DecodeError
from ..sparse import is_support


class RegionCodec(Protocol):
    """Codes one region payload; the hook implements it with the codecs."""

    def encode(self, *, indices: torch.Tensor, values: torch.Tensor, numel: int) -> tuple[bytes, torch.Tensor]:
        """The payload of one region's entries.

        Args:
            indices: (m,) int64, strictly ascending, relative to the region start, in ``[0, numel)``.
            values: (m,) float32.
            numel: the region's length.

        Returns:
            The bytes and the (m,) values the receiver will decode.
        """
        ...

    def decode(self, data: bytes, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The entries of one payload: exactly the encoded indices (lossless), values maybe lossy.

        Raises:
            DecodeError: on bad bytes, and nothing else.
        """
        ...

    # Optional: ``max_payload_bytes(*, most: int, numel: int) -> int | None``, the most bytes
    # :meth:`encode` returns for at most ``most`` entries of a region of ``numel`` positions
    # (None: no bound). With it the payloads can travel in fixed frames (module docstring).


#: bytes of a frame's length field (int32, the platform's little-endian order)
FRAME_HEADER = 4
#: the length field of a payload that did not fit its frame
OVERFLOW = -1


def frame_capacity(codec: Optional[RegionCodec], most: int, length: int, wide: bool) -> Optional[int]:
    """Bytes of the frame that holds any payload of at most ``most`` entries of a region of
    ``length`` positions, or None when the codec cannot bound one.

    Args:
        codec: the adapter, or None for raw entries (8 or 12 bytes each, :func:`is_wide`).
        most: the most entries any rank sends into the region, ``>= 0``.
        length: the region's length (positions).
        wide: :func:`is_wide` of the regions.

    Returns:
        ``FRAME_HEADER`` plus the payload's bound, or None.
    """
    if most <= 0:
        return FRAME_HEADER
    if codec is None:
        return FRAME_HEADER + most * (12 if wide else 8)
    bound = getattr(codec, "max_payload_bytes", None)
    payload = None if bound is None else bound(most=min(most, length), numel=length)
    return None if payload is None else FRAME_HEADER + payload


def to_frame(payload: torch.Tensor, entries: int, most: int, capacity: int) -> torch.Tensor:
    """``payload`` (uint8) in a frame of ``capacity`` bytes; one of length :data:`OVERFLOW` when
    it holds more than ``most`` entries or more bytes than the frame can."""
    frame = torch.zeros(capacity, dtype=torch.uint8, device=payload.device)
    fits = entries <= most and payload.numel() <= capacity - FRAME_HEADER
    length = payload.numel() if fits else OVERFLOW
    frame[:FRAME_HEADER] = torch.tensor([length], dtype=torch.int32).view(torch.uint8).to(payload.device)
    if fits:
        frame[FRAME_HEADER: FRAME_HEADER + payload.numel()] = payload
    return frame


def from_frame(frame: torch.Tensor, what: str) -> torch.Tensor:
    """The payload inside one received frame.

    Raises:
        DecodeError: the frame is too short, says its sender's payload did not fit, or declares
            more bytes than it holds.
    """
    if frame.numel() < FRAME_HEADER:
        raise DecodeError(f"{what}: a frame of {frame.numel()} bytes has no length field")
    length = int(frame[:FRAME_HEADER].cpu().clone().view(torch.int32)[0])  # a copy: frames need no alignment
    if length == OVERFLOW:
        raise DecodeError(f"{what}: its sender's payload did not fit the frame (more entries than agreed)")
    if not 0 <= length <= frame.numel() - FRAME_HEADER:
        raise DecodeError(f"{what}: a frame of {frame.numel()} bytes declares a payload of {length}")
    return frame[FRAME_HEADER: FRAME_HEADER + length]


def is_wide(bounds: Sequence[int]) -> bool:
    """Whether raw payloads over these regions need 64-bit relative indices (a region of ``2^31``
    or more positions). Every rank derives the same answer from the same boundaries."""
    return max((b - a for a, b in zip(bounds, bounds[1:])), default=0) >= 2**31


def encode_region(codec: Optional[RegionCodec], relative: torch.Tensor, values: torch.Tensor, length: int,
                  wide: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One region payload.

    Args:
        codec: the adapter, or None for raw entries.
        relative: (m,) int64 ascending indices in ``[0, length)``.
        values: (m,) float32.
        length: the region's length (positions).
        wide: :func:`is_wide` of the regions.

    Returns:
        The payload as a uint8 tensor on ``values``' device, and (m,) float32: the values a
        receiver will decode (``values`` itself for raw entries).
    """
    if relative.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=values.device), values
    if codec is None:
        words = relative.view(torch.int32).reshape(-1, 2) if wide else relative.to(torch.int32)[:, None]
        packed = torch.cat([words, values.contiguous().view(torch.int32)[:, None]], dim=1)
        return packed.reshape(-1).view(torch.uint8), values
    data, reconstructed = codec.encode(indices=relative, values=values, numel=length)
    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(values.device)
    return payload, reconstructed.to(device=values.device, dtype=torch.float32)


def decode_region(codec: Optional[RegionCodec], chunk: torch.Tensor, length: int, wide: bool,
                  what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The entries of one payload.

    Args:
        codec: the adapter, or None for raw entries.
        chunk: the payload, a uint8 tensor.
        length: the region's length (positions).
        wide: :func:`is_wide` of the regions.
        what: names the payload in errors.

    Returns:
        The relative indices ((m,) int64, strictly ascending in ``[0, length)``) and values
        ((m,) float32), on ``chunk``'s device.

    Raises:
        DecodeError: the bytes are not a valid payload for this region (``what`` names it).
    """
    if chunk.numel() == 0:
        return (torch.empty(0, dtype=torch.int64, device=chunk.device),
                torch.empty(0, dtype=torch.float32, device=chunk.device))
    if codec is None:
        entry = 12 if wide else 8
        if chunk.numel() % entry:
            raise DecodeError(f"{what} has {chunk.numel()} bytes, not a multiple of {entry}")
        words = chunk.clone().view(torch.int32).reshape(-1, entry // 4)
        relative = words[:, :2].reshape(-1).view(torch.int64) if wide else words[:, 0].to(torch.int64)
        values = words[:, -1].contiguous().view(torch.float32)
    else:
        relative, values = codec.decode(chunk.cpu().numpy().tobytes(), length)
        relative = relative.to(device=chunk.device, dtype=torch.int64).reshape(-1)
        values = values.to(device=chunk.device, dtype=torch.float32).reshape(-1)
    if relative.numel() != values.numel() or not is_support(relative, length):
        raise DecodeError(f"{what} has indices outside [0, {length}) or not strictly ascending")
    return relative, values
