"""Blockwise symmetric quantization of float32 tensors to int8 or int4, and its wire layout.

A chunk of ``n`` float32 values is cut into ``nb = ceil(n / block_size)`` blocks of ``block_size``
consecutive values (the last one shorter when ``block_size`` does not divide ``n``: it is padded
with zeros for the arithmetic, and the padding is never sent). Per block:

* ``scale = absmax / L``, float32, with ``L = 127`` (int8) or ``L = 7`` (int4): symmetric, so zero
  stays exactly zero and no offset travels. The scale is float32, not float16: a block of large
  gradients (absmax above 65504 x L, a loss spike, an outer step of a long DiLoCo round) would
  overflow fp16 to Inf, and small ones (absmax below about 6e-8 x L) would fall into fp16's
  subnormals and lose their relative precision; 4 bytes per block is 1/16 byte per value at
  ``block_size = 64``.
* ``code = clamp(round(x / scale), -L, L)``, ``round`` half to even (``torch.round``). Division and
  rounding are IEEE-exact operations on every device torch runs on, so the same input gives the
  same bits on CPU and GPU; the clamp only ever acts on the last ulp of ``x / scale``.
* A block holding NaN or Inf gets ``scale = NaN`` and codes 0: the whole block decodes to NaN, so a
  receiver can tell (an Inf scale would decode its zero codes to NaN and the rest to +-Inf, and a
  NaN has no code at all). An all-zero block has ``scale = 0`` and decodes to zeros.

Decoding is ``code * scale`` (float32): every value is within ``scale / 2`` of the input (plus
float32 rounding, a few 1e-8 of absmax), and ``x - dequantize(quantize(x))`` is exact in float32
(the code's value lies within a factor two of ``x`` or is zero: Sterbenz), so an error-feedback
residual computed from it loses nothing.

**Wire layout** of one chunk (a uint8 tensor, :func:`quantized_bytes` long)::

    [ scales: nb float32, 4 nb bytes ] [ codes: n bytes (int8) or ceil(n / 2) bytes (int4) ]

int8 codes are two's complement bytes. int4 codes are two's complement nibbles, element ``2i`` in
the low nibble of byte ``i`` and element ``2i + 1`` in the high one; an odd ``n`` leaves the last
high nibble 0. Floats are in the device's native byte order (little-endian on every CPU and GPU
torch supports). So::

    quantized_bytes(n, bits, block_size) = 4 * ceil(n / block_size) + ceil(n * bits / 8)

about ``n * (bits / 8 + 4 / block_size)`` bytes.

**Hostile bytes**: the receiver knows ``n`` (and ``bits``, ``block_size``), so it knows the exact
length; any other length raises :class:`~gradwire.errors.DecodeError`, and nothing is ever
allocated from a size read off the wire. Codes outside ``[-L, L]`` (-128, or nibble 8) are clamped,
so any bytes decode to values bounded by their block's scale; a NaN or Inf scale decodes to
non-finite values, which the exchanges report (:mod:`.quantized`).

**Segments**: with ``segments=(l_1, ..., l_m)`` (lengths summing to ``n``) blocks restart at every
segment's start, so no block straddles two segments: ``nb = sum ceil(l_i / block_size)`` blocks,
the last one of each segment shorter. A caller whose chunk joins several tensors (FSDP2's flat
gradient: one piece of every parameter per destination) gives one segment per tensor, so a small
tensor's values are never scaled by a large neighbour's absmax (which rounds them to zero). The
wire layout is the same with that ``nb``; the receiver knows the segments as it knows ``n``.

All functions take and return tensors on the input's device and work on a batch of equally long
chunks at once (leading dimensions). On the CPU with numba (``gradwire[fast]``) one compiled pass
per chunk quantizes (:func:`gradwire.kernels.block_quantize`) or decodes; elsewhere torch
operations do, with no Python loop over values or blocks; both give the same bits.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .. import kernels
from ..errors import DecodeError, is_integer

#: Supported code widths and their largest code ``L``.
LEVELS = {8: 127, 4: 7}


def check_options(bits: int, block_size: int) -> None:
    """Raise ``ValueError`` unless ``bits`` is 8 or 4 and ``block_size`` an int >= 1."""
    if bits not in LEVELS:
        raise ValueError(f"bits={bits!r} is not supported; allowed: 8, 4")
    if not is_integer(block_size) or block_size < 1:
        raise ValueError(f"block_size={block_size!r} must be an int >= 1")


def quantized_bytes(n: int, bits: int, block_size: int, segments: Optional[Sequence[int]] = None) -> int:
    """Bytes of one quantized chunk of ``n`` values: ``4 nb + ceil(n bits / 8)``, ``nb`` its blocks
    (``ceil(n / block_size)``, or per segment, module docstring)."""
    check_options(bits, block_size)
    if n < 0:
        raise ValueError(f"n={n} must be >= 0")
    return 4 * block_count(n, block_size, segments) + math.ceil(n * bits / 8)


def block_count(n: int, block_size: int, segments: Optional[Sequence[int]] = None) -> int:
    """Blocks of a chunk of ``n`` values; ``ValueError`` if ``segments`` do not sum to ``n``."""
    if segments is None:
        return math.ceil(n / block_size)
    if any(not is_integer(length) or length < 0 for length in segments) or sum(segments) != n:
        raise ValueError(f"segments must be lengths >= 0 summing to n={n}")
    return sum(math.ceil(length / block_size) for length in segments)


def quantize(x: torch.Tensor, *, bits: int, block_size: int, segments: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Quantize every row (last dimension) of ``x`` as one chunk (module docstring).

    Args:
        x: float32, shape ``(..., n)``; each row is quantized on its own (blocks never straddle rows).
        bits: 8 or 4.
        block_size: values per scale, >= 1.
        segments: lengths summing to ``n``; blocks restart at each (None: one segment).

    Returns:
        uint8, shape ``(..., quantized_bytes(n, bits, block_size))``, on ``x``'s device.

    Raises:
        ValueError: ``x`` not float32 or 0-dimensional, or bad ``bits`` / ``block_size``.
    """
    _check_input(x, bits, block_size)
    if _native(x):
        return _native_roundtrip(x, bits, block_size, segments, want_local=False)[0]
    scales, codes = _scales_and_codes(x, bits, block_size, segments)
    return _pack(scales, codes, bits)


def dequantize(data: torch.Tensor, n: int, *, bits: int, block_size: int,
               segments: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Decode chunks of ``n`` values laid out as :func:`quantize` writes them.

    Args:
        data: uint8, shape ``(..., quantized_bytes(n, bits, block_size))``, one chunk per row.
        n: values per chunk (known to the receiver, never read off the wire).
        bits: as the sender used.
        block_size: as the sender used.
        segments: as the sender used.

    Returns:
        float32, shape ``(..., n)``, on ``data``'s device; NaN throughout a block whose scale is NaN.

    Raises:
        DecodeError: ``data`` is not uint8, or its rows are not exactly ``quantized_bytes`` long.
        ValueError: bad ``n``, ``bits`` or ``block_size``.
    """
    expected = quantized_bytes(n, bits, block_size, segments)
    if data.dtype != torch.uint8 or data.dim() == 0 or data.shape[-1] != expected:
        raise DecodeError(f"a quantized chunk of {n} values ({bits}-bit, blocks of {block_size}) is {expected} "
                          f"uint8 bytes, got {data.dtype} of shape {tuple(data.shape)}")
    blocks = block_count(n, block_size, segments)
    if _native(data) and n:
        return _native_dequantize(data, n, bits, block_size, segments, blocks)
    scales, codes = _unpack(data, n, bits, blocks)
    return _scaled(codes, scales, n, block_size, segments)


def roundtrip(x: torch.Tensor, *, bits: int, block_size: int,
              segments: Optional[Sequence[int]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed, dequantize(packed))`` for ``x``: what a receiver will see, without unpacking again.

    Args:
        x: float32, shape ``(..., n)``, as for :func:`quantize`.
        bits: 8 or 4.
        block_size: values per scale, >= 1.
        segments: as for :func:`quantize`.

    Returns:
        The uint8 chunks :func:`quantize` returns and their float32 ``(..., n)`` decoding, bit for
        bit what :func:`dequantize` gives.

    Raises:
        ValueError: as for :func:`quantize`.
    """
    _check_input(x, bits, block_size)
    if _native(x):
        packed, local = _native_roundtrip(x, bits, block_size, segments, want_local=True)
        assert local is not None
        return packed, local
    scales, codes = _scales_and_codes(x, bits, block_size, segments)
    return _pack(scales, codes, bits), _scaled(codes, scales, x.shape[-1], block_size, segments)


def _native(tensor: torch.Tensor) -> bool:
    """Whether the one-pass kernels (:func:`gradwire.kernels.block_quantize`) take ``tensor``: a CPU
    tensor with values, numba available. Elsewhere (CUDA, no numba, ``GRADWIRE_NATIVE=0``) the torch
    path runs; both give the same bits (``tests/exchange/test_blockquant_native.py``)."""
    return tensor.device.type == "cpu" and tensor.numel() > 0 and kernels.available()


def _lengths(n: int, segments: Optional[Sequence[int]]) -> np.ndarray:
    return np.asarray(list(segments) if segments is not None else [n], dtype=np.int64)


def _native_roundtrip(x: torch.Tensor, bits: int, block_size: int, segments: Optional[Sequence[int]], *,
                      want_local: bool) -> "tuple[torch.Tensor, Optional[torch.Tensor]]":
    """The packed chunks (and with ``want_local`` their decoding) of ``x`` by the one-pass kernel:
    about 1.3 reads of ``x`` and one write of the codes, where the torch path makes about 15
    passes (pad, abs, amax, divide, round, clamp, where, cast, pack, and each again to decode)."""
    n = x.shape[-1]
    rows = x.detach().reshape(-1, n).contiguous().numpy()
    blocks = block_count(n, block_size, segments)
    scales, codes, local = kernels.block_quantize(rows, lengths=_lengths(n, segments), block_size=block_size,
                                                  level=LEVELS[bits], bits=bits, blocks=blocks,
                                                  want_local=want_local)
    packed = torch.from_numpy(np.concatenate([scales.view(np.uint8), codes], axis=1))
    packed = packed.reshape(*x.shape[:-1], packed.shape[-1])
    return packed, (torch.from_numpy(local).reshape(x.shape) if local is not None else None)


def _native_dequantize(data: torch.Tensor, n: int, bits: int, block_size: int, segments: Optional[Sequence[int]],
                       blocks: int) -> torch.Tensor:
    """:func:`dequantize` by the one-pass kernel (the scales copied out of the bytes first: a row's
    float32 scales need not be 4-aligned in ``data``)."""
    rows = data.detach().reshape(-1, data.shape[-1]).contiguous().numpy()
    scales = np.ascontiguousarray(rows[:, :4 * blocks]).view(np.float32)
    values = kernels.block_dequantize(scales, rows[:, 4 * blocks:], n=n, lengths=_lengths(n, segments),
                                      block_size=block_size, level=LEVELS[bits], bits=bits)
    return torch.from_numpy(values).reshape(*data.shape[:-1], n)


def _check_input(x: torch.Tensor, bits: int, block_size: int) -> None:
    check_options(bits, block_size)
    if x.dtype != torch.float32 or x.dim() == 0:
        raise ValueError(f"quantize needs a float32 tensor of >= 1 dimension, got {x.dtype} {tuple(x.shape)}")


def _scales_and_codes(x: torch.Tensor, bits: int, block_size: int,
                      segments: Optional[Sequence[int]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block float32 scales ``(..., nb)`` and int8 codes ``(..., n)`` in ``[-L, L]``."""
    level = LEVELS[bits]
    n = x.shape[-1]
    if segments is not None:  # each segment padded to whole blocks, quantized as one row of blocks
        padded = _pad_segments(x, block_size, segments)
        scales, codes = _quantize_blocks(padded.reshape(*x.shape[:-1], -1, block_size), level)
        return scales, _unpad_segments(codes.reshape(*x.shape[:-1], -1), block_size, segments)
    blocks_per_row = math.ceil(n / block_size)
    # zeros do not change a block's absmax, so padding the last block is harmless
    blocks = F.pad(x, (0, blocks_per_row * block_size - n)).reshape(*x.shape[:-1], blocks_per_row, block_size)
    scales, codes = _quantize_blocks(blocks, level)
    return scales, codes.reshape(*x.shape[:-1], blocks_per_row * block_size)[..., :n]


def _quantize_blocks(blocks: torch.Tensor, level: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales ``(..., nb)`` and int8 codes ``(..., nb, block_size)`` of float32 ``blocks``."""
    absmax = blocks.abs().amax(dim=-1)  # NaN propagates, Inf stays Inf
    finite = torch.isfinite(absmax)
    scales = torch.where(finite, absmax / level, torch.full_like(absmax, float("nan")))
    # a zero (or underflowed) scale divides by 1 instead: its codes are then 0 (or the few tiny values round to 0)
    divisor = torch.where(finite & (scales > 0), scales, torch.ones_like(scales))
    codes = torch.round(blocks / divisor.unsqueeze(-1)).clamp_(-level, level)
    codes = torch.where(finite.unsqueeze(-1), codes, torch.zeros_like(codes))
    return scales, codes.to(torch.int8)


def _pad_segments(x: torch.Tensor, block_size: int, segments: Sequence[int]) -> torch.Tensor:
    """``x`` ``(..., n)`` with every segment padded with zeros to whole blocks: ``(..., nb block_size)``
    (zeros do not change a block's absmax). One copy; a loop over segments, not values."""
    block_count(x.shape[-1], block_size, segments)  # checks the lengths
    pieces, start = [], 0
    for length in segments:
        piece = x[..., start: start + length]
        pad = -length % block_size
        pieces.append(F.pad(piece, (0, pad)) if pad else piece)
        start += length
    return torch.cat(pieces, dim=-1) if pieces else x[..., :0]


def _unpad_segments(padded: torch.Tensor, block_size: int, segments: Sequence[int]) -> torch.Tensor:
    """Undo :func:`_pad_segments`: ``(..., n)``."""
    pieces, start = [], 0
    for length in segments:
        pieces.append(padded[..., start: start + length])
        start += length + (-length % block_size)
    return torch.cat(pieces, dim=-1) if pieces else padded[..., :0]


def _scaled(codes: torch.Tensor, scales: torch.Tensor, n: int, block_size: int,
            segments: Optional[Sequence[int]] = None) -> torch.Tensor:
    """``code * scale`` per value: float32 ``(..., n)``."""
    if segments is not None:
        padded = _pad_segments(codes, block_size, segments).reshape(*codes.shape[:-1], -1, block_size)
        values = padded.to(torch.float32) * scales.unsqueeze(-1)
        return _unpad_segments(values.reshape(*codes.shape[:-1], -1), block_size, segments)
    blocks_per_row = scales.shape[-1]
    padded = F.pad(codes, (0, blocks_per_row * block_size - n)).reshape(*codes.shape[:-1], blocks_per_row, block_size)
    values = padded.to(torch.float32) * scales.unsqueeze(-1)
    return values.reshape(*codes.shape[:-1], blocks_per_row * block_size)[..., :n]


def _pack(scales: torch.Tensor, codes: torch.Tensor, bits: int) -> torch.Tensor:
    """The wire layout: scales' bytes, then the codes (one per byte, or two per byte for int4)."""
    if bits == 4:
        nibbles = F.pad(codes, (0, codes.shape[-1] % 2)).bitwise_and(0x0F).to(torch.uint8)
        code_bytes = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    else:
        code_bytes = codes.contiguous().view(torch.uint8)
    return torch.cat([scales.contiguous().view(torch.uint8), code_bytes], dim=-1)


def _unpack(data: torch.Tensor, n: int, bits: int, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales ``(..., nb)`` float32 (``blocks`` of them) and codes ``(..., n)`` int8, clamped to ``[-L, L]``."""
    level = LEVELS[bits]
    scale_bytes = 4 * blocks
    # a fresh copy: viewing bytes as float32 needs 4-aligned offsets and strides, which a row's slice
    # need not have (and .contiguous() returns a one-row slice as it is)
    scales = data[..., :scale_bytes].clone(memory_format=torch.contiguous_format).view(torch.float32)
    code_bytes = data[..., scale_bytes:]
    if bits == 4:
        nibbles = torch.stack([code_bytes & 0x0F, code_bytes >> 4], dim=-1).reshape(*data.shape[:-1], -1)[..., :n]
        codes = (nibbles.to(torch.int8) ^ 8) - 8  # sign-extend the two's complement nibble
    else:
        codes = code_bytes.contiguous().view(torch.int8)
    return scales, codes.clamp(-level, level)
