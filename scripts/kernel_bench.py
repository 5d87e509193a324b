"""The native kernels (gradwire/_native.py) against the one-pass floor, on one thread.

    python scripts/kernel_bench.py [--numel N] [--candidates F] [--repeats R]

Prints ms per call (medians of R calls after one untimed): torch.add(a, b, out=c) (the floor),
compensate_scan with and without the threshold test, with the zeroing of the gradient, scan, and
the dense path's divide_and_hash (by 3, a division; by 4, a multiplication) next to torch's div_,
the error-feedback scatter add_at at the candidates' fraction of sorted random positions next to
torch's index_add_, and the threshold's strided sample (sample_magnitudes; the scattered rows with
the caches flushed before each call, as a step finds them), and the sparse AllReduce's merges of two
sets of that many sorted positions (sorted_members, union_add) next to torch's searchsorted and its
unique with index_add_, and the blockwise int8/int4 quantization (blocks of 128, segments of a few
thousand values as FSDP2's parameters cut a chunk) of the kernel against blockquant's torch path;
random normal float32 data, the
threshold at the (1 - F) quantile of |grad + residual|
(F = 0.015: top-k 1% and its sampled threshold's margin). Defaults: ResNet-18's 11,173,834 elements.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable, Optional

import numpy as np
import torch


def _median_ms(call: Callable[[], object], repeats: int, before: Optional[Callable[[], object]] = None) -> float:
    call()
    samples = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=11_173_834)
    parser.add_argument("--candidates", type=float, default=0.015, help="fraction at or above the threshold")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(1)
    try:
        from gradwire import _native
        from gradwire.sparsify.topk import sample_stride
    except ImportError:
        print("numba is not installed (pip install -e '.[fast]')", file=sys.stderr)
        return 2
    rng = np.random.default_rng(0)
    grad = rng.standard_normal(args.numel).astype(np.float32)
    residual = (rng.standard_normal(args.numel) * 0.3).astype(np.float32)
    out = np.empty_like(grad)
    limit = np.float32(np.quantile(np.abs(grad + residual)[::50], 1.0 - args.candidates))
    positions = np.empty(int(args.numel * args.candidates * 2) + 1024, dtype=np.int64)
    values = np.empty(positions.size, dtype=np.float32)
    a, b, c = torch.from_numpy(grad), torch.from_numpy(residual), torch.from_numpy(out)
    zeroed = grad.copy()
    words, lanes = out.view(np.uint32), np.zeros(_native.BLOCK, dtype=np.uint64)
    rows = [
        ("torch.add(a, b, out=c) (floor)", lambda: torch.add(a, b, out=c)),
        ("compensate_scan", lambda: _native.compensate_scan(grad, residual, out, limit, positions, values,
                                                            False, True)),
        ("compensate_scan, flags only", lambda: _native.compensate_scan(grad, residual, out, np.float32(np.inf),
                                                                        positions[:0], values[:0], False, False)),
        ("compensate_scan, zeroing the gradient", lambda: _native.compensate_scan(
            zeroed, residual, out, limit, positions, values, True, True)),  # zeros after the first call: no hits
        ("scan", lambda: _native.scan(out, limit, positions, values)),
        ("torch div_ (in place)", lambda: c.div_(1.0)),
        ("divide_and_hash, by 3 (a division)", lambda: _native.divide_and_hash(
            out, words, np.float32(3.0), np.float32(1 / 3), lanes, False)),
        ("divide_and_hash, by 4 (a multiplication)", lambda: _native.divide_and_hash(
            out, words, np.float32(4.0), np.float32(0.25), lanes, True)),
    ]
    flush = np.empty(4 * args.numel, dtype=np.float32)  # 4x the gradient's bytes: evicts it from every cache
    scattered = np.sort(rng.choice(args.numel, int(args.numel * args.candidates), replace=False)).astype(np.int64)
    sent = rng.standard_normal(scattered.size).astype(np.float32)
    target, where, what = torch.from_numpy(residual), torch.from_numpy(scattered), torch.from_numpy(sent)
    cold = [
        ("add_at (scatter, flushed)", lambda: _native.add_at(residual, scattered, sent, 1.0)),
        ("torch index_add_ (the same, flushed)", lambda: target.index_add_(0, where, what)),
    ]
    if hasattr(_native, "sample_magnitudes"):  # not in a tree before it (a worktree through PYTHONPATH)
        stride = sample_stride(args.numel)
        sample = np.empty(-(-args.numel // stride), dtype=np.float32)
        cold.append((f"sample_magnitudes ({sample.size:,}, flushed)",
                     lambda: _native.sample_magnitudes(grad, residual, True, stride, sample)))
    merges = []
    if hasattr(_native, "sorted_members"):  # the sparse AllReduce's merges of two sorted sets of positions
        other = np.sort(rng.choice(args.numel, scattered.size, replace=False)).astype(np.int64)
        flags, (mine, theirs) = np.empty(scattered.size, dtype=np.bool_), (where, torch.from_numpy(other))
        union_positions = np.empty(2 * scattered.size, dtype=np.int64)
        union_values = np.empty(2 * scattered.size, dtype=np.float32)

        def _searched() -> object:
            at = torch.searchsorted(theirs, mine).clamp(max=theirs.numel() - 1)
            return theirs[at] == mine

        def _sorted() -> object:
            union, inverse = torch.unique(torch.cat([mine, theirs]), return_inverse=True)
            return torch.zeros(union.numel()).index_add_(0, inverse, torch.cat([what, what]))

        merges = [
            ("sorted_members", lambda: _native.sorted_members(scattered, other, flags)),
            ("torch searchsorted + gather (the same)", _searched),
            ("union_add", lambda: _native.union_add(scattered, sent, other, sent, union_positions, union_values)),
            ("torch unique + index_add_ (the same)", _sorted),
        ]
    quantization = []
    if hasattr(_native, "block_quantize"):
        from gradwire import kernels
        from gradwire.exchange import blockquant

        length = 8192  # FSDP2-like segments (one per parameter), the last one whatever is left
        segments = [length] * (args.numel // length) + ([args.numel % length] if args.numel % length else [])
        flat = torch.from_numpy(grad)

        def _torch_path(call: Callable[[], object]) -> Callable[[], object]:
            def run() -> object:
                kernels._compiled, kernels._tried = None, True  # the torch path for this call
                try:
                    return call()
                finally:
                    kernels._compiled, kernels._tried = _native, True
            return run

        for bits in (8, 4):
            packed = blockquant.quantize(flat, bits=bits, block_size=128, segments=segments)
            trip = lambda bits=bits: blockquant.roundtrip(flat, bits=bits, block_size=128, segments=segments)  # noqa: E731
            back = lambda bits=bits, packed=packed: blockquant.dequantize(  # noqa: E731
                packed, args.numel, bits=bits, block_size=128, segments=segments)
            quantization += [(f"blockquant roundtrip int{bits}, kernel", trip),
                             (f"blockquant roundtrip int{bits}, torch", _torch_path(trip)),
                             (f"blockquant dequantize int{bits}, kernel", back),
                             (f"blockquant dequantize int{bits}, torch", _torch_path(back))]
    found = _native.compensate_scan(grad, residual, out, limit, positions, values, False, True)[0]
    print(f"{args.numel:,} float32, {found:,} at or above the threshold, 1 thread, medians of {args.repeats}")
    for name, call in rows:
        print(f"{name:40s} {_median_ms(call, args.repeats):7.2f} ms")
    print(f"{scattered.size:,} sorted positions scattered")
    for name, call in cold:
        print(f"{name:40s} {_median_ms(call, args.repeats, before=lambda: flush.fill(1.0)):7.2f} ms")
    if merges:
        print(f"two sets of {scattered.size:,} sorted positions merged")
    for name, call in merges:
        print(f"{name:40s} {_median_ms(call, args.repeats):7.2f} ms")
    if quantization:
        print("blockwise quantization of the whole tensor, segments of 8,192")
    for name, call in quantization:
        print(f"{name:40s} {_median_ms(call, args.repeats):7.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
