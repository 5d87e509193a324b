"""The payload layer: header checks, option routing, multi-tensor payloads, hostile bytes."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gradwire
import gradwire.codecs as codecs
from gradwire.codecs.payload import MAGIC, _PREAMBLE, _RECORD


def _payload(n_tensors: int = 2, index_codec: str = "raw") -> bytes:
    tensors = [(torch.arange(3, dtype=torch.float32) + i, torch.tensor([1, 4, 9]) + i, 20) for i in range(n_tensors)]
    return codecs.encode_tensors(tensors, codecs.get_index_codec(index_codec), codecs.get_value_codec("fp32")).payload


def _reseal(body: bytes) -> bytes:
    """A hostile sender recomputes the checksum after tampering."""
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


def test_multi_tensor_roundtrip() -> None:
    decoded = codecs.decode_tensors(_payload(3))
    assert [t[1].tolist() for t in decoded] == [[1, 4, 9], [2, 5, 10], [3, 6, 11]]
    assert [t[2] for t in decoded] == [20, 20, 20]
    with pytest.raises(gradwire.DecodeError, match="holds 3 tensors"):
        codecs.decode(_payload(3))


def test_expected_sizes_are_checked_before_sections() -> None:
    payload = _payload(2)
    assert len(codecs.decode_tensors(payload, expected_numels=[20, 20])) == 2
    with pytest.raises(gradwire.DecodeError, match="expected"):
        codecs.decode_tensors(payload, expected_numels=[20, 21])
    with pytest.raises(gradwire.DecodeError, match="expected"):
        codecs.decode_tensors(payload, expected_numels=[20])


def test_header_is_checked_before_anything() -> None:
    payload = bytearray(_payload(1))
    assert payload[:4] == MAGIC
    with pytest.raises(gradwire.DecodeError, match="magic"):
        codecs.decode(b"XXXX" + bytes(payload[4:]))
    wrong_version = bytearray(payload)
    wrong_version[4] = 2
    with pytest.raises(gradwire.DecodeError, match="version 2"):
        codecs.decode(bytes(wrong_version))
    with pytest.raises(gradwire.DecodeError):
        codecs.decode(b"")
    with pytest.raises(gradwire.DecodeError, match="bytes-like"):
        codecs.decode(12345)  # type: ignore[arg-type]


def test_hostile_header_fields_with_valid_checksum() -> None:
    body = _payload(1)[:-8]
    record_at = _PREAMBLE.size
    fields = list(_RECORD.unpack_from(body, record_at))

    def with_fields(**changes: int) -> bytes:
        names = ["dtype", "index_id", "value_id", "reserved", "numel", "count", "index_len", "value_len"]
        values = dict(zip(names, fields)) | changes
        record = _RECORD.pack(*(values[n] for n in names))
        return _reseal(body[:record_at] + record + body[record_at + _RECORD.size:])

    for changes, message in [
        ({"numel": (1 << 40) + 1}, "exceeds 2\\*\\*40"),
        ({"count": 10**12, "numel": 1 << 40}, "without a limit; pass max_numel="),
        ({"count": 10**6, "numel": 10**6}, "asks for 1000000 elements"),
        ({"count": 21}, "values for a tensor"),
        ({"dtype": 9}, "dtype code"),
        ({"index_id": 250}, "unknown index codec"),
        ({"value_id": 250}, "unknown value codec"),
        ({"index_len": 2**32 - 1}, "truncated"),
        ({"reserved": 1}, "reserved"),
    ]:
        with pytest.raises(gradwire.DecodeError, match=message):
            codecs.decode(with_fields(**changes))
    # with the caller's consent the size check passes and the section's own bounds refuse it
    with pytest.raises(gradwire.DecodeError, match="raw index section"):
        codecs.decode(with_fields(count=10**12, numel=1 << 40), max_numel=1 << 40)
    with pytest.raises(gradwire.DecodeError, match="more than max_numel=100"):
        codecs.decode(with_fields(count=10, numel=101), max_numel=100)
    tensor_count = _reseal(body[:6] + struct.pack("<H", 60000) + body[8:])
    with pytest.raises(gradwire.DecodeError):
        codecs.decode(tensor_count)
    with pytest.raises(gradwire.DecodeError, match="trailing"):
        codecs.decode(_reseal(body + b"\0"))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=200), position=st.integers(0, 10_000), prefix=st.booleans())
def test_fuzz_arbitrary_and_resealed_bytes(data: bytes, position: int, prefix: bool) -> None:
    """Random bytes, and valid payloads with random bytes spliced in and the checksum recomputed,
    either decode to a valid result or raise DecodeError — nothing else."""
    base = _payload(2, index_codec="raw")[:-8]
    at = position % len(base)
    candidates = [data, _reseal(base[:at] + data + base[at + len(data):])] if prefix else [data + base]
    for candidate in candidates:
        try:
            tensors = codecs.decode_tensors(candidate)
        except gradwire.DecodeError:
            continue
        for values, indices, numel in tensors:
            assert values.numel() == indices.numel() <= numel
            if indices.numel():
                assert int(indices.min()) >= 0 and int(indices.max()) < numel
                assert bool((indices[1:] > indices[:-1]).all())


def test_options_are_routed_and_validated() -> None:
    with pytest.raises(ValueError, match="index_codec='nope' is not supported; allowed: .*raw"):
        codecs.encode(torch.ones(1), torch.tensor([0]), 1, index_codec="nope")
    with pytest.raises(ValueError, match="value_codec='nope'"):
        codecs.encode(torch.ones(1), torch.tensor([0]), 1, value_codec="nope")
    with pytest.raises(ValueError, match="option colour is accepted by neither"):
        codecs.encode(torch.ones(1), torch.tensor([0]), 1, index_codec="raw", colour=3)


def test_input_validation_names_the_problem() -> None:
    with pytest.raises(ValueError, match="strictly ascending"):
        codecs.encode(torch.ones(2), torch.tensor([5, 5]), 10, index_codec="raw")
    with pytest.raises(ValueError, match="lie in"):
        codecs.encode(torch.ones(1), torch.tensor([10]), 10, index_codec="raw")
    with pytest.raises(ValueError, match="dtype"):
        codecs.encode(torch.ones(1, dtype=torch.int32), torch.tensor([1]), 10, index_codec="raw")
    with pytest.raises(ValueError, match="2\\*\\*40"):
        codecs.encode(torch.ones(1), torch.tensor([1]), 1 << 41, index_codec="raw")


def test_listing_and_config_roundtrip() -> None:
    assert "raw" in codecs.index_codecs() and "fp32" in codecs.value_codecs()
    codec = codecs.get_index_codec({"id": "raw"})
    assert codecs.get_index_codec(codec.get_config()) == codec


def test_values_keep_sender_dtype_and_nan_bits() -> None:
    values = torch.tensor([1.5, float("nan"), -float("inf")], dtype=torch.bfloat16)
    decoded, indices, numel = codecs.decode(codecs.encode(values, torch.tensor([0, 3, 7]), 8, index_codec="raw"))
    assert decoded.dtype == torch.bfloat16
    assert torch.equal(decoded.view(torch.int16), values.view(torch.int16))


def test_sparse_tensor_helpers() -> None:
    dense = torch.tensor([[0.0, 2.0], [0.0, -1.0]])
    sparse = gradwire.SparseTensor.nonzero_of(dense)
    assert sparse.indices.tolist() == [1, 3] and sparse.density == 0.5
    assert torch.equal(sparse.to_dense(dense.shape), dense)
    picked = gradwire.SparseTensor.from_dense(dense, torch.tensor([3, 0]))
    assert picked.indices.tolist() == [0, 3] and picked.values.tolist() == [0.0, -1.0]
    with pytest.raises(ValueError, match="int64"):
        gradwire.SparseTensor(torch.ones(1), torch.tensor([0], dtype=torch.int32), 1)
    with pytest.raises(ValueError, match="ascending"):
        gradwire.SparseTensor(torch.ones(2), torch.tensor([1, 0]), 2).check()
    empty = gradwire.SparseTensor(torch.ones(0), torch.zeros(0, dtype=torch.int64), 5)
    np.testing.assert_array_equal(empty.to_dense().numpy(), np.zeros(5))


@pytest.fixture(scope="module")
def hostile_set() -> "list":
    from gradwire.bench.hostile_cases import hand_made

    return hand_made(big=False)


def _assert_consistent(tensors: list) -> None:
    for values, indices, numel in tensors:
        assert values.numel() == indices.numel() <= numel
        if indices.numel():
            assert int(indices.min()) >= 0 and int(indices.max()) < numel
            assert bool((indices[1:] > indices[:-1]).all())


def test_hand_made_hostile_payloads_are_refused_within_bounded_memory(hostile_set: list) -> None:
    """The crafted set (RLE runs of 2**28+, Bloom over 2**32 positions, zstd/deflate bombs, Huffman
    tables, huge Elias-Fano/Rice/QSGD/curve-fit counts): DecodeError, and a payload under 1 KB
    costs at most 64 MiB (tracemalloc + resident set) — the heaviest ones the default limit
    lets through (``at-budget``) decode."""
    from .contract import _Peak

    peak_of = _Peak()
    groups = {case.group for case in hostile_set}
    assert {"rle", "bloom", "zstd", "deflate", "huffman", "eliasfano", "rice", "qsgd", "polyfit", "at-budget"} <= groups
    for case in hostile_set:
        result, peak = peak_of(lambda: codecs.decode_tensors(case.payload, max_numel=case.max_numel))
        if case.group in ("at-budget", "opt-in"):
            assert isinstance(result, list), f"{case.label}: {result!r}"
            _assert_consistent(result)
        else:
            assert isinstance(result, gradwire.DecodeError), f"{case.group} {case.label}: {result!r}"
        if len(case.payload) < 1024 and case.max_numel is None:
            assert peak <= 64 << 20, f"{case.group} {case.label}: {peak / 2**20:.1f} MiB"
        if case.group not in ("at-budget", "opt-in") and len(case.payload) < 1024:
            assert peak <= 16 << 20, f"{case.group} {case.label}: {peak / 2**20:.1f} MiB to refuse"


def test_default_limit_and_max_numel() -> None:
    """A 7-byte run of 2**20 positions is refused without a limit, naming the option, and decodes
    with ``max_numel``; ``max_numel`` below the tensor refuses it; bad values are a ValueError."""
    n = 1 << 20
    payload = codecs.encode(torch.zeros(n), torch.arange(n), n, index_codec="rle", value_codec="zstd")
    assert len(payload) < 200 and n > codecs.element_budget(len(payload))
    with pytest.raises(gradwire.DecodeError, match="max_numel="):
        codecs.decode(payload)
    values, indices, numel = codecs.decode(payload, max_numel=n)
    assert numel == n and torch.equal(indices, torch.arange(n)) and not values.any()
    assert len(codecs.decode_tensors(payload, expected_numels=[n])) == 1  # the hook's way
    with pytest.raises(gradwire.DecodeError, match="more than max_numel"):
        codecs.decode(payload, max_numel=n - 1)
    for bad in (-1, 1.5, True, "big"):
        with pytest.raises(ValueError, match="max_numel"):
            codecs.decode(payload, max_numel=bad)  # type: ignore[arg-type]
    # Bloom counts 8x its numel: a tiny filter over 2**17 positions needs max_numel
    bloom = codecs.encode(torch.ones(2), torch.tensor([3, 70_000]), 1 << 17, index_codec="bloom", fpr=0.5, policy="p1")
    with pytest.raises(gradwire.DecodeError, match="max_numel="):
        codecs.decode(bloom)
    assert codecs.decode(bloom, max_numel=1 << 17)[1].numel() == 2


def test_fuzz_mutated_payloads_of_every_codec_pair() -> None:
    """Damaged payloads of every index x value pair, resealed (size fields set to extremes, codec
    ids relabelled, sections cut, extended or swapped): DecodeError or a consistent result."""
    from gradwire.bench.hostile_cases import mutated

    for case in mutated(300, seed=11):
        try:
            tensors = codecs.decode_tensors(case.payload)
        except gradwire.DecodeError:
            continue
        _assert_consistent(tensors)


@pytest.mark.parametrize("narrow", [torch.float16, torch.bfloat16])
def test_float_conversion_keeps_nan_payloads_found_by_one_sum(narrow: torch.dtype) -> None:
    # the NaN test is one sum first: a NaN anywhere, and only +Inf beside -Inf besides, take the
    # exact path; each case must give the bits the element-wise conversion gives
    from gradwire.codecs.values.floats import convert_float

    wide = torch.randn(1000, generator=torch.Generator().manual_seed(7))
    words = wide.view(torch.int32)
    words[[5, 500, 999]] = torch.tensor([0x7FC00001, 0x7F812345, -0x00400001], dtype=torch.int32)  # payload NaNs
    narrowed = convert_float(wide, narrow)
    if narrow == torch.float16:
        expected = torch.from_numpy(wide.numpy().astype(np.float16))
    else:
        expected = (words >> 16).to(torch.int16).view(torch.bfloat16)
        expected[~torch.isnan(wide)] = wide[~torch.isnan(wide)].to(torch.bfloat16)
    assert torch.equal(narrowed.view(torch.int16), expected.view(torch.int16))
    widened = convert_float(narrowed, torch.float32)
    assert torch.equal(convert_float(widened, narrow).view(torch.int16), narrowed.view(torch.int16))  # round trip
    infinities = torch.tensor([1.0, float("inf"), -float("inf"), -2.0])  # a NaN sum without a NaN
    assert torch.equal(convert_float(infinities, narrow), infinities.to(narrow))
