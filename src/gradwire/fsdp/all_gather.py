"""A quantized parameter all-gather for FSDP2 (ZeRO++'s qwZ): ``compress(model, all_gather="int8")``.

FSDP2 all-gathers every module's parameters before its forward (and again before its backward
when it resharded after forward): per step each rank receives ``(p-1)/p`` of the float32
parameters once or twice, as much as or twice what the reduce-scatter sends. Compressing only the
reduce-scatter therefore leaves at least half of FSDP's traffic untouched (measured in
docs/fsdp.md). This all-gather sends each rank's shard as blockwise int8 (or int4) codes with
float32 scales per block of ``quantize_block`` values, blocks restarting at every parameter
(:func:`gradwire.exchange.blockquant.quantize` with ``segments``), and writes the dequantized
values of *every* rank's shard, its own included, into FSDP's unsharded buffer:

1. quantize this rank's shard (FSDP's ``input_tensor``, a view into ``output_tensor``);
2. exchange the codes (an ``all_to_all_single`` of them repeated for every peer, as
   :func:`gradwire.exchange.checked.allgather_tensor` does: every rank talks to every peer, so a
   dead peer fails each survivor's wait at once, within ``collective_timeout``). The call returns
   with the exchange in flight (:class:`PendingGather`); FSDP2 waits on it where it reads the
   parameters, and the wait runs steps 3 and 4;
3. dequantize every rank's codes in rank order into ``output_tensor``;
4. fold a balanced digest of the exchange into this rank's pending share
   (:meth:`AllGatherStats.take_share`): for each peer, a hash of the codes sent to it tagged
   (call, module, sender, receiver), and for each peer's codes received the same tagged hash of
   what arrived. The step's reduce-scatter round (its one agreement comes at the last module's
   reduction, after every gather of the step) XORs it into its balanced digest, so codes
   corrupted in flight — ranks that would compute with different parameters — make every rank
   raise ``DivergenceError`` at that step, before any optimizer step.

So every rank computes forward and backward with the same unsharded parameters, within half a
quantization step of the sharded ones; the optimizer steps on the exact float32 shards (FSDP's
sharded parameters are never written here), so the rounding does not accumulate across steps.
Gradients are taken at the rounded point, as in qwZ. A non-finite parameter makes its block NaN
on every rank alike (the reduce-scatter then fails or skips that step everywhere).

An input dtype other than float32/bfloat16/float16 (FSDP packs modules with mixed parameter
dtypes as uint8 bytes) is gathered exactly, with FSDP's own collective, and counted as such; so is
every gather of the exchange's warm-up (``compress(..., warmup_steps=N)``: the first N steps compute
with the exact parameters as well as reducing exact gradients). Under Adam, rounding from the first
step on can put a run behind for good (docs/fsdp.md, seed 1): int4 with a 100-step warm-up of the
reduce-scatter but the int8 all-gather from step 1 was 10% behind plain FSDP2 at step 800, where
the same warm-up with FSDP2's exact all-gather ended 0.2% ahead of it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

import xxhash

from ..exchange import blockquant
from ..errors import CollectiveError
from ..exchange.checked import allgather_tensor, time_limit, wait_checked
from ..lifetime import track

#: all_gather= choices -> bits
ALL_GATHER_BITS = {"int8": 8, "int4": 4}
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class AllGatherStats:
    """Bytes this rank sent in the parameter all-gathers, and what FSDP2's own would have sent."""

    bytes_sent: float = 0.0
    bytes_dense: float = 0.0
    calls: int = 0
    exact_calls: int = 0  # gathered exactly: inputs that were not floating point, and the warm-up's
    seconds: float = 0.0
    #: this rank's share of the balanced digest of the gathers since the last reduce-scatter round
    pending_share: int = 0

    def take_share(self) -> int:
        """The pending share, and reset it (a reduce-scatter round folds it into its digest)."""
        share, self.pending_share = self.pending_share, 0
        return share


def _tagged(hashed: int, tag: tuple[int, ...]) -> int:
    hasher = xxhash.xxh3_64()
    hasher.update(repr(tag).encode())
    hasher.update(hashed.to_bytes(8, "little", signed=False))
    return hasher.intdigest() & ((1 << 63) - 1)


def _hash_rows(rows: torch.Tensor) -> list[int]:
    """xxh3 of each row's bytes (uint8 rows, on the CPU or copied there)."""
    host = rows.detach().cpu().contiguous().numpy()
    return [xxhash.xxh3_64_intdigest(memoryview(row)) for row in host]


def received_codes(gathered: torch.Tensor, ranks: int) -> torch.Tensor:
    """The codes as they arrived, ``(p, Q)`` uint8, row r from rank r (what step 3 decodes and step 4
    hashes; one place where a test can change them in flight)."""
    return gathered.reshape(ranks, -1)


class QuantizedAllGather(AllGather):
    """FSDP2's ``AllGather`` for one module: ``comm(output, input, group, async_op)`` (module docstring).

    Args:
        segments: the module's per-parameter chunk lengths in FSDP's order (padded), summing to
            the input's numel; blocks restart at each.
        tag: tells the modules' gathers apart in the digest (the same on every rank).
        bits: 8 or 4.
        block_size: values per scale.
        timeout: seconds before a collective fails the call.
        stats: where bytes and seconds are counted (shared by a model's modules).
        exact_now: True while every call should gather exactly (the exchange's warm-up steps); the
            same answer on every rank at every call (it reads the rank-agreed step count).
        overlap: return the gather in flight (:class:`PendingGather`), for FSDP2 to complete where it
            reads the parameters; False: complete it inside the call.
    """

    def __init__(self, segments: Sequence[int], *, bits: int, block_size: int, timeout: float,
                 stats: AllGatherStats, tag: int = 0, exact_now: Callable[[], bool] = lambda: False,
                 overlap: bool = True) -> None:
        blockquant.check_options(bits, block_size)
        self.overlap = overlap
        self.exact_now = exact_now
        self.segments = list(segments)
        self.tag = tag
        self.bits, self.block_size, self.timeout, self.stats = bits, block_size, timeout, stats

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> Optional[dist.Work]:
        started = time.perf_counter()
        ranks = group.size()
        numel = input_tensor.numel()
        if output_tensor.numel() != ranks * numel:
            raise ValueError(f"gradwire.fsdp all-gather: output of {output_tensor.numel()} elements for "
                             f"{ranks} x {numel}")
        self.stats.calls += 1
        self.stats.bytes_dense += (ranks - 1) * numel * input_tensor.element_size()
        if input_tensor.dtype not in _FLOATS or sum(self.segments) != numel or self.exact_now():
            self._exact(output_tensor, input_tensor, group)
            self.stats.seconds += time.perf_counter() - started
            return CompletedWork() if async_op else None
        pending = self._start_quantized(output_tensor, input_tensor, group, ranks, numel)
        self.stats.seconds += time.perf_counter() - started
        if not self.overlap:
            pending.wait()
            return CompletedWork() if async_op else None
        return pending

    def _start_quantized(self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, ranks: int,
                         numel: int) -> "PendingGather":
        """Steps 1 and 2's start: the codes go out now; FSDP's copy-out waits (steps 2-4, :class:`PendingGather`)."""
        codes = blockquant.quantize(input.detach().float(), bits=self.bits, block_size=self.block_size,
                                    segments=self.segments)
        self.stats.bytes_sent += (ranks - 1) * codes.numel()
        gathered = torch.empty(ranks * codes.numel(), dtype=codes.dtype, device=codes.device)
        what = "gradwire.fsdp all-gather (quantized parameters)"
        try:
            work = dist.all_to_all_single(gathered, codes.reshape(-1).repeat(ranks), group=group, async_op=True)
        except RuntimeError as error:
            raise CollectiveError(f"{what}: all_to_all_single could not start: {error}") from error
        track(work)
        call, rank = self.stats.calls, group.rank()

        def finish() -> None:
            started = time.perf_counter()
            with time_limit(self.timeout):
                wait_checked(work, what, "all_to_all_single", keep=False)
            rows = received_codes(gathered, ranks)
            values = blockquant.dequantize(rows, numel, bits=self.bits, block_size=self.block_size,
                                           segments=self.segments)
            output.view(ranks, numel).copy_(values)  # own shard too: every rank computes with the same values
            self._fold_digest(codes, rows, rank, ranks, call)
            self.stats.seconds += time.perf_counter() - started

        return PendingGather(finish, work)

    def _fold_digest(self, codes: torch.Tensor, gathered: torch.Tensor, rank: int, ranks: int, call: int) -> None:
        """Step 4: this rank's share of the balanced digest (module docstring) of gather number ``call``."""
        hashes = _hash_rows(gathered)
        own = _hash_rows(codes.reshape(1, -1))[0]
        # the call's ordinal is in the tag: every rank gathers in the same order, and a module gathered
        # twice in a step (forward, then backward after a reshard) sends the same codes twice, whose
        # shares would cancel under XOR without it
        share = 0
        for peer in range(ranks):
            if peer != rank:
                share ^= _tagged(own, (2, call, self.tag, rank, peer)) ^ _tagged(hashes[peer],
                                                                                 (2, call, self.tag, peer, rank))
        self.stats.pending_share ^= share

    def _exact(self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup) -> None:
        self.stats.exact_calls += 1
        self.stats.bytes_sent += (group.size() - 1) * input.numel() * input.element_size()
        with time_limit(self.timeout):
            gathered = allgather_tensor(input.detach().clone(), group,
                                        what="gradwire.fsdp all-gather (exact)", collective="all_to_all_single")
        output.copy_(gathered.reshape(-1))


class CompletedWork(dist.Work):
    """What an ``async_op=True`` call returns: the exchange is over when the call returns (the
    reduce-scatter's rounds depend on each other and must agree before they write; the gather
    dequantizes after it), so the Work is done."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True


class PendingGather(dist.Work):
    """A quantized gather in flight, what :class:`QuantizedAllGather` returns whether or not FSDP asked
    for ``async_op``: FSDP2 keeps the returned ``Work`` and waits on it in its copy-out, right before
    it reads the unsharded parameters. So a gather FSDP prefetches (the previous module's, issued at
    each module's pre-backward) moves its codes while this module's backward computes, where a
    blocking call would hold the thread for the transfer. ``wait`` finishes the exchange once: waits
    within the timeout (``CollectiveError`` if a peer is dead), dequantizes into FSDP's output and
    folds the digest; the digest is taken at the step's last reduction, which comes after every
    copy-out of the step.
    """

    def __init__(self, finish: Callable[[], None], work: Any) -> None:
        super().__init__()
        self._finish: Optional[Callable[[], None]] = finish
        self._work = work

    def wait(self, timeout: Any = None) -> bool:
        finish, self._finish = self._finish, None  # once, even when it raises
        if finish is not None:
            finish()
        return True

    def is_completed(self) -> bool:
        return self._finish is None

    def is_success(self) -> bool:
        return self._finish is None
