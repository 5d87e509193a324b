"""The DeepReduce Bloom-filter index codec: policies, false-positive rate, options, hostile input.

The shared contract (test_all_codecs.py) runs the default codec (p0) over every edge case but n
near 2**31 (the decoder queries every position: that case alone takes minutes on 2 cores; it runs
in the slow test below); here p1 and p2 go through the same cases plus what is particular to the
codec.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gradwire.codecs as codecs
from gradwire.codecs.index import bloom
from gradwire.codecs.index.bloom import BloomIndexCodec, sizing
from gradwire.errors import DecodeError

from .contract import check_config, check_rejects_corruption, index_cases, roundtrip_indices


def random_set(numel: int, count: int, seed: int = 0) -> np.ndarray:
    return np.sort(np.random.default_rng(seed).choice(numel, size=count, replace=False)).astype(np.int64)


def decode(codec: BloomIndexCodec, data: bytes, numel: int, count: int) -> np.ndarray:
    return codec.decode(memoryview(data), numel, count)


def positives_of(encoding_data: bytes, numel: int) -> np.ndarray:
    """Every positive of a section's filter, by decoding it as p0 (policy byte rewritten)."""
    data = bytearray(encoding_data)
    data[0] = 0
    _, h, seed, k, m = bloom._HEADER.unpack_from(data, 0)
    filt = np.unpackbits(np.frombuffer(bytes(data), np.uint8, offset=bloom._HEADER.size), bitorder="little")
    return bloom._select(filt.view(bool), numel, 0, h, m, seed, k, None)[0]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_contract_near_2_31() -> None:
    from .contract import check_index_codec

    check_index_codec(BloomIndexCodec(), max_numel=1 << 62)


# -- contract for the other policies ------------------------------------------------------------


@pytest.mark.parametrize("policy", ["p1", "p2"])
def test_contract_cases_other_policies(policy: str) -> None:
    codec = BloomIndexCodec(policy=policy, seed=7)
    check_config(codec)
    for label, indices, numel in index_cases():
        if label == "near-2^31":
            continue
        sent, decoded = roundtrip_indices(codec, indices, numel)
        np.testing.assert_array_equal(decoded, sent, err_msg=label)
        assert sent.size == indices.size, label  # p1 and p2 send exactly k
    indices = random_set(5000, 300)
    check_rejects_corruption(codecs.encode(torch.ones(300), torch.from_numpy(indices), 5000, index_codec=codec))


def test_sizing_follows_the_formula() -> None:
    assert sizing(0, 0.01) == (7, 8)
    assert sizing(1, 0.5) == (1, 8)
    for fpr, bits_per_index, hashes in [(0.1, 4.79, 3), (0.01, 9.59, 7), (0.001, 14.38, 10)]:
        h, m = sizing(100_000, fpr)
        assert h == hashes and m % 8 == 0
        assert m / 100_000 == pytest.approx(bits_per_index, abs=0.01)


# -- p0 -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("fpr", [0.1, 0.01])
@pytest.mark.parametrize("layout", ["random", "clustered"])
def test_p0_sends_a_superset_at_about_the_target_rate(fpr: float, layout: str) -> None:
    numel, k = 1 << 20, 1 << 14
    if layout == "random":
        indices = random_set(numel, k, seed=1)
    else:  # gradients' top-k often comes in runs: tabulation hashing must not mind
        indices = np.concatenate([np.arange(3000, 3000 + k // 2), (1 << 19) + 3 * np.arange(k // 2)])
    encoding = BloomIndexCodec(fpr=fpr).encode(indices, numel)
    positions = encoding.positions
    assert np.all(np.isin(indices, positions))
    assert positions.dtype == np.int64 and np.all(np.diff(positions) > 0)
    false_positives = positions.size - k
    measured = false_positives / (numel - k)
    # For these h and m the expected rate is within 2% of fpr, and the count (~100k false
    # positives at fpr 0.1, ~10k at 0.01) varies by about 1%: a 15% band is many sigmas wide.
    assert measured == pytest.approx(fpr, rel=0.15)
    stats = encoding.stats
    assert stats["true_k"] == k and stats["positives"] == positions.size
    assert stats["false_positives_sent"] == false_positives and stats["true_positives_sent"] == k
    assert stats["filter_bits"] == sizing(k, fpr)[1] and stats["hashes"] == sizing(k, fpr)[0]
    assert len(encoding.data) == bloom._HEADER.size + stats["filter_bits"] // 8
    np.testing.assert_array_equal(decode(BloomIndexCodec(), encoding.data, numel, positions.size), positions)


def test_p0_with_dense_reconstructs_every_sent_position() -> None:
    generator = torch.Generator().manual_seed(0)
    dense = torch.randn(64, 1000, generator=generator)  # any shape; flattened by the payload
    numel = dense.numel()
    indices = torch.topk(dense.reshape(-1).abs(), 640).indices.sort().values
    values = dense.reshape(-1)[indices]
    encoded = codecs.encode_sparse(values, indices, numel, index_codec="bloom", dense=dense, fpr=0.05)
    sent = encoded.tensors[0]
    assert sent.stats["false_positives_sent"] > 0
    decoded_values, decoded_indices, decoded_numel = codecs.decode(encoded.payload)
    assert decoded_numel == numel
    assert torch.equal(decoded_indices, sent.indices)
    assert bool(torch.isin(indices, decoded_indices).all())
    assert torch.equal(decoded_values, dense.reshape(-1)[decoded_indices])  # exact, false positives too
    assert torch.equal(sent.values, decoded_values)
    # The caller's price of the false positives: their values, 4 bytes each in fp32.
    assert sent.value_bytes == 4 * (640 + sent.stats["false_positives_sent"])

    # Without dense the false positives arrive as zero.
    plain = codecs.encode_sparse(values, indices, numel, index_codec="bloom", fpr=0.05)
    plain_values, plain_indices, _ = codecs.decode(plain.payload)
    true = torch.isin(plain_indices, indices)
    assert torch.equal(plain_values[true], dense.reshape(-1)[plain_indices[true]])
    assert not bool(plain_values[~true].any())


# -- p1 and p2 ----------------------------------------------------------------------------------


def test_p1_sends_k_and_is_determined_by_the_seed() -> None:
    numel, indices = 200_000, random_set(200_000, 2000, seed=3)
    first = BloomIndexCodec(policy="p1", fpr=0.05, seed=11).encode(indices, numel)
    again = BloomIndexCodec(policy="p1", fpr=0.05, seed=11).encode(indices, numel)
    other = BloomIndexCodec(policy="p1", fpr=0.05, seed=12).encode(indices, numel)
    assert first.positions.size == indices.size == other.positions.size
    assert first.data == again.data
    np.testing.assert_array_equal(first.positions, again.positions)
    assert not np.array_equal(first.positions, other.positions)
    np.testing.assert_array_equal(decode(BloomIndexCodec(), first.data, numel, 2000), first.positions)
    positives = positives_of(first.data, numel)
    assert np.all(np.isin(first.positions, positives))
    stats = first.stats
    assert stats["true_positives_sent"] + stats["false_positives_sent"] == 2000
    assert stats["false_positives_sent"] > 0  # some true indices were traded for false positives
    # The choice is the 2000 positives of smallest key: uniform, and what the receiver recomputes.
    keys = bloom._choice_keys(positives, bloom._salt(11, bloom._CHOICE_PURPOSE))
    np.testing.assert_array_equal(first.positions, np.sort(positives[np.argsort(keys)[:2000]]))


def sure_positives(data: bytes, numel: int) -> np.ndarray:
    """Reference conflict sets, written plainly: positives alone on one of their bits."""
    positives = positives_of(data, numel)
    _, h, seed, _, m = bloom._HEADER.unpack_from(data, 0)
    bits = bloom._Hasher(seed, m, h).probe_bits(positives)
    owners: dict[int, set[int]] = {}
    for position, row in zip(positives.tolist(), bits.tolist()):
        for bit in row:
            owners.setdefault(bit, set()).add(position)
    return np.array(sorted({next(iter(s)) for s in owners.values() if len(s) == 1}), dtype=np.int64)


def test_p2_sends_k_with_every_sure_positive_true() -> None:
    numel, indices = 100_000, random_set(100_000, 5000, seed=4)
    encoding = BloomIndexCodec(policy="p2", fpr=0.02, seed=5).encode(indices, numel)
    positions = encoding.positions
    assert positions.size == indices.size
    sure = sure_positives(encoding.data, numel)
    assert sure.size == encoding.stats["sure_positives"] > 0
    assert np.all(np.isin(sure, indices))  # a sole positive on a set bit is the one that set it
    assert np.all(np.isin(sure, positions))
    assert np.all(np.isin(positions, positives_of(encoding.data, numel)))
    np.testing.assert_array_equal(decode(BloomIndexCodec(), encoding.data, numel, indices.size), positions)


def test_p2_keeps_more_true_indices_than_p1() -> None:
    numel = 50_000
    kept = {"p1": [], "p2": []}
    for trial in range(8):
        indices = random_set(numel, 1000, seed=100 + trial)
        for policy in kept:
            stats = BloomIndexCodec(policy=policy, fpr=0.1, seed=trial).encode(indices, numel).stats
            kept[policy].append(stats["true_positives_sent"])
    assert np.mean(kept["p2"]) >= np.mean(kept["p1"])


def test_bounded_memory_paths_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    """Threads, the p2 rescan without cache and many bottom-k merges give the same positions."""
    numel = 10 * bloom._BLOCK + 1234
    indices = random_set(numel, 4000, seed=9)
    reference = {policy: BloomIndexCodec(policy=policy, fpr=0.1, seed=2).encode(indices, numel)
                 for policy in bloom.POLICIES}
    monkeypatch.setattr(bloom, "_SEGMENT", 2 * bloom._BLOCK)
    monkeypatch.setattr(bloom, "_workers", lambda: 3)
    monkeypatch.setattr(bloom, "_CACHE_LIMIT", 100)
    monkeypatch.setattr(bloom, "_MERGE_BATCH", 16)
    for policy, expected in reference.items():
        encoding = BloomIndexCodec(policy=policy, fpr=0.1, seed=2).encode(indices, numel)
        assert encoding.data == expected.data
        np.testing.assert_array_equal(encoding.positions, expected.positions)
        decoded = decode(BloomIndexCodec(), encoding.data, numel, encoding.positions.size)
        np.testing.assert_array_equal(decoded, expected.positions)


# -- options ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options, option",
    [
        ({"fpr": 0.0}, "fpr"),
        ({"fpr": 1.0}, "fpr"),
        ({"fpr": -0.5}, "fpr"),
        ({"fpr": float("nan")}, "fpr"),
        ({"fpr": 1e-12}, "fpr"),
        ({"fpr": "0.01"}, "fpr"),
        ({"fpr": True}, "fpr"),
        ({"policy": "p3"}, "policy"),
        ({"policy": 0}, "policy"),
        ({"seed": -1}, "seed"),
        ({"seed": 1 << 64}, "seed"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_bad_options_are_refused(options: dict, option: str) -> None:
    with pytest.raises(ValueError, match=option) as raised:
        BloomIndexCodec(**options)
    assert not isinstance(raised.value, DecodeError)
    if option == "policy":
        assert "p0, p1, p2" in str(raised.value)


def test_config_round_trip_and_routing() -> None:
    codec = codecs.get_index_codec("bloom", fpr=0.001, policy="p2", seed=(1 << 64) - 1)
    check_config(codec)
    assert codec.get_config() == {"id": "bloom", "fpr": 0.001, "policy": "p2", "seed": (1 << 64) - 1}
    assert BloomIndexCodec.wire_id == 10 and not BloomIndexCodec.lossless
    payload = codecs.encode(torch.ones(3), torch.tensor([1, 50, 99]), 100, index_codec="bloom", policy="p1", seed=3)
    assert codecs.decode(payload)[1].numel() == 3


def test_numel_beyond_2_32_is_refused_fast() -> None:
    with pytest.raises(ValueError, match="2\\*\\*32") as raised:
        BloomIndexCodec().encode(np.array([0, 5], dtype=np.int64), (1 << 32) + 1)
    assert not isinstance(raised.value, DecodeError)
    data = BloomIndexCodec().encode(np.array([0, 5], dtype=np.int64), 100).data
    started = time.perf_counter()
    for count in (0, 2, 1 << 35):
        with pytest.raises(DecodeError):
            decode(BloomIndexCodec(), data, 1 << 40, count)
    assert time.perf_counter() - started < 0.5


# -- hostile sections ---------------------------------------------------------------------------


def section(policy: int = 0, h: int = 3, seed: int = 0, k: int = 2, m: int = 16, body: "bytes | None" = None) -> bytes:
    return bloom._HEADER.pack(policy, h, seed, k, m) + (bytes(m // 8) if body is None else body)


def test_inconsistent_sections_are_refused() -> None:
    numel, indices = 5000, random_set(5000, 40, seed=1)
    good = BloomIndexCodec().encode(indices, numel)
    count = good.positions.size
    codec = BloomIndexCodec()
    np.testing.assert_array_equal(decode(codec, good.data, numel, count), good.positions)
    header = bytearray(good.data[: bloom._HEADER.size])
    _, h, seed, k, m = bloom._HEADER.unpack(bytes(header))
    body = good.data[bloom._HEADER.size :]
    cases = {
        "count too high": (good.data, count + 1),
        "count too low": (good.data, count - 1),
        "negative count": (good.data, -1),
        "truncated header": (good.data[:10], count),
        "truncated filter": (good.data[:-1], count),
        "extra byte": (good.data + b"\0", count),
        "policy 3": (section(3, h, seed, k, m, body), count),
        "h = 0": (section(0, 0, seed, k, m, body), count),
        "h = 33": (section(0, 33, seed, k, m, body), count),
        "m not bytes": (section(0, h, seed, k, m - 1, body), count),
        "m mismatch": (section(0, h, seed, k, m + 8, body), count),
        "m zero": (section(0, h, seed, k, 0, b""), count),
        "k > numel": (section(0, h, seed, numel + 1, m, body), count),
        "too many bits for k": (section(0, h, seed, 1, m, body), count),
        "bits but k = 0": (section(0, h, seed, 0, m, body), 0),
        "empty filter, k > 0": (section(0, h, seed, k, m, bytes(len(body))), count),
        "p1 count != k": (section(1, h, seed, k, m, body), k + 1),
        "p2 count != k": (section(2, h, seed, k, m, body), k - 1),
        "p0 count < k": (section(0, h, seed, k, m, body), k - 1),
        "k = 0 count > 0": (section(0, h, seed, 0, m, bytes(len(body))), 1),
    }
    for label, (data, claimed) in cases.items():
        with pytest.raises(DecodeError):
            decode(codec, data, numel, claimed)
            pytest.fail(label)


def test_fewer_positives_than_k_is_refused() -> None:
    # One of 8 bits set, h = 1: about an eighth of the 16 positions is positive, not the 8 claimed.
    data = section(policy=1, h=1, k=8, m=8, body=b"\x01")
    with pytest.raises(DecodeError, match="fewer than"):
        decode(BloomIndexCodec(), data, 16, 8)


def test_all_ones_filter_with_small_k_is_refused_early() -> None:
    # Every position positive: p0 must stop at count + 1 positives, not hash on to the end.
    data = section(policy=0, h=1, k=8, m=8, body=b"\xff")
    with pytest.raises(DecodeError):
        decode(BloomIndexCodec(), data, 1 << 22, 100)
    assert decode(BloomIndexCodec(), data, 1 << 12, 1 << 12).size == 1 << 12


def assert_valid_or_refused(data: bytes, numel: int, count: int) -> None:
    try:
        out = BloomIndexCodec().decode(memoryview(data), numel, count)
    except DecodeError:
        return
    assert isinstance(out, np.ndarray) and out.dtype == np.int64 and out.shape == (count,)
    if count:
        assert out[0] >= 0 and out[-1] < numel and np.all(np.diff(out) > 0)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=64), numel=st.integers(0, 1 << 16), count=st.integers(-2, (1 << 16) + 2))
def test_fuzz_arbitrary_bytes(data: bytes, numel: int, count: int) -> None:
    assert_valid_or_refused(data, numel, count)


@st.composite
def plausible_sections(draw: st.DrawFn) -> tuple[bytes, int, int]:
    """Mostly well-formed headers over arbitrary filters: reaches the scan and the policies."""
    numel = draw(st.integers(0, 1 << 16))
    size = draw(st.integers(1, 8))
    k = draw(st.one_of(st.integers(0, min(numel, 40)), st.integers(0, 64)))
    header = bloom._HEADER.pack(
        draw(st.one_of(st.integers(0, 2), st.integers(0, 255))),
        draw(st.one_of(st.integers(1, 8), st.integers(0, 255))),
        draw(st.integers(0, (1 << 64) - 1)),
        k,
        draw(st.one_of(st.just(8 * size), st.sampled_from([0, 8 * size - 1, 8 * size + 8, 1 << 40]))),
    )
    body = draw(st.binary(min_size=size, max_size=size))
    count = draw(st.one_of(st.just(k), st.integers(0, min(numel, 64)), st.integers(0, numel)))
    return header + body, numel, count


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arguments=plausible_sections())
def test_fuzz_plausible_sections(arguments: tuple[bytes, int, int]) -> None:
    assert_valid_or_refused(*arguments)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    numel=st.integers(1, 3000),
    density=st.floats(0.0, 1.0),
    policy=st.sampled_from(bloom.POLICIES),
    fpr=st.sampled_from([0.5, 0.1, 0.01]),
    seed=st.integers(0, (1 << 64) - 1),
)
def test_fuzz_round_trip(numel: int, density: float, policy: str, fpr: float, seed: int) -> None:
    indices = random_set(numel, int(numel * density), seed=seed % 1000)
    codec = BloomIndexCodec(policy=policy, fpr=fpr, seed=seed)
    encoding = codec.encode(indices, numel)
    np.testing.assert_array_equal(decode(BloomIndexCodec(), encoding.data, numel, encoding.positions.size),
                                  encoding.positions)
    if policy == "p0":
        assert np.all(np.isin(indices, encoding.positions))
    else:
        assert encoding.positions.size == indices.size
    if policy == "p2":
        assert np.all(np.isin(sure_positives(encoding.data, numel), indices))
