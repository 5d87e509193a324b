"""Peak memory per rank of FSDP2 training with and without gradwire's compressed reduce-scatter.

One setting per launch (fresh processes: peak resident memory is a high-water mark). Each rank
builds a byte-level GPT (``ByteGPT``; ``--d-model``, ``--layers``), ``fully_shard``s every block
and the root (``gradwire.harness.sharding.shard``), builds AdamW, then trains ``--steps`` steps on
random bytes. It reports, max over ranks: the resident set before the first step (model shards,
optimizer, libraries), the peak resident set after the steps (``ru_maxrss``), their difference (the
training step's memory: unsharded parameters and gradients in flight, sharded gradients, AdamW's
two moments, and gradwire's residuals and transients), and gradwire's residual bytes.

    torchrun --nproc-per-node 4 scripts/fsdp_memory.py --method plain
    torchrun --nproc-per-node 4 scripts/fsdp_memory.py --method quantize:bits=8 [--d-model 512 --layers 8]

``--method`` is ``plain`` (FSDP2's reduce-scatter) or a ``gradwire train`` method spec (e.g.
``quantize:bits=4,residuals=bfloat16`` or ``topk:density=0.1,values=fp16,indices=rice``; with
``warmup_steps=N,momentum=0.9`` the optimizer is ``gradwire.fsdp.MomentumAdamW`` and the bases'
bytes are reported too). Rank 0 prints one JSON line.

``--mmap-threshold BYTES`` fixes glibc's mmap threshold (``mallopt(M_MMAP_THRESHOLD)``, as the
``MALLOC_MMAP_THRESHOLD_`` environment variable does): every allocation of that size or more gets
its own mapping and is returned to the system when freed. With glibc's default, the threshold
rises to the size of the largest buffer freed so far, and later buffers of up to that size come
from the heap, whose freed space the resident set keeps: the peak then measures the heap's
high-water mark as much as what is live (docs/fsdp.md, "Peak memory per rank").
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time

import torch
import torch.distributed as dist


def _rss_mb() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _fix_mmap_threshold(threshold: int) -> None:
    """glibc's ``mallopt(M_MMAP_THRESHOLD, threshold)`` (which also stops its dynamic adjustment)."""
    import ctypes

    m_mmap_threshold = -3  # malloc.h
    if ctypes.CDLL("libc.so.6").mallopt(m_mmap_threshold, threshold) != 1:
        raise SystemExit(f"--mmap-threshold {threshold}: glibc's mallopt refused it")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--method", default="plain")
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--mmap-threshold", type=int, default=None,
                        help="fix glibc's mmap threshold at this many bytes (default: glibc's dynamic one)")
    args = parser.parse_args()
    if args.mmap_threshold is not None:
        _fix_mmap_threshold(args.mmap_threshold)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from gradwire.harness import sharding
    from gradwire.harness.methods import parse_method
    from gradwire.harness.models import build_model

    model = build_model("gpt", vocab_size=256, context=128, d_model=args.d_model, n_layers=args.layers,
                        n_heads=8, d_ff=4 * args.d_model, seed=0)
    parameters = sum(p.numel() for p in model.parameters())
    sharding.shard(model)
    state = None
    optimizer: torch.optim.Optimizer
    if args.method != "plain":
        import gradwire.fsdp

        state = gradwire.fsdp.compress(model, **parse_method(args.method).hook_options())
    if state is not None and state.momentum_bases is not None:  # 1-bit Adam's exchange
        optimizer = gradwire.fsdp.MomentumAdamW(model.parameters(), state, lr=1e-4)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(dist.get_rank())
    before = _rss_mb()
    started = time.perf_counter()
    for _ in range(args.steps):
        tokens = torch.randint(0, 256, (args.batch_size, 129), generator=generator)
        optimizer.zero_grad(set_to_none=True)
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1)).backward()
        optimizer.step()
    seconds = (time.perf_counter() - started) / args.steps
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux
    residual = state.residual_bytes() / 2**20 if state is not None else 0.0
    bases = 0.0
    if state is not None and state.momentum_bases is not None:
        bases = state.momentum_bases.nbytes() / 2**20
    mine = torch.tensor([before, peak, peak - before, residual, seconds, bases], dtype=torch.float64)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine, async_op=True).wait()
    worst = torch.stack(rows).amax(dim=0).tolist()
    if dist.get_rank() == 0:
        print(json.dumps({"method": args.method, "parameters": parameters, "world_size": dist.get_world_size(),
                          "d_model": args.d_model, "layers": args.layers, "steps": args.steps,
                          "rss_before_mb": round(worst[0], 1), "peak_rss_mb": round(worst[1], 1),
                          "step_memory_mb": round(worst[2], 1), "residual_mb": round(worst[3], 1),
                          "seconds_per_step": round(worst[4], 3), "momentum_bases_mb": round(worst[5], 1),
                          "mmap_threshold": args.mmap_threshold}),
              flush=True)
    dist.destroy_process_group()
    os._exit(0)  # PyTorch's exit abort after gloo collectives (pytorch PR #179291)


if __name__ == "__main__":
    main()
