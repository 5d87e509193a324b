"""The self-describing wire format: one or more sparse tensors in one byte string.

Layout (little-endian; see docs/wire-format.md for the full table)::

    magic  b"GWSP"          4 bytes
    version                 u8   (1)
    flags                   u8   (0; non-zero is refused)
    tensor count            u16
    per tensor, 28 bytes:   value dtype u8, index codec id u8, value codec id u8, reserved u8,
                            numel u64, count u64, index section bytes u32, value section bytes u32
    sections                index section then value section, tensor after tensor
    checksum                xxh3-64 of every byte above, u64

The decoder checks magic, version and checksum before it parses anything, then bounds every
length by the bytes actually present. Nothing is ever unpickled.

Decode cost. A few bytes can legitimately describe millions of elements (a run-length code of
one long run, a zstd frame of zeros, a Bloom filter over a huge tensor), so the bytes alone do
not bound the work; the declared sizes do. Without an explicit limit from the caller, a payload
of ``L`` bytes may ask for at most :func:`element_budget` ``(L) = 2**19 + 8 * L`` elements in
all: every tensor's ``count`` (decoded positions and values) plus, for codecs that query every
position (Bloom), ``8 * numel``. Every codec decodes in time and memory linear in its section
bytes plus those elements (docs/wire-format.md states each codec's constants), so a payload
under 1 KB costs at most about 25 ms of CPU and 11 MiB (measured, docs/benchmarks.md). A caller
that knows its tensor sizes passes them (``expected_numels``, as the DDP hook does) or a ceiling
(``max_numel``); then the declared sizes are checked against those instead, and the caller has
accepted work linear in them.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch
import xxhash

from ..errors import DecodeError, check_int, is_integer, require
from ..sparse import check_support, strictly_ascending
from .base import (
    IndexCodec,
    ValueCodec,
    get_index_codec,
    get_value_codec,
    index_codec_by_wire_id,
    value_codec_by_wire_id,
)
from .bits import MAX_NUMEL

MAGIC = b"GWSP"
VERSION = 1
_PREAMBLE = struct.Struct("<4sBBH")
_RECORD = struct.Struct("<BBBBQQII")
_CHECKSUM = struct.Struct("<Q")
MAX_TENSORS = 4096

#: Without ``max_numel``/``expected_numels``: elements any payload may ask for, however small
#: (about 25 ms of CPU and 11 MiB of decoding at worst, measured: docs/benchmarks.md).
DEFAULT_MIN_ELEMENTS = 1 << 19
#: ... plus this many per payload byte (one per bit: every lossless gap code spends >= 1 bit per index).
ELEMENTS_PER_PAYLOAD_BYTE = 8
#: A position a scanning codec (Bloom) queries counts as this many elements: its worst case
#: (every position positive, policy p2: h probes and a conflict count each) costs about 8x
#: what a decoded element costs elsewhere.
SCAN_COST = 8


def element_budget(payload_bytes: int) -> int:
    """Elements a payload of ``payload_bytes`` bytes may ask for without an explicit limit.

    What a payload asks for: the sum over its tensors of ``count``, plus ``8 * numel`` for tensors
    whose index codec queries every position (Bloom). So without a limit Bloom decodes tensors
    of at most ``2**16 + payload_bytes`` elements.

    Args:
        payload_bytes: the payload's length in bytes.

    Returns:
        ``2**19 + 8 * payload_bytes``, in elements.
    """
    return DEFAULT_MIN_ELEMENTS + ELEMENTS_PER_PAYLOAD_BYTE * int(payload_bytes)

#: Value dtypes a payload can carry, by their one-byte code.
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float64: 4,
}
_DTYPE_BY_CODE = {code: dtype for dtype, code in DTYPE_CODES.items()}


@dataclass
class EncodedTensor:
    """One tensor as the sender put it on the wire.

    ``indices`` and ``values`` are exactly what the receiver will decode (CPU tensors): for a
    lossy index codec the positions it sends, for a lossy value codec the reconstructed values.
    Error feedback uses them to keep ``residual = meant - received``.

    Attributes:
        indices: (count,) int64, strictly ascending, the positions the receiver decodes.
        values: (count,) the sender's value dtype, the values the receiver decodes.
        numel: the dense size in elements.
        index_bytes: bytes of the index section.
        value_bytes: bytes of the value section.
        stats: the index codec's counters (e.g. Bloom's false positives).
    """

    indices: torch.Tensor
    values: torch.Tensor
    numel: int
    index_bytes: int
    value_bytes: int
    stats: dict[str, float] = field(default_factory=dict)


@dataclass
class EncodedPayload:
    """A payload and, per tensor, what the receiver will reconstruct.

    Attributes:
        payload: the bytes to send (docs/wire-format.md).
        tensors: one :class:`EncodedTensor` per input tensor, in order.
    """

    payload: bytes
    tensors: list[EncodedTensor]

    @property
    def bytes_on_wire(self) -> int:
        """``len(payload)``: everything the codecs send, headers and checksum included."""
        return len(self.payload)


def _values_at(positions: np.ndarray, indices: np.ndarray, values: torch.Tensor) -> torch.Tensor:
    """Values of the sparse tensor (indices, values) at ``positions``; zero where absent."""
    slot = np.searchsorted(indices, positions)
    slot = np.minimum(slot, max(indices.size - 1, 0))
    present = indices[slot] == positions if indices.size else np.zeros(positions.size, dtype=bool)
    out = torch.zeros(positions.size, dtype=values.dtype)
    present_t = torch.from_numpy(present)
    out[present_t] = values[torch.from_numpy(slot[present])]
    return out


def _check_sparse(values: torch.Tensor, indices: torch.Tensor, numel: int) -> None:
    if not is_integer(numel):
        raise ValueError(f"numel must be an int, got {type(numel).__name__}")
    if not 0 <= numel <= MAX_NUMEL:
        raise ValueError(f"numel={numel} is not in [0, 2**40]")
    if values.dim() != 1 or indices.dim() != 1 or values.numel() != indices.numel():
        raise ValueError("values and indices must be 1-D tensors of the same length")
    if values.dtype not in DTYPE_CODES:
        allowed = ", ".join(str(d).replace("torch.", "") for d in DTYPE_CODES)
        raise ValueError(f"values dtype {values.dtype} is not supported; allowed: {allowed}")
    check_support(indices, numel)


def max_payload_bytes(tensors: Sequence[tuple[int, int]], index_codec: IndexCodec,
                      value_codec: ValueCodec) -> "int | None":
    """The most bytes :func:`encode_tensors` writes for tensors of at most these counts.

    Args:
        tensors: per tensor ``(most, numel)``: at most ``most`` entries of a tensor of ``numel``.
        index_codec: the codec of every index section.
        value_codec: the codec of every value section.

    Returns:
        Bytes (preamble, records, sections and checksum), or None when either codec cannot bound
        its sections (:meth:`~.base.IndexCodec.max_section_bytes`).
    """
    total = _PREAMBLE.size + _CHECKSUM.size
    for most, numel in tensors:
        index_bytes = index_codec.max_section_bytes(most, numel)
        value_bytes = value_codec.max_section_bytes(most)
        if index_bytes is None or value_bytes is None:
            return None
        total += _RECORD.size + index_bytes + value_bytes
    return total


def encode_tensors(
    tensors: Sequence[tuple[torch.Tensor, torch.Tensor, int]],
    index_codec: IndexCodec,
    value_codec: ValueCodec,
    *,
    check: bool = True,
    dense: "Sequence[torch.Tensor | None] | None" = None,
) -> EncodedPayload:
    """Encode several sparse tensors ``(values, indices, numel)`` into one payload.

    A lossy index codec (Bloom) may send positions outside ``indices``; their values are read
    from ``dense`` when given (DeepReduce's false-positive-aware scheme: the error-compensated
    gradient), else taken as zero.

    Args:
        tensors: per tensor ``(values, indices, numel)``: ``values`` (k,) float16/bfloat16/
            float32/float64 on any device; ``indices`` (k,) int64, strictly ascending, in
            ``[0, numel)``; ``numel`` at most 2**40. At most 4096 tensors.
        index_codec: the codec of every index section.
        value_codec: the codec of every value section.
        check: False skips validating the triples (callers that built them).
        dense: per tensor, the dense tensor (``numel`` elements, any shape) the sparse one was
            taken from, or None.

    Returns:
        The payload and, per tensor, what the receiver will decode (CPU tensors).

    Raises:
        ValueError: a malformed triple (with ``check``), more than 4096 tensors, a ``dense`` of
            the wrong length or size, a section of 4 GiB or more, or what a codec refuses.
    """
    if dense is not None and len(dense) != len(tensors):
        raise ValueError(f"dense has {len(dense)} entries for {len(tensors)} tensors")
    if len(tensors) > MAX_TENSORS:
        raise ValueError(f"at most {MAX_TENSORS} tensors per payload, got {len(tensors)}")
    records: list[bytes] = []
    sections: list[bytes] = []
    encoded: list[EncodedTensor] = []
    for position, (values, indices, numel) in enumerate(tensors):
        source = dense[position] if dense is not None else None
        values = values.detach().reshape(-1).cpu()
        indices = indices.detach().reshape(-1).to("cpu", torch.int64)
        numel = int(numel)
        if check:
            _check_sparse(values, indices, numel)
        index_np = indices.numpy()
        index_result = index_codec.encode(index_np, numel)
        positions = index_result.positions
        if positions is index_np:
            sent = values
        elif source is not None:
            source = source.detach().reshape(-1)
            if source.numel() != numel:
                raise ValueError(f"dense has {source.numel()} elements, numel is {numel}")
            sent = source[torch.from_numpy(positions).to(source.device)].cpu().to(values.dtype)
        else:
            sent = _values_at(positions, index_np, values)
        sent = sent.contiguous()
        value_data, received = value_codec.encode_with_reconstruction(sent)
        index_data = index_result.data
        if len(index_data) >= 1 << 32 or len(value_data) >= 1 << 32:
            raise ValueError("a section of 4 GiB or more does not fit the payload format")
        records.append(
            _RECORD.pack(
                DTYPE_CODES[values.dtype],
                index_codec.wire_id,
                value_codec.wire_id,
                0,
                numel,
                int(positions.size),
                len(index_data),
                len(value_data),
            )
        )
        sections += [index_data, value_data]
        out_indices = indices if positions is index_np else torch.from_numpy(positions)
        encoded.append(
            EncodedTensor(out_indices, received, numel, len(index_data), len(value_data), index_result.stats)
        )
    body = b"".join([_PREAMBLE.pack(MAGIC, VERSION, 0, len(tensors)), *records, *sections])
    return EncodedPayload(body + _CHECKSUM.pack(xxhash.xxh3_64_intdigest(body)), encoded)


def decode_tensors(
    payload: "bytes | bytearray | memoryview",
    *,
    expected_numels: "Sequence[int] | None" = None,
    max_numel: "int | None" = None,
) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """Decode every tensor of a payload into ``(values, indices, numel)`` (CPU tensors).

    Every record is checked before any section is decoded, against the first of
    ``expected_numels``, ``max_numel``, or otherwise the payload's own size: at most
    ``element_budget(len(payload))`` elements in all (counts, plus ``8 * numel`` for Bloom,
    which queries every position). A legitimate payload beyond that (e.g. a few-byte run-length
    code of 10**7 consecutive indices) needs ``max_numel``. Decoding then costs time and memory
    linear in ``len(payload)`` plus the elements accepted (docs/wire-format.md, "Decode cost
    bounds").

    Args:
        payload: the bytes received, untrusted.
        expected_numels: the tensors' sizes, when the receiver knows them (the DDP hook does);
            a payload describing other sizes is refused.
        max_numel: the largest tensor (elements) the caller accepts; larger ones are refused.

    Returns:
        Per tensor ``(values, indices, numel)``: values (count,) in the sender's dtype, indices
        (count,) int64 strictly ascending in ``[0, numel)``.

    Raises:
        DecodeError: anything but a well-formed payload within those limits.
        ValueError: ``max_numel`` is not None or an int >= 0.
    """
    check_int("max_numel", max_numel, 0, optional=True)
    try:
        view = memoryview(payload).cast("B")
    except TypeError as error:
        raise DecodeError(f"payload must be bytes-like, got {type(payload).__name__}") from error
    require(len(view) >= _PREAMBLE.size + _CHECKSUM.size, f"truncated: payload of {len(view)} bytes")
    magic, version, flags, count = _PREAMBLE.unpack_from(view, 0)
    require(magic == MAGIC, "not a gradwire payload (bad magic)")
    require(version == VERSION, f"payload format version {version} is not supported (this build reads {VERSION})")
    body = view[: len(view) - _CHECKSUM.size]
    (checksum,) = _CHECKSUM.unpack_from(view, len(body))
    require(xxhash.xxh3_64_intdigest(body) == checksum, "checksum mismatch: payload corrupt or truncated")
    require(flags == 0, f"unknown flags {flags:#x}")
    require(count <= MAX_TENSORS, f"tensor count {count} exceeds {MAX_TENSORS}")
    offset = _PREAMBLE.size
    require(len(body) >= offset + count * _RECORD.size, "truncated tensor records")
    records = [_RECORD.unpack_from(body, offset + i * _RECORD.size) for i in range(count)]
    offset += count * _RECORD.size
    if expected_numels is not None:
        sizes = [record[4] for record in records]
        require(sizes == list(expected_numels),
                f"payload describes {len(sizes)} tensors of sizes {sizes[:4]}..., "
                f"expected {list(expected_numels)[:4]}...")
    if max_numel is not None:
        largest = max((record[4] for record in records), default=0)
        require(largest <= max_numel,
                f"payload describes a tensor of {largest} elements, more than max_numel={max_numel}")
    elif expected_numels is None:
        _check_budget(records, len(view))
    out = []
    for dtype_code, index_id, value_id, reserved, numel, n_values, index_len, value_len in records:
        require(reserved == 0, "reserved byte is not zero")
        require(dtype_code in _DTYPE_BY_CODE, f"unknown value dtype code {dtype_code}")
        require(numel <= MAX_NUMEL, f"numel {numel} exceeds 2**40")
        require(n_values <= numel, f"{n_values} values for a tensor of {numel} elements")
        index_cls = index_codec_by_wire_id(index_id)
        value_cls = value_codec_by_wire_id(value_id)
        require(index_cls is not None, f"unknown index codec id {index_id}")
        require(value_cls is not None, f"unknown value codec id {value_id}")
        require(offset + index_len + value_len <= len(body), "truncated sections")
        index_data = body[offset : offset + index_len]
        value_data = body[offset + index_len : offset + index_len + value_len]
        offset += index_len + value_len
        indices = _decode_section(lambda: index_cls().decode(index_data, numel, n_values))
        _check_decoded_indices(indices, numel, n_values)
        dtype = _DTYPE_BY_CODE[dtype_code]
        values = _decode_section(lambda: value_cls().decode(value_data, n_values, dtype))
        require(
            isinstance(values, torch.Tensor) and values.shape == (n_values,) and values.dtype == dtype,
            "value codec returned the wrong shape or dtype",
        )
        out.append((values, torch.from_numpy(np.ascontiguousarray(indices, dtype=np.int64)), int(numel)))
    require(offset == len(body), f"{len(body) - offset} trailing bytes")
    return out



def _check_budget(records: "list[tuple]", payload_bytes: int) -> None:
    """Refuse a payload whose declared sizes ask for more than its own size allows."""
    elements = 0
    for record in records:
        numel, count = record[4], record[5]
        index_cls = index_codec_by_wire_id(record[1])  # unknown ids are refused later
        scans = index_cls is not None and index_cls.scans_every_position
        elements += count + (SCAN_COST * numel if scans else 0)
    budget = element_budget(payload_bytes)
    require(
        elements <= budget,
        f"a payload of {payload_bytes} bytes asks for {elements} elements (counts, plus 8 x numel for codecs "
        f"that scan every position), more than the {budget} (2**19 + 8 per byte) decoded without a limit; "
        "pass max_numel= (the largest tensor you accept) or expected_numels= to decode it",
    )


def _decode_section(run: Any) -> Any:
    """Run a codec's decode; anything but DecodeError from it is a codec bug on hostile bytes,
    reported as DecodeError so callers see one exception type."""
    try:
        return run()
    except DecodeError:
        raise
    except (ValueError, IndexError, OverflowError, KeyError, TypeError, RuntimeError, MemoryError,
            ZeroDivisionError, struct.error) as error:
        raise DecodeError(f"malformed section: {type(error).__name__}: {error}") from error


def _check_decoded_indices(indices: np.ndarray, numel: int, count: int) -> None:
    require(isinstance(indices, np.ndarray) and indices.shape == (count,), "index codec returned the wrong count")
    if count:
        require(int(indices[0]) >= 0 and int(indices[-1]) < numel, "decoded index out of range")
        require(strictly_ascending(indices), "decoded indices are not strictly ascending")


def encode(
    values: torch.Tensor,
    indices: torch.Tensor,
    numel: int,
    *,
    value_codec: "str | dict | ValueCodec" = "fp32",
    index_codec: "str | dict | IndexCodec" = "eliasfano",
    **options: Any,
) -> bytes:
    """Encode one sparse tensor into a self-describing payload.

    Args:
        values: (k,) float16/bfloat16/float32/float64.
        indices: (k,) int64, strictly ascending, in ``[0, numel)``.
        numel: the dense size in elements, at most 2**40.
        value_codec: a value codec name, config dict or instance (default ``"fp32"``).
        index_codec: an index codec name, config dict or instance (default ``"eliasfano"``).
        **options: routed by name to the codec(s) that accept them (e.g. ``bits=4`` to
            ``qsgd``, ``fpr=0.01`` to ``bloom``).

    Returns:
        The payload bytes (docs/wire-format.md).

    Raises:
        ValueError: a malformed triple, an unknown codec, or an option no chosen codec accepts
            or allows.

    >>> import torch, gradwire.codecs as codecs
    >>> payload = codecs.encode(torch.tensor([0.5, -2.0]), torch.tensor([3, 7]), 10, index_codec="rice")
    >>> codecs.decode(payload)[1].tolist()
    [3, 7]
    """
    return encode_sparse(values, indices, numel, value_codec=value_codec, index_codec=index_codec, **options).payload


def resolve_codecs(
    value_codec: "str | dict | ValueCodec", index_codec: "str | dict | IndexCodec", options: dict[str, Any]
) -> tuple[ValueCodec, IndexCodec]:
    """Build both codecs, routing each option to the codec(s) whose parameters name it.

    Args:
        value_codec: a value codec name, config dict or instance.
        index_codec: an index codec name, config dict or instance.
        options: options of either codec; an instance takes none (they were fixed when it was
            built).

    Returns:
        ``(value codec, index codec)``.

    Raises:
        ValueError: an unknown codec, or an option neither codec accepts or allows.
    """
    from .base import Codec, index_codec_classes, value_codec_classes

    def accepted(spec: Any, classes: dict[str, type]) -> tuple[str, ...]:
        name = spec.get("id") if isinstance(spec, dict) else spec
        if isinstance(spec, Codec) or name not in classes:
            return ()  # instances take no options; an unknown name fails in get_*_codec below
        return classes[name].parameter_names()

    value_names = accepted(value_codec, value_codec_classes())
    index_names = accepted(index_codec, index_codec_classes())
    unknown = sorted(set(options) - set(value_names) - set(index_names))
    if unknown:
        allowed = sorted(set(value_names) | set(index_names))
        raise ValueError(
            f"option {', '.join(unknown)} is accepted by neither value_codec {value_codec!r} nor "
            f"index_codec {index_codec!r}; allowed: {', '.join(allowed) or '(none)'}"
        )
    value_options = {k: v for k, v in options.items() if k in value_names}
    index_options = {k: v for k, v in options.items() if k in index_names}
    return get_value_codec(value_codec, **value_options), get_index_codec(index_codec, **index_options)


def encode_sparse(
    values: torch.Tensor,
    indices: torch.Tensor,
    numel: int,
    *,
    value_codec: "str | dict | ValueCodec" = "fp32",
    index_codec: "str | dict | IndexCodec" = "eliasfano",
    check: bool = True,
    dense: "torch.Tensor | None" = None,
    **options: Any,
) -> EncodedPayload:
    """Like :func:`encode`, but also return what the receiver will reconstruct (for error feedback).

    Takes :func:`encode`'s arguments, and two more.

    Args:
        check: False skips validating the triple (callers that built it).
        dense: the tensor the sparse one was taken from; see :func:`encode_tensors`.

    Returns:
        The payload and what the receiver will decode (:class:`EncodedPayload`, one tensor).

    Raises:
        ValueError: as for :func:`encode`.
    """
    values_codec_obj, index_codec_obj = resolve_codecs(value_codec, index_codec, options)
    return encode_tensors(
        [(values, indices, numel)], index_codec_obj, values_codec_obj, check=check, dense=[dense]
    )


def decode(
    payload: "bytes | bytearray | memoryview", *, max_numel: "int | None" = None
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Decode a one-tensor payload into ``(values, indices, numel)``; values keep the sender's dtype.

    Args:
        payload: the bytes received, untrusted.
        max_numel: the largest tensor the caller accepts, in elements; without it the declared
            sizes are bounded by the payload's size (see :func:`decode_tensors`).

    Returns:
        values (count,) in the sender's dtype, indices (count,) int64 strictly ascending in
        ``[0, numel)``, and ``numel``; CPU tensors.

    Raises:
        DecodeError: a malformed payload, one beyond the limit, or one of several tensors.
        ValueError: ``max_numel`` is not None or an int >= 0.
    """
    tensors = decode_tensors(payload, max_numel=max_numel)
    require(len(tensors) == 1, f"payload holds {len(tensors)} tensors; use decode_tensors")
    return tensors[0]
