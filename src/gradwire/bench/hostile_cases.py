"""Hostile payloads for ``gradwire bench hostile`` and the decode-bound tests.

Every payload here carries a valid checksum (a hostile sender recomputes it), so it reaches the
codecs. Two kinds:

* :func:`hand_made`: crafted sections that declare far more than they hold (run-length codes,
  zstd/deflate bombs, Bloom filters over 2**32 positions, Huffman tables, Elias-Fano/Rice/QSGD/
  curve-fit headers with huge counts), plus the heaviest payloads the default limit still lets
  through (``at-budget``: a few hundred bytes that decode to ``element_budget(len)`` elements).
* :func:`mutated`: valid payloads of every index x value codec pair, each damaged once (bytes
  overwritten, bits flipped, size fields set to extreme values, sections cut, extended, swapped
  or relabelled with another codec id), then resealed.

``Case.max_numel`` is None for every case that must be bounded without an opt-in.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import torch
import xxhash
import zstandard

from .. import codecs
from ..codecs.bits import encode_varint, pack_unary
from ..codecs.index._bitstream import write_fields
from ..codecs.payload import _PREAMBLE, _RECORD, DTYPE_CODES, MAGIC, SCAN_COST, VERSION, element_budget

_CHECKSUM = struct.Struct("<Q")
_F32 = DTYPE_CODES[torch.float32]


@dataclass(frozen=True)
class Case:
    """One payload to decode; ``max_numel`` is the caller's limit (None: the payload's own budget)."""

    group: str  # e.g. "rle", "bloom", "mutated:rice+fp16"
    label: str
    payload: bytes
    max_numel: "int | None" = None


@dataclass(frozen=True)
class Record:
    """One tensor record of a hand-made payload: codecs by name, sizes, and raw section bytes."""

    index_codec: str
    value_codec: str
    numel: int
    count: int
    index_data: bytes
    value_data: bytes
    dtype: int = _F32


def reseal(body: bytes) -> bytes:
    """``body`` followed by its checksum: what a hostile sender does after tampering."""
    return body + _CHECKSUM.pack(xxhash.xxh3_64_intdigest(body))


def build(records: "list[Record]") -> bytes:
    """A payload of raw records and sections, sealed with a valid checksum."""
    head = [_PREAMBLE.pack(MAGIC, VERSION, 0, len(records))]
    sections = []
    for r in records:
        index_id = codecs.get_index_codec(r.index_codec).wire_id
        value_id = codecs.get_value_codec(r.value_codec).wire_id
        head.append(_RECORD.pack(r.dtype, index_id, value_id, 0, r.numel, r.count, len(r.index_data),
                                 len(r.value_data)))
        sections += [r.index_data, r.value_data]
    return reseal(b"".join(head + sections))


# -- sections ---------------------------------------------------------------------------------


def rle_run(start: int, length: int) -> bytes:
    """The ``rle`` section of the positions ``[start, start + length)``: a handful of bytes."""
    runs = np.array([start + 1, length], dtype=np.int64)
    widths = np.array([int(x).bit_length() - 1 for x in runs], dtype=np.int64)
    lengths, _ = pack_unary(widths)
    return encode_varint(np.array([1])) + lengths + write_fields(runs - (np.int64(1) << widths), widths)


def zstd_zeros(size: int, level: int = 1) -> bytes:
    """A genuine zstd frame of ``size`` zero bytes (content size in its header), built in chunks."""
    compressor = zstandard.ZstdCompressor(level=level, write_content_size=True).compressobj(size=size)
    chunk = bytes(min(size, 1 << 22))
    parts = []
    left = size
    while left:
        step = min(left, len(chunk))
        parts.append(compressor.compress(chunk[:step]))
        left -= step
    return b"".join(parts) + compressor.flush()


def zstd_lying_header(declared: int, actual: int = 16) -> bytes:
    """A single-segment zstd frame whose header declares ``declared`` bytes; its one RLE block
    produces ``actual`` (zero) bytes."""
    descriptor = 0b11100000  # 8-byte content size, single segment, no checksum, no dictionary
    block = (actual << 3) | (1 << 1) | 1  # last block, type RLE, size
    return b"\x28\xb5\x2f\xfd" + bytes([descriptor]) + struct.pack("<Q", declared) + block.to_bytes(3, "little") + b"\0"


def deflate_zeros(size: int) -> bytes:
    """A raw DEFLATE stream of ``size`` zero bytes: a bomb of about 1 KiB per MiB (DEFLATE's ratio, 1032)."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    return compressor.compress(bytes(size)) + compressor.flush()


def bloom_section(*, policy: int, h: int, k: int, filter_bytes: bytes, seed: int = 7) -> bytes:
    """A Bloom index section as :mod:`gradwire.codecs.index.bloom` lays it out, header fields as given."""
    return struct.pack("<BBQQQ", policy, h, seed, k, 8 * len(filter_bytes)) + filter_bytes


# -- hand-made cases --------------------------------------------------------------------------


def _fit_header(segments: int, n_params: int = 4) -> bytes:
    return bytes([1]) + struct.pack("<hBI", 0, n_params, segments)


def _at_budget(make: "Callable[[int], bytes]", guess: int, share: int = 1, extra: int = 0) -> tuple[bytes, int]:
    """``(make(n), n)`` for the largest ``n`` whose ``share * n + extra`` elements fit the payload's
    own budget, less 64 to spare for the payload growing a little (``share=2``: ``n`` both
    counted and scanned)."""
    n = guess
    for _ in range(3):  # the payload's size depends a little on n
        n = (element_budget(len(make(n))) - extra) // share - 64
    payload = make(n)
    if share * n + extra > element_budget(len(payload)):
        raise AssertionError(f"at-budget payload of {len(payload)} bytes exceeds its budget")
    return payload, n


def hand_made(*, big: bool = True) -> list[Case]:
    """The crafted hostile set. ``big=False`` leaves out or shrinks the few cases that take a
    second or more to build (a genuine 1 GiB zstd bomb, a 64 MiB deflate bomb), for tests."""
    cases: list[Case] = []
    add = lambda group, label, records, max_numel=None: cases.append(  # noqa: E731
        Case(group, label, build(records), max_numel))

    # run-length codes: a few bytes name 2**28 positions (the probe's 53-byte payload)
    for exponent in (28, 36, 39):
        n = 1 << exponent
        add("rle", f"one run of 2^{exponent}, empty values", [Record("rle", "fp32", n, n, rle_run(0, n), b"")])
    add("rle", "run of 2^39 in 2^40, fp16-scaled values",
        [Record("rle", "fp16-scaled", 1 << 40, 1 << 39, rle_run(5, 1 << 39), b"\0")])
    if big:
        n = 1 << 28
        add("rle", "run of 2^28 + genuine 1 GiB zstd bomb of values",
            [Record("rle", "zstd", n, n, rle_run(0, n), b"\x00" + zstd_zeros(4 * n))])
    n = 1 << 24
    add("rle", "run of 2^24 + zstd frame declaring 2^26 bytes",
        [Record("rle", "zstd", n, n, rle_run(0, n), b"\x00" + zstd_lying_header(4 * n))])
    add("rle", "run of 2^24 + deflate bomb",
        [Record("rle", "deflate", n, n, rle_run(0, n), b"\x00" + deflate_zeros(1 << 20))])

    # Bloom: the receiver queries every position
    one_bit = bytes([1])
    for policy, name in enumerate(("p0", "p1", "p2")):
        add("bloom", f"{name}, numel 2^32, 1-byte filter (71 B)",
            [Record("bloom", "fp32", 1 << 32, 1, bloom_section(policy=policy, h=1, k=1, filter_bytes=one_bit),
                    b"\0" * 4)])
    ones = bytes([255]) * 64
    add("bloom", "p0, numel 2^26, all-ones filter, count 2^26",
        [Record("bloom", "fp32", 1 << 26, 1 << 26, bloom_section(policy=0, h=32, k=16, filter_bytes=ones), b"")])
    add("bloom", "p2, numel 2^30, all-ones filter",
        [Record("bloom", "fp32", 1 << 30, 16, bloom_section(policy=2, h=1, k=512, filter_bytes=ones), b"\0" * 64)])
    add("bloom", "30 tensors of numel 2^27 each (under 1 KB)",
        [Record("bloom", "fp32", 1 << 27, 0, bloom_section(policy=0, h=1, k=0, filter_bytes=b"\0"), b"")] * 30)
    add("bloom", "4096 tensors of numel 2^20 (2^32 in all)",
        [Record("bloom", "fp32", 1 << 20, 0, bloom_section(policy=0, h=1, k=0, filter_bytes=b"\0"), b"")] * 4096)

    # zstd / deflate index sections
    count = 26 << 20
    add("zstd", "index bomb: frame of 104 MiB zeros",
        [Record("zstd", "fp32", 1 << 30, count, b"\x04" + zstd_zeros(4 * count, 19 if big else 1), b"")])
    add("zstd", "index frame declaring 2^40 bytes",
        [Record("zstd", "fp32", 1 << 40, 1 << 37, b"\x08" + zstd_lying_header(1 << 40), b"")])
    add("zstd", "index frame declaring 2^40 bytes, count 4",
        [Record("zstd", "fp32", 1 << 40, 4, b"\x08" + zstd_lying_header(1 << 40), bytes(16))])
    add("zstd", "value frame declaring 2^40 bytes",
        [Record("rle", "zstd", 1 << 38, 1 << 38, rle_run(0, 1 << 38), b"\x00" + zstd_lying_header(1 << 40))])
    mib = 64 if big else 8
    add("deflate", f"index bomb: {mib} MiB of zeros",
        [Record("deflate", "fp32", 1 << 30, mib << 18, b"\x04" + deflate_zeros(mib << 20), b"")])
    add("deflate", "index bomb under 1 KB (1 MiB of zeros)",
        [Record("deflate", "fp32", 1 << 30, 1 << 18, b"\x04" + deflate_zeros(1 << 20), b"")])
    add("deflate", "value bomb under 1 KB (count 2^18)",
        [Record("raw", "deflate", 1 << 30, 1 << 18, b"\x04", b"\x00" + deflate_zeros(1 << 20))])

    # Huffman tables
    lengths15 = bytes([0xFF]) * 21
    add("huffman", "41 codes of length 15 (oversubscribed)",
        [Record("huffman", "fp32", 1 << 40, 8, bytes([41]) + lengths15 + b"\x08" + bytes(8), b"")])
    table = bytes([0x11])  # two symbols, one bit each: every bit is a code
    add("huffman", "900-byte code stream, count 7200 (1 bit per code)",
        [Record("huffman", "fp32", 1 << 40, 7200, bytes([2]) + table + encode_varint(np.array([900])) + bytes(900),
                b"")])
    add("huffman", "count 2^40 on a tiny stream",
        [Record("huffman", "fp32", 1 << 40, 1 << 40, bytes([2]) + table + b"\x04" + bytes(4), b"")])

    # gap codes and raw with counts far beyond their bytes
    for codec, section in (("eliasfano", bytes(64)), ("rice", bytes([40]) + bytes(63)), ("delta-varint", bytes(64)),
                           ("raw", b"\x08" + bytes(64)), ("bitmap", bytes(64))):
        add(codec, "count 2^39, numel 2^40", [Record(codec, "fp32", 1 << 40, 1 << 39, section, b"")])
        add(codec, "count = 8 x bytes, numel 2^40", [Record(codec, "fp32", 1 << 40, 8 * len(section), section, b"")])

    # value codecs with huge internal fields
    raw1 = b"\x04" + struct.pack("<I", 3)
    add("qsgd", "bucket 2^32-1, count 2^36",
        [Record("rle", "qsgd", 1 << 40, 1 << 36, rle_run(0, 1 << 36),
                b"\x02" + struct.pack("<I", 2**32 - 1) + bytes(12))])
    add("qsgd", "bits 2, count 2^20 under 1 KB (section lies)",
        [Record("rle", "qsgd", 1 << 20, 1 << 20, rle_run(0, 1 << 20), b"\x02" + struct.pack("<I", 1) + bytes(900))])
    for codec in ("polyfit", "dexp"):
        add(codec, "2^32-1 segments, count 2^30",
            [Record("rle", codec, 1 << 30, 1 << 30, rle_run(0, 1 << 30),
                    _fit_header(2**32 - 1, 4 if codec == "dexp" else 11) + bytes(64))])
        add(codec, "255 parameters, one value", [Record("raw", codec, 10, 1, raw1, _fit_header(1, 255) + bytes(64))])
    add("fp16-scaled", "count 2^30, 1-byte section",
        [Record("rle", "fp16-scaled", 1 << 30, 1 << 30, rle_run(0, 1 << 30), b"\0")])

    # the heaviest payloads the default limit lets through: decode, in bounded time and memory
    def rle_values(value_codec: str, stream: "Callable[[int], bytes]") -> "Callable[[int], bytes]":
        return lambda n: build([Record("rle", value_codec, n, n, rle_run(0, n), b"\x00" + stream(n))])

    for value_codec, stream in (("zstd", lambda n: zstd_zeros(4 * n)), ("deflate", lambda n: deflate_zeros(4 * n))):
        payload, n = _at_budget(rle_values(value_codec, stream), 1 << 20)
        cases.append(Case("at-budget", f"rle + {value_codec} zeros, {n} elements", payload))

    def zstd_index(n: int) -> bytes:
        raw = np.arange(n, dtype="<u4").tobytes()
        frame = zstandard.ZstdCompressor(level=3, write_content_size=True).compress(raw)
        return build([Record("zstd", "zstd", n, n, b"\x04" + frame, b"\x00" + zstd_zeros(4 * n))])

    n = 1 << 20  # ascending positions compress poorly: the payload is large, its budget larger
    cases.append(Case("at-budget", f"zstd index + zstd values, {n} elements", zstd_index(n)))

    def bloom_all(policy: int) -> "Callable[[int], bytes]":
        # 128 filter bits, all set, h = 1: every position is positive
        def make(numel: int) -> bytes:
            k = 128
            section = bloom_section(policy=policy, h=1, k=k, filter_bytes=bytes([255]) * 16)
            count = numel if policy == 0 else k
            return build([Record("bloom", "zstd", numel, count, section, b"\x00" + zstd_zeros(4 * count))])
        return make

    for policy, name in enumerate(("p0", "p1", "p2")):
        payload, n = _at_budget(bloom_all(policy), 1 << 16, share=SCAN_COST + (policy == 0),
                                extra=0 if policy == 0 else 128)
        cases.append(Case("at-budget", f"bloom {name}, all-ones filter, numel {n}", payload))

    # the opt-in: the same kind of payload decodes when the caller accepts the size
    n = 1 << 22
    cases.append(Case("opt-in", f"rle + zstd zeros, {n} elements, max_numel={n}",
                      rle_values("zstd", lambda m: zstd_zeros(4 * m))(n), n))
    return cases


# -- mutated payloads -------------------------------------------------------------------------

_NUMEL_CHOICES = (1, 7, 300, 4096, 100_003, 1 << 20, (1 << 31) - 1, 1 << 32, (1 << 32) + 5, 1 << 40)
_EXTREMES = (0, 1, 2, 255, 256, 1 << 16, 1 << 20, 1 << 24, 1 << 28, 1 << 31, 1 << 32, 1 << 36, 1 << 39, 1 << 40,
             (1 << 40) + 1, (1 << 64) - 1)


def _base_payloads(rng: np.random.Generator) -> Iterator[tuple[str, bytes]]:
    """Valid payloads of every index x value codec pair, small random tensors."""
    index_names, value_names = codecs.index_codecs(), codecs.value_codecs()
    while True:
        index_name = index_names[rng.integers(len(index_names))]
        value_name = value_names[rng.integers(len(value_names))]
        numel = int(_NUMEL_CHOICES[rng.integers(len(_NUMEL_CHOICES))])
        if index_name == "bloom":
            numel = min(numel, 1 << 16)
        if index_name == "bitmap":
            numel = min(numel, 1 << 13)
        k = int(min(numel, rng.integers(0, 120)))
        if numel < 1 << 24:
            indices = np.sort(rng.choice(numel, size=k, replace=False))
        else:
            indices = np.unique(rng.integers(0, numel, k))
        dtype = (torch.float32, torch.float16, torch.bfloat16, torch.float64)[rng.integers(4)]
        values = (torch.from_numpy(rng.standard_normal(indices.size)) * 1e-2).to(dtype)
        if rng.random() < 0.3:
            values = values.sort(descending=True).values  # gives the curve fits something to fit
        try:
            payload = codecs.encode(values, torch.from_numpy(indices.astype(np.int64)), numel,
                                    index_codec=index_name, value_codec=value_name)
        except ValueError:
            continue  # e.g. a codec that refuses an input (qsgd's norm range): not a decode case
        yield f"{index_name}+{value_name}", payload


def _records(body: bytes) -> list[list[int]]:
    count = struct.unpack_from("<H", body, 6)[0]
    return [list(_RECORD.unpack_from(body, _PREAMBLE.size + i * _RECORD.size)) for i in range(count)]


def _with_records(body: bytes, records: list[list[int]], sections: bytes) -> bytes:
    head = body[: _PREAMBLE.size]
    return head + b"".join(_RECORD.pack(*r) for r in records) + sections


def _mutate(body: bytes, rng: np.random.Generator, other: bytes) -> bytes:
    """One random damage to a payload body (no checksum); see the module docstring."""
    records = _records(body)
    start = _PREAMBLE.size + len(records) * _RECORD.size
    sections = bytearray(body[start:])
    kind = rng.integers(9)
    if kind == 0 and len(body):  # overwrite 1-4 bytes anywhere (headers included)
        out = bytearray(body)
        for _ in range(rng.integers(1, 5)):
            out[rng.integers(len(out))] = rng.integers(256)
        return bytes(out)
    if kind == 1 and len(body):  # flip 1-3 bits
        out = bytearray(body)
        for _ in range(rng.integers(1, 4)):
            bit = rng.integers(len(out) * 8)
            out[bit // 8] ^= 1 << (bit % 8)
        return bytes(out)
    if kind == 2 and records:  # a size field of a record to an extreme
        record = records[rng.integers(len(records))]
        field = (4, 5, 6, 7)[rng.integers(4)]
        value = int(_EXTREMES[rng.integers(len(_EXTREMES))])
        limit = (1 << 64) - 1 if field in (4, 5) else (1 << 32) - 1
        record[field] = min(value, limit)
        if field == 5 and rng.random() < 0.5:
            record[4] = max(record[4], record[5])  # keep count <= numel so the check passes
        return _with_records(body, records, bytes(sections))
    if kind == 3 and sections:  # the first bytes of the sections (codec headers) to extremes
        at = rng.integers(min(len(sections), 16))
        sections[at] = (0, 1, 0x7F, 0x80, 0xFF)[rng.integers(5)]
        if rng.random() < 0.5 and at + 4 <= len(sections):
            sections[at : at + 4] = b"\xff\xff\xff\xff"
        return _with_records(body, records, bytes(sections))
    if kind == 4 and records:  # cut or extend the first section, keeping the lengths consistent
        record = records[0]
        if rng.random() < 0.5 and record[6]:
            cut = rng.integers(record[6])
            del sections[cut : record[6]]
            record[6] = cut
        else:
            extra = rng.bytes(rng.integers(1, 9))
            sections[record[6] : record[6]] = extra
            record[6] += len(extra)
        return _with_records(body, records, bytes(sections))
    if kind == 5 and records:  # relabel a codec id
        record = records[rng.integers(len(records))]
        field = 1 + rng.integers(2)
        record[field] = int(rng.integers(1, 12))
        return _with_records(body, records, bytes(sections))
    if kind == 6 and records:  # declared count 2^k with numel raised to match
        record = records[rng.integers(len(records))]
        record[5] = 1 << int(rng.integers(10, 41))
        record[4] = max(record[4], record[5])
        return _with_records(body, records, bytes(sections))
    if kind == 7:  # sections of another payload under these records
        other_records = _records(other)
        other_start = _PREAMBLE.size + len(other_records) * _RECORD.size
        return _with_records(body, records, other[other_start:])
    # kind 8: duplicate the tensor record and its sections (a two-tensor payload), then damage
    if records:
        doubled = _with_records(body, records * 2, bytes(sections) * 2)
        doubled = doubled[:6] + struct.pack("<H", 2 * len(records)) + doubled[8:]
        return _mutate(doubled, rng, other) if rng.random() < 0.5 else doubled
    return body


def mutated(count: int, seed: int = 0) -> Iterator[Case]:
    """``count`` damaged, resealed payloads (see the module docstring)."""
    rng = np.random.default_rng(seed)
    bases = _base_payloads(rng)
    pool = [next(bases) for _ in range(max(1, min(400, count)))]
    for i in range(count):
        if i % 50 == 0:  # refresh the pool slowly: new tensors, new sizes
            pool[rng.integers(len(pool))] = next(bases)
        group, payload = pool[rng.integers(len(pool))]
        _, other = pool[rng.integers(len(pool))]
        yield Case(f"mutated:{group}", f"#{i}", reseal(_mutate(payload[:-8], rng, other[:-8])))
