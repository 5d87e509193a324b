"""One index region's sparse entries as bytes, and back: the payloads of the sparse exchanges.

A payload holds entries of one region ``[start, start + length)``, indices relative to ``start``.
A :class:`RegionCodec` adapter (the hook's, built on the codecs: the exchange layer imports none)
codes it; without one, entries travel raw: the int32 relative index (two int32 words when a region
is ``2^31`` or more long, :func:`is_wide`) and the float32 value's bits, 8 (12) bytes per entry.
Nothing to send is zero bytes, whatever the codec. Every decoded payload is checked (indices
strictly ascending inside the region), so a corrupt one raises :class:`~gradwire.errors.DecodeError`.
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
