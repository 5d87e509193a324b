"""Blockwise int8/int4 quantization and the quantized reduce-scatter / AllReduce on real gloo groups.

Workers return plain lists (tensors through the result queue would need shared memory that dies
with the worker). Every multi-process check recomputes the expected result in this process from
the inputs, with the same pure functions, so "exact" means bit for bit.
"""

from __future__ import annotations

import math
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from gradwire.errors import CollectiveError, DecodeError
from gradwire.exchange import quantized as quantized_module
from gradwire.exchange.alphabeta import Link, choose, dense_allreduce, quantized_allreduce_cost
from gradwire.exchange.blockquant import LEVELS, dequantize, quantize, quantized_bytes, roundtrip
from gradwire.exchange.quantized import quantized_allreduce, quantized_reduce_scatter

from ..distributed import run_workers, run_workers_some_die

BLOCK = 64
SHARD = 300  # reduce-scatter chunk: not a multiple of BLOCK
NUMEL = 1001  # AllReduce input: ceil(1001 / p) is not a multiple of BLOCK for p = 2, 3, 4


def _qd(x: torch.Tensor, bits: int, block_size: int = BLOCK) -> torch.Tensor:
    return dequantize(quantize(x, bits=bits, block_size=block_size), x.shape[-1], bits=bits, block_size=block_size)


def _scales(x: torch.Tensor, bits: int, block_size: int = BLOCK) -> torch.Tensor:
    """Each value's block scale (float64, from the float32 scale the wire carries), shape of ``x``."""
    n = x.shape[-1]
    blocks = math.ceil(n / block_size)
    packed = quantize(x, bits=bits, block_size=block_size)
    scales = packed[..., : 4 * blocks].clone(memory_format=torch.contiguous_format).view(torch.float32).double()
    return scales.repeat_interleave(block_size, dim=-1)[..., :n]


# ----------------------------------------------------------------------------------------- blockquant


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n, block_size", [(1, 64), (63, 64), (64, 64), (65, 64), (1000, 64), (999, 7), (50, 1),
                                           (257, 256)])
def test_round_trip_error_is_at_most_half_a_scale(bits: int, n: int, block_size: int) -> None:
    g = torch.Generator().manual_seed(n * 31 + bits)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 4)  # blocks of very different sizes
    packed = quantize(x, bits=bits, block_size=block_size)
    assert packed.dtype == torch.uint8 and packed.shape == (quantized_bytes(n, bits, block_size),)
    y = dequantize(packed, n, bits=bits, block_size=block_size)
    scale = _scales(x, bits, block_size)
    error = (x.double() - y.double()).abs()
    assert bool((error <= scale / 2).all()), float((error / scale).max())
    # the block's largest value uses the top code: the scale is absmax / L, not something looser
    blocks = math.ceil(n / block_size)
    padded = torch.nn.functional.pad(x, (0, blocks * block_size - n)).reshape(blocks, block_size)
    torch.testing.assert_close(scale[::block_size] * LEVELS[bits], padded.abs().amax(1).double(), rtol=1e-6, atol=0)
    # x - D(Q(x)) is exact in float32: an error-feedback residual loses nothing
    assert torch.equal((x - y).double(), x.double() - y.double())
    assert torch.equal(roundtrip(x, bits=bits, block_size=block_size)[1], y)


def test_int4_packs_two_codes_per_byte_low_nibble_first_for_odd_lengths() -> None:
    x = torch.tensor([1.0, -2.0, 7.0])  # absmax 7: scale 1.0, codes 1, -2, 7
    packed = quantize(x, bits=4, block_size=64)
    assert packed.tolist() == [0, 0, 128, 63, 0xE1, 0x07]  # 1.0f little-endian; (1 | -2 << 4), (7 | padding 0)
    assert dequantize(packed, 3, bits=4, block_size=64).tolist() == [1.0, -2.0, 7.0]
    # five values in two blocks of 3: two scales, then three bytes; the last high nibble is padding
    x = torch.tensor([3.5, -7.0, 0.0, -1.5, 7.0])  # scales 1 and 1; codes 4 -7 0 -2 7 (ties to even)
    packed = quantize(x, bits=4, block_size=3)
    assert packed.numel() == quantized_bytes(5, 4, 3) == 4 * 2 + 3
    assert packed[:8].view(torch.float32).tolist() == [1.0, 1.0]
    assert packed[8:].tolist() == [4 | (-7 & 0xF) << 4, 0 | (-2 & 0xF) << 4, 7]
    assert dequantize(packed, 5, bits=4, block_size=3).tolist() == [4.0, -7.0, 0.0, -2.0, 7.0]


def test_int8_layout_and_round_half_to_even() -> None:
    x = torch.tensor([127.0, 0.5, 1.5, 2.5, -2.5, -127.0])  # scale 1.0: ties go to the even code
    packed = quantize(x, bits=8, block_size=8)
    assert packed[:4].view(torch.float32).tolist() == [1.0]
    assert packed[4:].view(torch.int8).tolist() == [127, 0, 2, 2, -2, -127]
    assert torch.equal(quantize(x, bits=8, block_size=8), packed)  # deterministic


def test_rows_are_chunks_of_their_own() -> None:
    x = torch.randn(4, 130, generator=torch.Generator().manual_seed(3))
    x[2] *= 1000
    for bits in (8, 4):
        batch = quantize(x, bits=bits, block_size=BLOCK)
        assert batch.shape == (4, quantized_bytes(130, bits, BLOCK))
        for row in range(4):
            assert torch.equal(batch[row], quantize(x[row].clone(), bits=bits, block_size=BLOCK))
        assert torch.equal(dequantize(batch, 130, bits=bits, block_size=BLOCK),
                           torch.stack([_qd(x[row].clone(), bits) for row in range(4)]))
        # bytes at an odd offset in a receive buffer decode the same (float32 views need alignment)
        shifted = torch.cat([torch.zeros(1, dtype=torch.uint8), batch.reshape(-1)])[1:].reshape(batch.shape)
        assert torch.equal(dequantize(shifted[1], 130, bits=bits, block_size=BLOCK), _qd(x[1].clone(), bits))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_nonfinite_block_gets_a_nan_scale_and_decodes_to_nan(bits: int, bad: float) -> None:
    x = torch.randn(200, generator=torch.Generator().manual_seed(5))
    x[70] = bad  # block 1 of [0, 64), [64, 128), ...
    packed = quantize(x, bits=bits, block_size=BLOCK)
    scales = packed[:16].view(torch.float32)
    assert torch.isnan(scales).tolist() == [False, True, False, False]
    y = dequantize(packed, 200, bits=bits, block_size=BLOCK)
    assert bool(torch.isnan(y[64:128]).all())
    assert bool(torch.isfinite(y[:64]).all() and torch.isfinite(y[128:]).all())
    assert torch.equal(y[128:], _qd(x[128:].clone(), bits))


def test_large_small_and_zero_blocks_keep_float32_scales() -> None:
    x = torch.cat([torch.full((64,), 3e38), torch.full((64,), -1e-30), torch.zeros(64)])
    x[1], x[65] = 1e38, -3e-31
    for bits in (8, 4):
        packed = quantize(x, bits=bits, block_size=BLOCK)
        scales = packed[:12].view(torch.float32)
        assert bool(torch.isfinite(scales).all()) and scales[1] < 0.1 * 2.0**-24  # fp16: Inf and 0
        y = dequantize(packed, x.numel(), bits=bits, block_size=BLOCK)
        assert bool(((x.double() - y.double()).abs() <= _scales(x, bits) / 2).all())
        assert scales[2] == 0 and y[128:].tolist() == [0.0] * 64


@pytest.mark.parametrize("bits", [8, 4])
def test_wrong_length_or_type_raises_decode_error(bits: int) -> None:
    packed = quantize(torch.randn(100), bits=bits, block_size=BLOCK)
    for wrong in (packed[:-1], torch.cat([packed, packed[:1]]), packed[:0], packed.view(torch.int8)):
        with pytest.raises(DecodeError, match="uint8 bytes"):
            dequantize(wrong, 100, bits=bits, block_size=BLOCK)
    with pytest.raises(DecodeError):
        dequantize(packed, 101, bits=bits, block_size=BLOCK)  # the receiver's n decides, not the bytes
    with pytest.raises(DecodeError):
        dequantize(torch.stack([packed, packed])[:, 1:], 100, bits=bits, block_size=BLOCK)


@pytest.mark.parametrize("bits", [8, 4])
def test_hostile_bytes_of_the_right_length_decode_to_bounded_values(bits: int) -> None:
    g = torch.Generator().manual_seed(bits)
    data = torch.randint(0, 256, (50, quantized_bytes(300, bits, BLOCK)), dtype=torch.uint8, generator=g)
    data[:, 4 * 5:] = 0x80 if bits == 8 else 0x88  # codes -128 / nibble -8: outside [-L, L]
    values = dequantize(data, 300, bits=bits, block_size=BLOCK)
    scales = data[:, :20].contiguous().view(torch.float32).repeat_interleave(BLOCK, dim=1)[:, :300]
    finite = torch.isfinite(scales)
    assert torch.equal(values[finite], -LEVELS[bits] * scales[finite])  # clamped to the top code
    assert not bool(torch.isfinite(values[~finite]).any())


def test_bad_options_are_value_errors() -> None:
    with pytest.raises(ValueError, match="bits"):
        quantize(torch.randn(4), bits=2, block_size=4)
    with pytest.raises(ValueError, match="block_size"):
        quantize(torch.randn(4), bits=8, block_size=0)
    with pytest.raises(ValueError, match="float32"):
        quantize(torch.randn(4, dtype=torch.float64), bits=8, block_size=4)
    with pytest.raises(ValueError, match="float32"):
        quantized_allreduce(torch.randn(2, 2), bits=8, block_size=4)


def test_byte_formula() -> None:
    assert quantized_bytes(300, 8, 64) == 4 * 5 + 300
    assert quantized_bytes(300, 4, 64) == 4 * 5 + 150
    assert quantized_bytes(301, 4, 64) == 4 * 5 + 151
    assert quantized_bytes(0, 4, 64) == 0


def test_world_of_one_needs_no_collective_and_telescopes() -> None:
    x = torch.randn(777, generator=torch.Generator().manual_seed(9))
    for bits in (8, 4):
        reduced = quantized_reduce_scatter(x, bits=bits, block_size=BLOCK)
        assert torch.equal(reduced.shard, _qd(x, bits)) and torch.equal(reduced.error, x - reduced.shard)
        assert reduced.bytes_sent == 0 and bool(reduced.finite)
        result = quantized_allreduce(x, bits=bits, block_size=BLOCK)
        assert torch.equal(result.values, _qd(_qd(x, bits), bits)) and result.bytes_sent == 0
        assert torch.equal(result.residual.double() + result.values.double(), x.double())
    empty = quantized_allreduce(torch.empty(0), bits=8, block_size=BLOCK)
    assert empty.values.numel() == 0 and empty.residual.numel() == 0


def test_cost_entry_matches_the_byte_formula_and_can_beat_dense() -> None:
    cost = quantized_allreduce_cost(1001, 4, bits=4, block_size=BLOCK)
    assert cost.rounds == 6 and cost.bytes_sent == 2 * 3 * quantized_bytes(251, 4, BLOCK) and cost.decoded_entries == 0
    assert quantized_allreduce_cost(1001, 1, bits=8, block_size=BLOCK).bytes_sent == 0
    two = quantized_allreduce_cost(1001, 2, bits=4, block_size=BLOCK)  # one swap of the whole input
    assert two.rounds == 1 and two.bytes_sent == quantized_bytes(1001, 4, BLOCK)
    n = 25_000_000
    ratio = quantized_allreduce_cost(n, 8, bits=8, block_size=128).bytes_sent / dense_allreduce(n, 8).bytes_sent
    assert ratio == pytest.approx((1 + 4 / 128) / 4, rel=1e-4)
    costs = [dense_allreduce(n, 8), quantized_allreduce_cost(n, 8, bits=4, block_size=128)]
    assert choose(costs, Link.from_rate(1)) == "quantized-allreduce"
    assert choose([dense_allreduce(1, 8), quantized_allreduce_cost(1, 8, bits=4, block_size=128)],
                  Link.from_rate(1)) == "dense"  # one value: the scales cost more than they save


# -------------------------------------------------------------------------------- on real gloo groups


def _inputs(rank: int, numel: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 17 * rank)
    x = torch.randn(numel, generator=g) * (rank + 1)
    x[:: 97] *= 50  # outliers: blocks of different scales
    return x


def _scenarios(rank: int, world_size: int, group: dist.ProcessGroup) -> dict:
    out: dict = {}
    for bits in (8, 4):
        x = _inputs(rank, world_size * SHARD, bits)
        reduced = quantized_reduce_scatter(x, bits=bits, block_size=BLOCK, group=group)
        out[f"rs{bits}"] = {"input": x.tolist(), "shard": reduced.shard.tolist(), "error": reduced.error.tolist(),
                            "finite": bool(reduced.finite), "sent": reduced.sent_by_collective}
        x = _inputs(rank, NUMEL, 100 + bits)
        result = quantized_allreduce(x, bits=bits, block_size=BLOCK, group=group)
        out[f"ar{bits}"] = {"input": x.tolist(), "values": result.values.tolist(),
                            "residual": result.residual.tolist(), "finite": bool(result.finite),
                            "sent": result.sent_by_collective}
    # a NaN in chunk 0 on the last rank: only rank 0's shard is non-finite in a reduce-scatter
    x = _inputs(rank, world_size * SHARD, 7)
    if rank == world_size - 1:
        x[5] = float("nan")
    out["rs_nan"] = bool(quantized_reduce_scatter(x, bits=8, block_size=BLOCK, group=group).finite)
    # ... and every rank's result in an AllReduce, wherever the bad value is
    for name, position, value in [("nan", 5, float("nan")), ("inf", NUMEL - 1, float("inf"))]:
        x = _inputs(rank, NUMEL, 8)
        if rank == world_size - 1:
            x[position] = value
        result = quantized_allreduce(x, bits=4, block_size=BLOCK, group=group)
        out[f"ar_{name}"] = bool(result.finite)
    # finite inputs whose sum overflows float32 on one owner
    x = _inputs(rank, NUMEL, 9)
    x[NUMEL // 2] = 3e38
    out["ar_overflow"] = bool(quantized_allreduce(x, bits=8, block_size=BLOCK, group=group).finite)
    return out


def _every_size(rank: int, world_size: int) -> dict:
    """One spawn for p = 2..4: subgroups of the first p ranks (every rank creates every group)."""
    groups = {size: dist.new_group(list(range(size))) for size in range(2, world_size + 1)}
    return {size: _scenarios(rank, size, group) for size, group in groups.items() if rank < size}


@pytest.fixture(scope="module")
def every_size() -> list[dict]:
    return run_workers(_every_size, 4, timeout=120)


def _ordered_sum(rows: list[torch.Tensor]) -> torch.Tensor:
    total = rows[0].clone()
    for row in rows[1:]:
        total += row
    return total


def _by_size(every_size: list[dict], p: int, name: str) -> list[dict]:
    return [every_size[rank][p][name] for rank in range(p)]


@pytest.mark.distributed
@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("bits", [8, 4])
def test_reduce_scatter_is_the_rank_order_sum_of_the_dequantized_chunks(every_size, p: int, bits: int) -> None:
    results = _by_size(every_size, p, f"rs{bits}")
    inputs = [torch.tensor(r["input"]).reshape(p, SHARD) for r in results]
    decoded = [_qd(x, bits) for x in inputs]  # what each rank sent, as every owner decodes it
    for owner, r in enumerate(results):
        shard = torch.tensor(r["shard"])
        assert torch.equal(shard, _ordered_sum([d[owner] for d in decoded]))  # bit for bit
        exact = sum(x[owner].double() for x in inputs)
        bound = sum(_scales(x[owner], bits) for x in inputs) / 2 + 1e-5 * exact.abs()  # + the float32 sum
        assert bool(((shard.double() - exact).abs() <= bound).all())
        assert torch.equal(torch.tensor(r["error"]), (inputs[owner] - decoded[owner]).reshape(-1))
        assert r["finite"]
        assert r["sent"] == {"reduce-scatter": (p - 1) * quantized_bytes(SHARD, bits, BLOCK)}
    if p == 4:  # the formula written out: 4 ceil(300/64) + 300 bits/8 bytes per peer
        assert results[0]["sent"]["reduce-scatter"] == 3 * (20 + 300 * bits // 8)


@pytest.mark.distributed
@pytest.mark.parametrize("p", [3, 4])
@pytest.mark.parametrize("bits", [8, 4])
def test_allreduce_is_identical_everywhere_and_error_feedback_telescopes(every_size, p: int, bits: int) -> None:
    results = _by_size(every_size, p, f"ar{bits}")
    for r in results[1:]:
        assert r["values"] == results[0]["values"]  # the same bits on every rank
    chunk = math.ceil(NUMEL / p)
    inputs = [torch.nn.functional.pad(torch.tensor(r["input"]), (0, p * chunk - NUMEL)).reshape(p, chunk)
              for r in results]
    decoded = [_qd(x, bits) for x in inputs]
    sums = torch.stack([_ordered_sum([d[owner] for d in decoded]) for owner in range(p)])
    applied = _qd(sums, bits).reshape(-1)[:NUMEL]
    values = torch.tensor(results[0]["values"])
    assert torch.equal(values, applied)
    assert all(r["finite"] for r in results)

    # EF: sum of residuals + applied == sum of inputs, up to the owners' float32 roundings only: of the
    # sum S (the same as any float32 AllReduce's) and of adding the carry to the owner's local error
    total_in = sum(torch.tensor(r["input"]).double() for r in results)
    total_residual = sum(torch.tensor(r["residual"]).double() for r in results)
    summation = (sums.double() - sum(d.double() for d in decoded)).reshape(-1)[:NUMEL]  # S - sum q, in float64
    owners = torch.cat([torch.tensor(results[j]["residual"])[j * chunk:(j + 1) * chunk] for j in range(p)])
    gap = (total_residual + values.double() - total_in - summation).abs()
    assert bool((gap <= 2.0**-24 * owners.double().abs() + 1e-12).all()), float(gap.max())
    magnitude = sum(d.double().abs() for d in decoded).reshape(-1)[:NUMEL]
    assert bool((summation.abs() <= (p - 1) * 2.0**-24 * magnitude).all())
    # without the owners' re-quantization error the residuals would not telescope
    local_only = sum((torch.tensor(r["input"]) - d.reshape(-1)[:NUMEL]).double() for r, d in zip(results, decoded))
    assert (local_only + values.double() - total_in).abs().max() > 1e-3

    # within the quantization bound of the exact sum: every source's half scale plus the owner's
    exact = sum(x.double() for x in inputs)
    bound = (sum(_scales(x, bits) for x in inputs) / 2 + _scales(sums, bits) / 2).reshape(-1)[:NUMEL]
    assert bool(((values.double() - exact.reshape(-1)[:NUMEL]).abs() <= bound + 1e-5 * magnitude).all())
    q = quantized_bytes(chunk, bits, BLOCK)
    for r in results:
        assert r["sent"] == {"reduce-scatter": (p - 1) * q, "allgather": (p - 1) * q}


@pytest.mark.distributed
@pytest.mark.parametrize("bits", [8, 4])
def test_two_ranks_swap_their_quantized_inputs_and_add_both_decodings(every_size, bits: int) -> None:
    """p = 2: one exchange of Q(n) bytes (no more than the two rounds' 2 Q(n/2)), nothing re-quantized:
    both ranks apply q_0 + q_1 bit for bit, each keeps its own quantization error, and the result
    is closer to the exact sum than the re-quantized AllGather's."""
    results = _by_size(every_size, 2, f"ar{bits}")
    inputs = [torch.tensor(r["input"]) for r in results]
    decoded = [_qd(x, bits) for x in inputs]
    values = torch.tensor(results[0]["values"])
    assert results[1]["values"] == results[0]["values"]
    assert torch.equal(values, decoded[0] + decoded[1]) and torch.equal(values, decoded[1] + decoded[0])
    for r, x, d in zip(results, inputs, decoded):
        assert torch.equal(torch.tensor(r["residual"]), x - d)
        assert r["finite"]
        assert r["sent"] == {"exchange": quantized_bytes(NUMEL, bits, BLOCK)}
    assert quantized_bytes(NUMEL, bits, BLOCK) <= 2 * quantized_bytes(math.ceil(NUMEL / 2), bits, BLOCK)
    # EF: residuals + applied = inputs, up to the rounding of the one float32 addition
    total_in = inputs[0].double() + inputs[1].double()
    gap = (sum(torch.tensor(r["residual"]).double() for r in results) + values.double() - total_in).abs()
    assert bool((gap <= 2.0**-24 * values.double().abs() + 1e-12).all()), float(gap.max())
    # against the two rounds (reduce-scatter, re-quantized AllGather) on the same inputs: less error
    chunk = math.ceil(NUMEL / 2)
    padded = [torch.nn.functional.pad(x, (0, 2 * chunk - NUMEL)).reshape(2, chunk) for x in inputs]
    sums = _ordered_sum([_qd(x, bits) for x in padded])
    two_rounds = _qd(sums, bits).reshape(-1)[:NUMEL]
    assert (values.double() - total_in).abs().sum() < (two_rounds.double() - total_in).abs().sum()


@pytest.mark.distributed
@pytest.mark.parametrize("p", [2, 3, 4])
def test_a_nonfinite_value_on_one_rank_reaches_every_rank(every_size, p: int) -> None:
    assert _by_size(every_size, p, "rs_nan") == [False] + [True] * (p - 1)  # only the owner of chunk 0
    for name in ("ar_nan", "ar_inf", "ar_overflow"):
        assert _by_size(every_size, p, name) == [False] * p, name


# ---------------------------------------------------------------------------------------- a dead peer

VICTIM = 2


def _dies(rank: int, world_size: int, when: str) -> dict:
    x = _inputs(rank, 4096, 0)
    quantized_allreduce(x, bits=4, block_size=BLOCK)  # a first exchange that works
    if rank == VICTIM:
        if when == "between calls":
            os.kill(os.getpid(), signal.SIGKILL)
        honest = quantized_module.dequantize

        def dequantize_then_die(*args, **kwargs):  # called right after the reduce-scatter's transfer
            os.kill(os.getpid(), signal.SIGKILL)
            return honest(*args, **kwargs)

        quantized_module.dequantize = dequantize_then_die
    start = time.monotonic()
    try:
        quantized_allreduce(x, bits=4, block_size=BLOCK)
    except CollectiveError as error:
        return {"error": str(error), "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


@pytest.mark.distributed
@pytest.mark.parametrize("when, collective", [("between calls", "reduce-scatter all_to_all_single"),
                                              ("mid-exchange", "allgather all_to_all_single")])
def test_a_dead_peer_makes_every_survivor_raise_within_seconds(when: str, collective: str) -> None:
    results, exit_codes = run_workers_some_die(_dies, 3, when, timeout=60, pg_timeout=30)
    assert exit_codes[VICTIM] == -signal.SIGKILL, exit_codes
    for rank in (0, 1):
        ok, report = results.get(rank, (False, "no report"))
        assert ok, f"rank {rank}: {report}"
        assert (report["error"] or "").startswith(f"quantized_allreduce: {collective} failed"), report
        assert report["seconds"] < 10, report  # the group's own timeout is 30 s
