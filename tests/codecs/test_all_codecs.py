"""Every registered codec passes the shared contract; per-codec files add what is particular."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

import gradwire.codecs as codecs
from gradwire.codecs.base import ValueCodec
from gradwire.errors import require

from .contract import check_config, check_decode_bounded, check_index_codec, check_value_codec


@pytest.mark.parametrize("name", codecs.index_codecs())
def test_index_codec_contract(name: str) -> None:
    codec = codecs.get_index_codec(name)
    check_config(codec)
    check_index_codec(codec)


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
