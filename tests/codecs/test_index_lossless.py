"""Lossless index codecs: sizes, options, edge cases beyond the shared contract, and fuzzed decoding.

The shared round-trip contract runs for every registered codec in test_all_codecs.py; this file
adds what is particular to delta-varint, bitmap, rle, huffman, eliasfano, rice, zstd and deflate.
"""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gradwire.codecs as codecs
from gradwire.codecs.bits import pack_uint
from gradwire.codecs.index._bitstream import field_offsets, read_fields, read_fixed, write_fields, write_fixed
from gradwire.codecs.index.huffman import MAX_CODE_LENGTH, huffman_lengths, limited_lengths, unpack_lengths
from gradwire.errors import DecodeError

from .contract import check_config

LOSSLESS = ["delta-varint", "bitmap", "rle", "huffman", "eliasfano", "rice", "zstd", "deflate"]
#: Codecs whose size does not grow with numel (bitmap needs numel / 8 bytes).
GAP_CODECS = [name for name in LOSSLESS if name != "bitmap"]


def bound_bits(numel: int, count: int) -> float:
    """log2 C(numel, count): the fewest bits any code can spend on a count-subset of [0, numel)."""
    return (math.lgamma(numel + 1) - math.lgamma(count + 1) - math.lgamma(numel - count + 1)) / math.log(2)


def random_set(numel: int, count: int, seed: int = 0) -> np.ndarray:
    return np.sort(np.random.default_rng(seed).choice(numel, size=count, replace=False)).astype(np.int64)


def roundtrip(codec: codecs.IndexCodec, indices: np.ndarray, numel: int) -> bytes:
    encoding = codec.encode(indices, numel)
    assert encoding.positions is indices
    decoded = codec.decode(memoryview(encoding.data), numel, indices.size)
    assert decoded.dtype == np.int64
    np.testing.assert_array_equal(decoded, indices)
    return encoding.data


def assert_valid_or_refused(codec: codecs.IndexCodec, data: bytes, numel: int, count: int) -> None:
    """Decoding hostile bytes raises DecodeError or yields a well-formed set — nothing else."""
    try:
        decoded = codec.decode(memoryview(data), numel, count)
    except DecodeError:
        return
    assert isinstance(decoded, np.ndarray) and decoded.dtype == np.int64 and decoded.shape == (count,)
    if count:
        assert int(decoded[0]) >= 0 and int(decoded[-1]) < numel
        assert bool(np.all(decoded[1:] > decoded[:-1]))


def test_all_registered() -> None:
    wire_ids = {name: codecs.get_index_codec(name).wire_id for name in LOSSLESS}
    assert wire_ids == {
        "delta-varint": 2, "bitmap": 3, "rle": 4, "huffman": 5, "eliasfano": 6, "rice": 7, "zstd": 8, "deflate": 9,
    }
    assert all(codecs.get_index_codec(name).lossless for name in LOSSLESS)


@pytest.mark.parametrize("name", GAP_CODECS)
@pytest.mark.parametrize(
    "indices, numel",
    [
        ([0, (1 << 40) - 1], 1 << 40),
        ([5, (1 << 32) - 1, 1 << 32, (1 << 32) + 1], (1 << 32) + 2),
        ([(1 << 33) + 7], 1 << 34),
        (list(range(1000, 1100)) + [(1 << 39) + 3], 1 << 40),
        ([], 1 << 40),
    ],
    ids=["ends-of-2^40", "across-2^32", "lone-above-2^32", "run-and-far", "empty-2^40"],
)
def test_large_numel(name: str, indices: list[int], numel: int) -> None:
    roundtrip(codecs.get_index_codec(name), np.array(indices, dtype=np.int64), numel)


@pytest.mark.parametrize("name", LOSSLESS)
def test_clustered_and_periodic(name: str) -> None:
    codec = codecs.get_index_codec(name)
    rng = np.random.default_rng(3)
    numel = 1 << 18
    clustered = np.unique(np.concatenate([np.arange(start, start + 200) for start in rng.integers(0, numel - 200, 30)]))
    roundtrip(codec, clustered.astype(np.int64), numel)
    roundtrip(codec, np.arange(0, numel, 7, dtype=np.int64), numel)
    roundtrip(codec, np.arange(numel, dtype=np.int64), numel)


def test_bitmap_size() -> None:
    codec = codecs.get_index_codec("bitmap")
    for numel in (1, 7, 8, 9, 1000, 200_003):
        indices = random_set(numel, max(1, numel // 10))
        assert len(roundtrip(codec, indices, numel)) == (numel + 7) // 8


def test_delta_varint_size() -> None:
    indices = np.array([0, 127, 128 + 127 + 1, 1 << 20], dtype=np.int64)
    # gaps 0, 126, 128, (1 << 20) - 384: 1 + 1 + 2 + 3 bytes
    assert len(roundtrip(codecs.get_index_codec("delta-varint"), indices, 1 << 21)) == 7


def test_rle_long_runs_cost_almost_nothing() -> None:
    codec = codecs.get_index_codec("rle")
    assert len(roundtrip(codec, np.arange(1_000_000, dtype=np.int64), 1_000_000)) <= 8
    assert len(roundtrip(codec, np.arange(500, 900_000, dtype=np.int64), 1 << 20)) <= 10


def test_eliasfano_size() -> None:
    numel, count = 1 << 20, 10_000
    indices = random_set(numel, count)
    width = (numel // count).bit_length() - 1
    high_bits = (int(indices[-1]) >> width) + count
    expected = (count * width + 7) // 8 + (high_bits + 7) // 8
    assert len(roundtrip(codecs.get_index_codec("eliasfano"), indices, numel)) == expected


@pytest.mark.parametrize("density", [0.001, 0.01, 0.1])
def test_rice_within_three_percent_of_bound(density: float) -> None:
    numel = 1 << 20
    indices = random_set(numel, int(numel * density), seed=7)
    bits = 8 * len(roundtrip(codecs.get_index_codec("rice"), indices, numel))
    assert bits <= 1.03 * bound_bits(numel, indices.size)


@pytest.mark.parametrize("density", [0.001, 0.01, 0.1])
def test_huffman_and_eliasfano_near_bound(density: float) -> None:
    numel = 1 << 20
    indices = random_set(numel, int(numel * density), seed=8)
    bound = bound_bits(numel, indices.size)
    assert 8 * len(roundtrip(codecs.get_index_codec("huffman"), indices, numel)) <= 1.06 * bound
    assert 8 * len(roundtrip(codecs.get_index_codec("eliasfano"), indices, numel)) <= 1.15 * bound


def test_rice_explicit_parameter() -> None:
    indices = random_set(100_000, 1000)
    for parameter in (0, 5, 40):
        codec = codecs.get_index_codec("rice", parameter=parameter)
        data = roundtrip(codec, indices[:5] if parameter == 0 else indices, 100_000)
        assert data[0] == parameter
        # The decoder reads the parameter from the section, not from its own options.
        np.testing.assert_array_equal(
            codecs.get_index_codec("rice").decode(memoryview(data), 100_000, 5 if parameter == 0 else 1000),
            indices[:5] if parameter == 0 else indices,
        )


def test_huffman_code_lengths_are_limited() -> None:
    fibonacci = [1, 1]
    while len(fibonacci) < 30:
        fibonacci.append(fibonacci[-1] + fibonacci[-2])
    assert max(huffman_lengths(fibonacci[::-1])) > MAX_CODE_LENGTH
    lengths = limited_lengths(fibonacci[::-1])
    assert max(lengths) <= MAX_CODE_LENGTH and min(lengths) >= 1
    assert sum(2.0 ** -length for length in lengths) <= 1.0
    # The same skew through the codec: size class s (gaps in [2**s, 2**(s+1)) ) is Fibonacci-rare.
    rng = np.random.default_rng(5)
    frequencies = fibonacci[:20][::-1]
    assert max(huffman_lengths(frequencies)) > MAX_CODE_LENGTH
    classes = np.repeat(np.arange(20), frequencies)
    values = (np.int64(1) << classes) + rng.integers(0, 1 << 20, classes.size) % (np.int64(1) << classes)
    indices = np.cumsum(rng.permutation(values)) - 1
    data = roundtrip(codecs.get_index_codec("huffman"), indices, int(indices[-1]) + 1)
    table = unpack_lengths(memoryview(data)[1 : 1 + (data[0] + 1) // 2], data[0])
    assert max(table) <= MAX_CODE_LENGTH and sum(2.0 ** -length for length in table if length) <= 1.0


@pytest.mark.parametrize(
    "name, options, option",
    [
        ("rice", {"parameter": -1}, "parameter"),
        ("rice", {"parameter": 41}, "parameter"),
        ("rice", {"parameter": 2.0}, "parameter"),
        ("rice", {"parameter": True}, "parameter"),
        ("zstd", {"level": 0}, "level"),
        ("zstd", {"level": 23}, "level"),
        ("zstd", {"level": "3"}, "level"),
        ("deflate", {"level": -1}, "level"),
        ("deflate", {"level": 10}, "level"),
        ("deflate", {"level": False}, "level"),
    ],
)
def test_invalid_options(name: str, options: dict, option: str) -> None:
    with pytest.raises(ValueError, match=option) as error:
        codecs.get_index_codec(name, **options)
    assert not isinstance(error.value, DecodeError)
    assert "allowed" in str(error.value)


@pytest.mark.parametrize(
    "name, options",
    [(name, {}) for name in LOSSLESS]
    + [("rice", {"parameter": 7}), ("zstd", {"level": 19}), ("deflate", {"level": 1})],
)
def test_config_round_trip(name: str, options: dict) -> None:
    codec = codecs.get_index_codec(name, **options)
    check_config(codec)
    assert codecs.get_index_codec(codec.get_config()) == codec
    for option, value in options.items():
        assert codec.get_config()[option] == value


@pytest.mark.parametrize("name", LOSSLESS)
def test_huge_count_fails_fast(name: str) -> None:
    codec = codecs.get_index_codec(name)
    for data in (bytes(10), bytes([1]) * 10, bytes([4]) + bytes(9), bytes(range(10))):
        with pytest.raises(DecodeError):
            codec.decode(memoryview(data), 1 << 40, 10**12)
        with pytest.raises(DecodeError):
            codec.decode(memoryview(data), 1000, 10**12)  # more than numel


@pytest.mark.parametrize("name", LOSSLESS)
def test_section_of_other_count_refused(name: str) -> None:
    codec = codecs.get_index_codec(name)
    indices = random_set(10_000, 300)
    data = codec.encode(indices, 10_000).data
    for count in (299, 301, 0):
        with pytest.raises(DecodeError):
            codec.decode(memoryview(data), 10_000, count)
    with pytest.raises(DecodeError):
        codec.decode(memoryview(data + b"\x00"), 10_000, 300)


def test_zstd_bomb_and_frames_without_size_refused() -> None:
    codec = codecs.get_index_codec("zstd")
    bomb = bytes([4]) + zstandard.ZstdCompressor(level=19).compress(bytes(16 << 20))
    with pytest.raises(DecodeError):
        codec.decode(memoryview(bomb), 1 << 30, 10)
    with pytest.raises(DecodeError):  # the right size, but zeros are not ascending
        codec.decode(memoryview(bomb), 1 << 30, 4 << 20)
    unsized = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    frame = unsized.compress(np.arange(10, dtype="<u4").tobytes()) + unsized.flush()
    with pytest.raises(DecodeError):
        codec.decode(memoryview(bytes([4]) + frame), 100, 10)


def test_deflate_bomb_refused() -> None:
    codec = codecs.get_index_codec("deflate")
    compressor = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    bomb = bytes([4]) + compressor.compress(bytes(16 << 20)) + compressor.flush()
    with pytest.raises(DecodeError):
        codec.decode(memoryview(bomb), 1 << 30, 10)
    wrapped = bytes([4]) + zlib.compress(np.arange(10, dtype="<u4").tobytes())  # zlib header, not raw deflate
    with pytest.raises(DecodeError):
        codec.decode(memoryview(wrapped), 100, 10)


def test_width_must_match_numel() -> None:
    for name in ("zstd", "deflate"):
        codec = codecs.get_index_codec(name)
        data = codec.encode(np.array([1, 2], dtype=np.int64), 100).data
        with pytest.raises(DecodeError):
            codec.decode(memoryview(data), (1 << 32) + 1, 2)


numels = st.one_of(st.integers(0, 80), st.integers(0, 1 << 40))


@st.composite
def hostile_arguments(draw: st.DrawFn) -> tuple[bytes, int, int]:
    numel = draw(numels)
    count = draw(st.one_of(st.integers(0, min(numel, 64)), st.integers(0, numel), st.integers(0, 10**13)))
    return draw(st.binary(max_size=48)), numel, count


@pytest.mark.parametrize("name", LOSSLESS)
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arguments=hostile_arguments())
def test_fuzz_arbitrary_bytes(name: str, arguments: tuple[bytes, int, int]) -> None:
    assert_valid_or_refused(codecs.get_index_codec(name), *arguments)


@st.composite
def damaged_sections(draw: st.DrawFn, name: str) -> tuple[bytes, int, int]:
    """A valid section of a small random set, then truncated, extended or bit-flipped."""
    numel = draw(st.one_of(st.integers(1, 300), st.integers(1, 1 << 40)))
    size = draw(st.integers(1, min(numel, 40)))
    indices = np.array(sorted(draw(st.sets(st.integers(0, numel - 1), min_size=size, max_size=size))), dtype=np.int64)
    if name == "bitmap" and numel > 4096:
        numel = 4096
        indices = np.unique(indices % numel)
    data = bytearray(codecs.get_index_codec(name).encode(indices, numel).data)
    damage = draw(st.sampled_from(["flip", "flip", "truncate", "append", "count"]))
    count = indices.size
    if damage == "flip" and data:
        for bit in draw(st.lists(st.integers(0, len(data) * 8 - 1), min_size=1, max_size=3)):
            data[bit // 8] ^= 1 << (bit % 8)
    elif damage == "truncate":
        del data[draw(st.integers(0, max(len(data) - 1, 0))) :]
    elif damage == "append":
        data += draw(st.binary(min_size=1, max_size=8))
    else:
        count = draw(st.integers(0, min(numel, 2 * count + 2)))
    return bytes(data), numel, count


@pytest.mark.parametrize("name", LOSSLESS)
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_damaged_sections(name: str, data: st.DataObject) -> None:
    assert_valid_or_refused(codecs.get_index_codec(name), *data.draw(damaged_sections(name)))


@settings(max_examples=100, deadline=None)
@given(width=st.integers(0, 57), count=st.integers(0, 40), seed=st.integers(0, 2**32 - 1))
def test_fixed_width_fields_match_pack_uint(width: int, count: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    values = np.array([int(rng.integers(0, 1 << width)) if width else 0 for _ in range(count)], dtype=np.uint64)
    packed = write_fixed(values, width)
    assert packed == pack_uint(values, width)
    np.testing.assert_array_equal(read_fixed(np.frombuffer(packed, dtype=np.uint8), count, width), values)


@settings(max_examples=100, deadline=None)
@given(widths=st.lists(st.integers(0, 57), max_size=40), seed=st.integers(0, 2**32 - 1))
def test_variable_width_fields_round_trip(widths: list[int], seed: int) -> None:
    width_array = np.array(widths, dtype=np.int64)
    rng = np.random.default_rng(seed)
    values = np.array([int(rng.integers(0, 1 << w)) if w else 0 for w in widths], dtype=np.uint64)
    packed = write_fields(values, width_array)
    offsets, total = field_offsets(width_array)
    assert len(packed) == (total + 7) // 8
    np.testing.assert_array_equal(read_fields(np.frombuffer(packed, dtype=np.uint8), offsets, width_array), values)
