"""A group's sparse gradients as one payload: joined (lossless index codecs) or per parameter."""

from __future__ import annotations

import pytest
import torch

from gradwire import DecodeError, codecs
from gradwire.core.payload import Part, decode_bucket, encode_bucket, joins


def _parts(offsets: list[int], sizes: list[int], density: float = 0.05) -> list[Part]:
    generator = torch.Generator().manual_seed(7)
    parts = []
    for offset, size in zip(offsets, sizes):
        compensated = torch.randn(size, generator=generator)
        k = max(1, int(density * size))
        indices = torch.sort(torch.randperm(size, generator=generator)[:k]).values
        parts.append(Part(compensated, indices, offset))
    return parts


@pytest.mark.parametrize("index_codec", ["rice", "raw", "eliasfano", "bloom"])
@pytest.mark.parametrize("layout", ["ascending", "shuffled"])
def test_round_trip_puts_every_value_at_its_place(index_codec: str, layout: str) -> None:
    sizes = [3000, 5, 1, 700, 12000]
    offsets = [0, 3000, 3005, 3006, 3706]
    if layout == "shuffled":  # DDP does not promise parameters in offset order
        order = [3, 0, 4, 2, 1]
        sizes, offsets = [sizes[i] for i in order], [offsets[i] for i in order]
    parts = _parts(offsets, sizes)
    total = sum(sizes)
    value_codec, index = codecs.resolve_codecs("fp32", index_codec, {})
    encoded = encode_bucket(parts, total, index_codec=index, value_codec=value_codec)
    positions, values = decode_bucket(memoryview(encoded.payload), sizes, offsets, total, index_codec=index)

    received = torch.zeros(total).index_add_(0, positions, values)
    own = torch.zeros(total).index_add_(0, encoded.positions, encoded.values)
    assert torch.equal(received, own)  # this rank's reconstruction is what peers decode
    expected = torch.zeros(total)
    for part, sparse in zip(parts, encoded.sent):
        indices, sent = sparse.indices, sparse.values
        expected[part.offset + indices] = sent
        assert torch.equal(sent, part.compensated[indices])  # fp32: lossless
        if joins(index):
            assert torch.equal(indices, part.indices)
    assert torch.equal(received, expected)


def test_joined_payload_is_one_record_and_no_larger() -> None:
    sizes, offsets = [4096, 8, 8, 20000], [0, 4096, 4104, 4112]
    parts = _parts(offsets, sizes, density=0.01)
    value_codec, index = codecs.resolve_codecs("fp16", "rice", {})
    joined = encode_bucket(parts, sum(sizes), index_codec=index, value_codec=value_codec)
    separate = codecs.encode_tensors([(p.compensated[p.indices], p.indices, p.compensated.numel()) for p in parts],
                                     index, value_codec)
    assert len(codecs.decode_tensors(joined.payload)) == 1
    assert len(joined.payload) < len(separate.payload)


def test_payload_of_other_sizes_is_refused() -> None:
    sizes, offsets = [1000, 2000], [0, 1000]
    value_codec, index = codecs.resolve_codecs("fp32", "rice", {})
    encoded = encode_bucket(_parts(offsets, sizes), 3000, index_codec=index, value_codec=value_codec)
    with pytest.raises(DecodeError):
        decode_bucket(memoryview(encoded.payload), [1000, 2001], [0, 1000], 3001, index_codec=index)
    with pytest.raises(DecodeError):
        decode_bucket(memoryview(encoded.payload[:-3]), sizes, offsets, 3000, index_codec=index)
