"""Every registered codec passes the shared contract; per-codec files add what is particular."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

import gradwire.codecs as codecs
from gradwire.codecs.base import ValueCodec
from gradwire.errors import require

from .contract import (
    check_config,
    check_decode_bounded,
    check_index_bound,
    check_index_codec,
    check_value_codec,
    value_cases,
)


@pytest.mark.parametrize("name", codecs.index_codecs())
def test_index_codec_contract(name: str) -> None:
    codec = codecs.get_index_codec(name)
    check_config(codec)
    check_index_codec(codec)


@pytest.mark.parametrize("name", codecs.index_codecs())
def test_an_index_codec_that_bounds_its_sections_keeps_within_the_bound(name: str) -> None:
    check_index_bound(codecs.get_index_codec(name))


@pytest.mark.parametrize("name", codecs.value_codecs())
def test_a_value_codec_that_bounds_its_sections_keeps_within_the_bound(name: str) -> None:
    codec = codecs.get_value_codec(name)
    for label, values in value_cases():
        bound = codec.max_section_bytes(values.numel())
        if bound is None:
            return
        assert len(codec.encode(values)) <= bound, label


def test_the_bounds_are_tight_where_frames_use_them() -> None:
    """Rice's bound (the chosen parameter is not known in advance) stays within 12% of a section
    of uniformly random positions at 10% density, and Elias-Fano's is exact: a fixed frame costs
    little over the payload it carries. A bound of ``8 n`` would pass the contract and fail this."""
    rng = np.random.default_rng(3)
    numel, count = 25_000, 2_500
    positions = np.sort(rng.choice(numel, size=count, replace=False)).astype(np.int64)
    rice, eliasfano = codecs.get_index_codec("rice"), codecs.get_index_codec("eliasfano")
    assert len(rice.encode(positions, numel).data) <= rice.max_section_bytes(count, numel) \
        <= 1.12 * len(rice.encode(positions, numel).data)
    assert eliasfano.max_section_bytes(count, numel) == len(eliasfano.encode(positions, numel).data)
    assert codecs.get_index_codec("huffman").max_section_bytes(count, numel) is None  # counts first


@pytest.mark.parametrize("parameter", [None, 0, 3, 12])
def test_rice_keeps_within_its_bound_at_the_edges_of_its_parameter_guess(parameter: "int | None") -> None:
    """Gap sums just below and above each power of two of the guess, every count of small
    tensors: the chosen parameter moves there, and the bound must hold on both sides."""
    rng = np.random.default_rng(4)
    codec = codecs.get_index_codec("rice", parameter=parameter)
    for numel in (1, 2, 3, 10, 64, 257, 4096):
        for count in range(1, min(numel, 40) + 1):
            for _ in range(6):
                last = int(rng.integers(count - 1, numel))  # the gaps sum to last - (count - 1)
                middle = np.sort(rng.choice(last, size=count - 1, replace=False)) if count > 1 else []
                positions = np.append(np.asarray(middle, dtype=np.int64), last)
                data = codec.encode(positions, numel).data
                assert len(data) <= codec.max_section_bytes(count, numel), (numel, count, last)


@pytest.mark.parametrize("name", [n for n in codecs.value_codecs() if codecs.get_value_codec(n).lossless])
def test_lossless_value_codec_contract(name: str) -> None:
    codec = codecs.get_value_codec(name)
    check_config(codec)
    check_value_codec(codec)


@pytest.mark.parametrize(
    "kind, name", [("index", n) for n in codecs.index_codecs()] + [("value", n) for n in codecs.value_codecs()]
)
def test_decode_is_bounded_by_the_payload(kind: str, name: str) -> None:
    codec = codecs.get_index_codec(name) if kind == "index" else codecs.get_value_codec(name)
    check_decode_bounded(codec)


def test_registries_list_every_codec_the_wire_format_names() -> None:
    assert codecs.index_codecs() == sorted(
        ["raw", "delta-varint", "bitmap", "rle", "huffman", "eliasfano", "rice", "zstd", "deflate", "bloom"])
    assert codecs.value_codecs() == sorted(
        ["fp32", "fp16", "bf16", "zstd", "deflate", "qsgd", "polyfit", "dexp", "fp16-scaled", "qsgd-ans", "ans"])
    value_ids = [codecs.get_value_codec(name).wire_id for name in codecs.value_codecs()]
    assert sorted(value_ids) == list(range(1, 12))
    wire_ids = [codecs.get_index_codec(name).wire_id for name in codecs.index_codecs()]
    assert sorted(wire_ids) == list(range(1, 11))


class _Unbounded(ValueCodec):
    """Sizes an allocation from a header field, as a careless decoder would: the check must fail."""

    name = "unbounded-test"
    wire_id = 255

    def encode(self, values: torch.Tensor) -> bytes:
        return struct.pack("<I", values.numel()) + values.float().numpy().tobytes()

    def decode(self, data: memoryview, count: int, dtype: torch.dtype) -> torch.Tensor:
        (declared,) = struct.unpack_from("<I", data, 0)
        scratch = np.ones(min(declared, 1 << 25), dtype=np.uint8)  # up to 32 MiB on a hostile header
        require(len(data) == 4 + 4 * count and declared == count == scratch.size, "bad section")
        return torch.from_numpy(np.frombuffer(data, dtype="<f4", offset=4).copy()).to(dtype)


def test_bound_check_catches_an_allocation_sized_by_a_header_field() -> None:
    with pytest.raises(AssertionError, match="allocated"):
        check_decode_bounded(_Unbounded())
