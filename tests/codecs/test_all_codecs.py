"""Every registered codec passes the shared contract; per-codec files add what is particular."""

from __future__ import annotations

import pytest

import gradwire.codecs as codecs

from .contract import check_config, check_index_codec, check_value_codec


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


def test_registries_list_every_codec_the_wire_format_names() -> None:
    assert codecs.index_codecs() == sorted(
        ["raw", "delta-varint", "bitmap", "rle", "huffman", "eliasfano", "rice", "zstd", "deflate", "bloom"])
    assert codecs.value_codecs() == sorted(
        ["fp32", "fp16", "bf16", "zstd", "deflate", "qsgd", "polyfit", "dexp", "fp16-scaled", "qsgd-ans", "ans"])
    value_ids = [codecs.get_value_codec(name).wire_id for name in codecs.value_codecs()]
    assert sorted(value_ids) == list(range(1, 12))
    wire_ids = [codecs.get_index_codec(name).wire_id for name in codecs.index_codecs()]
    assert sorted(wire_ids) == list(range(1, 11))
