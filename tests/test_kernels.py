"""The native kernels (gradwire.kernels, numba) against the torch/numpy path they replace: the same
compensated tensor bit for bit and the same positions, including NaN, infinities, float64, a tail
that is not a whole block and more candidates than the room the sample predicted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gradwire import kernels
from gradwire.sparsify import topk

pytest.importorskip("numba")
pytestmark = pytest.mark.skipif(not kernels.available(), reason="GRADWIRE_NATIVE=0")


def _numpy_positions(values: np.ndarray, limit: float) -> np.ndarray:
    return np.flatnonzero(np.abs(values) >= values.dtype.type(limit)).astype(np.int64)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("numel", [1, 31, 32, 33, 1000, 65_539])
def test_compensate_and_scan_equals_numpy(dtype: type, numel: int) -> None:
    rng = np.random.default_rng(numel)
    grad = rng.standard_normal(numel).astype(dtype)
    residual = (rng.standard_normal(numel) * 0.3).astype(dtype)
    grad[::97] = np.nan
    grad[5::101] = np.inf
    grad[7::103] = -np.inf
    out = np.full(numel, 7.0, dtype=dtype)
    limit = dtype(1.5)
    found = kernels.compensate_and_scan(grad, residual, out, limit, capacity=numel)
    expected_out = grad + residual
    np.testing.assert_array_equal(out, expected_out)  # NaN positions compare equal here
    assert found.positions is not None
    np.testing.assert_array_equal(found.positions, _numpy_positions(expected_out, limit))
    assert found.finite == bool(np.isfinite(expected_out).all()) and found.nonzero
    scanned = kernels.scan(expected_out, limit, capacity=numel)
    assert scanned.positions is not None
    np.testing.assert_array_equal(scanned.positions, found.positions)
    assert scanned.finite == found.finite


@pytest.mark.parametrize("numel", [31, 64, 1000])
def test_the_flags_see_one_nan_or_inf_anywhere_and_an_all_zero_gradient(numel: int) -> None:
    for position in (0, numel // 2, numel - 1):  # in a whole block and in the tail
        for bad in (np.nan, np.inf, -np.inf):
            grad = np.ones(numel, dtype=np.float32)
            grad[position] = bad
            found = kernels.compensate_and_scan(grad, np.zeros(numel, np.float32), np.empty(numel, np.float32),
                                                np.float32(0.5), capacity=numel)
            assert not found.finite and found.nonzero, (position, bad)
    zeros = np.zeros(numel, dtype=np.float32)
    found = kernels.compensate_and_scan(zeros, np.ones(numel, np.float32), np.empty(numel, np.float32),
                                        np.float32(0.5), capacity=numel)
    assert found.finite and not found.nonzero  # nonzero is the gradient's, not the compensated sum's
    overflow = np.full(numel, 3e38, dtype=np.float32)
    assert not kernels.compensate_and_scan(overflow, overflow, np.empty(numel, np.float32), np.float32(0.5),
                                           capacity=numel).finite


def test_too_many_candidates_returns_none_with_out_written() -> None:
    grad = np.ones(1000, dtype=np.float32)
    residual = np.ones(1000, dtype=np.float32)
    out = np.zeros(1000, dtype=np.float32)
    assert kernels.compensate_and_scan(grad, residual, out, np.float32(0.5), capacity=10).positions is None
    np.testing.assert_array_equal(out, np.full(1000, 2.0, dtype=np.float32))
    assert kernels.scan(out, np.float32(0.5), capacity=999).positions is None


def test_usable_refuses_mixed_dtypes_and_strides() -> None:
    a = np.zeros(64, dtype=np.float32)
    assert kernels.usable(a, None, a)
    assert not kernels.usable(a, a.astype(np.float64))
    assert not kernels.usable(a[::2])
    assert not kernels.usable(a.astype(np.float16))


@pytest.mark.parametrize("with_residual", [True, False])
def test_topk_native_and_numpy_paths_agree(monkeypatch: pytest.MonkeyPatch, with_residual: bool) -> None:
    """The same top-k (and compensated tensor) with the kernels and without them, where the
    sampled threshold leaves more candidates than predicted (a heavy tail off the sample)."""
    numel = 3 * topk.FUSED_CHUNK_NUMEL + 17
    generator = torch.Generator().manual_seed(3)
    grad = torch.randn(numel, generator=generator)
    grad[1::32] *= 50.0  # never on the evenly spaced sample (stride 24): more candidates than room
    residual = torch.randn(numel, generator=generator) * 0.2 if with_residual else None
    k = numel // 100
    native_out = torch.empty(numel)
    native = topk.compensated_largest_magnitudes(grad, residual, native_out, k)
    monkeypatch.setattr(kernels, "_kernels", lambda: None)
    assert not kernels.available()
    numpy_out = torch.empty(numel)
    reference = topk.compensated_largest_magnitudes(grad, residual, numpy_out, k)
    assert torch.equal(native_out, numpy_out)
    assert torch.equal(native, reference)
    assert torch.equal(topk.largest_magnitudes(numpy_out, k), reference)


def test_the_scattered_loops_get_the_prefetch_hint() -> None:
    # without it the kernels still give the same results, only slower: a numba that silently
    # stopped emitting llvm.prefetch would show nowhere else
    from gradwire import _prefetch

    assert _prefetch.EMITTED


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_native_scatter_equals_index_add(dtype: type) -> None:
    rng = np.random.default_rng(7)
    target = rng.standard_normal(50_000).astype(dtype)
    # sorted like a selection's, with repeats (they accumulate in order), many more than AHEAD
    positions = np.sort(rng.integers(0, target.size, 9_000)).astype(np.int64)
    values = rng.standard_normal(positions.size).astype(dtype)
    expected = torch.from_numpy(target.copy()).index_add_(0, torch.from_numpy(positions),
                                                          torch.from_numpy(values), alpha=-1.0)
    assert kernels.add_at(target, positions, values, alpha=-1.0) is True
    assert torch.equal(torch.from_numpy(target), expected)
    values[4_321] = np.inf
    assert kernels.add_at(target, positions, values) is False


@pytest.mark.parametrize("where", [0, 4_000, 8_999])
def test_the_native_scatter_refuses_a_position_outside(where: int) -> None:
    # a hostile position is prefetched AHEAD iterations before the check reaches it: a prefetch
    # never faults, so the call still ends in the IndexError, wherever the position lies
    target = np.zeros(10_000, dtype=np.float32)
    positions = np.arange(9_000, dtype=np.int64)
    positions[where] = (1 << 62) if where % 2 == 0 else -(1 << 62)
    with pytest.raises(IndexError, match="outside"):
        kernels.add_at(target, positions, np.ones(positions.size, dtype=np.float32))
    assert not target[where:].any()  # it stopped at the position: nothing written from there on


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("with_residual", [True, False])
def test_the_native_sample_equals_torchs(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype,
                                         with_residual: bool) -> None:
    """The threshold's sample: the same float32 magnitudes (NaN as -1, infinities and a float64
    sum that overflows float32 kept) natively and through torch's calls, for strides that do and
    do not divide the size."""
    generator = torch.Generator().manual_seed(5)
    grad = torch.randn(10_007, generator=generator, dtype=dtype)
    grad[1::89] = float("nan")
    grad[3::97] = float("inf")
    grad[11::101] = -float("inf")
    if dtype == torch.float64:
        grad[13::103] = 1e300  # |x| overflows float32: inf in both
    residual = torch.randn(10_007, generator=generator, dtype=dtype) if with_residual else None
    for stride in (1, 7, 10_007, 20_000):
        native = topk._sample_magnitudes(grad, residual, dtype, stride)
        assert native.dtype == torch.float32 and native.numel() == -(-10_007 // stride)
        with monkeypatch.context() as patch:
            patch.setattr(kernels, "_kernels", lambda: None)
            reference = topk._sample_magnitudes(grad, residual, dtype, stride)
        assert torch.equal(native, reference), stride
        assert (native == -1.0).any() == (stride in (1, 7))  # 1 + 89 * 4 = 357 = 7 * 51; position 0 is a number


def test_native_flat_positions_equal_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    from gradwire.core.group import flat_positions

    generator = torch.Generator().manual_seed(3)
    sizes = [0, 1, 5, 0, 700, 3, 64, 65, 1]  # empty entries, one-element ones, a block and a half
    indices = [torch.sort(torch.randperm(max(size * 3, 1), generator=generator)[:size]).values for size in sizes]
    offsets = torch.cumsum(torch.tensor([0] + [size * 3 for size in sizes[:-1]]), 0).tolist()
    before = [i.clone() for i in indices]
    native = flat_positions(indices, offsets)
    with monkeypatch.context() as patch:
        patch.setattr(kernels, "_kernels", lambda: None)
        reference = flat_positions(indices, offsets)
    assert native.dtype == torch.int64 and torch.equal(native, reference)
    assert all(torch.equal(i, j) for i, j in zip(indices, before))  # shifted in the concatenation, not in place
    single = flat_positions([indices[4]], [offsets[4]])  # one entry: the copy is still a copy
    assert torch.equal(single, indices[4] + offsets[4]) and torch.equal(indices[4], before[4])


def test_shift_segments_refuses_counts_that_do_not_cover_the_values() -> None:
    values = np.arange(5, dtype=np.int64)
    with pytest.raises(ValueError, match="counts"):
        kernels.shift_segments(values, np.array([2, 2], dtype=np.int64), np.array([1, 1], dtype=np.int64))
    with pytest.raises(ValueError, match="counts"):
        kernels.shift_segments(values, np.array([6, -1], dtype=np.int64), np.array([1, 1], dtype=np.int64))
    assert values.tolist() == [0, 1, 2, 3, 4]


def test_environment_switch_turns_the_kernels_off() -> None:
    env = {**os.environ, "GRADWIRE_NATIVE": "0"}
    code = "from gradwire import kernels; print(kernels.available())"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "False", result.stderr


def worker_deferred_check(rank: int, world_size: int, native: bool, compressor: str) -> list[dict]:
    """Four rounds of a top-k pipeline over large tensors (the deferred check's path with the kernels):
    normal, an all-zero parameter on rank 1, normal, a NaN on rank 1."""
    import hashlib
    import math

    os.environ["GRADWIRE_NATIVE"] = "1" if native else "0"
    kernels._tried, kernels._compiled = False, None  # a forked worker inherits the parent's decision
    import torch.distributed as dist

    from gradwire.core.config import ExchangeConfig
    from gradwire.core.group import BufferTarget, Entry, Group
    from gradwire.core.pipeline import Pipeline

    collective = "allgather" if compressor == "topk" else "allreduce"
    pipeline = Pipeline(ExchangeConfig(compressor=compressor, density=0.01, collective=collective, value_codec="fp32"),
                        dist.group.WORLD)
    sizes = [50_000, 40_000, 300]
    records = []
    for step, case in enumerate(["normal", "zero", "normal", "nan"]):
        generator = torch.Generator().manual_seed(10 * step + rank)
        buffer = torch.randn(sum(sizes), generator=generator)
        if rank == 1 and case == "zero":
            buffer[50_000:90_000] = 0.0
        if rank == 1 and case == "nan":
            buffer[50_123] = math.nan
        group, offset = Group(BufferTarget([buffer]), divisor=float(world_size)), 0
        for index, numel in enumerate(sizes):
            group.entries.append(Entry(index, index, buffer[offset: offset + numel], offset))
            offset += numel
        deferred = sorted(pipeline.selection.deferrable(group))
        before = {k: v.clone() for k, v in pipeline.feedback.residuals.items()}
        exchange = pipeline.start(group, step)
        verdict = pipeline.finish([group], [exchange], step)
        residuals = pipeline.feedback.residuals
        records.append({
            "case": case, "deferred": deferred, "action": verdict.action,
            "error": type(verdict.error).__name__ if verdict.error is not None else None,
            "unused": [entry.unused for entry in group.entries],
            "kept_whole": 1 in before and torch.equal(before[1], residuals[1]),
            "residuals": hashlib.sha256(b"".join(residuals[k].numpy().tobytes()
                                                 for k in sorted(residuals))).hexdigest(),
            # the bucket after a round that raised is not a result (the selection zeroed it natively)
            "result": hashlib.sha256(buffer.numpy().tobytes()).hexdigest() if verdict.action == "apply" else None})
    return records


@pytest.mark.distributed
@pytest.mark.timeout(200)
@pytest.mark.parametrize("compressor", ["topk", "randomblock"])
def test_the_deferred_check_finds_what_the_pipelines_check_finds(compressor: str) -> None:
    """With the kernels the check of large tensors happens inside their compensate-and-scan; an
    all-zero parameter and a NaN are found as the separate check finds them, and the rounds end
    bit for bit as without the kernels (their torch/numpy path, which checks first)."""
    from .distributed import run_workers

    native = run_workers(worker_deferred_check, 2, True, compressor, timeout=150)
    plain = run_workers(worker_deferred_check, 2, False, compressor, timeout=150)
    for rank in (0, 1):
        # top-k: the 300-element one is checked first; a shared support checks the whole bucket in one pass
        expected = [[0, 1]] if compressor == "topk" else [[0, 1, 2]]
        assert [r["deferred"] for r in native[rank]] == expected * 4
        assert [r["deferred"] for r in plain[rank]] == [[]] * 4
        for mine, theirs in zip(native[rank], plain[rank]):
            assert {k: v for k, v in mine.items() if k != "deferred"} == \
                {k: v for k, v in theirs.items() if k != "deferred"}, (rank, mine, theirs)
        zero, nan = native[rank][1], native[rank][3]
        assert zero["action"] == "apply" and nan["action"] == "raise" and nan["error"] == "NonFiniteGradientError"
    assert native[1][1]["unused"] == [False, True, False] and native[1][1]["kept_whole"]
    assert native[0][1]["unused"] == [False, False, False]


def test_compensate_and_check_sums_flags_and_zeroes() -> None:
    grad = np.arange(1, 70, dtype=np.float32)
    residual = np.full(69, 0.5, dtype=np.float32)
    out = np.empty(69, dtype=np.float32)
    assert kernels.compensate_and_check(grad, residual, out, zero_grad=True) == (True, True)
    np.testing.assert_array_equal(out, np.arange(1, 70, dtype=np.float32) + 0.5)
    assert not grad.any()  # zeroed once read, the tail included
    assert kernels.compensate_and_check(grad, residual, out) == (True, False)  # an all-zero gradient
    grad[68] = np.nan
    assert kernels.compensate_and_check(grad, residual, out) == (False, True)  # NaN is not zero


def test_a_second_process_loads_the_compiled_kernels_from_the_cache(tmp_path: Path) -> None:
    # Closures missed numba's cache in every process (a compile and one more file each time).
    script = ("import numpy as np; from gradwire import kernels; "
              "g = np.ones(100, np.float32); r = np.zeros(100, np.float32); "
              "kernels.compensate_and_scan(g, r, np.empty(100, np.float32), np.float32(0.5), 100)")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path), "NUMBA_DEBUG_CACHE": "1", "GRADWIRE_NATIVE": "1"}
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        runs.append((done.stdout + done.stderr, sorted(p.name for p in tmp_path.rglob("*.nbc"))))
    (first_log, first_files), (second_log, second_files) = runs
    assert first_files, "the first process wrote no cache"
    assert second_files == first_files, "the second process compiled again"
    assert "data loaded" in second_log and "data saved" not in second_log


def test_unary_quotients_equal_the_numpy_path(monkeypatch: pytest.MonkeyPatch) -> None:
    from gradwire.codecs import bits
    from gradwire.errors import DecodeError

    rng = np.random.default_rng(5)
    for trial in range(300):
        size = int(rng.integers(1, 70))  # below, at and past whole 8-byte words
        stream = rng.integers(0, 256, size, dtype=np.uint8)
        stream[rng.random(size) < 0.6] = 0  # long runs of zeros: quotients across words
        count = int(rng.integers(1, 2 * size))
        with monkeypatch.context() as patched:
            patched.setattr(kernels, "available", lambda: False)
            try:
                expected = bits.unpack_unary(stream.tobytes(), count)
            except DecodeError:
                expected = None
        try:
            native = bits.unpack_unary(stream.tobytes(), count)
        except DecodeError:
            native = None
        assert (native is None) == (expected is None), trial
        if native is not None:
            np.testing.assert_array_equal(native, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_small_tensors_native_top_k_equals_the_torch_numpy_path(dtype: torch.dtype) -> None:
    rng = np.random.default_rng(11)
    for trial in range(150):
        numel = int(rng.integers(2, topk.NATIVE_TOP_MAX_NUMEL + 1))
        k = int(rng.integers(1, numel))
        grad = torch.from_numpy(rng.standard_normal(numel)).to(dtype)
        if trial % 3 == 0:
            grad = torch.round(grad * 2) / 2  # many ties at the k-th magnitude
        if trial % 5 == 0:
            grad[torch.from_numpy(rng.integers(0, numel, 3))] = float("nan")
        if trial % 7 == 0:  # an infinity ranks as the largest finite value, as nan_to_num makes it
            grad[torch.from_numpy(rng.integers(0, numel, 2))] = float("inf")
            grad[0] = torch.finfo(dtype).max
        residual = None if trial % 4 == 0 else torch.from_numpy(rng.standard_normal(numel) * 0.3).to(dtype)
        native_out, plain_out = torch.empty(numel, dtype=dtype), torch.empty(numel, dtype=dtype)
        flags: dict = {}
        native = topk.compensated_largest_magnitudes(grad, residual, native_out, k, flags)
        topk._compensate_into(grad, residual, plain_out)
        plain = topk.largest_magnitudes(plain_out, k)
        assert torch.equal(native, plain), trial
        np.testing.assert_array_equal(native_out.numpy(), plain_out.numpy())
        np.testing.assert_array_equal(flags["values"].numpy(), plain_out[plain].numpy())


def test_rice_native_encoding_writes_the_numpy_paths_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    from gradwire.codecs import get_index_codec
    from gradwire.codecs.index.rice import RiceIndexCodec

    rng = np.random.default_rng(3)
    for trial in range(120):
        numel = int(rng.integers(1, 2_000_000))
        count = int(rng.integers(1, min(numel, 5000) + 1))
        indices = np.sort(rng.choice(numel, count, replace=False)).astype(np.int64)
        if trial % 5 == 0:
            indices = np.arange(count, dtype=np.int64)  # every gap zero
        for codec in (get_index_codec("rice"), RiceIndexCodec(parameter=0), RiceIndexCodec(parameter=40)):
            native = codec.encode(indices, numel).data
            with monkeypatch.context() as patched:
                patched.setattr(kernels, "available", lambda: False)
                expected = codec.encode(indices, numel).data
            assert native == expected, (trial, codec.parameter)
            np.testing.assert_array_equal(codec.decode(memoryview(native), numel, count), indices)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("numel", [0, 1, 63, 64, 65, 255, 256, 257, 320, 5000, 70_001])
@pytest.mark.parametrize("divisor", [3.0, 4.0])  # a division, and a power of two (multiplied by 1/4)
def test_divide_and_hash_native_and_numpy_twin_agree(monkeypatch: pytest.MonkeyPatch, dtype: type,
                                                     numel: int, divisor: float) -> None:
    # the native kernel hashes four blocks per round (256 elements), then single blocks, then the
    # short tail: sizes on each side of those edges
    rng = np.random.default_rng(numel)
    values = (rng.standard_normal(numel) * 100).astype(dtype)
    # near the smallest normal number, where a quotient rounds to a subnormal one: a product by
    # 1/4 must round there exactly as the division does
    tiny = np.finfo(dtype).tiny
    values[::7] = (rng.standard_normal(values[::7].size) * 3 * tiny).astype(dtype)
    native_values, twin_values = values.copy(), values.copy()
    finite, lanes = kernels.divide_and_hash(native_values, divisor)
    monkeypatch.setattr(kernels, "_kernels", lambda: None)
    twin_finite, twin_lanes = kernels.divide_and_hash(twin_values, divisor)
    assert finite and twin_finite
    assert np.array_equal(native_values, twin_values)
    assert np.array_equal(lanes, twin_lanes)
    quotients = torch.from_numpy(values.copy()).div_(divisor).numpy()  # the bits torch's div_ gives
    assert np.array_equal(native_values.view(np.uint8), quotients.view(np.uint8))


def test_divide_and_hash_sees_one_changed_bit_and_one_nan_anywhere() -> None:
    values = np.random.default_rng(0).standard_normal(4099).astype(np.float32)
    _, reference = kernels.divide_and_hash(values.copy(), 2.0)
    for position in (0, 63, 64, 2048, 4098):
        for bit in (0, 17, 31):
            changed = values.copy()
            changed.view(np.uint32)[position] ^= np.uint32(1 << bit)
            finite, lanes = kernels.divide_and_hash(changed, 2.0)
            assert not np.array_equal(lanes, reference), (position, bit)
        for bad in (np.nan, np.inf, -np.inf):
            broken = values.copy()
            broken[position] = bad
            assert not kernels.divide_and_hash(broken, 2.0)[0], (position, bad)
    swapped = values.copy()
    swapped[[3, 67]] = swapped[[67, 3]]  # the same lane, another order
    assert not np.array_equal(kernels.divide_and_hash(swapped, 2.0)[1], reference)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_compensate_and_check_segments_equals_each_segment_alone(dtype: type) -> None:
    # segments with and without a residual, an empty one, one shorter than a block, an all-zero
    # gradient and a NaN: the sums bit for bit, each segment's own nonzero flag, one finite flag
    rng = np.random.default_rng(3)
    sizes = [5, 64, 0, 130, 1, 70_001, 3]
    ends = np.cumsum(sizes, dtype=np.int64)
    add = np.array([True, False, True, True, False, True, False])
    for case in ("plain", "zero", "nan"):
        grad = rng.standard_normal(int(ends[-1])).astype(dtype)
        residual = rng.standard_normal(grad.size).astype(dtype)
        if case == "zero":
            grad[ends[2]: ends[3]] = 0.0
        if case == "nan":
            grad[ends[4] + 17] = np.nan  # in a segment without a residual
        expected, begin = grad.copy(), 0
        for end, adds in zip(ends, add):
            if adds:
                expected[begin:end] = grad[begin:end] + residual[begin:end]
            begin = end
        out = np.empty_like(grad)
        finite, nonzero = kernels.compensate_and_check_segments(grad, residual, add, out, ends=ends, zero_grad=True)
        np.testing.assert_array_equal(out, expected)
        assert finite == (case != "nan")
        assert nonzero.tolist() == [True, True, False, case != "zero", True, True, True]
        assert not grad.any()  # zeroed once read


def test_compensate_and_check_segments_without_a_residual_and_its_errors() -> None:
    grad = np.arange(10, dtype=np.float32)
    out = np.empty_like(grad)
    ends = np.array([1, 10], dtype=np.int64)
    finite, nonzero = kernels.compensate_and_check_segments(grad, None, np.zeros(2, np.bool_), out, ends=ends)
    assert finite and nonzero.tolist() == [False, True] and out.tolist() == list(range(10)) and grad[9] == 9
    with pytest.raises(ValueError, match="no residual"):
        kernels.compensate_and_check_segments(grad, None, np.ones(2, np.bool_), out, ends=ends)
    with pytest.raises(ValueError, match="2 segments ending at 9 for 10 elements"):
        kernels.compensate_and_check_segments(grad, None, np.zeros(2, np.bool_), out, ends=np.array([1, 9]))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_keeping_the_largest_candidates_equals_the_torch_numpy_path(dtype: type) -> None:
    """``_finish``'s native path (numpy's partition, one branch-free pass) keeps what the
    torch/numpy path keeps: the same positions, values and order, ties at the k-th the first ones."""
    rng = np.random.default_rng(12)
    for trial in range(200):
        count = int(rng.integers(1, 20_000))
        k = int(rng.integers(1, count + 3))
        values = rng.standard_normal(count).astype(dtype)
        if trial % 3 == 0:
            values = np.round(values * 2) / 2  # many ties at the k-th magnitude
        if trial % 7 == 0:
            values[rng.integers(0, count, 3)] = np.inf
            values[rng.integers(0, count, 2)] = -np.inf
        positions = np.sort(rng.choice(10 * count, count, replace=False)).astype(np.int64)
        wanted_positions, wanted_values = topk.largest_among(torch.from_numpy(positions), torch.from_numpy(values),
                                                             min(k, count))
        kept_positions, kept_values = kernels.keep_largest_candidates(positions, values, k)
        np.testing.assert_array_equal(kept_positions, wanted_positions.numpy())
        np.testing.assert_array_equal(kept_values, wanted_values.numpy())
        assert kept_values.dtype == values.dtype


def test_sorted_membership_equals_the_binary_search(monkeypatch: pytest.MonkeyPatch) -> None:
    from gradwire.exchange.sparse_allreduce import positions_in

    generator = torch.Generator().manual_seed(5)
    pool = torch.randperm(5000, generator=generator)
    cases = [(pool[:800], pool[400:2000]), (pool[:0], pool[:10]), (pool[:10], pool[:0]),
             (pool[:300], pool[:300]), (torch.tensor([4999]), torch.tensor([0])),
             (torch.tensor([0]), torch.tensor([4999]))]
    for needles, haystack in cases:
        needles, haystack = torch.sort(needles).values, torch.sort(haystack).values
        native = positions_in(needles, haystack)
        with monkeypatch.context() as patch:
            patch.setattr(kernels, "_kernels", lambda: None)
            reference = positions_in(needles, haystack)
        assert native.dtype == torch.bool and torch.equal(native, reference)
        assert int(native.sum()) == len(set(needles.tolist()) & set(haystack.tolist()))


def test_union_add_equals_adding_into_zeros_in_order() -> None:
    # the torch twin: index_add_ into zeros, a's entries first, then b's (bit for bit, -0.0 and NaN included)
    generator = torch.Generator().manual_seed(6)
    a_positions = torch.sort(torch.randperm(3000, generator=generator)[:900]).values
    b_positions = torch.sort(torch.randperm(3000, generator=generator)[:700]).values
    a_values = torch.randn(900, generator=generator) * 1e3
    b_values = torch.randn(700, generator=generator)
    a_values[:5], b_values[:5] = -0.0, -0.0
    b_values[5:8] = float("nan")
    for a_pos, a_val in ((a_positions, a_values), (a_positions[:0], a_values[:0])):
        for b_val in (b_values, -b_values):
            zero_then_a = kernels.union_add(np.empty(0, dtype=np.int64), np.empty(0, dtype=np.float32),
                                            a_pos.numpy(), a_val.numpy())
            positions, values = kernels.union_add(*zero_then_a, b_positions.numpy(), b_val.numpy())
            union, inverse = torch.unique(torch.cat([a_pos, b_positions]), return_inverse=True)
            expected = torch.zeros(union.numel()).index_add_(0, inverse, torch.cat([a_val, b_val]))
            assert positions.tolist() == union.tolist()
            assert torch.equal(torch.from_numpy(values).view(torch.int32), expected.view(torch.int32))


def test_native_histograms_equal_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    from gradwire.exchange.threshold_search import ThresholdSearch, magnitude_keys

    generator = torch.Generator().manual_seed(7)
    values = torch.cat([torch.randn(20_000, generator=generator) * 10.0 ** torch.randint(-20, 20, (20_000,),
                                                                                              generator=generator),
                        torch.zeros(50), torch.tensor([1.4e-45, 3.0e38])])
    keys = magnitude_keys(values)
    for hint in (None, 0.5, 1e-30):
        search = ThresholdSearch.start(2000, None, hint)
        while not search.done:
            native = search.local_counts(keys)
            with monkeypatch.context() as patch:
                patch.setattr(kernels, "_kernels", lambda: None)
                reference = search.local_counts(keys)
            assert native.dtype == torch.int64 and torch.equal(native, reference), (hint, search.level)
            search = search.refine(native)
