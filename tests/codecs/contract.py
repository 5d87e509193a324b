"""The one shared round-trip helper every codec passes (in the manner of numcodecs' tests/common.py).

* :func:`index_cases` / :func:`check_index_codec`: the edge-case matrix for index codecs — empty
  set, one element, all elements, first/last position, n = 1, n near 2**31, random sets at
  several densities. Lossless codecs must return the exact set; lossy ones (Bloom) must return
  the positions their encoder said it sends, and those must contain... whatever their policy
  promises (checked in their own tests).
* :func:`check_value_codec`: float16/bfloat16/float32 inputs, empty, one value, NaN/Inf.
  Lossless codecs are bit-exact (NaN payloads included); lossy codecs either refuse non-finite
  input with ValueError or keep it, and stay within the ``bound`` their test passes in.
* :func:`check_config`: get_config/from_config round-trips and names the codec.
* :func:`check_rejects_corruption`: truncations and bit flips of a payload raise DecodeError.
"""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np
import pytest
import torch

import gradwire.codecs as codecs
from gradwire.codecs.base import Codec, IndexCodec, ValueCodec
from gradwire.errors import DecodeError


def index_cases(seed: int = 0) -> Iterator[tuple[str, np.ndarray, int]]:
    """(label, sorted unique int64 indices, numel) covering the edge cases."""
    rng = np.random.default_rng(seed)
    yield "empty", np.zeros(0, dtype=np.int64), 1000
    yield "empty-n0", np.zeros(0, dtype=np.int64), 0
    yield "n1-one", np.array([0], dtype=np.int64), 1
    yield "n1-empty", np.zeros(0, dtype=np.int64), 1
    yield "one-first", np.array([0], dtype=np.int64), 1000
    yield "one-last", np.array([999], dtype=np.int64), 1000
    yield "first-and-last", np.array([0, 999], dtype=np.int64), 1000
    yield "all", np.arange(777, dtype=np.int64), 777
    yield "all-but-one", np.delete(np.arange(500, dtype=np.int64), 250), 500
    yield "dense-run", np.arange(100, 400, dtype=np.int64), 1000
    big = (1 << 31) - 3
    yield "near-2^31", np.array([0, 17, big - 2, big - 1], dtype=np.int64), big
    for density in (0.001, 0.01, 0.1, 0.5):
        n = 200_003
        k = max(1, int(n * density))
        yield f"random-{density}", np.sort(rng.choice(n, size=k, replace=False)).astype(np.int64), n
    clustered = np.unique(np.concatenate([np.arange(5000, 5300), rng.integers(0, 1 << 20, 3000)]))
    yield "clustered", clustered.astype(np.int64), 1 << 20


def roundtrip_indices(codec: IndexCodec, indices: np.ndarray, numel: int) -> tuple[np.ndarray, np.ndarray]:
    """Through the full payload: (positions the encoder says it sends, positions decoded)."""
    values = torch.arange(indices.size, dtype=torch.float32)
    encoded = codecs.encode_tensors([(values, torch.from_numpy(indices), numel)], codec, codecs.get_value_codec("fp32"))
    # The receiver knows the size (as the hook does): Bloom's cases scan up to 2**26 positions,
    # beyond what a payload of its size may ask for without a limit.
    _, decoded, decoded_numel = codecs.decode(encoded.payload, max_numel=numel)
    assert decoded_numel == numel
    return encoded.tensors[0].indices.numpy(), decoded.numpy()


#: Codecs that query every position get the near-2**31 case in a slow test of their own.
SCAN_LIMIT = 1 << 26


def check_index_codec(codec: IndexCodec, *, max_numel: int | None = None) -> None:
    """Every edge case round-trips through a payload; lossless codecs return the input set."""
    if max_numel is None:
        max_numel = SCAN_LIMIT if codec.scans_every_position else 1 << 62
    for label, indices, numel in index_cases():
        if numel > max_numel:
            continue
        sent, decoded = roundtrip_indices(codec, indices, numel)
        assert decoded.dtype == np.int64, label
        np.testing.assert_array_equal(decoded, sent, err_msg=f"{codec!r} on {label}: decoded != sent")
        if codec.lossless:
            np.testing.assert_array_equal(decoded, indices, err_msg=f"{codec!r} on {label}")
        check_rejects_corruption(codecs.encode(torch.ones(indices.size), torch.from_numpy(indices), numel,
                                               index_codec=codec))


def check_index_bound(codec: IndexCodec) -> None:
    """Where the codec bounds its sections (``max_section_bytes``), every edge case fits, with
    ``most`` the exact count and a little more; the payload bound holds too."""
    fp16 = codecs.get_value_codec("fp16")
    for label, indices, numel in index_cases():
        if numel > (SCAN_LIMIT if codec.scans_every_position else 1 << 62):
            continue
        for most in sorted({indices.size, min(numel, indices.size + 3)}):
            bound = codec.max_section_bytes(most, numel)
            if bound is None:
                return
            data = codec.encode(indices, numel).data
            assert len(data) <= bound, f"{codec!r} on {label}: {len(data)} bytes over its bound {bound} (most {most})"
            payload = codecs.encode_tensors([(torch.ones(indices.size), torch.from_numpy(indices), numel)], codec, fp16)
            assert payload.bytes_on_wire <= codecs.max_payload_bytes([(most, numel)], codec, fp16), label


def value_cases(seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """(label, 1-D float tensor) — finite cases only; non-finite ones are in :func:`nonfinite_cases`."""
    generator = torch.Generator().manual_seed(seed)
    yield "empty", torch.zeros(0)
    yield "one", torch.tensor([0.25])
    yield "zeros", torch.zeros(64)
    yield "constant", torch.full((100,), -3.5)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        yield f"normal-{dtype}", (torch.randn(5000, generator=generator) * 1e-3).to(dtype)
    yield "heavy-tailed", torch.randn(20_000, generator=generator) ** 3
    yield "mixed-scale", torch.cat([torch.randn(100, generator=generator) * 1e3,
                                    torch.randn(100, generator=generator) * 1e-6])


def nonfinite_cases() -> Iterator[tuple[str, torch.Tensor]]:
    yield "nan-inf", torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), -0.0, 2.0])
    yield "nan-f16", torch.tensor([float("nan"), 1.0], dtype=torch.float16)


def roundtrip_values(codec: ValueCodec, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Through the full payload: (what the encoder says arrives, what decodes)."""
    indices = torch.arange(values.numel(), dtype=torch.int64)
    encoded = codecs.encode_tensors([(values, indices, values.numel())], codecs.get_index_codec("raw"), codec)
    decoded, _, _ = codecs.decode(encoded.payload)
    return encoded.tensors[0].values, decoded


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    width = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return bool(torch.equal(a.view(width), b.view(width)))


def check_value_codec(codec: ValueCodec, bound: "Callable[[torch.Tensor], torch.Tensor] | None" = None) -> None:
    """Round-trip the value matrix. ``bound(values)`` gives the allowed per-element absolute error
    (shape (k,)) for lossy codecs; lossless codecs must be bit-exact, NaN included."""
    assert codec.lossless or bound is not None, f"lossy codec {codec!r} must state an error bound"
    for label, values in value_cases():
        sent, decoded = roundtrip_values(codec, values)
        assert decoded.dtype == values.dtype and decoded.shape == values.shape, label
        assert _same_bits(decoded, sent), f"{codec!r} on {label}: decoded differs from what the encoder reported"
        if codec.lossless:
            assert _same_bits(decoded, values), f"{codec!r} on {label}: not bit-exact"
        else:
            error = (decoded.double() - values.double()).abs()
            allowed = bound(values).double() if values.numel() else error
            assert bool((error <= allowed + 1e-12).all()), (
                f"{codec!r} on {label}: max error {error.max().item():.3g} exceeds its bound"
            )
    for label, values in nonfinite_cases():
        if codec.lossless:
            sent, decoded = roundtrip_values(codec, values)
            assert _same_bits(decoded, values), f"{codec!r} on {label}: NaN/Inf not kept bit-exact"
        else:
            try:
                _, decoded = roundtrip_values(codec, values)
            except ValueError as error:
                assert not isinstance(error, DecodeError)
                continue
            finite = torch.isfinite(values)
            assert torch.equal(torch.isnan(decoded), torch.isnan(values)), f"{codec!r} on {label}: NaN moved"
            assert torch.equal(decoded[~finite & ~torch.isnan(values)], values[~finite & ~torch.isnan(values)])


def check_config(codec: Codec) -> None:
    config = codec.get_config()
    assert config["id"] == codec.name
    rebuilt = type(codec).from_config(config)
    assert rebuilt == codec and rebuilt.get_config() == config
    assert repr(codec).startswith(type(codec).__name__)


def check_rejects_corruption(payload: bytes, seed: int = 0) -> None:
    """Every truncation point sampled and single bit flips raise DecodeError and nothing else."""
    rng = np.random.default_rng(seed)
    cuts = {0, 1, len(payload) - 1, len(payload) // 2, *rng.integers(0, len(payload), 6).tolist()}
    for cut in cuts:
        with pytest.raises(DecodeError):
            codecs.decode(payload[:cut])
    for position in rng.integers(0, len(payload) * 8, 8).tolist():
        flipped = bytearray(payload)
        flipped[position // 8] ^= 1 << (position % 8)
        with pytest.raises(DecodeError):
            codecs.decode(bytes(flipped))


# -- decode bounds ----------------------------------------------------------------------------

#: Allocation a decoder may make on top of what its inputs allow: codec tables (Bloom's probe
#: tables are up to 8.5 MiB at h = 32), a compressor's context, numpy's temporaries.
DECODE_SLACK_BYTES = 12 << 20
#: Bytes a decoder may allocate per section byte and per element it was asked for.
DECODE_BYTES_PER_UNIT = 64


class _Peak:
    """Peak memory of one call: tracemalloc (Python objects and numpy arrays) and, where Linux
    lets the peak be reset, the resident set (which also sees torch's allocator)."""

    def __init__(self) -> None:
        import os

        self.rss = os.access("/proc/self/clear_refs", os.W_OK)

    @staticmethod
    def _status(key: str) -> int:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith(key))

    def __call__(self, run: Callable[[], object]) -> tuple[object, int]:
        """(the result or the exception raised, peak bytes above what was in use before).

        The resident set also grows when code pages of a library are first touched (file-backed,
        once per process): when it exceeds the traced peak by more than 4 MiB the call is
        measured again and the smaller resident peak kept — an allocation repeats, a page-in not.
        """
        result, traced, resident = self._measure(run)
        if resident > traced + (4 << 20):
            result, traced, resident_again = self._measure(run)
            resident = min(resident, resident_again)
        return result, max(traced, resident)

    def _measure(self, run: Callable[[], object]) -> tuple[object, int, int]:
        import tracemalloc

        started = not tracemalloc.is_tracing()
        if started:
            tracemalloc.start()
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        rss_before = 0
        if self.rss:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")
            rss_before = self._status("VmRSS:")
        try:
            result: object = run()
        except Exception as error:  # noqa: BLE001 - the caller checks the type
            result = error
        traced = tracemalloc.get_traced_memory()[1] - before
        if started:
            tracemalloc.stop()
        resident = self._status("VmHWM:") - rss_before if self.rss else 0
        return result, traced, resident


def _hostile_variants(data: bytes) -> Iterator[bytes]:
    """A section with its header bytes set to extremes (one byte, or a 32-bit field to 2**32-1),
    cut short, and extended."""
    for at in range(min(len(data), 24)):
        for byte in (0x00, 0x80, 0xFF):
            out = bytearray(data)
            out[at] = byte
            yield bytes(out)
        if at + 4 <= len(data):
            yield data[:at] + b"\xff\xff\xff\xff" + data[at + 4 :]
    yield data[: len(data) // 2]
    yield data + b"\xff" * 8


def check_decode_bounded(codec: Codec) -> None:
    """Hostile sections cost at most ``64 * (section bytes + count) + 12 MiB`` of memory in the
    codec's own decoder, and raise DecodeError or decode to the right shape; through the payload
    layer, sizes beyond what the payload's bytes allow are refused before any section decodes.

    ``count`` here is at most 4096 and ``numel`` at most 2**40 (2**14 for scanning codecs), so a
    decoder that sizes an allocation from a hostile header field shows up as gigabytes.
    """
    peak_of = _Peak()
    rng = np.random.default_rng(5)
    if isinstance(codec, IndexCodec):
        huge = 1 << 14 if codec.scans_every_position else 1 << 40
        samples = []
        for numel, k in ((3000, 0), (3000, 1), (3000, 700), (1 << 14, 40)):
            indices = np.sort(rng.choice(numel, size=k, replace=False)).astype(np.int64)
            encoding = codec.encode(indices, numel)
            samples.append((encoding.data, numel, encoding.positions.size))
        for data, numel, count in samples:  # once unmeasured: lazy initialisation is not the decoder's
            codec.decode(memoryview(data), numel, count)
        for data, numel, count in samples:
            for variant in _hostile_variants(data):
                for asked_numel, asked in {(numel, count), (huge, count + 1), (numel, 2 * count + 5), (huge, 4096)}:
                    result, peak = peak_of(lambda: codec.decode(memoryview(variant), asked_numel, asked))
                    _check_outcome(codec, result, peak, len(variant) + asked,
                                   lambda out: isinstance(out, np.ndarray) and out.shape == (asked,))
    else:
        samples = []
        for k, dtype in ((0, torch.float32), (1, torch.float16), (40, torch.float32), (700, torch.float16)):
            values = (torch.from_numpy(rng.standard_normal(k)) * 1e-2).to(dtype)
            if k == 700:
                values = values.sort(descending=True).values  # curve fits take their fitted path
            samples.append((codec.encode(values), k, dtype))
        for data, count, dtype in samples:
            codec.decode(memoryview(data), count, dtype)
        for data, count, dtype in samples:
            for variant in _hostile_variants(data):
                for asked in {count, 2 * count + 5, 4096}:
                    result, peak = peak_of(lambda: codec.decode(memoryview(variant), asked, dtype))
                    _check_outcome(codec, result, peak, len(variant) + asked,
                                   lambda out: (isinstance(out, torch.Tensor) and out.shape == (asked,)
                                                and out.dtype == dtype))
    _check_payload_bounds(codec, peak_of)


def _check_outcome(codec: Codec, result: object, peak: int, units: int, valid: Callable[[object], bool]) -> None:
    if isinstance(result, Exception):
        assert isinstance(result, DecodeError), f"{codec!r} raised {type(result).__name__}: {result}"
    else:
        assert valid(result), f"{codec!r} decoded a wrong shape or type"
    assert peak <= DECODE_BYTES_PER_UNIT * units + DECODE_SLACK_BYTES, (
        f"{codec!r} allocated {peak / 2**20:.1f} MiB decoding {units} section bytes + elements"
    )


#: Elements in the compressible inputs below: above what any small payload may ask for.
BOMB_ELEMENTS = (1 << 19) + (1 << 16)


def _check_payload_bounds(codec: Codec, peak_of: _Peak) -> None:
    """The codec's own encoding of a large compressible input (all positions of a tensor, or all
    zeros) decodes without a limit only if the payload is large enough to ask for it, and with
    ``max_numel`` always; records that declare huge sizes are refused before any section."""
    n = BOMB_ELEMENTS
    if isinstance(codec, IndexCodec):
        index_codec, value_codec = codec, codecs.get_value_codec("zstd")
    else:
        index_codec, value_codec = codecs.get_index_codec("rle"), codec
    values = torch.zeros(n)
    encoded = codecs.encode_tensors([(values, torch.arange(n), n)], index_codec, value_codec)
    payload = encoded.payload
    scanned = 8 * n if index_codec.scans_every_position else 0
    result, peak = peak_of(lambda: codecs.decode(payload))
    if n + scanned <= codecs.element_budget(len(payload)):
        assert not isinstance(result, Exception), f"{codec!r}: {result}"
    else:
        assert isinstance(result, DecodeError) and "max_numel" in str(result), f"{codec!r}: {result!r}"
        assert peak < 1 << 20, f"{codec!r}: {peak / 2**20:.1f} MiB to refuse a payload of {len(payload)} bytes"
    decoded_values, decoded_indices, numel = codecs.decode(payload, max_numel=n)
    assert numel == n and decoded_values.shape == (encoded.tensors[0].indices.numel(),)
    assert torch.equal(decoded_indices, encoded.tensors[0].indices)

    # a small payload whose record declares huge sizes: refused up front, whatever the codec
    small = codecs.encode_tensors([(torch.ones(3), torch.tensor([1, 5, 9]), 16)], index_codec, value_codec).payload
    from gradwire.codecs.payload import _PREAMBLE, _RECORD

    import struct

    import xxhash

    body = small[:-8]
    fields = list(_RECORD.unpack_from(body, _PREAMBLE.size))
    for numel, count in ((1 << 28, 1 << 28), (1 << 40, 1 << 39), (1 << 32, 3), (1 << 40, 3)):
        fields[4], fields[5] = numel, count
        changed = body[: _PREAMBLE.size] + _RECORD.pack(*fields) + body[_PREAMBLE.size + _RECORD.size :]
        hostile = changed + struct.pack("<Q", xxhash.xxh3_64_intdigest(changed))
        result, peak = peak_of(lambda: codecs.decode(hostile))
        if count > 3 or index_codec.scans_every_position:
            assert isinstance(result, DecodeError), f"{codec!r} numel={numel} count={count}: {result!r}"
        else:  # a larger numel alone changes nothing for most codecs: refused or decoded, cheaply
            assert isinstance(result, (DecodeError, tuple)), f"{codec!r} numel={numel}: {result!r}"
        assert peak < 1 << 20, f"{codec!r}: {peak / 2**20:.1f} MiB to refuse numel={numel}, count={count}"
